"""``fp16``: cast each bucket to IEEE half precision, all-reduce, cast back.

Bytes per step: 2(N-1)/N * 2n (compression ratio 2). Half precision keeps 11 significant bits and
a range of about 6e-8 .. 65504: the bucket is divided by N *before* the cast so the sum cannot
overflow, but gradients below ~6e-8 flush to zero. Use it when gradients are well scaled (most
fp32 training); prefer ``bf16`` when they span many orders of magnitude.

Same as torch's ``default_hooks.fp16_compress_hook``, recorded in the ledger.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at runtime.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.strategies.codecs.common import CodecState
from gradsync.strategies.ledger import fp32_allreduce_bytes


@dataclass
class Fp16State(CodecState):
    """State of :func:`fp16_hook`: nothing to tune, nothing kept between steps."""


def cast_allreduce(state: CodecState, bucket: dist.GradBucket, dtype: torch.dtype) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket's mean in ``dtype`` and write it back in the bucket's own dtype."""
    buffer = bucket.buffer()
    world = state.world_size()
    state.ledger.add_logical(fp32_allreduce_bytes(buffer.numel(), world))
    compressed = buffer.to(dtype).div_(world)
    fut = state.ledger.all_reduce(compressed, group=state.group, async_op=True)

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(f.value())
        return buffer

    return fut.then(decompress)


def fp16_hook(state: Fp16State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket as float16 on the wire."""
    return cast_allreduce(state, bucket, torch.float16)
