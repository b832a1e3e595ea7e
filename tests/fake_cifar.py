"""A tiny CIFAR-10 in the real python-pickle format, for tests (the real one is never downloaded)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_fake_cifar10(root: Path, *, per_batch: int = 16, num_test: int = 16, seed: int = 0) -> Path:
    """Write ``root/cifar-10-batches-py/`` with 5 training batches, a test batch and the meta file.

    Images are random uint8 with a class-dependent brightness, so a model can learn something.
    Returns the batches folder.
    """
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def batch(n: int, label: str) -> dict:
        labels = [int(v) for v in rng.integers(0, 10, size=n)]
        data = rng.integers(0, 128, size=(n, 3072), dtype=np.uint8)
        data += (np.array(labels, dtype=np.uint8) * 12)[:, None]
        return {b"batch_label": label.encode(), b"labels": labels, b"data": data,
                b"filenames": [f"img_{i}.png".encode() for i in range(n)]}

    for i in range(1, 6):
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch(per_batch, f"training batch {i} of 5"), f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch(num_test, "testing batch 1 of 1"), f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [c.encode() for c in CLASSES], b"num_cases_per_batch": per_batch,
                     b"num_vis": 3072}, f)
    return folder
