"""The parameter server's staleness rule and update arithmetic, without processes."""

import pytest
import torch

from gradsync.algorithms.param_server import ShardState, split_shards
from gradsync.comm.ps import ServerError


def shard(s, workers=3, lr=1.0, scaling="none"):
    return ShardState([torch.zeros(2)], lambda ps: torch.optim.SGD(ps, lr=lr), [0], num_workers=workers,
                      max_staleness=s, staleness_scaling=scaling)


def grad(*values):
    return [torch.tensor(values, dtype=torch.float32)]


def test_bound_0_averages_one_gradient_per_worker_per_update():
    sh = shard(0)
    for w in range(3):
        assert sh.try_pull(w)[0] == 0
    sh.push(0, 0, 1.0, [1.0], grad(3.0, 0.0))
    sh.push(1, 0, 1.0, [1.0], grad(6.0, 3.0))
    assert sh.version == 0 and sh.try_pull(0) is None  # waits for the third worker
    sh.push(2, 0, 1.0, [1.0], grad(0.0, 3.0))
    assert sh.version == 1 and sh.gradients_applied == 3
    assert torch.allclose(sh.params[0].detach(), torch.tensor([-3.0, -2.0]))  # w - lr * mean
    assert dict(sh.staleness) == {0: 3}


def test_bound_1_applies_each_gradient_and_never_exceeds_it():
    sh = shard(1)
    for w in range(3):
        sh.try_pull(w)
    sh.push(0, 0, 1.0, [1.0], grad(1.0, 1.0))
    assert sh.version == 1  # applied at once: others are 1 behind, within the bound
    assert sh.try_pull(0)[0] == 1
    sh.push(0, 1, 1.0, [1.0], grad(1.0, 1.0))
    assert sh.version == 1  # a second step would leave workers 1 and 2 two versions behind
    assert sh.try_pull(0) is None  # and worker 0 may not compute from version 1 twice
    sh.push(1, 0, 1.0, [1.0], grad(1.0, 1.0))
    assert sh.version == 1  # worker 2 still holds version 0
    sh.push(2, 0, 1.0, [1.0], grad(1.0, 1.0))
    assert sh.version == 2 and sh.updates == 2
    assert dict(sh.staleness) == {0: 2, 1: 2} and max(sh.staleness) <= 1


def test_weighted_pushes_give_the_weighted_mean():
    sh = shard(0, workers=2)
    sh.try_pull(0), sh.try_pull(1)
    sh.push(0, 0, 3.0, [1.0], grad(3.0, 0.0))  # sum over 3 samples
    sh.push(1, 0, 1.0, [1.0], grad(1.0, 4.0))  # sum over 1 sample
    assert torch.allclose(sh.params[0].detach(), -torch.tensor([4.0, 4.0]) / 4)


def test_read_waits_for_computing_workers_and_flushes_pending():
    sh = shard(0, workers=2)
    sh.try_pull(0), sh.try_pull(1)
    sh.push(0, 0, 1.0, [1.0], grad(2.0, 2.0))
    assert sh.try_read() is None  # worker 1 is computing
    sh.push(1, 0, 1.0, [0.5], None)  # worker 1 skips (non-finite): nothing pending from it
    version, flats = sh.try_read()
    assert version == 1 and torch.allclose(flats[0], torch.tensor([-2.0, -2.0]))  # lr of the gradient push
    assert sh.skipped == 1 and sh.try_pull(1)[0] == 1


def test_protocol_errors_name_the_worker():
    sh = shard(2)
    with pytest.raises(ServerError, match="worker 1 pushed a gradient for version 0"):
        sh.push(1, 0, 1.0, [1.0], grad(1.0, 1.0))
    sh.try_pull(1)
    with pytest.raises(ServerError, match="worker 1 pulled twice"):
        sh.try_pull(1)


def test_state_round_trip_keeps_optimizer_state():
    sh = ShardState([torch.ones(2)], lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), [0], num_workers=1,
                    max_staleness=0)
    sh.try_pull(0)
    sh.push(0, 0, 1.0, [0.1], grad(1.0, 1.0))
    state = sh.state_dict([7])
    again = ShardState([torch.zeros(2)], lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), [0], num_workers=1,
                       max_staleness=0, version=state["version"])
    again.load([7], state["params"], state["optimizer"])
    assert again.version == 1 and torch.equal(again.params[0], sh.params[0])
    assert torch.equal(again.optimizer.state[again.params[0]]["momentum_buffer"],
                       sh.optimizer.state[sh.params[0]]["momentum_buffer"])


def test_split_shards_balances_and_covers_every_parameter():
    shards = split_shards([100, 10, 60, 50, 5], 2)
    assert sorted(i for s in shards for i in s) == [0, 1, 2, 3, 4]
    loads = [sum([100, 10, 60, 50, 5][i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= 10
    with pytest.raises(ValueError, match="exceeds the number of parameters"):
        split_shards([1, 2], 3)


@pytest.mark.parametrize("scaling, expected", [("none", -4.0), ("inverse", -3.0)])
def test_inverse_scaling_weighs_a_gradient_two_updates_late_by_half(scaling, expected):
    sh = shard(2, workers=2, scaling=scaling)
    sh.try_pull(0), sh.try_pull(1)  # both at version 0
    for v in (0, 1):  # worker 0 runs two updates ahead
        sh.push(0, v, 1.0, [1.0], grad(1.0, 1.0))
        sh.try_pull(0)
    assert sh.version == 2
    sh.push(1, 0, 1.0, [1.0], grad(2.0, 2.0))  # computed at 0, applied at 2: staleness 2
    assert dict(sh.staleness) == {0: 2, 2: 1}  # worker 0 always pulled fresh parameters
    assert torch.allclose(sh.params[0].detach(), torch.tensor([expected, expected]))
