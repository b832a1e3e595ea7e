"""``digits``: a small convolutional classifier on scikit-learn's bundled handwritten digits.

1,797 8x8 grey images in 10 classes, shipped inside scikit-learn (no download). A fixed split
holds out 297 images for validation. No dropout or batch norm, so data-parallel runs are exactly
comparable with single-process runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gradsync.errors import check
from gradsync.recipes.base import ClassifierRecipe, RecipeData

NUM_VAL = 297
SPLIT_SEED = 1234  # the split never depends on the run seed: val_acc is comparable across runs


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    return x, y


class DigitsData(RecipeData):
    """Handwritten digits (8x8) with a fixed train/validation split."""

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        x, y = load_digits_tensors()
        g = torch.Generator().manual_seed(SPLIT_SEED)
        perm = torch.randperm(len(y), generator=g)
        val, train = perm[:NUM_VAL], perm[NUM_VAL:]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])


class DigitsClassifier(ClassifierRecipe):
    """Two 3x3 convolutions and a linear head; ~0.97 validation accuracy in a few hundred steps."""

    def __init__(self, *, channels: int = 32, **kwargs: Any) -> None:
        """
        Args:
            channels: width of the second convolution (the first has half), >= 2.
            **kwargs: optimizer options of :class:`~gradsync.recipes.base.Recipe`.
        """
        super().__init__(**kwargs)
        check(channels >= 2, "channels", channels, "must be >= 2")
        self.channels = channels
        self.save_hyperparameters()
        half = max(1, channels // 2)
        self.conv1 = nn.Conv2d(1, half, 3, padding=1)
        self.conv2 = nn.Conv2d(half, channels, 3, padding=1)
        self.head = nn.Linear(channels * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))
