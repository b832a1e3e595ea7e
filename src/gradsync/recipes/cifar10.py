"""``cifar10``: ResNet-18 (the CIFAR variant) on CIFAR-10 read from its python-pickle files.

The user supplies the data; nothing is downloaded. Get ``cifar-10-python.tar.gz`` from
https://www.cs.toronto.edu/~kriz/cifar.html and extract it under ``--data.root``, so that
``ROOT/cifar-10-batches-py/`` holds ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and
``batches.meta`` (a ``--data.root`` that is itself that folder works too). Each batch file is a
pickled dict: ``b"data"`` a uint8 array of shape (N, 3072) — 1024 red, then 1024 green, then 1024
blue values per image, rows top to bottom — and ``b"labels"``, N integers in 0..9.

The network (He et al., 2016, as adapted to 32x32 inputs): a 3x3 stem without max-pooling, four
stages of two basic blocks (64, 128, 256, 512 channels x ``width / 64``), global average pooling
and a linear head; 11.2M parameters at the default width. Training augments with a random crop
(4-pixel zero padding) and a horizontal flip, drawn from (seed, epoch, sample index), so a sample
is augmented the same way whatever the number of processes. Batch-norm statistics are per
process (plain DDP semantics): unlike the other recipes, N processes x batch b are not exactly
1 process x batch N b.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from gradsync.errors import GradsyncError, check
from gradsync.recipes.base import ClassifierRecipe, RecipeData, Scheduler
from gradsync.recipes.data import run_seed

FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
# Per-channel mean and standard deviation of the CIFAR-10 training images (0..1 scale).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


# ---- reading the pickle files -------------------------------------------------------------------
def find_cifar10(root: str | Path) -> Path:
    """The folder that holds the batches: ``root/cifar-10-batches-py`` or ``root`` itself."""
    root = Path(root)
    for folder in (root / FOLDER, root):
        if (folder / TRAIN_FILES[0]).is_file():
            missing = [f for f in (*TRAIN_FILES, TEST_FILE, META_FILE) if not (folder / f).is_file()]
            if missing:
                raise GradsyncError(f"--data.root {root}: {folder} lacks {', '.join(missing)}; extract the whole "
                                    f"cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) there")
            return folder
    raise GradsyncError(
        f"--data.root {root}: no CIFAR-10 found; download cifar-10-python.tar.gz from "
        f"https://www.cs.toronto.edu/~kriz/cifar.html and extract it into {root} so that "
        f"{root / FOLDER}/data_batch_1..5, test_batch and batches.meta exist (nothing is downloaded for you)")


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> images uint8 (N, 3, 32, 32) and labels int64 (N,)."""
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except Exception as exc:  # unpickling raises many types for a foreign or truncated file
        raise GradsyncError(f"{path}: not a CIFAR-10 python batch ({type(exc).__name__}: {exc})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise GradsyncError(f"{path}: expected data of shape (N, 3072) and N labels, "
                            f"got {data.shape} and {len(labels)}")
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(root: str | Path) -> dict[str, Any]:
    """All of CIFAR-10 under ``root``: train/test images (uint8, N x 3 x 32 x 32), labels, class names."""
    folder = find_cifar10(root)
    parts = [read_batch(folder / f) for f in TRAIN_FILES]
    test_x, test_y = read_batch(folder / TEST_FILE)
    with open(folder / META_FILE, "rb") as f:
        meta = pickle.load(f, encoding="bytes")
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[b"label_names"]]
    return {"train_x": np.concatenate([p[0] for p in parts]), "train_y": np.concatenate([p[1] for p in parts]),
            "test_x": test_x, "test_y": test_y, "classes": names}


class CifarImages(Dataset):
    """uint8 images -> normalized float tensors, with optional crop-and-flip augmentation.

    The augmentation of sample i in epoch e depends only on (seed, e, i): ``epoch_of`` returns
    the current epoch (the training sampler's).
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, *, augment: bool = False,
                 epoch_of: Optional[Callable[[], int]] = None) -> None:
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.augment, self.epoch_of = augment, epoch_of or (lambda: 0)
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.x[i].float().div_(255)
        if self.augment:
            rng = random.Random(f"{run_seed()}/{self.epoch_of()}/{i}")
            dy, dx, flip = rng.randrange(9), rng.randrange(9), rng.random() < 0.5
            img = F.pad(img, (4, 4, 4, 4))[:, dy : dy + 32, dx : dx + 32]
            if flip:
                img = img.flip(2)
        return (img - self.mean) / self.std, self.y[i]


class Cifar10Data(RecipeData):
    """CIFAR-10 from the python-pickle batches under ``root`` (the user downloads them)."""

    def __init__(self, *, root: str = "data", augment: bool = True, batch_size: int = 128) -> None:
        """
        Args:
            root: folder holding ``cifar-10-batches-py/`` (or that folder itself).
            augment: random 32x32 crops of the 4-pixel zero-padded image and horizontal flips.
            batch_size: per-process micro-batch size, >= 1.
        """
        super().__init__(batch_size=batch_size)
        find_cifar10(root)  # a missing dataset fails now, before any process starts
        self.root, self.augment = root, augment
        self.classes: list[str] = []

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        d = load_cifar10(self.root)
        self.classes = d["classes"]
        self.train_set = CifarImages(d["train_x"], d["train_y"], augment=self.augment, epoch_of=self._epoch)
        self.val_set = CifarImages(d["test_x"], d["test_y"])

    def _epoch(self) -> int:
        return self._train_loader.sampler.epoch if self._train_loader is not None else 0


# ---- ResNet-18 ------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images: 3x3 stem, no max-pool, stages of 2 blocks, strides 1, 2, 2, 2."""

    def __init__(self, num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, c = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            c_out = width * 2**i
            blocks += [BasicBlock(c, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class Cifar10ResNet(ClassifierRecipe):
    """ResNet-18 on CIFAR-10 from the python-pickle files (~94% test accuracy with a full schedule)."""

    def __init__(self, *, width: int = 64, lr: float = 0.1, weight_decay: float = 5e-4, scheduler: Scheduler = "cosine",
                 warmup_steps: int = 0, **kwargs: Any) -> None:
        """
        Args:
            width: channels of the first stage (the standard ResNet-18 has 64), >= 1.
            lr: peak learning rate of SGD with momentum 0.9 (the usual CIFAR setting), > 0.
            weight_decay: L2 penalty, >= 0.
            scheduler: ``cosine`` (default here: decays over the whole run) or ``constant``.
            warmup_steps: optimizer steps of linear warm-up, >= 0 (useful with large global batches).
            **kwargs: the other :class:`~gradsync.recipes.base.Recipe` options.
        """
        super().__init__(lr=lr, weight_decay=weight_decay, scheduler=scheduler, warmup_steps=warmup_steps, **kwargs)
        check(width >= 1, "width", width, "must be >= 1")
        self.width = width
        self.save_hyperparameters()
        self.net = ResNet18(num_classes=10, width=width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
