"""Checkpoint files that are always whole.

A checkpoint is written to a temporary file beside its target, flushed to disk and renamed over
the target (``os.replace`` is atomic on POSIX), so a process killed mid-save leaves the previous
``last.ckpt`` intact. Loading uses ``weights_only=True``: no arbitrary objects are unpickled.
(The implementation lives with the strategies' checkpoint parts, so that every gradsync strategy
writes atomically under a plain ``L.Trainer`` too.)
"""

from __future__ import annotations

from gradsync.strategies.parts import AtomicCheckpointIO, atomic_torch_save, load_checkpoint_file, parts_dir

__all__ = ["AtomicCheckpointIO", "atomic_torch_save", "load_checkpoint_file", "parts_dir"]
