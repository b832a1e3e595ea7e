"""``synthetic``: a model of a chosen parameter count on generated data, for communication benchmarks.

What a strategy sends depends on the gradient's size, not on what the model learns; this recipe
lets the size be set directly (``--model.num_params 25_000_000``, 1M to 1B and beyond) while
compute stays light: an MLP of ``num_layers`` square hidden layers whose width is solved from the
target count. The task is learnable, so the loss falls and a broken strategy still shows: inputs
are seeded Gaussian vectors, labels the argmax of a fixed random linear map of them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from gradsync.errors import check
from gradsync.recipes.base import ClassifierRecipe, RecipeData

NUM_FEATURES = 32
NUM_CLASSES = 10
DATA_SEED = 4321  # the data never depends on the run seed: runs are comparable across seeds
MIN_PARAMS = 10_000


def mlp_width(num_params: int, num_layers: int) -> int:
    """The hidden width w whose MLP (in -> w, ``num_layers`` x (w -> w), w -> out) is closest to ``num_params``.

    Parameters: (in+1) w + L (w^2 + w) + (w+1) out, a quadratic in w.
    """
    a, b, c = num_layers, NUM_FEATURES + 1 + num_layers + NUM_CLASSES, NUM_CLASSES - num_params
    w = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    return max(1, min((math.floor(w), math.ceil(w)), key=lambda x: abs(mlp_param_count(x, num_layers) - num_params)))


def mlp_param_count(width: int, num_layers: int) -> int:
    return (NUM_FEATURES + 1) * width + num_layers * (width * width + width) + (width + 1) * NUM_CLASSES


class SyntheticData(RecipeData):
    """Seeded Gaussian inputs labelled by a fixed random linear teacher (generated, no files)."""

    def __init__(self, *, num_samples: int = 8192, num_val_samples: int = 1024, batch_size: int = 32) -> None:
        """
        Args:
            num_samples: training samples per epoch, >= 1.
            num_val_samples: validation samples, >= 1.
            batch_size: per-process micro-batch size, >= 1.
        """
        super().__init__(batch_size=batch_size)
        check(num_samples >= 1, "num_samples", num_samples, "must be >= 1")
        check(num_val_samples >= 1, "num_val_samples", num_val_samples, "must be >= 1")
        self.num_samples, self.num_val_samples = num_samples, num_val_samples

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        g = torch.Generator().manual_seed(DATA_SEED)
        teacher = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=g)
        x = torch.randn(self.num_samples + self.num_val_samples, NUM_FEATURES, generator=g)
        y = (x @ teacher).argmax(dim=1)
        n = self.num_samples
        self.train_set = TensorDataset(x[:n], y[:n])
        self.val_set = TensorDataset(x[n:], y[n:])


class SyntheticModel(ClassifierRecipe):
    """An MLP of a chosen parameter count on generated data, for communication benchmarks."""

    num_classes = NUM_CLASSES
    #: FSDP2 units under ``--strategy.shard node``: each linear layer
    shard_modules = (nn.Linear,)

    def __init__(self, *, num_params: int = 25_000_000, num_layers: int = 4, **kwargs: Any) -> None:
        """
        Args:
            num_params: the model's parameter count (met within 0.1% above ~100k), >= 10_000.
                The gradient all-reduced per step is 4 x num_params bytes in fp32.
            num_layers: square hidden layers the parameters are spread over, >= 1. More layers
                mean more, smaller gradient tensors (and DDP buckets fill differently).
            **kwargs: optimizer options of :class:`~gradsync.recipes.base.Recipe`.
        """
        super().__init__(**kwargs)
        check(num_params >= MIN_PARAMS, "num_params", num_params, f"must be >= {MIN_PARAMS:_}",
              "e.g. --model.num_params 25_000_000")
        check(num_layers >= 1, "num_layers", num_layers, "must be >= 1")
        self.num_params, self.num_layers = num_params, num_layers
        self.save_hyperparameters()
        self.width = mlp_width(num_params, num_layers)
        w = self.width
        layers: list[nn.Module] = [nn.Linear(NUM_FEATURES, w), nn.ReLU()]
        for _ in range(num_layers):
            layers += [nn.Linear(w, w), nn.ReLU()]
        layers.append(nn.Linear(w, NUM_CLASSES))
        self.net = nn.Sequential(*layers)

    @property
    def actual_num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
