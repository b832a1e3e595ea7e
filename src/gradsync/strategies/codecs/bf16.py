"""``bf16``: cast each bucket to bfloat16, all-reduce, cast back.

Bytes per step: 2(N-1)/N * 2n (compression ratio 2). bfloat16 keeps fp32's range (no overflow, no
flush to zero) with 8 significant bits, so each entry carries ~0.4% relative error. It works on
gloo as well as NCCL (torch's own ``bf16_compress_hook`` refuses gloo).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at runtime.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.strategies.codecs.common import CodecState
from gradsync.strategies.codecs.fp16 import cast_allreduce


@dataclass
class Bf16State(CodecState):
    """State of :func:`bf16_hook`: nothing to tune, nothing kept between steps."""


def bf16_hook(state: Bf16State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket as bfloat16 on the wire."""
    return cast_allreduce(state, bucket, torch.bfloat16)
