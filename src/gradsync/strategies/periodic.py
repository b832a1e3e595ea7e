"""What ``local_sgd`` and ``diloco`` share: train locally, agree on parameters every ``period`` steps.

Between averaging rounds no gradient leaves a rank: the DDP communication hook
(:func:`local_or_warmup_hook`) hands each bucket back untouched, except during the optional
``warmup_steps`` of plain synchronous training (post-local SGD). Every ``period`` optimizer steps
the ranks run one *averaging round*: each rank flattens its parameters (and, optionally, its
floating-point buffers) into one buffer per dtype, the buffers are averaged with one all-reduce, and
the subclass turns the average into the new common parameters:

* ``local_sgd`` sends the parameters and adopts their mean;
* ``diloco`` sends the pseudo-gradient (global − local parameters) and lets an outer optimizer step
  the global parameters with its mean.

**Overlap.** With ``overlap=True`` the round's all-reduce is issued non-blocking and training goes
on; its result is applied at the *next* round, one period later. A rank then takes the new common
point and keeps the progress it made while the collective was in flight::

    x_i  <-  consensus(average sent one period ago)  +  (x_i - x_i at the time it was sent)

so the ranks never wait for the network but never quite agree either: each differs from the
consensus by its own last period of local progress (bounded staleness of one period). Before a
checkpoint the in-flight collective is waited for and its result kept as ``pending`` state (the
trajectory is unchanged); at the end of fit it is applied, and one more blocking round makes every
rank leave with the same model.

**One owner for the step count.** :class:`PeriodicState` counts optimizer steps; warm-up and the
position inside the period are derived from it, the hook reads the same object, and the count is
checkpointed (a counter that restarts at 0 on resume, as in pytorch#74556, would silently re-run
the warm-up and shift every round).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from gradsync.errors import GradsyncError, check
from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.ledger import CommLedger, fp32_allreduce_bytes
from gradsync.strategies.sync import AllReduceState, allreduce_hook


@dataclass
class PeriodicState:
    """The optimizer-step count of a periodic-averaging strategy, and what is derived from it."""

    ledger: CommLedger
    period: int
    warmup_steps: int = 0
    num_steps: int = 0  #: optimizer steps taken under this strategy (checkpointed)
    sync: AllReduceState = field(init=False)

    def __post_init__(self) -> None:
        self.sync = AllReduceState(ledger=self.ledger)

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step is a synchronous warm-up step."""
        return self.num_steps < self.warmup_steps

    @property
    def steps_in_period(self) -> int:
        """Local steps taken since the last averaging round (0 right after one, and in warm-up)."""
        return 0 if self.in_warmup else (self.num_steps - self.warmup_steps) % self.period


