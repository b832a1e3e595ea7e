"""DiLoCo composed with the communication layer: codecs, streaming fragments, sync delay, accounting.

Digits' classifier has three layers (conv1, conv2, head); with two fragments the strided split of
Streaming DiLoCo puts conv1 and head in fragment 0 and conv2 in fragment 1. The tests below write
that split, the schedule and the outer step out by hand, independently of the strategy's code.
"""

import math
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.recipes.synthetic import SyntheticData, SyntheticModel
from gradsync.strategies import DiLoCoStrategy, LocalSGDStrategy, SyncStrategy
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(180)

FRAGMENT_OF = {"conv1": 0, "head": 0, "conv2": 1}  # strided: layer j -> fragment j mod 2


def model(momentum=0.9, seed=0):
    L.seed_everything(seed, verbose=False)
    return DigitsClassifier(lr=0.1, momentum=momentum)


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def masks(module) -> list[torch.Tensor]:
    """Boolean masks over the flat parameters, one per fragment (from the layer names alone)."""
    pieces = [[], []]
    for name, p in module.named_parameters():
        k = FRAGMENT_OF[name.split(".")[0]]
        for j in (0, 1):
            pieces[j].append(torch.full((p.numel(),), j == k))
    return [torch.cat(m) for m in pieces]


class Trace(DiLoCoStrategy):
    """Records, per rank, each issue (fragment, step, kind, local point, wire bytes so far) and each
    landing (step, local point), then the local and global points after it."""

    def on_train_start(self):
        super().on_train_start()
        self.trace = []
        self.algorithm.listeners.append(self._record)

    def _record(self, event, f):
        params = self.algorithm.layout.params
        if event == "issue":
            self.trace.append(("issue", f["fragment"], f["step"], f["kind"], flat(params), self.ledger.wire_bytes))
        elif event == "land":
            self.trace.append(("land", f["fragment"], f["step"], f["blend"], flat(params)))
        elif event == "landed":
            self.trace.append(("after", f["fragment"], f["step"], flat(params), flat(self.global_params)))

    def algorithm_state_dict(self):
        return {**super().algorithm_state_dict(), "trace": getattr(self, "trace", [])}


def rounds_of(trace: list) -> list:
    """The trace up to the fit's final rounds (which run first thing in on_train_end, before the
    trace is read)."""
    end = next((i for i, e in enumerate(trace) if e[0] == "issue" and e[3] == "final"), len(trace))
    return trace[:end]


class FinalParams(Callback):
    """Every rank's parameters when fit has ended (after the strategy's final rounds)."""

    def __init__(self, out):
        self.out = Path(out)

    def on_fit_end(self, trainer, pl_module):
        torch.save(flat(pl_module.parameters()), self.out / f"final{trainer.global_rank}.pt")


class PlainAllReduce:
    """No codec at all: every tensor all-reduced in fp32 by torch.distributed and divided by N."""

    def __init__(self, world: int) -> None:
        self.world = world

    def reduce(self, tensors, names=None, sync=None):
        out = [t.detach().to(torch.float32).clone() for t in tensors]
        for t in out:
            dist.all_reduce(t)
        future = torch.futures.Future()
        future.set_result([t / self.world for t in out])
        return future

    def state_dict(self):
        return {}


def without_codec(cls):
    """``cls`` with its rounds' reducer replaced by :class:`PlainAllReduce` (no gradsync reducer)."""
    class WithoutCodec(cls):
        @property
        def reducer(self):
            self._round_reducer = self._round_reducer or PlainAllReduce(self.world_size)
            return self._round_reducer

    return WithoutCodec


@pytest.mark.parametrize("cls, options", [
    (DiLoCoStrategy, {"period": 3}),
    (DiLoCoStrategy, {"period": 4, "fragments": 2, "sync_delay": 1}),
    (LocalSGDStrategy, {"period": 3}),
], ids=["diloco", "diloco-streaming", "local_sgd"])
def test_identity_codec_equals_no_codec(tmp_path, cls, options):
    """The identity codec (the default) against rounds whose mean is a plain torch.distributed all-reduce."""
    codec = fit(model(), DigitsData(batch_size=16), strategy=cls(codec="identity", **options), devices=2,
                max_steps=10, out=tmp_path / "identity")
    plain = fit(model(), DigitsData(batch_size=16), strategy=without_codec(cls)(**options), devices=2,
                max_steps=10, out=tmp_path / "plain")
    for a, b in zip(codec, plain):
        assert max_abs_diff(a["params"], b["params"]) <= 1e-6
    assert max_abs_diff(codec[0]["params"], model().state_dict()) > 1e-3  # it trained
    assert codec[0]["ledger"]["wire_bytes"] > 0 == plain[0]["ledger"]["wire_bytes"]  # the reference bypassed it


