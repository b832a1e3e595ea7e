"""compressed's optimizer side without Lightning: the settings read from the optimizers, and one step
that applies a delivered velocity (SGD) or direction (Adam/AdamW) once, checked by hand."""

import warnings

import pytest
import torch

from gradsync.algorithms.compressed import MomentumTakeover, read_settings
from gradsync.comm.error_feedback import AdamMoments, SGDMomentum


def _params(*values):
    return [torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for v in values]


def _takeover(optimizers, params, warned=None):
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    return MomentumTakeover(lambda: optimizers, lambda: names,
                            lambda key, msg: (warned if warned is not None else []).append((key, msg)))


def test_settings_are_read_by_name_from_sgd_adam_and_adamw():
    a, b, c, d, e = _params([1.0], [2.0], [3.0], [4.0], [5.0])
    sgd = torch.optim.SGD([{"params": [a], "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                           {"params": [b], "momentum": 0.0}], lr=0.1)
    adam = torch.optim.Adam([c], lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    adamw = torch.optim.AdamW([d], lr=0.1, weight_decay=0.1)
    rms = torch.optim.RMSprop([e], lr=0.1)
    warned: list = []
    names = {id(p): n for p, n in zip((a, b, c, d, e), "abcde")}
    settings, groups = read_settings([sgd, adam, adamw, rms], names, lambda k, m: warned.append(k))
    assert settings == {"a": SGDMomentum(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01),
                        "c": AdamMoments(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
                        # AdamW's decay is decoupled: applied by the step, not added to the gradient
                        "d": AdamMoments(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)}
    assert groups == [sgd.param_groups[0]]  # b has no momentum to take over
    assert warned == ["RMSprop"]


def test_sgd_steps_apply_the_delivered_velocity_once():
    # The gradient holds what the codec delivered (a velocity with momentum and weight decay in it):
    # the step must be w <- w - lr * v, twice, with no momentum buffer or decay of the optimizer's own.
    (w,) = _params([1.0, -2.0])
    sgd = torch.optim.SGD([w], lr=0.5, momentum=0.9, weight_decay=0.1)
    takeover = _takeover([sgd], [w])
    expected = w.detach().clone()
    for v in ([0.25, 1.0], [-0.5, 0.75]):
        w.grad = torch.tensor(v, dtype=torch.float64)
        with takeover.step(sgd):
            assert takeover.settings() == {"p0": SGDMomentum(momentum=0.9, weight_decay=0.1)}  # frozen
            assert sgd.param_groups[0]["momentum"] == 0.0 and sgd.param_groups[0]["weight_decay"] == 0.0
            sgd.step()
        expected -= 0.5 * torch.tensor(v, dtype=torch.float64)
        assert torch.equal(w.detach(), expected)
    # the user's settings are back for the scheduler and the checkpoint
    assert sgd.param_groups[0]["momentum"] == 0.9 and sgd.param_groups[0]["weight_decay"] == 0.1
    assert not takeover.applying_direction


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_steps_apply_the_delivered_direction_with_decoupled_decay(cls):
    (w,) = _params([1.0, -2.0])
    opt = cls([w], lr=0.5, weight_decay=0.1)
    takeover = _takeover([opt], [w])
    d = torch.tensor([0.25, -1.0], dtype=torch.float64)
    w.grad = d.clone()
    before = w.detach().clone()
    with takeover.step(opt):
        assert takeover.applying_direction
        opt.step()
    decay = 1.0 - 0.5 * 0.1 if cls is torch.optim.AdamW else 1.0  # Adam's L2 decay is in the moments
    assert torch.equal(w.detach(), before * decay - 0.5 * d)
    assert not opt.state  # the optimizer's own moments are not used (the codec keeps each rank's)
    assert "step" not in vars(opt) and not takeover.applying_direction  # the class's own step is back
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()  # and it is Adam's again: it builds its moments
    assert opt.state[w]["step"] == 1
