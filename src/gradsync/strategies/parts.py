"""Per-rank parts of a checkpoint: each rank writes its own algorithm state next to the checkpoint.

A gradsync strategy's algorithm state differs per rank (error-feedback residuals, local parameters
mid-period, local optimizer state) and can be several times the model (DiLoCo keeps global
parameters and outer momentum too). Gathering it to rank 0 would send all of it across the slowest
link at every checkpoint, so instead every rank writes its part to a file of its own::

    checkpoints/last.ckpt                         rank 0: Lightning's checkpoint + the manifest
    checkpoints/last.ckpt.ranks/rank00000-<token>.pt
    checkpoints/last.ckpt.ranks/rank00001-<token>.pt ...

The *manifest* in ``last.ckpt`` (``checkpoint["gradsync"]``) names the token of the parts it
belongs to. A save is: rank 0 draws a fresh token and broadcasts it (8 bytes); every rank writes
its part atomically (temp file, fsync, rename); the ranks agree that every part is on disk (one
4-byte all-reduce); only then does rank 0 replace ``last.ckpt`` (atomically). A crash at any point
leaves the previous ``last.ckpt`` and the parts it names intact; parts no manifest can name any more
are removed at the next save. No rank needs another rank's part to resume on the same world size, so
on nodes without a shared file system each node keeps its own ranks' parts.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from gradsync.errors import GradsyncError

SUFFIX = ".ranks"
_PART = re.compile(r"^rank(\d+)-([0-9a-f]+)\.pt$")
_SHARDS = re.compile(r"^shards-([0-9a-f]+)$")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temp file beside ``path``, fsync, rename over it: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def parts_dir(checkpoint: str | os.PathLike) -> Path:
    return Path(str(checkpoint) + SUFFIX)


def part_path(checkpoint: str | os.PathLike, rank: int, token: str) -> Path:
    return parts_dir(checkpoint) / f"rank{rank:05d}-{token}.pt"


def shards_dir(checkpoint: str | os.PathLike, token: str) -> Path:
    """Where every process writes its shards of a sharded model (torch.distributed.checkpoint)."""
    return parts_dir(checkpoint) / f"shards-{token}"


def write_part(checkpoint: str | os.PathLike, rank: int, token: str, state: dict) -> Path:
    path = part_path(checkpoint, rank, token)
    atomic_torch_save(state, path)
    return path


def remove_stale_parts(checkpoint: str | os.PathLike, rank: int, keep: set[str], *, shards: bool = False) -> None:
    """Delete this rank's parts of ``checkpoint`` whose token is not in ``keep``, and with ``shards`` (one
    process of each machine: every node cleans its own directory) the older sharded models' folders."""
    folder = parts_dir(checkpoint)
    if not folder.is_dir():
        return
    for f in folder.iterdir():
        m = _PART.match(f.name)
        if m and int(m.group(1)) == rank and m.group(2) not in keep:
            f.unlink(missing_ok=True)
        old_shards = _SHARDS.match(f.name)
        if old_shards and shards and old_shards.group(1) not in keep:
            shutil.rmtree(f, ignore_errors=True)


def remove_parts(checkpoint: str | os.PathLike, rank: Optional[int] = None, *, shards: bool = False) -> None:
    """Delete the parts of a removed checkpoint (this rank's, or all of them)."""
    folder = parts_dir(checkpoint)
    if rank is None:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        remove_stale_parts(checkpoint, rank, keep=set(), shards=shards)


class SavedParts:
    """The per-rank parts a checkpoint's manifest names, read lazily (a rank reads only its own)."""

    def __init__(self, manifest: dict, checkpoint: Optional[str | os.PathLike]) -> None:
        self.manifest = manifest
        self.checkpoint = checkpoint
        self.world_size = int(manifest.get("world_size", 1))
        self._inline = manifest.get("ranks")  # checkpoints that held every part inline
        self._cache: dict[int, dict] = {}

    @property
    def token(self) -> Optional[str]:
        return self.manifest.get("token")

    def part(self, rank: int) -> dict:
        if self._inline is not None:
            return self._inline[rank]
        if rank not in self._cache:
            path = part_path(self.checkpoint, rank, self.token)
            if not path.is_file():
                raise GradsyncError(
                    f"--resume: {self.checkpoint} names per-rank state {path.name} of rank {rank}, which is missing "
                    f"under {path.parent}; resume on the machines that wrote it (each node keeps its own ranks' parts) "
                    "or copy the whole checkpoints directory")
            self._cache[rank] = torch.load(path, map_location="cpu", weights_only=True)
        return self._cache[rank]

    def all(self) -> list[dict]:
        return [self.part(r) for r in range(self.world_size)]


def read_parts(checkpoint: str | os.PathLike) -> list[dict]:
    """Every rank's algorithm state of a gradsync checkpoint file, in rank order."""
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    manifest = ckpt.get("gradsync")
    if not manifest:
        raise GradsyncError(f"{checkpoint} holds no gradsync algorithm state")
    return SavedParts(manifest, checkpoint).all()


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load a checkpoint safely; an unreadable file is a one-line :class:`GradsyncError`."""
    path = Path(path)
    if not path.is_file():
        raise GradsyncError(f"--resume: checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GradsyncError(f"--resume: checkpoint {path} is corrupt or not a checkpoint ({reason[:160]})") from None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO that writes atomically and loads with ``weights_only``."""

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Optional[Any] = None) -> None:
        shards = [k for k, v in checkpoint.items() if type(v).__name__ == "DTensor"]
        if shards:
            # Lightning's fork/spawn launchers hand rank 0's module state to the main process; a sharded
            # module's is a shard, which the main process's full module cannot take
            import warnings

            warnings.warn("shard node: the launching process keeps its module's initial weights (each process held a "
                          "shard); the trained model is in the checkpoint (`gradsync export` writes it whole)",
                          stacklevel=2)
            checkpoint = {k: v for k, v in checkpoint.items() if k not in shards}
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = "cpu", weights_only: Optional[bool] = None) -> dict:
        return load_checkpoint_file(path, map_location=map_location)
