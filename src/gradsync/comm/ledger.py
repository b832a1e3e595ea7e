"""The communication ledger: what every collective gradsync issues costs on the wire.

Byte counts follow the nccl-tests "bus bandwidth" convention: the bytes one rank sends under the
bandwidth-optimal algorithm for that collective, among the ranks of the group it runs on.

==============  =====================  ==========================================
collective      bytes this rank sends  why
==============  =====================  ==========================================
all_reduce      2(N-1)/N * S           ring: reduce-scatter, then all-gather
reduce_scatter  (N-1)/N * S            each rank forwards N-1 of its N chunks
all_to_all      (N-1)/N * S            each rank keeps one of its N chunks
all_gather      (N-1) * s              ``s`` is this rank's part; it reaches N-1 peers
broadcast       S at the root, else 0  the root's data leaves it once
send            S                      point to point
==============  =====================  ==========================================

**Training traffic** (gradients, parameters, pseudo-gradients) is the ledger's headline:
``wire_bytes``, ``logical_bytes`` and ``compression_ratio = logical_bytes / wire_bytes``, where
``logical_bytes`` is what a plain fp32 synchronous all-reduce of the same gradients would have sent
for the same optimizer steps (1.0 for sync DDP itself). Each training collective also belongs to a
*scope* (``world``, or ``intra_node`` / ``inter_node`` under a node topology) and to a *sync*: the
collectives that together synchronize the model once (the buckets of one optimizer step, one
averaging round, one fragment's round). ``peak_sync_bytes`` is the most one sync sent — the
figure that falls F-fold when a model is synchronized in F fragments.

**Other traffic** gradsync sends is counted apart, per purpose, so it never flatters or spoils the
compression ratio: ``checkpoint`` (coordination of a checkpoint write) and ``control`` (logged
metrics, agreement checks, barriers).

Pure torch: no Lightning import.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Literal, Optional

import torch
import torch.distributed as dist

Collective = Literal["all_reduce", "reduce_scatter", "all_to_all", "all_gather", "broadcast", "send"]
COLLECTIVES: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_to_all", "all_gather", "broadcast", "send")
#: Purposes of traffic that is not training traffic (reported apart from it).
OTHER_PURPOSES: tuple[str, ...] = ("checkpoint", "control")
TRAIN = "train"


def wire_bytes(collective: str, nbytes: int, world_size: int, *, is_root: bool = True) -> int:
    """Bytes this rank sends for one ``collective`` of ``nbytes`` among ``world_size`` ranks.

    ``nbytes`` is the full buffer size S, except for ``all_gather`` where it is this rank's part s.
    """
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if collective == "all_reduce":
        return (2 * (n - 1) * nbytes) // n
    if collective in ("reduce_scatter", "all_to_all"):
        return ((n - 1) * nbytes) // n
    if collective == "all_gather":
        return (n - 1) * nbytes
    if collective == "broadcast":
        return nbytes if (is_root and n > 1) else 0
    if collective == "send":
        return nbytes
    raise ValueError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")


def fp32_allreduce_bytes(numel: int, world_size: int) -> int:
    """What plain fp32 synchronous DDP sends for ``numel`` gradient entries: the logical baseline."""
    return wire_bytes("all_reduce", 4 * int(numel), world_size)


@dataclass
class Totals:
    """Running totals of one scope or one purpose."""

    wire_bytes: int = 0
    logical_bytes: int = 0
    seconds: float = 0.0
    collectives: int = 0
    peak_sync_bytes: int = 0
    _sync: Any = field(default=None, repr=False)  # key of the sync being counted
    _sync_bytes: int = field(default=0, repr=False)

    def add(self, sent: int, sync: Optional[Hashable]) -> None:
        self.wire_bytes += sent
        self.collectives += 1
        if sync is None or sync != self._sync:
            self._close_sync()
            self._sync = sync
        self._sync_bytes += sent
        if sync is None:
            self._close_sync()

    def _close_sync(self) -> None:
        self.peak_sync_bytes = max(self.peak_sync_bytes, self._sync_bytes)
        self._sync, self._sync_bytes = None, 0

    @property
    def peak(self) -> int:
        return max(self.peak_sync_bytes, self._sync_bytes)

    @property
    def compression_ratio(self) -> Optional[float]:
        """logical / wire bytes; None for traffic with no fp32 equivalent (FSDP2's intra-node gathers:
        what sync would send is booked to the scope a strategy replaces, not here)."""
        if self.wire_bytes == 0:
            return 1.0 if self.logical_bytes == 0 else float("inf")
        if self.logical_bytes == 0:
            return None
        return self.logical_bytes / self.wire_bytes

    def summary(self, *, with_ratio: bool = True) -> dict:
        ratio = self.compression_ratio
        out = {"wire_bytes": int(self.wire_bytes), "logical_bytes": int(self.logical_bytes),
               "compression_ratio": None if ratio is None else float(ratio), "seconds": float(self.seconds),
               "collectives": int(self.collectives), "peak_sync_bytes": int(self.peak)}
        if not with_ratio:
            for k in ("logical_bytes", "compression_ratio", "peak_sync_bytes"):
                out.pop(k)
        return out

    def load(self, state: dict) -> None:
        self.wire_bytes = int(state.get("wire_bytes", 0))
        self.logical_bytes = int(state.get("logical_bytes", 0))
        self.seconds = float(state.get("seconds", 0.0))
        self.collectives = int(state.get("collectives", 0))
        self.peak_sync_bytes = int(state.get("peak_sync_bytes", 0))
        self._sync, self._sync_bytes = None, 0


@dataclass
class CommLedger:
    """Per-rank running totals of communication. One ledger per strategy instance.

    ``seconds`` is the wall time from issuing a collective to its completion; for overlapped
    collectives it measures time in flight, not time the training loop waited.

    Every recording method takes ``group`` (the wire formula uses that group's size; without one
    the ledger's ``world_size``), ``scope`` (training traffic: which links it crosses) and
    ``purpose`` (``train``, or one of :data:`OTHER_PURPOSES`). Collectives may complete on
    communication threads, so updates are taken under a lock.
    """

    world_size: int = 1
    wire_bytes: int = 0
    logical_bytes: int = 0
    seconds: float = 0.0
    collectives: int = 0
    #: False where the training collectives run out of gradsync's sight (DDP's built-in all-reduce):
    #: their bytes are booked, their time is not, and the summary's ``seconds`` is None.
    timed: bool = True
    by_collective: dict = field(default_factory=dict)
    by_scope: dict = field(default_factory=dict)  # scope -> Totals (training traffic)
    other: dict = field(default_factory=dict)  # purpose -> Totals
    _lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    # A ledger travels with its strategy (Lightning's spawn launchers pickle it, copy.deepcopy(trainer)
    # copies it): the lock does not, a new one is made on the other side.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ---- recording -------------------------------------------------------------------------
    def group_size(self, group: Optional[dist.ProcessGroup] = None) -> int:
        if group is not None or (dist.is_available() and dist.is_initialized() and self.world_size > 1):
            return dist.get_world_size(group)
        return self.world_size

    def record(self, collective: str, nbytes: int, *, seconds: float = 0.0, is_root: bool = True,
               group: Optional[dist.ProcessGroup] = None, group_size: Optional[int] = None, scope: str = "world",
               purpose: str = TRAIN, sync: Optional[Hashable] = None) -> int:
        """Account one collective of ``nbytes`` (see :func:`wire_bytes`); returns its wire bytes.

        ``sync`` names the synchronization the collective belongs to (collectives recorded with
        the same key one after another count as one sync for ``peak_sync_bytes``); ``None``
        makes it a sync of its own.
        """
        n = group_size if group_size is not None else self.group_size(group)
        sent = wire_bytes(collective, nbytes, n, is_root=is_root)
        with self._lock:
            if purpose != TRAIN:
                totals = self.other.setdefault(purpose, Totals())
                totals.add(sent, None)
                totals.seconds += float(seconds)
                return sent
            self.wire_bytes += sent
            self.seconds += float(seconds)
            self.collectives += 1
            entry = self.by_collective.setdefault(collective, {"count": 0, "wire_bytes": 0})
            entry["count"] += 1
            entry["wire_bytes"] += sent
            totals = self.by_scope.setdefault(scope, Totals())
            totals.add(sent, sync)
            totals.seconds += float(seconds)
        return sent

    def add_logical(self, nbytes: int, *, scope: str = "world") -> None:
        """Account what fp32 sync DDP would have sent for the gradients this step replaced."""
        with self._lock:
            self.logical_bytes += int(nbytes)
            self.by_scope.setdefault(scope, Totals()).logical_bytes += int(nbytes)

    def add_seconds(self, seconds: float, *, scope: str = "world", purpose: str = TRAIN) -> None:
        with self._lock:
            if purpose != TRAIN:
                self.other.setdefault(purpose, Totals()).seconds += float(seconds)
                return
            self.seconds += float(seconds)
            self.by_scope.setdefault(scope, Totals()).seconds += float(seconds)

    # ---- collectives that record themselves ----------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
                   op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False, **account: Any):
        """``dist.all_reduce`` that records itself. With ``async_op`` returns a Future of the tensor.

        ``account``: ``scope``, ``purpose``, ``sync`` as in :meth:`record`.
        """
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_reduce", nbytes, lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a),
                         async_op, tensor, group, account)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *,
                               group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **account: Any):
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_gather", nbytes,
                         lambda a: dist.all_gather_into_tensor(output, tensor, group=group, async_op=a),
                         async_op, output, group, account)

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, *,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **account: Any):
        """All-gather into one tensor (``output`` holds every rank's ``tensor``, in rank order).

        ``dist.all_gather_single`` where torch has it (it replaces the deprecated
        ``all_gather_into_tensor``), else ``all_gather_into_tensor``; on a group that marks itself
        ``gathers_into_lists`` (torchft's), the list form into views of ``output``. Records this rank's part.
        """
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if getattr(group, "gathers_into_lists", False):
            gather = _gather_into_views
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_gather", nbytes, lambda a: gather(output, tensor, group=group, async_op=a),
                         async_op, output, group, account)

    def all_gather(self, outputs: list, tensor: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
                   async_op: bool = False, **account: Any):
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_gather", nbytes, lambda a: dist.all_gather(outputs, tensor, group=group, async_op=a),
                         async_op, outputs, group, account)

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, *,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **account: Any):
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("all_to_all", nbytes,
                         lambda a: dist.all_to_all_single(output, tensor, group=group, async_op=a),
                         async_op, output, group, account)

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *,
                              group: Optional[dist.ProcessGroup] = None, async_op: bool = False, **account: Any):
        """``dist.reduce_scatter_tensor`` (sum): ``output`` gets this rank's 1/N of the summed ``tensor``."""
        nbytes = tensor.numel() * tensor.element_size()
        return self._run("reduce_scatter", nbytes,
                         lambda a: dist.reduce_scatter_tensor(output, tensor, group=group, async_op=a),
                         async_op, output, group, account)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, group: Optional[dist.ProcessGroup] = None,
                  async_op: bool = False, **account: Any):
        nbytes = tensor.numel() * tensor.element_size()
        is_root = dist.get_rank() == src
        t0 = time.perf_counter()
        work = dist.broadcast(tensor, src=src, group=group, async_op=async_op)
        self.record("broadcast", nbytes, is_root=is_root, group=group, **account)
        return self._finish(work, t0, async_op, tensor, account)

    def _run(self, collective, nbytes, issue, async_op, result, group, account):
        t0 = time.perf_counter()
        work = issue(async_op)
        self.record(collective, nbytes, group=group, **account)
        return self._finish(work, t0, async_op, result, account)

    def _finish(self, work, t0, async_op, result, account):
        timing = {k: v for k, v in account.items() if k in ("scope", "purpose")}
        if not async_op:
            self.add_seconds(time.perf_counter() - t0, **timing)
            return result

        def done(fut):
            fut.wait()  # re-raises a failed collective
            self.add_seconds(time.perf_counter() - t0, **timing)
            return result

        return work.get_future().then(done)

    # ---- reporting -------------------------------------------------------------------------
    @property
    def compression_ratio(self) -> float:
        if self.wire_bytes == 0:
            return 1.0 if self.logical_bytes == 0 else float("inf")
        return self.logical_bytes / self.wire_bytes

    @property
    def peak_sync_bytes(self) -> int:
        """The most training bytes one sync sent, over every scope."""
        return max((t.peak for t in self.by_scope.values()), default=0)

    def summary(self) -> dict:
        out = {
            "wire_bytes": int(self.wire_bytes),
            "logical_bytes": int(self.logical_bytes),
            "compression_ratio": float(self.compression_ratio),
            "seconds": float(self.seconds) if self.timed else None,
            "collectives": int(self.collectives),
            "peak_sync_bytes": int(self.peak_sync_bytes),
        }
        scopes = set(self.by_scope) - {"world"}
        if scopes:
            out["by_scope"] = {s: self.by_scope[s].summary() for s in sorted(self.by_scope)}
        purposes = (*OTHER_PURPOSES, *sorted(set(self.other) - set(OTHER_PURPOSES)))  # e.g. heal, when a group healed
        out["other"] = {p: self.other[p].summary(with_ratio=False) if p in self.other else
                        Totals().summary(with_ratio=False) for p in purposes}
        return out

    def metrics(self) -> dict[str, float]:
        """The summary as flat ``name -> number`` pairs for loggers (``inter_node/wire_bytes``, ...)."""
        out: dict[str, float] = {}

        def walk(prefix: str, d: dict) -> None:
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(f"{prefix}{k}/", v)
                elif v is not None:
                    out[f"{prefix}{k}"] = float(v)

        summary = self.summary()
        walk("", {k: v for k, v in summary.items() if k not in ("by_scope", "other")})
        walk("", summary.get("by_scope", {}))
        walk("", summary["other"])
        return out

    def state_dict(self) -> dict:
        return {**self.summary(), "by_collective": {k: dict(v) for k, v in self.by_collective.items()},
                "by_scope": {s: t.summary() for s, t in self.by_scope.items()}}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.wire_bytes = int(state.get("wire_bytes", 0))
            self.logical_bytes = int(state.get("logical_bytes", 0))
            self.seconds = float(state.get("seconds") or 0.0)  # None where the ledger was not timed
            self.collectives = int(state.get("collectives", 0))
            self.by_collective = {k: dict(v) for k, v in state.get("by_collective", {}).items()}
            self.by_scope = {}
            for scope, saved in (state.get("by_scope") or {}).items():
                self.by_scope[scope] = Totals()
                self.by_scope[scope].load(saved)
            if not self.by_scope and (self.wire_bytes or self.logical_bytes):
                # a checkpoint from before scopes: everything was world traffic
                self.by_scope["world"] = Totals()
                self.by_scope["world"].load({**state, "peak_sync_bytes": state.get("peak_sync_bytes", 0)})
            self.other = {}
            for purpose, saved in (state.get("other") or {}).items():
                self.other[purpose] = Totals()
                self.other[purpose].load(saved)


def _gather_into_views(output: torch.Tensor, tensor: torch.Tensor, *, group: Any, async_op: bool = False) -> Any:
    """All-gather into one tensor through the list form, for process groups without a gather into one tensor
    (torchft's, which mark themselves ``gathers_into_lists``): each rank's part lands in its view of ``output``."""
    parts = list(output.view(-1).chunk(group.size()))
    return dist.all_gather(parts, tensor.reshape(-1), group=group, async_op=async_op)
