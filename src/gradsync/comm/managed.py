"""Replica groups that survive one another's failures: torchft's Manager as gradsync's transport between groups.

A *replica group* is one ``gradsync fit`` job (a node's processes, or one process) holding one replica of the
model; with several processes, DDP keeps them equal inside it and each process meets the processes of the
same local rank in the other groups.
Replica groups find each other through torchft's Lighthouse (``gradsync lighthouse``); before every round
each group asks its Manager for a *quorum* — the groups alive right now — and torchft reconfigures a
gloo/NCCL process group over exactly those. A group that died drops out of the next quorum; one that
comes back is *healed*: it receives a live group's state (model, optimizer, algorithm state, step
counters) over torchft's checkpoint transport before it contributes.

:class:`ReplicaGroup` owns the Manager and what gradsync needs of it: a quorum per round
(:meth:`ReplicaGroup.begin_round`), a commit decision after the reduction (:meth:`ReplicaGroup.commit`),
the state a healing group receives (``state_dict`` / ``load_state_dict`` callables), and telemetry.
:class:`ManagedReducer` is the reducer of rounds on it: the exact fp32 mean over the groups in the
quorum. A group that is healing contributes zeros and is not counted (torchft's semantics), so the mean
is never taken over a stale or missing contribution.

torchft is the ``ft`` extra (``pip install gradsync[ft]``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from gradsync.comm.ledger import TRAIN, CommLedger
from gradsync.comm.reducer import Reducer, WrappingReducer, split_by_dtype, unflatten_into
from gradsync.errors import GradsyncError

#: torchft's own environment names, read as fallbacks of the flags.
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"

MISSING_EXTRA = "--fault-tolerance torchft needs the ft extra: pip install 'gradsync[ft]'"


class _DropFlightRecorder(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:  # NCCL's flight recorder: not on gloo, said per quorum
        return "flight recorder" not in str(record.getMessage())


def import_torchft() -> Any:
    """torchft, its per-quorum INFO lines quieted (its Rust side reads ``RUST_LOG``, default here ``warn``)."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError:
        raise GradsyncError(MISSING_EXTRA) from None
    log = logging.getLogger("torchft")
    if log.level == logging.NOTSET:
        log.setLevel(logging.WARNING)
    for logger in (log, logging.getLogger("torchft.manager")):
        if not any(isinstance(f, _DropFlightRecorder) for f in logger.filters):
            logger.addFilter(_DropFlightRecorder())
    # torch's deserialization of a received checkpoint warns that the buffer is read-only; the tensors are
    # copied into the model's own at once
    warnings.filterwarnings("ignore", message=r"The given buffer is not writable")
    return torchft


@dataclass
class FaultToleranceConfig:
    """How this job joins the fault-tolerant replica groups (``--fault-tolerance torchft``)."""

    lighthouse: str
    replica_group: int
    replica_groups: int
    #: seconds a round waits for a quorum (a group restarting and healing joins within it; ``--timeout``)
    quorum_timeout: float = 300.0
    #: seconds any collective, commit or heal transfer may take (``--timeout``)
    timeout: float = 60.0
    #: processes in this replica group (``--devices``): one replica, DDP inside the group
    processes: int = 1
    #: seconds to wait for the lighthouse to answer at start (``--timeout`` when given): an address that
    #: refuses fails at once, one that never answers (a wrong host, a firewall) after this long
    connect_timeout: float = 10.0

    def describe(self) -> dict:
        return {"engine": "torchft", "lighthouse": self.lighthouse, "replica_group": self.replica_group,
                "replica_groups": self.replica_groups, "processes_per_group": self.processes}


