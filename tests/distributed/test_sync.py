"""sync strategy: exact equivalences (DESIGN.md) on real gloo process groups."""

import lightning as L
import pytest

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import SyncStrategy
from harness import assert_resumed_at, fit, max_abs_diff

pytestmark = pytest.mark.timeout(120)

STEPS = 20


def plain_sgd(seed=0):
    L.seed_everything(seed, verbose=False)
    return DigitsClassifier(lr=0.1, momentum=0.0)


def reference(tmp_path, global_batch):
    L.seed_everything(0, verbose=False)
    return fit(plain_sgd(), DigitsData(batch_size=global_batch), devices=1, max_steps=STEPS,
               out=tmp_path / "ref")[0]


@pytest.mark.parametrize("world", [2, 3])
def test_sync_equals_single_process_full_batch(tmp_path, world):
    b = 8
    ref = reference(tmp_path, world * b)
    ranks = fit(plain_sgd(), DigitsData(batch_size=b), strategy=SyncStrategy(), devices=world,
                max_steps=STEPS, out=tmp_path / "sync")
    assert ranks[0]["global_step"] == STEPS
    diff = max_abs_diff(ranks[0]["params"], ref["params"])
    assert diff <= 1e-5, f"sync on {world} processes differs from 1 process x batch {world * b} by {diff}"
    # and the run really moved: the weights are not the initial ones
    assert max_abs_diff(ranks[0]["params"], plain_sgd().state_dict()) > 1e-3
    for r in ranks[1:]:
        assert max_abs_diff(r["params"], ranks[0]["params"]) == 0.0


@pytest.mark.parametrize("world", [2, 3])
def test_sync_equals_lightning_ddp(tmp_path, world):
    """sync's reduction is DDP's own: bit for bit Lightning's ddp. With time_comm (a hook that sums
    gradients of loss/N) it is the same mean within rounding (exact at N = 2, a power of two)."""
    ddp = fit(plain_sgd(), DigitsData(batch_size=16), strategy="ddp_fork", devices=world, max_steps=STEPS,
              out=tmp_path / "ddp")
    sync = fit(plain_sgd(), DigitsData(batch_size=16), strategy=SyncStrategy(), devices=world, max_steps=STEPS,
               out=tmp_path / "sync")
    assert max_abs_diff(sync[0]["params"], plain_sgd().state_dict()) > 1e-3  # it trained
    assert max_abs_diff(sync[0]["params"], ddp[0]["params"]) == 0.0
    timed = fit(plain_sgd(), DigitsData(batch_size=16), strategy=SyncStrategy(time_comm=True), devices=world,
                max_steps=STEPS, out=tmp_path / "timed")
    assert max_abs_diff(timed[0]["params"], ddp[0]["params"]) <= (0.0 if world == 2 else 1e-6)


@pytest.mark.parametrize("time_comm", [False, True])
def test_sync_ledger_counts_fp32_allreduce_bytes(tmp_path, time_comm):
    model = plain_sgd()
    numel = sum(p.numel() for p in model.parameters())
    ranks = fit(model, DigitsData(batch_size=16), strategy=SyncStrategy(time_comm=time_comm), devices=2, max_steps=5,
                out=tmp_path / "sync")
    for r in ranks:
        # DDP's own all-reduce is not timed; the hook that time_comm installs times each bucket
        assert (r["ledger"]["seconds"] > 0) if time_comm else (r["ledger"]["seconds"] is None)
        ledger = r["ledger"]
        # one bucket (the model is far below 25 MiB): one all-reduce of 2(N-1)/N * 4 * numel bytes per step
        assert ledger["wire_bytes"] == 5 * (2 * 1 * 4 * numel) // 2
        assert ledger["logical_bytes"] == ledger["wire_bytes"]
        assert ledger["compression_ratio"] == 1.0
        assert ledger["collectives"] == 5


def test_mid_epoch_resume_equals_uninterrupted_run(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    full = fit(plain_sgd(), DigitsData(batch_size=16), strategy=SyncStrategy(), devices=2, max_steps=14,
               out=tmp_path / "full")
    ckpt_dir = tmp_path / "ckpt"
    fit(plain_sgd(), DigitsData(batch_size=16), strategy=SyncStrategy(), devices=2, max_steps=7,
        out=tmp_path / "a", callbacks=(ModelCheckpoint(dirpath=ckpt_dir, filename="last", every_n_train_steps=7),))
    resumed = fit(plain_sgd(), DigitsData(batch_size=16), strategy=SyncStrategy(), devices=2, max_steps=14,
                  out=tmp_path / "b", ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert_resumed_at(resumed, 7, 14)  # started at the checkpoint's step and ran only the 7 steps after it
    assert max_abs_diff(resumed[0]["params"], full[0]["params"]) <= 1e-6
    # the ledger continues across the resume instead of restarting from zero
    assert resumed[0]["ledger"]["collectives"] == full[0]["ledger"]["collectives"] == 14
