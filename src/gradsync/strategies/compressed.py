"""``compressed``: synchronous data parallel whose gradients cross the network compressed.

Every step is still a synchronous all-reduce of the mean gradient, but each DDP bucket travels
through a codec (:mod:`gradsync.strategies.codecs`): fp16, bf16, int8, 1-bit sign, top-k or
PowerSGD, the last three with error feedback. The codecs are DDP communication hooks, so
compression overlaps with the rest of the backward pass (no hook waits for a hop), and they run on
CPU/gloo as well as CUDA/NCCL. See docs/strategies/compressed.md for the math, the bytes and when to use which.

    gradsync fit --recipe digits --strategy compressed --strategy.codec int8 --devices 2 --accelerator cpu
    torchrun --nproc-per-node 8 -m gradsync.cli fit --strategy compressed --strategy.codec powersgd --strategy.rank 4
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Literal, Optional

from gradsync.comm import CODEC_OPTIONS, build_reducer, check_codec_options
from gradsync.comm.ddp import ReducerHookState, reducer_hook
from gradsync.comm.hierarchical import INTER, NodeReducer
from gradsync.comm.reducer import IdentityReducer, Reducer
from gradsync.errors import check
from gradsync.strategies.base import GradsyncStrategy

Codec = Literal["identity", "fp16", "bf16", "int8", "int4", "sign", "topk", "powersgd"]

#: Codecs whose error feedback is an option of ``compressed`` (on by default). The others send an
#: unbiased or nearly exact mean every step and run without it.
FEEDBACK_CODECS = ("sign", "topk", "powersgd")

#: Warm-up steps when none are given: PowerSGD with error feedback or warm start follows torch's
#: ``start_powerSGD_iter > 1`` rule; every other codec compresses from the first step.
POWERSGD_MIN_WARMUP = 2


class CompressedStrategy(GradsyncStrategy):
    """Compressed all-reduce: gradients sent as fp16, bf16, int8, int4, 1-bit sign, top-k or PowerSGD."""

    strategy_name = "compressed"

    def __init__(
        self,
        *,
        codec: Codec = "int8",
        warmup_steps: Optional[int] = None,
        chunk_size: int = 512,
        fraction: float = 0.01,
        rank: int = 4,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        scope: Literal["world", "node"] = "world",
        procs_per_node: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            codec: how gradients are encoded on the wire: ``identity`` (fp32, as ``sync``), ``fp16``,
                ``bf16`` (2x fewer bytes), ``int8`` (~4x), ``int4`` (~8x, noisy), ``sign`` (1 bit + scale, ~30x), ``topk``
                (1 / (N fraction)x) or ``powersgd`` (low rank; nm / (r(n+m))x per matrix).
            warmup_steps: optimizer steps of plain fp32 all-reduce before compression starts.
                Default: 2 for powersgd with error feedback or warm start (the minimum), else 0.
            chunk_size: int8, int4 and sign: entries that share one float32 scale (a multiple of 8 for sign).
            fraction: topk: share of entries sent per step, in (0, 1].
            rank: powersgd: rank of the approximation, >= 1.
            error_feedback: sign, topk, powersgd: carry what compression dropped into the next step.
            warm_start: powersgd: start each power iteration from the previous step's Q.
            seed: int8, int4: seed of the stochastic rounding (rank r uses seed + r); powersgd: of the initial Q.
            scope: ``world``: the codec between every rank; ``node``: the hierarchical all-reduce —
                fp32 reduce-scatter inside the node, the codec across nodes on the shard, fp32
                all-gather inside the node — so only the slow hop is compressed.
            procs_per_node: force the layout (K processes play one node), for tests on one machine.
            **kwargs: options of :class:`~gradsync.strategies.base.GradsyncStrategy` (backend,
                timeout_seconds, bucket_cap_mb, ...).
        """
        check_codec_options(codec, {"chunk_size": chunk_size, "fraction": fraction, "rank": rank,
                                    "warm_start": warm_start, "seed": seed})
        check(error_feedback or codec in FEEDBACK_CODECS, "error_feedback", error_feedback,
              f"is not used by codec {codec} (only by {', '.join(FEEDBACK_CODECS)})",
              f"drop --strategy.error_feedback or choose --strategy.codec {FEEDBACK_CODECS[0]}")
        has_memory = codec == "powersgd" and (error_feedback or warm_start)
        if warmup_steps is None:
            warmup_steps = POWERSGD_MIN_WARMUP if has_memory else 0
        check(isinstance(warmup_steps, int) and warmup_steps >= 0, "warmup_steps", warmup_steps,
              "must be an integer >= 0")
        check(not has_memory or warmup_steps >= POWERSGD_MIN_WARMUP, "warmup_steps", warmup_steps,
              "powersgd with error feedback or warm start must start after step 1 (torch's "
              "start_powerSGD_iter > 1 rule: the first steps run while DDP settles its buckets)",
              f"set --strategy.warmup_steps {POWERSGD_MIN_WARMUP} or more, or --strategy.error_feedback false "
              "--strategy.warm_start false")
        super().__init__(**kwargs)
        self._set_scope(scope, procs_per_node)
        self.codec = codec
        self.warmup_steps = warmup_steps
        self.chunk_size, self.fraction, self.rank = chunk_size, fraction, rank
        self.error_feedback, self.warm_start, self.seed = error_feedback, warm_start, seed
        self._new_reducer()  # validates the codec's own options now, not at the first step
        self._hook_state: Optional[ReducerHookState] = None

    def _new_reducer(self, group: Any = None, scope: str = "world") -> Reducer:
        options = {k: getattr(self, k) for k in CODEC_OPTIONS}
        return build_reducer(self.codec, ledger=self.ledger, group=group, scope=scope,
                             error_feedback=self.error_feedback and self.codec in FEEDBACK_CODECS, **options)

    # ---- hooks -----------------------------------------------------------------------------
    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        if self.scope == "node" and self.topology is not None:
            inter, intra = self.topology.inter, self.topology.intra
            reducer: Reducer = NodeReducer(self._new_reducer(inter, INTER), intra=intra)
            warmup: Reducer = NodeReducer(IdentityReducer(ledger=self.ledger, group=inter, scope=INTER), intra=intra)
        else:
            reducer = self._new_reducer(self.comm_group)
            warmup = IdentityReducer(ledger=self.ledger, group=self.comm_group)
        self._hook_state = ReducerHookState(reducer=reducer, warmup=warmup, warmup_steps=self.warmup_steps,
                                            ).bind(self.lightning_module.named_parameters())
        return self._hook_state, reducer_hook

    # ---- algorithm state -------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        out = super().algorithm_state_dict()
        if self._hook_state is not None:
            out["compressed"] = {"codec": self.codec, "num_steps": self._hook_state.num_steps,
                                 "codec_state": self._hook_state.reducer.state_dict()}
        return out

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        saved = state.get("compressed")
        if saved is None or self._hook_state is None:
            return
        self._hook_state.num_steps = int(saved["num_steps"])
        if saved.get("codec") != self.codec:
            if self.global_rank == 0:
                warnings.warn(f"compressed: checkpoint was written with codec {saved.get('codec')}, this run uses "
                              f"{self.codec}; starting the {self.codec} codec state from scratch", stacklevel=2)
            return
        self._hook_state.reducer.load_state_dict(saved.get("codec_state", {}))

    def reshard_algorithm_state(self, parts: list, saved_world_size: int) -> Optional[dict]:
        # Residuals and rounding streams belong to one rank of one world size: reset them. The step
        # counter is global (the same on every rank), so warm-up is not repeated.
        saved = parts[0].get("compressed")
        if saved is not None and self.global_rank == 0:
            reset = ", ".join(self._new_reducer().runtime_state_names())
            if reset:
                warnings.warn(
                    f"compressed: {self.written_by(saved_world_size)}; reset codec state ({self.codec}): {reset}", stacklevel=2)
        out: dict = {"ledger": parts[0].get("ledger", {})}
        if saved is not None:
            out["compressed"] = {"codec": saved.get("codec"), "num_steps": saved["num_steps"], "codec_state": {}}
        return out