@dataclass
class Telemetry:
    """What the summary, the progress line and W&B report about membership."""

    rounds: int = 0
    committed: int = 0
    participants: list = field(default_factory=list)  # per round: groups whose contribution was averaged
    failures_seen: int = 0  # rounds with fewer groups than the one before
    heals: int = 0
    heal_seconds: float = 0.0
    heal_bytes: int = 0
    steps_healed_over: int = 0  # steps this group took over from a peer when it healed
    uncommitted: int = 0  # rounds / steps this group dropped because a group failed during them
    quorum_seconds: float = 0.0  # time spent forming quorums (and fetching a heal): where a failure costs
    started_at: float = field(default_factory=time.monotonic)
    #: this process's optimizer steps: how many it took and kept, and their time (forward and backward included)
    steps: int = 0
    steps_kept: int = 0
    stepping_seconds: float = 0.0
    #: the steps no failure touched (no smaller quorum, heal or dropped step during them): the pace
    calm_steps: int = 0
    calm_seconds: float = 0.0
    _seen: tuple = (0, 0, 0)

    def note_step(self, seconds: float, kept: bool = True) -> None:
        """An optimizer step of this process took ``seconds``; ``kept``: its work stayed in the model (a
        ``sync`` step that a failure left uncommitted did not)."""
        seen = (self.failures_seen, self.heals, self.uncommitted)
        calm, self._seen = seen == self._seen, seen
        self.steps += 1
        self.steps_kept += int(kept)
        self.stepping_seconds += seconds
        if calm and kept:
            self.calm_steps += 1
            self.calm_seconds += seconds

    def goodput(self) -> Optional[float]:
        """Steps this process kept ÷ steps it would have taken in its stepping time without failures, at its
        own pace: the mean of the steps no failure touched (a step that saw a smaller quorum, a heal or a
        dropped step is not). Time outside optimizer steps (data loading, validation) is left out of both.
        None before 16 such steps."""
        if self.calm_steps < 16 or self.stepping_seconds <= 0:
            return None
        pace = self.calm_seconds / self.calm_steps
        return min(1.0, self.steps_kept * pace / self.stepping_seconds)

    #: What a checkpoint carries over to the group's next process (torchrun restarts it after a failure),
    #: so that its figures count every process of the group, as its ledger's heal bytes do.
    _CARRIED = ("rounds", "committed", "participants", "failures_seen", "heals", "heal_seconds", "heal_bytes",
                "steps_healed_over", "uncommitted", "quorum_seconds")

    def state_dict(self) -> dict:
        return {name: (list(v) if isinstance(v := getattr(self, name), list) else v) for name in self._CARRIED}

    def load_state_dict(self, state: dict) -> None:
        for name in self._CARRIED:
            if name in state:
                setattr(self, name, list(state[name]) if name == "participants" else type(getattr(self, name))(state[name]))

    def summary(self) -> dict:
        parts = self.participants
        goodput = self.goodput()
        return {"goodput": None if goodput is None else round(goodput, 4), "rounds": self.rounds, "committed": self.committed,
                "participants": {"min": min(parts) if parts else None, "max": max(parts) if parts else None,
                                 "last": parts[-1] if parts else None, "per_round": list(parts)},
                "failures_seen": self.failures_seen, "heals": self.heals,
                "heal_seconds": round(self.heal_seconds, 3), "heal_bytes": self.heal_bytes,
                "steps_healed_over": self.steps_healed_over, "uncommitted": self.uncommitted,
                "quorum_seconds": round(self.quorum_seconds, 3)}


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class ReplicaGroup:
    """This job as one fault-tolerant replica group, from one of its processes.

    Every process of the group runs a Manager: local rank 0's talks to the lighthouse for the group and
    gathers the group's commit votes, and each process's process group joins the processes of its local
    rank in the other groups of a quorum. A healing group's process of local rank ``r`` receives the state
    of the donor's process of local rank ``r``.

    Args:
        config: the lighthouse and this group's index.
        state_dict: what a healing group receives from this one (tensors are read, not copied, while the
            peer fetches them: called at a round's start, before anything changes).
        load_state_dict: applies a peer's state in a healing group.
        ledger: books the heal bytes under ``other.heal``.
    """

    def __init__(self, config: FaultToleranceConfig, *, state_dict: Callable[[], dict],
                 load_state_dict: Callable[[dict], None], ledger: CommLedger) -> None:
        import_torchft()
        from torchft import Manager, ProcessGroupGloo

        self.config, self.ledger = config, ledger
        check_lighthouse(config)  # reachable within the timeout, and no live group already has this index
        self._user_state_dict, self._user_load = state_dict, load_state_dict
        self.telemetry = Telemetry()
        #: this process's local rank in the group, and the group's processes (the job's default process group)
        self.rank, self.processes = _job_rank_and_size()
        #: the address the other groups reach this group at (its store, when the quorum's process groups are
        #: set up over it, and its Manager)
        self.host = os.environ.get("GRADSYNC_FT_HOSTNAME", socket.gethostname())
        # The group's own store, on its local rank 0: the Manager's server address and torchft's per-quorum
        # keys live there.
        self._store = (torch.distributed.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)
                       if self.rank == 0 else None)
        self._store_port = _from_rank_0(self._store.port if self._store is not None else 0, self.processes)
        timeout = timedelta(seconds=config.timeout)
        try:
            self.manager = self._manager(Manager, ProcessGroupGloo, timeout)
        except Exception as exc:  # the lighthouse went away since check_lighthouse
            raise GradsyncError(f"fault tolerance: cannot reach the lighthouse {config.lighthouse} "
                                f"({_first_line(exc)}); {_UNREACHABLE_FIX}") from None
        self._healing_started: Optional[float] = None

    def _manager(self, Manager: Any, ProcessGroupGloo: Any, timeout: timedelta) -> Any:
        config = self.config
        #: the process group torchft reconfigures over each quorum's groups
        self.pg = _quorum_group(ProcessGroupGloo)(timeout=timeout)
        return Manager(
            pg=self.pg, min_replica_size=1, load_state_dict=self._load,
            state_dict=self._user_state_dict, replica_id=_replica_id(config.replica_group),
            lighthouse_addr=config.lighthouse, store_addr=self.host, store_port=self._store_port, rank=self.rank,
            world_size=self.processes, use_async_quorum=True, init_sync=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout), connect_timeout=timeout, hostname=self.host)

    # ---- rounds ----------------------------------------------------------------------------------
    def begin_round(self) -> None:
        """Form this round's quorum (blocking: a healing group fetches a peer's state meanwhile)."""
        t0 = time.perf_counter()
        try:
            self.manager.start_quorum()
            self.manager.wait_quorum()
        except Exception as exc:  # the lighthouse is gone, or no quorum formed in time
            raise GradsyncError(f"fault tolerance: no quorum at the lighthouse {self.config.lighthouse} within "
                                f"{self.config.quorum_timeout:g} s ({_first_line(exc)}); start it with "
                                "`gradsync lighthouse --min-replicas N` and pass its address to --lighthouse") from None
        self.telemetry.quorum_seconds += time.perf_counter() - t0
        if self.healing:
            self._healing_started = t0
        n = self.participants
        if self.telemetry.participants and n < self.telemetry.participants[-1]:
            self.telemetry.failures_seen += 1
        self.telemetry.rounds += 1
        self.telemetry.participants.append(n)

    @property
    def healing(self) -> bool:
        """This group is behind the quorum and takes a peer's state at this round's commit."""
        return not self.manager.is_participating()

    @property
    def step(self) -> int:
        """Steps (rounds) committed by the groups of this quorum, as torchft counts them (a healing group
        is behind it until its commit)."""
        return int(self.manager.current_step())

    @property
    def participants(self) -> int:
        """Groups whose contribution this round's mean is taken over (a healing group's is not)."""
        return self.manager.num_participants()

    def commit(self) -> bool:
        """After the round's reduction: True when every group may apply it (a healing group's peer state
        is loaded first); False when a peer failed during the round, which then changes nothing."""
        ok = self.manager.should_commit()
        if ok:
            self.telemetry.committed += 1
        else:
            self.telemetry.uncommitted += 1
        return ok

    def _load(self, state: dict) -> None:
        self._user_load(state)
        nbytes = _tensor_bytes(state)
        self.telemetry.heals += 1
        self.telemetry.heal_bytes += nbytes
        if self._healing_started is not None:
            self.telemetry.heal_seconds += time.perf_counter() - self._healing_started
            self._healing_started = None
        self.ledger.record("send", nbytes, group_size=2, purpose="heal")

    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` replaced by its mean over the quorum's participants (zeros sent while healing)."""
        work = self.manager.allreduce(tensor)
        work.wait()
        return tensor

    def mean(self, tensor: torch.Tensor, *, purpose: str = TRAIN, sync: Optional[Hashable] = None) -> torch.Tensor:
        """:meth:`allreduce_mean`, booked in the ledger (training traffic, or ``purpose``'s)."""
        self.allreduce_mean(tensor)
        self.ledger.record("all_reduce", tensor.numel() * tensor.element_size(), group_size=self.wire_size(),
                           purpose=purpose, sync=sync)
        return tensor

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` replaced by its sum over the quorum's participants (zeros sent while healing)."""
        from torch.distributed import ReduceOp

        work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
        work.wait()
        return tensor

    def report_error(self, exc: Exception) -> None:
        """A collective of this round failed (a group died during it): the commit drops the round."""
        self.manager.report_error(exc)

    @property
    def errored(self) -> bool:
        """A collective of this round failed already: the rest of the round sends nothing."""
        return self.manager.errored() is not None

    def codec_reducer(self, spec: Any, scope: str = "world") -> Reducer:
        """The reducer of ``spec`` (a :class:`~gradsync.comm.CodecSpec`) across the groups of each quorum: the
        codec on the quorum's process group, in a :class:`ManagedCodec`, inside error feedback."""
        return spec.build(ledger=self.ledger, group=self.pg, scope=scope, wrap=lambda codec: ManagedCodec(codec, self))

    def disagreeing(self, fingerprint: dict[str, str]) -> list[str]:
        """The fields of ``fingerprint`` (field -> digest, the same on every group that runs the same job)
        on which the groups of this quorum differ. One all-reduce of a fixed-size bit pattern: each field
        XORs 32 bits of its digest into one of 128 slots chosen by its name, and the mean of a bit over
        the groups is exactly 0 or 1 where every group holds the same bit."""
        slots, owners = [0] * _AGREE_SLOTS, {}
        for name, digest in fingerprint.items():
            slot = _hash32(name) % _AGREE_SLOTS
            slots[slot] ^= _hash32(f"{name}={digest}")
            owners.setdefault(slot, []).append(name)
        bits = ((torch.tensor(slots, dtype=torch.int64).unsqueeze(1) >> torch.arange(32)) & 1).to(torch.float32)
        flat = self.mean(bits.reshape(-1), purpose="control")
        mixed = ((flat != 0) & (flat != 1)).reshape(_AGREE_SLOTS, 32).any(dim=1)
        return sorted(name for slot in mixed.nonzero().flatten().tolist()
                      for name in owners.get(slot, ["a field this group does not have"]))

    def wire_size(self) -> int:
        """Groups in this round's process group (a healing group takes part, sending zeros)."""
        return max(int(self.pg.size()), 1)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


