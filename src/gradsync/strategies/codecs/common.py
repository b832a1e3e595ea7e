"""What every codec shares: the hook state base, per-parameter residuals, shard layout, byte packing.

Pure torch. A codec is a DDP communication hook ``hook(state, bucket) -> Future[Tensor]`` plus a
state class. The state's dataclass fields are what users tune; runtime state (residuals, random
generators, PowerSGD matrices) is created empty and lives in :meth:`CodecState.state_dict`.

Per-bucket state is kept **per parameter**, not per bucket: DDP's first iteration uses buckets in
the reverse of registration order and then rebuilds them in the order gradients became ready (and
does so again after every resume, since the DDP wrapper is new). A residual stored as one flat
bucket-sized vector would be added to the wrong entries after such a rebuild; stored per parameter
name it always lands on the right ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from gradsync.strategies.ledger import CommLedger


@dataclass
class BucketLayout:
    """A bucket's parameters in the model's own order, with where each sits in the bucket buffer.

    Codecs compress the bucket in this *canonical* order, so chunk scales, shards and random draws
    do not depend on the order DDP happened to put parameters in (which changes when DDP rebuilds
    its buckets after the first step, and again on every resume): a resumed run then compresses
    exactly like the uninterrupted one.
    """

    keys: list  # (name, numel), canonical order
    offsets: list  # offset of each in the bucket buffer
    shapes: list

    def gather(self, buffer: torch.Tensor) -> torch.Tensor:
        """The buffer's entries in canonical order, as a new float32 vector."""
        parts = [buffer[o:o + n] for o, (_, n) in zip(self.offsets, self.keys)]
        return torch.cat(parts).to(torch.float32) if parts else buffer.new_zeros(0, dtype=torch.float32)

    def scatter(self, flat: torch.Tensor, buffer: torch.Tensor) -> None:
        """Write a canonical-order vector back into the bucket buffer."""
        pos = 0
        for o, (_, n) in zip(self.offsets, self.keys):
            buffer[o:o + n].copy_(flat[pos:pos + n])
            pos += n


@dataclass
class CodecState:
    """Base of every codec's hook state: where bytes are recorded and which group reduces."""

    ledger: CommLedger = field(default_factory=CommLedger, repr=False)
    group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    #: id(parameter) -> (position, name) in the model; set by :meth:`bind`.
    param_names: dict = field(default_factory=dict, repr=False, compare=False)

    def bind(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> "CodecState":
        """Name the model's parameters so per-parameter state survives bucket rebuilds and resume."""
        self.param_names = {id(p): (i, name) for i, (name, p) in enumerate(named_parameters)}
        return self

    def bucket_layout(self, bucket: dist.GradBucket) -> BucketLayout:
        """The bucket's parameters in canonical (model) order; unbound ones keep bucket order, last."""
        entries, offset = [], 0
        for i, p in enumerate(bucket.parameters()):
            order, name = self.param_names.get(id(p), ((1 << 40) + i, f"bucket{bucket.index()}.{i}"))
            entries.append((order, name, p.numel(), offset, p.shape))
            offset += p.numel()
        entries.sort(key=lambda e: e[0])
        return BucketLayout(keys=[(e[1], e[2]) for e in entries], offsets=[e[3] for e in entries],
                            shapes=[e[4] for e in entries])

    def bucket_keys(self, bucket: dist.GradBucket) -> list[tuple[str, int]]:
        """``(name, numel)`` of each parameter in ``bucket``, in canonical order."""
        return self.bucket_layout(bucket).keys

    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def group_rank(self) -> int:
        return dist.get_rank(self.group)

    # ---- runtime state (overridden by codecs that have any) ---------------------------------
    def state_dict(self) -> dict:
        """This rank's runtime state (CPU tensors)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    def runtime_state_names(self) -> list[str]:
        """Human names of the runtime state, for the warning when a world-size change resets it."""
        return []


class ParamStore:
    """Flat per-bucket vectors kept as one piece per parameter name (see the module docstring)."""

    def __init__(self) -> None:
        self.pieces: dict[str, torch.Tensor] = {}

    def gather(self, keys: list[tuple[str, int]], like: torch.Tensor) -> torch.Tensor:
        """The bucket-ordered flat vector (zeros where nothing is stored), float32 on ``like``'s device."""
        parts = []
        for name, numel in keys:
            piece = self.pieces.get(name)
            if piece is None or piece.numel() != numel:
                piece = torch.zeros(numel, dtype=torch.float32, device=like.device)
            parts.append(piece.to(like.device))
        return torch.cat(parts) if parts else torch.zeros(0, device=like.device)

    def scatter(self, keys: list[tuple[str, int]], flat: torch.Tensor) -> None:
        """Store ``flat`` (bucket order; entries past the bucket, e.g. padding, are ignored)."""
        offset = 0
        for name, numel in keys:
            self.pieces[name] = flat[offset:offset + numel].detach().clone()
            offset += numel

    def __len__(self) -> int:
        return len(self.pieces)

    def state_dict(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.pieces.items()}

    def load_state_dict(self, state: dict) -> None:
        self.pieces = {k: v.clone() for k, v in state.items()}


def shard_length(numel: int, world_size: int, multiple: int = 1) -> int:
    """Entries per rank when a bucket of ``numel`` is cut into ``world_size`` equal shards."""
    per = math.ceil(numel / world_size) if numel else 0
    return math.ceil(per / multiple) * multiple


def pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.numel() == length:
        return x
    out = torch.zeros(length, dtype=x.dtype, device=x.device)
    out[: x.numel()] = x
    return out


def chunked(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``x`` zero-padded to whole chunks, as a (num_chunks, chunk_size) view."""
    num_chunks = max(1, math.ceil(x.numel() / chunk_size))
    return pad_to(x, num_chunks * chunk_size).view(num_chunks, chunk_size)


def float_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 values as raw bytes (uint8), to travel in the same message as a payload."""
    return x.to(torch.float32).contiguous().view(torch.uint8)


def bytes_float(b: torch.Tensor) -> torch.Tensor:
    # clone: a slice of a byte buffer need not be 4-byte aligned for a float32 view
    return b.clone().view(torch.float32)


def make_generator(device: torch.device, seed: int, saved: Optional[torch.Tensor]) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    if saved is not None:
        g.set_state(saved)
    return g


def generator_state(g: Optional[torch.Generator], pending: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A generator's state to checkpoint (or the not-yet-applied restored one)."""
    if g is not None:
        return g.get_state().clone()
    return None if pending is None else pending.clone()


def completed(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def as_state_dict(**items: Any) -> dict:
    return {k: v for k, v in items.items() if v is not None}
