"""local_sgd and diloco: equivalences, agreement after rounds, DiLoCo by hand, overlap, resume."""

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import DiLoCoStrategy, LocalSGDStrategy, SyncStrategy
from gradsync.strategies.parts import read_parts
from harness import ValAccuracy, assert_resumed_at, digest, fit, max_abs_diff, run_gloo

pytestmark = pytest.mark.timeout(120)


def model(momentum=0.0, seed=0):
    L.seed_everything(seed, verbose=False)
    return DigitsClassifier(lr=0.1, momentum=momentum)


class RecordHashes(Callback):
    """After every optimizer step, a hash of this rank's parameters (and DiLoCo's outer state)."""

    def __init__(self, out):
        self.out, self.rows = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = trainer.strategy
        outer = []
        if getattr(s, "global_params", None) is not None:
            outer = list(s.global_params) + [st["momentum_buffer"] for st in s.outer_optimizer.state.values()]
        self.rows.append((trainer.global_step, digest(pl_module.parameters()), digest(outer) if outer else None))

    def on_fit_end(self, trainer, pl_module):
        final = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        s = trainer.strategy
        torch.save({"rows": self.rows, "final": final, "ledger": s.ledger.summary(),
                    "in_flight": s.algorithm.in_flight is not None}, self.out / f"hashes{trainer.global_rank}.pt")


def test_local_sgd_period_1_equals_sync(tmp_path):
    sync = fit(model(), DigitsData(batch_size=16), strategy=SyncStrategy(), devices=2, max_steps=20,
               out=tmp_path / "sync")
    local = fit(model(), DigitsData(batch_size=16), strategy=LocalSGDStrategy(period=1), devices=2,
                max_steps=20, out=tmp_path / "local")
    diff = max_abs_diff(local[0]["params"], sync[0]["params"])
    assert diff <= 1e-5, f"local_sgd period 1 differs from sync by {diff}"
    assert max_abs_diff(local[0]["params"], model().state_dict()) > 1e-3  # it trained
    # one round per step, each the size of one step's gradients: the same bytes as sync
    assert local[0]["ledger"]["wire_bytes"] == sync[0]["ledger"]["wire_bytes"]
    assert local[0]["ledger"]["compression_ratio"] == 1.0


@pytest.mark.parametrize("strategy", [
    LocalSGDStrategy(period=4, warmup_steps=2),
    DiLoCoStrategy(period=4, warmup_steps=2),
], ids=["local_sgd", "diloco"])
def test_ranks_identical_after_every_round_and_differ_between(tmp_path, strategy):
    fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=strategy, devices=2, max_steps=15,
        out=tmp_path, callbacks=(RecordHashes(tmp_path),))
    r0, r1 = (torch.load(tmp_path / f"hashes{r}.pt", weights_only=False) for r in (0, 1))
    rounds = {2 + 4 * k for k in range(1, 4)}  # warm-up ends at 2, then every 4 steps: 6, 10, 14
    for (step, p0, o0), (_, p1, o1) in zip(r0["rows"], r1["rows"]):
        if step <= 2 or step in rounds:
            assert p0 == p1, f"ranks differ after step {step} (a warm-up step or an averaging round)"
        else:
            assert p0 != p1, f"ranks agree after local step {step}: the step was not local"
        assert o0 == o1, f"outer state differs after step {step}"
    assert len(r0["rows"]) == 15
    if isinstance(strategy, DiLoCoStrategy):
        assert r0["rows"][-1][2] is not None
    # fit ends mid-period (15): one more round, so every rank leaves with the same model
    assert max_abs_diff(r0["final"], r1["final"]) == 0.0


