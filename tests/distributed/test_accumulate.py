"""Gradient accumulation: exact equivalences, exact weighted normalization, one sync per step."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from gradsync.recipes import DigitsClassifier, DigitsData, Recipe
from gradsync.strategies import AccumulateStrategy, LocalSGDStrategy, SyncStrategy
from harness import assert_resumed_at, fit, max_abs_diff

pytestmark = pytest.mark.timeout(180)


def plain_sgd():
    L.seed_everything(0, verbose=False)
    return DigitsClassifier(lr=0.1, momentum=0.0)


def test_accumulation_equals_full_global_batch_and_syncs_once_per_step(tmp_path):
    steps, k, world, b = 12, 4, 2, 8
    ref = fit(plain_sgd(), DigitsData(batch_size=k * world * b), devices=1, max_steps=steps, out=tmp_path / "ref")[0]
    ranks = fit(plain_sgd(), DigitsData(batch_size=b), strategy=AccumulateStrategy(), devices=world,
                max_steps=steps, accumulate_grad_batches=k, out=tmp_path / "acc")
    assert ranks[0]["global_step"] == steps
    assert max_abs_diff(ranks[0]["params"], ref["params"]) <= 1e-5
    numel = sum(p.numel() for p in plain_sgd().parameters())
    for r in ranks:
        # exactly one gradient all-reduce per optimizer step, not one per micro-batch
        assert r["ledger"]["collectives"] == steps
        assert r["ledger"]["wire_bytes"] == steps * 4 * numel  # 2(N-1)/N = 1 at N = 2


def test_same_global_batch_on_1_2_3_processes(tmp_path):
    g, b, steps = 48, 8, 10
    results = {}
    for world in (1, 2, 3):
        k = g // (b * world)
        ranks = fit(plain_sgd(), DigitsData(batch_size=b), strategy=SyncStrategy(), devices=world,
                    max_steps=steps, accumulate_grad_batches=k, out=tmp_path / f"w{world}")
        for r in ranks:  # every rank ran the steps, each of k micro-batches
            assert r["global_step"] == steps and r["batches_run"] == steps * k
        results[world] = ranks[0]["params"]
    assert max_abs_diff(results[1], plain_sgd().state_dict()) > 1e-3  # the weights moved
    assert max_abs_diff(results[1], results[2]) <= 1e-5
    assert max_abs_diff(results[1], results[3]) <= 1e-5


def test_resume_on_another_world_size_keeps_global_batch(tmp_path):
    g, b = 48, 8
    full = fit(plain_sgd(), DigitsData(batch_size=b), strategy=SyncStrategy(), devices=1, max_steps=10,
               accumulate_grad_batches=g // b, out=tmp_path / "full")[0]
    ckpt_dir = tmp_path / "ckpt"
    fit(plain_sgd(), DigitsData(batch_size=b), strategy=SyncStrategy(), devices=2, max_steps=5,
        accumulate_grad_batches=g // (2 * b), out=tmp_path / "first",
        callbacks=(ModelCheckpoint(dirpath=ckpt_dir, filename="last", every_n_train_steps=5),))
    resumed = fit(plain_sgd(), DigitsData(batch_size=b), strategy=SyncStrategy(), devices=3, max_steps=10,
                  accumulate_grad_batches=g // (3 * b), out=tmp_path / "second", ckpt_path=str(ckpt_dir / "last.ckpt"))
    # started at the checkpoint's step 5 and ran the 5 steps after it, each of 2 micro-batches on 3 processes
    assert_resumed_at(resumed, 5, 10, micro_batches_per_step=g // (3 * b))
    assert max_abs_diff(resumed[0]["params"], full["params"]) <= 1e-5


def test_static_graph_with_accumulation_is_refused(tmp_path):
    # raised in the worker process; Lightning's launcher re-raises it with the worker's message
    with pytest.raises(Exception, match="static_graph=True is invalid: cannot be combined with gradient accum"):
        fit(plain_sgd(), DigitsData(batch_size=8), strategy=SyncStrategy(static_graph=True), devices=1,
            max_steps=2, accumulate_grad_batches=2, out=tmp_path / "sg")


# ---- exact normalization with unequal micro-batches and token weights ------------------------
# Each "sample" of these loaders is a whole micro-batch: tokens (B, T) with a padding mask.
def _token_batches(seed: int, sizes: list[tuple[int, int]]):
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, length in sizes:
        x = torch.randn(rows, length, 4, generator=g)
        y = torch.randn(rows, length, generator=g)
        mask = (torch.rand(rows, length, generator=g) > 0.3).float()
        mask[:, 0] = 1.0
        out.append((x, y, mask))
    return out


RANK_BATCHES = {  # 2 ranks x 2 micro-batches of different rows, lengths and padding
    0: _token_batches(0, [(3, 5), (1, 7)]),
    1: _token_batches(1, [(4, 2), (2, 6)]),
}


class TokenRegressor(Recipe):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lin = torch.nn.Linear(4, 1)

    def compute_loss(self, batch):
        x, y, mask = batch
        per_token = (self.lin(x).squeeze(-1) - y) ** 2
        return (per_token * mask).sum() / mask.sum(), mask.sum()


class TokenData(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(RANK_BATCHES[self.trainer.global_rank], batch_size=None)


def test_weighted_loss_gives_exact_global_token_mean_gradient(tmp_path):
    L.seed_everything(0, verbose=False)
    model = TokenRegressor(lr=1.0, momentum=0.0)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ranks = fit(model, TokenData(), strategy=SyncStrategy(), devices=2, max_steps=1,
                accumulate_grad_batches=2, out=tmp_path / "tok")

    # Hand-computed reference: the gradient of the mean over *all tokens* of all micro-batches.
    ref = TokenRegressor(lr=1.0, momentum=0.0)
    ref.load_state_dict(init)
    batches = RANK_BATCHES[0] + RANK_BATCHES[1]
    total = sum(((ref.lin(x).squeeze(-1) - y) ** 2 * m).sum() for x, y, m in batches)
    tokens = sum(m.sum() for _, _, m in batches)
    (total / tokens).backward()
    expected = {k: init[f"lin.{k}"] - p.grad for k, p in ref.lin.named_parameters()}
    # The naive mean of micro-batch means differs: the test can tell the two apart.
    ref.zero_grad()
    (sum(((ref.lin(x).squeeze(-1) - y) ** 2 * m).sum() / m.sum() for x, y, m in batches) / 4).backward()
    naive = {k: init[f"lin.{k}"] - p.grad for k, p in ref.lin.named_parameters()}
    got = {k: ranks[0]["params"][f"lin.{k}"] for k in expected}
    assert max_abs_diff(got, expected) <= 1e-6
    assert max_abs_diff(naive, expected) > 1e-3


class AfterFirstStep(Callback):
    """Each rank's parameters and training bytes right after its first optimizer step."""

    def __init__(self, out):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1 and not (self.out / f"first{trainer.global_rank}.pt").exists():
            torch.save({"params": {k: v.clone() for k, v in pl_module.state_dict().items()},
                        "wire": trainer.strategy.ledger.wire_bytes},
                       self.out / f"first{trainer.global_rank}.pt")


