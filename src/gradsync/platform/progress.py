"""The training progress display: step, loss, samples/s and communication share.

On a terminal it is a live rich progress bar. Anywhere else (CI logs, ``| tee``, files) it prints
plain lines, a tenth of the run apart, with no colour codes or carriage returns::

    step 10/20  train_loss 0.8123  samples/s 1850  comm 12.5%
    validation at step 20: val_loss 0.4120  val_acc 0.9110
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks.progress import ProgressBar

from gradsync.platform.steps import total_training_steps, training_steps


def _num(v: Any) -> Optional[float]:
    if v is None:
        return None
    try:
        return float(v.item() if hasattr(v, "item") else v)
    except (TypeError, ValueError):
        return None


def step_stats(metrics: dict) -> str:
    """``train_loss 0.81  samples/s 1850  comm 12.5%`` from the trainer's latest metrics."""
    parts = []
    loss = _num(metrics.get("train_loss"))
    if loss is not None:
        parts.append(f"train_loss {loss:.4f}")
    sps = _num(metrics.get("perf/samples_per_second"))
    if sps is not None:
        parts.append(f"samples/s {sps:,.0f}")
    tps = _num(metrics.get("train_tokens_per_sec"))
    if tps is not None:
        parts.append(f"tokens/s {tps:,.0f}")
    share = _num(metrics.get("comm/run_time_share"))
    if share is not None:
        parts.append(f"comm {100 * share:.1f}%")
    groups = _num(metrics.get("ft/participants"))
    if groups is not None:  # fault-tolerant replica groups in the last round's quorum
        parts.append(f"groups {groups:.0f}")
    goodput = _num(metrics.get("ft/goodput"))
    if goodput is not None:
        parts.append(f"goodput {goodput:.2f}")
    return "  ".join(parts)


class GradsyncProgressBar(ProgressBar):
    """rich progress bar on a terminal, plain text lines elsewhere; on global rank 0, and (step lines
    only, marked ``[node N]``) on the first process of every other node.

    Args:
        live: ``True`` for the rich bar, ``False`` for plain lines, ``None`` to decide by whether
            standard output is a terminal.
        num_lines: how many plain lines a run prints (besides the last step and validations).
    """

    def __init__(self, *, live: Optional[bool] = None, num_lines: int = 10) -> None:
        super().__init__()
        self._enabled = True
        self._live = live
        self._num_lines = max(1, num_lines)
        self._console: Any = None
        self._progress: Any = None
        self._task: Any = None
        self._total: Optional[int] = None
        self._every = 1
        self._last_printed = -1
        self._prefix = ""

    # ---- ProgressBar interface ----
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_live(self) -> bool:
        return bool(self._live)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # (disables itself on every rank but global rank 0)
        if trainer.local_rank == 0 and trainer.node_rank > 0:
            # Every node shows that it trains: its first process prints the step lines, marked.
            self._prefix = f"[node {trainer.node_rank}] "
            self._live = False
            self.enable()
        from rich.console import Console

        self._console = Console()
        if self._live is None:
            self._live = self._console.is_terminal and not self._console.is_dumb_terminal

    # ---- training ----
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._enabled:
            return
        self._total = total_training_steps(trainer)
        self._every = max(1, (self._total or 500) // self._num_lines)
        self._last_printed = training_steps(trainer)
        if self._live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[stats]}"), console=self._console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self._total, completed=training_steps(trainer),
                                                 stats="")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._enabled:
            return
        step = training_steps(trainer)
        from gradsync.platform.tracking import telemetry_of

        telemetry = telemetry_of(trainer)
        stats = step_stats({**trainer.callback_metrics, **(telemetry.latest if telemetry is not None else {})})
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
            return
        last = self._total is not None and step >= self._total
        if step != self._last_printed and (step % self._every == 0 or last):
            self._last_printed = step
            total = f"/{self._total}" if self._total is not None else ""
            self._print(f"step {step}{total}  {stats}".rstrip())

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._enabled or trainer.sanity_checking or self._prefix:
            return
        vals = {k: _num(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
        text = "  ".join(f"{k} {v:.4f}" for k, v in sorted(vals.items()) if v is not None)
        if text:
            self._print(f"validation at step {training_steps(trainer)}: {text}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop()

    # ---- helpers ----
    def _print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            # plain print: no rich markup, highlighting or line wrapping in CI logs
            print(self._prefix + text, flush=True)

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