class AtTrainEnd(Callback):
    """What a user's callback sees in on_train_end (where ModelCheckpoint writes its last save)."""

    def __init__(self, out):
        self.out = Path(out)

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy
        torch.save({"params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "in_flight": s.algorithm.in_flight is not None}, self.out / f"train_end{trainer.global_rank}.pt")


@pytest.mark.parametrize("make", [
    lambda: LocalSGDStrategy(period=4),
    lambda: LocalSGDStrategy(period=4, overlap=True),
    lambda: DiLoCoStrategy(period=4, fragments=2, sync_delay=1, fragment_alpha=0.5),
], ids=["local_sgd", "local_sgd-overlap", "diloco-streaming"])
def test_callbacks_see_the_model_after_the_final_round(tmp_path, make):
    # 15 steps: mid-period, so the ranks disagree when training stops and the end of fit must sync them
    ranks = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=make(), devices=2, max_steps=15,
                out=tmp_path, callbacks=(AtTrainEnd(tmp_path),))
    seen = [torch.load(tmp_path / f"train_end{r}.pt", weights_only=False) for r in (0, 1)]
    assert max_abs_diff(seen[0]["params"], seen[1]["params"]) == 0.0, "a callback saw ranks that disagree"
    assert not seen[0]["in_flight"] and not seen[1]["in_flight"]
    for r, s in zip(ranks, seen):
        assert max_abs_diff(r["params"], s["params"]) == 0.0  # what the callback saw is what fit returns


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


class CaptureRounds(DiLoCoStrategy):
    """Records every rank's flat parameters just before each round (the algorithm's ``issue`` event)."""

    def on_train_start(self):
        super().on_train_start()
        self.captured = []
        self.algorithm.listeners.append(
            lambda event, f: self.captured.append(flat(f["values"])) if event == "issue" and f["kind"] == "round"
            else None)

    def algorithm_state_dict(self):
        return {**super().algorithm_state_dict(), "captured": getattr(self, "captured", [])}


@pytest.mark.parametrize("warmup", [None, 0, 2], ids=["default-warmup", "no-warmup", "warmup-2"])
def test_diloco_two_rank_outer_nesterov_step_by_hand(tmp_path, warmup):
    """DiLoCo written out in the test: the streaming implementation with one fragment and no delay
    (set explicitly here) is the plain DiLoCo of the paper, outer step by outer step."""
    eta, mu, period, rounds = 0.5, 0.8, 3, 3
    # the outer momentum of the t-th outer step: mu * min(1, t / W), W = ceil(400 / period) by default,
    # never below min(mu, 0.5): with W = 2 the steps use 0.5, 0.8, 0.8; by default 0.5 throughout
    w = math.ceil(400 / period) if warmup is None else warmup
    mu_at = [mu if w == 0 else max(min(mu, 0.5), mu * min(1.0, t / w)) for t in range(1, rounds + 1)]
    theta0 = torch.cat([p.detach().reshape(-1) for p in model(momentum=0.9).parameters()])
    ranks = fit(model(momentum=0.9), DigitsData(batch_size=16),
                strategy=CaptureRounds(period=period, outer_lr=eta, outer_momentum=mu, outer_momentum_warmup=warmup,
                                       fragments=1, sync_delay=0),
                devices=2, max_steps=rounds * period, out=tmp_path)
    theta, m = theta0.clone(), torch.zeros_like(theta0)
    for k in range(rounds):
        local = [r["algorithm"]["captured"][k] for r in ranks]
        assert not torch.equal(local[0], local[1])
        delta = ((theta - local[0]) + (theta - local[1])) / 2  # the averaged pseudo-gradient
        m = mu_at[k] * m + delta
        theta = theta - eta * (delta + mu_at[k] * m)  # Nesterov
    for r in ranks:
        g = torch.cat([t.reshape(-1) for t in r["algorithm"]["global_params"]])
        assert (g - theta).abs().max() <= 1e-6
        final = torch.cat([r["params"][k].reshape(-1) for k in r["params"]])
        assert torch.equal(final, g)  # every rank restarts from the global parameters
    outer = ranks[0]["algorithm"]["outer_optimizer"]["state"]
    mom = torch.cat([outer[i]["momentum_buffer"].reshape(-1) for i in sorted(outer)])
    assert (mom - m).abs().max() <= 1e-6


class CaptureLocalRounds(LocalSGDStrategy):
    """Records each round of a lossy-codec local SGD run: the point each rank had, the last common
    point, what it sent, the mean the reducer returned and the new common point."""

    def on_train_start(self):
        super().on_train_start()
        self.rounds = []
        self.algorithm.listeners.append(self._record)

    def _record(self, event, f):
        if event == "issue":
            indices = self.algorithm.layout.fragments[f["fragment"]]
            self.rounds.append({
                "x": [v.clone() for v in f["values"]], "sent": [t.clone() for t in f["payload"]],
                "last": [self.last_common[i].clone() for i in indices],
                "names": [self.algorithm.layout.names[i] for i in indices]})
        elif event == "consensus":
            self.rounds[-1].update(mean=[m.clone() for m in f["means"]], common=[c.clone() for c in f["common"]])

    def algorithm_state_dict(self):
        return {**super().algorithm_state_dict(), "rounds": getattr(self, "rounds", [])}


def replay_codec(rank, world, codec, payloads, names):
    """The mean of each round's payloads through a fresh reducer of ``codec`` with error feedback:
    the reduction the strategy should have run, computed apart from it."""
    from gradsync.comm import CODEC_OPTIONS, build_reducer

    reducer = build_reducer(codec, error_feedback=True, **{k: v[0] for k, v in CODEC_OPTIONS.items()})
    return [reducer.reduce(p, names=names, sync=("round", k)).wait() for k, p in enumerate(payloads[rank])]


@pytest.mark.parametrize("codec", ["int8", "sign"])
def test_local_sgd_lossy_codec_two_rank_two_rounds_by_hand(tmp_path, codec):
    """Through a lossy codec each rank sends its change since the last common point, and every rank
    moves that point by the mean change: common <- last - mean_r(last - x_r)."""
    period = 3
    start = model(momentum=0.9)
    ranks = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=CaptureLocalRounds(period=period, codec=codec),
                devices=2, max_steps=2 * period, out=tmp_path)
    rounds = [r["algorithm"]["rounds"] for r in ranks]
    assert len(rounds[0]) == len(rounds[1]) == 2
    last = [p.detach() for p in start.parameters()]  # the first common point: the initial model
    for k in range(2):
        for r in (0, 1):
            rec = rounds[r][k]
            for a, b in zip(rec["last"], last):
                assert torch.equal(a, b), f"round {k + 1}: rank {r} measured its change from the wrong point"
            for sent, lst, x in zip(rec["sent"], rec["last"], rec["x"]):
                assert torch.equal(sent, lst - x), f"round {k + 1}: rank {r} did not send last - x"
        assert not all(torch.equal(a, b) for a, b in zip(rounds[0][k]["x"], rounds[1][k]["x"]))  # trained apart
        for r in (0, 1):  # the new common point: last minus the reducer's mean, the same on both ranks
            rec = rounds[r][k]
            for c, lst, m in zip(rec["common"], rec["last"], rec["mean"]):
                assert torch.equal(c, lst - m), f"round {k + 1}: rank {r}'s new common point is not last - mean"
        for a, b in zip(rounds[0][k]["common"], rounds[1][k]["common"]):
            assert torch.equal(a, b), f"round {k + 1}: the ranks disagree after the round"
        last = rounds[0][k]["common"]
    # the means are those of the codec with error feedback over both ranks' payloads, round after round
    payloads = [[rec["sent"] for rec in rounds[r]] for r in (0, 1)]
    replayed = run_gloo(replay_codec, 2, codec, payloads, rounds[0][0]["names"], tmp=tmp_path)
    for r in (0, 1):
        for k in range(2):
            for m, ref in zip(rounds[r][k]["mean"], replayed[r][k]):
                assert torch.equal(m, ref), f"round {k + 1}: rank {r}'s mean is not the codec's"
    # ... which is a real compression of the mean change (not the exact mean), pointing its way
    for k in range(2):
        exact = torch.cat([((a + b) / 2).reshape(-1) for a, b in zip(payloads[0][k], payloads[1][k])])
        mean = torch.cat([t.reshape(-1) for t in rounds[0][k]["mean"]])
        assert not torch.equal(exact, mean)
        assert torch.dot(exact, mean) > 0
    final = [torch.cat([r["params"][n].reshape(-1) for n in rounds[0][0]["names"]]) for r in ranks]
    assert torch.equal(final[0], torch.cat([t.reshape(-1) for t in last]))  # every rank continues from it
    assert torch.equal(final[0], final[1])