_AGREE_SLOTS = 128


# ---- the lighthouse, before joining --------------------------------------------------------------
_UNREACHABLE_FIX = "start it with `gradsync lighthouse --min-replicas N` and pass its address to --lighthouse"


def _replica_id(group: int) -> str:
    return f"gradsync_{group}"


def lighthouse_status(url: str, timeout: float) -> str:
    """The lighthouse's status page (its quorum and every member's last heartbeat), read over the HTTP
    endpoint torchft's lighthouse serves beside its RPCs. Raises :class:`GradsyncError` in one line, naming
    the whole address and ``--timeout``, when nothing answers within ``timeout`` seconds."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as reply:
            return reply.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GradsyncError(f"fault tolerance: cannot reach the lighthouse {url} ({_first_line(reason)}; waited up to "
                            f"{timeout:g} s, --timeout SECONDS waits longer); {_UNREACHABLE_FIX}") from None


_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def heartbeat_ages(status: str) -> dict[str, float]:
    """Replica id (without torchft's per-start suffix) -> seconds since its latest heartbeat, from
    :func:`lighthouse_status`'s page (``gradsync_0:<uuid>: seen 0.0123s ago``)."""
    import re

    ages: dict[str, float] = {}
    for rid, value, unit in re.findall(r"([\w.-]+):[0-9a-f-]+: seen ([0-9.]+)(ns|µs|us|ms|s) ago", status):
        age = float(value) * _UNITS[unit]
        ages[rid] = min(age, ages.get(rid, age))
    return ages


def check_lighthouse(config: FaultToleranceConfig, *, fresh: float = 1.0, recheck_after: float = 1.5) -> None:
    """Refuse to join when the lighthouse does not answer, or when another live group already runs with this
    ``--replica-group``: its heartbeats are fresh now and still fresh ``recheck_after`` seconds later (a group
    restarted after a failure finds only its dead self's heartbeat, which ages)."""
    rid = _replica_id(config.replica_group)
    for attempt in range(2):
        age = heartbeat_ages(lighthouse_status(config.lighthouse, config.connect_timeout)).get(rid)
        if age is None or age >= fresh:
            return
        if attempt == 0:
            time.sleep(recheck_after)
    raise GradsyncError(
        f"--replica-group {config.replica_group}: a live replica group with this index is already at the lighthouse "
        f"{config.lighthouse} (its latest heartbeat {age:.2g} s ago); give each group its own --replica-group "
        f"0..{config.replica_groups - 1}")


def _job_rank_and_size() -> tuple[int, int]:
    """This process's rank in its job (its replica group) and the job's processes."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _from_rank_0(value: int, processes: int) -> int:
    """``value`` as the job's rank 0 holds it, on every process of the job."""
    if processes == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _quorum_group(base: type) -> type:
    """torchft's process group, as gradsync's reducers ask of a group: its ``rank()`` is this group's rank in
    the quorum it was last configured for (torchft's answers the rank it was constructed with, 0), and it
    says that it has no all-gather into one tensor (see :meth:`CommLedger.all_gather_single`)."""

    class QuorumGroup(base):  # type: ignore[misc, valid-type]
        gathers_into_lists = True

        def rank(self) -> int:
            return self.parent.rank()

    return QuorumGroup


def _hash32(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


class ManagedReducer(Reducer):
    """``identity`` over the replica groups of a quorum: the exact mean, one all-reduce per dtype.

    The sum over the quorum's process group, divided by the participants (torchft's average): a
    healing group sends zeros and is not counted. ``divide_first``: each group divides by the
    participants and the quorum sums, as DDP's own gradient all-reduce does (``sync``'s mean).
    """

    codec = "identity"

    def __init__(self, group: ReplicaGroup, *, ledger: Optional[CommLedger] = None, scope: str = "world",
                 divide_first: bool = False) -> None:
        super().__init__(ledger=ledger, scope=scope)
        self.replicas, self.divide_first = group, divide_first

    def reduce(self, tensors: Sequence[torch.Tensor], *, names: Optional[Sequence[str]] = None,
               sync: Optional[Hashable] = None) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._means(list(tensors), sync))
        return fut

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Any:
        """As :meth:`reduce`, as a step of an enclosing reducer (a group's processes each reduce their
        share of the replica: :class:`~gradsync.comm.hierarchical.NodeReducer`)."""
        return self._means(tensors, sync), list(tensors)
        yield  # pragma: no cover - a generator, as every reducer's run; its collectives block

    def _means(self, tensors: list[torch.Tensor], sync: Optional[Hashable]) -> list:
        means: list[Optional[torch.Tensor]] = [None] * len(tensors)
        t0 = time.perf_counter()
        for _, idx in split_by_dtype(tensors).items():  # as IdentityReducer: one all-reduce per dtype
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
            if self.divide_first:
                self.replicas.allreduce_sum(flat.mul_(1.0 / self.replicas.participants))
            else:
                self.replicas.allreduce_mean(flat)
            self.ledger.record("all_reduce", flat.numel() * flat.element_size(), group_size=self.replicas.wire_size(),
                               scope=self.scope, sync=sync, seconds=time.perf_counter() - t0)
            unflatten_into(means, flat, tensors, idx)
        return means

    def world_size(self) -> int:
        return self.replicas.participants


class ManagedCodec(WrappingReducer):
    """A lossy codec's reducer (``inner``, built on the quorum's process group) across the replica groups of a
    quorum, with the semantics of torchft's managed all-reduce around it:

    * a healing group sends zeros, which every codec decodes to zero, and the codec's mean over the process
      group is rescaled to the participants (the groups whose contribution counts);
    * its ``sent`` is its whole input, so error feedback keeps no residual from a round it took no part in:
      what it owed died with the process it was, and it starts from zero, as a new job does;
    * a collective that fails (a group died during the round) is logged and reported to this group's
      Manager, and the rest of the round sends nothing here: this group does not commit the round (torchft
      agrees on a commit within a group; the survivors of a death each see their collective fail), and its
      coordinator rolls the residuals back. A group that drops a round the others committed is behind them
      at the next quorum, and heals.

    Built by :meth:`ReplicaGroup.codec_reducer`, inside error feedback like the codec itself.
    """

    def __init__(self, inner: Reducer, group: ReplicaGroup) -> None:
        super().__init__(ledger=inner.ledger, group=inner.group, scope=inner.scope)
        self.inner, self.replicas = inner, group
        self.codec, self.lossy = inner.codec, inner.lossy

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Any:
        replicas, inner = self.replicas, self.inner
        inner.need_sent = self.need_sent
        healing = replicas.healing
        if replicas.errored:  # a collective of this round failed already
            return _unsent(tensors)
        inputs = [torch.zeros_like(t) for t in tensors] if healing else tensors
        try:
            means, sent = yield from inner.run(inputs, names, sync)
        except Exception as exc:  # noqa: BLE001 - as torchft's managed all-reduce: this group drops the round
            _log.warning("fault tolerance: the %s round failed (%s); this group drops it", self.codec,
                         _first_line(exc), exc_info=True)
            replicas.report_error(exc)
            return _unsent(tensors)
        wire, participants = inner.world_size(), replicas.participants
        if participants != wire:
            means = [m.mul(wire / participants) for m in means]
        return means, (list(tensors) if healing else sent)

    def world_size(self) -> int:
        return self.replicas.participants


def _unsent(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A round this group drops: its own values back (never applied), all of them counted as sent."""
    return [t.detach().clone() for t in tensors], list(tensors)


_log = logging.getLogger(__name__)
