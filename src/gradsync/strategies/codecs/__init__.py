"""Gradient codecs: pure torch (no Lightning), testable in isolation.

Each codec is a DDP communication hook ``<codec>_hook(state, bucket) -> Future[Tensor]`` and a
state class ``<Codec>State`` whose fields are what users tune; runtime state (residuals, random
generators, PowerSGD matrices) comes back from ``state.state_dict()``. Every collective goes
through the state's :class:`~gradsync.strategies.ledger.CommLedger`, and each hook adds the fp32
baseline of its bucket, so ``ledger.compression_ratio`` is the real ratio against sync DDP.

Use one directly on a plain DDP model::

    state = Int8State(ledger=CommLedger(world_size=dist.get_world_size())).bind(model.named_parameters())
    ddp_model.register_comm_hook(state, int8_hook)
"""

from __future__ import annotations

from typing import Callable

from gradsync.strategies.codecs.bf16 import Bf16State, bf16_hook
from gradsync.strategies.codecs.common import CodecState
from gradsync.strategies.codecs.fp16 import Fp16State, fp16_hook
from gradsync.strategies.codecs.identity import IdentityState, identity_hook
from gradsync.strategies.codecs.int8 import Int8State, int8_hook
from gradsync.strategies.codecs.powersgd import PowerSGDState, powersgd_hook
from gradsync.strategies.codecs.sign import SignState, sign_hook
from gradsync.strategies.codecs.topk import TopKState, topk_hook

#: Codec name -> (state class, hook). The ``compressed`` strategy's ``codec`` option chooses one.
CODECS: dict[str, tuple[type[CodecState], Callable]] = {
    "identity": (IdentityState, identity_hook),
    "fp16": (Fp16State, fp16_hook),
    "bf16": (Bf16State, bf16_hook),
    "int8": (Int8State, int8_hook),
    "sign": (SignState, sign_hook),
    "topk": (TopKState, topk_hook),
    "powersgd": (PowerSGDState, powersgd_hook),
}

__all__ = [
    "CODECS", "Bf16State", "CodecState", "Fp16State", "IdentityState", "Int8State", "PowerSGDState",
    "SignState", "TopKState", "bf16_hook", "fp16_hook", "identity_hook", "int8_hook", "powersgd_hook",
    "sign_hook", "topk_hook",
]
