"""Lightning's own collectives, counted in the ledger as control traffic.

Lightning reduces logged metrics, meets in barriers and broadcasts objects (a checkpoint path, a
stop flag) through the strategy; a gradsync strategy books each in its ledger's control bytes, apart
from the training traffic.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist


class CountedCollectives:
    """Mixed into :class:`~gradsync.strategies.base.GradsyncStrategy` ahead of Lightning's ``DDPStrategy``."""

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and self._distributed():
            self.ledger.record("all_reduce", tensor.numel() * tensor.element_size(), purpose="control")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._distributed():
            self.ledger.record("all_reduce", 4, purpose="control")  # a barrier moves a token's worth
        super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        out = super().broadcast(obj, src)
        if self._distributed():
            self.ledger.record("broadcast", len(pickle.dumps(out)) + 8, is_root=self.global_rank == src,
                               purpose="control")
        return out

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world_size > 1
