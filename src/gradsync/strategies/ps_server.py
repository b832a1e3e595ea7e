"""The parameter server behind ``async_ps``: shard state, the staleness rule, and the transport.

Pure torch (no Lightning). Three layers:

* :class:`ShardState` — one server shard: the authoritative copy of some parameters, their
  optimizer, the version counter (updates applied so far) and the bounded-staleness rule. Not
  thread-safe; one thread owns it.
* :class:`ServerThread` — a background thread on the rank that hosts a shard. It receives requests
  from remote workers by point-to-point operations on a gloo group of its own (any-source
  ``irecv``), and from the worker co-located on its own rank through an in-process queue.
* :class:`PSClient` — what a worker's training loop calls: ``pull``, ``push``, ``read``, ``stop``,
  fanned out to every shard.

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

import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from gradsync.strategies.lightning_private import work_source_rank

OP_PULL, OP_PUSH, OP_READ, OP_STOP = 1, 2, 3, 4
TAG_REQUEST, TAG_GRAD, TAG_VERSION, TAG_PARAMS = 71, 72, 73, 74
HEADER = 5  # op, worker, version, weight, skip; then one learning rate per optimizer group


class ServerError(RuntimeError):
    """The parameter server failed or lost a worker; the message says which and when."""


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


def dtype_layout(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, list[int]]]:
    """Indices of ``tensors`` grouped by dtype, in first-seen order: one flat buffer per group."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.items())


