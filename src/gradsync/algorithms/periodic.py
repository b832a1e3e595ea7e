"""Train locally, agree on parameters every ``period`` optimizer steps: the algorithm of ``local_sgd``
and ``diloco``, in plain torch.

:class:`PeriodicAveraging` hooks the optimizer step, not DDP: :meth:`~PeriodicAveraging.before_step`
and :meth:`~PeriodicAveraging.after_step` around every step (or :meth:`~PeriodicAveraging.attach`
to register them on the optimizer). Every ``period`` local steps it runs a round: every rank
contributes one tensor per trainable parameter of a fragment, a
:class:`~gradsync.comm.reducer.Reducer` averages them over whatever process group it was built on
(DDP replicas, one process per node, a fault-tolerant group), and a :class:`Payload` turns the mean
into the new common parameters:

* :class:`~gradsync.algorithms.local_sgd.LocalAverage` sends the parameters (or, through a lossy
  codec, their change since the last common point) and adopts their mean;
* :class:`~gradsync.algorithms.diloco.OuterStep` sends the pseudo-gradient (global − local) and
  lets an outer optimizer step the global parameters with its mean.

Floating-point buffers (BatchNorm statistics) are plainly averaged in fp32 with fragment 0's
round, never through the codec.

**Fragments and delay** (streaming DiLoCo). The parameters are split into F fragments strided over
the model's layers; fragment k is synced every ``period`` steps at offset k·period/F (one
:class:`Round` each), so each round moves 1/F of the model. With ``sync_delay`` T the fragment's
reduction is issued and T inner steps run before its result is applied; T = 0 is blocking. With
``fragment_alpha`` α the local fragment becomes α·local + (1 − α)·common.

**Overlap** (whole model only). The round's reduction is issued non-blocking and its result
applied at the *next* round, one period later; a rank then takes the new common point and keeps the
progress it made while the collective was in flight::

    x_i  <-  consensus(average sent one period ago)  +  (x_i - x_i at the time it was sent)

:meth:`~PeriodicAveraging.flush` (before every checkpoint) waits for what is in flight and keeps
its result until its turn, so the trajectory does not depend on checkpoints;
:meth:`~PeriodicAveraging.finish` (end of training) applies it and syncs, once, every fragment the
ranks disagree on, so every rank leaves with the same model.

Usage in plain torch (one process per replica, any group)::

    algo = PeriodicAveraging(model, OuterStep(outer_lr=0.7, outer_momentum=0.9, period=8),
                             Schedule(period=8), reducer=lambda: build_reducer("int8", ledger=ledger,
                             error_feedback=True), ledger=ledger)
    algo.attach(optimizer)
    ...                                   # train as usual; rounds happen inside optimizer.step()
    algo.finish()
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from gradsync.algorithms.layout import Layout
from gradsync.algorithms.schedule import Schedule
from gradsync.algorithms.state import Resharded, StateRegistry
from gradsync.comm.ledger import CommLedger, fp32_allreduce_bytes
from gradsync.comm.reducer import Reducer
from gradsync.errors import check, spell

#: What a listener receives: the event and its facts — ``issue`` (a round is sent: fragment, step,
#: kind, values, payload), ``land`` (it is about to be applied: fragment, step, blend, values),
#: ``consensus`` (its mean and the common values made of it), ``landed`` (values after), and
#: ``overlap`` (an overlapped round: the values before and after the merge).
Listener = Callable[[str, dict], None]


class Payload(Protocol):
    """What a round sends, and how the mean of it becomes the new common parameters."""

    def begin(self, layout: Layout, *, mid_run: bool,
              share: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
        """Before the first local step of a fit, also of a resumed one (``mid_run``: after local steps
        already taken); ``share(tensors)`` returns the ranks' mean of this rank's ``tensors``."""

    def payload(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's contribution for the parameters ``indices``, whose current ``values`` are given."""

    def consensus(self, fragment: int, indices: list[int], means: list[torch.Tensor]) -> list[torch.Tensor]:
        """The new common values of fragment ``fragment``'s parameters, from the mean of the payloads."""

    def register_state(self, registry: StateRegistry, layout: Callable[[], Layout]) -> None:
        """Declare the payload's state (replicated, averaged or per rank)."""


