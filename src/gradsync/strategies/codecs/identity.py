"""``identity``: no compression. One fp32 all-reduce per bucket, exactly what synchronous DDP sends.

Used for warm-up steps and as the reference the other codecs are measured against (the identity
codec through the hook path equals ``sync`` to 1e-6; the test suite checks it).

Bytes per step: 2(N-1)/N * 4n for n gradient entries (compression ratio 1.0).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at runtime.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.strategies.codecs.common import CodecState
from gradsync.strategies.ledger import fp32_allreduce_bytes


@dataclass
class IdentityState(CodecState):
    """State of :func:`identity_hook`: nothing to tune, nothing kept between steps."""


def identity_hook(state: IdentityState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket with one fp32 all-reduce (divide by N, then sum, as DDP does)."""
    tensor = bucket.buffer()
    world = state.world_size()
    state.ledger.add_logical(fp32_allreduce_bytes(tensor.numel(), world))
    tensor.div_(world)
    return state.ledger.all_reduce(tensor, group=state.group, async_op=True)
