"""``diloco --strategy.codec sparseloco`` on the digits recipe, 2 processes (fork): it trains, the
ranks agree after every round, and the ledger holds the packed messages' bytes."""

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import DiLoCoStrategy
from harness import ValAccuracy, ValLoss, digest, fit

pytestmark = pytest.mark.timeout(180)

PERIOD, STEPS = 4, 48


def sparse_message_bytes(numel: int) -> int:
    """One packed message at the defaults, by hand: per chunk of 4096, 64 codes of 6 low index bits and a
    2-bit value, a 64 + 4096 / 2^6-bit upper bitmap; then float32 scales."""
    chunks = math.ceil(numel / 4096)
    return math.ceil(chunks * (64 * (6 + 2) + 64 + 64) / 8) + 4 * chunks


class Hashes(Callback):
    """A hash of this rank's parameters after every optimizer step."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, digest(pl_module.parameters())))

    def on_fit_end(self, trainer, pl_module):
        torch.save(self.rows, self.out / f"hashes{trainer.global_rank}.pt")


class OptimizerType(Callback):
    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save(type(trainer.optimizers[0]).__name__, self.out / "optimizer.pt")


def test_diloco_with_the_sparse_codec_trains_and_ranks_agree_after_rounds(tmp_path):
    L.seed_everything(0, verbose=False)
    module = DigitsClassifier()
    numel = sum(p.numel() for p in module.parameters())
    untrained = {k: v.clone() for k, v in module.state_dict().items()}
    ranks = fit(module, DigitsData(batch_size=32), strategy=DiLoCoStrategy(period=PERIOD, codec="sparseloco"),
                devices=2, max_steps=STEPS, out=tmp_path, callbacks=(Hashes(tmp_path), ValAccuracy(tmp_path)))
    h0, h1 = (torch.load(tmp_path / f"hashes{r}.pt") for r in (0, 1))
    assert len(h0) == STEPS
    for (step, a), (_, b) in zip(h0, h1):
        if step % PERIOD == 0:
            assert a == b, f"ranks differ after the round at step {step}"
        else:
            assert a != b, f"ranks agree after local step {step}: the step was not local"
    acc = [torch.load(tmp_path / f"val_acc{r}.pt") for r in (0, 1)]
    assert acc[0] == acc[1] and acc[0] > 0.5, f"val_acc {acc} (chance is 0.1)"
    moved = max((ranks[0]["params"][k] - untrained[k]).abs().max().item() for k in untrained)
    assert moved > 1e-2
    # one all-gather per round of one packed message of every parameter: (N - 1) x its size
    message = sparse_message_bytes(numel)
    ledger = ranks[0]["ledger"]
    assert ledger["wire_bytes"] == STEPS // PERIOD * message
    fp32_sync = STEPS * 2 * (2 - 1) / 2 * 4 * numel
    assert ledger["compression_ratio"] == pytest.approx(fp32_sync / ledger["wire_bytes"])
    print(f"digits: {numel} parameters, {message} bytes per round, ratio {ledger['compression_ratio']:.0f}x, "
          f"val_acc {acc[0]:.3f}")


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_chargpt_with_muon_under_diloco_and_the_sparse_codec_trains(tmp_path, optimizer):
    from gradsync.recipes import CharData, CharGPT
    from gradsync.recipes.optim import MuonAdamW

    L.seed_everything(0, verbose=False)
    model = CharGPT(n_layer=1, n_head=2, n_embd=48, block_size=32, optimizer=optimizer, warmup_steps=4)
    data = CharData(max_chars=100_000, val_windows=64, batch_size=16)
    ranks = fit(model, data, strategy=DiLoCoStrategy(period=PERIOD, codec="sparseloco"), devices=2,
                max_steps=24, out=tmp_path, callbacks=(OptimizerType(tmp_path),))
    assert torch.load(tmp_path / "optimizer.pt") == {"muon": MuonAdamW.__name__, "adamw": "AdamW"}[optimizer]
    assert max((ranks[0]["params"][k] - ranks[1]["params"][k]).abs().max().item() for k in ranks[0]["params"]) == 0
    uniform = math.log(ranks[0]["params"]["net.tok_emb.weight"].shape[0])  # the vocabulary, from the data
    loss = ranks[0]["metrics"]["train_loss"]
    print(f"chargpt {optimizer}: train_loss {loss:.3f} after 24 steps (uniform guess {uniform:.3f})")
    assert loss < uniform - 0.25  # a random model sits at the uniform guess (±0.05 here)


@pytest.mark.timeout(400)
def test_diloco_with_the_sparse_codec_at_its_defaults_ends_within_2_percent_of_sync_on_chargpt(tmp_path):
    """The lowcomm benchmark's chargpt (2 layers, 128 wide, AdamW at lr 3e-3) and lengths: sync 160
    steps, low-communication runs 400. ``diloco --strategy.codec sparseloco`` with no other option
    (period 8, SparseLoCo's outer step and error decay) must end within 2% of sync's validation loss."""
    from gradsync.recipes import CharData, CharGPT
    from gradsync.strategies import SyncStrategy

    def make() -> CharGPT:
        return CharGPT(n_layer=2, n_head=4, n_embd=128, block_size=64, lr=0.003, optimizer="adamw")

    def val_loss(strategy, steps: int, out: Path) -> tuple[float, dict]:
        L.seed_everything(0, verbose=False)
        model = make()
        data = CharData(max_chars=1_000_000, val_windows=64, batch_size=16)
        ranks = fit(model, data, strategy=strategy, devices=2, max_steps=steps, out=out, callbacks=(ValLoss(out),))
        return torch.load(out / "val_loss0.pt"), ranks[0]

    sync, _ = val_loss(SyncStrategy(), 160, tmp_path / "sync")
    sparse, rank0 = val_loss(DiLoCoStrategy(codec="sparseloco"), 400, tmp_path / "sparse")
    print(f"chargpt val_loss: sync {sync:.3f} (160 steps), diloco + sparseloco at its defaults {sparse:.3f} (400 steps)")
    assert sparse <= 1.02 * sync
    # it was the sparse codec that crossed: 400 / 8 rounds of one packed message of every parameter
    model = make()
    model.build("".join(map(chr, range(32, 32 + rank0["params"]["net.tok_emb.weight"].shape[0]))))  # the data's size
    numel = sum(p.numel() for p in model.parameters())
    assert rank0["ledger"]["wire_bytes"] == 400 // 8 * sparse_message_bytes(numel)
