"""The plugin example of docs/guides/writing-a-strategy.md runs and does what the page says.

examples/fp16_error_feedback.py is included verbatim into the page, so this tests the page's code.
"""

import importlib.util
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import STRATEGIES, SyncStrategy
from gradsync.strategies.parts import read_parts
from harness import fit, max_abs_diff, run_gloo

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fp16_error_feedback.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("fp16_error_feedback", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # forked ranks and pickled hooks find it by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    if "fp16_ef" in StrategyRegistry:
        StrategyRegistry.remove("fp16_ef")


def _fit(strategy, out: Path, **kwargs):
    L.seed_everything(0, verbose=False)
    return fit(DigitsClassifier(lr=0.05), DigitsData(batch_size=16), strategy=strategy, devices=2, max_steps=20,
               out=out, **kwargs)


def test_the_plugin_registers_with_lightning_only(example):
    assert StrategyRegistry["fp16_ef"]["strategy"] is example.Fp16EFStrategy
    assert "fp16_ef" not in STRATEGIES  # a plugin does not change gradsync's pinned names
    trainer = L.Trainer(strategy="fp16_ef", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert type(trainer.strategy) is example.Fp16EFStrategy
    assert trainer.strategy.options["gradient_scale"] == 1.0
    with pytest.raises(ValueError, match="gradient_scale=0.0 is invalid: must be > 0"):
        example.Fp16EFStrategy(gradient_scale=0.0)


def test_the_plugin_halves_the_bytes_and_error_feedback_tracks_sync(example, tmp_path):
    reference = _fit(SyncStrategy(), tmp_path / "sync")
    ranks = _fit(example.Fp16EFStrategy(), tmp_path / "ef",
                 callbacks=(ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True),))
    plain = _fit(example.Fp16EFStrategy(error_feedback=False), tmp_path / "plain")

    # synchronous: every rank holds the same model after every step
    assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    # fp16 on the wire: exactly half of fp32 sync's bytes, one all-reduce per step (one bucket)
    ledger = ranks[0]["ledger"]
    assert ledger["compression_ratio"] == 2.0
    assert ledger["wire_bytes"] * 2 == reference[0]["ledger"]["wire_bytes"]
    # fp16 is lossy, and error feedback changes what is sent (its exact arithmetic, and that rounding
    # errors do not accumulate with it, are checked on gloo below, where the math fixes the answer)
    assert max_abs_diff(ranks[0]["params"], reference[0]["params"]) > 0.0
    assert max_abs_diff(ranks[0]["params"], plain[0]["params"]) > 0.0

    # every rank's residuals are in the checkpoint, and they differ between ranks
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    parts = read_parts(tmp_path / "ckpt" / "last.ckpt")
    assert checkpoint["gradsync"]["strategy"] == "fp16_ef" and len(parts) == 2
    residuals = [p["fp16_ef"]["residuals"] for p in parts]
    assert residuals[0].keys() == dict(DigitsClassifier().named_parameters()).keys()
    assert max_abs_diff(residuals[0], residuals[1]) > 0


STEPS, SIZE = 64, 4096


def _gradient(rank: int) -> torch.Tensor:
    # float32 values below fp16's precision (11 significant bits): nearly every one rounds when cast
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(rank)) * 1e-3 + 1e-2


def _fp16_steps(rank: int, world: int, error_feedback: bool) -> dict:
    """``STEPS`` reductions of this rank's fixed gradient through the example's codec."""
    from gradsync.comm.error_feedback import ErrorFeedback
    from gradsync.comm.ledger import CommLedger

    example = sys.modules["fp16_error_feedback"]
    codec = example.ScaledFp16Reducer(ledger=CommLedger(world_size=world))
    reducer = ErrorFeedback(codec) if error_feedback else codec
    g = _gradient(rank)
    residuals, means = [], []
    for _ in range(STEPS):
        means.append(reducer.reduce([g], names=["w"]).wait()[0])
        residuals.append(reducer.residuals.pieces["w"].clone() if error_feedback else None)
    return {"residuals": residuals, "means": means}


def test_error_feedback_carries_the_rounding_error_instead_of_losing_it(example, tmp_path):
    """The worker side of error feedback, against the same arithmetic written out here: at every step
    the rank sends fp16(g + e) and keeps e <- (g + e) - fp16(g + e); so after T steps what it sent adds
    up to T g - e_T, off by one rounding, where plain fp16 is off by T roundings."""
    with_ef = run_gloo(_fp16_steps, 2, True, tmp=tmp_path)
    plain = run_gloo(_fp16_steps, 2, False, tmp=tmp_path)
    for rank in (0, 1):
        g, e = _gradient(rank), torch.zeros(SIZE)
        sent_total, plain_total = torch.zeros(SIZE, dtype=torch.float64), torch.zeros(SIZE, dtype=torch.float64)
        for t in range(STEPS):
            meant = g + e
            # the codec's contribution in its input's units: divided by N = 2 (exact), cast, times 2 (exact)
            sent = meant.div(2).to(torch.float16).to(torch.float32).mul(2)
            e = meant - sent
            assert torch.equal(with_ef[rank]["residuals"][t], e), f"rank {rank}, step {t}: residual"
            sent_total += sent.double()
            plain_total += g.div(2).to(torch.float16).to(torch.float32).mul(2).double()
        target = STEPS * g.double()
        carried = (sent_total - target).abs().max().item()
        lost = (plain_total - target).abs().max().item()
        # fp16 keeps 11 significant bits: one rounding of a value below 0.02 is at most 2^-17 ~ 7.6e-6
        assert carried <= 2 * 2.0 ** -17, f"rank {rank}: error feedback let {carried} accumulate"
        assert lost >= 8 * carried, (lost, carried)  # plain fp16: the same rounding, T = 64 times
    # what the reducer returns is the mean over both ranks of those contributions (the sum of two
    # fp16 values, each well inside fp16's range), and the two variants send different values
    for t in (0, STEPS - 1):
        meant = [_gradient(r) + (with_ef[r]["residuals"][t - 1] if t else 0) for r in (0, 1)]
        exact = (meant[0] + meant[1]) / 2
        assert (with_ef[0]["means"][t] - exact).abs().max() <= 2.0 ** -15
        assert torch.equal(with_ef[0]["means"][t], with_ef[1]["means"][t])
    assert not torch.equal(with_ef[0]["means"][-1], plain[0]["means"][-1])
