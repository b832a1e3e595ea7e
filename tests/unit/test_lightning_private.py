"""Every private Lightning/torch member gradsync relies on exists in the installed versions, and each
accessor fails loudly (naming the member) when it does not."""

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.strategies import DDPStrategy

from gradsync.strategies import lightning_private as lp


def test_ddp_strategy_members():
    s = DDPStrategy()
    assert isinstance(lp.ddp_kwargs(s), dict)
    lp.set_process_group_backend(s, "gloo")
    assert lp.process_group_backend(s) == "gloo"
    assert lp.process_group_timeout(s) is not None


def test_layer_sync_of_a_strategy_sync_batchnorm_configured():
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    trainer = L.Trainer(accelerator="cpu", strategy=DDPStrategy(), devices=1, sync_batchnorm=True, logger=False)
    assert isinstance(lp.layer_sync(trainer.strategy), TorchSyncBatchNorm)
    lp.set_layer_sync(trainer.strategy, None)
    assert lp.layer_sync(trainer.strategy) is None


def test_sigterm_broadcast_of_the_training_epoch_loop():
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    calls = []
    lp.replace_sigterm_broadcast(trainer, lambda loop: calls.append(loop))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == [trainer.fit_loop.epoch_loop]


def test_batches_that_stepped_of_the_training_epoch_loop():
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert lp.batches_that_stepped(trainer) == 0
    lp.set_batches_that_stepped(trainer, 7)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 7 and lp.batches_that_stepped(trainer) == 7


def test_fit_progress_schema_of_a_real_checkpoint(tmp_path):
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=False)
    progress = lp.fit_batch_progress(ckpt)
    assert progress["total"]["ready"] == 2 and set(progress) >= {"total", "current"}


def test_logger_members(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert isinstance(lp.wandb_init_kwargs(WandbLogger(save_dir=str(tmp_path), offline=True)), dict)
    assert hasattr(CSVLogger(str(tmp_path)), "_experiment")


def test_missing_members_fail_loudly():
    class Bare:
        pass

    for accessor in (lp.ddp_kwargs, lp.process_group_backend, lp.process_group_timeout,
                     lp.wandb_init_kwargs, lp.layer_sync):
        with pytest.raises(lp.LightningInternalsChanged, match="is gone in this version"):
            accessor(Bare())
    with pytest.raises(lp.LightningInternalsChanged, match="batch_progress"):
        lp.fit_batch_progress({"loops": {"fit_loop": {}}})
    assert lp.fit_batch_progress({}) is None  # a checkpoint without a fit loop is not an error


def test_mark_optimizer_stepped_silences_the_schedulers_warning():
    import warnings

    def scheduler_warnings(mark):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        if mark:
            lp.mark_optimizer_stepped(opt)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sched.step()
        return [w for w in seen if "optimizer.step()" in str(w.message)]

    assert scheduler_warnings(mark=False)  # what async_ps would show every run without it
    assert not scheduler_warnings(mark=True)


def test_device_mesh_member_of_a_lightning_module():
    module = BoringModel()
    mesh = object()
    lp.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh  # what a module's configure_model reads
    with pytest.raises(lp.LightningInternalsChanged, match="_device_mesh"):
        lp.set_device_mesh(torch.nn.Linear(1, 1), mesh)