def test_weighted_loss_on_a_local_step_is_the_ranks_own_token_mean_and_sends_nothing(tmp_path):
    """A local step (local_sgd between rounds) normalizes by this rank's own weight: no all-reduce."""
    L.seed_everything(0, verbose=False)
    model = TokenRegressor(lr=1.0, momentum=0.0)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    fit(model, TokenData(), strategy=LocalSGDStrategy(period=4), devices=2, max_steps=1, accumulate_grad_batches=2,
        out=tmp_path, callbacks=(AfterFirstStep(tmp_path),))
    for rank in (0, 1):
        first = torch.load(tmp_path / f"first{rank}.pt")
        assert first["wire"] == 0, "a local step sent bytes"
        ref = TokenRegressor(lr=1.0, momentum=0.0)
        ref.load_state_dict(init)
        batches = RANK_BATCHES[rank]
        total = sum(((ref.lin(x).squeeze(-1) - y) ** 2 * m).sum() for x, y, m in batches)
        (total / sum(m.sum() for _, _, m in batches)).backward()
        expected = {k: init[f"lin.{k}"] - p.grad for k, p in ref.lin.named_parameters()}
        got = {k: first["params"][f"lin.{k}"] for k in expected}
        assert max_abs_diff(got, expected) <= 1e-6
