"""A complete gradsync strategy plugin: fp16 all-reduce with error feedback.

Plain fp16 compression rounds every gradient entry to 11 significant bits and forgets the rounding
error. Here each rank keeps that error and adds it to its next gradient (error feedback), so over
many steps nothing is lost, only delayed. It halves the bytes of ``sync`` (compression ratio 2).

Two parts, as in gradsync itself:

* the **codec** — a DDP communication hook ``fp16_ef_hook(state, bucket) -> Future[Tensor]`` and
  its state class, in pure torch (usable on any ``DistributedDataParallel`` model);
* the **strategy** — a ``GradsyncStrategy`` subclass that builds the hook, puts the residuals in
  the checkpoint, and registers itself with Lightning under the name ``fp16_ef``.

Use it from plain Lightning code::

    import lightning as L
    import fp16_error_feedback                # registers "fp16_ef" with Lightning
    trainer = L.Trainer(strategy="fp16_ef", accelerator="cpu", devices=2)
    trainer = L.Trainer(strategy=fp16_error_feedback.Fp16EFStrategy(gradient_scale=1024.0), devices=8)

The test suite runs this file (tests/docs/test_examples.py) on two gloo processes.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at runtime.
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

from gradsync.errors import check
from gradsync.strategies import GradsyncStrategy
from gradsync.strategies.codecs.common import CodecState, ParamStore
from gradsync.strategies.ledger import fp32_allreduce_bytes


# ---- the codec: pure torch ---------------------------------------------------------------------
@dataclass
class Fp16EFState(CodecState):
    """State of :func:`fp16_ef_hook`. The fields are what users tune; residuals are runtime state."""

    gradient_scale: float = 1.0
    error_feedback: bool = True
    # Kept per parameter name, not per bucket: DDP rebuilds its buckets after the first step.
    residuals: ParamStore = field(default_factory=ParamStore, repr=False)

    def state_dict(self) -> dict:
        return {"residuals": self.residuals.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.residuals.load_state_dict(state.get("residuals", {}))

    def runtime_state_names(self) -> list:
        return ["residuals"] if self.error_feedback else []


def fp16_ef_hook(state: Fp16EFState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket as float16 on the wire, carrying this rank's rounding error to the next step."""
    buffer = bucket.buffer()
    world = state.world_size()
    # What fp32 sync DDP would have sent for this bucket: the baseline of compression_ratio.
    state.ledger.add_logical(fp32_allreduce_bytes(buffer.numel(), world))

    layout = state.bucket_layout(bucket)  # the model's parameter order, whatever DDP's bucket order
    x = layout.gather(buffer).div_(world).mul_(state.gradient_scale)  # divide first: the sum cannot overflow
    if state.error_feedback:
        x += state.residuals.gather(layout.keys, x)
    sent = x.to(torch.float16)
    if state.error_feedback:
        state.residuals.scatter(layout.keys, x - sent.to(torch.float32))

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        layout.scatter(fut.value().to(torch.float32).div_(state.gradient_scale), buffer)
        return buffer

    # The ledger issues the all-reduce and records its wire bytes: 2(N-1)/N * 2 bytes per entry.
    return state.ledger.all_reduce(sent, group=state.group, async_op=True).then(decode)


# ---- the strategy --------------------------------------------------------------------------------
class Fp16EFStrategy(GradsyncStrategy):
    """fp16 all-reduce with error feedback: half the bytes of sync, rounding errors carried forward."""

    strategy_name = "fp16_ef"

    def __init__(self, *, gradient_scale: float = 1.0, error_feedback: bool = True, **kwargs: Any) -> None:
        """
        Args:
            gradient_scale: multiply gradients by this before the fp16 cast and divide after, > 0.
                Raise it (e.g. 1024) when gradients are tiny: fp16 flushes values below ~6e-8 to zero.
            error_feedback: add each rank's rounding error to its next gradient.
            **kwargs: options of :class:`~gradsync.strategies.base.GradsyncStrategy` (backend,
                timeout_seconds, bucket_cap_mb, ...).
        """
        check(gradient_scale > 0, "gradient_scale", gradient_scale, "must be > 0",
              "1.0 sends gradients unscaled; try 1024 for tiny gradients")
        super().__init__(**kwargs)
        # Stored under the argument's own name: GradsyncStrategy.options reads them back for summaries.
        self.gradient_scale = float(gradient_scale)
        self.error_feedback = bool(error_feedback)
        self.codec_state: Optional[Fp16EFState] = None

    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        # Called once the DDP model exists, on every backend (gloo included).
        self.codec_state = Fp16EFState(ledger=self.ledger, gradient_scale=self.gradient_scale,
                                       error_feedback=self.error_feedback)
        self.codec_state.bind(self.lightning_module.named_parameters())
        return self.codec_state, fp16_ef_hook

    # Every rank's part of this goes into the checkpoint and comes back to the same rank on resume.
    def algorithm_state_dict(self) -> dict:
        state = super().algorithm_state_dict()  # keeps the ledger totals
        if self.codec_state is not None:
            state["fp16_ef"] = self.codec_state.state_dict()
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        if self.codec_state is not None and "fp16_ef" in state:
            self.codec_state.load_state_dict(state["fp16_ef"])

    # A resume on another number of processes goes through GradsyncStrategy.reshard_algorithm_state,
    # which keeps the ledger and resets the residuals with a warning that names them.


# `L.Trainer(strategy="fp16_ef")` works once this module is imported.
Fp16EFStrategy.register_strategies(StrategyRegistry)