class CaptureOverlap(LocalSGDStrategy):
    """Records this rank's flat parameters just before and just after each overlapped round."""

    def on_train_start(self):
        super().on_train_start()
        self.captured = []
        self.algorithm.listeners.append(
            lambda event, f: self.captured.append((f["step"], flat(f["before"]), flat(f["after"])))
            if event == "overlap" else None)

    def algorithm_state_dict(self):
        return {**super().algorithm_state_dict(), "captured": getattr(self, "captured", [])}


def test_overlap_two_rank_two_rounds_by_hand(tmp_path):
    """Each round sends this rank's point x_k and keeps training; one period later the average m_k
    arrives and the rank continues from m_k + (x - x_k): the average plus its own progress since."""
    period = 3
    ranks = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=CaptureOverlap(period=period, overlap=True),
                devices=2, max_steps=3 * period, out=tmp_path)
    rounds = [r["algorithm"]["captured"] for r in ranks]
    assert [s for s, _, _ in rounds[0]] == [period, 2 * period, 3 * period]
    sent = [[rounds[r][0][1]] for r in (0, 1)]  # round 1: nothing in flight, the point is sent as it is
    for r in (0, 1):
        assert torch.equal(rounds[r][0][2], rounds[r][0][1])
    assert not torch.equal(sent[0][0], sent[1][0])
    for k in (1, 2):  # rounds 2 and 3 land the averages of rounds 1 and 2
        mean = (sent[0][k - 1] + sent[1][k - 1]) / 2
        for r in (0, 1):
            x = rounds[r][k][1]  # after this period's local steps, before the merge
            expected = mean + (x - sent[r][k - 1])
            assert (rounds[r][k][2] - expected).abs().max() <= 1e-6, f"rank {r}, round {k + 1}"
            sent[r].append(expected)
        assert not torch.equal(sent[0][k], sent[1][k])  # each kept its own progress


