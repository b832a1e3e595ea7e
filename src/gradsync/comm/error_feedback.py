"""Error feedback and momentum correction, as wrappers around any lossy reducer.

**Error feedback.** Each rank adds what it failed to send last time to what it sends now, and
keeps the new shortfall::

    m = x + e,    sent = C(m),    e <- m - sent

so compression error is delayed, never lost (Seide et al. 2014, 1-bit SGD; Karimireddy et al.
2019, EF-SGD). With a ``decay`` beta < 1 the residual fades, ``m = x + beta e``: SparseLoCo's
accumulator (arXiv 2508.15706), which stands in for DiLoCo's outer momentum. The residual ``e``
is kept per tensor name (a flat float32 piece each), so it follows a tensor across DDP bucket
rebuilds, DiLoCo fragments and resumes; it is this rank's own state and is checkpointed with the rank.

For ``sign`` the reducer also keeps a residual of its second hop (see
:mod:`gradsync.comm.codecs.sign`); this wrapper keeps the first.

**Momentum correction.** With heavy-ball SGD, compressing the *gradient* and letting the
optimizer apply momentum afterwards puts two delays into one feedback loop: a piece of gradient
held in the residual enters the momentum buffer only once it is finally sent, and then keeps
pushing for ~1/(1-m) more steps, long after the gradient that caused it has changed (on the
digits recipe, SGD momentum 0.9, ``sign`` reaches 0.34 val_acc where ``sync`` reaches 0.97).
Deep Gradient Compression's momentum correction (Lin, Han, Mao, Wang, Dally, ICLR 2018) moves
the momentum in front of the compressor: each rank keeps a local velocity, in torch's SGD
convention (weight decay first; ``u = d`` on a tensor's first step),

    d = g + wd w,    u <- m u + (1 - dampening) d,    x = u   (nesterov: x = d + m u)

the compressor sends ``x`` (plus the residual, which now accumulates velocities: DGC's
``v <- v + u``), and the optimizer applies the delivered mean as a plain SGD step,
``w <- w - lr mean(C(x + e))`` — the strategy sets the optimizer's momentum and weight decay to 0
for the duration of that step. Without compression this is exactly momentum SGD (the mean of the
ranks' velocities is the velocity of the mean gradient): the local velocity sees every gradient
at once, only its transmission is delayed. Sparse codecs (``topk``) add DGC's *momentum factor
masking*: the velocity is zeroed where the codec sent (the residual is zero there already), so a
coordinate whose accumulated velocity was just applied stops pushing with stale momentum.

Dense codecs (``sign``) keep no worker residual for corrected tensors (``worker_feedback`` off):
every entry is sent every step, and what the compressor shaved off is still in the velocity,
decayed by m, at the next step — Signum's compression of the momentum (Bernstein et al., ICML
2018), with the reducer-side residual of the second hop kept. A residual of velocities on top of
the velocity compounds instead: measured in :mod:`gradsync.comm.codecs.sign`. Tensors the
optimizer applies no momentum to pass through untouched, residual included: at momentum 0 both
variants are the same, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Container, Hashable, Mapping, Optional

import torch

from gradsync.comm.codecs.common import ParamStore
from gradsync.comm.futures import Reduction
from gradsync.comm.reducer import Reducer


class ErrorFeedback(Reducer):
    """Wraps ``inner`` (a lossy reducer) and carries ``input - sent`` into the next reduction."""

    lossy = True

    def __init__(self, inner: Reducer, *, decay: float = 1.0) -> None:
        super().__init__(ledger=inner.ledger, group=inner.group, scope=inner.scope)
        self.inner = inner
        #: Factor on the residual before it is added (1: plain error feedback).
        self.decay = float(decay)
        inner.need_sent = True
        self.codec = inner.codec
        self.residuals = ParamStore()
        #: Names sent without a residual (set by :class:`MomentumCorrection` for dense codecs,
        #: where the velocity is the memory).
        self.exempt: Container[str] = frozenset()

    def options(self) -> dict:
        extra = {} if self.decay == 1 else {"error_decay": self.decay}
        return {**self.inner.options(), "error_feedback": True, **extra}

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        exempt = {name for name in names if name in self.exempt}
        inputs = [t.to(torch.float32) if name in exempt else
                  t.to(torch.float32) + self._residual(name, t).view(t.shape)
                  for t, name in zip(tensors, names)]
        means, sent = yield from self.inner.run(inputs, names, sync)
        for name, m, s in zip(names, inputs, sent):
            if name in exempt:
                self.residuals.pieces.pop(name, None)
            else:
                self.residuals.pieces[name] = (m - s.to(torch.float32)).reshape(-1)
        # ``sent`` is in the units of the input plus residual: where it is nonzero the codec sent
        # the whole entry (momentum factor masking reads that).
        return [mean.to(t.dtype) for mean, t in zip(means, tensors)], (sent if self.need_sent else None)

    def _residual(self, name: str, t: torch.Tensor) -> torch.Tensor:
        e = self.residuals.get(name, t.numel(), t)
        return e if self.decay == 1 else e.mul(self.decay)

    def state_dict(self) -> dict:
        return {"residuals": self.residuals.state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.residuals.load_state_dict(state.get("residuals", {}))
        self.inner.load_state_dict(state.get("inner", {}))

    def runtime_state_names(self) -> list[str]:
        return ["worker error-feedback residuals", *self.inner.runtime_state_names()]

    def world_size(self) -> int:
        return self.inner.world_size()

    def mark(self) -> Any:
        return dict(self.residuals.pieces), self.inner.mark()

    def roll_back(self, mark: Any) -> None:
        pieces, inner = mark
        self.residuals.pieces = dict(pieces)
        self.inner.roll_back(inner)

    def residual_norm(self) -> float:
        """The residuals' L2 norm over every name (a health figure: it should stay bounded)."""
        total = sum(float(v.double().pow(2).sum()) for v in self.residuals.pieces.values())
        return total ** 0.5


