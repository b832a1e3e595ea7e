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

from typing import Any, ClassVar, Literal, Optional

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
    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The mean loss over ``batch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss(batch)")

    # ---- conventions -----------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.compute_loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.compute_loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)


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

    def _shard(self) -> tuple[int, int]:
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank

    def _batches_consumed(self) -> int:
        # Lightning fetches one batch ahead, so the loader cannot count for itself: ask the loop
        # how many batches of this epoch have entered a training step.
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def train_dataloader(self) -> ShardedLoader:
        world, rank = self._shard()
        sampler = ShardedSampler(len(self.train_set), num_replicas=world, rank=rank, shuffle=True,
                                 seed=run_seed(), batch_size=self.batch_size, drop_last=True)
        if len(sampler) == 0:
            raise ValueError(
                f"the training set has {len(self.train_set)} samples: too few for {world} processes "
                f"x batch size {self.batch_size}; lower --batch-size")
        return ShardedLoader(self.train_set, sampler=sampler, batch_size=self.batch_size,
                             batches_consumed=self._batches_consumed)

    def val_dataloader(self) -> ShardedLoader:
        world, rank = self._shard()
        sampler = ShardedSampler(len(self.val_set), num_replicas=world, rank=rank, shuffle=False,
                                 batch_size=self.batch_size, drop_last=False)
        return ShardedLoader(self.val_set, sampler=sampler, batch_size=self.batch_size)

    def test_dataloader(self) -> ShardedLoader:
        return self.val_dataloader()