def test_two_rank_streaming_fragments_with_delay_and_blend_by_hand(tmp_path):
    """period 4, two fragments, sync_delay 1, alpha 0.25: every outer step written out by hand (an alpha
    other than 0.5, so that a blend the wrong way round, 0.75 local, cannot pass)."""
    eta, mu, alpha, period, steps = 0.5, 0.8, 0.25, 4, 7
    start = model()
    theta, m = flat(start.parameters()), torch.zeros(sum(p.numel() for p in start.parameters()))
    frag = masks(start)
    ranks = fit(model(), DigitsData(batch_size=16),
                strategy=Trace(period=period, outer_lr=eta, outer_momentum=mu, fragments=2, sync_delay=1,
                               fragment_alpha=alpha, outer_momentum_warmup=0),  # (warm-up: test_local_sgd)
                devices=2, max_steps=steps, out=tmp_path,
                callbacks=(FinalParams(tmp_path),))
    traces = [rounds_of(r["algorithm"]["trace"]) for r in ranks]
    # the schedule: fragment 1 at offset period/2 (steps 2, 6), fragment 0 at offset 0 (step 4);
    # each lands one inner step later
    events = [(e[0], e[1], e[2]) for e in traces[0] if e[0] != "after"]
    assert events == [("issue", 1, 2), ("land", 1, 3), ("issue", 0, 4), ("land", 0, 5), ("issue", 1, 6),
                      ("land", 1, 7)]
    issues = [[e for e in t if e[0] == "issue"] for t in traces]
    lands = [[e for e in t if e[0] == "land"] for t in traces]
    afters = [[e for e in t if e[0] == "after"] for t in traces]
    for j in range(3):
        k, blend = issues[0][j][1], lands[0][j][3]
        f = frag[k]
        sent = [issues[r][j][4] for r in (0, 1)]
        assert not torch.equal(sent[0][f], sent[1][f])  # the ranks really trained apart
        delta = ((theta - sent[0]) + (theta - sent[1]))[f] / 2  # mean pseudo-gradient of fragment k
        m[f] = mu * m[f] + delta
        theta[f] = theta[f] - eta * (delta + mu * m[f])  # Nesterov, this fragment only
        for r in (0, 1):
            local_at_land = lands[r][j][4]
            expect = local_at_land.clone()
            a = alpha if blend else 0.0
            expect[f] = a * local_at_land[f] + (1 - a) * theta[f]
            after_local, after_global = afters[r][j][3], afters[r][j][4]
            assert (after_global - theta).abs().max() <= 1e-6, f"global params after round {j}"
            assert (after_local - expect).abs().max() <= 1e-6, f"rank {r} local params after round {j}"
            assert torch.equal(after_local[~f], local_at_land[~f])  # the other fragment is untouched
        assert torch.equal(afters[0][j][4], afters[1][j][4])  # identical global parameters on both ranks
    # no fragment is agreed at the end (alpha > 0 keeps some local progress), so the fit ends with a
    # blocking round of each that takes the global parameters outright: every rank leaves the same
    final = [torch.load(tmp_path / f"final{r}.pt") for r in (0, 1)]
    assert not torch.equal(afters[0][-1][3], afters[1][-1][3])
    assert torch.equal(final[0], final[1])


def int8_round_bytes(numel: int, world: int = 2, chunk: int = 512) -> int:
    """int8's two hops for ``numel`` entries (docs/strategies/compressed.md), written out here."""
    shard = math.ceil(numel / world)
    return 2 * (world - 1) * (shard + 4 * math.ceil(shard / chunk))


