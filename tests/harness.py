"""Shared test helpers: in-process multi-process Lightning fits (fork), and pure-torch gloo groups.

Lightning's ``ddp`` strategy re-runs ``sys.argv`` for its children, which inside pytest re-runs
pytest; these helpers use the fork start method instead (~0.6 s per 2-process fit).
"""

from __future__ import annotations

import gc
import hashlib
import os
import socket
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


def before_fork() -> None:
    """Destroy garbage (a process group an earlier in-process fit dropped) here, where its threads
    run: a forked child that collected it would join worker threads it does not have, for ever."""
    gc.collect()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DumpRankState(Callback):
    """Writes every rank's final parameters (and the strategy's algorithm state) to ``out/rank{r}.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.start_step, self.batches_run = None, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step  # a resumed fit starts at the checkpoint's step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches_run += 1
        ledger = getattr(trainer.strategy, "ledger", None)
        self.last_step_ledger = ledger.summary() if ledger is not None else None

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        # the algorithm state first: reading it waits for anything in flight, which the ledger then counts
        algorithm = strategy.algorithm_state_dict() if hasattr(strategy, "algorithm_state_dict") else None
        state = {
            "params": {k: full(v).detach().clone() for k, v in pl_module.state_dict().items()},
            "global_step": trainer.global_step,
            "start_step": self.start_step,
            "batches_run": self.batches_run,
            "ledger": strategy.ledger.summary() if hasattr(strategy, "ledger") else None,
            # as the last training step left it: before the end-of-fit rounds of local SGD / DiLoCo
            "last_step_ledger": getattr(self, "last_step_ledger", None),
            "algorithm": algorithm,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "skipped": list(getattr(strategy, "skipped_steps", [])),
        }
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor (a shard under FSDP2) is gathered from its processes (collective)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fit(model: L.LightningModule, data: L.LightningDataModule, *, strategy: Any = "auto", devices: int = 1,
        max_steps: int = 20, out: Path, callbacks: tuple = (), ckpt_path: Optional[str] = None,
        **trainer_kwargs: Any) -> list[dict]:
    """Fit on ``devices`` CPU processes (fork) and return each rank's final state."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.pt"):
        f.unlink()
    if hasattr(strategy, "_start_method"):
        strategy._start_method = "fork"
    elif strategy == "auto" and devices > 1:
        strategy = "ddp_fork"
    os.environ["MASTER_PORT"] = str(free_port())
    before_fork()
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    settings = dict(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
        enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[DumpRankState(out), *callbacks],
    )
    trainer = L.Trainer(**{**settings, **trainer_kwargs})
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    # map_location: a CUDA run's tensors load on the CPU, so this process never creates a CUDA context (the
    # next fork-launched fit would refuse to start).
    return [torch.load(out / f"rank{r}.pt", weights_only=False, map_location="cpu") for r in range(devices)]


class ValAccuracy(Callback):
    """Accuracy of the final model (after the strategy's last round or read) on the validation split."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    @torch.no_grad()
    def on_fit_end(self, trainer, pl_module) -> None:
        x, y = trainer.datamodule.val_set.tensors
        acc = (pl_module(x).argmax(1) == y).float().mean().item()
        torch.save(acc, self.out / f"val_acc{trainer.global_rank}.pt")


def assert_resumed_at(ranks: list[dict], step: int, end: int, *, micro_batches_per_step: int = 1) -> None:
    """The resumed fit started at the checkpoint's ``step`` and trained only the steps up to ``end``."""
    for r in ranks:
        assert r["start_step"] == step, f"resumed fit started at step {r['start_step']}, not the checkpoint's {step}"
        assert r["batches_run"] == (end - step) * micro_batches_per_step, \
            f"resumed fit ran {r['batches_run']} batches, expected {(end - step) * micro_batches_per_step}"
        assert r["global_step"] == end


def digest(tensors) -> str:
    """sha256 of the tensors' bytes: equal hashes mean bit-identical tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def torchft_context() -> Any:
    """A multiprocessing context for processes that run torchft beside a Rust lighthouse in this one (which a
    plain fork crashes): a forkserver that imports torch, torchft, Lightning and gradsync once, so that each
    process skips an interpreter's imports (the first caller's preload wins for the whole session)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchft", "lightning", "gradsync.recipes", "gradsync.strategies",
                                "gradsync.comm.managed"])
    return ctx


# ---- pure-torch process groups ------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out, f"result{rank}.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_gloo(fn: Callable, world: int, *args: Any, tmp: Path, timeout: float = 60) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes with a gloo group; return each result.

    ``fn`` must be importable (module level). A hang fails after ``timeout`` seconds.
    """
    ctx = mp.get_context("fork")
    port = free_port()
    before_fork()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, str(tmp))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"gloo workers hung for more than {timeout} s"
    assert all(p.exitcode == 0 for p in procs), f"worker exit codes {[p.exitcode for p in procs]}"
    return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False) for r in range(world)]


class ValLoss(Callback):
    """Saves the validation loss over the whole validation set after fit (``val_loss{rank}.pt``)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    @torch.no_grad()
    def on_fit_end(self, trainer, pl_module) -> None:
        pl_module.eval()
        losses = [pl_module.compute_loss((x.unsqueeze(0), y.unsqueeze(0)))[0] for x, y in trainer.datamodule.val_set]
        torch.save(float(torch.stack(losses).mean()), self.out / f"val_loss{trainer.global_rank}.pt")
