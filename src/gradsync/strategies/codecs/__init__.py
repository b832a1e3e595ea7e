"""Gradient codecs as DDP communication hooks: the codec states of ``compressed``, on :mod:`gradsync.comm`.

The codecs themselves live in :mod:`gradsync.comm.codecs` as reducers; this module keeps the
hook-shaped API of ``compressed``: a state class per codec whose fields are what users tune, and a
hook ``<codec>_hook(state, bucket) -> Future[Tensor]`` (all of them the bucket adapter
:func:`gradsync.comm.ddp.reducer_hook`). Runtime state (residuals, random generators, PowerSGD
matrices) comes back from ``state.state_dict()``. Every collective goes through the state's
:class:`~gradsync.comm.ledger.CommLedger`, and each bucket adds its fp32 baseline, so
``ledger.compression_ratio`` is the real ratio against sync DDP.

Use one directly on a plain DDP model::

    state = Int8State(ledger=CommLedger(world_size=dist.get_world_size())).bind(model.named_parameters())
    ddp_model.register_comm_hook(state, int8_hook)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable, Optional

import torch.distributed as dist

from gradsync.comm import build_reducer
from gradsync.comm.codecs import int8, powersgd, sign, topk  # noqa: F401 - the codecs' functions, by module
from gradsync.comm.codecs.common import ParamStore
from gradsync.comm.ddp import name_parameters, reducer_hook
from gradsync.comm.error_feedback import ErrorFeedback
from gradsync.comm.ledger import CommLedger
from gradsync.comm.reducer import Reducer


@dataclass
class CodecState:
    """Base of every codec's hook state: the ledger, the group, the parameters' names, the reducer."""

    codec: ClassVar[str] = "identity"
    ledger: CommLedger = field(default_factory=CommLedger, repr=False)
    group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    #: id(parameter) -> (position, name) in the model; set by :meth:`bind`.
    param_names: dict = field(default_factory=dict, repr=False, compare=False)
    num_steps: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.reducer: Reducer = build_reducer(self.codec, ledger=self.ledger, group=self.group,
                                              **self.codec_options())

    def codec_options(self) -> dict:
        return {}

    def bind(self, named_parameters: Iterable) -> "CodecState":
        """Name the model's parameters so per-parameter state survives bucket rebuilds and resume."""
        self.param_names = name_parameters(named_parameters)
        return self

    def state_dict(self) -> dict:
        """This rank's runtime state (CPU tensors)."""
        return self.reducer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reducer.load_state_dict(state)

    def runtime_state_names(self) -> list[str]:
        return self.reducer.runtime_state_names()

    # ---- the reducer's state, by the names codec users know ------------------------------------
    def _feedback(self) -> ParamStore:
        return self.reducer.residuals if isinstance(self.reducer, ErrorFeedback) else ParamStore()

    def _inner(self) -> Reducer:
        return self.reducer.inner if isinstance(self.reducer, ErrorFeedback) else self.reducer


@dataclass
class IdentityState(CodecState):
    """State of :func:`identity_hook`: nothing to tune, nothing kept between steps."""

    codec: ClassVar[str] = "identity"


@dataclass
class Fp16State(CodecState):
    """State of :func:`fp16_hook`: nothing to tune, nothing kept between steps."""

    codec: ClassVar[str] = "fp16"


@dataclass
class Bf16State(CodecState):
    """State of :func:`bf16_hook`: nothing to tune, nothing kept between steps."""

    codec: ClassVar[str] = "bf16"


@dataclass
class Int8State(CodecState):
    """State of :func:`int8_hook`.

    Args:
        chunk_size: entries that share one scale, >= 8.
        seed: seed of the rounding noise; each rank draws from ``seed + rank``.
    """

    codec: ClassVar[str] = "int8"
    chunk_size: int = 512
    seed: int = 0

    def codec_options(self) -> dict:
        return {"chunk_size": self.chunk_size, "seed": self.seed}


@dataclass
class Int4State(Int8State):
    """State of :func:`int4_hook` (4-bit integers; options as :class:`Int8State`)."""

    codec: ClassVar[str] = "int4"