class Coordinator(Protocol):
    """Membership around each round (fault-tolerant replica groups, :mod:`gradsync.comm.managed`):
    :meth:`begin_round` before anything is sent (``fragment``: the fragment the round is for), :meth:`commit`
    once the mean is known — False when a
    peer failed during the round, which is then dropped (nothing lands, every group keeps its values);
    :meth:`mean` averages a tensor over the groups of the round (the floating buffers, after their mean
    inside the group)."""

    def begin_round(self, fragment: int = 0) -> None: ...

    def commit(self) -> bool: ...

    def mean(self, tensor: torch.Tensor, sync: Any) -> None: ...


class Round:
    """One fragment's synchronization: :meth:`prepare` issues its reduction without waiting,
    :meth:`wait` collects the mean (keeping it until it is applied), :meth:`land` applies it."""

    def __init__(self, algorithm: "PeriodicAveraging", fragment: int) -> None:
        self.algorithm, self.fragment = algorithm, fragment
        self.issued_at: Optional[int] = None
        self.future: Optional[torch.futures.Future] = None
        self.means: Optional[list[torch.Tensor]] = None
        self.since = 0.0

    @property
    def in_flight(self) -> bool:
        return self.issued_at is not None

    def prepare(self, s: int, kind: str = "round", values: Optional[list[torch.Tensor]] = None) -> None:
        """Issue this fragment's reduction after local step ``s`` (from ``values``, default: the parameters now)."""
        a = self.algorithm
        if a.coordinator is not None:
            a.coordinator.begin_round(self.fragment)
        layout = a.layout
        indices = layout.fragments[self.fragment]
        values = layout.values(indices) if values is None else values
        sent = a.payload.payload(indices, values)
        a.emit("issue", fragment=self.fragment, step=s, kind=kind, values=values, payload=sent)
        sync = (kind, s, self.fragment)
        self.future = a.reducer.reduce(sent, names=[layout.names[i] for i in indices], sync=sync)
        self.issued_at, self.means, self.since = s, None, time.perf_counter()
        if self.fragment == 0:
            a.average_buffers(sync)

    def wait(self) -> None:
        """Wait for the reduction in flight and keep its mean until it is applied."""
        if self.future is None:
            return
        a, stats = self.algorithm, self.algorithm.overlap_stats
        stats["rounds"] += 1
        stats["steps_in_flight"] += a.schedule.local_steps - self.issued_at
        stats["completed_before_needed"] += int(self.future.done())
        t0 = time.perf_counter()
        self.means = self.future.wait()
        stats["seconds_waited"] += time.perf_counter() - t0
        self.future = None

    def collect(self) -> list[torch.Tensor]:
        """The fragment's new common values (the payload's consensus of the mean); clears the round."""
        self.wait()
        a = self.algorithm
        indices = a.layout.fragments[self.fragment]
        common = a.payload.consensus(self.fragment, indices, self.means)
        a.emit("consensus", fragment=self.fragment, means=self.means, common=common)
        self.issued_at, self.means = None, None
        return common

    def land(self, s: int, alpha: float = 0.0) -> None:
        """Apply the fragment's consensus after local step ``s``, blended with the local values by ``alpha``."""
        a = self.algorithm
        layout = a.layout
        indices = layout.fragments[self.fragment]
        a.emit("land", fragment=self.fragment, step=s, blend=alpha > 0, values=layout.values(indices))
        if a.coordinator is not None:
            self.wait()
            if not a.coordinator.commit():  # a peer failed during the round: it changes nothing
                self.issued_at, self.means = None, None
                a.emit("dropped", fragment=self.fragment, step=s)
                return
        common = self.collect()
        if alpha > 0:
            common = [alpha * local + (1 - alpha) * c.to(local.device)
                      for local, c in zip(layout.values(indices), common)]
        else:
            a.agreed.add(self.fragment)
        layout.write(indices, common)
        a.emit("landed", fragment=self.fragment, step=s, values=layout.values(indices))

    def state_dict(self) -> Optional[dict]:
        self.wait()
        if not self.in_flight:
            return None
        return {"fragment": self.fragment, "issued_at": self.issued_at, "means": self.means}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.issued_at, self.future = int(state["issued_at"]), None
        self.means = [t.to(device) for t in state["means"]]


