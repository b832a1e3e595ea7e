"""The CLI reference page, generated from the ``gradsync`` command itself.

Nothing here restates a flag: every table row comes from the parser that ``gradsync fit`` builds
(:func:`gradsync.cli.main.build_parser`) and every other command's section is that command's own
``--help`` output. A flag added to the CLI therefore appears in the docs at the next build.

Two ways to run it:

* as an mkdocs hook (``hooks:`` in mkdocs.yml): ``mkdocs build`` adds ``reference/cli.md`` to the
  site, generated fresh, so the page can never go stale;
* as a script, to read the page without building the site::

      python scripts/cli_reference.py              # to stdout
      python scripts/cli_reference.py -o cli.md
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

PAGE = "reference/cli.md"
DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"
DEFAULT_RECIPE = "digits"
DEFAULT_STRATEGY = "sync"

# Parser entries that are not flags a user types: jsonargparse's per-group "load a config file"
# actions (``--model`` etc. are selector flags in gradsync, see ``_rewrite``) and its help action.
_SKIP_DESTS = {"help", "model", "data", "strategy"}


# ---- formatting -----------------------------------------------------------------------------
def _cell(text: Any) -> str:
    """One markdown table cell: one line, ``rst`` literals as markdown code, pipes escaped."""
    text = " ".join(str(text).split())
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r":(?:class|func|meth|attr|mod|paramref):`~?([^`]+)`", r"`\1`", text)
    return text.replace("|", "\\|")


def _type_name(hint: Any) -> str:
    if hint is None:
        return ""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is typing.Union:
        parts = [_type_name(a) for a in args if a is not type(None)]
        suffix = " \\| `None`" if type(None) in args else ""
        return " \\| ".join(parts) + suffix
    if origin is not None:
        inner = ", ".join(_type_name(a).strip("`") for a in args)
        return f"`{getattr(origin, '__name__', str(origin))}[{inner}]`"
    return f"`{getattr(hint, '__name__', str(hint).replace('typing.', ''))}`"


def _default(value: Any) -> str:
    if value is None or value == "==SUPPRESS==":
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


# ---- what the parser holds ------------------------------------------------------------------
def _selector_flags() -> dict[str, str]:
    """Parser option -> the short flag users type (``--strategy.name`` is typed ``--strategy NAME``)."""
    from gradsync.cli.main import _rewrite

    out = {}
    for flag, metavar in (("--strategy", "NAME"), ("--model", "CLASS"), ("--data", "CLASS")):
        out[_rewrite([flag, "x"])[0]] = f"{flag} {metavar}"
    return out


def _actions(parser: Any) -> list[Any]:
    return [a for a in parser._actions if a.dest not in _SKIP_DESTS and a.option_strings]


def _rows(actions: Iterable[Any], selectors: dict[str, str]) -> list[str]:
    rows = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    for a in actions:
        primary = a.option_strings[0]
        spelled = [selectors.get(primary, primary)] + [o for o in a.option_strings[1:] if not o.endswith("+")]
        flag = "<br>".join(f"`{s}`" for s in spelled)
        hint = getattr(a, "_typehint", None)
        kind = "flag" if a.nargs == 0 else _type_name(hint)
        rows.append(f"| {flag} | {kind} | {_default(a.default) if a.nargs != 0 else ''} | {_cell(a.help or '')} |")
    return rows


def _parser(command: str, recipe: str, strategy: str) -> Any:
    from gradsync.cli.main import build_parser

    parser, _, _ = build_parser(command, {"recipe": recipe, "strategy": strategy, "model_class": None,
                                          "data_class": None})
    return parser


def _help_of(run: Callable[[], Any]) -> str:
    """What a command prints for ``--help`` (argparse exits after printing)."""
    buf = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width; the page should not depend on it
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            run()
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return buf.getvalue().rstrip()


# ---- the page -------------------------------------------------------------------------------
def _page_link(docs_dir: Path, folder: str, name: str) -> str:
    """`` ([page](../folder/name.md))`` when the docs have a page for ``name``, else nothing."""
    for stem in (name.replace("_", "-"), name):
        if (docs_dir / folder / f"{stem}.md").is_file():
            return f" — [{folder[:-1]} page](../{folder}/{stem}.md)"
    return ""


def render(docs_dir: Optional[Path] = None) -> str:
    """The whole page, as markdown. ``docs_dir`` is where to look for strategy and recipe pages to link."""
    from gradsync.cli import main as cli
    from gradsync.recipes import RECIPES
    from gradsync.strategies import STRATEGIES, GradsyncStrategy

    docs_dir = Path(docs_dir) if docs_dir is not None else DOCS_DIR
    selectors = _selector_flags()
    base = _parser("fit", DEFAULT_RECIPE, DEFAULT_STRATEGY)
    from gradsync.platform.trainer_args import OWNED, trainer_parameter_names

    trainer_names = set(trainer_parameter_names()) - set(OWNED)
    trainer_actions = [a for a in _actions(base) if a.dest in trainer_names]
    run_actions = [a for a in _actions(base) if (not a.dest.startswith(("model.", "data.", "strategy."))
                   or a.dest == "strategy.name") and a.dest not in trainer_names
                   and a.dest.split(".")[0] not in trainer_names]
    base_options = set(_option_names(GradsyncStrategy))

    out = [
        "# CLI reference",
        "",
        "!!! info \"Generated\"",
        "    This page is generated from the `gradsync` command itself each time the site is built",
        "    (`scripts/cli_reference.py`, an mkdocs hook): the tables are read from the parser that",
        "    `gradsync fit` builds, the other sections are each command's own `--help`. Run",
        "    `python scripts/cli_reference.py` to print it without building the site.",
        "",
        "```text",
        cli.USAGE,
        "```",
        "",
        "## `gradsync fit`, `validate`, `test`",
        "",
        "The three commands take the same flags: `fit` trains, `validate` and `test` evaluate a model",
        "(usually with `--resume CHECKPOINT`). Flags may be spelled with `-` or `_` where both are",
        "listed; `--config FILE` loads YAML (as `--print_config` writes it); precedence is",
        "flag > `--config` > default. `--help` prints the flags of the chosen recipe and strategy.",
        "",
        "### Run flags",
        "",
        *_rows(run_actions, selectors),
        "",
        "### Trainer flags",
        "",
        "Every other argument of `lightning.pytorch.Trainer`, read from its signature (a Lightning release",
        "that adds an argument adds a flag), with Lightning's meaning and type. The arguments",
        f"{', '.join(f'`{n}`' for n in OWNED)} are set by the run flags above",
        f"({', '.join(f'`{flag}`' for flag in dict.fromkeys(OWNED.values()))}). A `bool` flag given alone",
        "means `true` (`--sync-batchnorm`); `--callbacks+ module.Class` adds a callback and",
        "`--profiler`, `--plugins` take a name or a class path, as in LightningCLI.",
        "",
        *_rows(trainer_actions, selectors),
        "",
        "### Shorthands",
        "",
        "| flag | same as |",
        "|---|---|",
        *[f"| `{flag}` | `--{comp}.{opt}` |" for flag, (comp, opt) in cli.ALIASES.items()],
        "",
        "### Strategy options",
        "",
        "`--strategy NAME` chooses one of the gradsync strategies below (or a stock Lightning strategy",
        "such as `ddp`, which takes no `--strategy.*` options); `--strategy.<option>` sets its",
        "constructor arguments. Each strategy has a page under *Strategies* and an entry in the",
        "[Python API](api.md).",
        "",
        "#### Every gradsync strategy",
        "",
        f"Options of `{GradsyncStrategy.__module__}.GradsyncStrategy`, accepted by every strategy below.",
        "",
        *_rows([a for a in _actions(base) if a.dest.startswith("strategy.") and a.dest[9:] in base_options],
               selectors),
        "",
    ]
    for name, cls in STRATEGIES.items():
        parser = base if name == DEFAULT_STRATEGY else _parser("fit", DEFAULT_RECIPE, name)
        own = [a for a in _actions(parser) if a.dest.startswith("strategy.") and a.dest[9:] not in base_options
               and a.dest != "strategy.name"]
        out += [f"#### `--strategy {name}`", "", _cell(cls.describe()) + f" (`{cls.__module__}.{cls.__name__}`)"
                + _page_link(docs_dir, "strategies", name), ""]
        out += _rows(own, selectors) if own else ["No options besides those of every gradsync strategy."]
        out.append("")
    out += [
        "### Recipe options",
        "",
        "`--recipe NAME` chooses the model and data; `--model.<option>` and `--data.<option>` set their",
        "constructor arguments. With `--model CLASS --data CLASS` (your own classes) the flags are read",
        "from your constructors in the same way.",
        "",
    ]
    for name, entry in RECIPES.items():
        parser = base if name == DEFAULT_RECIPE else _parser("fit", name, DEFAULT_STRATEGY)
        own = [a for a in _actions(parser) if a.dest.startswith(("model.", "data."))]
        out += [f"#### `--recipe {name}`", "",
                _cell(entry.description) + f" (`{entry.model.__module__}.{entry.model.__name__}`, "
                f"`{entry.data.__module__}.{entry.data.__name__}`)" + _page_link(docs_dir, "recipes", name), ""]
        out += _rows(own, selectors)
        out.append("")
    out += _other_commands()
    return "\n".join(out).rstrip() + "\n"


def _option_names(cls: type) -> list[str]:
    import inspect

    return [n for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY]


def _other_commands() -> list[str]:
    from gradsync.cli.doctor import main as doctor
    from gradsync.cli.export import build_parser as export_parser
    from gradsync.cli.lighthouse import parser as lighthouse_parser
    from gradsync.cli.sample import build_parser as sample_parser
    from gradsync.platform.compare import cmd_compare

    sections = [
        ("list", "Lists the recipes and strategies (`--recipe` and `--strategy` names) with one line each. "
                 "It takes no flags.", None),
        ("doctor", "Versions, devices, NCCL/gloo availability, the relevant environment (secrets redacted) "
                   "and an all-reduce check across the launched processes; see "
                   "[multi-node training](../guides/multi-node.md).", lambda: doctor(["--help"])),
        ("compare", "A side-by-side table (and plots) of finished runs' `summary.json`.",
         lambda: cmd_compare(["--help"])),
        ("sample", "Text from a `chargpt` checkpoint.", lambda: sample_parser().print_help()),
        ("export", "The run's model as one plain `state_dict` (`torch.save`, tensors on CPU, written atomically) "
                   "that loads into the unsharded module with `torch.load(path, weights_only=True)`: rank 0's "
                   "weights from the checkpoint, which every rank shares after a synchronization.",
         lambda: export_parser().print_help()),
        ("lighthouse", "torchft's lighthouse, where the replica groups of `--fault-tolerance torchft` form a quorum "
                       "before every round (the `ft` extra); see [fault tolerance](../guides/fault-tolerance.md).",
         lambda: lighthouse_parser().print_help()),
    ]
    out: list[str] = []
    for name, what, show_help in sections:
        out += [f"## `gradsync {name}`", "", what, ""]
        if show_help is not None:
            out += ["```text", _help_of(show_help), "```", ""]
    return out


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated page (replacing a checked-in copy, if any)."""
    from mkdocs.structure.files import File

    existing = files.get_file_from_path(PAGE)
    if existing is not None:
        files.remove(existing)
    files.append(File.generated(config, PAGE, content=render(Path(config["docs_dir"]))))
    return files


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Print the gradsync CLI reference (markdown).")
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    args = parser.parse_args(argv)
    text = render()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
