"""Data order shared by every recipe.

The contract (DESIGN.md "Data order"): N processes with per-process batch b see, step by step,
exactly the samples that 1 process with batch N*b sees. With a permutation ``perm`` of the epoch,
rank r takes ``perm[r::N]``; its t-th batch of b samples are ``perm[(t*b + j)*N + r]``, j < b, and
the union over ranks is ``perm[t*N*b : (t+1)*N*b]`` — the single process's t-th batch. Incomplete
batches are dropped so every process runs the same number of steps.

With gradient accumulation of K micro-batches, optimizer step t consumes ``perm[t*G : (t+1)*G]``
(G = K*N*b) whatever N is, and only whole global batches are kept, so the same G on 1, 2 or 3
processes gives the same optimization.

The loader also resumes mid-epoch: its ``state_dict`` (stored by Lightning with the fit loop)
records the epoch and how many samples of it were consumed, and the sampler skips those.
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def run_seed() -> int:
    """The run's seed as set by ``lightning.seed_everything`` (0 when none was set)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class ShardedSampler(DistributedSampler):
    """Rank ``rank`` of ``num_replicas`` takes every N-th index of a per-epoch permutation.

    A ``DistributedSampler`` (so Lightning does not replace it) with the contract's tail rule:
    no padding, only whole batches.
    """

    def __init__(self, num_samples: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, batch_size: int = 1, drop_last: bool = True, step_batches: int = 1) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        # DistributedSampler's own __init__ needs a dataset; everything it sets is overridden here.
        self.num_samples_total = num_samples
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.batch_size, self.drop_last = batch_size, drop_last
        self.step_batches = step_batches  # micro-batches per optimizer step (accumulation)
        self._skip: Optional[tuple[int, int]] = None  # (epoch, samples to skip)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, epoch: int, num_samples: int) -> None:
        """Skip the first ``num_samples`` of ``epoch`` once (mid-epoch resume)."""
        self._skip = (epoch, num_samples)

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            perm = torch.randperm(self.num_samples_total, generator=g).tolist()
        else:
            perm = list(range(self.num_samples_total))
        mine = perm[self.rank :: self.num_replicas]
        if self.drop_last:
            # Only whole global batches: the same steps on every rank, and for any N with the same G.
            unit = self.batch_size * self.step_batches
            per_rank = self.num_samples_total // self.num_replicas
            mine = mine[: (per_rank // unit) * unit]
        return mine

    def __iter__(self) -> Iterator[int]:
        indices = self._indices()
        if self._skip is not None and self._skip[0] == self.epoch:
            indices = indices[self._skip[1] :]
        self._skip = None
        return iter(indices)

    def __len__(self) -> int:
        return len(self._indices())


class ShardedLoader(DataLoader):
    """A DataLoader over a :class:`ShardedSampler` whose position survives a checkpoint.

    The position is counted in *global samples* consumed this epoch, so a run can resume on a
    different number of processes (with the same global batch) and continue exactly.
    """

    def __init__(self, dataset: Dataset, *, sampler: ShardedSampler, batch_size: int, **kwargs) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=sampler.drop_last, **kwargs)
        self.position = 0  # micro-batches of this epoch that reached a training step, on this rank

    def note_consumed(self) -> None:
        """Called once per micro-batch that enters a training step (not when it is prefetched)."""
        self.position += 1

    def __iter__(self):
        skip = self.sampler._skip
        self.position = skip[1] // self.batch_size if skip is not None and skip[0] == self.sampler.epoch else 0
        return super().__iter__()

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch,
                "samples_consumed": self.position * self.batch_size * self.sampler.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.skip(int(state["epoch"]), int(state["samples_consumed"]) // self.sampler.num_replicas)
