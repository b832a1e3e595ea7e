"""Every private Lightning or torch member gradsync touches, in one place.

A rename in Lightning or torch must not make gradsync *silently* stop doing its job (stop keeping
buffers local, stop resuming accumulation windows, deadlock an asynchronous run). Each accessor
here fails loudly, naming the member and the versions gradsync is tested with, and
``tests/unit/test_lightning_private.py`` checks every member against the installed versions.

Members (and what breaks without them):

* ``DDPStrategy._ddp_kwargs``: the keyword arguments Lightning passes to ``DistributedDataParallel``;
  the periodic and asynchronous strategies set ``broadcast_buffers=False`` there (else rank 0's
  buffers silently overwrite every rank's at each forward).
* ``DDPStrategy._process_group_backend`` and ``DDPStrategy._timeout``: the backend and timeout the
  default process group is created with (gradsync builds it itself under torchrun restarts).
* ``_TrainingEpochLoop._broadcast_sigterm_tensor``: a collective Lightning runs every step;
  ``async_ps`` ranks step at different rates, so it replaces it with a local check (else a hang).
* ``Optimizer._opt_called`` (torch): set by ``optimizer.step``; ``async_ps`` steps on the server, so
  it sets it for torch's LR schedulers (else they warn that the scheduler stepped first).
* The fit loop's progress schema in a checkpoint, ``loops/fit_loop/epoch_loop.batch_progress``:
  rescaled when a resume changes the accumulation K.
* ``WandbLogger._wandb_init``: the arguments Lightning passes to ``wandb.init``.
* ``CSVLogger._experiment``: the writer a resumable CSV log replaces.
* ``_TrainingEpochLoop._batches_that_stepped``: the count Lightning logs steps by; a fault-tolerant
  replica group that heals takes a live group's (else its logged steps would restart from its own).
* ``ParallelStrategy._layer_sync``: the plugin ``sync_batchnorm=True`` sets; torch's SyncBatchNorm
  fails on CPU, so gradsync strategies swap in a layer that works on any backend.

The DDP communication hook is registered through the public ``configure_ddp`` (not Lightning's
private ``_register_ddp_hooks``, which registers hooks on CUDA only).
"""

from __future__ import annotations

import types
from typing import Any, Callable

TESTED_WITH = "lightning 2.6, torch 2.13"


class LightningInternalsChanged(RuntimeError):
    """A private member gradsync relies on is gone: upgrade gradsync or pin the tested versions."""


def _missing(owner: str, member: str, consequence: str) -> LightningInternalsChanged:
    return LightningInternalsChanged(
        f"{owner}.{member} is gone in this version (gradsync is tested with {TESTED_WITH}); without it "
        f"{consequence}. Pin the tested versions or upgrade gradsync.")


def ddp_kwargs(strategy: Any) -> dict:
    kwargs = getattr(strategy, "_ddp_kwargs", None)
    if not isinstance(kwargs, dict):
        raise _missing("DDPStrategy", "_ddp_kwargs", "buffers could not be kept off DDP's per-forward broadcast")
    return kwargs


def process_group_backend(strategy: Any) -> Any:
    if not hasattr(strategy, "_process_group_backend"):
        raise _missing("DDPStrategy", "_process_group_backend", "the process-group backend cannot be chosen")
    return strategy._process_group_backend


def set_process_group_backend(strategy: Any, backend: Any) -> None:
    process_group_backend(strategy)
    strategy._process_group_backend = backend


def process_group_timeout(strategy: Any) -> Any:
    if not hasattr(strategy, "_timeout"):
        raise _missing("DDPStrategy", "_timeout", "the process-group timeout cannot be set")
    return strategy._timeout


def replace_sigterm_broadcast(trainer: Any, local_check: Callable[[Any], None]) -> None:
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        raise _missing("_TrainingEpochLoop", "_broadcast_sigterm_tensor",
                       "async_ps could not replace a per-step collective, and its ranks would hang")
    loop._broadcast_sigterm_tensor = types.MethodType(local_check, loop)


def batches_that_stepped(trainer: Any) -> int:
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_batches_that_stepped"):
        raise _missing("_TrainingEpochLoop", "_batches_that_stepped",
                       "a healed replica group could not take over the step count its metrics are logged at")
    return int(loop._batches_that_stepped)


def set_batches_that_stepped(trainer: Any, count: int) -> None:
    batches_that_stepped(trainer)  # (fails loudly if the member is gone)
    trainer.fit_loop.epoch_loop._batches_that_stepped = int(count)


def mark_optimizer_stepped(optimizer: Any) -> None:
    """Tell torch's LR schedulers that ``optimizer`` has stepped (its step ran elsewhere)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps it
    inner._opt_called = True


#: Where a checkpoint keeps the fit loop's micro-batch counters.
FIT_PROGRESS_PATH = ("loops", "fit_loop", "epoch_loop.batch_progress")


def fit_batch_progress(checkpoint: dict) -> Any:
    """The fit loop's batch-progress entry of a checkpoint, or None when it has no fit loop."""
    loops = checkpoint.get(FIT_PROGRESS_PATH[0])
    if not loops or FIT_PROGRESS_PATH[1] not in loops:
        return None
    fit_loop = loops[FIT_PROGRESS_PATH[1]]
    if FIT_PROGRESS_PATH[2] not in fit_loop:
        raise _missing("checkpoint['loops']['fit_loop']", "['epoch_loop.batch_progress']",
                       "a resume with another accumulation K would misalign its accumulation windows")
    return fit_loop[FIT_PROGRESS_PATH[2]]


def wandb_init_kwargs(logger: Any) -> dict:
    kwargs = getattr(logger, "_wandb_init", None)
    if not isinstance(kwargs, dict):
        raise _missing("WandbLogger", "_wandb_init", "W&B runs cannot be configured")
    return kwargs


def layer_sync(strategy: Any) -> Any:
    """The ``LayerSync`` plugin (``sync_batchnorm=True``) Lightning gave the strategy, or None."""
    if not hasattr(strategy, "_layer_sync"):
        raise _missing("ParallelStrategy", "_layer_sync", "--sync-batchnorm would fail on CPU")
    return strategy._layer_sync


def set_layer_sync(strategy: Any, plugin: Any) -> None:
    layer_sync(strategy)
    strategy._layer_sync = plugin


def set_device_mesh(module: Any, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns (Lightning's ``ModelParallelStrategy`` sets the same member)."""
    if not hasattr(module, "_device_mesh"):
        raise _missing("LightningModule", "_device_mesh", "a module cannot shard itself in configure_model under shard node")
    module._device_mesh = mesh
