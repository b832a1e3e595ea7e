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
from harness import fit, max_abs_diff

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
    # error feedback: the rounding error is carried, not lost, so the run stays much closer to fp32 sync
    with_ef = max_abs_diff(ranks[0]["params"], reference[0]["params"])
    without = max_abs_diff(plain[0]["params"], reference[0]["params"])
    assert 0.0 < with_ef < without / 3, (with_ef, without)

    # every rank's residuals are in the checkpoint, and they differ between ranks
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    parts = read_parts(tmp_path / "ckpt" / "last.ckpt")
    assert checkpoint["gradsync"]["strategy"] == "fp16_ef" and len(parts) == 2
    residuals = [p["fp16_ef"]["residuals"] for p in parts]
    assert residuals[0].keys() == dict(DigitsClassifier().named_parameters()).keys()
    assert max_abs_diff(residuals[0], residuals[1]) > 0