@pytest.mark.parametrize("cls", [LocalSGDStrategy, DiLoCoStrategy], ids=["local_sgd", "diloco"])
def test_overlap_runs_collective_behind_local_steps(tmp_path, cls):
    period, steps = 4, 18
    ranks = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=cls(period=period, overlap=True),
                devices=2, max_steps=steps, out=tmp_path, callbacks=(RecordHashes(tmp_path),))
    numel = sum(p.numel() for p in model().parameters())
    one_round = 4 * numel  # 2(N-1)/N x 4 bytes x numel, N = 2
    for r in ranks:
        stats = r["algorithm"]["overlap_stats"]
        # rounds issued at 4, 8, 12, 16; collected at 8, 12, 16 after `period` local steps ran while
        # the collective was in flight; the end of fit (18) collects the last and runs one blocking
        # round, which nothing was in flight behind
        assert stats["rounds"] == 5 and stats["steps_in_flight"] == 3 * period + 2
        # and it had finished in the background before it was needed (on loopback it takes well
        # under a millisecond; a period of steps takes tens)
        assert stats["completed_before_needed"] >= 3
        assert r["last_step_ledger"]["collectives"] == 4 and r["last_step_ledger"]["wire_bytes"] == 4 * one_round
        assert r["ledger"]["collectives"] == 5 and r["ledger"]["wire_bytes"] == 5 * one_round
    h0, h1 = (torch.load(tmp_path / f"hashes{r}.pt", weights_only=False) for r in (0, 1))
    # overlapped ranks never agree during training (each keeps its last period of progress) ...
    assert all(a[1] != b[1] for a, b in zip(h0["rows"], h1["rows"]))
    # ... but after the final flush and one blocking round they do, with nothing left in flight
    assert max_abs_diff(h0["final"], h1["final"]) == 0.0
    for h in (h0, h1):
        assert not h["in_flight"] and h["ledger"]["wire_bytes"] == 5 * one_round


class SaveAt(Callback):
    def __init__(self, step, path):
        self.step, self.path, self.in_flight_after = step, path, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            flight = trainer.strategy.algorithm.in_flight
            # a fragment may wait for its turn to be applied, but its collective has finished
            assert flight is None or flight.future is None, "a checkpoint left a collective in flight"


@pytest.mark.parametrize("make", [
    lambda: LocalSGDStrategy(period=8, warmup_steps=3),
    lambda: LocalSGDStrategy(period=8, codec="sign"),
    lambda: DiLoCoStrategy(period=8),
    # outer steps at 4, 8, 12: the checkpoint falls mid-way up a 6-step momentum warm-up, so the
    # resumed run steps with momentum 0.6 and 0.75 only if the outer-step count came back
    lambda: DiLoCoStrategy(period=4, outer_momentum_warmup=6),
    lambda: DiLoCoStrategy(period=4, overlap=True),
    # fragment 1 is issued at 12 and lands at 15: at 14 its mean waits to be applied
    lambda: DiLoCoStrategy(period=8, fragments=2, sync_delay=3, codec="int8"),
], ids=["local_sgd", "local_sgd-sign", "diloco", "diloco-momentum-warmup", "diloco-overlap",
        "diloco-streaming-int8"])