@dataclass(frozen=True)
class SGDMomentum:
    """One parameter's heavy-ball settings, as ``torch.optim.SGD`` applies them."""

    momentum: float
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


@dataclass(frozen=True)
class AdamMoments:
    """One parameter's Adam settings, as ``torch.optim.Adam`` / ``AdamW`` apply them.

    ``weight_decay`` is Adam's L2 term (added to the gradient before the moments); AdamW's
    decoupled decay is not a moment matter and stays with the optimizer step.
    """

    beta1: float
    beta2: float
    eps: float
    weight_decay: float = 0.0


class _Corrected:
    """The names whose SGD velocity a :class:`MomentumCorrection` sends: its :class:`ErrorFeedback`
    keeps no residual for them (Adam directions keep theirs: see the class). Behind the node-scoped
    reducer, which sends one shard named after its whole bucket, every name once any SGD tensor is."""

    def __init__(self, settings: Callable[[], Mapping[str, object]], by_name: bool) -> None:
        self.settings, self.by_name = settings, by_name

    def __contains__(self, name: object) -> bool:
        settings = self.settings()
        if self.by_name:
            return isinstance(settings.get(name), SGDMomentum)
        return any(isinstance(s, SGDMomentum) for s in settings.values())


def _error_feedback_in(reducer: Reducer) -> Optional[ErrorFeedback]:
    while reducer is not None and not isinstance(reducer, ErrorFeedback):
        reducer = getattr(reducer, "inner", None)
    return reducer