def flatten(tensors: list[torch.Tensor], layout: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
    return [torch.cat([tensors[i].detach().reshape(-1).cpu() for i in idx]) for _, idx in layout]


@torch.no_grad()
def unflatten_into(tensors: list[torch.Tensor], layout: list[tuple[torch.dtype, list[int]]],
                   flats: list[torch.Tensor]) -> None:
    for (_, idx), flat in zip(layout, flats):
        offset = 0
        for i in idx:
            t = tensors[i]
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


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


class ServerThread(threading.Thread):
    """Serves one :class:`ShardState` on its rank until every remote worker has said stop.

    The thread blocks on requests from remote workers (any-source ``recv`` on ``request_group``,
    which only this thread uses on this rank; a gloo receive completes only inside ``wait``, so the
    thread cannot also poll a queue). The worker on the same rank calls :meth:`local` directly. Either
    way the shard is changed under :attr:`lock`, and replies go out under it as ``isend`` on
    ``reply_group`` — one sender at a time.
    """

    def __init__(self, shard: ShardState, *, request_group: Any, reply_group: Any, rank: int, world_size: int,
                 num_lrs: int, on_send: Callable[[int], None], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.shard, self.rank, self.world_size = shard, rank, world_size
        self.request_group, self.reply_group = request_group, reply_group
        self.num_lrs, self.on_send = num_lrs, on_send
        self.lock = threading.RLock()
        self._local_reply: Optional[Future] = None
        self._sent: dict[int, list[tuple[Any, torch.Tensor]]] = {}
        self.error: Optional[str] = None
        self.last_seen: dict[int, tuple[float, int]] = {}

    # ---- the co-located worker -------------------------------------------------------------
    def local(self, op: int, *args: Any) -> Future:
        """A request of the worker on this rank; the future resolves when it is answered."""
        fut: Future = Future()
        with self.lock:
            if self.error is not None:
                fut.set_exception(ServerError(self.error))
                return fut
            try:
                if op == OP_STOP:
                    fut.set_result(None)
                else:
                    self._handle(self.rank, op, args, fut)
            except ServerError as exc:
                self._fail(exc)
        return fut

    # ---- remote workers --------------------------------------------------------------------
    def run(self) -> None:
        remote = set(range(self.world_size)) - {self.rank}
        header = torch.zeros(HEADER + self.num_lrs, dtype=torch.float64)
        try:
            while remote:
                work = dist.irecv(header, src=None, group=self.request_group, tag=TAG_REQUEST)
                work.wait()
                src = work_source_rank(work)
                op = int(header[0])
                if op == OP_STOP:
                    remote.discard(src)
                    continue
                version, weight, skip = int(header[2]), float(header[3]), bool(header[4])
                args: tuple = ()
                if op == OP_PUSH:
                    flats = None
                    if not skip:
                        flats = []
                        for dtype, idx in self.shard.layout:
                            buf = torch.empty(sum(self.shard.params[i].numel() for i in idx), dtype=dtype)
                            dist.recv(buf, src=src, group=self.request_group, tag=TAG_GRAD)
                            flats.append(buf)
                    args = (version, weight, header[HEADER:].tolist(), flats)
                with self.lock:
                    self._handle(src, op, args, None)
            with self.lock:
                for works in self._sent.values():
                    for w, _ in works:
                        w.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting worker
            with self.lock:
                self._fail(exc)

    # ---- under the lock --------------------------------------------------------------------
    def _handle(self, worker: int, op: int, args: tuple, fut: Optional[Future]) -> None:
        shard = self.shard
        self.last_seen[worker] = (time.monotonic(), shard.version)
        if op == OP_PUSH:
            shard.push(worker, *args)
            if fut is not None:
                fut.set_result(None)
        elif op in (OP_PULL, OP_READ):
            if fut is not None:
                self._local_reply = fut
            shard.waiting.append((op, worker))
        else:
            raise ServerError(f"unknown request {op} from rank {worker}")
        still = []
        for op, w in shard.waiting:
            reply = shard.try_pull(w) if op == OP_PULL else shard.try_read()
            if reply is None:
                still.append((op, w))
            else:
                self._reply(w, reply)
        shard.waiting = still

    def _reply(self, worker: int, reply: tuple[int, list[torch.Tensor]]) -> None:
        if worker == self.rank:
            fut, self._local_reply = self._local_reply, None
            assert fut is not None
            fut.set_result(reply)
            return
        # The worker asked again, so it has received everything sent to it before: those sends are done.
        for w, _ in self._sent.pop(worker, []):
            w.wait()
        version, flats = reply
        tensors = [torch.tensor([version], dtype=torch.int64), *flats]
        works = []
        for tag, t in zip([TAG_VERSION] + [TAG_PARAMS] * len(flats), tensors):
            works.append((dist.isend(t, dst=worker, group=self.reply_group, tag=tag), t))
            self.on_send(t.numel() * t.element_size())
        self._sent[worker] = works

    def _fail(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        now = time.monotonic()
        seen = ", ".join(f"rank {w} {now - t:.1f} s ago at version {v}" for w, (t, v) in sorted(self.last_seen.items()))
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.error = (f"async_ps server on rank {self.rank} stopped at version {self.shard.version}: "
                      f"{type(exc).__name__}: {detail}; a worker was lost or broke the protocol "
                      f"(last request per worker: {seen or 'none'})")
        print(f"gradsync: {self.error}", file=sys.stderr, flush=True)
        if self._local_reply is not None and not self._local_reply.done():
            self._local_reply.set_exception(ServerError(self.error))
        for _, worker in self.shard.waiting:
            if worker != self.rank:
                try:  # tell a waiting remote worker instead of leaving it to time out
                    self._sent.setdefault(worker, []).append(
                        (dist.isend(torch.tensor([-1], dtype=torch.int64), dst=worker, group=self.reply_group,
                                    tag=TAG_VERSION), None))
                except Exception:  # noqa: BLE001 - the group may be broken too
                    pass


class PSClient:
    """A worker's view of every shard: which parameters each holds and how to reach it."""

    def __init__(self, params: list[torch.Tensor], shards: list[list[int]], servers: list[int],
                 groups: list[tuple[Any, Any]], local: dict[int, ServerThread], *, rank: int, num_lrs: int,
                 timeout: float, on_send: Callable[[int], None]) -> None:
        """``groups[j]`` is shard j's (request group, reply group); ``local`` the shards served on this rank."""
        self.params, self.shards, self.servers, self.groups = params, shards, servers, groups
        self.local, self.rank, self.num_lrs, self.timeout, self.on_send = local, rank, num_lrs, timeout, on_send
        self.layouts = [dtype_layout([params[i] for i in idx]) for idx in shards]
        self.versions: list[int] = [-1] * len(shards)

    def _header(self, op: int, version: int = 0, weight: float = 0.0, skip: bool = False,
                lrs: Optional[list[float]] = None) -> torch.Tensor:
        h = torch.zeros(HEADER + self.num_lrs, dtype=torch.float64)
        h[:HEADER] = torch.tensor([op, self.rank, version, weight, float(skip)], dtype=torch.float64)
        if lrs:
            h[HEADER:] = torch.tensor(lrs, dtype=torch.float64)
        return h

    def _send(self, j: int, tensors: list[torch.Tensor], tags: list[int]) -> None:
        for t, tag in zip(tensors, tags):
            dist.send(t, dst=self.servers[j], group=self.groups[j][0], tag=tag)
            self.on_send(t.numel() * t.element_size())

    def _request(self, op: int) -> list[int]:
        """Pull or read from every shard; writes the parameters into ``params``; returns versions."""
        futures: dict[int, Future] = {}
        for j in range(len(self.shards)):
            if j in self.local:
                futures[j] = self.local[j].local(op)
            else:
                self._send(j, [self._header(op)], [TAG_REQUEST])
        versions = []
        for j, idx in enumerate(self.shards):
            if j in futures:
                version, flats = futures[j].result(timeout=self.timeout)
            else:
                v = torch.zeros(1, dtype=torch.int64)
                dist.recv(v, src=self.servers[j], group=self.groups[j][1], tag=TAG_VERSION)
                version = int(v.item())
                if version < 0:
                    raise ServerError(f"async_ps server on rank {self.servers[j]} failed while this worker "
                                      f"(rank {self.rank}) waited; see its error above")
                flats = []
                for dtype, gidx in self.layouts[j]:
                    buf = torch.empty(sum(self.params[idx[i]].numel() for i in gidx), dtype=dtype)
                    dist.recv(buf, src=self.servers[j], group=self.groups[j][1], tag=TAG_PARAMS)
                    flats.append(buf)
            unflatten_into([self.params[i] for i in idx], self.layouts[j],
                           [f.to(self.params[idx[0]].device) for f in flats])
            versions.append(version)
        return versions

    def pull(self) -> list[int]:
        self.versions = self._request(OP_PULL)
        return self.versions

    def read(self) -> list[int]:
        return self._request(OP_READ)

    def push(self, grads: list[torch.Tensor], *, weight: float, lrs: list[float], skip: bool) -> None:
        """Send this worker's gradient (one tensor per parameter, as ``params``) to every shard."""
        for j, idx in enumerate(self.shards):
            flats = None if skip else flatten([grads[i] for i in idx], self.layouts[j])
            if j in self.local:
                self.local[j].local(OP_PUSH, self.versions[j], weight, lrs, flats).result(timeout=self.timeout)
            else:
                header = self._header(OP_PUSH, self.versions[j], weight, skip, lrs)
                self._send(j, [header] + (flats or []), [TAG_REQUEST] + [TAG_GRAD] * len(flats or []))

    def stop(self) -> None:
        for j in range(len(self.shards)):
            if j in self.local:
                self.local[j].local(OP_STOP).result(timeout=self.timeout)
            else:
                self._send(j, [self._header(OP_STOP)], [TAG_REQUEST])
