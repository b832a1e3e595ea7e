"""What ``local_sgd`` and ``diloco`` share: train locally, agree on parameters every ``period`` steps.

Between averaging rounds no gradient leaves a rank: the DDP communication hook
(:func:`local_or_warmup_hook`) hands each bucket back untouched, except during the optional
``warmup_steps`` of plain synchronous training (post-local SGD). Every ``period`` optimizer steps
the ranks run an *averaging round*: every rank contributes one tensor per trainable parameter, a
:class:`~gradsync.comm.reducer.Reducer` of the chosen ``codec`` averages them (error feedback on
for lossy codecs), and the subclass turns the mean into the new common parameters:

* ``local_sgd`` sends the parameters (or, through a lossy codec, their change since the last
  round) and adopts their mean;
* ``diloco`` sends the pseudo-gradient (global − local parameters) and lets an outer optimizer step
  the global parameters with its mean.

Floating-point buffers (BatchNorm statistics) are plainly averaged in fp32 once per period, never
through the codec.

**Fragments and delay** (streaming DiLoCo; the subclass exposes them). The parameters are split
into F fragments, strided over the model's layers; fragment k is synced every ``period`` steps, at
offset k·period/F, so each round moves 1/F of the model. With ``sync_delay`` T the fragment's
reduction is issued and T inner steps run before its result is applied; T = 0 is blocking.

**Overlap** (``overlap=True``, whole model only). The round's reduction is issued non-blocking and
its result applied at the *next* round, one period later; a rank then takes the new common point
and keeps the progress it made while the collective was in flight::

    x_i  <-  consensus(average sent one period ago)  +  (x_i - x_i at the time it was sent)

Before a checkpoint anything in flight is waited for and its result kept (the trajectory is
unchanged); at the end of fit it is applied, and a final blocking round (fragment by fragment)
makes every rank leave with the same model.

**One owner for the step count.** :class:`PeriodicState` counts optimizer steps; warm-up, the
position in the period and the fragment schedule are derived from it, the hook reads the same
object, and the count is checkpointed (a counter that restarts at 0 on resume, as in
pytorch#74556, would silently re-run the warm-up and shift every round).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from gradsync.comm import CODEC_OPTIONS, LOSSY, build_reducer, check_codec_options
from gradsync.comm.ddp import AllReduceState, allreduce_hook, local_hook
from gradsync.comm.hierarchical import INTER, INTRA, NodeReducer
from gradsync.comm.ledger import CommLedger, fp32_allreduce_bytes
from gradsync.comm.reducer import Reducer
from gradsync.errors import GradsyncError, check
from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.lightning_private import ddp_kwargs

Codec = Literal["identity", "fp16", "bf16", "int8", "int4", "sign", "topk", "powersgd", "sparseloco"]
Scope = Literal["world", "node"]


@dataclass
class PeriodicState:
    """The optimizer-step count of a periodic-averaging strategy, and what is derived from it."""

    ledger: CommLedger
    period: int
    warmup_steps: int = 0
    num_steps: int = 0  #: optimizer steps taken under this strategy (checkpointed)
    sync: AllReduceState = field(init=False)
    #: Node scope: the intra-node all-reduce of every local step (None: local steps send nothing).
    node: Optional[AllReduceState] = None

    def __post_init__(self) -> None:
        self.sync = AllReduceState(ledger=self.ledger)

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step is a synchronous warm-up step."""
        return self.num_steps < self.warmup_steps

    @property
    def local_steps(self) -> int:
        """Local steps taken after the warm-up."""
        return max(0, self.num_steps - self.warmup_steps)

    @property
    def steps_in_period(self) -> int:
        """Local steps taken since the last averaging round (0 right after one, and in warm-up)."""
        return 0 if self.in_warmup else self.local_steps % self.period