def test_resume_mid_period_equals_uninterrupted(tmp_path, make):
    steps, at = 22, 14  # 14 is mid-period for every case (3 + 8 + 3; 8 + 6; 12 + 2)
    ckpt = tmp_path / "mid.ckpt"
    full = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=make(), devices=2, max_steps=steps,
               out=tmp_path / "full", callbacks=(SaveAt(at, ckpt),))
    parts = read_parts(ckpt)
    assert [p["num_steps"] for p in parts] == [at, at]
    assert max_abs_diff(parts[0]["local_params"], parts[1]["local_params"]) > 0  # really mid-period
    if make().fragments > 1:
        assert [p["pending"]["fragment"] for p in parts] == [1, 1]  # saved with the fragment in flight
    if make().codec != "identity":
        assert all(p["reducer"]["residuals"] for p in parts)  # and the error-feedback residuals
    if isinstance(make(), LocalSGDStrategy) and make().codec != "identity":
        assert all(p["last_common"] is not None for p in parts)  # and the last common point
    strategy = make()
    if isinstance(strategy, DiLoCoStrategy) and strategy.fragments == 1 and not strategy.overlap:
        assert [p["outer_steps"] for p in parts] == [[at // strategy.period]] * 2  # outer steps so far
    # each rank wrote its own part: the checkpoint sent only coordination, per save an 8-byte token
    # broadcast by rank 0 (a broadcast costs its root S, the others 0) and two 4-byte all-reduced flags
    # (2(N-1)/N x 4 bytes each, N = 2)
    for r, ranked in enumerate(full):
        expected = (8 if r == 0 else 0) + 2 * (2 * (2 - 1) * 4 // 2)
        assert ranked["ledger"]["other"]["checkpoint"]["wire_bytes"] == expected, ranked["ledger"]["other"]
    resumed = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=make(), devices=2,
                  max_steps=steps, out=tmp_path / "resumed", ckpt_path=str(ckpt))
    assert_resumed_at(resumed, at, steps)
    for a, b in zip(full, resumed):
        assert b["algorithm"]["num_steps"] == steps  # the step counter survived the resume
        diff = max_abs_diff(a["params"], b["params"])
        assert diff <= 1e-6, f"resumed run differs from the uninterrupted one by {diff}"
        assert b["ledger"]["wire_bytes"] == a["ledger"]["wire_bytes"]


class RecordWarnings(Callback):
    """The warnings each rank raised from set-up (where a checkpoint's state is loaded) to the end of training."""

    def __init__(self, out):
        self.out = Path(out)

    def setup(self, trainer, pl_module, stage):
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module):
        self._catch.__exit__(None, None, None)
        torch.save([str(w.message) for w in self.caught], self.out / f"warnings{trainer.global_rank}.pt")


def test_resume_with_another_codec_resets_its_state_and_says_so(tmp_path):
    steps, at = 22, 14
    ckpt = tmp_path / "mid.ckpt"
    fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=DiLoCoStrategy(period=8, codec="int8"), devices=2,
        max_steps=steps, out=tmp_path / "full", callbacks=(SaveAt(at, ckpt),))
    assert all(p["reducer"]["residuals"] for p in read_parts(ckpt))  # int8's residuals are in the checkpoint
    resumed = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=DiLoCoStrategy(period=8, codec="sign"),
                  devices=2, max_steps=steps, out=tmp_path / "sign", ckpt_path=str(ckpt),
                  callbacks=(RecordWarnings(tmp_path),))
    said = [w for w in torch.load(tmp_path / "warnings0.pt") if "codec" in w]
    assert len(said) == 1 and "written with codec int8" in said[0] and "uses sign" in said[0], said
    assert "reset the codec state (residuals" in said[0]
    assert not any("codec" in w for w in torch.load(tmp_path / "warnings1.pt"))  # said once, by rank 0
    # the reference: the same resume from a checkpoint whose parts hold no codec state at all
    for part in ckpt.parent.glob("mid.ckpt.ranks/*.pt"):
        state = torch.load(part, weights_only=True)
        state.pop("reducer")
        torch.save(state, part)
    fresh = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=DiLoCoStrategy(period=8, codec="sign"),
                devices=2, max_steps=steps, out=tmp_path / "fresh", ckpt_path=str(ckpt))
    assert_resumed_at(resumed, at, steps)
    for a, b in zip(resumed, fresh):
        assert max_abs_diff(a["params"], b["params"]) == 0.0, "sign started from int8's residuals"


