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
    bucket.buffer().div_(dist.get_world_size(state.group))
    return allreduce_sum_hook(state, bucket)


def allreduce_sum_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum a gradient bucket across ranks with one all-reduce, and record it in the ledger.

    For gradients that already carry the 1/N of the mean (``sync`` divides the loss by N before
    backward): this saves the hook's pass over the bucket that :func:`allreduce_hook` spends on
    dividing — the pass DDP's built-in reduction fuses into its copy into the bucket.
    """
    tensor = bucket.buffer()
    state.ledger.add_logical(fp32_allreduce_bytes(tensor.numel(), dist.get_world_size(state.group)))
    return state.ledger.all_reduce(tensor, group=state.group, async_op=True)


class SyncStrategy(GradsyncStrategy):
    """Synchronous data parallel: every step all ranks apply the mean of all ranks' gradients."""

    strategy_name = "sync"

    #: True once :meth:`build_comm_hook` chose the summing hook: then backward divides the loss by N.
    _mean_in_loss = False

    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        self._mean_in_loss = True
        return AllReduceState(ledger=self.ledger), allreduce_sum_hook

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # d(loss/N) = grad/N: the mean's division rides on the backward pass (exact for N a power
        # of two, within rounding otherwise) and the hook only sums.
        if self._mean_in_loss and self.world_size > 1:
            closure_loss = closure_loss / self.world_size
        return super().backward(closure_loss, optimizer, *args, **kwargs)
