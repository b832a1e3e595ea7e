"""``diloco``: local inner steps, then an outer Nesterov step on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models") keeps a copy of the *global* parameters θ. Each rank runs its inner optimizer (the
module's own, e.g. AdamW) for ``period`` steps starting from θ, reaching x_r. A round then averages
the pseudo-gradient Δ = mean_r(θ − x_r), and an outer SGD with Nesterov momentum μ and learning rate
η updates the global parameters::

    m  <-  μ m + Δ
    θ  <-  θ − η (Δ + μ m)

Every rank computes the same outer step from the same average, so every rank holds the same θ
without a broadcast, and every rank restarts from it (x_r <- θ). With η = 1 and μ = 0 this is
local SGD. The paper's defaults are η = 0.7, μ = 0.9.

It composes with the rest of gradsync's communication layer:

* ``codec``: the pseudo-gradient crosses the network through any codec of ``compressed``, with
  error feedback (on by default for lossy codecs): INTELLECT-1's int8 pseudo-gradients, or the
  4-bit ``int4`` of Streaming DiLoCo. Bytes per optimizer step fall period x codec-ratio fold.
* ``fragments`` F, ``sync_delay`` T, ``fragment_alpha`` α (Streaming DiLoCo, Douillard et al.
  2025, arXiv 2501.18512): the parameters are split into F fragments strided over the layers;
  fragment k is synced every ``period`` steps at offset k·period/F (a round moves 1/F of the model,
  so peak bandwidth falls F-fold); its reduction is issued and T inner steps run before its outer
  step is applied, and the local fragment becomes α·local + (1 − α)·global.
* ``offload``: global parameters and outer momentum live in host memory, so DiLoCo costs no extra
  accelerator memory (default on CUDA for models over 1 GB).

Usage::

    L.Trainer(strategy=DiLoCoStrategy(period=8), devices=2)
    gradsync fit --recipe digits --strategy diloco --strategy.period 8 --devices 2
    gradsync fit --recipe chargpt --strategy diloco --strategy.period 32 --strategy.codec int8 \\
        --strategy.fragments 4 --strategy.sync_delay 2 --devices 2
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradsync.errors import check
from gradsync.strategies.periodic import PeriodicAveragingStrategy

#: Models above this many bytes keep DiLoCo's global state on the host by default (on CUDA).
OFFLOAD_BYTES = 1 << 30
#: Inner steps the default outer-momentum warm-up spans: ceil(this / period) outer steps.
MOMENTUM_WARMUP_INNER_STEPS = 400
#: The warm-up's floor: the outer momentum never starts below this (or below ``outer_momentum``,
#: if that is lower). A ramp from 0 left AdamW runs of a few dozen outer steps without the momentum
#: that makes DiLoCo fast (chargpt, 20 outer steps: 2.18 val_loss vs 2.16 at a constant 0.5).
MOMENTUM_WARMUP_START = 0.5


class DiLoCoStrategy(PeriodicAveragingStrategy):
    """DiLoCo: local inner steps, outer Nesterov SGD on the averaged pseudo-gradient every `period` steps."""

    strategy_name = "diloco"
    replicated_state = ("num_steps", "global_params", "outer_optimizer", "outer_steps")

    def __init__(
        self,
        *,
        period: int = 8,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_momentum_warmup: Optional[int] = None,
        fragments: int = 1,
        sync_delay: int = 0,
        fragment_alpha: float = 0.0,
        offload: Optional[bool] = None,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        overlap: bool = False,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            period: inner optimizer steps between outer steps of each fragment, >= 1 (the paper uses
                500 for language models; small models on small data want far fewer). Communication
                falls ~period-fold.
            outer_lr: learning rate of the outer Nesterov SGD, > 0 (paper: 0.7). 1 with
                ``outer_momentum`` 0 is plain local SGD; lower it if the loss jumps after rounds.
            outer_momentum: Nesterov momentum of the outer SGD, in [0, 1) (paper: 0.9).
            outer_momentum_warmup: outer steps over which the momentum ramps up linearly,
                ``max(min(outer_momentum, 0.5), outer_momentum * min(1, t / W))`` at a fragment's
                t-th outer step; 0 uses the full momentum from the first. Default: ceil(400 / period), so the paper's H = 500 runs
                start at full momentum and short periods do not overshoot.
            fragments: split the parameters into this many fragments, strided over the layers, each
                synced once per period at its own offset (Streaming DiLoCo); must divide ``period``.
            sync_delay: inner steps between issuing a fragment's reduction and applying its outer
                step (the reduction runs meanwhile), < period / fragments; 0 is blocking.
            fragment_alpha: after a fragment's outer step the local fragment becomes
                ``alpha * local + (1 - alpha) * global``; 0 takes the global parameters.
            offload: keep global parameters and outer momentum in host memory. Default: on for CUDA
                models over 1 GB, else off.
            warmup_steps: synchronous (all-reduced) optimizer steps before local training starts.
            average_buffers: also average floating-point buffers (e.g. BatchNorm statistics) once per
                period (plainly, not through the outer optimizer); otherwise each rank keeps its own.
            overlap: issue each round's reduction without waiting and apply the outer step one period
                later, keeping the local progress made meanwhile (whole model only; see docs).
            **kwargs: the codec options (``codec``, ``error_feedback``, ``chunk_size``, ...) of
                :class:`~gradsync.strategies.periodic.PeriodicAveragingStrategy`, and the DDP and
                process-group options of :class:`~gradsync.strategies.base.GradsyncStrategy`.
        """
        check(outer_lr > 0, "outer_lr", outer_lr, "must be > 0", "the DiLoCo paper uses --strategy.outer_lr 0.7")
        check(0 <= outer_momentum < 1, "outer_momentum", outer_momentum, "must be in [0, 1)",
              "the DiLoCo paper uses --strategy.outer_momentum 0.9")
        check(outer_momentum_warmup is None or (isinstance(outer_momentum_warmup, int)
                                                 and not isinstance(outer_momentum_warmup, bool)
                                                 and outer_momentum_warmup >= 0),
              "outer_momentum_warmup", outer_momentum_warmup, "must be an integer >= 0 (outer steps; 0: none)",
              "omit it for the default warm-up")
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.outer_momentum_warmup = outer_momentum_warmup
        super().__init__(period=period, warmup_steps=warmup_steps, average_buffers=average_buffers,
                         overlap=overlap, **kwargs)
        self.fragments, self.sync_delay, self.fragment_alpha = fragments, sync_delay, float(fragment_alpha)
        self._check_streaming()
        self.offload = offload
        self.global_params: Optional[list[torch.Tensor]] = None
        self.outer_steps = [0] * self.fragments  # outer steps taken, per fragment
        self.outer_optimizer: Optional[torch.optim.SGD] = None

    # ---- the global copy ----------------------------------------------------------------------
    def global_device(self) -> torch.device:
        """Where the global parameters and outer momentum live."""
        offload = self.offload
        if offload is None:
            numel_bytes = sum(p.numel() * p.element_size() for p in self._layout().params)
            offload = self.root_device.type == "cuda" and numel_bytes > OFFLOAD_BYTES
        return torch.device("cpu") if offload else self.root_device

    def _set_global(self, params: list[torch.Tensor]) -> None:
        device = self.global_device()
        self.global_params = [p.detach().to(device).clone() for p in params]
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=self.outer_lr,
                                               momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)

    def momentum_at(self, t: int) -> float:
        """The outer momentum of a fragment's ``t``-th outer step (1-based)."""
        w = self.outer_momentum_warmup
        if w is None:
            w = -(-MOMENTUM_WARMUP_INNER_STEPS // self.period)
        if w == 0:
            return self.outer_momentum
        return max(min(self.outer_momentum, MOMENTUM_WARMUP_START), self.outer_momentum * min(1.0, t / w))

    def _begin_local_phase(self) -> None:
        if self.global_params is None:
            self._set_global(self._layout().params)

    # ---- rounds ---------------------------------------------------------------------------------
    def _payload(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        assert self.global_params is not None
        return [self.global_params[i].to(v.device, non_blocking=True) - v for i, v in zip(indices, values)]

    @torch.no_grad()
    def _consensus(self, indices: list[int], means: list[torch.Tensor]) -> list[torch.Tensor]:
        assert self.global_params is not None and self.outer_optimizer is not None
        for i, pseudo_grad in zip(indices, means):
            g = self.global_params[i]
            g.grad = pseudo_grad.to(g.device, g.dtype)
        k = self._layout().fragments.index(indices)
        self.outer_steps[k] += 1
        for group in self.outer_optimizer.param_groups:
            group["momentum"] = self.momentum_at(self.outer_steps[k])
        self.outer_optimizer.step()  # steps only the parameters that have a gradient: this fragment's
        for i in indices:
            self.global_params[i].grad = None
        return [self.global_params[i] for i in indices]

    # ---- algorithm state -------------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        state = super().algorithm_state_dict()
        state["outer_steps"] = list(self.outer_steps)
        state["global_params"] = self.global_params
        state["outer_optimizer"] = self.outer_optimizer.state_dict() if self.outer_optimizer is not None else None
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        if state.get("outer_steps") is not None and len(state["outer_steps"]) == self.fragments:
            self.outer_steps = [int(t) for t in state["outer_steps"]]
        saved = state.get("global_params")
        if saved is None:
            return
        expected = [p.numel() for p in self._layout().params]
        if [t.numel() for t in saved] != expected:
            raise ValueError(f"diloco: the checkpoint's global parameters have {len(saved)} tensors, "
                             f"this model has {len(expected)} of other sizes; resume with the same model")
        self._set_global(saved)
        if state.get("outer_optimizer") is not None:
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
            # the momentum buffer is state; the learning rate and momentum are this run's options
            for group in self.outer_optimizer.param_groups:
                group.update(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
