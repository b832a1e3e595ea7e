"""``local_sgd``: every rank trains on its own; every ``period`` steps the ranks average parameters.

Local SGD (Stich 2019, "Local SGD converges fast and communicates little") cuts communication by
``period``x: ordinary steps send nothing, and a round sends the parameters once (the size of one
step of gradients). With ``warmup_steps`` the first steps are plain synchronous steps (post-local
SGD, Lin et al. 2020, "Don't use large mini-batches, use local SGD"), which protects the fragile
early phase of training. With ``period=1`` and plain SGD it is exactly ``sync``: the mean of the
ranks' ``p - lr*g_r`` is ``p - lr*mean(g_r)``.

With a lossy ``codec`` a round sends each rank's *change since the last round* instead of the
parameters, with error feedback (:class:`gradsync.algorithms.local_sgd.LocalAverage`). That costs
one copy of the parameters on each rank.

Usage::

    L.Trainer(strategy=LocalSGDStrategy(period=8), devices=2)
    gradsync fit --recipe digits --strategy local_sgd --strategy.period 8 --devices 2
    gradsync fit --recipe digits --strategy local_sgd --strategy.period 8 --strategy.codec int8 --devices 2
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradsync.algorithms import LocalAverage
from gradsync.strategies.periodic import PeriodicAveragingStrategy


class LocalSGDStrategy(PeriodicAveragingStrategy):
    """Local SGD: train locally, average the parameters every `period` optimizer steps."""

    strategy_name = "local_sgd"

    def __init__(
        self,
        *,
        period: int = 8,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        overlap: bool = False,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            period: optimizer steps between averaging rounds, >= 1. Communication falls ~period-fold;
                larger periods let the ranks drift further apart. 4-16 is typical; 1 equals ``sync``
                for plain SGD.
            warmup_steps: synchronous (all-reduced) optimizer steps before local training starts
                (post-local SGD); a few hundred to an epoch helps when early training is unstable.
            average_buffers: also average floating-point buffers (e.g. BatchNorm statistics) at each
                round; otherwise each rank keeps its own.
            overlap: issue each round's all-reduce without waiting and apply it one period later;
                hides communication behind ``period`` steps of computation at the price of one period
                of staleness (see the docs).
            **kwargs: the codec options (``codec``, ``error_feedback``, ``chunk_size``, ...) of
                :class:`~gradsync.strategies.periodic.PeriodicAveragingStrategy`, and the DDP and
                process-group options of :class:`~gradsync.strategies.base.GradsyncStrategy`.
        """
        super().__init__(period=period, warmup_steps=warmup_steps, average_buffers=average_buffers,
                         overlap=overlap, **kwargs)
        self._configure_streaming()

    def build_payload(self) -> LocalAverage:
        return LocalAverage(sends_changes=self.codec_spec.lossy)

    @property
    def last_common(self) -> Optional[list[torch.Tensor]]:
        """The last common parameters (lossy codecs send the change since then)."""
        return self.payload.last_common
