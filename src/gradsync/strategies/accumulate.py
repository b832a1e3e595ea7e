"""``accumulate``: synchronous DDP with gradient accumulation, selectable on its own.

Every strategy honours the run's global batch (``--global-batch-size G``): with per-process
micro-batch b and N processes, K = G / (b*N) micro-batches run forward/backward locally with DDP's
gradient sync switched off (``no_sync``) and the K-th synchronizes once, so communication happens
once per optimizer step. This strategy is ``sync`` that *requires* accumulation: choosing it without
a global batch larger than b*N is a mistake, and it says so.
"""

from __future__ import annotations

import warnings
from typing import Any

from gradsync.strategies.sync import SyncStrategy


class AccumulateStrategy(SyncStrategy):
    """Synchronous DDP with gradient accumulation: one all-reduce per optimizer step of K micro-batches."""

    strategy_name = "accumulate"
    requires_global_batch = True

    def setup(self, trainer: Any) -> None:
        if getattr(trainer, "accumulate_grad_batches", 1) == 1 and trainer.is_global_zero:
            warnings.warn("accumulate: 1 micro-batch per optimizer step, so nothing is accumulated; set a global "
                          "batch larger than batch size x processes (--global-batch-size) or use --strategy sync",
                          stacklevel=2)
        super().setup(trainer)