class MomentumCorrection(Reducer):
    """Wraps ``inner`` (usually :class:`ErrorFeedback` around a codec) and sends each rank's SGD velocity.

    ``settings()`` gives, at each reduction, the :class:`SGDMomentum` of every tensor name the
    optimizer applies momentum to; other names pass through untouched (momentum 0: the plain
    variant, bit for bit). ``params`` maps names to the parameters, for weight decay. Velocities
    live in ``velocities``, which two wrappers may share (the warm-up reducer and the codec's, so
    the velocity carries over when compression starts).
    """

    lossy = True

    def __init__(self, inner: Reducer, *, settings: Callable[[], Mapping[str, SGDMomentum]],
                 params: Optional[Mapping[str, torch.Tensor]] = None, masking: bool = False,
                 worker_feedback: bool = True, velocities: Optional[ParamStore] = None,
                 grad_scale: Optional[Callable[[], float]] = None, second_moments: Optional[ParamStore] = None,
                 adam_steps: Optional[dict] = None) -> None:
        """
        Args:
            inner: the reducer the velocities go through.
            settings: name -> momentum settings, read at every reduction (the optimizer's, live).
            params: name -> parameter, read for weight decay.
            masking: zero the velocity where ``inner`` sent (DGC's momentum factor masking; for
                sparse codecs: a dense codec sends everything and would cancel the momentum).
            worker_feedback: keep the :class:`ErrorFeedback` residual inside ``inner`` for the
                corrected tensors. Off for ``sign``: see the module docstring.
            velocities: the store to keep velocities in (shared between wrappers).
            second_moments, adam_steps: where Adam's second moments and step counts live (shared
                like ``velocities``, which hold Adam's first moments).
            grad_scale: factor that turns the incoming gradient into this rank's mean gradient
                (a weighted loss back-propagates sums); read at every reduction, for Adam.
        """
        super().__init__(ledger=inner.ledger, group=inner.group, scope=inner.scope)
        self.inner = inner
        self.codec = inner.codec
        self.lossy = inner.lossy
        self.logical_scope = inner.logical_scope
        self.settings = settings
        self.params = params if params is not None else {}
        self.masking = bool(masking)
        if self.masking:
            inner.need_sent = True
        self.worker_feedback = bool(worker_feedback)
        feedback = _error_feedback_in(inner)
        if not self.worker_feedback and feedback is not None:
            feedback.exempt = _Corrected(settings, by_name=feedback is inner)
        self.velocities = velocities if velocities is not None else ParamStore()
        self.grad_scale = grad_scale
        #: Adam's second moments and per-name step counts (first moments live in ``velocities``).
        self.second_moments = second_moments if second_moments is not None else ParamStore()
        self.adam_steps: dict[str, int] = adam_steps if adam_steps is not None else {}

    def world_size(self) -> int:
        return self.inner.world_size()

    def options(self) -> dict:
        return {**self.inner.options(), "momentum_correction": True}

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        settings = self.settings()
        inputs, corrected = [], []
        for i, (t, name) in enumerate(zip(tensors, names)):
            s = settings.get(name)
            if s is None:
                inputs.append(t)
                continue
            if isinstance(s, AdamMoments):
                inputs.append(self._adam_direction(t, name, s).view(t.shape))
                corrected.append(i)
                continue
            d = t.to(torch.float32).reshape(-1)
            if s.weight_decay:
                d = d + s.weight_decay * self.params[name].detach().to(d.device, torch.float32).reshape(-1)
            u = self.velocities.pieces.get(name)
            if u is None or u.numel() != d.numel():
                u = d.clone()  # torch's first step: the buffer starts as the gradient, undamped
            else:
                u = u.to(d.device).mul(s.momentum).add_(d, alpha=1.0 - s.dampening)
            self.velocities.pieces[name] = u
            x = d.add(u, alpha=s.momentum) if s.nesterov else u
            inputs.append(x.view(t.shape))
            corrected.append(i)
        means, sent = yield from self.inner.run(inputs, names, sync)
        if self.masking and sent is not None:
            for i in corrected:
                # Momentum factor masking: a coordinate just sent stops carrying its old velocity.
                self.velocities.pieces[names[i]].masked_fill_(sent[i].reshape(-1) != 0, 0.0)
        return [mean.to(t.dtype) for mean, t in zip(means, tensors)], None

    def _adam_direction(self, t: torch.Tensor, name: str, s: AdamMoments) -> torch.Tensor:
        """This rank's Adam step direction from its own gradient, moments kept here:
        ``m_hat / (sqrt(v_hat) + eps)`` (the optimizer then applies ``-lr`` times the delivered mean)."""
        d = t.to(torch.float32).reshape(-1)
        if self.grad_scale is not None:
            d = d * self.grad_scale()
        if s.weight_decay:
            d = d + s.weight_decay * self.params[name].detach().to(d.device, torch.float32).reshape(-1)
        m = self.velocities.get(name, d.numel(), d).mul_(s.beta1).add_(d, alpha=1.0 - s.beta1)
        v = self.second_moments.get(name, d.numel(), d).mul_(s.beta2).addcmul_(d, d, value=1.0 - s.beta2)
        self.velocities.pieces[name], self.second_moments.pieces[name] = m, v
        step = self.adam_steps.get(name, 0) + 1
        self.adam_steps[name] = step
        denom = v.div(1.0 - s.beta2 ** step).sqrt_().add_(s.eps)
        return m.div(1.0 - s.beta1 ** step).div_(denom)

    def state_dict(self) -> dict:
        out = {**self.inner.state_dict(), "velocities": self.velocities.state_dict()}
        if self.adam_steps:
            out["adam"] = {"second_moments": self.second_moments.state_dict(),
                           "steps": {k: torch.tensor(v) for k, v in self.adam_steps.items()}}
        return out

    def load_state_dict(self, state: dict) -> None:
        self.velocities.load_state_dict(state.get("velocities", {}))
        adam = state.get("adam") or {}
        self.second_moments.load_state_dict(adam.get("second_moments", {}))
        self.adam_steps.clear()  # in place: a warm-up wrapper may share it
        self.adam_steps.update({k: int(v) for k, v in (adam.get("steps") or {}).items()})
        self.inner.load_state_dict({k: v for k, v in state.items() if k not in ("velocities", "adam")})

    def runtime_state_names(self) -> list[str]:
        return ["momentum-correction velocities", *self.inner.runtime_state_names()]