def test_local_sgd_resumed_with_a_lossy_codec_after_identity_keeps_ranks_together(tmp_path):
    steps, at = 22, 14
    ckpt = tmp_path / "mid.ckpt"
    fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=LocalSGDStrategy(period=8), devices=2,
        max_steps=steps, out=tmp_path / "full", callbacks=(SaveAt(at, ckpt),))
    assert all(p.get("last_common") is None for p in read_parts(ckpt))  # identity keeps no common point
    resumed = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=LocalSGDStrategy(period=8, codec="int8"),
                  devices=2, max_steps=steps, out=tmp_path / "int8", ckpt_path=str(ckpt),
                  callbacks=(RecordHashes(tmp_path), RecordWarnings(tmp_path)))
    assert any("no last common point" in w for w in torch.load(tmp_path / "warnings0.pt"))
    rows = [torch.load(tmp_path / f"hashes{r}.pt", weights_only=False)["rows"] for r in (0, 1)]
    at_16 = [dict((step, h) for step, h, _ in rows[r])[16] for r in (0, 1)]
    assert at_16[0] == at_16[1], "the ranks disagree after the first int8 round"
    assert max_abs_diff(resumed[0]["params"], resumed[1]["params"]) == 0.0


def test_convergence_on_digits_with_fewer_bytes(tmp_path):
    steps = 160
    # 160 steps (~7 epochs of 23 steps: 1500 samples / (2 x 32)), a multiple of the period, each
    # strategy at its defaults and the recipe's own optimizer (SGD, momentum 0.9): a first try
    results = {}
    for name, strategy in [("sync", SyncStrategy()), ("local_sgd", LocalSGDStrategy(period=8)),
                           ("diloco", DiLoCoStrategy(period=8))]:
        out = tmp_path / name
        r = fit(DigitsClassifier(), DigitsData(batch_size=32), strategy=strategy, devices=2, max_steps=steps,
                out=out, callbacks=(ValAccuracy(out),))[0]
        acc = torch.load(out / "val_acc0.pt")
        assert acc == torch.load(out / "val_acc1.pt")  # both ranks end with the same model
        results[name] = (acc, r["ledger"]["wire_bytes"], r["ledger"]["compression_ratio"])
    sync_acc, sync_bytes, _ = results["sync"]
    assert sync_acc > 0.9, results
    for name in ("local_sgd", "diloco"):
        acc, wire, ratio = results[name]
        assert acc >= sync_acc - 0.02, f"{name} val_acc {acc:.3f} vs sync {sync_acc:.3f}: {results}"
        assert sync_bytes >= 7 * wire and ratio == pytest.approx(8.0), results
    print(results)


def test_resume_on_another_world_size_keeps_global_state(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=DiLoCoStrategy(period=8), devices=2, max_steps=12,
        out=tmp_path / "first", callbacks=(ModelCheckpoint(dirpath=ckpt_dir, filename="mid", every_n_train_steps=12),))
    saved = read_parts(ckpt_dir / "mid.ckpt")[0]
    ranks = fit(model(momentum=0.9), DigitsData(batch_size=16), strategy=DiLoCoStrategy(period=8), devices=3,
                max_steps=16, out=tmp_path / "resumed", ckpt_path=str(ckpt_dir / "mid.ckpt"),
                callbacks=(RecordHashes(tmp_path),))
    for r in ranks:
        assert r["algorithm"]["num_steps"] == 16  # the round fell at 16, not at 12 + 8
        assert not torch.equal(r["algorithm"]["global_params"][0], saved["global_params"][0])
    rows = [torch.load(tmp_path / f"hashes{r}.pt", weights_only=False)["rows"] for r in range(3)]
    assert [row[0] for row in rows[0]] == [13, 14, 15, 16]
    assert len({rows[r][-1][1] for r in range(3)}) == 1  # all three agree after the round at 16
    assert len({rows[r][0][1] for r in range(3)}) == 3  # and trained locally before it
