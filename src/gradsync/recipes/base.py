"""Bases for recipes: subclass :class:`Recipe` for a model and :class:`RecipeData` for its data.

A new model needs only its network, its loss and its data::

    class MyModel(Recipe):
        def __init__(self, *, hidden: int = 64, **kwargs):
            super().__init__(**kwargs)          # optimizer, lr, momentum, weight_decay
            self.net = torch.nn.Linear(8, hidden)

        def compute_loss(self, batch):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

and runs with ``gradsync fit --model my_pkg.MyModel --data my_pkg.MyData``.

What the base gives every recipe: the optimizer options (``optimizer``, ``lr``, ``momentum``,
``betas``, ``weight_decay``), a learning-rate schedule (``scheduler``, ``warmup_steps``,
``decay_steps``, ``min_lr_ratio``), the logging conventions (``train_loss``, ``val_loss``, ``lr``,
and the recipe's headline ``metric_name``), throughput counters (``train_samples_per_sec`` and, for
recipes that count tokens, ``train_tokens_per_sec``), and the loss weight that makes accumulation
exact.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar, Literal, Optional, Union

import lightning as L
import torch
from torch.utils.data import Dataset

from gradsync.errors import check
from gradsync.recipes.data import ShardedLoader, ShardedSampler, run_seed


Scheduler = Literal["constant", "cosine"]


def lr_factor(step: int, *, scheduler: Scheduler = "constant", warmup_steps: int = 0,
              decay_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` (the first step already trains, at ``lr / warmup_steps``),
    then ``constant`` or a half-cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``decay_steps``,
    flat after that.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "constant":
        return 1.0
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """``lr_factor`` as a picklable callable for ``LambdaLR`` (its settings go into the checkpoint)."""

    def __init__(self, scheduler: Scheduler, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> None:
        self.scheduler, self.warmup_steps = scheduler, warmup_steps
        self.decay_steps, self.min_lr_ratio = decay_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        return lr_factor(step, scheduler=self.scheduler, warmup_steps=self.warmup_steps,
                         decay_steps=self.decay_steps, min_lr_ratio=self.min_lr_ratio)


class Recipe(L.LightningModule):
    """A LightningModule with gradsync's optimizer, schedule, logging and throughput conventions.

    Subclasses implement :meth:`compute_loss` (the mean loss of a batch) and may override
    :meth:`validation_step`. Logged by every recipe:

    - ``train_loss`` every step, ``val_loss`` per validation (averaged over all ranks);
    - ``lr``, the learning rate of the step;
    - ``train_samples_per_sec`` (and ``train_tokens_per_sec`` when :meth:`count_tokens` counts
      tokens): samples over *all* processes per second of training, averaged since the start of
      the run, validation excluded;
    - ``metric_name``: the recipe's headline metric for the run summary.

    A subclass that overrides ``on_train_batch_start``/``on_train_batch_end``,
    ``on_validation_start`` or ``on_save_checkpoint`` calls ``super()`` to keep the counters and the
    checkpoint's record of the model class.
    """

    metric_name: ClassVar[str] = "val_loss"

    def __init__(
        self,
        *,
        optimizer: Literal["sgd", "adamw", "muon"] = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        scheduler: Scheduler = "constant",
        warmup_steps: int = 0,
        decay_steps: Optional[int] = None,
        min_lr_ratio: float = 0.0,
    ) -> None:
        """
        Args:
            optimizer: ``sgd`` (with ``momentum``), ``adamw`` (with ``betas``) or ``muon``:
                ``torch.optim.Muon`` on :meth:`muon_parameters` (the hidden weight matrices), AdamW
                on the rest, both at ``lr`` and ``weight_decay`` (:class:`~gradsync.recipes.optim.MuonAdamW`).
            lr: peak learning rate, > 0.
            momentum: SGD momentum in [0, 1); ignored by adamw.
            betas: AdamW's two moment decay rates, each in [0, 1); ignored by sgd.
            weight_decay: L2 penalty (sgd) or decoupled weight decay (adamw), >= 0.
            scheduler: ``constant``, or ``cosine`` decay from ``lr`` to ``min_lr_ratio * lr`` at
                ``decay_steps``; both after ``warmup_steps`` of linear warm-up.
            warmup_steps: optimizer steps of linear warm-up from ``lr / warmup_steps`` to ``lr``, >= 0.
            decay_steps: optimizer step at which the cosine reaches its floor (warm-up included);
                default: the run's length (``--max-steps``, or epochs x steps per epoch).
            min_lr_ratio: the cosine's floor as a fraction of ``lr``, in [0, 1].
        """
        super().__init__()
        check(optimizer in ("sgd", "adamw", "muon"), "optimizer", optimizer, "must be sgd, adamw or muon")
        check(lr > 0, "lr", lr, "must be > 0", "e.g. --lr 0.05")
        check(0 <= momentum < 1, "momentum", momentum, "must be in [0, 1)")
        check(len(betas) == 2 and all(0 <= b < 1 for b in betas), "betas", betas,
              "must be two numbers in [0, 1)", "e.g. --model.betas '[0.9, 0.95]'")
        check(weight_decay >= 0, "weight_decay", weight_decay, "must be >= 0")
        check(scheduler in ("constant", "cosine"), "scheduler", scheduler, "must be constant or cosine")
        check(isinstance(warmup_steps, int) and warmup_steps >= 0, "warmup_steps", warmup_steps,
              "must be an integer >= 0")
        check(decay_steps is None or (isinstance(decay_steps, int) and decay_steps >= 1), "decay_steps",
              decay_steps, "must be an integer >= 1", "or leave it unset to decay over the whole run")
        check(0 <= min_lr_ratio <= 1, "min_lr_ratio", min_lr_ratio, "must be in [0, 1]")
        self.optimizer_name, self.lr, self.momentum, self.weight_decay = optimizer, lr, momentum, weight_decay
        self.betas = (float(betas[0]), float(betas[1]))
        self.scheduler_name, self.warmup_steps = scheduler, warmup_steps
        self.decay_steps, self.min_lr_ratio = decay_steps, min_lr_ratio
        self._throughput = Throughput()

    # ---- what subclasses write -----------------------------------------------------------
    def compute_loss(self, batch: Any) -> Union[torch.Tensor, tuple[torch.Tensor, Any]]:
        """The mean loss over ``batch``, or ``(mean_loss, weight)``.

        Return a weight (the number of samples or tokens the mean is over) when micro-batches can
        differ in size, e.g. padded sequences: gradsync strategies then normalize by the weight
        summed over all micro-batches and ranks, so the optimizer sees exactly the gradient of the
        mean over the whole global batch (not a mean of means).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss(batch)")

    def count_samples(self, batch: Any) -> int:
        """Samples in ``batch`` for ``train_samples_per_sec``: the length of its first tensor."""
        first = _first_tensor(batch)
        return int(first.shape[0]) if first is not None and first.dim() > 0 else 0

    def count_tokens(self, batch: Any) -> Optional[int]:
        """Tokens in ``batch`` for ``train_tokens_per_sec``; ``None`` (not logged) unless overridden."""
        return None

    def parameter_groups(self) -> list[dict]:
        """Parameter groups for the optimizer; override to exempt e.g. biases from weight decay."""
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def muon_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters ``--model.optimizer muon`` gives to Muon: every 2-D parameter except
        embeddings' (Muon orthogonalizes a matrix's update, which suits a layer's weights, not a
        lookup table). Override to exclude e.g. an output head."""
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, torch.nn.Embedding)}
        return [p for p in self.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in embeddings]

    # ---- conventions -----------------------------------------------------------------------
    @property
    def attached_trainer(self) -> Optional[Any]:
        """The Trainer this module is attached to, or None (Lightning's ``trainer`` raises when there is none)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    def training_step(self, batch: Any, batch_idx: int) -> Union[torch.Tensor, dict]:
        out = self.compute_loss(batch)
        loss, weight = out if isinstance(out, tuple) else (out, None)
        self.log("train_loss", loss, prog_bar=True)
        if self.attached_trainer is not None and self.trainer.optimizers:
            self.log("lr", float(self.trainer.optimizers[0].param_groups[0]["lr"]), on_step=True, on_epoch=False)
        return loss if weight is None else {"loss": loss, "weight": weight}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _mean_loss(self.compute_loss(batch)), prog_bar=True, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _mean_loss(self.compute_loss(batch)), sync_dist=True)

    def configure_optimizers(self) -> Any:
        groups = self.parameter_groups()
        if self.optimizer_name == "muon":
            opt: torch.optim.Optimizer = self._muon_adamw(groups)
        elif self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas,
                                                           weight_decay=self.weight_decay)
        else:
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if self.scheduler_name == "constant" and self.warmup_steps == 0:
            return opt
        schedule = LRSchedule(self.scheduler_name, self.warmup_steps, self._decay_steps(), self.min_lr_ratio)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def _muon_adamw(self, groups: list[dict]) -> torch.optim.Optimizer:
        from gradsync.recipes.optim import MuonAdamW

        muon = {id(p) for p in self.muon_parameters()}
        muon_groups, adamw_groups = [], []
        for g in groups:  # each group split in two, keeping its own options (weight decay)
            params = list(g["params"])
            muon_groups.append({**g, "params": [p for p in params if id(p) in muon]})
            adamw_groups.append({**g, "params": [p for p in params if id(p) not in muon]})
        return MuonAdamW(muon_groups, adamw_groups, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)

    def _decay_steps(self) -> int:
        if self.decay_steps is not None or self.scheduler_name == "constant":
            return self.decay_steps or 0
        total = self.trainer.estimated_stepping_batches if self.attached_trainer is not None else float("inf")
        check(math.isfinite(total), "decay_steps", self.decay_steps,
              "must be set for a cosine schedule when the run has no length",
              "set --max-steps or --max-epochs, or --model.decay_steps")
        return int(total)

    # ---- throughput and learning-rate logging -----------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._throughput.start()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        world = self.trainer.world_size if self.attached_trainer is not None else 1
        tokens = self.count_tokens(batch)
        rates = self._throughput.end(self.count_samples(batch) * world, None if tokens is None else tokens * world)
        if rates is not None:
            samples_per_sec, tokens_per_sec = rates
            self.log("train_samples_per_sec", samples_per_sec, on_step=True, on_epoch=False)
            if tokens_per_sec is not None:
                self.log("train_tokens_per_sec", tokens_per_sec, on_step=True, on_epoch=False, prog_bar=True)

    def on_validation_start(self) -> None:
        self._throughput.pause()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Lets tools (``gradsync sample``) rebuild the model from the file alone.
        # FSDP2 (--strategy.shard node) swaps the class for a generated FSDP<Name>: record the user's own
        cls = next(c for c in type(self).__mro__ if not c.__module__.startswith("torch.distributed"))
        checkpoint["gradsync_recipe"] = {"model_class": f"{cls.__module__}.{cls.__qualname__}"}


