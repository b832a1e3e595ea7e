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
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

import lightning as L
import torch
from torch.utils.data import Dataset

from gradsync.errors import check
from gradsync.recipes.data import ShardedLoader, ShardedSampler, run_seed


class Recipe(L.LightningModule):
    """A LightningModule with gradsync's optimizer options and logging conventions.

    Subclasses implement :meth:`compute_loss` (the mean loss of a batch) and may override
    :meth:`validation_step`. ``train_loss`` and ``val_loss`` are always logged; ``metric_name``
    names the recipe's headline metric for the run summary.
    """

    metric_name: ClassVar[str] = "val_loss"

    def __init__(
        self,
        *,
        optimizer: Literal["sgd", "adamw"] = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        """
        Args:
            optimizer: ``sgd`` (with ``momentum``) or ``adamw``.
            lr: learning rate, > 0.
            momentum: SGD momentum in [0, 1); ignored by adamw.
            weight_decay: L2 penalty (sgd) or decoupled weight decay (adamw), >= 0.
        """
        super().__init__()
        check(optimizer in ("sgd", "adamw"), "optimizer", optimizer, "must be sgd or adamw")
        check(lr > 0, "lr", lr, "must be > 0", "e.g. --lr 0.05")
        check(0 <= momentum < 1, "momentum", momentum, "must be in [0, 1)")
        check(weight_decay >= 0, "weight_decay", weight_decay, "must be >= 0")
        self.optimizer_name, self.lr, self.momentum, self.weight_decay = optimizer, lr, momentum, weight_decay

    # ---- what subclasses write -----------------------------------------------------------
    def compute_loss(self, batch: Any) -> Union[torch.Tensor, tuple[torch.Tensor, Any]]:
        """The mean loss over ``batch``, or ``(mean_loss, weight)``.

        Return a weight (the number of samples or tokens the mean is over) when micro-batches can
        differ in size, e.g. padded sequences: gradsync strategies then normalize by the weight
        summed over all micro-batches and ranks, so the optimizer sees exactly the gradient of the
        mean over the whole global batch (not a mean of means).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss(batch)")

    # ---- conventions -----------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Union[torch.Tensor, dict]:
        out = self.compute_loss(batch)
        loss, weight = out if isinstance(out, tuple) else (out, None)
        self.log("train_loss", loss, prog_bar=True)
        return loss if weight is None else {"loss": loss, "weight": weight}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _mean_loss(self.compute_loss(batch)), prog_bar=True, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", _mean_loss(self.compute_loss(batch)), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)


def _mean_loss(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class RecipeData(L.LightningDataModule):
    """A DataModule whose loaders keep the data-order contract and resume mid-epoch.

    Subclasses set ``self.train_set`` and ``self.val_set`` (map-style datasets) in :meth:`setup`.
    ``batch_size`` is the per-process micro-batch.
    """

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

    def _shard(self) -> tuple[int, int]:
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning fetches one batch ahead, so the loader cannot count consumed batches itself;
        # this hook runs once per batch that actually enters a step.
        if self.trainer is not None and self.trainer.training and self._train_loader is not None:
            self._train_loader.note_consumed()
        return batch

    def train_dataloader(self) -> ShardedLoader:
        world, rank = self._shard()
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
