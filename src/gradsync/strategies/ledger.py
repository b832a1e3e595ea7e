"""The communication ledger: what every collective a strategy issues costs on the wire.

Byte counts follow the nccl-tests "bus bandwidth" convention: the bytes one rank sends under the
bandwidth-optimal algorithm for that collective.

==============  =====================  ==========================================
collective      bytes this rank sends  why
==============  =====================  ==========================================
all_reduce      2(N-1)/N * S           ring: reduce-scatter, then all-gather
reduce_scatter  (N-1)/N * S            each rank forwards N-1 of its N chunks
all_to_all      (N-1)/N * S            each rank keeps one of its N chunks
all_gather      (N-1) * s              ``s`` is this rank's part; it reaches N-1 peers
broadcast       S at the root, else 0  the root's data leaves it once
send            S                      point to point
==============  =====================  ==========================================

``logical_bytes`` is what a plain fp32 synchronous all-reduce of the same gradients would have sent
for the same optimizer steps, so ``compression_ratio = logical_bytes / wire_bytes`` compares any
strategy with synchronous DDP (1.0 for sync DDP itself).

Pure torch: no Lightning import, so codecs and tests can use it on their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
import torch.distributed as dist

Collective = Literal["all_reduce", "reduce_scatter", "all_to_all", "all_gather", "broadcast", "send"]
COLLECTIVES: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_to_all", "all_gather", "broadcast", "send")


def wire_bytes(collective: str, nbytes: int, world_size: int, *, is_root: bool = True) -> int:
    """Bytes this rank sends for one ``collective`` of ``nbytes`` among ``world_size`` ranks.

    ``nbytes`` is the full buffer size S, except for ``all_gather`` where it is this rank's part s.
    """
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if collective == "all_reduce":
        return (2 * (n - 1) * nbytes) // n
    if collective in ("reduce_scatter", "all_to_all"):
        return ((n - 1) * nbytes) // n
    if collective == "all_gather":
        return (n - 1) * nbytes
    if collective == "broadcast":
        return nbytes if (is_root and n > 1) else 0
    if collective == "send":
        return nbytes
    raise ValueError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")


def fp32_allreduce_bytes(numel: int, world_size: int) -> int:
    """What plain fp32 synchronous DDP sends for ``numel`` gradient entries: the logical baseline."""
    return wire_bytes("all_reduce", 4 * int(numel), world_size)


@dataclass
class CommLedger:
    """Per-rank running totals of communication. One ledger per strategy instance.

    ``seconds`` is the wall time from issuing a collective to its completion; for overlapped
    collectives it measures time in flight, not time the training loop waited.
    """

    world_size: int = 1
    wire_bytes: int = 0
    logical_bytes: int = 0
    seconds: float = 0.0
    collectives: int = 0
    by_collective: dict = field(default_factory=dict)

    # ---- recording -------------------------------------------------------------------------
    def record(self, collective: str, nbytes: int, *, seconds: float = 0.0, is_root: bool = True) -> int:
        """Account one collective of ``nbytes`` (see :func:`wire_bytes`); returns its wire bytes."""
        sent = wire_bytes(collective, nbytes, self.world_size, is_root=is_root)
        self.wire_bytes += sent
        self.seconds += float(seconds)
        self.collectives += 1
        entry = self.by_collective.setdefault(collective, {"count": 0, "wire_bytes": 0})
        entry["count"] += 1
        entry["wire_bytes"] += sent
        return sent

    def add_logical(self, nbytes: int) -> None:
        """Account what fp32 sync DDP would have sent for the gradients this step replaced."""
        self.logical_bytes += int(nbytes)

    def add_seconds(self, seconds: float) -> None:
        self.seconds += float(seconds)

    # ---- collectives that record themselves ----------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        group: Optional[dist.ProcessGroup] = None,
        op: dist.ReduceOp = dist.ReduceOp.SUM,
        async_op: bool = False,
    ):
        """``dist.all_reduce`` that records itself. With ``async_op`` returns a Future of the tensor."""
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_reduce", nbytes, lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a),
                         async_op, tensor)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *,
                               group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_gather", nbytes,
                         lambda a: dist.all_gather_into_tensor(output, tensor, group=group, async_op=a),
                         async_op, output)

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, *,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
        """All-gather into one tensor (``output`` holds every rank's ``tensor``, in rank order).

        ``dist.all_gather_single`` where torch has it (it replaces the deprecated
        ``all_gather_into_tensor``), else ``all_gather_into_tensor``. Records this rank's part.
        """
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_gather", nbytes, lambda a: gather(output, tensor, group=group, async_op=a),
                         async_op, output)

    def all_gather(self, outputs: list, tensor: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
                   async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_gather", nbytes, lambda a: dist.all_gather(outputs, tensor, group=group, async_op=a),
                         async_op, outputs)

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, *,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_to_all", nbytes,
                         lambda a: dist.all_to_all_single(output, tensor, group=group, async_op=a),
                         async_op, output)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, group: Optional[dist.ProcessGroup] = None,
                  async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        is_root = dist.get_rank() == src
        t0 = time.perf_counter()
        work = dist.broadcast(tensor, src=src, group=group, async_op=async_op)
        self.record("broadcast", nbytes, is_root=is_root)
        return self._finish(work, t0, async_op, tensor)

    def _run(self, collective, nbytes, issue, async_op, result):
        t0 = time.perf_counter()
        work = issue(async_op)
        self.record(collective, nbytes)
        return self._finish(work, t0, async_op, result)

    def _finish(self, work, t0, async_op, result):
        if not async_op:
            self.add_seconds(time.perf_counter() - t0)
            return result

        def done(fut):
            self.add_seconds(time.perf_counter() - t0)
            return result

        return work.get_future().then(done)

    # ---- reporting -------------------------------------------------------------------------
    @property
    def compression_ratio(self) -> float:
        if self.wire_bytes == 0:
            return 1.0 if self.logical_bytes == 0 else float("inf")
        return self.logical_bytes / self.wire_bytes

    def summary(self) -> dict:
        return {
            "wire_bytes": int(self.wire_bytes),
            "logical_bytes": int(self.logical_bytes),
            "compression_ratio": float(self.compression_ratio),
            "seconds": float(self.seconds),
            "collectives": int(self.collectives),
        }

    def state_dict(self) -> dict:
        return {**self.summary(), "by_collective": {k: dict(v) for k, v in self.by_collective.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.wire_bytes = int(state.get("wire_bytes", 0))
        self.logical_bytes = int(state.get("logical_bytes", 0))
        self.seconds = float(state.get("seconds", 0.0))
        self.collectives = int(state.get("collectives", 0))
        self.by_collective = {k: dict(v) for k, v in state.get("by_collective", {}).items()}