def local_or_warmup_hook(state: PeriodicState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """During warm-up, average the bucket like ``sync``; afterwards keep the local gradient.

    Returning the bucket untouched is what makes the step local: DDP copies it back into the
    gradients without any communication.
    """
    if state.in_warmup:
        return allreduce_hook(state.sync, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class _FlatLayout:
    """The tensors one averaging round moves, grouped by (dtype, device), as flat buffers.

    Each group's flat buffer holds the trainable parameters first (``num_params`` entries), then the
    floating-point buffers when they are averaged too.
    """

    def __init__(self, module: torch.nn.Module, with_buffers: bool) -> None:
        groups: dict = {}
        for p in module.parameters():
            if p.requires_grad:
                groups.setdefault((p.dtype, p.device), ([], []))[0].append(p)
        if with_buffers:
            for b in module.buffers():
                if b.is_floating_point():
                    groups.setdefault((b.dtype, b.device), ([], []))[1].append(b)
        self.groups = [(params, buffers) for params, buffers in groups.values()]
        self.num_params = [sum(p.numel() for p in params) for params, _ in self.groups]
        self.numel = [sum(t.numel() for t in params + buffers) for params, buffers in self.groups]

    @property
    def num_trainable(self) -> int:
        return sum(self.num_params)

    def flatten(self) -> list[torch.Tensor]:
        return [torch.cat([t.detach().reshape(-1) for t in params + buffers]) for params, buffers in self.groups]

    @torch.no_grad()
    def write(self, flats: list[torch.Tensor]) -> None:
        for (params, buffers), flat in zip(self.groups, flats):
            offset = 0
            for t in params + buffers:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class PeriodicAveragingStrategy(GradsyncStrategy):
    """Base of strategies that train locally and average every ``period`` optimizer steps.

    Subclasses define what a round sends (:meth:`_payload`) and how the mean of it becomes the
    new common parameters (:meth:`_consensus`); both see the trainable parameters only, buffers are
    always plainly averaged.
    """

    #: Local steps: ranks' gradients differ, so the non-finite check must ask every rank.
    gradients_synchronized = False

    #: Keys of :meth:`algorithm_state_dict` that are identical on every rank (kept on a reshard).
    replicated_state: tuple[str, ...] = ("num_steps",)

    def __init__(
        self,
        *,
        period: int = 8,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        overlap: bool = False,
        **kwargs: Any,
    ) -> None:
        check(isinstance(period, int) and not isinstance(period, bool) and period >= 1, "period", period,
              "must be an integer >= 1 (optimizer steps between averaging rounds)", "e.g. --strategy.period 8")
        check(isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool) and warmup_steps >= 0,
              "warmup_steps", warmup_steps, "must be an integer >= 0", "0 disables the synchronous warm-up")
        self.period = period
        self.warmup_steps = warmup_steps
        self.average_buffers = bool(average_buffers)
        self.overlap = bool(overlap)
        super().__init__(**kwargs)
        # Buffers are averaged at rounds (average_buffers) or stay local; DDP's per-forward
        # broadcast of rank 0's buffers would be unaccounted traffic that overrides both.
        self._ddp_kwargs["broadcast_buffers"] = False
        self.steps = PeriodicState(ledger=self.ledger, period=period, warmup_steps=warmup_steps)
        self._layout_cache: Optional[_FlatLayout] = None
        self._local_phase_started = False
        # overlap: what was sent at the last round (this rank's point then), and its all-reduce
        self._anchor: Optional[list[torch.Tensor]] = None
        self._in_flight: Optional[list[torch.futures.Future]] = None
        self._in_flight_since = (0, 0.0)  # (num_steps, time) when issued
        self._pending: Optional[list[torch.Tensor]] = None  # a collected average not yet applied
        self._restored_optimizer_states: Optional[list] = None
        self.overlap_stats = {"rounds": 0, "steps_in_flight": 0, "completed_before_needed": 0,
                              "seconds_waited": 0.0}

    # ---- what subclasses define ----------------------------------------------------------------
    def _begin_local_phase(self, params: list[torch.Tensor]) -> None:
        """Called before the first local step of a fit (also of a resumed one) with the flat parameters."""

    def _payload(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """What this rank contributes to the average, per flat group (new tensors)."""
        raise NotImplementedError

    def _consensus(self, averages: list[torch.Tensor]) -> list[torch.Tensor]:
        """The new common parameters, given the mean of every rank's payload."""
        raise NotImplementedError

    # ---- hooks into Lightning ------------------------------------------------------------------
    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        return self.steps, local_or_warmup_hook

    def on_train_start(self) -> None:
        super().on_train_start()
        if len(self.optimizers) != 1:
            raise GradsyncError(
                f"{self.strategy_name} counts optimizer steps of one optimizer; this module configures "
                f"{len(self.optimizers)}. Use one optimizer or --strategy sync")

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        warmup = self.steps.in_warmup  # the hook reads the same count during this step's backward
        if not warmup and not self._local_phase_started:
            layout = self._layout()
            self._begin_local_phase([f[:n] for f, n in zip(layout.flatten(), layout.num_params)])
            self._local_phase_started = True
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.steps.num_steps += 1
        if not warmup:
            # what sync DDP would have sent for this step's gradients (warm-up steps record it in the hook)
            self.ledger.add_logical(fp32_allreduce_bytes(self._layout().num_trainable, self.world_size))
            if self.steps.steps_in_period == 0:
                self._round()
        return output

    def on_train_end(self) -> None:
        self.finish()
        super().on_train_end()

    def teardown(self) -> None:
        # Normal ends have flushed in on_train_end; after an error, drop what is in flight.
        self._in_flight = None
        super().teardown()

    # ---- averaging rounds ----------------------------------------------------------------------
    def _layout(self) -> _FlatLayout:
        if self._layout_cache is None:
            self._layout_cache = _FlatLayout(self.lightning_module, self.average_buffers)
        return self._layout_cache

    def _full_payload(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        nums = self._layout().num_params
        payload = self._payload([f[:n] for f, n in zip(flats, nums)])
        return [torch.cat([p, f[n:]]) for p, f, n in zip(payload, flats, nums)]

    def _full_consensus(self, averages: list[torch.Tensor]) -> list[torch.Tensor]:
        nums = self._layout().num_params
        common = self._consensus([a[:n] for a, n in zip(averages, nums)])
        return [torch.cat([c, a[n:]]) for c, a, n in zip(common, averages, nums)]

    def _mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # Sum, then divide: every rank divides the same bit pattern, so all hold identical results.
        for t in tensors:
            self.ledger.all_reduce(t)
        return [t.div_(self.world_size) for t in tensors]

    def _round(self) -> None:
        layout = self._layout()
        flats = layout.flatten()
        if not self.overlap:
            layout.write(self._full_consensus(self._mean(self._full_payload(flats))))
            return
        if self._in_flight is not None or self._pending is not None:
            flats = self._merge(flats)
            layout.write(flats)
        self._anchor = flats
        payload = self._full_payload(flats)
        self._in_flight = [self.ledger.all_reduce(t, async_op=True) for t in payload]
        self._in_flight_since = (self.steps.num_steps, time.perf_counter())

    def _merge(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Apply the average sent one period ago, keeping this rank's progress since then."""
        common = self._full_consensus(self._collect())
        assert self._anchor is not None
        merged = [c + (f - a) for c, f, a in zip(common, flats, self._anchor)]
        self._anchor = None
        return merged

    def _collect(self) -> list[torch.Tensor]:
        """The mean of the in-flight (or already collected) round; waits if it is not done yet."""
        if self._pending is None:
            self.flush()
        pending, self._pending = self._pending, None
        assert pending is not None
        return pending

    def flush(self) -> None:
        """Wait for the in-flight averaging collective and keep its result for the next round.

        Called before every checkpoint, so a checkpoint never holds a half-finished collective and
        the trajectory after a resume is the one without the checkpoint.
        """
        if self._in_flight is None:
            return
        futures, self._in_flight = self._in_flight, None
        stats = self.overlap_stats
        stats["rounds"] += 1
        stats["steps_in_flight"] += self.steps.num_steps - self._in_flight_since[0]
        stats["completed_before_needed"] += int(all(f.done() for f in futures))
        t0 = time.perf_counter()
        results = [f.wait() for f in futures]
        stats["seconds_waited"] += time.perf_counter() - t0
        self._pending = [t.div_(self.world_size) for t in results]

    def finish(self) -> None:
        """End of fit: apply anything in flight, then average once more so every rank agrees."""
        if not self._local_phase_started:
            return
        layout = self._layout()
        flats = layout.flatten()
        merged = self._in_flight is not None or self._pending is not None
        if merged:
            flats = self._merge(flats)
            layout.write(flats)
        if self.steps.steps_in_period != 0:
            layout.write(self._full_consensus(self._mean(self._full_payload(flats))))

    # ---- algorithm state -----------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        self.flush()
        state = super().algorithm_state_dict()
        state.update(
            num_steps=self.steps.num_steps,
            overlap_stats=dict(self.overlap_stats),
            # Lightning's checkpoint holds rank 0's weights and optimizer state only; between
            # rounds every rank has its own.
            local_params={k: v.detach() for k, v in self.lightning_module.state_dict().items()},
            local_optimizer_states=[opt.state_dict() for opt in self.optimizers],
            anchor=self._anchor,
            pending=self._pending,
        )
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        self.steps.num_steps = int(state.get("num_steps", 0))
        self.overlap_stats.update(state.get("overlap_stats", {}))
        if state.get("local_params") is not None:
            module = self.lightning_module
            with torch.no_grad():
                for name, value in module.state_dict().items():
                    value.copy_(state["local_params"][name])
        device = self.root_device
        self._anchor = _to(state.get("anchor"), device)
        self._pending = _to(state.get("pending"), device)
        self._restored_optimizer_states = state.get("local_optimizer_states")

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._restored_optimizer_states is not None:
            from lightning.fabric.utilities.optimizer import _optimizer_to_device

            for optimizer, opt_state in zip(self.optimizers, self._restored_optimizer_states):
                optimizer.load_state_dict(opt_state)
                _optimizer_to_device(optimizer, self.root_device)
            self._restored_optimizer_states = None

    def reshard_algorithm_state(self, parts: list, saved_world_size: int) -> Optional[dict]:
        """Keep what every rank shares; average the ranks' local parameters; reset the rest.

        Replicated state (the step count, and e.g. DiLoCo's global parameters and outer optimizer)
        is rank-independent and kept. The saved ranks' local parameters are averaged, which is what
        the next round would have done with them. Per-rank optimizer state (Lightning's rank-0 copy
        is used on every rank) and an overlapped round's anchor and result are reset.
        """
        first = parts[0]
        state: dict = {"ledger": first.get("ledger", {})}
        state.update({k: first[k] for k in self.replicated_state if k in first})
        reset = ["local_optimizer_states"]
        if first.get("local_params") is not None:
            local = {}
            for name, value in first["local_params"].items():
                if value.is_floating_point():
                    local[name] = sum(p["local_params"][name].double() for p in parts).div(len(parts)).to(value.dtype)
                else:
                    local[name] = value
            state["local_params"] = local
        if any(p.get("pending") is not None or p.get("anchor") is not None for p in parts):
            reset.append("anchor and pending (the overlapped round in flight is dropped)")
        if self.global_rank == 0:
            warnings.warn(
                f"{self.strategy_name}: checkpoint was written by {saved_world_size} processes, this run has "
                f"{self.world_size}; kept {', '.join(k for k in self.replicated_state if k in first)}; "
                f"averaged local_params of the {saved_world_size} saved ranks; reset {', '.join(reset)}",
                stacklevel=2,
            )
        return state


def _to(tensors: Optional[list], device: torch.device) -> Optional[list]:
    return None if tensors is None else [t.to(device) for t in tensors]
