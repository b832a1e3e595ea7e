"""Error feedback as a wrapper around any lossy reducer.

Each rank adds what it failed to send last time to what it sends now, and keeps the new shortfall::

    m = x + e,    sent = C(m),    e <- m - sent

so compression error is delayed, never lost (Seide et al. 2014, 1-bit SGD; Karimireddy et al.
2019, EF-SGD). The residual ``e`` is kept per tensor name (a flat float32 piece each), so it
follows a tensor across DDP bucket rebuilds, DiLoCo fragments and resumes; it is this rank's own
state and is checkpointed with the rank.

For ``sign`` the reducer also keeps a residual of its second hop (see
:mod:`gradsync.comm.codecs.sign`); this wrapper keeps the first.
"""

from __future__ import annotations

from typing import Hashable

import torch

from gradsync.comm.codecs.common import ParamStore
from gradsync.comm.futures import Reduction
from gradsync.comm.reducer import Reducer


class ErrorFeedback(Reducer):
    """Wraps ``inner`` (a lossy reducer) and carries ``input - sent`` into the next reduction."""

    lossy = True

    def __init__(self, inner: Reducer) -> None:
        super().__init__(ledger=inner.ledger, group=inner.group, scope=inner.scope)
        self.inner = inner
        inner.need_sent = True
        self.codec = inner.codec
        self.residuals = ParamStore()

    def options(self) -> dict:
        return {**self.inner.options(), "error_feedback": True}

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        inputs = [t.to(torch.float32) + self.residuals.get(name, t.numel(), t).view(t.shape)
                  for t, name in zip(tensors, names)]
        means, sent = yield from self.inner.run(inputs, names, sync)
        for name, m, s in zip(names, inputs, sent):
            self.residuals.pieces[name] = (m - s.to(torch.float32)).reshape(-1)
        return [mean.to(t.dtype) for mean, t in zip(means, tensors)], None

    def state_dict(self) -> dict:
        return {"residuals": self.residuals.state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.residuals.load_state_dict(state.get("residuals", {}))
        self.inner.load_state_dict(state.get("inner", {}))

    def runtime_state_names(self) -> list[str]:
        return ["worker error-feedback residuals", *self.inner.runtime_state_names()]

    def residual_norm(self) -> float:
        """The residuals' L2 norm over every name (a health figure: it should stay bounded)."""
        total = sum(float(v.double().pow(2).sum()) for v in self.residuals.pieces.values())
        return total ** 0.5
