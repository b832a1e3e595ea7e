"""Optimizers the recipes build beyond torch's single-algorithm ones.

:class:`MuonAdamW` is ``--model.optimizer muon``: ``torch.optim.Muon`` (momentum orthogonalized by
Newton-Schulz iterations; Jordan et al. 2024) on the hidden weight matrices and AdamW on everything
else (embeddings, the output head, norms, biases), as Keller Jordan's Muon and MuLoCo (Thérien et
al., "MuLoCo: Muon is a practical inner optimizer for DiLoCo", arXiv 2505.23725) do. MuLoCo reports
that Muon's pseudo-gradients compress better than AdamW's (2-bit with error feedback at next to no
loss). Muon's step size is scaled to match AdamW's update RMS (``adjust_lr_fn="match_rms_adamw"``,
Moonshot's "Muon is Scalable for LLM Training"), so both halves share the recipe's ``lr`` and
``weight_decay``.

It is one ``torch.optim.Optimizer``: one learning-rate schedule drives both halves, one state dict
checkpoints them, and strategies that count one optimizer's steps (``local_sgd``, ``diloco``) see one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

#: Muon's momentum (torch's default and the Muon paper's).
MUON_MOMENTUM = 0.95


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``muon_groups`` (2-D parameters only), ``torch.optim.AdamW`` on ``adamw_groups``.

    Every group keeps its own options (e.g. ``weight_decay``); the groups of both halves are this
    optimizer's ``param_groups`` (the same dicts, so a scheduler's ``lr`` reaches both), each tagged
    with ``"algorithm": "muon"`` or ``"adamw"``, and the per-parameter state lives in one ``state``.
    """

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 momentum: float = MUON_MOMENTUM) -> None:
        muon_groups = [g for g in muon_groups if list(g["params"])]
        adamw_groups = [g for g in adamw_groups if list(g["params"])]
        self.inner: dict[str, torch.optim.Optimizer] = {}
        if muon_groups:
            self.inner["muon"] = torch.optim.Muon(muon_groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                                  adjust_lr_fn="match_rms_adamw")
        if adamw_groups:
            self.inner["adamw"] = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, weight_decay=weight_decay)
        groups = []
        for name, opt in self.inner.items():
            for g in opt.param_groups:
                g["algorithm"] = name
                groups.append(g)
        super().__init__(groups, defaults={"lr": lr})
        self._link()

    def _link(self) -> None:
        """Point both halves at this optimizer's groups and state (after construction or a load)."""
        for name, opt in self.inner.items():
            opt.param_groups = [g for g in self.param_groups if g["algorithm"] == name]
            opt.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.inner.values():
            opt.step()
        return loss