class Throughput:
    """Counts samples/tokens per second of training, skipping the time spent in validation.

    The clock runs from the end of one training batch to the end of the next (data loading
    included); after a pause (validation) it restarts at the next batch's start.
    """

    def __init__(self) -> None:
        self.seconds, self.samples, self.tokens = 0.0, 0, 0
        self._since: Optional[float] = None

    def start(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def pause(self) -> None:
        self._since = None

    def end(self, samples: int, tokens: Optional[int]) -> Optional[tuple[float, Optional[float]]]:
        now = time.perf_counter()
        if self._since is None:
            return None
        self.seconds += now - self._since
        self.samples += samples
        self.tokens += tokens or 0
        self._since = now
        if self.seconds <= 0:
            return None
        return self.samples / self.seconds, (self.tokens / self.seconds if tokens is not None else None)


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in values:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


class ClassifierRecipe(Recipe):
    """A :class:`Recipe` for ``(inputs, labels)`` batches: cross-entropy loss, ``val_acc``/``test_acc``.

    Subclasses build their network after ``super().__init__(**kwargs)`` and define ``forward``;
    ``num_classes`` (a class attribute) sizes the accuracy metric.
    """

    metric_name = "val_acc"
    num_classes: ClassVar[int] = 10

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from torchmetrics.classification import MulticlassAccuracy

        self.val_acc = MulticlassAccuracy(num_classes=self.num_classes, average="micro")

    def compute_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def _evaluate(self, batch: Any, prefix: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", torch.nn.functional.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.val_acc.update(logits, y)
        self.log(f"{prefix}_acc", self.val_acc, prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")


def _mean_loss(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class RecipeData(L.LightningDataModule):
    """A DataModule whose loaders keep the data-order contract and resume mid-epoch.

    Subclasses set ``self.train_set`` and ``self.val_set`` (map-style datasets) in :meth:`setup`.
    ``batch_size`` is the per-process micro-batch.
    """

    #: The loaders give each rank its own shard (the data-order contract), so gradsync does not add
    #: Lightning's distributed sampler. A DataModule of your own that shards itself says so the same way.
    shards_itself = True

    def __init__(self, *, batch_size: int = 32) -> None:
        """
        Args:
            batch_size: per-process micro-batch size, >= 1.
        """
        super().__init__()
        check(isinstance(batch_size, int) and batch_size >= 1, "batch_size", batch_size, "must be an integer >= 1")
        self.batch_size = batch_size
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self._train_loader: Optional[ShardedLoader] = None

    def _shard(self, training: bool = False) -> tuple[int, int]:
        """(shards, this process's shard). Training data is split as the strategy's sampler arguments say:
        the processes of the job, or of every fault-tolerant replica group; evaluation over this job's."""
        if self.trainer is None:
            return 1, 0
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if training else None
        if kwargs:
            return int(kwargs["num_replicas"]), int(kwargs["rank"])
        return self.trainer.world_size, self.trainer.global_rank

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning fetches one batch ahead, so the loader cannot count consumed batches itself;
        # this hook runs once per batch that actually enters a step.
        if self.trainer is not None and self.trainer.training and self._train_loader is not None:
            self._train_loader.note_consumed()
        return batch

    def train_dataloader(self) -> ShardedLoader:
        world, rank = self._shard(training=True)
        accumulation = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        sampler = ShardedSampler(len(self.train_set), num_replicas=world, rank=rank, shuffle=True,
                                 seed=run_seed(), batch_size=self.batch_size, drop_last=True,
                                 step_batches=accumulation)
        if len(sampler) == 0:
            raise ValueError(
                f"the training set has {len(self.train_set)} samples: too few for {world} processes "
                f"x batch size {self.batch_size} x {accumulation} accumulation; lower --batch-size")
        self._train_loader = ShardedLoader(self.train_set, sampler=sampler, batch_size=self.batch_size)
        return self._train_loader

    def val_dataloader(self) -> ShardedLoader:
        world, rank = self._shard()
        sampler = ShardedSampler(len(self.val_set), num_replicas=world, rank=rank, shuffle=False,
                                 batch_size=self.batch_size, drop_last=False)
        return ShardedLoader(self.val_set, sampler=sampler, batch_size=self.batch_size)

    def test_dataloader(self) -> ShardedLoader:
        return self.val_dataloader()
