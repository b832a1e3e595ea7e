"""``compressed``: synchronous data parallel whose gradients cross the network compressed.

Every step is still a synchronous all-reduce of the mean gradient, but each DDP bucket travels
through a codec (a reducer of :mod:`gradsync.comm`): fp16, bf16, int8, int4, 1-bit sign, top-k,
PowerSGD or SparseLoCo's 2-bit top-k of each chunk, the last four with error feedback. The codecs are DDP communication hooks, so
compression overlaps with the rest of the backward pass (no hook waits for a hop), and they run on
CPU/gloo as well as CUDA/NCCL. See docs/strategies/compressed.md for the math, the bytes and when to use which.

``sign``, ``topk`` and ``sparseloco`` compress each rank's SGD *velocity* instead of its gradient (momentum
correction, :class:`~gradsync.comm.error_feedback.MomentumCorrection`): the strategy reads the
momentum, dampening, nesterov and weight decay from the optimizer's parameter groups at every step,
and sets that optimizer's momentum and weight decay to 0 for the duration of its step (restored
right after, so the optimizer's own state and checkpoint keep the user's values), so momentum is
applied once. With Adam or AdamW each rank sends its own Adam direction (moments of its own
gradient, kept as codec state) and the step applies the delivered mean with the learning rate and
decoupled decay. ``--strategy.momentum_correction false`` compresses the gradient instead.

    gradsync fit --recipe digits --strategy compressed --strategy.codec int8 --devices 2 --accelerator cpu
    torchrun --nproc-per-node 8 -m gradsync.cli fit --strategy compressed --strategy.codec powersgd --strategy.rank 4
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Literal, Optional

from gradsync.algorithms import Schedule
from gradsync.algorithms.compressed import ADAM_OPTIMIZERS, MomentumTakeover
from gradsync.algorithms.state import StateRegistry, codec_change
from gradsync.comm import CODEC_OPTIONS, Codec, CodecSpec
from gradsync.comm.codecs.common import ParamStore
from gradsync.comm.ddp import ReducerHookState, reducer_hook
from gradsync.comm.error_feedback import MomentumCorrection
from gradsync.comm.hierarchical import INTER, NodeReducer
from gradsync.comm.reducer import IdentityReducer, Reducer
from gradsync.errors import check, spell
from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.local_clip import LocalClipState, local_clip_hook
from gradsync.strategies.replicas import QuorumPerStep, codec_across_groups
from gradsync.strategies.sharding import Shard, ShardDtype


# What this strategy needs to know of a codec is a trait of the codec (gradsync.comm.reducer.Reducer):
# error feedback is on by default for the biased ones (the others send an unbiased or nearly exact mean
# every step); the momentum-correctable ones compress the SGD velocity rather than the gradient unless
# momentum_correction is off (their error feedback compounds with the optimizer's momentum otherwise), and
# of those, the ones whose sparse messages mask the velocity where they sent (DGC) say so.

#: Warm-up steps when none are given: PowerSGD with error feedback or warm start follows torch's
#: ``start_powerSGD_iter > 1`` rule; every other codec compresses from the first step.
POWERSGD_MIN_WARMUP = 2

#: PowerSGD's rank when none is given: 4 (torch's hook and the paper use 1-4) with SGD, 8 with Adam
#: or AdamW, whose per-coordinate normalization divides what a rank-4 approximation drops by the
#: small second moments of those coordinates. Chargpt (AdamW, 2 ranks, 80 / 160 steps): rank 4 ends
#: 1.1% / 2.0% above sync's val_loss, rank 8 0.6% / 0.6%; on the 0.4M slow-link model 4.7% and 2.0%.
POWERSGD_RANK = CODEC_OPTIONS["rank"][0]  # (the Adam rank is the codec's: PowerSGDReducer.adam_options)


class CompressedStrategy(QuorumPerStep, GradsyncStrategy):
    """Compressed all-reduce: gradients sent as fp16, bf16, int8, int4, sign, top-k, PowerSGD or sparse 2-bit."""

    strategy_name = "compressed"

    def __init__(
        self,
        *,
        codec: Codec = "int8",
        warmup_steps: Optional[int] = None,
        chunk_size: int = 512,
        fraction: float = 0.01,
        rank: Optional[int] = None,
        error_feedback: Optional[bool] = None,
        momentum_correction: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        sparse_chunk_size: int = CODEC_OPTIONS["sparse_chunk_size"][0],
        sparse_k: int = CODEC_OPTIONS["sparse_k"][0],
        value_bits: int = CODEC_OPTIONS["value_bits"][0],
        error_decay: float = CODEC_OPTIONS["error_decay"][0],
        scope: Literal["world", "node"] = "world",
        procs_per_node: Optional[int] = None,
        shard: Shard = "none",
        param_dtype: ShardDtype = "fp32",
        reduce_dtype: ShardDtype = "fp32",
        **kwargs: Any,
    ) -> None:
        """
        Args:
            codec: how gradients are encoded on the wire: ``identity`` (fp32, as ``sync``), ``fp16``,
                ``bf16`` (2x fewer bytes), ``int8`` (~4x), ``int4`` (~8x, noisy), ``sign`` (1 bit + scale, ~30x), ``topk``
                (1 / (N fraction)x), ``powersgd`` (low rank; nm / (r(n+m))x per matrix) or ``sparseloco``
                (the top 64 of every 4096 entries, 2-bit values, Elias-Fano indices: 390 / N x).
            warmup_steps: optimizer steps of plain fp32 all-reduce before compression starts.
                Default: 2 for powersgd with error feedback or warm start (the minimum), else 0.
            chunk_size: int8, int4 and sign: entries that share one float32 scale (a multiple of 8 for sign).
            fraction: topk: share of entries sent per step, in (0, 1].
            rank: powersgd: rank of the approximation, >= 1. Default: 4, or 8 when the optimizer is
                Adam or AdamW (their per-coordinate scaling amplifies what a low rank drops).
            error_feedback: carry what compression dropped into the next step (any lossy codec; the same
                option as ``local_sgd``'s and ``diloco``'s). Default: on for sign, topk, powersgd and
                sparseloco, which need it; off for fp16, bf16, int8 and int4, whose rounding is
                unbiased (stochastic) or below the gradient noise.
            momentum_correction: sign, topk, sparseloco: compress each rank's SGD velocity (Deep Gradient
                Compression's momentum correction) or, with Adam/AdamW, its Adam direction, not its
                gradient: the optimizer's settings are read from it and applied before compression,
                and its step applies the delivered mean. ``false``: compress the gradient (the plain variants).
            warm_start: powersgd: start each power iteration from the previous step's Q.
            seed: int8, int4: seed of the stochastic rounding (rank r uses seed + r); powersgd: of the initial Q.
            sparse_chunk_size: sparseloco: entries per top-k chunk, a power of two.
            sparse_k: sparseloco: entries sent per chunk.
            value_bits: sparseloco: bits per sent value, 2, 4 or 8.
            error_decay: sparseloco: factor on the error-feedback residual before it is added, in (0, 1].
            scope: ``world``: the codec between every rank; ``node``: the hierarchical all-reduce —
                fp32 reduce-scatter inside the node, the codec across nodes on the shard, fp32
                all-gather inside the node — so only the slow hop is compressed.
            procs_per_node: force the layout (K processes play one node), for tests on one machine.
            shard: ``none``: a full replica per process (DDP); ``node``: parameters, gradients and optimizer
                state sharded over the node's processes (FSDP2), and each process's gradient shard
                crosses nodes through the codec (compressed HSDP).
            param_dtype: with ``shard node``: the dtype FSDP2 gathers and computes each unit in (``fp32``,
                ``bf16``, ``fp16``); the sharded parameters and the optimizer stay fp32.
            reduce_dtype: with ``shard node``: the dtype of FSDP2's intra-node gradient reduce-scatter.
            **kwargs: options of :class:`~gradsync.strategies.base.GradsyncStrategy` (backend,
                timeout_seconds, bucket_cap_mb, ...).
        """
        #: the codec with its options and error feedback (on by default for the codecs that need it)
        self.codec_spec = CodecSpec.parse(codec, {
            "chunk_size": chunk_size, "fraction": fraction, "rank": POWERSGD_RANK if rank is None else rank,
            "warm_start": warm_start, "seed": seed, "sparse_chunk_size": sparse_chunk_size, "sparse_k": sparse_k,
            "value_bits": value_bits, "error_decay": error_decay}, error_feedback, feedback_by_default=None)
        error_feedback = self.codec_spec.error_feedback
        correctable = CodecSpec.having("momentum_correctable")
        check(momentum_correction or self.codec_spec.traits.momentum_correctable, "momentum_correction",
              momentum_correction, f"is not used by codec {codec} (only by {', '.join(correctable)})",
              f"drop {spell('momentum_correction')} or choose {spell('codec', correctable[0])}")
        has_memory = self.codec_spec.keeps_memory()
        if warmup_steps is None:
            warmup_steps = POWERSGD_MIN_WARMUP if has_memory else 0
        check(isinstance(warmup_steps, int) and warmup_steps >= 0, "warmup_steps", warmup_steps,
              "must be an integer >= 0")
        check(not has_memory or warmup_steps >= POWERSGD_MIN_WARMUP, "warmup_steps", warmup_steps,
              "powersgd with error feedback or warm start must start after step 1 (torch's "
              "start_powerSGD_iter > 1 rule: the first steps run while DDP settles its buckets)",
              f"set {spell('warmup_steps', POWERSGD_MIN_WARMUP)} or more, or {spell('error_feedback', False)} "
              f"{spell('warm_start', False)}")
        super().__init__(**kwargs)
        self._set_shard(shard, param_dtype, reduce_dtype)
        check(not (self.sharded and scope == "node"), "scope", scope,
              "is implied by shard node (FSDP2 reduces inside the node, the codec runs across nodes)",
              f"drop {spell('scope')}")
        check(not (self.sharded and momentum_correction and self.codec_spec.traits.momentum_correctable),
              "momentum_correction",
              True, f"is not available with shard node: codec {codec} compresses the gradient shards there",
              f"add {spell('momentum_correction', False)}")
        self._set_scope(scope, procs_per_node)
        self.codec = codec
        self.warmup_steps = warmup_steps
        #: the optimizer-step count (advanced by :meth:`optimizer_step`, read by the hook, checkpointed)
        self.schedule = Schedule(warmup_steps=warmup_steps)
        for option, value in self.codec_spec.options.items():
            setattr(self, option, value)
        self._given_options = {"rank"} if rank is not None else set()  # (the others have plain defaults)
        self.error_feedback = error_feedback
        self.momentum_correction = bool(momentum_correction)
        self._hook_state: Optional[ReducerHookState] = None
        self._velocities = ParamStore()  # shared by the warm-up and the codec reducer
        self._second_moments, self._adam_steps = ParamStore(), {}  # ... and Adam's other moments
        self._warned: set = set()
        # the optimizer's momentum, read at every step and applied once (algorithms.compressed)
        self._takeover = MomentumTakeover(self._live_optimizers, self._parameter_names, self._warn_once)
        self._local_clip: Optional[LocalClipState] = None  # gradient clipping before compression
        self.registry = self._register_state()

    @property
    def corrects_momentum(self) -> bool:
        """True when the codec is sent the SGD velocity (and the optimizer steps without momentum)."""
        return self.momentum_correction and self.codec_spec.traits.momentum_correctable

    def _new_reducer(self, group: Any = None, scope: str = "world") -> Reducer:
        return self.codec_spec.build(ledger=self.ledger, group=group, scope=scope)

    # ---- hooks -----------------------------------------------------------------------------
    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        if self.fault_tolerance is not None:  # a quorum per step: the codec across the groups of each
            state, hook = self._managed_hook()
            self._hook_state = state  # (its reducer's residuals are checkpointed as the codec state)
            return state, hook
        reducer, warmup = self._build_reducers()
        self._hook_state = ReducerHookState(reducer=reducer, warmup=warmup, warmup_steps=self.schedule.warmup_steps,
                                            steps=self.schedule).bind(self.lightning_module.named_parameters())
        trainer = self.lightning_module.trainer
        clip_val = getattr(trainer, "gradient_clip_val", None) if trainer is not None else None
        if self.corrects_momentum and clip_val:
            # What arrives is a mean velocity / Adam direction, not a gradient: clip each rank's gradient
            # before the codec forms it (DGC's local clipping), and keep Lightning from clipping the result.
            algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm"
            self._local_clip = LocalClipState(self._hook_state, reducer_hook, float(clip_val), algorithm,
                                              grad_scale=self._local_gradient_scale)
            return self._local_clip, local_clip_hook
        return self._hook_state, reducer_hook

    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.sharded:  # no DDP hook: the reducers run on the gradient shards after backward
            # (across replica groups: the codec across the groups of each step's quorum, no warm-up)
            reducer, warmup = ((self._shard_reducer,) * 2 if self.replicas is not None else self._build_reducers())
            self._hook_state = ReducerHookState(reducer=reducer, warmup=warmup, warmup_steps=self.schedule.warmup_steps,
                                                steps=self.schedule)

    def sharded_gradient_reducer(self) -> Reducer:
        state = self._hook_state
        return state.warmup if self.schedule.in_warmup else state.reducer

    def _build_reducers(self) -> tuple[Reducer, Reducer]:
        """The codec's reducer and the warm-up's, wrapped as the scope and momentum correction ask."""
        if self.sharded and self.topology is not None:
            inter = self.topology.inter
            return self._new_reducer(inter, INTER), IdentityReducer(ledger=self.ledger, group=inter, scope=INTER)
        if self.scope == "node" and self.topology is not None:
            inter, intra = self.topology.inter, self.topology.intra
            reducer: Reducer = NodeReducer(self._new_reducer(inter, INTER), intra=intra)
            warmup: Reducer = NodeReducer(IdentityReducer(ledger=self.ledger, group=inter, scope=INTER), intra=intra)
        else:
            reducer = self._new_reducer(self.comm_group)
            warmup = IdentityReducer(ledger=self.ledger, group=self.comm_group)
        if self.corrects_momentum:
            params = dict(self.lightning_module.named_parameters())
            # Masking needs to know where the codec sent: the node-scoped reducer does not say.
            masking = self.codec_spec.traits.masks_sent and self.scope != "node"
            # the warm-up and the codec's wrapper share every moment, so nothing restarts when compression does
            shared = dict(velocities=self._velocities, second_moments=self._second_moments,
                          adam_steps=self._adam_steps, grad_scale=self._local_gradient_scale)
            reducer = MomentumCorrection(reducer, settings=self._takeover.settings, params=params, masking=masking,
                                         worker_feedback=self.codec_spec.traits.masks_sent,
                                         **shared)
            warmup = MomentumCorrection(warmup, settings=self._takeover.settings, params=params, **shared)
        return reducer, warmup

    # ---- momentum correction: the optimizer's momentum, applied once ---------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self._choose_adam_options(trainer.optimizers)

    def _choose_adam_options(self, optimizers: list) -> None:
        """The codec's options for Adam-family optimizers where the user gave none (PowerSGD: rank 8, not
        4). The optimizers exist only after the DDP hook is registered, so the (still empty) reducers are
        rebuilt with them."""
        if not any(isinstance(o, ADAM_OPTIMIZERS) for o in optimizers):
            return
        adam = {k: v for k, v in self.codec_spec.traits.adam_options.items()
                if k not in self._given_options and self.codec_spec.options.get(k) != v}
        if adam:
            for option, value in adam.items():
                setattr(self, option, value)
            self.codec_spec = self.codec_spec.with_options(**adam)
            if self._hook_state is not None:
                self._hook_state.reducer, self._hook_state.warmup = self._build_reducers()

    def _local_gradient_scale(self) -> float:
        """What turns this rank's gradient into its mean gradient: a weighted loss back-propagates
        ``sum_mb w * grad / K``; its Adam direction needs ``grad / w`` (the moments are not linear)."""
        if self._weighted and self._weight_sum > 0:
            return self.accumulation_steps / self._weight_sum
        return 1.0

    def _normalize_weighted_gradients(self, optimizer: Any) -> None:
        if not self._takeover.applying_direction:  # a delivered Adam direction is normalized already
            super()._normalize_weighted_gradients(optimizer)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.replicas is not None:
            out = self._quorum_step(optimizer, closure,
                                    lambda managed: self._optimizer_step(optimizer, managed, model, **kwargs))
        else:
            out = self._optimizer_step(optimizer, closure, model, **kwargs)
        self.schedule.num_steps += 1  # the step's gradients were reduced under the count before it
        return out

    # ---- fault-tolerant replica groups (a quorum per step, as sync's) ----------------------------
    #: what the codec compresses does not depend on DDP's bucket rebuild (as under the per-bucket hook)
    _canonical_layout = True

    def _unsupported_across_groups(self) -> list:
        return [*super()._unsupported_across_groups(), codec_across_groups(self.codec_spec),
                (self.corrects_momentum, "momentum_correction", True, False),
                (self.schedule.warmup_steps != 0, "warmup_steps", self.schedule.warmup_steps, 0),
                (self.scope != "world", "scope", self.scope, "world")]

    def _step_reducer(self) -> Reducer:
        # (powersgd, whose path rebuilds the per-bucket reducers, is refused above)
        return self._within_group(self.replicas.codec_reducer(self.codec_spec, self._across_scope()))

    def _step_count(self) -> Schedule:
        return self.schedule

    def _optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if not self.corrects_momentum:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self.lightning_module.trainer
        clip_val = trainer.gradient_clip_val
        if self._local_clip is not None:
            # each rank's gradient was clipped before compression (local_clip_hook): Lightning must not
            # clip again what arrives (a mean velocity or Adam direction)
            trainer.gradient_clip_val = None
        try:
            with self._takeover.step(optimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            trainer.gradient_clip_val = clip_val

    def _live_optimizers(self) -> list:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return list(trainer.optimizers) if trainer is not None else []

    def _parameter_names(self) -> dict:
        return {id(p): name for name, p in self.lightning_module.named_parameters()}

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and self.global_rank == 0:
            warnings.warn(message, stacklevel=3)
        self._warned.add(key)

    # ---- algorithm state -------------------------------------------------------------------
    # The registry holds closures over self: it is made anew on the other side of a pickle or deepcopy.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("registry", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.registry = self._register_state()

    def _register_state(self) -> StateRegistry:
        """compressed's state, declared once: what a resume on another layout keeps, averages or resets.
        It stays under the checkpoint key ``compressed``."""
        reg = StateRegistry()
        reg.register("codec", "replicated", lambda: self.codec, lambda v: None)  # checked on load
        reg.register("momentum_correction", "replicated", lambda: self.corrects_momentum, lambda v: None)
        # global (the same on every rank): warm-up is not repeated on another world size
        reg.register("num_steps", "replicated", lambda: self.schedule.num_steps,
                     lambda v: setattr(self.schedule, "num_steps", int(v)))
        # residuals, rounding streams and Adam moments belong to one rank of one world size
        reg.register("codec_state", "per_rank", self._codec_state, self._load_codec_state,
                     label=f"codec state ({self.codec}): {', '.join(self.codec_spec.state_names())}")
        # without masking, the velocities' mean is exactly the momentum buffer sync SGD would hold;
        # loaded after the codec state, which would clear them
        reg.register("velocities", "averaged", lambda: self._velocities.state_dict() or None,
                     lambda v: self._velocities.load_state_dict(v or {}), label="momentum-correction velocities")
        return reg

    def _codec_state(self) -> Optional[dict]:
        state = {k: v for k, v in self._hook_state.reducer.state_dict().items() if k != "velocities"}
        return state or None

    def _load_codec_state(self, state: Optional[dict]) -> None:
        self._hook_state.reducer.load_state_dict(state or {})

    def algorithm_state_dict(self) -> dict:
        out = super().algorithm_state_dict()
        if self._hook_state is not None:
            out["compressed"] = self.registry.state_dict()
        return out

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        saved = state.get("compressed")
        if saved is None or self._hook_state is None:
            return
        self.schedule.num_steps = int(saved["num_steps"])
        # Residuals of velocities and of gradients are different quantities: neither fits the other.
        change = codec_change({"name": saved.get("codec"), "momentum_correction": bool(saved.get("momentum_correction"))},
                              {"name": self.codec, "momentum_correction": self.corrects_momentum})
        if change:
            if self.global_rank == 0:
                warnings.warn(f"compressed: {change}; starting the {self.codec} codec state from scratch", stacklevel=2)
            return
        self.registry.load_state_dict(saved)

    def reshard_algorithm_state(self, parts: list, saved_world_size: int) -> Optional[dict]:
        out: dict = {"ledger": parts[0].get("ledger", {})}
        if parts[0].get("compressed") is None:
            return out
        resharded = self.registry.reshard([_with_velocities_apart(p.get("compressed") or {}) for p in parts])
        if (resharded.reset or resharded.averaged) and self.global_rank == 0:
            warnings.warn(resharded.describe("compressed", self.written_by(saved_world_size), len(parts)),
                          stacklevel=2)
        out["compressed"] = resharded.state
        return out


def _with_velocities_apart(saved: dict) -> dict:
    """A saved part as the registry declares it: checkpoints written before the registry kept the
    momentum-correction velocities inside the codec state."""
    codec_state = saved.get("codec_state") or {}
    if "velocities" not in codec_state:
        return saved
    rest = {k: v for k, v in codec_state.items() if k != "velocities"}
    return {**saved, "codec_state": rest or None, "velocities": saved.get("velocities") or codec_state["velocities"]}
