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
local SGD. The paper's defaults are η = 0.7, μ = 0.9; with the ``sparseloco`` codec the defaults
are η = 2, μ = 0: SparseLoCo's plain step (its decayed error-feedback residual does the momentum's
work) at twice SparseLoCo's learning rate.

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

from gradsync.algorithms import OuterStep
from gradsync.comm import REDUCERS
from gradsync.algorithms.diloco import default_momentum_warmup, momentum_at
from gradsync.errors import check, spell
from gradsync.strategies.periodic import PeriodicAveragingStrategy

#: The DiLoCo paper's outer step (Douillard et al. 2023).
PAPER_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}
#: With an all-gathered (sparse) codec: SparseLoCo's plain outer step (Sarfi et al. 2025, arXiv 2508.15706), the
#: decayed error-feedback residual (``error_decay`` 0.95) standing in for the momentum, at twice its
#: learning rate. A round delivers only the top entries of each chunk and the replicas restart from
#: the global parameters, so a step of 1 moves them less than the replicas moved; a step of 2 ends
#: lower at every period measured, and SparseLoCo's 1 lower than the DiLoCo paper's Nesterov step
#: (docs/low-communication.md).
SPARSE_OUTER = {"outer_lr": 2.0, "outer_momentum": 0.0}


class DiLoCoStrategy(PeriodicAveragingStrategy):
    """DiLoCo: local inner steps, outer Nesterov SGD on the averaged pseudo-gradient every `period` steps."""

    strategy_name = "diloco"

    def __init__(
        self,
        *,
        period: int = 8,
        outer_lr: Optional[float] = None,
        outer_momentum: Optional[float] = None,
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
            outer_lr: learning rate of the outer Nesterov SGD, > 0. Default: the paper's 0.7; 2 with the
                ``sparseloco`` codec (twice SparseLoCo's plain outer step). 1 with ``outer_momentum`` 0 is
                plain local SGD; lower it if the loss jumps after rounds.
            outer_momentum: Nesterov momentum of the outer SGD, in [0, 1). Default: the paper's 0.9;
                0 with ``sparseloco``, whose decayed error-feedback residual carries the momentum.
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
        traits = REDUCERS.get(kwargs.get("codec"))  # (None: identity; an unknown codec is refused with its options)
        outer = SPARSE_OUTER if traits is not None and traits.all_gathered else PAPER_OUTER
        outer_lr = outer["outer_lr"] if outer_lr is None else outer_lr
        outer_momentum = outer["outer_momentum"] if outer_momentum is None else outer_momentum
        check(outer_lr > 0, "outer_lr", outer_lr, "must be > 0", f"the DiLoCo paper uses {spell('outer_lr', 0.7)}")
        check(0 <= outer_momentum < 1, "outer_momentum", outer_momentum, "must be in [0, 1)",
              f"the DiLoCo paper uses {spell('outer_momentum', 0.9)}")
        check(outer_momentum_warmup is None or (isinstance(outer_momentum_warmup, int)
                                                 and not isinstance(outer_momentum_warmup, bool)
                                                 and outer_momentum_warmup >= 0),
              "outer_momentum_warmup", outer_momentum_warmup, "must be an integer >= 0 (outer steps; 0: none)",
              "omit it for the default warm-up")
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.outer_momentum_warmup = outer_momentum_warmup
        self.offload = offload
        super().__init__(period=period, warmup_steps=warmup_steps, average_buffers=average_buffers,
                         overlap=overlap, **kwargs)
        self._configure_streaming(fragments, sync_delay, fragment_alpha)

    def build_payload(self) -> OuterStep:
        w = self.outer_momentum_warmup
        return OuterStep(outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                         momentum_warmup=default_momentum_warmup(self.period) if w is None else w,
                         fragments=self.fragments, offload=self.offload)

    def momentum_at(self, t: int) -> float:
        """The outer momentum of a fragment's ``t``-th outer step (1-based)."""
        return momentum_at(t, self.outer_momentum, self.payload.momentum_warmup)

    @property
    def global_params(self) -> Optional[list[torch.Tensor]]:
        """The global parameters θ (None before the first local step)."""
        return self.payload.global_params

    @property
    def outer_optimizer(self) -> Optional[torch.optim.SGD]:
        return self.payload.outer_optimizer
