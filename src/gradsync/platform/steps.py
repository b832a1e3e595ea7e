"""What a "step" is in gradsync's figures: one training step.

Under automatic optimization a training step is one optimizer step (over K accumulated micro-batches),
Lightning's ``trainer.global_step``. Under manual optimization it is one batch (one ``training_step``
call): Lightning counts every ``optimizer.step()`` in ``global_step``, so a module that steps two
optimizers per batch (a GAN's generator and discriminator) would show twice the steps, stop after
half the batches at ``--max-steps``, and report twice the samples per second. ``--max-steps``, the
progress line, samples/s and ``summary.json``'s ``global_step`` count training steps;
``summary.json`` adds Lightning's count as ``optimizer_steps`` where it differs.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Callback


def counts_batches(trainer: Any) -> bool:
    """True under manual optimization (a training step is a batch, not an optimizer step)."""
    module = trainer.lightning_module
    return module is not None and not module.automatic_optimization


def training_steps(trainer: Any) -> int:
    """Training steps done since the run first started (resumes included)."""
    if counts_batches(trainer):
        # (inside on_train_batch_end the batch is "processed", not yet "completed")
        return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)
    return int(trainer.global_step)


class TrainingStepLimit(Callback):
    """``--max-steps`` in training steps: under manual optimization, the run stops after that many
    batches, however many optimizer steps each batch takes (Lightning's own limit is lifted)."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.max_steps > 0 and counts_batches(trainer):
            trainer.fit_loop.epoch_loop.max_steps = -1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.max_steps > 0 and counts_batches(trainer) and training_steps(trainer) >= self.max_steps:
            trainer.should_stop = True


def total_training_steps(trainer: Any) -> Optional[int]:
    """The run's length in training steps, when known."""
    import math

    limit = next((cb.max_steps for cb in trainer.callbacks if isinstance(cb, TrainingStepLimit)), -1)
    if counts_batches(trainer):
        if limit > 0:
            return limit
        total = trainer.num_training_batches * max(trainer.max_epochs or 0, 0)
        return int(total) if total and math.isfinite(total) else None
    total = trainer.estimated_stepping_batches
    return int(total) if total is not None and math.isfinite(total) else None


def micro_batch_of(data: Any, trainer: Optional[Any] = None) -> int:
    """The per-process micro-batch: the DataModule's ``batch_size``, else (after fit) its train loader's."""
    size = getattr(data, "batch_size", None)
    if not size and trainer is not None:
        try:
            size = getattr(trainer.train_dataloader, "batch_size", None)
        except Exception:  # no loader was built (e.g. validate only)
            size = None
    return int(size or 0)
