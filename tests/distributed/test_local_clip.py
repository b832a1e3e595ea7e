"""Gradient clipping under momentum correction (compressed sign/topk): each rank's gradient is clipped
before the codec forms its velocity or Adam direction (DGC's local clipping), not the delivered mean.

When every rank trains on the same batch, each rank's gradient is the mean gradient, so local clipping
is sync's clipping, and momentum correction over an exact mean must give sync + clipping's weights.
"""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradsync.strategies import SyncStrategy
from gradsync.strategies.compressed import CompressedStrategy
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(240)

STEPS = 8


class SameBatches(L.LightningDataModule):
    """The same batches on every rank (no sharding): local gradients equal the mean gradient."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 16, generator=g) * 4
        y = x @ torch.randn(16, 4, generator=g) + 3
        return DataLoader(TensorDataset(x, y), batch_size=16)


class Regression(L.LightningModule):
    def __init__(self, optimizer: str, weighted: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.optimizer, self.weighted = optimizer, weighted

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # a token-weighted loss as chargpt and the Hugging Face recipe return: the backward pass carries
        # mean x weight, and what a rank clips is its gradient, the weight's scale taken out
        return {"loss": loss, "weight": float(x.shape[0])} if self.weighted else loss

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


@pytest.mark.parametrize("optimizer, weighted", [("sgd", False), ("adamw", False), ("sgd", True)])
def test_local_clipping_is_syncs_clipping_when_ranks_agree(tmp_path, optimizer, weighted):
    def run(name, strategy, **kw):
        return fit(Regression(optimizer, weighted), SameBatches(), strategy=strategy, devices=2, max_steps=STEPS,
                   out=tmp_path / name, **kw)[0]["params"]

    # momentum correction over an exact (fp32) mean: the warm-up reducer of sign/topk, here for every step,
    # so the only approximation left is the one under test
    def corrected():
        return CompressedStrategy(codec="topk", warmup_steps=STEPS)

    clip = dict(gradient_clip_val=0.5)
    sync_clip = run("sync_clip", SyncStrategy(), **clip)
    # the gradients here are far above 0.5: clipping changes the run
    assert max_abs_diff(sync_clip, run("sync", SyncStrategy())) > 1e-3
    assert max_abs_diff(run("topk_clip", corrected(), **clip), sync_clip) <= 1e-5
    by_value = dict(gradient_clip_val=0.05, gradient_clip_algorithm="value")
    assert max_abs_diff(run("topk_value", corrected(), **by_value), run("sync_value", SyncStrategy(), **by_value)) <= 1e-5


# ---- chargpt at its defaults (AdamW): clipping trains under sign and topk --------------------------
class ValLoss(L.Callback):
    def __init__(self, out):
        self.out = out

    @torch.no_grad()
    def on_fit_end(self, trainer, pl_module) -> None:
        pl_module.eval()
        losses = [pl_module.compute_loss((x.unsqueeze(0), y.unsqueeze(0)))[0] for x, y in trainer.datamodule.val_set]
        torch.save(float(torch.stack(losses).mean()), self.out / f"val_loss{trainer.global_rank}.pt")


def chargpt_val_loss(out, strategy, **trainer_kwargs) -> float:
    from gradsync.recipes import CharData, CharGPT

    L.seed_everything(0, verbose=False)
    model = CharGPT(n_layer=1, n_head=2, n_embd=48, block_size=32)
    data = CharData(max_chars=100_000, val_windows=64, batch_size=16)
    fit(model, data, strategy=strategy, devices=2, max_steps=80, out=out, callbacks=(ValLoss(out),), **trainer_kwargs)
    return torch.load(out / "val_loss0.pt")


def test_clipping_trains_under_sign_and_topk_with_adamw(tmp_path):
    """gradient_clip_val=1.0 keeps each codec as close to sync + clipping as it is to sync without it
    (measured: sync 2.836 / clipped 2.793; topk 2.951 / 2.933; sign 2.886 / 2.845 val_loss after 80 steps;
    clipping the delivered Adam direction instead left both at 4.4, where they started)."""
    clip = dict(gradient_clip_val=1.0)
    sync = chargpt_val_loss(tmp_path / "sync", SyncStrategy())
    sync_clip = chargpt_val_loss(tmp_path / "sync_clip", SyncStrategy(), **clip)
    assert sync_clip < 3.0, f"sync + clipping reached only {sync_clip:.3f}: the budget is too small to compare"
    for codec in ("topk", "sign"):
        free = chargpt_val_loss(tmp_path / codec, CompressedStrategy(codec=codec))
        clipped = chargpt_val_loss(tmp_path / f"{codec}_clip", CompressedStrategy(codec=codec), **clip)
        # the codec's gap to sync with clipping is its gap without, within 2% of the loss
        assert clipped - sync_clip <= (free - sync) + 0.02 * sync, (codec, sync, sync_clip, free, clipped)


def gpt2_val_loss(out, strategy, **trainer_kwargs) -> float:
    from gradsync.recipes.hf_causal_lm import HFCausalLM, TextData

    L.seed_everything(0, verbose=False)
    model = HFCausalLM(n_layer=2, n_head=2, n_embd=64, block_size=32, warmup_steps=5)
    data = TextData(max_chars=100_000, val_windows=64, batch_size=16)
    fit(model, data, strategy=strategy, devices=2, max_steps=40, out=out, callbacks=(ValLoss(out),), **trainer_kwargs)
    return torch.load(out / "val_loss0.pt")


def test_clipping_trains_a_hugging_face_gpt2_under_sign_and_topk(tmp_path):
    """The issue's case: transformers' GPT-2 (tiny config, tied head), AdamW, gradient_clip_val=1.0
    (measured, 40 steps: sync 3.137 / clipped 3.093; topk 3.605 / 3.537; sign 3.204 / 3.166; clipping
    the delivered direction instead: 5.376 and 5.342, from 5.55)."""
    pytest.importorskip("transformers")
    clip = dict(gradient_clip_val=1.0)
    sync = gpt2_val_loss(tmp_path / "sync", SyncStrategy())
    sync_clip = gpt2_val_loss(tmp_path / "sync_clip", SyncStrategy(), **clip)
    for codec in ("topk", "sign"):
        free = gpt2_val_loss(tmp_path / codec, CompressedStrategy(codec=codec))
        clipped = gpt2_val_loss(tmp_path / f"{codec}_clip", CompressedStrategy(codec=codec), **clip)
        assert clipped - sync_clip <= (free - sync) + 0.02 * sync, (codec, sync, sync_clip, free, clipped)