@dataclass
class SignState(CodecState):
    """State of :func:`sign_hook`.

    Args:
        chunk_size: entries that share one scale, a multiple of 8.
        error_feedback: keep worker and reducer residuals (strongly recommended).
    """

    codec: ClassVar[str] = "sign"
    chunk_size: int = 512
    error_feedback: bool = True

    def codec_options(self) -> dict:
        return {"chunk_size": self.chunk_size, "error_feedback": self.error_feedback}

    @property
    def worker_residuals(self) -> ParamStore:
        return self._feedback()

    @property
    def reducer_residuals(self) -> ParamStore:
        return self._inner().reducer_residuals


@dataclass
class TopKState(CodecState):
    """State of :func:`topk_hook`.

    Args:
        fraction: share of each bucket's entries sent per step, in (0, 1].
        error_feedback: keep what was not sent and add it next step (needed for convergence).
    """

    codec: ClassVar[str] = "topk"
    fraction: float = 0.01
    error_feedback: bool = True

    def codec_options(self) -> dict:
        return {"fraction": self.fraction, "error_feedback": self.error_feedback}

    @property
    def residuals(self) -> ParamStore:
        return self._feedback()


@dataclass
class PowerSGDState(CodecState):
    """State of :func:`powersgd_hook`.

    Args:
        rank: rank r of the approximation, >= 1.
        error_feedback: keep what the approximation missed and add it next step.
        warm_start: start each step's power iteration from last step's Q.
        seed: seed of the initial Q matrices; the same on every rank.
    """

    codec: ClassVar[str] = "powersgd"
    rank: int = 4
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0

    def codec_options(self) -> dict:
        return {"rank": self.rank, "error_feedback": self.error_feedback, "warm_start": self.warm_start,
                "seed": self.seed}

    @property
    def errors(self) -> ParamStore:
        return self._feedback()

    @property
    def qs(self) -> dict:
        return self._inner().qs


@dataclass
class SparseLoCoState(CodecState):
    """State of :func:`sparseloco_hook`.

    Args:
        sparse_chunk_size: entries per chunk, a power of two; indices cost log2 of it in bits.
        sparse_k: entries sent per chunk.
        value_bits: bits per sent value: 2, 4 or 8.
        error_feedback: keep what was not sent and add it next step (needed for convergence).
        error_decay: factor on the residual before it is added, in (0, 1].
    """

    codec: ClassVar[str] = "sparseloco"
    sparse_chunk_size: int = 4096
    sparse_k: int = 64
    value_bits: int = 2
    error_feedback: bool = True
    error_decay: float = 1.0

    def codec_options(self) -> dict:
        return {"sparse_chunk_size": self.sparse_chunk_size, "sparse_k": self.sparse_k,
                "value_bits": self.value_bits, "error_feedback": self.error_feedback,
                "error_decay": self.error_decay}

    @property
    def residuals(self) -> ParamStore:
        return self._feedback()


# One adapter serves every codec; the names say which state each is meant for.
identity_hook = fp16_hook = bf16_hook = int8_hook = int4_hook = sign_hook = topk_hook = powersgd_hook = reducer_hook
sparseloco_hook = reducer_hook

#: Codec name -> (state class, hook). The ``compressed`` strategy's ``codec`` option chooses one.
CODECS: dict[str, tuple[type[CodecState], Callable]] = {
    "identity": (IdentityState, identity_hook),
    "fp16": (Fp16State, fp16_hook),
    "bf16": (Bf16State, bf16_hook),
    "int8": (Int8State, int8_hook),
    "int4": (Int4State, int4_hook),
    "sign": (SignState, sign_hook),
    "topk": (TopKState, topk_hook),
    "powersgd": (PowerSGDState, powersgd_hook),
    "sparseloco": (SparseLoCoState, sparseloco_hook),
}

__all__ = [
    "CODECS", "Bf16State", "CodecState", "Fp16State", "IdentityState", "Int4State", "Int8State", "PowerSGDState",
    "SignState", "SparseLoCoState", "TopKState", "bf16_hook", "fp16_hook", "identity_hook", "int4_hook", "int8_hook", "powersgd_hook",
    "sign_hook", "sparseloco_hook", "topk_hook",
]


