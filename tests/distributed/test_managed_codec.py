"""A lossy codec across fault-tolerant replica groups (:class:`~gradsync.comm.managed.ManagedCodec`), on torchft's
own quorum and process group: three one-process groups at a lighthouse that forms a quorum of two.

Round 1: groups 0 and 1 alone. Round 2: group 2 joins behind them, so it heals; it holds a residual from "its
checkpoint" and a pseudo-gradient a thousand times the others'. Round 3: group 0's round fails (a collective
error reported to its Manager) and is dropped. What the math guarantees is asserted: every group gets the
same mean; it is the mean of the participants' inputs within int8's rounding (two hops of at most one level
of a chunk's scale each), far from any mean that counts the healing group or divides by three; the healing
group keeps no residual; the dropped round leaves group 0's residuals as they were.
"""

import os
import time

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="the ft extra (pip install gradsync[ft]) is not installed")

from harness import torchft_context  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SIZES = (1000, 77)  # two tensors, one not a multiple of the chunk size


def _inputs(group: int, scale: float) -> list:
    gen = torch.Generator().manual_seed(100 + group)
    return [scale * torch.randn(n, generator=gen) for n in SIZES]


def _group(index: int, lighthouse: str, out: str, round1_done, joining, everyone) -> None:
    from gradsync.comm import CodecSpec, CommLedger
    from gradsync.comm.managed import FaultToleranceConfig, ManagedCodec, ReplicaGroup
    from gradsync.strategies.periodic import _JoinedRound

    torch.set_num_threads(1)
    results: dict = {"rounds": {}}
    if index == 2:
        round1_done.wait(60)
    config = FaultToleranceConfig(lighthouse=lighthouse, replica_group=index, replica_groups=3, quorum_timeout=60,
                                  timeout=30)
    replicas = ReplicaGroup(config, state_dict=lambda: {"w": torch.zeros(3)}, load_state_dict=lambda s: None,
                            ledger=CommLedger())
    reducer = CodecSpec.parse("int8", {}, None).build(ledger=replicas.ledger, group=replicas.pg,
                                                      wrap=lambda codec: ManagedCodec(codec, replicas))
    rounds = _JoinedRound(replicas, lambda: reducer)  # diloco's coordinator of rounds across groups
    names = ["a", "b"]
    if index == 2:  # a residual restored from an old checkpoint of the process this group was
        reducer.load_state_dict({"residuals": {n: torch.full((k,), 5.0) for n, k in zip(names, SIZES)}})

    def round_(number, tensors, fail=False):
        rounds.begin_round()
        healing = replicas.healing
        before = {n: t.clone() for n, t in reducer.residuals.pieces.items()}
        means = reducer.reduce(tensors, names=names).wait()
        if fail:
            replicas.report_error(RuntimeError("a peer died during the round"))
        ok = rounds.commit()  # a dropped round rolls the residuals back
        results["rounds"][number] = ({"means": [m.clone() for m in means], "inputs": [t.clone() for t in tensors],
                                  "residual_before": before, "healing": healing, "committed": ok,
                                  "participants": replicas.participants,
                                  "residual_after": {n: t.clone() for n, t in reducer.residuals.pieces.items()}})

    try:
        if index < 2:
            round_(1, _inputs(index, 1.0))
            round1_done.set()
        # group 2 asks first: groups that all held the last quorum form the next one at once ("fast quorum")
        if index == 2:
            joining.set()
        else:
            joining.wait(60)
            time.sleep(1.0)
        round_(2, _inputs(index, 1000.0 if index == 2 else 1.0))
        everyone.wait(60)
        round_(3, _inputs(10 + index, 1.0), fail=index == 0)
        results["heals"] = replicas.telemetry.heals
        torch.save(results, os.path.join(out, f"group{index}.pt"))
    finally:
        replicas.shutdown()
    os._exit(0)  # torchft's threads can abort the interpreter's teardown after the work is saved


def _bound(*inputs) -> float:
    """int8's error on a mean: each of two hops rounds an entry by at most one level (scale / 127) of a
    chunk whose scale is at most the largest input (first hop) or the largest mean (second)."""
    largest = max(float(t.abs().max()) for t in inputs)
    return 2.5 * largest / 127


def test_an_int8_round_across_replica_groups_counts_the_participants_only(tmp_path, monkeypatch):
    from torchft.coordination import LighthouseServer

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("GRADSYNC_FT_HOSTNAME", "127.0.0.1")
    monkeypatch.setenv("RUST_LOG", "warn")
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000)
    lighthouse = server.address()
    ctx = torchft_context()
    round1_done, joining, everyone = ctx.Event(), ctx.Event(), ctx.Barrier(3)
    procs = [ctx.Process(target=_group, args=(g, lighthouse, str(tmp_path), round1_done, joining, everyone))
             for g in range(3)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(100)
        assert [p.exitcode for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.shutdown()
    got = [torch.load(tmp_path / f"group{g}.pt", weights_only=False) for g in range(3)]

    # round 1: the two groups' mean
    r = [got[g]["rounds"][1] for g in (0, 1)]
    assert all(x["participants"] == 2 and x["committed"] for x in r)
    for k in range(len(SIZES)):
        assert torch.equal(r[0]["means"][k], r[1]["means"][k])
        by_hand = (r[0]["inputs"][k] + r[1]["inputs"][k]) / 2
        assert (r[0]["means"][k] - by_hand).abs().max() <= _bound(r[0]["inputs"][k], r[1]["inputs"][k])

    # round 2: group 2 heals; the mean is over groups 0 and 1 (their inputs plus their residuals), on all three
    r = [got[g]["rounds"][2] for g in range(3)]
    assert [x["healing"] for x in r] == [False, False, True] and all(x["participants"] == 2 for x in r)
    assert got[2]["heals"] == 1 and all(x["committed"] for x in r)
    for k, name in enumerate(("a", "b")):
        sent = [r[g]["inputs"][k] + r[g]["residual_before"][name] for g in (0, 1)]
        by_hand = (sent[0] + sent[1]) / 2
        assert torch.equal(r[0]["means"][k], r[1]["means"][k]) and torch.equal(r[0]["means"][k], r[2]["means"][k])
        assert (r[0]["means"][k] - by_hand).abs().max() <= _bound(*sent)
        # (counting the healing group's thousandfold input, or dividing by three, misses by far more)
        assert (by_hand - (sent[0] + sent[1] + r[2]["inputs"][k]) / 3).abs().max() > 100 * _bound(*sent)
        assert (by_hand - (sent[0] + sent[1]) / 3).abs().max() > 10 * _bound(*sent)
        # the healing group's restored residual was there before, and none is left after
        assert torch.equal(r[2]["residual_before"][name], torch.full((SIZES[k],), 5.0))
        assert torch.equal(r[2]["residual_after"][name], torch.zeros(SIZES[k]))
        # the others keep what int8 did not send
        assert r[0]["residual_after"][name].abs().max() > 0

    # round 3: group 0's round failed and was dropped: its residuals are as they were before it
    r = [got[g]["rounds"][3] for g in range(3)]
    assert [x["committed"] for x in r] == [False, True, True] and all(x["participants"] == 3 for x in r)
    before = got[0]["rounds"][2]["residual_after"]
    assert all(torch.equal(r[0]["residual_after"][n], before[n]) for n in before)
    assert any(not torch.equal(r[1]["residual_after"][n], got[1]["rounds"][2]["residual_after"][n]) for n in before)
