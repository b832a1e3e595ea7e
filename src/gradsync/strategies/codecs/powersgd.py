"""``powersgd``: rank-r approximation of each gradient matrix by one step of power iteration.

For each parameter viewed as an n x m matrix M (plus this rank's residual), with a shared m x r
matrix Q (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019):

    P = all_reduce(M Q);  P = orthonormalize(P);  Q' = all_reduce(M^T P);  M ≈ P Q'^T

Both all-reduces are linear, so summing low-rank factors gives the factors of the sum. *Warm
start* reuses last step's Q' as the next Q — one power-iteration step per training step converges
to the gradient's top singular space over time. *Error feedback* keeps this rank's part of what
the approximation missed, ``e = M - P Q_local^T``, and adds it to the next step's gradient.

Parameters whose matrix would not shrink (vectors such as biases, or r(n+m) >= nm) are all-reduced
uncompressed in the same collective as P.

Bytes per step: 2(N-1)/N * 4 * (sum r n_i + uncompressed entries) for P, plus 2(N-1)/N * 4 * sum r m_i
for Q, against 2(N-1)/N * 4 * (all entries) for fp32 — large matrices shrink by nm / (r(n+m)).

Unlike torch's ``powerSGD_hook``, which keys its error and Q memories by bucket index, this keeps
them per parameter: DDP's first step uses different buckets than later steps (and a resumed run
starts again with first-step buckets), and per-parameter memories stay right across both.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at runtime.
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from gradsync.errors import check
from gradsync.strategies.codecs.common import (
    CodecState, ParamStore, completed, generator_state, make_generator,
)
from gradsync.strategies.ledger import fp32_allreduce_bytes


@dataclass
class PowerSGDState(CodecState):
    """State of :func:`powersgd_hook`.

    Args:
        rank: rank r of the approximation, >= 1. 1-4 is typical; raise it when accuracy lags
            (cost grows linearly with r).
        error_feedback: keep what the approximation missed and add it next step.
        warm_start: start each step's power iteration from last step's Q (better approximations
            at no extra cost).
        seed: seed of the initial Q matrices; the same on every rank, so all ranks share Q.
    """

    rank: int = 4
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0
    errors: ParamStore = field(default_factory=ParamStore, init=False, repr=False, compare=False)
    qs: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _generator: Optional[torch.Generator] = field(default=None, init=False, repr=False, compare=False)
    _restored_generator: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check(isinstance(self.rank, int) and self.rank >= 1, "rank", self.rank, "must be an integer >= 1",
              "e.g. --strategy.rank 4")

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = make_generator(device, self.seed, self._restored_generator)
            self._restored_generator = None
        return self._generator

    def state_dict(self) -> dict:
        out = {"errors": self.errors.state_dict(), "qs": {k: v.detach().cpu().clone() for k, v in self.qs.items()}}
        g = generator_state(self._generator, self._restored_generator)
        if g is not None:
            out["generator"] = g
        return out

    def load_state_dict(self, state: dict) -> None:
        self.errors.load_state_dict(state.get("errors", {}))
        self.qs = {k: v.clone() for k, v in state.get("qs", {}).items()}
        self._generator, self._restored_generator = None, state.get("generator")

    def runtime_state_names(self) -> list[str]:
        return ["PowerSGD error-feedback residuals", "PowerSGD Q matrices", "PowerSGD Q generator"]


def matrix_shape(shape: torch.Size, rank: int) -> Optional[tuple[int, int, int]]:
    """``(n, m, r)`` when a parameter of ``shape`` is worth compressing at ``rank``, else None."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    r = min(rank, n, m)
    return (n, m, r) if r * (n + m) < n * m else None


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (n x r); identical bits on every rank for identical input."""
    return torch.linalg.qr(p, mode="reduced").Q


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket as rank-r factors P, Q (two all-reduces); see the module docstring."""
    buffer = bucket.buffer()
    n_total, world = buffer.numel(), state.world_size()
    state.ledger.add_logical(fp32_allreduce_bytes(n_total, world))
    buffer_f32 = buffer.to(torch.float32).div(world)  # a copy: the buffer is written below
    layout = state.bucket_layout(bucket)  # canonical order: Q draws do not depend on DDP's bucket order

    matrices, plain = [], []  # (name, offset, n, m, r, M) / (offset, numel), offsets into the buffer
    for (name, numel), offset, shape in zip(layout.keys, layout.offsets, layout.shapes):
        dims = matrix_shape(shape, state.rank)
        if dims is None:
            plain.append((offset, numel))
        else:
            n, m, r = dims
            mat = buffer_f32[offset:offset + numel].view(n, m)
            if state.error_feedback:
                err = state.errors.pieces.get(name)
                if err is not None and err.numel() == numel:
                    mat = mat + err.to(mat.device).view(n, m)
            matrices.append((name, offset, n, m, r, mat))

    gen = state.generator(buffer.device)
    qs = []
    for name, _, n, m, r, _ in matrices:
        q = state.qs.get(name) if state.warm_start else None
        if q is None or q.shape != (m, r):
            q = torch.randn(m, r, generator=gen, device=buffer.device, dtype=torch.float32)
        qs.append(q.to(buffer.device))

    # All-reduce 1: every P (M Q) and the uncompressed entries, in one message.
    ps_local = [mat @ q for (_, _, _, _, _, mat), q in zip(matrices, qs)]
    first = torch.cat([p.flatten() for p in ps_local] + [buffer_f32[o:o + k] for o, k in plain])
    state.ledger.all_reduce(first, group=state.group)
    ps, pos = [], 0
    for p_local in ps_local:
        ps.append(orthonormalize(first[pos:pos + p_local.numel()].view_as(p_local)))
        pos += p_local.numel()
    for o, k in plain:
        buffer[o:o + k].copy_(first[pos:pos + k])
        pos += k

    # All-reduce 2: every Q (M^T P). Error feedback keeps what this rank's factors miss.
    qs_local = [mat.t() @ p for (_, _, _, _, _, mat), p in zip(matrices, ps)]
    if state.error_feedback:
        for (name, _, _, _, _, mat), p, q in zip(matrices, ps, qs_local):
            state.errors.pieces[name] = (mat - p @ q.t()).flatten()
    if not matrices:
        return completed(buffer)
    second = torch.cat([q.flatten() for q in qs_local])
    fut = state.ledger.all_reduce(second, group=state.group, async_op=True)

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        summed, pos = f.value(), 0
        for (name, offset, n, m, r, _), p in zip(matrices, ps):
            q = summed[pos:pos + m * r].view(m, r)
            pos += m * r
            buffer[offset:offset + n * m].copy_((p @ q.t()).flatten())
            if state.warm_start:
                state.qs[name] = q.clone()
        return buffer

    return fut.then(decompress)
