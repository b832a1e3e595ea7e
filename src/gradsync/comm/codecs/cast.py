"""``fp16`` and ``bf16``: cast to half precision, all-reduce, cast back.

Bytes: 2(N-1)/N x 2 bytes per entry (compression ratio 2).

* ``fp16`` keeps 11 significant bits and a range of about 6e-8 .. 65504: entries below ~6e-8
  flush to zero and entries above overflow. Use it when values are well scaled (most fp32
  training); the same as torch's ``default_hooks.fp16_compress_hook``.
* ``bf16`` keeps fp32's range (no overflow, no flush to zero) with 8 significant bits, ~0.4%
  relative error per entry. It works on gloo as well as NCCL (torch's ``bf16_compress_hook``
  refuses gloo).

The message is each entry rounded to the wire type, then divided by N in the wire type (as
torch's hooks do). The inputs are copied straight into the wire buffer (one pass, no float32
intermediate) and the sum is cast back into one new float32 vector: the two casts are the only
passes over the entries, each at about memory-copy speed.
"""

from __future__ import annotations

from typing import ClassVar, Hashable, Optional

import torch

from gradsync.comm.codecs.common import flatten_into, unflatten
from gradsync.comm.futures import Reduction
from gradsync.comm.reducer import Reducer


class CastReducer(Reducer):
    """Mean computed in a narrower float type on the wire."""

    lossy = True
    wire_dtype: ClassVar[torch.dtype] = torch.float16

    def encode(self, tensors: list[torch.Tensor], world: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The message: every entry rounded to the wire type, then divided by ``world`` in it.

        ``out``: a wire-typed buffer of all the entries to reuse (allocated when absent)."""
        n = sum(t.numel() for t in tensors)
        if out is None:
            device = tensors[0].device if tensors else torch.device("cpu")
            out = torch.empty(n, dtype=self.wire_dtype, device=device)
        wire = flatten_into(tensors, out)
        return wire.div_(world)

    def decode(self, wire: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The message back in float32 (into ``out`` when given)."""
        return wire.to(torch.float32) if out is None else out.copy_(wire)

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        world = self.world_size()
        wire = self.encode(tensors, world)
        sent = unflatten(self.decode(wire).mul_(world), tensors) if self.need_sent else None
        summed = yield self.ledger.all_reduce(wire, **self.account(sync))
        return unflatten(self.decode(summed), tensors), sent


class Fp16Reducer(CastReducer):
    """``fp16``: IEEE half precision on the wire (2x fewer bytes)."""

    codec = "fp16"
    wire_dtype = torch.float16


class Bf16Reducer(CastReducer):
    """``bf16``: bfloat16 on the wire (2x fewer bytes, fp32's range)."""

    codec = "bf16"
    wire_dtype = torch.bfloat16
