"""``compressed``'s optimizer side: the optimizer's momentum, applied once under momentum correction.

Under momentum correction a codec sends each rank's SGD velocity (or, with Adam/AdamW, its Adam
direction) instead of its gradient (:class:`~gradsync.comm.error_feedback.MomentumCorrection` forms
it inside the all-reduce). What arrives is then already a step direction, so the optimizer must not
apply momentum again:

* :func:`read_settings` reads each parameter's momentum settings from the optimizers, by name;
* :class:`MomentumTakeover` holds them for one optimizer step and lets the optimizer apply the
  delivered mean — SGD with its momentum and weight decay set to 0 for that step (restored right
  after, so the optimizer's state and checkpoint keep the user's values); Adam/AdamW with its step
  replaced by ``w <- w - lr (mean + decoupled_wd w)`` (its moments are kept by the codec).

Pure torch: the Lightning adapter (:mod:`gradsync.strategies.compressed`) calls it around its step.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from gradsync.comm.error_feedback import AdamMoments, SGDMomentum
from gradsync.errors import spell

#: Optimizers whose step direction the codecs send under momentum correction, besides SGD.
ADAM_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)

#: Called as ``warn(key, message)`` for settings the correction cannot take over (once per key).
Warn = Callable[[str, str], None]


def read_settings(optimizers: list, names: Mapping[int, str], warn: Warn) -> tuple[dict, list]:
    """``(name -> SGDMomentum | AdamMoments, SGD param groups whose momentum the codec takes over)``.

    ``names`` maps ``id(parameter)`` to its name. Optimizers other than SGD, Adam and AdamW, SGD
    groups with ``maximize`` and Adam with ``amsgrad``/``maximize`` are left to the optimizer (their
    parameters are sent plain gradients), each with one warning."""
    settings: dict = {}
    groups: list = []
    for opt in optimizers:
        if isinstance(opt, ADAM_OPTIMIZERS):
            settings.update(_read_adam(opt, names, warn) or {})
            continue
        if not isinstance(opt, torch.optim.SGD):
            name = type(opt).__name__
            warn(name, f"compressed: momentum correction applies to torch.optim.SGD, Adam and AdamW; {name} is "
                       f"sent plain gradients ({spell('momentum_correction', False)} silences this)")
            continue
        for group in opt.param_groups:
            if group.get("maximize"):
                warn("maximize", "compressed: momentum correction skips SGD parameter groups with maximize=True; "
                                 "their momentum is applied by the optimizer")
                continue
            if not group.get("momentum"):
                continue  # nothing to take over: plain SGD sees the compressed gradient, as without correction
            s = SGDMomentum(momentum=float(group["momentum"]), dampening=float(group.get("dampening", 0.0)),
                            nesterov=bool(group.get("nesterov", False)),
                            weight_decay=float(group.get("weight_decay", 0.0)))
            settings.update({names[id(p)]: s for p in group["params"] if id(p) in names})
            groups.append(group)
    return settings, groups


def _read_adam(opt: Any, names: Mapping[int, str], warn: Warn) -> Optional[dict]:
    unsupported = [k for k in ("amsgrad", "maximize") if any(g.get(k) for g in opt.param_groups)]
    if unsupported:
        warn(f"adam-{unsupported}", f"compressed: momentum correction does not reproduce {type(opt).__name__}"
                                    f"({'=True, '.join(unsupported)}=True); it is sent plain gradients")
        return None
    decoupled = _decoupled(opt)
    out = {}
    for group in opt.param_groups:
        beta1, beta2 = (float(b) for b in group["betas"])
        s = AdamMoments(beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                        weight_decay=0.0 if decoupled else float(group.get("weight_decay", 0.0)))
        out.update({names[id(p)]: s for p in group["params"] if id(p) in names})
    return out


def _decoupled(opt: Any) -> bool:
    return isinstance(opt, torch.optim.AdamW) or any(g.get("decoupled_weight_decay") for g in opt.param_groups)


@contextmanager
def momentum_off(groups: list, optimizer: Any) -> Iterator[None]:
    """SGD's momentum and weight decay at 0 in ``groups`` (those of ``optimizer``) for one step."""
    mine = {id(g) for g in getattr(optimizer, "param_groups", [])}
    saved = [(g, g["momentum"], g["weight_decay"]) for g in groups if id(g) in mine]
    for g, _, _ in saved:
        g["momentum"], g["weight_decay"] = 0.0, 0.0
    try:
        yield
    finally:
        for g, momentum, weight_decay in saved:
            g["momentum"], g["weight_decay"] = momentum, weight_decay


@contextmanager
def direction_step(optimizer: Any) -> Iterator[None]:
    """Replace an Adam/AdamW ``optimizer.step`` for one call by ``w <- w - lr (d + decoupled_wd w)``,
    ``d`` the gradient (the delivered mean direction); the optimizer's own moments are not used."""
    decoupled = _decoupled(optimizer)

    @torch.no_grad()
    def step(closure: Optional[Callable[[], Any]] = None) -> Any:
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in optimizer.param_groups:
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if decoupled and group.get("weight_decay"):
                    p.mul_(1.0 - lr * float(group["weight_decay"]))
                p.add_(p.grad, alpha=-lr)
        return loss

    optimizer.step = step
    try:
        yield
    finally:
        del optimizer.step  # back to the class's own step


class MomentumTakeover:
    """The optimizer settings a momentum-correcting codec reads, frozen for the length of one step.

    ``optimizers()`` and ``names()`` give the live optimizers and ``id(parameter) -> name``.
    :meth:`settings` is what the codec calls at every reduction: inside :meth:`step` (where
    automatic optimization runs backward) the settings read before the optimizer's momentum was
    set to 0; elsewhere (manual optimization) read live."""

    def __init__(self, optimizers: Callable[[], list], names: Callable[[], Mapping[int, str]], warn: Warn) -> None:
        self.optimizers, self.names, self.warn = optimizers, names, warn
        self._frozen: Optional[dict] = None
        #: True while an Adam direction is being applied (it is normalized already)
        self.applying_direction = False

    def settings(self) -> dict:
        if self._frozen is not None:
            return self._frozen
        return read_settings(self.optimizers(), self.names(), self.warn)[0]

    @contextmanager
    def step(self, optimizer: Any) -> Iterator[None]:
        """Around one optimizer step whose gradients are a delivered velocity or direction."""
        names = self.names()
        self._frozen, groups = read_settings(list(self.optimizers()) or [optimizer], names, self.warn)
        takes_direction = isinstance(optimizer, ADAM_OPTIMIZERS) and any(
            names.get(id(p)) in self._frozen for g in optimizer.param_groups for p in g["params"])
        try:
            if takes_direction:
                self.applying_direction = True
                with direction_step(optimizer):
                    yield
            else:
                with momentum_off(groups, optimizer):
                    yield
        finally:
            self._frozen, self.applying_direction = None, False
