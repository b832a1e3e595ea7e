"""Rules on a step's gradients that every strategy shares: the non-finite check (agreed by all ranks
when their gradients differ) and the weighted-loss normalization. Pure torch."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from gradsync.comm.ledger import CommLedger


def _grads(optimizer: Any) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def all_finite(optimizer: Any, *, ledger: CommLedger, ask_every_rank: bool, device: Any = None) -> bool:
    """Whether every gradient of ``optimizer`` is finite — on every rank when ``ask_every_rank`` (the
    ranks' gradients differ; 4 bytes cross the network so that no rank steps while another skips)."""
    finite = all(bool(torch.isfinite(g).all()) for g in _grads(optimizer))
    if not ask_every_rank or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return finite
    flag = torch.tensor([0.0 if finite else 1.0], device=device)
    ledger.all_reduce(flag, purpose="control")
    return float(flag.item()) == 0.0


def normalize_weighted(optimizer: Any, *, weight_sum: float, micro_batches: int, group: Optional[Any], n: int,
                       ledger: CommLedger, device: Any = None) -> None:
    """Turn the gradient of a weighted loss into the weighted mean over micro-batches and ranks.

    After backward each gradient holds the mean over the ``n`` averaged ranks (``group``; None for
    every rank) of ``sum_mb w * grad(mean_mb) / K``: multiply by ``K n / W``, ``W`` the weight summed
    over those ranks. A local step (``n`` 1) asks no one."""
    total = torch.tensor([weight_sum], dtype=torch.float64)
    if n > 1 and dist.is_available() and dist.is_initialized():
        total = total.to(device)
        ledger.all_reduce(total, group=group, scope="world" if group is None else "intra_node")
    scale = micro_batches * n / float(total.item())
    for g in _grads(optimizer):
        g.mul_(scale)
