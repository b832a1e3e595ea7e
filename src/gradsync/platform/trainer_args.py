"""Every ``L.Trainer`` argument as a ``gradsync fit`` flag, read from Lightning's own signature.

``--precision bf16-mixed``, ``--gradient-clip-val 1.0``, ``--sync-batchnorm`` ... reach the Trainer
exactly as ``L.Trainer(precision=..., ...)`` would: the flags, their types, defaults and help come
from ``L.Trainer.__init__`` (jsonargparse reads it as LightningCLI does), so a Lightning release that
adds an argument adds a flag. Each flag is spelled with ``_`` and with ``-``.

A few arguments are set from gradsync's own flags of the same meaning and are not repeated here
(:data:`OWNED`); a few others get gradsync's default (:data:`GRADSYNC_DEFAULTS`) or are derived from
another flag unless given (:data:`DERIVED`).
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any

#: Trainer arguments that gradsync's own flags set: argument -> the flag that sets it.
OWNED = {
    "accelerator": "--accelerator", "strategy": "--strategy", "devices": "--devices", "num_nodes": "--num-nodes",
    "max_steps": "--max-steps", "max_epochs": "--max-epochs", "logger": "--logger",
    "default_root_dir": "--output-dir",
}

#: Where gradsync's default differs from Lightning's (a run prints its own progress and summary).
GRADSYNC_DEFAULTS = {"num_sanity_val_steps": 0, "log_every_n_steps": 1, "enable_model_summary": False}

#: Arguments that gradsync derives from another flag when they are not given (default None here).
DERIVED = {
    "accumulate_grad_batches": "--global-batch-size / (batch size x processes), else 1",
    "val_check_interval": "--val-every x accumulation, else Lightning's (once per epoch)",
    "use_distributed_sampler": "false for a DataModule that declares `shards_itself = True` (the recipes), "
                               "else true",
    "enable_checkpointing": "true with --output-dir (checkpoints/last.ckpt), else false",
}


@lru_cache(maxsize=1)
def trainer_parameter_names() -> tuple[str, ...]:
    """The names of ``L.Trainer.__init__``'s arguments, read from Lightning's source without importing
    it (the CLI checks flag names in a fraction of a second; importing Lightning takes seconds)."""
    spec = importlib.util.find_spec("lightning")
    if spec is None or not spec.submodule_search_locations:
        return ()
    source = Path(list(spec.submodule_search_locations)[0]) / "pytorch" / "trainer" / "trainer.py"
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    return tuple(a.arg for a in [*args.args, *args.kwonlyargs] if a.arg != "self")
    return ()


def flag_names() -> dict[str, str]:
    """Flag spelling (``--gradient_clip_val`` and ``--gradient-clip-val``) -> Trainer argument."""
    out: dict[str, str] = {}
    for name in trainer_parameter_names():
        if name not in OWNED:
            out[f"--{name}"] = name
            out[f"--{name.replace('_', '-')}"] = name
    return out


def add_trainer_arguments(parser: Any) -> list[str]:
    """Add every Trainer argument but :data:`OWNED` to a jsonargparse parser, at the top level;
    returns the argument names."""
    import lightning as L

    added = parser.add_class_arguments(L.Trainer, None, skip=set(OWNED), fail_untyped=False, instantiate=False)
    parser.set_defaults(**GRADSYNC_DEFAULTS, **{name: None for name in DERIVED})
    for action in list(parser._actions):
        if action.dest not in added:
            continue
        if action.dest in DERIVED:
            action.help = f"{action.help or ''} gradsync: when not given, {DERIVED[action.dest]}."
        elif action.dest in GRADSYNC_DEFAULTS:
            action.help = f"{action.help or ''} gradsync's default: {GRADSYNC_DEFAULTS[action.dest]!r}."
        for option in list(action.option_strings):
            dashed = option.replace("_", "-")
            if option.startswith("--") and dashed != option and dashed not in parser._option_string_actions:
                action.option_strings.append(dashed)
                parser._option_string_actions[dashed] = action
    return list(added)


def defaults() -> dict:
    """Each Trainer flag's default: Lightning's, or gradsync's (:data:`GRADSYNC_DEFAULTS`, :data:`DERIVED`)."""
    import inspect

    import lightning as L

    out = {n: p.default for n, p in inspect.signature(L.Trainer.__init__).parameters.items()
           if n != "self" and n not in OWNED}
    return {**out, **GRADSYNC_DEFAULTS, **{name: None for name in DERIVED}}


def changed(options: dict) -> dict:
    """The Trainer arguments of ``options`` that differ from their defaults (what the user set)."""
    base = defaults()
    return {k: v for k, v in (options or {}).items() if k in base and v != base[k]}


def bool_flags() -> set[str]:
    """Trainer arguments typed ``bool`` (or ``Optional[bool]``): ``--sync-batchnorm`` alone means
    ``--sync-batchnorm true``."""
    import inspect
    from typing import Optional

    import lightning as L

    return {n for n, p in inspect.signature(L.Trainer.__init__).parameters.items()
            if p.annotation in (bool, Optional[bool]) and n not in OWNED}


def instantiate(options: dict) -> dict:
    """The Trainer arguments with their ``class_path`` values (``--callbacks+ pkg.MyCallback``,
    ``--profiler pkg.MyProfiler``, ``--plugins ...``) built, as jsonargparse builds them for LightningCLI."""
    import copy
    import inspect

    import lightning as L
    from jsonargparse import ArgumentParser

    def has_class_path(value: Any) -> bool:
        if isinstance(value, dict):
            return "class_path" in value
        return isinstance(value, list) and any(has_class_path(v) for v in value)

    params = inspect.signature(L.Trainer.__init__).parameters
    out = dict(options)
    for name, value in options.items():
        if has_class_path(value):
            parser = ArgumentParser(exit_on_error=False)
            parser.add_argument(f"--{name}", type=params[name].annotation)
            cfg = parser.parse_object({name: copy.deepcopy(value)})  # jsonargparse rewrites what it is given
            out[name] = parser.instantiate_classes(cfg)[name]
    return out
