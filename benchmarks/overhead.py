"""overhead: ``sync`` against Lightning's stock ``ddp`` on the same model and data, runs alternating.

Both train the ``synthetic`` recipe (a ~25M-parameter MLP: 100 MB of fp32 gradients per step) on 2
CPU processes (gloo), started the same way (Lightning's fork launcher) and differing only in the
strategy. The figure is the steady-state throughput (global batch / median optimizer-step time,
first steps excluded), reported as the ratio sync / ddp per pair, median with min–max.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Report, command_line


def _step_timer():
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self, out: Path) -> None:
            self.out, self.marks = out, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.marks.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.global_rank == 0:
                gaps = sorted(b - a for a, b in zip(self.marks[2:], self.marks[3:]))
                torch.save({"median_step": gaps[len(gaps) // 2], "steps": trainer.global_step}, self.out)

    return StepTimer


def one_run(strategy_name: str, num_params: int, steps: int, batch: int, tmp: Path) -> float:
    """Samples per second (steady state) of one 2-process run."""
    import lightning as L

    from gradsync.recipes import SyntheticData, SyntheticModel
    from gradsync.strategies import SyncStrategy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if strategy_name == "sync":
        strategy = SyncStrategy()
        strategy._start_method = "fork"
    else:
        strategy = "ddp_fork"
    L.seed_everything(0, verbose=False)
    model = SyntheticModel(num_params=num_params)
    data = SyntheticData(num_samples=2 * batch * (steps + 1), num_val_samples=2 * batch, batch_size=batch)
    out = tmp / f"{strategy_name}.pt"
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[_step_timer()(out)])
    trainer.fit(model, datamodule=data)
    return 2 * batch / torch.load(out)["median_step"]


def run(out: Path, quick: bool = False) -> Report:
    num_params, steps, pairs, batch = (200_000, 10, 2, 16) if quick else (25_000_000, 40, 9, 32)
    torch.set_num_threads(1)  # before any parallel work: the runs fork this process
    ratios, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            order = ("sync", "ddp") if i % 2 == 0 else ("ddp", "sync")  # alternate who goes first
            sps = {s: one_run(s, num_params, steps, batch, Path(tmp)) for s in order}
            ratios.append(sps["sync"] / sps["ddp"])
            rows.append([i + 1, " then ".join(order), sps["ddp"], sps["sync"], ratios[-1]])
    med = statistics.median(ratios)
    rep = Report("overhead", f"sync vs Lightning ddp, synthetic {num_params / 1e6:g}M params, 2 processes (gloo)",
                 ["pair", "order", "ddp samples/s", "sync samples/s", "sync / ddp"], rows=rows, command=command_line())
    rep.notes.append(f"throughput ratio sync / ddp: median {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
                     f"over {pairs} alternating pairs; goal >= 1.00 (sync leaves the all-reduce to DDP itself).")
    rep.notes.append(f"{steps} optimizer steps per run, batch {batch} per process; steady state = global batch / "
                     "median step time after 2 warm-up steps.")
    rep.data = {"ratios": ratios, "median_ratio": med, "num_params": num_params}
    def plot(ax):
        ax.bar(range(1, len(ratios) + 1), ratios, color="#4a7")
        ax.axhline(1.0, color="#888", lw=1)
        ax.axhline(1.0, color="#c44", lw=1, ls="--", label="goal 1.00")
        ax.set_xlabel("alternating pair")
        ax.set_ylabel("sync / ddp throughput")
        ax.set_ylim(min(0.8, min(ratios) - 0.05), max(1.1, max(ratios) + 0.05))
        ax.legend()

    rep.write(out, plot)
    return rep
