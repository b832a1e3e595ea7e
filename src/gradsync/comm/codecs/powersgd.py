"""``powersgd``: rank-r approximation of each matrix by one step of power iteration.

For each tensor viewed as an n x m matrix M (its first dimension by the rest; the input already
holds the error-feedback residual when :class:`~gradsync.comm.error_feedback.ErrorFeedback` wraps
this reducer), with a shared m x r matrix Q (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical
Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019):

    P = all_reduce(M Q);  P = orthonormalize(P);  Q' = all_reduce(M^T P);  M ≈ P Q'^T

Both all-reduces are linear, so summing low-rank factors gives the factors of the sum. *Warm
start* reuses last round's Q' as the next Q — one power-iteration step per round converges to the
top singular space over time. This rank's contribution is ``P (M^T P)^T``; error feedback keeps
``M - P (M^T P)^T``.

Tensors whose matrix would not shrink (vectors such as biases, or r(n+m) >= nm) are all-reduced
uncompressed in the same collective as P.

Bytes: 2(N-1)/N x 4 x (sum r n_i + uncompressed entries) for P, plus 2(N-1)/N x 4 x sum r m_i
for Q, against 2(N-1)/N x 4 x (all entries) for fp32 — large matrices shrink by nm / (r(n+m)).

Unlike torch's ``powerSGD_hook``, which keys its Q memories by bucket index, this keeps them per
tensor name: DDP's first step uses different buckets than later steps (and a resumed run starts
again with first-step buckets), and per-name memories stay right across both.
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch

from gradsync.comm.codecs.common import generator_state, make_generator
from gradsync.comm.futures import Reduction
from gradsync.comm.reducer import Reducer
from gradsync.errors import check


def matrix_shape(shape: torch.Size, rank: int) -> Optional[tuple[int, int, int]]:
    """``(n, m, r)`` when a tensor of ``shape`` is worth compressing at ``rank``, else None."""
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


class PowerSGDReducer(Reducer):
    """``powersgd``: low-rank factors P and Q, two all-reduces."""

    codec = "powersgd"
    lossy = True
    biased = True
    # Q must be the same on every rank, and a healed group's is not
    survives_membership_change = False
    #: rank 8 under Adam / AdamW (see gradsync.strategies.compressed): their per-coordinate normalization
    #: divides what a rank-4 approximation drops by small second moments
    adam_options = {"rank": 8}

    @classmethod
    def keeps_memory(cls, error_feedback: bool, options: dict) -> bool:
        return bool(error_feedback or options.get("warm_start"))  # torch's start_powerSGD_iter > 1 rule

    def __init__(self, *, rank: int = 4, warm_start: bool = True, seed: int = 0, **kwargs) -> None:
        """
        Args:
            rank: rank r of the approximation, >= 1. 1-4 is typical; raise it when accuracy lags
                (cost grows linearly with r).
            warm_start: start each power iteration from the previous round's Q (better
                approximations at no extra cost).
            seed: seed of the initial Q matrices; the same on every rank, so all ranks share Q.
        """
        check(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1, "rank", rank,
              "must be an integer >= 1", "e.g. --strategy.rank 4")
        super().__init__(**kwargs)
        self.rank, self.warm_start, self.seed = rank, bool(warm_start), int(seed)
        self.qs: dict[str, torch.Tensor] = {}
        self._generator: Optional[torch.Generator] = None
        self._restored_generator: Optional[torch.Tensor] = None

    def options(self) -> dict:
        return {"rank": self.rank, "warm_start": self.warm_start, "seed": self.seed}

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = make_generator(device, self.seed, self._restored_generator)
            self._restored_generator = None
        return self._generator

    def state_dict(self) -> dict:
        out = {"qs": {k: v.detach().cpu().clone() for k, v in self.qs.items()}}
        g = generator_state(self._generator, self._restored_generator)
        if g is not None:
            out["generator"] = g
        return out

    def load_state_dict(self, state: dict) -> None:
        self.qs = {k: v.clone() for k, v in state.get("qs", {}).items()}
        self._generator, self._restored_generator = None, state.get("generator")

    def runtime_state_names(self) -> list[str]:
        return ["PowerSGD Q matrices", "PowerSGD Q generator"]

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        world = self.world_size()
        device = tensors[0].device if tensors else torch.device("cpu")
        matrices, plain = [], []  # (index, name, n, m, r, M) / (index, flat)
        for i, (t, name) in enumerate(zip(tensors, names)):
            dims = matrix_shape(t.shape, self.rank)
            x = t.reshape(-1).to(torch.float32).div(world)
            if dims is None:
                plain.append((i, x))
            else:
                n, m, r = dims
                matrices.append((i, name, n, m, r, x.view(n, m)))

        gen = self.generator(device)
        qs = []
        for _, name, _, m, r, _ in matrices:
            q = self.qs.get(name) if self.warm_start else None
            if q is None or q.shape != (m, r):
                q = torch.randn(m, r, generator=gen, device=device, dtype=torch.float32)
            qs.append(q.to(device))

        # All-reduce 1: every P (M Q) and the uncompressed entries, in one message.
        ps_local = [mat @ q for (*_, mat), q in zip(matrices, qs)]
        first = torch.cat([p.flatten() for p in ps_local] + [x for _, x in plain]) if (ps_local or plain) \
            else torch.zeros(0, device=device)
        first = yield self.ledger.all_reduce(first, **self.account(sync))
        means: list[Optional[torch.Tensor]] = [None] * len(tensors)
        ps, pos = [], 0
        for p_local in ps_local:
            ps.append(orthonormalize(first[pos:pos + p_local.numel()].view_as(p_local)))
            pos += p_local.numel()
        for i, x in plain:
            means[i] = first[pos:pos + x.numel()].view(tensors[i].shape).to(tensors[i].dtype)
            pos += x.numel()

        # All-reduce 2: every Q (M^T P).
        qs_local = [mat.t() @ p for (*_, mat), p in zip(matrices, ps)]
        sent = None
        if self.need_sent:
            sent = [None] * len(tensors)
            for (i, _, _, _, _, _), p, q in zip(matrices, ps, qs_local):
                sent[i] = (p @ q.t()).mul_(world).view(tensors[i].shape)
            for i, _ in plain:
                sent[i] = tensors[i].to(torch.float32)  # sent exactly: nothing to carry
        if matrices:
            second = torch.cat([q.flatten() for q in qs_local])
            summed = yield self.ledger.all_reduce(second, **self.account(sync))
            pos = 0
            for (i, name, n, m, r, _), p in zip(matrices, ps):
                q = summed[pos:pos + m * r].view(m, r)
                pos += m * r
                means[i] = (p @ q.t()).view(tensors[i].shape).to(tensors[i].dtype)
                if self.warm_start:
                    self.qs[name] = q.clone()
        return means, sent
