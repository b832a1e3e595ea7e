"""The parameter server's transport (``async_ps``): requests and replies between workers and shards.

Pure torch. :class:`ServerThread` is a background thread on a rank that hosts a shard
(:class:`~gradsync.algorithms.param_server.ShardState`): it receives requests from remote workers by
point-to-point operations on gloo groups of its own (an any-source ``irecv`` of a header that names
its sender) and serves the worker co-located on its rank in-process. :class:`PSClient` is what a
worker's training loop calls — ``pull``, ``push``, ``read``, ``stop`` — fanned out to every shard.
Every tensor either side sends is booked in the :class:`~gradsync.comm.ledger.CommLedger` it is
given, as a ``send`` of its bytes.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import torch
import torch.distributed as dist

from gradsync.comm.codecs.common import flatten as flatten_as
from gradsync.comm.codecs.common import unflatten
from gradsync.comm.ledger import CommLedger

OP_PULL, OP_PUSH, OP_READ, OP_STOP = 1, 2, 3, 4
TAG_REQUEST, TAG_GRAD, TAG_VERSION, TAG_PARAMS = 71, 72, 73, 74
HEADER = 5  # op, worker, version, weight, skip; then one learning rate per optimizer group


class ServerError(RuntimeError):
    """The parameter server failed or lost a worker; the message says which and when."""


def dtype_layout(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, list[int]]]:
    """Indices of ``tensors`` grouped by dtype, in first-seen order: one flat buffer per group."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.items())


def flatten(tensors: list[torch.Tensor], layout: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
    """One flat CPU buffer per dtype group of ``layout`` (what travels)."""
    return [flatten_as([tensors[i].detach().cpu() for i in idx], dtype) for dtype, idx in layout]


@torch.no_grad()
def unflatten_into(tensors: list[torch.Tensor], layout: list[tuple[torch.dtype, list[int]]],
                   flats: list[torch.Tensor]) -> None:
    """Copy each group's flat buffer back into its tensors."""
    for (_, idx), flat in zip(layout, flats):
        group = [tensors[i] for i in idx]
        for t, piece in zip(group, unflatten(flat, group)):
            t.copy_(piece)


class ServerThread(threading.Thread):
    """Serves one shard (a :class:`~gradsync.algorithms.param_server.ShardState`) on its rank until
    every remote worker has said stop.

    The thread blocks on requests from remote workers (any-source ``recv`` on ``request_group``,
    which only this thread uses on this rank; a gloo receive completes only inside ``wait``, so the
    thread cannot also poll a queue). The worker on the same rank calls :meth:`local` directly. Either
    way the shard is changed under :attr:`lock`, and replies go out under it as ``isend`` on
    ``reply_group`` — one sender at a time.
    """

    def __init__(self, shard: Any, *, request_group: Any, reply_group: Any, rank: int, world_size: int,
                 num_lrs: int, ledger: CommLedger, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.shard, self.rank, self.world_size = shard, rank, world_size
        self.request_group, self.reply_group = request_group, reply_group
        self.num_lrs, self.ledger = num_lrs, ledger
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
                op, src = int(header[0]), int(header[1])  # every request names its sender
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
            self.ledger.record("send", t.numel() * t.element_size())
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
                 timeout: float, ledger: CommLedger) -> None:
        """``groups[j]`` is shard j's (request group, reply group); ``local`` the shards served on this rank."""
        self.params, self.shards, self.servers, self.groups = params, shards, servers, groups
        self.local, self.rank, self.num_lrs, self.timeout, self.ledger = local, rank, num_lrs, timeout, ledger
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
            self.ledger.record("send", t.numel() * t.element_size())

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
