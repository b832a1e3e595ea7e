"""What the codecs share: flattening, per-name residual stores, shard layout, byte packing, RNG state,
and the counter-based noise of stochastic rounding.

Pure torch.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One new vector of every tensor's entries, in order, as ``dtype``."""
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def flatten_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write every tensor's entries, in order, into the front of ``out`` (converting to its dtype); ``out``.

    One pass from the inputs straight into the buffer the codec works on (a wire buffer of another
    dtype, a padded vector): no intermediate float32 copy.
    """
    pos = 0
    if tensors and all(t.dtype == out.dtype for t in tensors):
        pos = sum(t.numel() for t in tensors)
        torch.cat([t.reshape(-1) for t in tensors], out=out[:pos])
    else:
        for t in tensors:
            out[pos:pos + t.numel()].copy_(t.reshape(-1))
            pos += t.numel()
    return out


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


# ---- counter-based rounding noise ----------------------------------------------------------------
_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(z: int) -> int:
    """Steele et al.'s SplitMix64 finalizer, on Python integers (exact)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 entries in [0, 2^32) (C. Wellons' hash-prospector form).

    The multipliers are below 2^31, so every product stays below 2^63: no int64 overflow on any device.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


class RoundingNoise:
    """Uniform 16-bit noise for stochastic rounding: a counter-based hash of (seed, draw, index).

    Each :meth:`tables` call is one draw. For a message laid out as ``rows x cols`` it returns two
    short vectors ``A`` (rows) and ``B`` (cols) of uniform 16-bit integers; entry (r, c) uses
    ``A[r] ^ B[c]``, with ``A[r] = T1[r // K] ^ T2[r % K]``. Every table entry is the hash of its own
    (seed, draw, index), so any two entries of a message differ in at least one independent table
    entry: the noise of every entry is exactly uniform and any two entries' noises are independent.
    That is all stochastic rounding needs: each entry is unbiased, and rounding errors are
    uncorrelated, so the variance of any sum of decoded entries is what fully independent noise
    would give. (It is not more than pairwise independent: in one draw the noises of (r, c), (r, c'),
    (r', c), (r', c') XOR to zero, so one message's error pattern has structure; a new draw per
    message removes it on average.) Only ~2 sqrt(rows) + cols values are hashed per draw; the
    full-size noise costs one broadcast XOR, instead of one ``torch.rand`` draw per entry (~10x a
    memory copy on a CPU).

    The state is two integers, ``seed`` and ``draws``: the same seed and draw count give the same
    noise on every run and every device (integer arithmetic), which makes resume exact.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.draws = 0

    def tables(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The next draw: int32 vectors ``A`` (``rows``) and ``B`` (``cols``) of values in [0, 2^16)."""
        key = _splitmix64(_splitmix64(self.seed & _M64) ^ self.draws)
        self.draws += 1
        k2 = math.isqrt(max(rows - 1, 0)) + 1          # ceil(sqrt(rows))
        k1 = -(-rows // k2)
        idx = torch.arange(k1 + k2 + cols, dtype=torch.int64, device=device)
        h = _hash32(_hash32((idx + (key & _M32)) & _M32) ^ (key >> 32))
        bits = (h >> 16).to(torch.int32)
        t1, t2, b = bits[:k1], bits[k1:k1 + k2], bits[k1 + k2:]
        a = (t1.unsqueeze(1) ^ t2.unsqueeze(0)).flatten()[:rows]
        return a, b

    def state_dict(self) -> dict:
        return {"seed": torch.tensor(self.seed, dtype=torch.int64), "draws": torch.tensor(self.draws, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.draws = int(state["seed"]), int(state["draws"])


def rounding_noise(source: Union[RoundingNoise, torch.Generator, None]) -> RoundingNoise:
    """``source`` itself, or a :class:`RoundingNoise` seeded by one draw from a torch generator
    (torch's default generator when ``None``)."""
    if isinstance(source, RoundingNoise):
        return source
    device = source.device if isinstance(source, torch.Generator) else "cpu"
    seed = torch.randint(0, 2**62, (1,), generator=source, device=device)
    return RoundingNoise(int(seed))
