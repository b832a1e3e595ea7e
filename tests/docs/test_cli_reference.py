"""The CLI reference page is generated from the CLI and misses no command, strategy, recipe or flag.

mkdocs runs scripts/cli_reference.py as a hook at every build, so the built page cannot go stale. A
copy is also checked in as docs/reference/cli.md, so that the pages linking to it work in the
repository too (on GitHub, in an editor); a test keeps that copy equal to what the generator prints.
The other tests make sure the generator itself keeps up with the parser (a flag added in a way the
generator does not read would otherwise vanish from the docs silently).
"""

import difflib
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from gradsync.cli.main import COMMANDS, build_parser
from gradsync.recipes import RECIPES
from gradsync.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(generator):
    return generator.render()


def _flags_in(page: str) -> set:
    return set(re.findall(r"`(--[A-Za-z0-9_.+-]+)", page))


def test_every_flag_of_every_strategy_and_recipe_is_listed(generator, page):
    listed = _flags_in(page)
    typed_as = generator._selector_flags()  # --strategy.name is typed `--strategy NAME`
    parsers = [build_parser("fit", {"recipe": "digits", "strategy": s, "model_class": None, "data_class": None})[0]
               for s in STRATEGIES]
    parsers += [build_parser("fit", {"recipe": r, "strategy": "sync", "model_class": None, "data_class": None})[0]
                for r in RECIPES]
    missing = set()
    for parser in parsers:
        for action in parser._actions:
            if action.dest in ("help", "model", "data", "strategy"):
                continue  # --help; jsonargparse's per-group config loaders, which gradsync's selectors replace
            typed = {o for o in action.option_strings if not o.endswith("+")}
            if not typed & listed and not any(f"`{typed_as.get(o)}`" in page for o in typed):
                missing |= typed
    assert not missing, f"flags missing from the CLI reference: {sorted(missing)}"


def test_every_command_strategy_and_recipe_has_a_section(page):
    for command in (*COMMANDS, "list", "doctor", "compare", "sample"):
        assert f"`gradsync {command}`" in page or f"`{command}`" in page, command
    for name in STRATEGIES:
        assert f"#### `--strategy {name}`" in page
    for name in RECIPES:
        assert f"#### `--recipe {name}`" in page
    assert "--size-mb" in page and "--num-chars" in page  # argparse commands' own --help is included
    assert "| `--lr` | `--model.lr` |" in page


def test_the_site_generates_the_page_at_build_time():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    assert "scripts/cli_reference.py" in config["hooks"]
    assert "reference/cli.md" in yaml.safe_dump(config["nav"])


def test_the_checked_in_page_is_what_the_generator_prints(generator, page):
    path = ROOT / "docs" / generator.PAGE
    fix = f"regenerate it with `python scripts/cli_reference.py -o docs/{generator.PAGE}` (or `make docs`)"
    assert path.is_file(), f"docs/{generator.PAGE} is missing; {fix}"
    diff = list(difflib.unified_diff(path.read_text().splitlines(), page.splitlines(), "checked in", "generated",
                                     lineterm="", n=1))
    assert not diff, f"docs/{generator.PAGE} is out of date with the CLI; {fix}:\n" + "\n".join(diff[:40])
