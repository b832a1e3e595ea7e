"""local_sgd / diloco options, registration and resharding, without processes."""

import warnings

import lightning as L
import pytest
import torch

from gradsync.errors import OptionError
from gradsync.strategies import STRATEGIES, DiLoCoStrategy, LocalSGDStrategy


@pytest.mark.parametrize("make, option", [
    (lambda: LocalSGDStrategy(period=0), "period"),
    (lambda: LocalSGDStrategy(period=2.5), "period"),
    (lambda: LocalSGDStrategy(warmup_steps=-1), "warmup_steps"),
    (lambda: DiLoCoStrategy(period=0), "period"),
    (lambda: DiLoCoStrategy(outer_lr=-0.7), "outer_lr"),
    (lambda: DiLoCoStrategy(outer_lr=0.0), "outer_lr"),
    (lambda: DiLoCoStrategy(outer_momentum=1.0), "outer_momentum"),
])
def test_bad_options_fail_with_one_line(make, option):
    with pytest.raises(OptionError) as err:
        make()
    msg = str(err.value)
    assert msg.startswith(f"{option}=") and "\n" not in msg and "must be" in msg


def test_registered_under_one_name_each():
    assert STRATEGIES["local_sgd"] is LocalSGDStrategy and STRATEGIES["diloco"] is DiLoCoStrategy
    trainer = L.Trainer(strategy="diloco", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, DiLoCoStrategy)
    opts = DiLoCoStrategy(period=4, overlap=True).options
    assert opts["period"] == 4 and opts["overlap"] is True and opts["outer_lr"] == 0.7
    assert opts["outer_momentum"] == 0.9


def _part(rank_value, **extra):
    return {"ledger": {"wire_bytes": 10}, "num_steps": 13,
            "local_params": {"w": torch.full((3,), float(rank_value)), "n": torch.tensor(7)},
            "local_optimizer_states": [{"state": {}, "param_groups": []}], "anchor": None, "pending": None,
            **extra}


def test_reshard_keeps_shared_state_averages_local_and_warns():
    g = [torch.arange(3.0)]
    outer = {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": []}
    parts = [_part(r, global_params=g, outer_optimizer=outer) for r in (0, 1)]
    for p in parts:  # an overlapped round in flight: its anchor is this rank's own point
        p["pending"] = {"fragment": 0, "issued_at": 12, "means": [torch.zeros(3)]}
    parts[1]["anchor"] = [torch.zeros(3)]
    with pytest.warns(UserWarning) as caught:
        state = DiLoCoStrategy(period=4).reshard_algorithm_state(parts, saved_world_size=2)
    msg = str(caught[0].message)
    assert "written by 2 processes" in msg and "local_optimizer_states" in msg and "pending" in msg
    assert "num_steps" in msg and "global_params" in msg
    assert state["num_steps"] == 13  # the step count survives any resume
    assert state["global_params"] is g and state["outer_optimizer"] is outer
    assert torch.equal(state["local_params"]["w"], torch.full((3,), 0.5))
    assert int(state["local_params"]["n"]) == 7
    assert "local_optimizer_states" not in state and state.get("pending") is None


def test_reshard_keeps_an_agreed_fragment_in_flight():
    pending = {"fragment": 1, "issued_at": 10, "means": [torch.ones(3)]}
    outer = {"state": {}, "param_groups": []}
    parts = [_part(r, global_params=[torch.zeros(3)], outer_optimizer=outer, pending=pending,
                   reducer={"residuals": {"w": torch.ones(3)}}) for r in (0, 1)]
    with pytest.warns(UserWarning) as caught:
        state = DiLoCoStrategy(period=4, fragments=2, sync_delay=1).reshard_algorithm_state(parts, 2)
    msg = str(caught[0].message)
    assert "kept num_steps, global_params, outer_optimizer, pending" in msg
    assert "codec state" in msg  # per-rank error-feedback residuals are reset
    assert state["pending"] is pending and "reducer" not in state


def test_local_sgd_reshard_has_no_global_state():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        state = LocalSGDStrategy(period=4).reshard_algorithm_state([_part(1), _part(3), _part(5)], 3)
    assert set(state) == {"ledger", "num_steps", "local_params"}
    assert torch.equal(state["local_params"]["w"], torch.full((3,), 3.0))


def test_outer_momentum_warmup_ramp():
    # max(min(mu, 0.5), mu * min(1, t / W)): the floor 0.5 for the first two outer steps, then the ramp
    s = DiLoCoStrategy(period=8, outer_momentum=0.9, outer_momentum_warmup=4)
    assert [s.momentum_at(t) for t in range(1, 7)] == pytest.approx([0.5, 0.5, 0.675, 0.9, 0.9, 0.9], abs=1e-12)
    # a momentum below the floor is used from the start; W = 0 is no warm-up
    assert DiLoCoStrategy(outer_momentum=0.3, outer_momentum_warmup=4).momentum_at(1) == 0.3
    assert DiLoCoStrategy(outer_momentum=0.9, outer_momentum_warmup=0).momentum_at(1) == 0.9
    # the default spans ceil(400 / period) outer steps: period 100 reaches 0.9 at t = 4, period 8 at t = 50
    assert DiLoCoStrategy(period=100).momentum_at(3) == pytest.approx(0.675)
    assert DiLoCoStrategy(period=8).momentum_at(49) < 0.9 == DiLoCoStrategy(period=8).momentum_at(50)


def test_rounds_with_the_sparse_codec_default_to_sparseloco_outer_setting():
    from gradsync.strategies.compressed import CompressedStrategy

    sparse = DiLoCoStrategy(codec="sparseloco")
    assert (sparse.outer_lr, sparse.outer_momentum, sparse.codec_spec.options["error_decay"]) == (2.0, 0.0, 0.95)
    assert sparse.options["outer_lr"] == 2.0 and sparse.options["outer_momentum"] == 0.0
    dense = DiLoCoStrategy(codec="int8")
    assert (dense.outer_lr, dense.outer_momentum, dense.codec_spec.options["error_decay"]) == (0.7, 0.9, 1.0)
    assert LocalSGDStrategy(codec="sparseloco").codec_spec.options["error_decay"] == 0.95
    # what is given is kept
    given = DiLoCoStrategy(codec="sparseloco", outer_lr=0.7, outer_momentum=0.9, error_decay=1.0)
    assert (given.outer_lr, given.outer_momentum, given.codec_spec.options["error_decay"]) == (0.7, 0.9, 1.0)
    # without error feedback there is no residual to decay (and no error for the default)
    assert DiLoCoStrategy(codec="sparseloco", error_feedback=False).codec_spec.options["error_decay"] == 1.0
    # the gradient codec keeps the whole residual (momentum correction carries the rest)
    assert CompressedStrategy(codec="sparseloco").codec_spec.options["error_decay"] == 1.0
