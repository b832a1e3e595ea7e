"""``gradsync export``: one plain ``state_dict`` of a run's model, for use outside gradsync.

    gradsync export runs/gpt                          # writes runs/gpt/model.pt
    gradsync export runs/gpt/checkpoints/last.ckpt --output gpt.pt

The file is a ``torch.save`` of the module's ``state_dict`` (tensors on CPU, no Lightning or
gradsync objects), loadable with ``torch.load(path, weights_only=True)`` into the unsharded module:
``model.load_state_dict(torch.load("model.pt", weights_only=True))``. It is written atomically. The
weights are those of the checkpoint: rank 0's, which every rank shares after a synchronization
(at the end of a fit, every strategy's last round or step leaves all ranks equal; a checkpoint taken
mid-period under ``local_sgd``/``diloco`` holds rank 0's local replica). A sharded run's checkpoint
(``--strategy.shard node``) is consolidated here, in one process, from the shards its processes wrote.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

import torch

from gradsync.errors import GradsyncError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, through the CLI's error path
        raise GradsyncError(f"export: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gradsync export", description="Write a run's model as one plain state_dict (torch.save).")
    p.add_argument("run", metavar="RUN_DIR|FILE", help="a run's --output-dir (its checkpoints/last.ckpt) or a .ckpt file")
    p.add_argument("--output", "-o", default=None, help="where to write it (default: RUN_DIR/model.pt)")
    return p


def checkpoint_and_run_dir(given: str) -> tuple[Path, Path]:
    path = Path(given)
    if path.is_dir():
        ckpt = path / "checkpoints" / "last.ckpt"
        run = path
    else:
        ckpt = path
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    if not ckpt.is_file():
        raise GradsyncError(f"export {given}: no checkpoint there (give a run's --output-dir or a .ckpt file)")
    return ckpt, run


def export(given: str, output: str | None = None) -> tuple[Path, dict]:
    """Write the model of ``given`` (run directory or checkpoint) to ``output``; returns (path, state_dict)."""
    from gradsync.platform.checkpoint import atomic_torch_save, load_checkpoint_file

    ckpt_path, run = checkpoint_and_run_dir(given)
    ckpt = load_checkpoint_file(ckpt_path)
    if "state_dict" not in ckpt:
        raise GradsyncError(f"export {ckpt_path}: not a Lightning checkpoint (it holds no state_dict)")
    sharded = (ckpt.get("gradsync") or {}).get("sharded")
    if sharded:
        state = consolidate(ckpt_path, sharded)
    else:
        state = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                 for k, v in ckpt["state_dict"].items()}
    out = Path(output) if output else run / "model.pt"
    atomic_torch_save(state, out)  # (creates the directory)
    return out, state


def consolidate(ckpt_path: Path, sharded: dict) -> dict:
    """The whole model of a sharded checkpoint (``--strategy.shard node``), read in this one process
    from the shards its processes wrote (torch.distributed.checkpoint; no process group needed).

    Each node writes its replica's shards into its own directory (``shards-<token>/node<k>``), so the
    directory of any one node is enough: node 0's replica where this directory holds it, else the first
    complete one it holds (replicas are equal after a synchronization; mid-period under local steps they
    are each node's own). Checkpoints of earlier gradsync versions (one folder across every node, saved
    per node under ``node<k>.`` keys) are read as they were written."""
    from gradsync.platform.checkpoint import parts_dir

    folder = parts_dir(ckpt_path) / sharded["shards"]
    if not folder.is_dir():
        raise GradsyncError(f"export {ckpt_path}: its shards {folder} are missing (copy the whole checkpoints directory)")
    if not sharded.get("node_dirs"):
        return _read_model(folder, ("node0." if sharded.get("per_node") else "") + "model.", ckpt_path)
    nodes = sorted((p for p in folder.glob("node*") if p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))
    complete = [p for p in nodes if (p / ".metadata").is_file()]
    if not complete:
        found = ", ".join(p.name for p in nodes) or "no node folder"
        raise GradsyncError(f"export {ckpt_path}: no complete replica under {folder} ({found}, none with its "
                            ".metadata); export from the --output-dir of a node that finished writing its checkpoint")
    return _read_model(complete[0], "model.", ckpt_path)


def _read_model(folder: Path, prefix: str, ckpt_path: Path) -> dict:
    """The tensors under ``prefix`` of the DCP checkpoint in ``folder``, whole, in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
        state = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
                 for key, meta in metadata.state_dict_metadata.items()
                 if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
        nested: dict = {}
        node = nested
        for part in prefix.rstrip(".").split("."):  # "node0.model." -> {"node0": {"model": state}}
            node[part] = {}
            parent, node = node, node[part]
        parent[part] = state
        dcp.load(nested, checkpoint_id=str(folder), no_dist=True)
    except GradsyncError:
        raise
    except Exception as exc:  # a shard file of another node, or a truncated one
        text = str(exc).strip().splitlines()
        raise GradsyncError(f"export {ckpt_path}: the shards under {folder} cannot be read "
                            f"({text[0][:300] if text else type(exc).__name__})") from None
    return state


def cmd_export(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out, state = export(args.run, args.output)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    size = sum(t.numel() * t.element_size() for t in tensors)
    print(f"wrote {out}: {len(tensors)} tensors, {sum(t.numel() for t in tensors):,} values, {size / 1e6:.1f} MB")
    return 0
