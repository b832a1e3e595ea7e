"""``sync``: synchronous data parallel (DDP) with a communication ledger."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from gradsync.comm.ddp import AllReduceState, allreduce_hook, allreduce_sum_hook
from gradsync.strategies.base import GradsyncStrategy

__all__ = ["AllReduceState", "SyncStrategy", "allreduce_hook", "allreduce_sum_hook"]


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
