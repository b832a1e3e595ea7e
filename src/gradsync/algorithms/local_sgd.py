"""Local SGD's round: average the parameters, or their change since the last common point.

With an exact codec a round sends the parameters and adopts their mean. Through a lossy codec it
sends each rank's change since the last common point, ``last - x_r`` (an int8 code of the weights
themselves would add noise the size of the weights to every round; a code of the change adds noise
the size of one period's progress), and moves that point by the mean change:
``last <- last - mean_r(last - x_r)``. That costs one copy of the parameters on each rank.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from gradsync.algorithms.layout import Layout
from gradsync.algorithms.state import StateRegistry


class LocalAverage:
    """The payload of ``local_sgd``: the parameters, or (``sends_changes``) their change since the last round."""

    def __init__(self, *, sends_changes: bool = False) -> None:
        self.sends_changes = bool(sends_changes)
        #: the last common parameters (lossy codecs send the change since then)
        self.last_common: Optional[list[torch.Tensor]] = None

    def begin(self, layout: Layout, *, mid_run: bool, share: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
        if self.sends_changes and self.last_common is None:
            self.last_common = layout.values(list(range(len(layout.params))))
            if mid_run:
                # Resumed mid-run from a checkpoint with no common point (written with the identity
                # codec): the ranks' parameters differ, and any point they share serves the rule
                # last - mean(last - x_r) = mean(x_r). Their mean is one fp32 all-reduce away.
                self.last_common = share(self.last_common)
                if not dist.is_initialized() or dist.get_rank() == 0:
                    warnings.warn("local_sgd: the checkpoint holds no last common point (it was written with codec "
                                  "identity); the lossy codec measures each rank's change from the ranks' mean "
                                  "parameters instead", stacklevel=2)

    def payload(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.sends_changes:
            return values
        assert self.last_common is not None
        return [self.last_common[i] - v for i, v in zip(indices, values)]

    @torch.no_grad()
    def consensus(self, fragment: int, indices: list[int], means: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.sends_changes:
            return means
        assert self.last_common is not None
        for i, m in zip(indices, means):
            self.last_common[i] = self.last_common[i] - m
        return [self.last_common[i] for i in indices]

    def register_state(self, registry: StateRegistry, layout: Callable[[], Layout]) -> None:
        def load(saved: Optional[list]) -> None:
            if saved is not None:
                device = layout().params[0].device
                self.last_common = [t.to(device) for t in saved]

        registry.register("last_common", "replicated", lambda: self.last_common, load)
