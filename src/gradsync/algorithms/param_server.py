"""The parameter server's algorithm behind ``async_ps``: shards, versions and the staleness rule.

Pure torch (no Lightning, no communication): :class:`ShardState` is one server shard — the
authoritative copy of some parameters, their optimizer, the version counter (updates applied so
far) and the bounded-staleness rule. Not thread-safe; one thread owns it. The bytes between workers
and shards move in :mod:`gradsync.comm.ps`.

**Versions and the staleness rule.** A worker *pulls* parameters at version ``v`` (a shard's count
of applied updates), computes a gradient and *pushes* it tagged with ``v``. The shard applies the
mean of the gradients it holds as one update, turning version ``t`` into ``t+1``; a gradient
computed at ``v`` and applied at ``t`` has staleness ``t - v``. The shard advances only when no
worker would be left more than ``max_staleness`` versions behind:

* a worker that pulled ``v`` and has not pushed yet blocks the step to ``t+1`` if ``t+1-v > s``;
* a worker that pushed at ``v`` will next compute at ``max(v+1, t)`` or later, which blocks the
  step only when ``s = 0`` and ``v < t`` (it has not yet contributed to the current version);
* a worker never computes two gradients from the same version: its pull waits for the version to
  move past the one it last pushed.

With ``s = 0`` every update is the mean of one gradient from each worker, all computed from the
same parameters — synchronous SGD. With ``s >= 1`` gradients are applied as they come (one per
update when workers arrive one at a time) and a fast worker is held back only when it would get
more than ``s`` updates ahead of a worker still computing. Gradients of one update are summed in
(worker, version) order, so a run with ``s = 0`` is deterministic.

The weights of a push: an unweighted gradient counts 1; a weighted one (sum of weight x gradient of
the mean loss) counts its weight, so the update is the exact weighted mean over every sample. With
``staleness_scaling="inverse"`` a gradient applied ``tau >= 1`` updates late is scaled by ``1/tau``
in that mean (the staleness-dependent learning rate of Zhang et al. 2016); fresh gradients and
every gradient at bound 0 are unaffected.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Optional

import torch

from gradsync.comm.ps import ServerError, dtype_layout, flatten

__all__ = ["ShardState", "split_shards"]


def split_shards(numels: list[int], num_servers: int) -> list[list[int]]:
    """Assign parameter indices to ``num_servers`` shards, balancing their sizes.

    Largest parameter first onto the least-loaded shard; each shard lists its indices in order.
    Every shard gets at least one parameter when there are enough parameters.
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if num_servers > len(numels):
        raise ValueError(f"num_servers={num_servers} exceeds the number of parameters ({len(numels)})")
    loads = [0] * num_servers
    shards: list[list[int]] = [[] for _ in range(num_servers)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        j = min(range(num_servers), key=lambda j: (loads[j], j))
        shards[j].append(i)
        loads[j] += numels[i]
    return [sorted(s) for s in shards]


class ShardState:
    """One parameter-server shard. See the module docstring for the rule it enforces."""

    def __init__(self, params: list[torch.Tensor], make_optimizer: Callable[[list[torch.Tensor]], Any],
                 lr_groups: list[int], *, num_workers: int, max_staleness: int, version: int = 0,
                 staleness_scaling: str = "none") -> None:
        """
        Args:
            params: initial values of this shard's parameters (copied to CPU).
            make_optimizer: builds the server optimizer over the copies.
            lr_groups: for each server optimizer group, the index of the worker optimizer group whose
                learning rate it follows (a push carries the worker's current rates).
            num_workers: workers 0..num_workers-1 push to and pull from this shard.
            max_staleness: the bound ``s`` (0 = synchronous).
            version: starting version (a resumed run continues its count).
            staleness_scaling: ``none``, or ``inverse``: a gradient applied ``tau >= 1`` updates late
                enters the mean with weight ``1/tau`` (a staleness-dependent learning rate).
        """
        if staleness_scaling not in ("none", "inverse"):
            raise ValueError(f"staleness_scaling must be none or inverse, got {staleness_scaling!r}")
        self.staleness_scaling = staleness_scaling
        self.params = [p.detach().to("cpu", copy=True).requires_grad_(True) for p in params]
        self.optimizer = make_optimizer(self.params)
        self.lr_groups = list(lr_groups)
        self.layout = dtype_layout(self.params)
        self.max_staleness = int(max_staleness)
        self.version = int(version)
        self.num_workers = int(num_workers)
        # ("pushed", v): last pushed at v (start: version-1, i.e. ready); ("pulled", v): computing from v
        self.claims: dict[int, tuple[str, int]] = {w: ("pushed", self.version - 1) for w in range(num_workers)}
        self.pending: list[tuple[int, int, float, list[torch.Tensor]]] = []
        self._pending_lrs: Optional[list[float]] = None
        self.waiting: list[tuple[int, int]] = []  # (op, worker) not answerable yet
        self.staleness: Counter = Counter()
        self.pushes = self.pulls = self.reads = self.skipped = self.gradients_applied = 0
        self.updates = 0  # updates applied by this process (the version also counts earlier runs')

    # ---- the rule ------------------------------------------------------------------------------
    def can_advance(self) -> bool:
        nxt, s = self.version + 1, self.max_staleness
        for state, v in self.claims.values():
            if state == "pulled" and nxt - v > s:
                return False
            if state == "pushed" and nxt - max(v + 1, self.version) > s:
                return False
        return True

    def quiescent(self) -> bool:
        """No worker is computing from a version it pulled."""
        return all(state != "pulled" for state, _ in self.claims.values())

    # ---- requests ------------------------------------------------------------------------------
    def push(self, worker: int, version: int, weight: float, lrs: list[float],
             flats: Optional[list[torch.Tensor]]) -> None:
        """Accept a gradient computed at ``version`` (``flats`` None: the worker skipped this step)."""
        state, v = self.claims[worker]
        if state != "pulled" or v != version:
            raise ServerError(f"worker {worker} pushed a gradient for version {version} but its last pull "
                              f"was {'version ' + str(v) if state == 'pulled' else 'already answered by a push'}")
        self.pushes += 1
        if flats is None:
            # A skipped step (non-finite gradient) contributes nothing; the worker may compute again
            # from the same version.
            self.claims[worker] = ("pushed", version - 1)
            self.skipped += 1
        else:
            self.claims[worker] = ("pushed", version)
            self.pending.append((worker, version, float(weight), flats))
            self._pending_lrs = list(lrs)
        if self.pending and self.can_advance():
            self.apply()

    def try_pull(self, worker: int) -> Optional[tuple[int, list[torch.Tensor]]]:
        """Parameters to compute the next gradient from, or None if the worker must wait."""
        state, v = self.claims[worker]
        if state == "pulled":
            raise ServerError(f"worker {worker} pulled twice without pushing (holds version {v})")
        if self.version <= v:
            return None
        self.claims[worker] = ("pulled", self.version)
        self.pulls += 1
        return self.snapshot()

    def try_read(self) -> Optional[tuple[int, list[torch.Tensor]]]:
        """The current parameters once no worker is computing (pending gradients applied first)."""
        if not self.quiescent():
            return None
        if self.pending:
            # Safe for every bound: each pending gradient was within it when pushed, and the version
            # has not moved since.
            self.apply()
        self.reads += 1
        return self.snapshot()

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        return self.version, flatten(self.params, self.layout)

    # ---- one update ----------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self) -> None:
        """Apply the (weighted) mean of the pending gradients as one optimizer step."""
        t = self.version
        entries = sorted(self.pending, key=lambda e: (e[0], e[1]))
        total = sum(e[2] for e in entries)
        # staleness-aware: a gradient tau updates late counts 1/tau (Zhang et al. 2016)
        scales = [1.0 / max(1, t - e[1]) if self.staleness_scaling == "inverse" else 1.0 for e in entries]
        for gi, (dtype, idx) in enumerate(self.layout):
            acc = torch.zeros_like(entries[0][3][gi], dtype=torch.float64 if dtype == torch.float64 else torch.float32)
            for e, scale in zip(entries, scales):
                acc.add_(e[3][gi], alpha=scale) if scale != 1.0 else acc.add_(e[3][gi])
            acc /= total
            offset = 0
            for i in idx:
                p = self.params[i]
                p.grad = acc[offset : offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
        if self._pending_lrs is not None:
            for group, wg in zip(self.optimizer.param_groups, self.lr_groups):
                group["lr"] = self._pending_lrs[wg]
        with torch.enable_grad():
            self.optimizer.step()
        for p in self.params:
            p.grad = None
        for _, v, _, _ in entries:
            self.staleness[t - v] += 1
        self.gradients_applied += len(entries)
        self.pending.clear()
        self.version += 1
        self.updates += 1

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self, indices: list[int]) -> dict:
        """Per-parameter values and optimizer state keyed by global parameter index, and the counters."""
        opt_state = self.optimizer.state
        return {
            "version": self.version,
            "params": {g: p.detach().clone() for g, p in zip(indices, self.params)},
            "optimizer": {g: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt_state[p].items()}
                          for g, p in zip(indices, self.params) if p in opt_state},
            "staleness": dict(self.staleness),
            "counters": self.stats(),
        }

    @torch.no_grad()
    def load(self, indices: list[int], params: dict, optimizer: dict) -> None:
        for g, p in zip(indices, self.params):
            p.copy_(params[g])
            if g in optimizer:
                self.optimizer.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                           for k, v in optimizer[g].items()}

    def stats(self) -> dict:
        return {"version": self.version, "updates": self.updates, "pushes": self.pushes, "pulls": self.pulls,
                "reads": self.reads, "skipped_pushes": self.skipped, "gradients_applied": self.gradients_applied}