def test_streaming_schedule_and_bytes_per_round_with_int8(tmp_path):
    period, steps = 6, 12
    ranks = fit(model(), DigitsData(batch_size=16), strategy=Trace(period=period, fragments=3, sync_delay=1,
                                                                    codec="int8"),
                devices=2, max_steps=steps, out=tmp_path, callbacks=(FinalParams(tmp_path),))
    start = model()
    sizes = {}
    for name, p in start.named_parameters():
        layer = name.split(".")[0]
        sizes[layer] = sizes.get(layer, 0) + p.numel()
    fragment_numel = [sizes["conv1"], sizes["conv2"], sizes["head"]]  # three layers, one each
    trace = ranks[0]["algorithm"]["trace"]
    issues = [(e[1], e[2]) for e in trace if e[0] == "issue"]
    # fragment k at steps with s % 6 == 2k, each landing one step later; fragment 0, issued at 12, is
    # still in flight when training ends: the end of fit lands it, then syncs fragments 1 and 2 once more
    assert issues == [(1, 2), (2, 4), (0, 6), (1, 8), (2, 10), (0, 12), (1, 12), (2, 12)]
    assert [e[3] for e in trace if e[0] == "issue"] == ["round"] * 6 + ["final"] * 2
    # a round's bytes: the ledger at the next issue minus at its own (it has landed by then), and the
    # last one's: the ledger when training has ended minus at its issue
    wire = [e[5] for e in trace if e[0] == "issue"] + [ranks[0]["ledger"]["wire_bytes"]]
    issues = issues + [None]
    for (k, _), before, after in zip(issues, wire, wire[1:]):
        assert after - before == int8_round_bytes(fragment_numel[k]), f"bytes of fragment {k}'s round"
    assert ranks[0]["ledger"]["collectives"] == 2 * 8  # two hops a round, nothing else
    assert ranks[0]["ledger"]["peak_sync_bytes"] == max(int8_round_bytes(n) for n in fragment_numel)
    sync_bytes = steps * 4 * sum(fragment_numel)  # fp32 all-reduce on 2 ranks: 4 bytes per entry per step
    assert ranks[0]["ledger"]["logical_bytes"] == sync_bytes
    assert ranks[0]["ledger"]["compression_ratio"] == pytest.approx(sync_bytes / ranks[0]["ledger"]["wire_bytes"])
    final = [torch.load(tmp_path / f"final{r}.pt") for r in (0, 1)]
    assert torch.equal(final[0], final[1])  # fit ends with the flight landed and a round of the others




def synthetic_diloco(tmp_path: Path, name: str, steps: int, **options) -> dict:
    """Rank 0's ledger after the last training step (before the end of fit syncs what ranks disagree on)."""
    L.seed_everything(0, verbose=False)
    net = SyntheticModel(num_params=40_000, num_layers=8, lr=0.05)
    return fit(net, SyntheticData(num_samples=2048, batch_size=16), strategy=DiLoCoStrategy(**options),
               devices=2, max_steps=steps, out=tmp_path / name)[0]["last_step_ledger"]


@pytest.mark.parametrize("codec, anchor", [("int8", 400), ("int4", 800)])
def test_accounting_matches_the_papers_anchors(tmp_path, codec, anchor):
    """INTELLECT-1: DiLoCo H=100 with int8 pseudo-gradients moves 400x fewer bytes than fp32 data
    parallel (100 x 32/8); Streaming DiLoCo's 4-bit values give 800x against fp32 (400x against bf16)."""
    ledger = synthetic_diloco(tmp_path, codec, 200, period=100, codec=codec)
    assert ledger["compression_ratio"] == pytest.approx(anchor, rel=0.02), ledger


def test_peak_bytes_per_sync_fall_with_fragments(tmp_path):
    whole = synthetic_diloco(tmp_path, "whole", 8, period=8, codec="int8")
    streamed = synthetic_diloco(tmp_path, "streamed", 8, period=8, codec="int8", fragments=4)
    # the same bytes over a period, a quarter of them at a time (the MLP's 10 layers split 3/3/2/2,
    # the eight hidden layers equal and the input and output layers small)
    assert streamed["wire_bytes"] == pytest.approx(whole["wire_bytes"], rel=0.01)
    assert whole["peak_sync_bytes"] / streamed["peak_sync_bytes"] >= 3.0, (whole, streamed)
    assert whole["peak_sync_bytes"] == pytest.approx(whole["wire_bytes"])  # one round: all of it at once


def test_sync_reference_bytes_for_the_anchor(tmp_path):
    """The anchor's denominator is what sync really sends: the ledger's logical bytes per step."""
    L.seed_everything(0, verbose=False)
    net = SyntheticModel(num_params=40_000, num_layers=8, lr=0.05)
    sync = fit(net, SyntheticData(num_samples=2048, batch_size=16), strategy=SyncStrategy(), devices=2,
               max_steps=4, out=tmp_path / "sync")[0]["ledger"]
    diloco = synthetic_diloco(tmp_path, "diloco", 4, period=4)
    assert diloco["logical_bytes"] == sync["wire_bytes"]
    assert diloco["compression_ratio"] == pytest.approx(4.0)
