"""A complete gradsync strategy plugin: fp16 all-reduce with error feedback.

Plain fp16 compression rounds every gradient entry to 11 significant bits and forgets the rounding
error. Here each rank keeps that error and adds it to its next gradient (error feedback), so over
many steps nothing is lost, only delayed. It halves the bytes of ``sync`` (compression ratio 2).

Two parts, as in gradsync itself:

* the **codec** — a :class:`gradsync.comm.reducer.Reducer` in pure torch: the mean of a list of
  tensors across a process group, written as a generator that yields the Future of each
  collective. Wrapped in :class:`gradsync.comm.error_feedback.ErrorFeedback` it keeps each rank's
  rounding error per parameter name. The same reducer serves DDP gradient buckets (through
  :func:`gradsync.comm.ddp.reducer_hook`) and any strategy's rounds;
* the **strategy** — a ``GradsyncStrategy`` subclass that builds the hook, puts the residuals in
  the checkpoint, and registers itself with Lightning under the name ``fp16_ef``.

Use it from plain Lightning code::

    import lightning as L
    import fp16_error_feedback                # registers "fp16_ef" with Lightning
    trainer = L.Trainer(strategy="fp16_ef", accelerator="cpu", devices=2)
    trainer = L.Trainer(strategy=fp16_error_feedback.Fp16EFStrategy(gradient_scale=1024.0), devices=8)

The test suite runs this file (tests/docs/test_examples.py) on two gloo processes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.pytorch.strategies import StrategyRegistry

from gradsync.comm.codecs.common import unflatten
from gradsync.comm.ddp import ReducerHookState, reducer_hook
from gradsync.comm.error_feedback import ErrorFeedback
from gradsync.comm.reducer import Reducer
from gradsync.errors import check
from gradsync.strategies import GradsyncStrategy


# ---- the codec: pure torch ---------------------------------------------------------------------
class ScaledFp16Reducer(Reducer):
    """The mean of tensors as float16 on the wire, scaled first so that tiny values survive the cast."""

    codec = "scaled_fp16"
    lossy = True  # the mean is approximate: ErrorFeedback may wrap it

    def __init__(self, *, gradient_scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gradient_scale = float(gradient_scale)

    def run(self, tensors, names, sync):
        world = self.world_size()
        # divide first: the sum of N values cannot overflow
        x = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors]).div_(world).mul_(self.gradient_scale)
        wire = x.to(torch.float16)
        # what this rank's contribution decodes to, in its input's units (error feedback keeps input - sent)
        sent = unflatten(wire.to(torch.float32).div_(self.gradient_scale).mul_(world), tensors) \
            if self.need_sent else None
        # The ledger issues the all-reduce and records its wire bytes: 2(N-1)/N * 2 bytes per entry.
        # ``yield`` hands the Future back; the reduction resumes when it completes, without blocking anyone.
        summed = yield self.ledger.all_reduce(wire, **self.account(sync))
        return unflatten(summed.to(torch.float32).div_(self.gradient_scale), tensors), sent


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
        self.reducer: Optional[Reducer] = None

    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        # Called once the DDP model exists, on every backend (gloo included). comm_group is
        # gradsync's own process group: no other collective can come between a reducer's hops.
        reducer = ScaledFp16Reducer(ledger=self.ledger, group=self.comm_group, gradient_scale=self.gradient_scale)
        self.reducer = ErrorFeedback(reducer) if self.error_feedback else reducer
        state = ReducerHookState(self.reducer).bind(self.lightning_module.named_parameters())
        return state, reducer_hook

    # Every rank's part of this goes into the checkpoint and comes back to the same rank on resume.
    def algorithm_state_dict(self) -> dict:
        state = super().algorithm_state_dict()  # keeps the ledger totals
        if self.reducer is not None:
            state["fp16_ef"] = self.reducer.state_dict()
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        if self.reducer is not None and "fp16_ef" in state:
            self.reducer.load_state_dict(state["fp16_ef"])

    # A resume on another number of processes goes through GradsyncStrategy.reshard_algorithm_state,
    # which keeps the ledger and resets the residuals with a warning that names them.


# `L.Trainer(strategy="fp16_ef")` works once this module is imported.
Fp16EFStrategy.register_strategies(StrategyRegistry)
