"""straggler: ``sync`` against ``async_ps`` when one of three workers is slow.

Digits on 3 CPU processes (gloo); rank 2 sleeps a fixed delay in every training step (a straggler:
a slower GPU, a noisy neighbour). Each run does the same number of steps per worker. Reported side
by side in one run: the step rate of the fast workers and of the straggler, and the *gradient
throughput* — gradients that reached the model per second while the fast workers were training —
as the ratio async_ps / sync, with the final validation accuracy of the model.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Report, command_line


def _parts():
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from gradsync.recipes import DigitsClassifier

    class Straggler(DigitsClassifier):
        def __init__(self, *, delay: float = 0.0, **kwargs) -> None:
            super().__init__(**kwargs)
            self.delay = delay

        def training_step(self, batch, batch_idx):
            if self.global_rank == 2 and self.delay:
                time.sleep(self.delay)
            return super().training_step(batch, batch_idx)

    class Record(Callback):
        def __init__(self, out: Path) -> None:
            self.out, self.marks = out, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.marks.append(time.perf_counter())

        @torch.no_grad()
        def on_fit_end(self, trainer, pl_module) -> None:
            x, y = trainer.datamodule.val_set.tensors
            acc = (pl_module(x).argmax(1) == y).float().mean().item()
            torch.save({"marks": self.marks, "acc": acc}, self.out / f"rank{trainer.global_rank}.pt")

    return L, Straggler, Record


def one_run(name: str, delay: float, steps: int, tmp: Path) -> dict:
    L, Straggler, Record = _parts()
    from gradsync.recipes import DigitsData
    from gradsync.strategies import AsyncPSStrategy, SyncStrategy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    strategy = SyncStrategy() if name == "sync" else AsyncPSStrategy(max_staleness=8)
    strategy._start_method = "fork"
    out = tmp / f"{name}-{delay}"
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    # plain SGD: momentum 0.9 and asynchrony together overshoot (see docs/strategies/async-ps.md)
    model = Straggler(delay=delay, lr=0.2, momentum=0.0)
    trainer = L.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[Record(out)])
    trainer.fit(model, datamodule=DigitsData(batch_size=32))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(3)]
    start = min(r["marks"][0] for r in ranks)
    rate = [(len(r["marks"]) - 1) / (r["marks"][-1] - r["marks"][0]) for r in ranks]
    fast_end = max(ranks[r]["marks"][-1] for r in (0, 1))
    # gradients that reached the model by the time both fast workers were done
    applied = sum(sum(1 for m in r["marks"] if m <= fast_end) for r in ranks)
    return {"fast_rate": min(rate[:2]), "slow_rate": rate[2], "gradients_per_s": applied / (fast_end - start),
            "acc": ranks[0]["acc"], "wall": max(r["marks"][-1] for r in ranks) - start}


def run(out: Path, quick: bool = False) -> Report:
    steps, delays = (12, (0.0, 0.06)) if quick else (46, (0.0, 0.05, 0.1, 0.2))
    torch.set_num_threads(1)
    rows, data = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for delay in delays:
            res = {name: one_run(name, delay, steps, Path(tmp)) for name in ("sync", "async_ps")}
            ratio = res["async_ps"]["gradients_per_s"] / res["sync"]["gradients_per_s"]
            rows.append([f"{delay * 1000:.0f} ms", res["sync"]["fast_rate"], res["async_ps"]["fast_rate"],
                         res["async_ps"]["slow_rate"], res["sync"]["gradients_per_s"],
                         res["async_ps"]["gradients_per_s"], ratio, res["sync"]["acc"], res["async_ps"]["acc"]])
            data.append({"delay": delay, **{f"{k}_{n}": v for n, r in res.items() for k, v in r.items()},
                         "ratio": ratio})
    rep = Report("straggler", "sync vs async_ps (max_staleness 8) with one slow worker of 3, digits (gloo)",
                 ["straggler delay / step", "sync fast-worker steps/s", "async_ps fast-worker steps/s",
                  "async_ps straggler steps/s", "sync gradients/s", "async_ps gradients/s",
                  "async_ps / sync gradients/s", "sync val_acc", "async_ps val_acc"],
                 rows=rows, command=command_line())
    rep.notes.append(f"{steps} steps per worker, micro-batch 32, plain SGD lr 0.2; rank 2 sleeps the delay in every "
                     "training step. gradients/s = gradients that reached the model while the fast workers trained, "
                     "over that time. Both runs end when the straggler finishes its equal data shard; the gain is "
                     "that the model keeps moving at the fast workers' pace meanwhile.")
    rep.data = {"results": data}

    def plot(ax):
        x = range(len(data))
        ax.bar([i - 0.2 for i in x], [d["gradients_per_s_sync"] for d in data], 0.4, label="sync", color="#888")
        ax.bar([i + 0.2 for i in x], [d["gradients_per_s_async_ps"] for d in data], 0.4, label="async_ps", color="#4a7")
        ax.set_xticks(list(x), [f"{d['delay'] * 1000:.0f} ms" for d in data])
        ax.set_xlabel("straggler delay per step")
        ax.set_ylabel("gradients reaching the model per second")
        ax.legend()

    rep.write(out, plot)
    return rep
