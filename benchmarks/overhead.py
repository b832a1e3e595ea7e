"""overhead: ``sync`` against Lightning's stock ``ddp`` on the same model and data, runs alternating.

Both train the ``synthetic`` recipe (a ~25M-parameter MLP: 100 MB of fp32 gradients per step) on 2
CPU processes (gloo), started the same way (Lightning's fork launcher) and differing only in the
strategy. The figure is the steady-state throughput (global batch / median optimizer-step time,
first steps excluded). Each round runs three arms in a rotating order: ``sync``, ``ddp`` and ``ddp``
again. The A/A ratio (the second ddp run over the first) is the benchmark's own floor: what two
identical runs differ by on this machine; ``sync`` over the mean of the round's two ddp runs is the
figure, read against that floor.
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
    out.unlink(missing_ok=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[_step_timer()(out)])
    trainer.fit(model, datamodule=data)
    return 2 * batch / torch.load(out)["median_step"]


ARMS = ("sync", "ddp", "ddp again")


def run(out: Path, quick: bool = False) -> Report:
    num_params, steps, rounds, batch = (200_000, 10, 2, 16) if quick else (25_000_000, 40, 9, 32)
    torch.set_num_threads(1)  # before any parallel work: the runs fork this process
    ratios, controls, rows = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            order = ARMS[i % 3:] + ARMS[:i % 3]  # each arm goes first, second and third in turn
            sps = {arm: one_run(arm.split()[0], num_params, steps, batch, Path(tmp)) for arm in order}
            ddp = (sps["ddp"] + sps["ddp again"]) / 2
            ratios.append(sps["sync"] / ddp)
            controls.append(sps["ddp again"] / sps["ddp"])
            rows.append([i + 1, ", ".join(order), sps["ddp"], sps["ddp again"], sps["sync"], controls[-1], ratios[-1]])
    med, floor = statistics.median(ratios), statistics.median(controls)
    rep = Report("overhead", f"sync vs Lightning ddp, synthetic {num_params / 1e6:g}M params, 2 processes (gloo)",
                 ["round", "order", "ddp samples/s", "ddp again samples/s", "sync samples/s", "A/A: ddp again / ddp",
                  "sync / mean ddp"], rows=rows, command=command_line())
    rep.notes.append(f"throughput ratio sync / ddp: median {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
                     f"over {rounds} rounds; goal >= 1.00 (sync leaves the all-reduce to DDP itself).")
    rep.notes.append(f"A/A control, ddp against ddp: median {floor:.3f} (min {min(controls):.3f}, max "
                     f"{max(controls):.3f}): two identical runs differ this much here, so a sync / ddp ratio inside "
                     "that range is no measurable difference.")
    rep.notes.append(f"{steps} optimizer steps per run, batch {batch} per process; steady state = global batch / "
                     "median step time after 2 warm-up steps; arms rotate through the three positions.")
    rep.data = {"ratios": ratios, "controls": controls, "median_ratio": med, "median_control": floor,
                "num_params": num_params}

    def plot(ax):
        x = range(1, len(ratios) + 1)
        ax.plot(x, ratios, "o-", color="#4a7", label="sync / mean ddp")
        ax.plot(x, controls, "s--", color="#888", label="A/A: ddp again / ddp")
        ax.axhline(1.0, color="#c44", lw=1, ls="--", label="goal 1.00")
        ax.set_xlabel("round")
        ax.set_ylabel("throughput ratio")
        lo, hi = min(ratios + controls), max(ratios + controls)
        ax.set_ylim(min(0.8, lo - 0.05), max(1.1, hi + 0.05))
        ax.legend()

    rep.write(out, plot)
    return rep
