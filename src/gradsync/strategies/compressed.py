"""``compressed``: synchronous data parallel whose gradients cross the network compressed.

Every step is still a synchronous all-reduce of the mean gradient, but each DDP bucket travels
through a codec (:mod:`gradsync.strategies.codecs`): fp16, bf16, int8, 1-bit sign, top-k or
PowerSGD, the last three with error feedback. The codecs are DDP communication hooks, so
compression overlaps with the rest of the backward pass, and they run on CPU/gloo as well as
CUDA/NCCL. See docs/strategies/compressed.md for the math, the bytes and when to use which.

    gradsync fit --recipe digits --strategy compressed --strategy.codec int8 --devices 2 --accelerator cpu
    torchrun --nproc-per-node 8 -m gradsync.cli fit --strategy compressed --strategy.codec powersgd --strategy.rank 4
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist

from gradsync.errors import check
from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.codecs import CODECS, CodecState, IdentityState, identity_hook

Codec = Literal["identity", "fp16", "bf16", "int8", "sign", "topk", "powersgd"]

# Options that belong to some codecs only: (option, its default, the codecs that read it).
_CODEC_OPTIONS = (
    ("chunk_size", 512, ("int8", "sign")),
    ("fraction", 0.01, ("topk",)),
    ("rank", 4, ("powersgd",)),
    ("error_feedback", True, ("sign", "topk", "powersgd")),
    ("warm_start", True, ("powersgd",)),
    ("seed", 0, ("int8", "powersgd")),
)

#: Warm-up steps when none are given: PowerSGD with error feedback or warm start follows torch's
#: ``start_powerSGD_iter > 1`` rule; every other codec compresses from the first step.
POWERSGD_MIN_WARMUP = 2


@dataclass
class CompressedState:
    """State of :func:`compressed_hook`: the codec, the warm-up and the one step counter."""

    codec_state: CodecState
    codec_hook: Callable
    warmup_state: IdentityState
    warmup_steps: int = 0
    #: Optimizer steps whose gradients went through this hook (the last bucket of a step counts it).
    num_steps: int = 0


def compressed_hook(state: CompressedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Plain fp32 all-reduce for the first ``warmup_steps`` steps, then the codec's hook."""
    if state.num_steps < state.warmup_steps:
        fut = identity_hook(state.warmup_state, bucket)
    else:
        fut = state.codec_hook(state.codec_state, bucket)
    if bucket.is_last():
        # DDP launches buckets in index order, so this is the step's final bucket.
        state.num_steps += 1
    return fut


class CompressedStrategy(GradsyncStrategy):
    """Compressed all-reduce: gradients sent as fp16, bf16, int8, 1-bit sign, top-k or PowerSGD."""

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
        **kwargs: Any,
    ) -> None:
        """
        Args:
            codec: how gradients are encoded on the wire: ``identity`` (fp32, as ``sync``), ``fp16``,
                ``bf16`` (2x fewer bytes), ``int8`` (~4x), ``sign`` (1 bit + scale, ~30x), ``topk``
                (1 / (N fraction)x) or ``powersgd`` (low rank; nm / (r(n+m))x per matrix).
            warmup_steps: optimizer steps of plain fp32 all-reduce before compression starts.
                Default: 2 for powersgd with error feedback or warm start (the minimum), else 0.
            chunk_size: int8 and sign: entries that share one float32 scale (a multiple of 8).
            fraction: topk: share of entries sent per step, in (0, 1].
            rank: powersgd: rank of the approximation, >= 1.
            error_feedback: sign, topk, powersgd: carry what compression dropped into the next step.
            warm_start: powersgd: start each power iteration from the previous step's Q.
            seed: int8: seed of the stochastic rounding (rank r uses seed + r); powersgd: of the initial Q.
            **kwargs: options of :class:`~gradsync.strategies.base.GradsyncStrategy` (backend,
                timeout_seconds, bucket_cap_mb, ...).
        """
        check(codec in CODECS, "codec", codec, f"must be one of {', '.join(CODECS)}", "e.g. --strategy.codec int8")
        given = {"chunk_size": chunk_size, "fraction": fraction, "rank": rank, "error_feedback": error_feedback,
                 "warm_start": warm_start, "seed": seed}
        for option, default, users in _CODEC_OPTIONS:
            check(given[option] == default or codec in users, option, given[option],
                  f"is not used by codec {codec} (only by {', '.join(users)})",
                  f"drop --strategy.{option} or choose --strategy.codec {users[0]}")
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
        self.codec = codec
        self.warmup_steps = warmup_steps
        self.chunk_size, self.fraction, self.rank = chunk_size, fraction, rank
        self.error_feedback, self.warm_start, self.seed = error_feedback, warm_start, seed
        self._new_codec_state()  # validates the codec's own options now, not at the first step
        self._hook_state: Optional[CompressedState] = None

    def _new_codec_state(self) -> CodecState:
        state_cls, _ = CODECS[self.codec]
        names = [f for f in ("chunk_size", "fraction", "rank", "error_feedback", "warm_start", "seed")
                 if f in state_cls.__dataclass_fields__]
        return state_cls(ledger=self.ledger, **{f: getattr(self, f) for f in names})

    # ---- hooks -----------------------------------------------------------------------------
    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        named = list(self.lightning_module.named_parameters())
        codec_state = self._new_codec_state().bind(named)
        self._hook_state = CompressedState(
            codec_state=codec_state, codec_hook=CODECS[self.codec][1],
            warmup_state=IdentityState(ledger=self.ledger), warmup_steps=self.warmup_steps,
        )
        return self._hook_state, compressed_hook

    # ---- algorithm state -------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        out = super().algorithm_state_dict()
        if self._hook_state is not None:
            out["compressed"] = {"codec": self.codec, "num_steps": self._hook_state.num_steps,
                                 "codec_state": self._hook_state.codec_state.state_dict()}
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
        self._hook_state.codec_state.load_state_dict(saved.get("codec_state", {}))

    def reshard_algorithm_state(self, parts: list, saved_world_size: int) -> Optional[dict]:
        # Residuals and rounding streams belong to one rank of one world size: reset them. The step
        # counter is global (the same on every rank), so warm-up is not repeated.
        saved = parts[0].get("compressed")
        if saved is not None and self.global_rank == 0:
            reset = ", ".join(self._new_codec_state().runtime_state_names())
            if reset:
                warnings.warn(
                    f"compressed: checkpoint was written by {saved_world_size} processes, this run has "
                    f"{self.world_size}; reset codec state ({self.codec}): {reset}", stacklevel=2)
        out: dict = {"ledger": parts[0].get("ledger", {})}
        if saved is not None:
            out["compressed"] = {"codec": saved.get("codec"), "num_steps": saved["num_steps"], "codec_state": {}}
        return out
