"""PeriodicAveraging in plain torch on two gloo ranks (no Lightning): DiLoCo's outer step and local
SGD through a lossy codec, against hand computations."""

import pytest
import torch

from gradsync.algorithms import LocalAverage, OuterStep, PeriodicAveraging, Schedule
from harness import run_gloo

pytestmark = pytest.mark.timeout(60)


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def _train(rank, payload, schedule, codec, steps):
    """Plain torch: a linear model, SGD with momentum, this rank's own data; rounds hooked on the optimizer."""
    from gradsync.comm import build_reducer
    from gradsync.comm.ledger import CommLedger

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    ledger = CommLedger(world_size=2)
    algo = PeriodicAveraging(model, payload, schedule, ledger=ledger,
                             reducer=lambda: build_reducer(codec, ledger=ledger, error_feedback=codec != "identity"))
    events = []

    def record(event, facts):
        facts = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in facts.items()}
        if event == "issue" and getattr(payload, "last_common", None) is not None:
            facts["last"] = _flat(payload.last_common)  # the point this round's change is measured from
        events.append((event, facts))

    algo.listeners.append(record)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algo.attach(optimizer)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(steps, 8, 6, generator=g), torch.randn(steps, 8, 2, generator=g)
    for t in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[t]), y[t]).backward()
        optimizer.step()
    return {"events": events, "final": _flat(model.parameters()), "wire": ledger.wire_bytes, "state": algo.state_dict()}


def _diloco(rank, world):
    payload = OuterStep(outer_lr=0.5, outer_momentum=0.8, momentum_warmup=2)
    return _train(rank, payload, Schedule(period=3), "identity", steps=9)


def test_diloco_outer_nesterov_step_by_hand(tmp_path):
    ranks = run_gloo(_diloco, 2, tmp=tmp_path)
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    theta, m = _flat(start.parameters()), None
    issued = [[f for e, f in r["events"] if e == "issue"] for r in ranks]
    assert [f["step"] for f in issued[0]] == [3, 6, 9]
    for t, (a, b) in enumerate(zip(issued[0], issued[1]), start=1):
        x0, x1 = _flat(a["values"]), _flat(b["values"])
        assert not torch.equal(x0, x1)  # each rank trained on its own data
        assert (_flat(a["payload"]) - (theta - x0)).abs().max() <= 1e-6  # the pseudo-gradient theta - x
        delta = ((theta - x0) + (theta - x1)) / 2
        mu = max(0.5, 0.8 * min(1.0, t / 2))  # the warm-up: 0.5, 0.8, 0.8
        m = delta if m is None else mu * m + delta
        theta = theta - 0.5 * (delta + mu * m)  # Nesterov
    for r in ranks:
        assert (r["final"] - theta).abs().max() <= 1e-6
        assert torch.equal(r["final"], _flat(r["state"]["global_params"]))  # every rank restarts from theta
        assert r["state"]["num_steps"] == 9 and r["state"]["outer_steps"] == [3]
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])
    n = theta.numel()
    assert ranks[0]["wire"] == 3 * 4 * n  # three fp32 all-reduces of 2(N-1)/N x 4 bytes per entry, N = 2


def _local_int8(rank, world):
    return _train(rank, LocalAverage(sends_changes=True), Schedule(period=2), "int8", steps=5)


def test_local_sgd_through_int8_moves_the_common_point_by_the_mean_change(tmp_path):
    ranks = run_gloo(_local_int8, 2, tmp=tmp_path)
    issues = [[f for e, f in r["events"] if e == "issue"] for r in ranks]
    consensus = [[f for e, f in r["events"] if e == "consensus"] for r in ranks]
    assert [f["step"] for f in issues[0]] == [2, 4]
    torch.manual_seed(0)  # the first common point: the initial model
    start = _flat(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).parameters())
    assert torch.equal(issues[0][0]["last"], start) and torch.equal(issues[1][0]["last"], start)
    for k in range(2):
        exact = (_flat(issues[0][k]["payload"]) + _flat(issues[1][k]["payload"])) / 2
        for r in (0, 1):
            last, x = issues[r][k]["last"], _flat(issues[r][k]["values"])
            assert torch.equal(_flat(issues[r][k]["payload"]), last - x), f"round {k + 1}: rank {r} did not send last - x"
            mean, common = _flat(consensus[r][k]["means"]), _flat(consensus[r][k]["common"])
            assert torch.equal(common, last - mean), f"round {k + 1}: the new common point is not last - mean"
            assert not torch.equal(mean, exact) and torch.dot(mean, exact) > 0  # compressed, the right way
        assert torch.equal(_flat(consensus[0][k]["common"]), _flat(consensus[1][k]["common"]))
        if k == 0:
            assert torch.equal(issues[0][1]["last"], _flat(consensus[0][0]["common"]))  # the next round's point
    # after the last round (step 4) one local step (5): the end is not synced here, so they differ
    assert not torch.equal(ranks[0]["final"], ranks[1]["final"])
    assert all(r["state"]["reducer"]["residuals"] for r in ranks)  # error feedback kept per rank
