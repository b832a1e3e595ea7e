"""``gradsync sample``: generate text from a checkpoint of a text recipe (``chargpt``).

    gradsync sample --checkpoint runs/gpt                      # the run's checkpoints/last.ckpt
    gradsync sample --checkpoint runs/gpt/checkpoints/last.ckpt --prompt "def " --num-chars 500 \\
        --temperature 0.8 --top-k 20 --seed 1

The checkpoint names its model class (every gradsync recipe records it), so no recipe flag is
needed. Output goes to stdout: the prompt, then the generated characters.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any, NoReturn

from gradsync.errors import GradsyncError, OptionError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, through the CLI's error path
        raise GradsyncError(f"sample: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gradsync sample", description="Generate text from a checkpoint of a text recipe (chargpt).")
    p.add_argument("--checkpoint", required=True,
                   help="a .ckpt file, or a run's --output-dir (its checkpoints/last.ckpt)")
    p.add_argument("--prompt", default="", help="text to continue (default: start of a line)")
    p.add_argument("--num-chars", "--num_chars", dest="num_chars", type=int, default=500,
                   help="characters to generate (default 500)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="below 1: safer, above 1: more varied; 0: always the likeliest character (default 0.8)")
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=None,
                   help="sample only among the k likeliest characters (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    return p


def load_recipe(checkpoint: str | Path) -> Any:
    """The recipe model stored in ``checkpoint`` (a file or a run directory), on CPU, in eval mode."""
    from gradsync.platform.checkpoint import load_checkpoint_file

    path = Path(checkpoint)
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise GradsyncError(f"--checkpoint {checkpoint}: no checkpoint there (give a .ckpt file or a run's "
                            f"--output-dir)")
    ckpt = load_checkpoint_file(path)
    class_path = (ckpt.get("gradsync_recipe") or {}).get("model_class")
    if not class_path:
        raise GradsyncError(f"--checkpoint {path}: not written by a gradsync recipe (it names no model class)")
    module_name, _, cls_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        raise GradsyncError(f"--checkpoint {path}: cannot import its model class {class_path} ({exc})") from None
    model = cls(**dict(ckpt.get("hyper_parameters") or {}))
    model.on_load_checkpoint(ckpt)
    sharded = (ckpt.get("gradsync") or {}).get("sharded")
    if sharded:  # --strategy.shard node: the model is in the shards the processes wrote
        from gradsync.cli.export import consolidate

        model.load_state_dict(consolidate(path, sharded))
    else:
        model.load_state_dict(ckpt["state_dict"])
    return model.eval()


def cmd_sample(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model = load_recipe(args.checkpoint)
    if not hasattr(model, "sample"):
        raise GradsyncError(f"--checkpoint {args.checkpoint}: {type(model).__name__} does not generate text "
                            f"(only text recipes such as chargpt do)")
    try:
        text = model.sample(args.prompt, args.num_chars, temperature=args.temperature, top_k=args.top_k,
                            seed=args.seed)
    except OptionError as exc:
        raise GradsyncError(f"--{exc.option.replace('_', '-')} {exc.value}: {exc.rule}") from None
    print(args.prompt + text)
    return 0

