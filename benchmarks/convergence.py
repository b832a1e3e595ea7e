"""convergence: every codec at the recipes' own defaults, next to ``sync``, in one run.

Each recipe trains with its own optimizer and schedule and every strategy option at its default
(digits: SGD momentum 0.9; chargpt: AdamW with warm-up and cosine), 2 CPU processes on gloo,
seed 0. The table gives the final validation figure and its distance from ``sync``'s, with the
bytes the codec saved (the ledger's compression ratio). This is the table the test suite's
convergence tests are cut from (tests/distributed/test_compressed.py); a timing is not measured.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch

from benchmarks.common import Report, command_line

CODECS = ("fp16", "bf16", "int8", "powersgd", "sign", "topk")


def _fit(model, data, strategy, steps: int, out: Path):
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    class Final(Callback):
        @torch.no_grad()
        def on_fit_end(self, trainer, pl_module) -> None:
            pl_module.eval()
            val = trainer.datamodule.val_set
            if hasattr(val, "tensors"):  # digits: accuracy
                x, y = val.tensors
                figure = float((pl_module(x).argmax(1) == y).float().mean())
            else:  # chargpt: mean token loss over the validation windows
                losses = [pl_module.compute_loss((x.unsqueeze(0), y.unsqueeze(0)))[0] for x, y in val]
                figure = float(torch.stack(losses).mean())
            ledger = trainer.strategy.ledger.summary()
            torch.save({"figure": figure, "ratio": ledger["compression_ratio"]}, out / f"rank{trainer.global_rank}.pt")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    strategy._start_method = "fork"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[Final()])
    trainer.fit(model, datamodule=data)
    return torch.load(out / "rank0.pt")


def _recipe(name: str, quick: bool):
    import lightning as L

    from gradsync.recipes import CharData, CharGPT, DigitsClassifier, DigitsData

    L.seed_everything(0, verbose=False)
    if name == "digits":
        return DigitsClassifier(), DigitsData(batch_size=16)
    return CharGPT(n_layer=1, n_head=2, n_embd=48, block_size=32), CharData(max_chars=100_000, val_windows=64,
                                                                            batch_size=16)


def run(out: Path, quick: bool = False) -> Report:
    from gradsync.strategies import CompressedStrategy, SyncStrategy

    torch.set_num_threads(1)
    plan = ([("digits", 6, ("int8",)), ("chargpt", 6, ("int8",))] if quick else
            [("digits", 150, CODECS), ("chargpt", 80, CODECS), ("chargpt", 160, CODECS)])
    rows, data = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe, steps, codecs in plan:
            results = {}
            for name in ("sync", *codecs):
                strategy = SyncStrategy() if name == "sync" else CompressedStrategy(codec=name)
                results[name] = _fit(*_recipe(recipe, quick), strategy, steps, Path(tmp) / f"{recipe}{steps}{name}")
            ref = results["sync"]["figure"]
            for name, r in results.items():
                if recipe == "digits":
                    gap = f"{(r['figure'] - ref) * 100:+.1f} points"
                else:
                    gap = f"{(r['figure'] / ref - 1) * 100:+.2f} %"
                rows.append([recipe, steps, name, "val_acc" if recipe == "digits" else "val_loss", r["figure"], gap,
                             r["ratio"]])
                data.append({"recipe": recipe, "steps": steps, "strategy": name, **r, "sync": ref})
    rep = Report("convergence", "Every codec at the recipes' defaults, 2 processes: distance from sync",
                 ["recipe", "steps", "strategy", "metric", "value", "vs sync", "compression ratio"],
                 rows=rows, command=command_line())
    rep.notes.append("digits: DigitsClassifier() defaults (SGD lr 0.05, momentum 0.9), micro-batch 16; chargpt: "
                     "CharGPT(n_layer=1, n_head=2, n_embd=48, block_size=32) defaults (AdamW lr 2e-3, 50 warm-up steps, "
                     "cosine), micro-batch 16, first 100,000 characters; seed 0; every strategy option at its default "
                     "(sign and topk: momentum correction on).")
    rep.notes.append("goals (issue 17): fp16, bf16, int8, powersgd within 1.5 points of sync's val_acc / 2 % of its "
                     "val_loss; sign and topk within 4 points / 5 %.")
    rep.data = {"results": data}

    def plot(ax):
        labels = [f"{d['recipe']} {d['steps']}\n{d['strategy']}" for d in data if d["strategy"] != "sync"]
        gaps = [(d["figure"] - d["sync"]) * 100 if d["recipe"] == "digits" else -(d["figure"] / d["sync"] - 1) * 100
                for d in data if d["strategy"] != "sync"]
        ax.bar(range(len(gaps)), gaps, color=["#4a7" if g >= 0 else "#c66" for g in gaps])
        ax.axhline(0, color="#444", linewidth=0.8)
        ax.set_xticks(range(len(gaps)), labels, fontsize=6, rotation=90)
        ax.set_ylabel("better than sync (points / % of loss)")

    rep.write(out, plot)
    return rep
