"""``sync``: synchronous data parallel (DDP) with a communication ledger."""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.ledger import CommLedger, fp32_allreduce_bytes


@dataclass
class AllReduceState:
    """State of :func:`allreduce_hook`: where to record bytes and which group to use."""

    ledger: CommLedger
    group: Optional[dist.ProcessGroup] = None


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket across ranks with one all-reduce, and record it in the ledger.

    Numerically the same as DDP's built-in reduction (divide by N, then sum).
    """
    tensor = bucket.buffer()
    world = dist.get_world_size(state.group)
    state.ledger.add_logical(fp32_allreduce_bytes(tensor.numel(), world))
    tensor.div_(world)
    return state.ledger.all_reduce(tensor, group=state.group, async_op=True)


class SyncStrategy(GradsyncStrategy):
    """Synchronous data parallel: every step all ranks apply the mean of all ranks' gradients."""

    strategy_name = "sync"

    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        return AllReduceState(ledger=self.ledger), allreduce_hook