def local_or_warmup_hook(state: PeriodicState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """During warm-up, average the bucket like ``sync``; afterwards keep the local gradient (node
    scope: average it inside the node)."""
    if state.in_warmup:
        return allreduce_hook(state.sync, bucket)
    if state.node is not None:
        return allreduce_hook(state.node, bucket)
    return local_hook(state, bucket)


def layer_key(name: str) -> str:
    """The layer a parameter belongs to: its path up to the first numeric index (``blocks.3``),
    else its module's path (``tok_emb``). Fragments are strided over these keys."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if re.fullmatch(r"\d+", part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def strided_fragments(names: list[str], fragments: int) -> list[list[int]]:
    """Parameter indices of each of ``fragments`` fragments: layer j (in model order) goes to j mod F.

    The strided pattern of Streaming DiLoCo (Douillard et al. 2025): every fragment holds layers
    from the whole depth of the model."""
    layers: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        layers.setdefault(layer_key(name), []).append(i)
    if fragments > len(layers):
        raise GradsyncError(
            f"--strategy.fragments {fragments}: this model has only {len(layers)} layers to split "
            f"({', '.join(list(layers)[:8])}{', ...' if len(layers) > 8 else ''}); use at most {len(layers)}")
    out: list[list[int]] = [[] for _ in range(fragments)]
    for j, indices in enumerate(layers.values()):
        out[j % fragments].extend(indices)
    return [sorted(f) for f in out]


class _Layout:
    """The tensors rounds move: trainable parameters (named, in model order), floating buffers, fragments."""

    def __init__(self, module: torch.nn.Module, with_buffers: bool, fragments: int) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.buffer_names, self.buffers = [], []
        if with_buffers:
            for n, b in module.named_buffers():
                if b.is_floating_point():
                    self.buffer_names.append(n)
                    self.buffers.append(b)
        self.fragments = strided_fragments(self.names, fragments)
        self.num_trainable = sum(p.numel() for p in self.params)

    def values(self, indices: list[int]) -> list[torch.Tensor]:
        """Copies of the parameters ``indices``, as they are now."""
        return [self.params[i].detach().clone() for i in indices]

    @torch.no_grad()
    def write(self, indices: list[int], values: list[torch.Tensor]) -> None:
        for i, v in zip(indices, values):
            self.params[i].copy_(v)

    def fragment_numel(self, k: int) -> int:
        return sum(self.params[i].numel() for i in self.fragments[k])


@dataclass
class _Flight:
    """One round's reduction: issued at ``issued_at`` (local steps), applied when its delay is over."""

    fragment: int
    issued_at: int
    future: Optional[torch.futures.Future] = None
    means: Optional[list[torch.Tensor]] = None  # set once collected
    since: float = 0.0


class PeriodicAveragingStrategy(GradsyncStrategy):
    """Base of strategies that train locally and average every ``period`` optimizer steps.

    Subclasses define what a round sends (:meth:`_payload`) and how the mean of it becomes the
    new common parameters (:meth:`_consensus`); both see the trainable parameters of one fragment.
    """

    #: Local steps: ranks' gradients differ, so the non-finite check must ask every rank.
    gradients_synchronized = False

    #: Keys of :meth:`algorithm_state_dict` that are identical on every rank (kept on a reshard).
    replicated_state: tuple[str, ...] = ("num_steps",)

    #: Streaming settings; only ``diloco`` exposes them as options.
    fragments: int = 1
    sync_delay: int = 0
    fragment_alpha: float = 0.0

    def __init__(
        self,
        *,
        period: int = 8,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        overlap: bool = False,
        codec: Codec = "identity",
        error_feedback: Optional[bool] = None,
        chunk_size: int = CODEC_OPTIONS["chunk_size"][0],
        fraction: float = CODEC_OPTIONS["fraction"][0],
        rank: int = CODEC_OPTIONS["rank"][0],
        warm_start: bool = CODEC_OPTIONS["warm_start"][0],
        seed: int = CODEC_OPTIONS["seed"][0],
        sparse_chunk_size: int = CODEC_OPTIONS["sparse_chunk_size"][0],
        sparse_k: int = CODEC_OPTIONS["sparse_k"][0],
        value_bits: int = CODEC_OPTIONS["value_bits"][0],
        error_decay: float = CODEC_OPTIONS["error_decay"][0],
        scope: Scope = "world",
        procs_per_node: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            period: optimizer steps between averaging rounds, >= 1.
            warmup_steps: synchronous (all-reduced) optimizer steps before local training starts.
            average_buffers: also average floating-point buffers (e.g. BatchNorm statistics) once per
                period, in fp32; otherwise each rank keeps its own.
            overlap: issue each round's reduction without waiting and apply it one period later.
            codec: how a round's tensors cross the network: ``identity`` (fp32, exact), ``fp16``,
                ``bf16``, ``int8``, ``int4``, ``sign``, ``topk``, ``powersgd``, ``sparseloco`` — the codecs of
                ``compressed``, with the same options.
            error_feedback: carry what the codec dropped into the next round (per rank, per
                parameter). Default: on for every lossy codec, off for ``identity``.
            chunk_size: int8, int4, sign: entries that share one float32 scale.
            fraction: topk: share of entries sent per round, in (0, 1].
            rank: powersgd: rank of the approximation, >= 1.
            warm_start: powersgd: start each power iteration from the previous round's Q.
            seed: int8, int4: stochastic-rounding seed (rank r uses seed + r); powersgd: initial Q.
            sparse_chunk_size: sparseloco: entries per top-k chunk, a power of two.
            sparse_k: sparseloco: entries sent per chunk.
            value_bits: sparseloco: bits per sent value, 2, 4 or 8.
            error_decay: sparseloco: factor on the error-feedback residual before it is added, in (0, 1].
            scope: ``world``: every rank trains its own replica and rounds average all of them;
                ``node``: every inner step all-reduces gradients inside the node (fp32, as DDP), so
                each node holds one replica, and rounds (with their codec) run across nodes only.
            procs_per_node: force the layout (K processes play one node), for tests on one machine;
                default: what torchrun / SLURM say.
            **kwargs: DDP and process-group options of :class:`~gradsync.strategies.base.GradsyncStrategy`.
        """
        check(isinstance(period, int) and not isinstance(period, bool) and period >= 1, "period", period,
              "must be an integer >= 1 (optimizer steps between averaging rounds)", "e.g. --strategy.period 8")
        check(isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool) and warmup_steps >= 0,
              "warmup_steps", warmup_steps, "must be an integer >= 0", "0 disables the synchronous warm-up")
        codec_options = {"chunk_size": chunk_size, "fraction": fraction, "rank": rank, "warm_start": warm_start,
                         "seed": seed, "sparse_chunk_size": sparse_chunk_size, "sparse_k": sparse_k,
                         "value_bits": value_bits, "error_decay": error_decay}
        check_codec_options(codec, codec_options)
        check(not (error_feedback and codec not in LOSSY), "error_feedback", error_feedback,
              f"is not used by codec {codec} (it is exact)", "drop --strategy.error_feedback or choose a lossy codec")
        self.period = period
        self.warmup_steps = warmup_steps
        self.average_buffers = bool(average_buffers)
        self.overlap = bool(overlap)
        self.codec = codec
        self.error_feedback = (codec in LOSSY) if error_feedback is None else bool(error_feedback)
        for option, value in codec_options.items():
            setattr(self, option, value)
        build_reducer(codec, error_feedback=self.error_feedback, **codec_options)  # validates the codec's options
        super().__init__(**kwargs)
        self._set_scope(scope, procs_per_node)
        # Buffers are averaged at rounds (average_buffers) or stay local; DDP's per-forward
        # broadcast of rank 0's buffers would be unaccounted traffic that overrides both.
        ddp_kwargs(self)["broadcast_buffers"] = False
        self.steps = PeriodicState(ledger=self.ledger, period=period, warmup_steps=warmup_steps)
        self._layout_cache: Optional[_Layout] = None
        self._reducer_cache: Optional[Reducer] = None
        self._restored_reducer_state: Optional[dict] = None
        self._local_phase_started = False
        self._finished = False  # the final round of this fit has run
        self._flight: Optional[_Flight] = None
        self._anchor: Optional[list[torch.Tensor]] = None  # overlap: this rank's point when it sent
        self._agreed: set[int] = set()  # fragments identical on every rank right now
        self._restored_optimizer_states: Optional[list] = None
        self.overlap_stats = {"rounds": 0, "steps_in_flight": 0, "completed_before_needed": 0,
                              "seconds_waited": 0.0}

    def _check_streaming(self) -> None:
        """Validate fragments, sync_delay, fragment_alpha against period and overlap (one-line errors)."""
        f, t = self.fragments, self.sync_delay
        check(isinstance(f, int) and not isinstance(f, bool) and f >= 1, "fragments", f,
              "must be an integer >= 1 (1: the whole model every round)", "e.g. --strategy.fragments 4")
        check(self.period % f == 0, "fragments", f, f"must divide --strategy.period {self.period} (fragment k syncs "
              f"at offset k*period/fragments)", f"e.g. --strategy.period {self.period - self.period % f or f}")
        check(isinstance(t, int) and not isinstance(t, bool) and t >= 0, "sync_delay", t,
              "must be an integer >= 0 (0: blocking)", "e.g. --strategy.sync_delay 2")
        check(t < self.period // f, "sync_delay", t,
              f"must be < period/fragments = {self.period // f} (a fragment must land before the next one is sent)",
              f"use --strategy.sync_delay {self.period // f - 1} or fewer fragments")
        check(0.0 <= self.fragment_alpha <= 1.0, "fragment_alpha", self.fragment_alpha,
              "must be in [0, 1] (0: take the global parameters)", "e.g. --strategy.fragment_alpha 0")
        check(not (self.overlap and (f > 1 or t > 0)), "overlap", self.overlap,
              "is the whole-model, one-period-stale variant and cannot be combined with fragments or sync_delay",
              "drop --strategy.overlap and use --strategy.sync_delay")

    # ---- what subclasses define ----------------------------------------------------------------
    def _begin_local_phase(self) -> None:
        """Called before the first local step of a fit (also of a resumed one)."""

    def _payload(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        """What this rank contributes for the parameters ``indices``, whose current ``values`` are given."""
        raise NotImplementedError

    def _consensus(self, indices: list[int], means: list[torch.Tensor]) -> list[torch.Tensor]:
        """The new common values of the parameters ``indices``, given the mean of every rank's payload."""
        raise NotImplementedError

    # ---- hooks into Lightning ------------------------------------------------------------------
    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        if self.scope == "node" and self.topology is not None:
            self.steps.node = AllReduceState(ledger=self.ledger, group=self.topology.intra, scope=INTRA,
                                             logical=False)
        return self.steps, local_or_warmup_hook

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # Lightning calls every callback's on_train_end (ModelCheckpoint's last save, a user's export
        # hook), then the module's, and only then the strategy's: the final round must come first,
        # or they all see ranks that still disagree.
        if not any(isinstance(c, _FinalRound) and c.strategy is self for c in trainer.callbacks):
            trainer.callbacks.insert(0, _FinalRound(self))

    def on_train_start(self) -> None:
        super().on_train_start()
        self._finished = False
        if len(self.optimizers) != 1:
            raise GradsyncError(
                f"{self.strategy_name} counts optimizer steps of one optimizer; this module configures "
                f"{len(self.optimizers)}. Use one optimizer or --strategy sync")

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        warmup = self.steps.in_warmup  # the hook reads the same count during this step's backward
        if not warmup and not self._local_phase_started:
            self._begin_local_phase()
            self._local_phase_started = True
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.steps.num_steps += 1
        if not warmup:
            # what sync DDP would have sent for this step's gradients (warm-up steps record it in the hook)
            self.ledger.add_logical(fp32_allreduce_bytes(self._layout().num_trainable, self.world_size),
                                    scope=self.round_scope())
            self._after_local_step(self.steps.local_steps)
        return output

    def averaged_over(self) -> tuple[Optional[Any], int]:
        if self.steps.in_warmup:  # read during the step's closure, before the count moves on
            return super().averaged_over()
        if self.scope == "node" and self.topology is not None:
            return self.topology.intra, self.topology.procs_per_node
        return None, 1  # a local step: the gradient is this rank's own

    def on_train_end(self) -> None:
        self.finish()  # already done by _FinalRound, before any callback's on_train_end
        super().on_train_end()

    def teardown(self) -> None:
        # Normal ends have flushed in on_train_end; after an error, drop what is in flight.
        self._flight = None
        super().teardown()

    # ---- the schedule --------------------------------------------------------------------------
    def fragment_offset(self, k: int) -> int:
        """Local step (mod period) at which fragment ``k`` is sent."""
        return k * (self.period // self.fragments)

    def due_fragment(self, s: int) -> Optional[int]:
        """The fragment sent after local step ``s`` (> 0), or None."""
        if s <= 0:
            return None
        every = self.period // self.fragments
        return (s % self.period) // every if s % every == 0 else None

    def _after_local_step(self, s: int) -> None:
        self._agreed.clear()  # a local step made every fragment differ across ranks
        if self.overlap:
            if s % self.period == 0:
                self._overlap_round(s)
            return
        if self._flight is not None and s >= self._flight.issued_at + self.sync_delay:
            self._land(s)
        k = self.due_fragment(s)
        if k is not None:
            self._issue(k, s)
            if self.sync_delay == 0:
                self._land(s)

    # ---- rounds --------------------------------------------------------------------------------
    def _layout(self) -> _Layout:
        if self._layout_cache is None:
            self._layout_cache = _Layout(self.lightning_module, self.average_buffers, self.fragments)
        return self._layout_cache

    @property
    def reducer(self) -> Reducer:
        """The reducer of rounds (built on gradsync's own group at first use)."""
        if self._reducer_cache is None:
            options = {k: getattr(self, k, default) for k, (default, _) in CODEC_OPTIONS.items()}
            self._reducer_cache = build_reducer(self.codec, ledger=self.ledger, group=self.round_group(),
                                                scope=self.round_scope(), error_feedback=self.error_feedback,
                                                **options)
            if self.scope == "node":
                # every process of a node holds the same replica: each sends its 1/K shard across nodes
                self._reducer_cache = NodeReducer(self._reducer_cache, intra=self.topology.intra, replicated=True)
            if self._restored_reducer_state is not None:
                self._reducer_cache.load_state_dict(self._restored_reducer_state)
                self._restored_reducer_state = None
        return self._reducer_cache

    def round_group(self) -> Optional[dist.ProcessGroup]:
        """The process group rounds average over (node scope: this local rank's inter-node group)."""
        if self.scope == "node" and self.topology is not None:
            return self.topology.inter
        return self.comm_group

    def round_scope(self) -> str:
        return INTER if self.scope == "node" else "world"

    def _issue(self, k: int, s: int, kind: str = "round") -> None:
        layout = self._layout()
        indices = layout.fragments[k]
        payload = self._payload(indices, layout.values(indices))
        sync = (kind, s, k)
        future = self.reducer.reduce(payload, names=[layout.names[i] for i in indices], sync=sync)
        self._flight = _Flight(fragment=k, issued_at=s, future=future, since=time.perf_counter())
        if k == 0:
            self._average_buffers(sync)

    def _land(self, s: int, blend: bool = True) -> None:
        """Apply the fragment in flight: its consensus, blended into the local parameters (``blend``)."""
        flight = self._flight
        assert flight is not None
        means = self._collect()
        layout = self._layout()
        indices = layout.fragments[flight.fragment]
        common = self._consensus(indices, means)
        alpha = self.fragment_alpha if blend else 0.0
        if alpha > 0:
            common = [alpha * local + (1 - alpha) * c.to(local.device)
                      for local, c in zip(layout.values(indices), common)]
        else:
            self._agreed.add(flight.fragment)
        layout.write(indices, common)

    def _overlap_round(self, s: int) -> None:
        layout = self._layout()
        indices = layout.fragments[0]
        current = layout.values(indices)
        if self._flight is not None:
            current = self._merge(indices, current)
            layout.write(indices, current)
        self._anchor = [c.clone() for c in current]
        payload = self._payload(indices, current)
        future = self.reducer.reduce(payload, names=[layout.names[i] for i in indices], sync=("round", s, 0))
        self._flight = _Flight(fragment=0, issued_at=s, future=future, since=time.perf_counter())
        self._average_buffers(("round", s, 0))

    def _merge(self, indices: list[int], current: list[torch.Tensor]) -> list[torch.Tensor]:
        """Apply the average sent one period ago, keeping this rank's progress since then."""
        common = self._consensus(indices, self._collect())
        assert self._anchor is not None
        merged = [c.to(x.device) + (x - a) for c, x, a in zip(common, current, self._anchor)]
        self._anchor = None
        return merged

    def _collect(self) -> list[torch.Tensor]:
        """The mean of the round in flight (waiting for it if needed); clears the flight."""
        self.flush()
        flight, self._flight = self._flight, None
        assert flight is not None and flight.means is not None
        return flight.means

    def flush(self) -> None:
        """Wait for the reduction in flight and keep its result until its turn to be applied.

        Called before every checkpoint, so a checkpoint never holds a half-finished collective and
        the trajectory after a resume is the one without the checkpoint.
        """
        flight = self._flight
        if flight is None or flight.future is None:
            return
        stats = self.overlap_stats
        stats["rounds"] += 1
        stats["steps_in_flight"] += self.steps.local_steps - flight.issued_at
        stats["completed_before_needed"] += int(flight.future.done())
        t0 = time.perf_counter()
        flight.means = flight.future.wait()
        stats["seconds_waited"] += time.perf_counter() - t0
        flight.future = None

    @torch.no_grad()
    def _average_buffers(self, sync: Any) -> None:
        """Plain fp32 mean of the floating buffers (e.g. BatchNorm statistics) over every rank, blocking.

        Over the world even with node scope: a node's processes compute their statistics on
        different data, so they differ inside a node too."""
        buffers = self._layout().buffers
        if not buffers or not self._distributed():
            return
        flat = torch.cat([b.reshape(-1).to(torch.float32) for b in buffers])
        self.ledger.all_reduce(flat, group=self.comm_group, scope=self.round_scope(), sync=sync)
        flat.div_(self.world_size)
        pos = 0
        for b in buffers:
            b.copy_(flat[pos:pos + b.numel()].view_as(b))
            pos += b.numel()

    def finish(self) -> None:
        """End of fit: apply anything in flight, then sync every fragment ranks disagree on, once."""
        if not self._local_phase_started or self._finished:
            return
        self._finished = True
        s = self.steps.local_steps
        layout = self._layout()
        if self.overlap:
            if self._flight is not None:
                indices = layout.fragments[0]
                layout.write(indices, self._merge(indices, layout.values(indices)))
            if self.steps.steps_in_period != 0:
                self._issue(0, s, "final")
                self._land(s)
            return
        if self._flight is not None:
            self._land(s)
        for k in range(self.fragments):
            if k not in self._agreed:
                self._issue(k, s, "final")
                self._land(s, blend=False)  # every rank leaves with the same model, whatever alpha is

    # ---- algorithm state -----------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        self.flush()
        state = super().algorithm_state_dict()
        flight = self._flight
        state.update(
            num_steps=self.steps.num_steps,
            overlap_stats=dict(self.overlap_stats),
            # Lightning's checkpoint holds rank 0's weights and optimizer state only; between
            # rounds every rank has its own.
            local_params={k: v.detach() for k, v in self.lightning_module.state_dict().items()},
            local_optimizer_states=[opt.state_dict() for opt in self.optimizers],
            anchor=self._anchor,
            pending=None if flight is None else {"fragment": flight.fragment, "issued_at": flight.issued_at,
                                                 "means": flight.means},
            agreed=sorted(self._agreed),
            reducer=self.reducer.state_dict() if self._reducer_cache is not None else self._restored_reducer_state,
            codec=self.codec_signature(),
        )
        return state

    def codec_signature(self) -> dict:
        """What the codec state in a checkpoint belongs to: the codec, its options, error feedback."""
        options = {k: getattr(self, k, default) for k, (default, users) in CODEC_OPTIONS.items() if self.codec in users}
        return {"name": self.codec, "error_feedback": self.error_feedback, **options}

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
        pending = state.get("pending")
        self._flight = None
        if pending is not None:
            self._flight = _Flight(fragment=int(pending["fragment"]), issued_at=int(pending["issued_at"]),
                                   means=_to(pending["means"], device))
        self._agreed = set(state.get("agreed", []))
        self._restored_optimizer_states = state.get("local_optimizer_states")
        self._reducer_cache = None
        self._restored_reducer_state = state.get("reducer") or None
        saved_codec = state.get("codec")
        if self._restored_reducer_state is not None and saved_codec is not None and saved_codec != self.codec_signature():
            # Residuals of one codec are not those of another (int8's are rounding errors, sign's are
            # most of the signal): never load them into another codec.
            self._restored_reducer_state = None
            if self.global_rank == 0:
                def spell(sig: dict) -> str:
                    return f"{sig.get('name')} ({', '.join(f'{k} {v}' for k, v in sig.items() if k != 'name')})"
                warnings.warn(f"{self.strategy_name}: checkpoint was written with codec {spell(saved_codec)}, this "
                              f"run uses {spell(self.codec_signature())}; reset the codec state "
                              f"({', '.join(state['reducer']) or 'empty'}): the {self.codec} codec starts from scratch",
                              stacklevel=2)

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

        Replicated state (the step count, and e.g. DiLoCo's global parameters and outer optimizer,
        and the agreed mean of a fragment in flight) is rank-independent and kept. The saved ranks'
        local parameters are averaged, which is what the next round would have done with them.
        Per-rank optimizer state (Lightning's rank-0 copy is used on every rank), error-feedback
        residuals and an overlapped round's anchor are reset.
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
        kept = [k for k in self.replicated_state if k in first]
        if any(p.get("anchor") is not None for p in parts):
            reset.append("anchor and pending (the overlapped round in flight is dropped)")
        elif first.get("pending") is not None:
            state["pending"] = first["pending"]  # the mean every rank agreed on: still valid
            kept.append("pending (the fragment in flight)")
        if any(p.get("reducer") for p in parts):
            names = self._describe_reducer_state()
            reset.append(f"codec state ({self.codec}{': ' + ', '.join(names) if names else ''})")
        if self.global_rank == 0:
            warnings.warn(
                f"{self.strategy_name}: {self.written_by(saved_world_size)}; kept {', '.join(kept)}; "
                f"averaged local_params of the {saved_world_size} saved ranks; reset {', '.join(reset)}",
                stacklevel=2,
            )
        return state

    def _describe_reducer_state(self) -> list[str]:
        options = {k: getattr(self, k, default) for k, (default, _) in CODEC_OPTIONS.items()}
        return build_reducer(self.codec, error_feedback=self.error_feedback, **options).runtime_state_names()

    def run_stats(self) -> dict:
        stats = {"rounds_waited_seconds": round(self.overlap_stats["seconds_waited"], 4)}
        if self.overlap or self.sync_delay:
            stats["overlap"] = dict(self.overlap_stats)
        if self.fragments > 1:
            layout = self._layout()
            stats["fragments"] = [{"parameters": len(f), "numel": layout.fragment_numel(k)}
                                  for k, f in enumerate(layout.fragments)]
        return stats


class _FinalRound(Callback):
    """Runs the strategy's final round at the start of on_train_end, before every other callback."""

    def __init__(self, strategy: PeriodicAveragingStrategy) -> None:
        self.strategy = strategy

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.finish()


def _to(tensors: Optional[list], device: torch.device) -> Optional[list]:
    return None if tensors is None else [t.to(device) for t in tensors]
