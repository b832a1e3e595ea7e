"""``sync`` is a drop-in for Lightning's ``DDPStrategy``: its arguments, with their meaning, and what
Lightning does with a strategy (pickle it for the spawn launchers, deep-copy a Trainer).

The cases follow Lightning's own DDP strategy tests (``tests_pytorch/strategies/test_ddp.py``,
``test_ddp_strategy.py``) that apply on CPU: process-group backend and timeout reach the group, DDP's
keyword arguments reach ``DistributedDataParallel``, a comm hook runs (here on CPU too, where Lightning
skips it), post-local SGD model averaging averages.
"""

import copy
import pickle
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from gradsync.errors import OptionError
from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import STRATEGIES, SyncStrategy
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_pickles_and_deep_copies(name):
    strategy = STRATEGIES[name]()
    for twin in (pickle.loads(pickle.dumps(strategy)), copy.deepcopy(strategy)):
        assert type(twin) is type(strategy) and twin.options == strategy.options
        twin.ledger.record("all_reduce", 1000, group_size=2)  # the lock was made anew on this side
        assert twin.ledger.wire_bytes == 1000 and strategy.ledger.wire_bytes == 0
    trainer = L.Trainer(strategy=STRATEGIES[name](), accelerator="cpu", devices=2, logger=False)
    assert type(copy.deepcopy(trainer).strategy) is STRATEGIES[name]


def test_ddp_strategy_arguments_with_their_meaning():
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.plugins import Precision, TorchCheckpointIO

    env, io, precision = LightningEnvironment(), TorchCheckpointIO(), Precision()
    devices = [torch.device("cpu")] * 2
    strategy = SyncStrategy(process_group_backend="gloo", timeout=timedelta(seconds=77), cluster_environment=env,
                            checkpoint_io=io, precision_plugin=precision, parallel_devices=devices,
                            start_method="fork", broadcast_buffers=False, init_sync=True)
    assert strategy.backend == "gloo" and strategy.timeout_seconds == 77.0
    assert strategy.cluster_environment is env and strategy.checkpoint_io is io
    assert strategy.precision_plugin is precision and strategy.parallel_devices == devices
    assert strategy._start_method == "fork" and strategy._timeout == timedelta(seconds=77)
    assert strategy._ddp_kwargs["broadcast_buffers"] is False and strategy._ddp_kwargs["init_sync"] is True
    # gradsync's spellings stay as aliases, and the options a summary reports are gradsync's
    assert SyncStrategy(backend="gloo", timeout_seconds=77).options == {
        **strategy.options, "backend": "gloo", "timeout_seconds": 77.0}
    assert "cluster_environment" not in strategy.options and "timeout" not in strategy.options


@pytest.mark.parametrize("kwargs, says", [
    (dict(bucket_cap_mbs=5), "bucket_cap_mbs=5 is invalid: is not an option of SyncStrategy nor an argument of "
                             "DistributedDataParallel"),
    (dict(backend="nccl", process_group_backend="gloo"), "disagrees with backend='nccl'"),
    (dict(timeout_seconds=5, timeout=timedelta(seconds=9)), "disagrees with timeout_seconds=5"),
    (dict(timeout=30), "must be a datetime.timedelta"),
    (dict(time_comm=True, ddp_comm_hook=lambda state, bucket: None), "give one of them"),
])
def test_bad_ddp_arguments_are_one_line(kwargs, says):
    with pytest.raises(OptionError, match=says.replace("(", r"\(").replace(")", r"\)")):
        SyncStrategy(**kwargs)


@pytest.mark.parametrize("name", ["compressed", "diloco", "local_sgd", "async_ps"])
def test_strategies_with_their_own_messages_refuse_a_ddp_hook(name):
    with pytest.raises(OptionError, match="sends its own messages"):
        STRATEGIES[name](ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(OptionError, match="model_averaging_period=4 is invalid"):
        STRATEGIES[name](model_averaging_period=4)


def counting_allreduce(state, bucket):
    """torch's all-reduce hook that also counts the buckets it is given (state: a file per rank)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with open(f"{state}.{dist.get_rank()}", "a") as f:
        f.write("x")
    return default_hooks.allreduce_hook(None, bucket)


def plain_sgd():
    L.seed_everything(0, verbose=False)
    return DigitsClassifier(lr=0.1, momentum=0.0)


def test_a_ddp_comm_hook_runs_on_cpu(tmp_path):
    """Lightning's DDPStrategy registers ddp_comm_hook on CUDA only; sync registers it on every device."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    steps = 6
    counts = tmp_path / "calls"
    ranks = fit(plain_sgd(), DigitsData(batch_size=16), strategy=SyncStrategy(
        ddp_comm_state=str(counts), ddp_comm_hook=counting_allreduce, bucket_cap_mb=1000), devices=2,
        max_steps=steps, out=tmp_path / "hook")
    for rank in range(2):  # one bucket (the digits CNN fits in one), one call a step
        assert (tmp_path / f"calls.{rank}").read_text() == "x" * steps
    sync = fit(plain_sgd(), DigitsData(batch_size=16), strategy=SyncStrategy(), devices=2, max_steps=steps,
               out=tmp_path / "sync")
    assert max_abs_diff(ranks[0]["params"], sync[0]["params"]) <= 1e-6  # the same mean, by torch's hook
    # a wrapper wraps the hook, as DDPStrategy(ddp_comm_wrapper=...) does: fp16 on the wire moves the weights
    fp16 = fit(plain_sgd(), DigitsData(batch_size=16), strategy=SyncStrategy(
        ddp_comm_hook=default_hooks.allreduce_hook, ddp_comm_wrapper=default_hooks.fp16_compress_wrapper),
        devices=2, max_steps=steps, out=tmp_path / "fp16")
    assert 0 < max_abs_diff(fp16[0]["params"], sync[0]["params"]) < 1e-2
    assert max_abs_diff(fp16[0]["params"], fp16[1]["params"]) == 0.0


class ParamsAfterStep(Callback):
    """Records whether the two ranks hold the same parameters after each step; gives post-local SGD its
    per-process subgroup (its default, one per node, is created for CUDA only)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        state = trainer.strategy._ddp_comm_state
        state.subgroup, _ = dist.new_subgroups(group_size=1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, flat)
        if trainer.is_global_zero:
            torch.save(torch.equal(gathered[0], gathered[1]), f"{pl_module.out}/agree{trainer.global_step}.pt")


def test_post_local_sgd_model_averaging(tmp_path):
    """DDPStrategy's post-local SGD (PostLocalSGDState + post_localSGD_hook + model_averaging_period):
    after the warm-up, replicas step alone and agree again exactly at every period's end."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local

    model = plain_sgd()
    model.out = str(tmp_path)
    state = post_local.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=2)
    ranks = fit(model, DigitsData(batch_size=16), strategy=SyncStrategy(
        ddp_comm_state=state, ddp_comm_hook=post_local.post_localSGD_hook, model_averaging_period=3),
        devices=2, max_steps=9, out=tmp_path / "run", callbacks=(ParamsAfterStep(),))
    agree = {s: torch.load(tmp_path / f"agree{s}.pt") for s in range(1, 10)}
    assert agree[1] and agree[2]  # warm-up: the hook all-reduces
    assert agree[3] and agree[6] and agree[9]  # the averager's steps (3, 6, 9)
    assert not agree[4] and not agree[5] and not agree[7]  # local steps between them
    assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
