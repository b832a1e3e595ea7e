"""``local_sgd``: every rank trains on its own; every ``period`` steps the ranks average parameters.

Local SGD (Stich 2019, "Local SGD converges fast and communicates little") cuts communication by
``period``x: ordinary steps send nothing, and a round sends the parameters once (the size of one
step of gradients). With ``warmup_steps`` the first steps are plain synchronous steps (post-local
SGD, Lin et al. 2020, "Don't use large mini-batches, use local SGD"), which protects the fragile
early phase of training. With ``period=1`` and plain SGD it is exactly ``sync``: the mean of the
ranks' ``p - lr*g_r`` is ``p - lr*mean(g_r)``.

With a lossy ``codec`` a round sends each rank's *change since the last round* instead of the
parameters (an int8 code of the parameters themselves would add noise the size of the weights to
every round; a code of the change adds noise the size of one period's progress), with error
feedback: the new common point is ``x_last - mean_r(x_last - x_r)``. That costs one copy of the
parameters on each rank.

Usage::

    L.Trainer(strategy=LocalSGDStrategy(period=8), devices=2)
    gradsync fit --recipe digits --strategy local_sgd --strategy.period 8 --devices 2
    gradsync fit --recipe digits --strategy local_sgd --strategy.period 8 --strategy.codec int8 --devices 2
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from gradsync.strategies.periodic import PeriodicAveragingStrategy


class LocalSGDStrategy(PeriodicAveragingStrategy):
    """Local SGD: train locally, average the parameters every `period` optimizer steps."""

    strategy_name = "local_sgd"
    replicated_state = ("num_steps", "last_common")

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
        self._check_streaming()
        #: the last common parameters (lossy codecs send the change since then)
        self.last_common: Optional[list[torch.Tensor]] = None

    @property
    def sends_changes(self) -> bool:
        return self.codec != "identity"

    def _begin_local_phase(self) -> None:
        if self.sends_changes and self.last_common is None:
            layout = self._layout()
            self.last_common = layout.values(list(range(len(layout.params))))
            if self.steps.local_steps > 0 and self._distributed():
                # Resumed mid-run from a checkpoint with no common point (written with the identity
                # codec): the ranks' parameters differ, and any point they share serves the rule
                # last - mean(last - x_r) = mean(x_r). Their mean is one fp32 all-reduce away.
                self._share_common_point()

    @torch.no_grad()
    def _share_common_point(self) -> None:
        assert self.last_common is not None
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in self.last_common])
        self.ledger.all_reduce(flat, group=self.comm_group, scope=self.round_scope(), sync=("common", 0, 0))
        flat.div_(self.world_size)
        pos = 0
        for i, t in enumerate(self.last_common):
            self.last_common[i] = flat[pos:pos + t.numel()].view_as(t).to(t.dtype)
            pos += t.numel()
        if self.global_rank == 0:
            warnings.warn(f"local_sgd: the checkpoint holds no last common point (it was written with codec identity); "
                          f"codec {self.codec} measures each rank's change from the ranks' mean parameters instead",
                          stacklevel=2)

    def _payload(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.sends_changes:
            return values
        assert self.last_common is not None
        return [self.last_common[i] - v for i, v in zip(indices, values)]

    @torch.no_grad()
    def _consensus(self, indices: list[int], means: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.sends_changes:
            return means
        assert self.last_common is not None
        for i, m in zip(indices, means):
            self.last_common[i] = self.last_common[i] - m
        return [self.last_common[i] for i in indices]

    def algorithm_state_dict(self) -> dict:
        state = super().algorithm_state_dict()
        if self.last_common is not None:
            state["last_common"] = self.last_common
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        saved = state.get("last_common")
        if saved is not None:
            self.last_common = [t.to(self.root_device) for t in saved]
