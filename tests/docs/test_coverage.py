"""Every strategy, codec and recipe has a page or an API reference entry (commands: test_cli_reference.py)."""

import re
from pathlib import Path

from gradsync.recipes import RECIPES
from gradsync.strategies import STRATEGIES
from gradsync.comm import REDUCERS

DOCS = Path(__file__).resolve().parents[2] / "docs"
API = (DOCS / "reference" / "api.md").read_text()
DOCUMENTED = set(re.findall(r"^::: ([\w.]+)$", API, re.M))


def _documented(obj: object) -> bool:
    """The object itself, or its whole module, has a ``:::`` entry in the API reference."""
    return f"{obj.__module__}.{obj.__qualname__}" in DOCUMENTED or obj.__module__ in DOCUMENTED


def test_every_strategy_has_a_page_and_an_api_entry():
    for name, cls in STRATEGIES.items():
        assert (DOCS / "strategies" / f"{name.replace('_', '-')}.md").is_file(), f"no docs/strategies page for {name}"
        assert _documented(cls), f"{cls.__qualname__} is missing from docs/reference/api.md"


def test_every_codec_has_a_section_and_an_api_entry():
    headings = [line for line in (DOCS / "strategies" / "compressed.md").read_text().splitlines()
                if line.startswith("### ")]
    for name, reducer_cls in REDUCERS.items():
        assert any(f"`{name}`" in h for h in headings), f"codec {name} has no section in strategies/compressed.md"
        assert _documented(reducer_cls), f"codec {name} is missing from docs/reference/api.md"


def test_every_recipe_has_a_page_and_an_api_entry():
    for name, entry in RECIPES.items():
        assert (DOCS / "recipes" / f"{name}.md").is_file(), f"no docs/recipes page for {name}"
        assert _documented(entry.model) and _documented(entry.data), f"recipe {name} is missing from the API reference"


def test_api_entries_point_at_real_objects():
    import importlib

    for path in DOCUMENTED:
        try:
            importlib.import_module(path)
            continue
        except ImportError:
            module, _, attr = path.rpartition(".")
            assert hasattr(importlib.import_module(module), attr), f"docs/reference/api.md: ::: {path} does not exist"
