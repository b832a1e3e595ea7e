"""What one process holds: parameter, gradient, optimizer-state and algorithm-state bytes.

Counted from the tensors' storage, not from the process's resident memory (which also holds
activations, the allocator's cache, libraries and data): each storage once, however many tensors
view it, and for a sharded (DTensor) parameter only this process's shard. These are the figures
the memory arithmetic of data parallelism is about — 4 bytes per parameter for fp32 weights, 4
for their gradients, 8 for AdamW's two moments (16 in all, replicated on every process) — and the
ones sharding divides.

``summary.json`` ``memory`` holds this process's figures (rank 0's, every process of a replicated
run holds the same) and the largest total over all processes.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from lightning.pytorch.callbacks import Callback

from gradsync.algorithms.layout import local_part

KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "algorithm_state_bytes")


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped; a DTensor counts its
    local shard)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = local_part(t.detach())  # a DTensor: this process's shard
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = max(seen.get((t.device, storage.data_ptr()), 0), storage.nbytes())
    return sum(seen.values())


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    return tensor_bytes(t for opt in optimizers for t in _tensors(list(opt.state.values())))


class MemoryProbe(Callback):
    """Records the largest parameter, gradient and optimizer-state bytes of this process over the run
    (gradients just before each optimizer step, where they are whole; states after it, where they exist)."""

    def __init__(self) -> None:
        self.figures = dict.fromkeys(KINDS, 0)

    def _keep(self, kind: str, value: int) -> None:
        self.figures[kind] = max(self.figures[kind], value)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._keep("gradient_bytes", tensor_bytes(p.grad for p in pl_module.parameters()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._keep("parameter_bytes", tensor_bytes(pl_module.parameters()))
        self._keep("optimizer_state_bytes", optimizer_state_bytes(trainer.optimizers))

    def summary(self, trainer, pl_module, algorithm_state: Optional[dict] = None) -> dict:
        """This process's figures (the parameters counted again now, the algorithm's state from
        ``algorithm_state``), and the largest total over all processes (a collective: every rank calls it)."""
        import torch.distributed as dist

        self._keep("parameter_bytes", tensor_bytes(pl_module.parameters()))
        if algorithm_state is not None:
            self._keep("algorithm_state_bytes", tensor_bytes(_tensors(algorithm_state)))
        out = dict(self.figures)
        out["total_bytes"] = sum(out[k] for k in KINDS)
        out["max_total_bytes_any_process"] = out["total_bytes"]
        # the process's peak resident memory (activations, transient all-gathered layers, the allocator,
        # libraries): what the machine must hold, next to the tensor figures sharding divides
        out["max_peak_rss_bytes_any_process"] = peak_rss_bytes()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            backend_device = torch.device("cuda", torch.cuda.current_device()) \
                if dist.get_backend() == "nccl" else torch.device("cpu")
            peaks = torch.tensor([out["total_bytes"], out["max_peak_rss_bytes_any_process"]], dtype=torch.float64,
                                 device=backend_device)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
            out["max_total_bytes_any_process"] = int(peaks[0].item())
            out["max_peak_rss_bytes_any_process"] = int(peaks[1].item())
        return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB, macOS bytes; 0 where unknown)."""
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return 0
