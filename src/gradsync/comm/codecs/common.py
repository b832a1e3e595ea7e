"""What the codecs share: flattening, per-name residual stores, shard layout, byte packing, RNG state.

Pure torch.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One new vector of every tensor's entries, in order, as ``dtype``."""
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut ``flat`` back into tensors shaped (and typed) like ``like``."""
    out, pos = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[pos:pos + n].view(t.shape).to(t.dtype))
        pos += n
    return out


class ParamStore:
    """Flat vectors kept as one piece per tensor name (residuals, reducer memories).

    State is keyed by name, not by position in a message: DDP rebuilds its buckets after the first
    step and again on every resume, and DiLoCo sends a different fragment each round; a piece
    stored per name always lands on the right entries.
    """

    def __init__(self) -> None:
        self.pieces: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The piece for ``name`` (zeros when absent or of another size), float32 on ``like``'s device."""
        piece = self.pieces.get(name)
        if piece is None or piece.numel() != numel:
            return torch.zeros(numel, dtype=torch.float32, device=like.device)
        return piece.to(like.device)

    def gather(self, keys: list[tuple[str, int]], like: torch.Tensor) -> torch.Tensor:
        """The pieces of ``keys`` ((name, numel) pairs) concatenated in that order."""
        parts = [self.get(name, numel, like) for name, numel in keys]
        return torch.cat(parts) if parts else torch.zeros(0, device=like.device)

    def scatter(self, keys: list[tuple[str, int]], flat: torch.Tensor) -> None:
        """Store ``flat`` (``keys`` order; entries past the last key, e.g. padding, are ignored)."""
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


def keys_of(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> list[tuple[str, int]]:
    return [(name, t.numel()) for name, t in zip(names, tensors)]


def shard_length(numel: int, world_size: int, multiple: int = 1) -> int:
    """Entries per rank when ``numel`` entries are cut into ``world_size`` equal shards."""
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