class PeriodicAveraging:
    """Local steps, and a round every ``schedule.period`` of them (see the module docstring).

    Args:
        module: the model whose trainable parameters (and floating buffers) the rounds average (may be
            set later, before the first step).
        payload: what a round sends and makes of the mean (:class:`LocalAverage`, :class:`OuterStep`).
        schedule: the step count, warm-up, period, fragments and delay.
        reducer: builds the reducer of rounds (called at the first round, when process groups exist).
        ledger: where rounds' bytes are recorded (the reducer's own ledger, usually).
        overlap: apply each round's mean one period later, keeping the progress made meanwhile.
        fragment_alpha: share of the local values kept when a fragment lands, in [0, 1].
        average_buffers: average floating buffers in fp32 with fragment 0's round.
        buffer_group: the group buffers are averaged over (None: the default group), and its size.
        scope: the ledger scope of rounds and of the fp32 bytes sync would have sent.
    """

    def __init__(self, module: Optional[torch.nn.Module], payload: Payload, schedule: Schedule, *,
                 reducer: Callable[[], Reducer], ledger: Optional[CommLedger] = None, overlap: bool = False,
                 fragment_alpha: float = 0.0, average_buffers: bool = True,
                 buffer_group: Optional[dist.ProcessGroup] = None, scope: str = "world") -> None:
        check(0.0 <= fragment_alpha <= 1.0, "fragment_alpha", fragment_alpha,
              "must be in [0, 1] (0: take the global parameters)", f"e.g. {spell('fragment_alpha', 0)}")
        check(not (overlap and (schedule.fragments > 1 or schedule.sync_delay > 0)), "overlap", overlap,
              "is the whole-model, one-period-stale variant and cannot be combined with fragments or sync_delay",
              f"drop {spell('overlap')} and use {spell('sync_delay')}")
        self.module, self.payload, self.schedule = module, payload, schedule
        self._reducer_factory = reducer
        self.ledger = ledger if ledger is not None else CommLedger()
        self.overlap, self.fragment_alpha = bool(overlap), float(fragment_alpha)
        self.with_buffers, self.buffer_group, self.scope = bool(average_buffers), buffer_group, scope
        #: the group parameter-shaped tensors are averaged over outside rounds (None: the buffer group);
        #: under FSDP2 the processes that hold the same shard (one per node)
        self.param_group: Optional[dist.ProcessGroup] = None
        #: membership around rounds (fault-tolerant replica groups); None: a fixed group
        self.coordinator: Optional[Coordinator] = None
        #: the ranks sync would all-reduce over, when rounds span more than this process group (replica groups)
        self.logical_world: Optional[int] = None
        self._layout: Optional[Layout] = None
        self._reducer: Optional[Reducer] = None
        self._restored_reducer_state: Optional[dict] = None
        self.rounds = [Round(self, k) for k in range(schedule.fragments)]
        self.started = False  # the local phase of this fit has begun
        self.finished = False  # the final round of this fit has run
        self.anchor: Optional[list[torch.Tensor]] = None  # overlap: this rank's point when it sent
        self.agreed: set[int] = set()  # fragments identical on every rank right now
        self.overlap_stats = {"rounds": 0, "steps_in_flight": 0, "completed_before_needed": 0,
                              "seconds_waited": 0.0}
        self.listeners: list[Listener] = []
        self.registry = StateRegistry()
        self._register_state()

    # ---- what rounds move and how -----------------------------------------------------------
    @property
    def layout(self) -> Layout:
        if self._layout is None:
            if self.module is None:
                raise RuntimeError("PeriodicAveraging: set .module before the first step")
            self._layout = Layout(self.module, with_buffers=self.with_buffers, fragments=self.schedule.fragments)
        return self._layout

    @property
    def reducer(self) -> Reducer:
        """The reducer of rounds (built at first use, when the process groups exist)."""
        if self._reducer is None:
            self._reducer = self._reducer_factory()
            if self._restored_reducer_state is not None:
                self._reducer.load_state_dict(self._restored_reducer_state)
                self._restored_reducer_state = None
        return self._reducer

    def emit(self, event: str, **facts: Any) -> None:
        for listener in self.listeners:
            listener(event, facts)

    @property
    def in_flight(self) -> Optional[Round]:
        return next((r for r in self.rounds if r.in_flight), None)

    # ---- the optimizer step -----------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Run :meth:`before_step` and :meth:`after_step` around every ``optimizer.step()``."""
        optimizer.register_step_pre_hook(lambda *_: self.before_step())
        optimizer.register_step_post_hook(lambda *_: self.after_step())

    def before_step(self) -> None:
        if not self.schedule.in_warmup and not self.started:
            self.payload.begin(self.layout, mid_run=self.schedule.local_steps > 0, share=self.mean_over_ranks)
            self.started = True

    def after_step(self) -> None:
        warmup = self.schedule.in_warmup
        self.schedule.num_steps += 1
        if warmup:
            return
        # what sync DDP would have sent for this step's gradients (warm-up steps record it in their hook)
        world = self.logical_world or self._world()
        self.ledger.add_logical(fp32_allreduce_bytes(self.layout.num_trainable, world), scope=self.scope)
        self._after_local_step(self.schedule.local_steps)

    def _world(self) -> int:
        return dist.get_world_size(self.buffer_group) if dist.is_available() and dist.is_initialized() else 1

    def _after_local_step(self, s: int) -> None:
        self.agreed.clear()  # a local step made every fragment differ across ranks
        if self.overlap:
            if s % self.schedule.period == 0:
                self._overlap_round(s)
            return
        flight = self.in_flight
        if flight is not None and self.schedule.lands(flight.issued_at, s):
            flight.land(s, self.fragment_alpha)
        k = self.schedule.due_fragment(s)
        if k is not None:
            self.rounds[k].prepare(s)
            if self.schedule.sync_delay == 0:
                self.rounds[k].land(s, self.fragment_alpha)

    def _overlap_round(self, s: int, kind: str = "round") -> None:
        layout, r = self.layout, self.rounds[0]
        indices = layout.fragments[0]
        current = layout.values(indices)
        before = current
        if r.in_flight:
            current = self._merge(current)
            layout.write(indices, current)
        self.emit("overlap", step=s, before=before, after=current)
        self.anchor = [c.clone() for c in current]
        r.prepare(s, kind, values=current)

    def _merge(self, current: list[torch.Tensor]) -> list[torch.Tensor]:
        """Apply the average sent one period ago, keeping this rank's progress since then."""
        common = self.rounds[0].collect()
        assert self.anchor is not None
        merged = [c.to(x.device) + (x - a) for c, x, a in zip(common, current, self.anchor)]
        self.anchor = None
        return merged

    def flush(self) -> None:
        """Wait for the reduction in flight and keep its mean until its turn (before a checkpoint)."""
        for r in self.rounds:
            r.wait()

    @torch.no_grad()
    def mean_over_ranks(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The fp32 mean of ``tensors`` over every rank (the parameter group), in their own dtypes; blocking."""
        group = self.param_group if self.param_group is not None else self.buffer_group
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if world == 1:
            return [t.clone() for t in tensors]
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        self.ledger.all_reduce(flat, group=group, scope=self.scope, sync=("common", 0, 0))
        flat.div_(world)
        out, pos = [], 0
        for t in tensors:
            out.append(flat[pos:pos + t.numel()].view_as(t).to(t.dtype))
            pos += t.numel()
        return out

    @torch.no_grad()
    def average_buffers(self, sync: Any) -> None:
        """Plain fp32 mean of the floating buffers over the buffer group (and the replica groups of the
        round, with a coordinator), blocking.

        Over every rank even when rounds run between nodes: a node's processes compute their
        statistics on different data, so they differ inside a node too."""
        buffers = self.layout.buffers
        world = self._world()
        if not buffers or (world == 1 and self.coordinator is None):
            return
        flat = torch.cat([b.reshape(-1).to(torch.float32) for b in buffers])
        if world > 1:
            self.ledger.all_reduce(flat, group=self.buffer_group, scope=self.scope, sync=sync)
            flat.div_(world)
        if self.coordinator is not None:  # then over the replica groups of the round
            self.coordinator.mean(flat, sync)
        pos = 0
        for b in buffers:
            b.copy_(flat[pos:pos + b.numel()].view_as(b))
            pos += b.numel()

    def finish(self) -> None:
        """End of training: apply anything in flight, then sync every fragment the ranks disagree on, once."""
        if not self.started or self.finished:
            return
        self.finished = True
        s = self.schedule.local_steps
        layout = self.layout
        if self.overlap:
            r = self.rounds[0]
            if r.in_flight:
                indices = layout.fragments[0]
                layout.write(indices, self._merge(layout.values(indices)))
            if self.schedule.steps_in_period != 0:
                r.prepare(s, "final")
                r.land(s)
            return
        flight = self.in_flight
        if flight is not None:
            flight.land(s, self.fragment_alpha)
        for k in range(self.schedule.fragments):
            if k not in self.agreed:
                self.rounds[k].prepare(s, "final")
                self.rounds[k].land(s)  # alpha 0: every rank leaves with the same model

    # ---- state ----------------------------------------------------------------------------------
    def _register_state(self) -> None:
        reg, device = self.registry, lambda: self.layout.params[0].device
        reg.register("num_steps", "replicated", lambda: self.schedule.num_steps,
                     lambda v: setattr(self.schedule, "num_steps", int(v)))
        reg.register("overlap_stats", "per_rank", lambda: dict(self.overlap_stats),
                     lambda v: self.overlap_stats.update(v))
        reg.register("agreed", "per_rank", lambda: sorted(self.agreed), lambda v: setattr(self, "agreed", set(v)))
        self.payload.register_state(reg, lambda: self.layout)
        reg.register("anchor", "per_rank", lambda: self.anchor,
                     lambda v: setattr(self, "anchor", None if v is None else [t.to(device()) for t in v]),
                     label="anchor and pending (the overlapped round in flight is dropped)")
        # the mean every rank agreed on: still valid on another world size (unless overlapped)
        reg.register("pending", "replicated", self._pending_state, self._load_pending,
                     label="pending (the fragment in flight)")
        reg.register("reducer", "per_rank", self._reducer_state, self._load_reducer_state,
                     label="codec state")

    def _pending_state(self) -> Optional[dict]:
        flight = self.in_flight
        return flight.state_dict() if flight is not None else None

    def _load_pending(self, state: Optional[dict]) -> None:
        for r in self.rounds:
            r.issued_at, r.future, r.means = None, None, None
        if state is not None:
            self.rounds[int(state["fragment"])].load_state_dict(state, self.layout.params[0].device)

    def _reducer_state(self) -> Optional[dict]:
        return self._reducer.state_dict() if self._reducer is not None else self._restored_reducer_state

    def _load_reducer_state(self, state: Optional[dict]) -> None:
        self._reducer = None
        self._restored_reducer_state = state or None

    def state_dict(self) -> dict:
        self.flush()
        return self.registry.state_dict()

    def reshard(self, parts: list[dict]) -> Resharded:
        """The registry's reshard, with the overlapped round's rule: a mean in flight belongs with each
        rank's anchor, so when any rank saved an anchor both are reset."""
        out = self.registry.reshard(parts)
        if any(p.get("anchor") is not None for p in parts):
            out.state.pop("pending", None)
            out.kept = [k for k in out.kept if k != "pending"]
            label = self.registry.entries["anchor"].label
            if label not in out.reset:
                out.reset.append(label)
        elif "pending" in out.kept:
            out.kept[out.kept.index("pending")] = "pending (the fragment in flight)"
        return out

    def drop_in_flight(self) -> None:
        """After an error: forget the rounds in flight (nothing lands)."""
        for r in self.rounds:
            r.issued_at, r.future, r.means = None, None, None

    def stats(self) -> dict:
        """Figures for the run summary: time waited on rounds, overlap, the fragments' sizes."""
        out: dict = {"rounds_waited_seconds": round(self.overlap_stats["seconds_waited"], 4)}
        if self.overlap or self.schedule.sync_delay:
            out["overlap"] = dict(self.overlap_stats)
        if self.schedule.fragments > 1:
            out["fragments"] = [{"parameters": len(f), "numel": self.layout.fragment_numel(k)}
                                for k, f in enumerate(self.layout.fragments)]
        return out

    def load_state_dict(self, state: dict) -> None:
        self.registry.load_state_dict(state)
        self.started = False  # the payload's begin() runs again and keeps what was restored
