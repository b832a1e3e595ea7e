"""``diloco``: local inner steps, then an outer Nesterov step on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models") keeps a copy of the *global* parameters θ. Each rank runs its inner optimizer (the
module's own, e.g. AdamW) for ``period`` steps starting from θ, reaching x_r. A round then averages
the pseudo-gradient Δ = mean_r(θ − x_r) with one all-reduce, and an outer SGD with Nesterov
momentum μ and learning rate η updates the global parameters::

    m  <-  μ m + Δ
    θ  <-  θ − η (Δ + μ m)

Every rank computes the same outer step from the same average, so every rank holds the same θ
without a broadcast, and every rank restarts from it (x_r <- θ). With η = 1 and μ = 0 this is
local SGD. The paper's defaults are η = 0.7, μ = 0.9.

Usage::

    L.Trainer(strategy=DiLoCoStrategy(period=8), devices=2)
    gradsync fit --recipe digits --strategy diloco --strategy.period 8 --devices 2
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradsync.errors import check
from gradsync.strategies.periodic import PeriodicAveragingStrategy


class DiLoCoStrategy(PeriodicAveragingStrategy):
    """DiLoCo: local inner steps, outer Nesterov SGD on the averaged pseudo-gradient every `period` steps."""

    strategy_name = "diloco"
    replicated_state = ("num_steps", "global_params", "outer_optimizer")

    def __init__(
        self,
        *,
        period: int = 8,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        overlap: bool = False,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            period: inner optimizer steps between outer steps, >= 1 (the paper uses 500 for language
                models; small models on small data want far fewer). Communication falls ~period-fold.
            outer_lr: learning rate of the outer Nesterov SGD, > 0 (paper: 0.7). 1 with
                ``outer_momentum`` 0 is plain local SGD; lower it if the loss jumps after rounds.
            outer_momentum: Nesterov momentum of the outer SGD, in [0, 1) (paper: 0.9).
            warmup_steps: synchronous (all-reduced) optimizer steps before local training starts.
            average_buffers: also average floating-point buffers (e.g. BatchNorm statistics) at each
                round (plainly, not through the outer optimizer); otherwise each rank keeps its own.
            overlap: issue each round's all-reduce without waiting and apply the outer step one period
                later, keeping the local progress made meanwhile (one period of staleness; see docs).
            **kwargs: DDP and process-group options of :class:`~gradsync.strategies.base.GradsyncStrategy`.
        """
        check(outer_lr > 0, "outer_lr", outer_lr, "must be > 0", "the DiLoCo paper uses --strategy.outer_lr 0.7")
        check(0 <= outer_momentum < 1, "outer_momentum", outer_momentum, "must be in [0, 1)",
              "the DiLoCo paper uses --strategy.outer_momentum 0.9")
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        super().__init__(period=period, warmup_steps=warmup_steps, average_buffers=average_buffers,
                         overlap=overlap, **kwargs)
        self.global_params: Optional[list[torch.Tensor]] = None
        self.outer_optimizer: Optional[torch.optim.SGD] = None

    def _set_global(self, params: list[torch.Tensor]) -> None:
        self.global_params = [p.detach().clone() for p in params]
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=self.outer_lr,
                                               momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)

    def _begin_local_phase(self, params: list[torch.Tensor]) -> None:
        if self.global_params is None:
            self._set_global(params)

    def _payload(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        assert self.global_params is not None
        return [g - p for g, p in zip(self.global_params, params)]

    @torch.no_grad()
    def _consensus(self, averages: list[torch.Tensor]) -> list[torch.Tensor]:
        assert self.global_params is not None and self.outer_optimizer is not None
        for g, pseudo_grad in zip(self.global_params, averages):
            g.grad = pseudo_grad
        self.outer_optimizer.step()
        for g in self.global_params:
            g.grad = None
        return self.global_params

    def algorithm_state_dict(self) -> dict:
        state = super().algorithm_state_dict()
        state["global_params"] = self.global_params
        state["outer_optimizer"] = self.outer_optimizer.state_dict() if self.outer_optimizer is not None else None
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        saved = state.get("global_params")
        if saved is None:
            return
        self._set_global([t.to(self.root_device) for t in saved])
        expected = self._layout().num_params
        if [t.numel() for t in self.global_params] != expected:
            raise ValueError(f"diloco: the checkpoint's global parameters have {[t.numel() for t in saved]} "
                             f"entries per dtype, this model has {expected}; resume with the same model")
        if state.get("outer_optimizer") is not None:
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
            # the momentum buffer is state; the learning rate and momentum are this run's options
            for group in self.outer_optimizer.param_groups:
                group.update(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
