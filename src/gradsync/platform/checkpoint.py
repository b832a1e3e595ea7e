"""Checkpoint files that are always whole.

A checkpoint is written to a temporary file beside its target, flushed to disk and renamed over
the target (``os.replace`` is atomic on POSIX), so a process killed mid-save leaves the previous
``last.ckpt`` intact. Loading uses ``weights_only=True``: no arbitrary objects are unpickled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from gradsync.errors import GradsyncError
from gradsync.strategies.parts import atomic_torch_save, parts_dir

__all__ = ["AtomicCheckpointIO", "atomic_torch_save", "load_checkpoint_file", "parts_dir"]


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
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = "cpu", weights_only: Optional[bool] = None) -> dict:
        return load_checkpoint_file(path, map_location=map_location)
