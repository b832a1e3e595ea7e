"""Local gradient clipping before compression (Deep Gradient Compression's local clipping, Lin et al. 2018).

Under momentum correction (``compressed`` with ``sign``, ``topk`` or ``sparseloco``) the codec sends
each rank's SGD velocity or Adam direction, and what arrives in ``p.grad`` is the mean of those, not a
gradient. Lightning clips ``p.grad`` after backward, so it would clip the delivered direction: an
Adam direction has entries of size ~1, its norm is ~sqrt(parameters), and ``gradient_clip_val=1.0``
shrinks every step by that factor (a GPT-2 run then barely moves). Here each rank clips *its own
gradient* before the velocity or direction is formed, on the step's whole gradient:

* ``norm``: the rank's gradient is scaled by ``min(1, c / ||g_rank||)``. The mean of the clipped
  gradients then has norm <= c (triangle inequality), the bound ``sync`` + clipping gives its mean.
* ``value``: every entry is clamped to ``[-c, c]``, as Lightning clips by value.

DDP hands the gradient over bucket by bucket during backward, and the norm needs every bucket: the
hook holds the step's buckets (returning futures it completes later) until the last one arrives,
clips them all, then passes them on in order to the codec's hook. The wait costs the overlap of
compression with backward for that step, not any communication.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at runtime.
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

ClipAlgorithm = Literal["norm", "value"]


@dataclass
class LocalClipState:
    """State of :func:`local_clip_hook`: the hook and state it wraps, and the clipping settings."""

    inner_state: Any
    inner_hook: Callable
    clip_val: float
    algorithm: ClipAlgorithm = "norm"
    #: What turns a bucket's entries into this rank's gradient (a weighted loss's normalization).
    grad_scale: Callable[[], float] = lambda: 1.0
    #: Clip factors applied to the last steps' gradients (norm clipping), for tests and run stats.
    factors: list = field(default_factory=list)
    _pending: list = field(default_factory=list)


def _forward(inner: torch.futures.Future, outer: torch.futures.Future) -> None:
    def done(f: torch.futures.Future) -> None:
        try:
            outer.set_result(f.value())
        except Exception as exc:  # a failed reduction must fail the step, not hang it
            outer.set_exception(exc)

    inner.add_done_callback(done)


def local_clip_hook(state: LocalClipState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Clip this rank's gradient (all of the step's buckets together), then run the wrapped hook."""
    c = float(state.clip_val)
    if state.algorithm == "value":
        scale = state.grad_scale() or 1.0
        bucket.buffer().clamp_(-c / scale, c / scale)
        return state.inner_hook(state.inner_state, bucket)
    outer: torch.futures.Future = torch.futures.Future()
    state._pending.append((bucket, outer))
    if not bucket.is_last():
        return outer
    pending, state._pending = state._pending, []
    squares = torch.stack([b.buffer().float().pow(2).sum() for b, _ in pending]).sum()
    norm = math.sqrt(float(squares)) * abs(state.grad_scale() or 1.0)
    factor = min(1.0, c / (norm + 1e-6))  # torch's clip_grad_norm_ rule
    state.factors = (state.factors + [factor])[-16:]
    for b, fut in pending:
        if factor < 1.0:
            b.buffer().mul_(factor)
        _forward(state.inner_hook(state.inner_state, b), fut)
    return outer
