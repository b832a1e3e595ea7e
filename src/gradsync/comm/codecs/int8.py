"""``int8`` (and the 4-bit ``int4``): integers with a per-chunk scale and unbiased stochastic rounding.

Each chunk of ``chunk_size`` entries is sent as integers ``q`` and one float32 scale
``s = max|x|`` of the chunk; ``x ≈ q s / L`` with ``q = floor(L x / s + u)``, ``u ~ U[0, 1)`` and
``L`` levels on each side of zero (127 for 8 bits, 7 for 4). Rounding up with probability equal to
the fraction part makes the code unbiased, ``E[q s / L] = x``, with per-entry variance at most
``(s / L)^2 / 4`` (Alistarh et al., QSGD, NeurIPS 2017, with a chunk-wise max norm).

Integers with different scales cannot be summed on the wire, so the mean is computed in two hops
that both carry the narrow integers — the bandwidth-optimal shape of a ring all-reduce:

1. all-to-all: the input is cut into N shards; rank j receives every rank's quantized shard j,
   dequantizes and sums them, and quantizes the sum again;
2. all-gather: every rank receives every re-quantized shard and decodes the whole vector.

Every rank decodes the same bytes, so all ranks get identical means.

Bytes for n entries, shard length L = ceil(n / N) (even for 4 bits), C = ceil(L / chunk_size)
chunks per shard, M = L b/8 + 4C bytes per shard message (b bits per entry): all-to-all
(N-1)M + all-gather (N-1)M = 2(N-1)M, against 2(N-1)/N x 4n for fp32 — a ratio of about
(32 / b) / (1 + 32 / (b chunk_size)): 3.97 for int8 and 7.88 for int4 at the default chunk of 512.

How it stays fast (a handful of passes over memory, whatever the number of shards and chunks):

* the noise is :class:`~gradsync.comm.codecs.common.RoundingNoise` (a counter-based hash of seed,
  draw and index), built as the float32 bit pattern of ``2^e + u`` with ``2^e > L`` (128 for int8,
  8 for int4) by one broadcast XOR of two short tables, so ``v = x L / s + 2^e + u`` is one fused
  multiply-add and lies in [1, 2^(e+1)): float-to-integer conversion truncates, which for positive
  ``v`` is the floor. No ``torch.rand``, no separate floor, no temporary per shard or per chunk;
  int4's codes (1..15) even take the faster float-to-int8 conversion;
* the sent scale is ``max|x| (1 + 2^-21)``: that headroom keeps ``|x| L / s <= L`` through float
  rounding, so no clamp is needed;
* the division by N is applied to the (short) scales, not to the entries.

The noise has 16 bits per entry: ``E[q s / L]`` equals ``x`` to within 2^-16 of a level (float32's
own resolution at these magnitudes; ``torch.rand`` + floor, used before, was within about 2^-17).
"""

from __future__ import annotations

import math
import warnings
from typing import ClassVar, Hashable, Optional, Union

import torch

from gradsync.comm.codecs import fused, native
from gradsync.comm.codecs.common import RoundingNoise, flatten_into, rounding_noise, shard_length, unflatten
from gradsync.comm.futures import Reduction
from gradsync.comm.reducer import Reducer
from gradsync.errors import check

LEVELS = 127
#: Relative headroom of the sent scale over max|x| (see the module docstring).
HEADROOM = 1 + 2**-21
#: Smallest scale sent: below ~127 / 3.4e38 the factor L / s would overflow float32.
TINY_SCALE = 2.0**-120

Noise = Union[RoundingNoise, torch.Generator, None]


def _chunk_views(m: torch.Tensor, chunk_size: int) -> list[tuple[torch.Tensor, slice]]:
    """(rows, chunks, entries) views of ``m`` (rows, length): its full chunks and its partial last
    chunk, each with the slice of chunk indices it covers. Views, never copies: writes land in ``m``."""
    rows, length = m.shape
    full = length // chunk_size
    parts = []
    if full:
        parts.append((m[:, :full * chunk_size].view(rows, full, chunk_size), slice(0, full)))
    if length > full * chunk_size:
        parts.append((m[:, full * chunk_size:].unsqueeze(1), slice(full, full + 1)))
    return parts


def chunk_scales_eager(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """max|x| of every chunk of every row of ``x`` (rows, length): (rows, chunks), float32."""
    # amax and amin read x twice but run at memory speed; abs() would write a full temporary and
    # aminmax over a dimension is not vectorized on CPU.
    parts = [torch.maximum(v.amax(dim=2), v.amin(dim=2).neg_()) for v, _ in _chunk_views(x, chunk_size)]
    return torch.cat(parts, dim=1) if parts else x.new_zeros(x.shape[0], 0)


def _probe_inputs() -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, generator=g)
    x[0, :300] = 0
    x[1, 5] = -1e30
    return [(x, 64), (x, 1000), (x, 2048), (x[:, :8].contiguous(), 8)]


def _probe_scales() -> bool:
    fn = native.raw("absmax_chunks")
    return all(torch.equal(_chunk_scales_native(fn, x, c), chunk_scales_eager(x, c)) for x, c in _probe_inputs())


def _chunk_scales_native(fn, x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    rows, length = x.shape
    out = torch.empty(rows, math.ceil(length / chunk_size), dtype=torch.float32)
    fn(x.data_ptr(), rows, length, chunk_size, out.data_ptr())
    return out


def chunk_scales(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """:func:`chunk_scales_eager`; on CPU one native pass (``native.c``)."""
    if x.numel() and x.dtype == torch.float32 and native.usable(x):
        fn = native.kernel("absmax_chunks", _probe_scales)
        if fn is not None:
            return _chunk_scales_native(fn, x, chunk_size)
    return chunk_scales_eager(x, chunk_size)


def encode_codes(x: torch.Tensor, chunk_size: int, levels: int, noise: RoundingNoise, codes: torch.Tensor,
                 work: Optional[torch.Tensor] = None, nibbles: bool = False) -> torch.Tensor:
    """Stochastically round every row of ``x`` (rows, length; float32, any row stride).

    Writes ``q + 2^e`` (``2^e`` the power of two just above ``levels``: 128 for 8 bits, 8 for 4)
    into ``codes`` (shaped like ``x``; uint8, or int8 when every code is below 128) and returns the
    scales (rows, chunks) they are meant with: ``x ≈ q s / levels``. ``work``: float32 scratch of
    at least ``x.numel()`` entries (allocated when absent). One noise draw per call. ``nibbles``
    (int4, even length): ``codes`` is the packed payload (rows, length / 2), entry i in the high
    nibble of byte i and entry i + length / 2 in its low nibble.
    """
    e = levels.bit_length()
    if e > 7:
        raise ValueError(f"levels={levels}: at most 127 (8 bits per entry)")
    rows, length = x.shape
    scales = chunk_scales(x, chunk_size).mul_(HEADROOM).clamp_(min=TINY_SCALE)
    inv = levels / scales
    a, b = noise.tables(scales.numel(), chunk_size, x.device)
    # float32 bits of 2^e + u, u on the 2^-16 grid (at its midpoints where float32 resolves them)
    shift = 7 - e
    base = ((127 + e) << 23) | ((1 << (6 - e)) if e < 7 else 0)
    a = ((a << shift) | base).view(rows, -1)
    b = b << shift
    if work is None:
        work = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
    if native.rows_usable(x) and native.rows_usable(codes) and x.dtype == torch.float32 and codes.element_size() == 1:
        fn = native.kernel("quant_round", _probe_round)
        if fn is not None:  # one pass, the same bytes
            inv, a, b = inv.contiguous(), a.contiguous(), b.contiguous()
            fn(x.data_ptr(), rows, length, x.stride(0), chunk_size, inv.data_ptr(), a.data_ptr(), b.data_ptr(),
               codes.data_ptr(), codes.stride(0), int(nibbles))
            return scales
    if nibbles:
        payload, codes = codes, torch.empty(rows, length, dtype=torch.int8, device=x.device)
    w = work.view(-1)[: x.numel()].view(rows, length)
    for (xv, chunks), (wv, _), (cv, _) in zip(_chunk_views(x, chunk_size), _chunk_views(w, chunk_size),
                                              _chunk_views(codes, chunk_size)):
        if fused.wanted(xv.numel()):  # one pass, the same bytes (see comm/codecs/fused.py)
            cv.copy_(fused.round_codes(xv, inv[:, chunks], a[:, chunks], b[: xv.shape[2]]))
            continue
        torch.bitwise_xor(a[:, chunks].unsqueeze(2), b[: wv.shape[2]], out=wv.view(torch.int32))
        torch.addcmul(wv, xv, inv[:, chunks].unsqueeze(2), out=wv)
        cv.copy_(wv)  # truncation == floor: every entry is >= 1
    if nibbles:
        half = length // 2
        u = codes.view(torch.uint8)
        torch.add(u[:, half:], u[:, :half], alpha=16, out=payload)
    return scales


def _probe_round() -> bool:
    """The native rounding against the eager one (``addcmul``) on inputs a rounding away from a code
    boundary (:func:`~gradsync.comm.codecs.fused.probe_inputs`: where one rounding and two differ)."""
    fn = native.raw("quant_round")
    x, inv, a, b = fused.probe_inputs(torch.device("cpu"))
    rows, chunks, chunk = x.shape
    got = torch.empty(rows, chunks * chunk, dtype=torch.uint8)
    fn(x.data_ptr(), rows, chunks * chunk, chunks * chunk, chunk, inv.contiguous().data_ptr(),
       a.contiguous().data_ptr(), b.data_ptr(), got.data_ptr(), chunks * chunk, 0)
    return torch.equal(got.view(rows, chunks, chunk), fused.round_codes_eager(x, inv, a, b))


def decode_codes(codes: torch.Tensor, scales: torch.Tensor, chunk_size: int, levels: int,
                 out: torch.Tensor) -> torch.Tensor:
    """``q * scale / levels`` for every row of ``codes`` (integers ``q``, rows x length), into ``out`` (float32)."""
    # A divisor on the device, not a Python number: CUDA divides by a host scalar as a multiply by its
    # reciprocal, one rounding off the CPU's quotient; a device tensor gets the correctly rounded quotient.
    step = scales / scales.new_tensor(float(levels))
    if codes.numel() and codes.dtype == torch.int8 and native.rows_usable(codes) and native.usable(step, out):
        fn = native.kernel("int8_decode", _probe_decode)
        if fn is not None:
            fn(codes.data_ptr(), codes.shape[0], codes.shape[1], codes.stride(0), chunk_size, step.data_ptr(),
               out.data_ptr())
            return out
    return _decode_codes_eager(codes, step, chunk_size, out)


def _decode_codes_eager(codes: torch.Tensor, step: torch.Tensor, chunk_size: int, out: torch.Tensor) -> torch.Tensor:
    out.copy_(codes)
    for ov, chunks in _chunk_views(out, chunk_size):
        ov.mul_(step[:, chunks].unsqueeze(2))
    return out


def _probe_decode() -> bool:
    fn = native.raw("int8_decode")
    for x, c in _probe_inputs():
        codes = x.mul(40).clamp(-127, 127).to(torch.int8)
        step = torch.rand(x.shape[0], math.ceil(x.shape[1] / c), generator=torch.Generator().manual_seed(1))
        got, want = torch.empty_like(x), torch.empty_like(x)
        fn(codes.data_ptr(), codes.shape[0], codes.shape[1], codes.stride(0), c, step.data_ptr(), got.data_ptr())
        if not torch.equal(got, _decode_codes_eager(codes, step, c, want)):
            return False
    return True


def _probe_int4() -> bool:
    fn = native.raw("int4_decode")
    g = torch.Generator().manual_seed(2)
    for rows, shard, c in ((2, 1000, 64), (1, 16, 2048), (3, 40, 8)):
        msgs = torch.randint(0, 256, (rows, shard // 2), generator=g, dtype=torch.uint8)
        step = torch.rand(rows, math.ceil(shard / c), generator=g)
        got, want = torch.empty(rows, shard), torch.empty(rows, shard)
        fn(msgs.data_ptr(), rows, shard // 2, shard // 2, c, step.data_ptr(), got.data_ptr())
        if not torch.equal(got, _decode_codes_eager(_int4_codes(msgs, shard), step, c, want)):
            return False
    return True


def _int4_codes(payload: torch.Tensor, shard: int) -> torch.Tensor:
    """The int8 codes q of an int4 payload (rows, shard / 2)."""
    pay = payload.shape[1]
    codes = torch.empty(payload.shape[0], shard, dtype=torch.uint8, device=payload.device)
    torch.bitwise_right_shift(payload, 4, out=codes[:, :pay])
    torch.bitwise_and(payload, 0x0F, out=codes[:, pay:])
    return codes.sub_(8).view(torch.int8)  # wraps: q + 8 -> q in two's complement


def quantize(x: torch.Tensor, chunk_size: int, generator: Noise = None, levels: int = LEVELS, *,
             out: Optional[torch.Tensor] = None, work: Optional[torch.Tensor] = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastically round ``x`` (1-d) to integers in [-levels, levels] with one scale per chunk.

    ``generator``: a :class:`~gradsync.comm.codecs.common.RoundingNoise` (one draw is used), or a
    torch generator that seeds one (torch's default generator when ``None``). ``out`` (int8, like
    ``x``) and ``work`` (float32 scratch, as many entries) reuse buffers. Returns ``(q, scales)``.
    """
    n = x.numel()
    q = torch.empty(n, dtype=torch.int8, device=x.device) if out is None else out
    codes = q.view(torch.uint8).view(1, n)
    scales = encode_codes(x.reshape(1, n).to(torch.float32), chunk_size, levels, rounding_noise(generator),
                          codes, work)
    codes.sub_(1 << levels.bit_length())  # wraps: q + 2^e -> q in two's complement
    return q, scales.view(-1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, chunk_size: int, levels: int = LEVELS, *,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    n = q.numel()
    out = torch.empty(n, dtype=torch.float32, device=q.device) if out is None else out
    decode_codes(q.view(1, n), scales.view(1, -1), chunk_size, levels, out.view(1, n))
    return out


def scales_of(msgs: torch.Tensor, payload_bytes: int) -> torch.Tensor:
    """The float32 scales of every message row (a copy: a slice of a byte buffer need not be
    4-byte aligned for a float32 view)."""
    out = torch.empty(msgs.shape[0], msgs.shape[1] - payload_bytes, dtype=torch.uint8, device=msgs.device)
    return out.copy_(msgs[:, payload_bytes:]).view(torch.float32)


def message_bytes(shard: int, chunk_size: int, bits: int = 8) -> int:
    """Bytes of one quantized shard of ``shard`` entries: payload plus float32 scales."""
    return shard * bits // 8 + 4 * math.ceil(shard / chunk_size)


class QuantizedReducer(Reducer):
    """Two-hop quantized mean (all-to-all, then all-gather) with stochastic rounding."""

    lossy = True
    bits: ClassVar[int] = 8

    def __init__(self, *, chunk_size: int = 512, seed: int = 0, **kwargs) -> None:
        """
        Args:
            chunk_size: entries that share one scale, >= 8. Smaller chunks follow the values' local
                magnitude more closely (less rounding noise) and cost 4 bytes of scale per chunk.
            seed: seed of the rounding noise; each rank draws from ``seed + rank``.
        """
        check(isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 8,
              "chunk_size", chunk_size, "must be an integer >= 8", "e.g. --strategy.chunk_size 512")
        super().__init__(**kwargs)
        self.chunk_size, self.seed = chunk_size, int(seed)
        self.levels = 2 ** (self.bits - 1) - 1
        self._noise: Optional[RoundingNoise] = None
        self._restored_noise: Optional[dict] = None

    def options(self) -> dict:
        return {"chunk_size": self.chunk_size, "seed": self.seed}

    def noise(self) -> RoundingNoise:
        """This rank's rounding noise: seed ``seed + rank`` (the rank known once the group is)."""
        if self._noise is None:
            self._noise = RoundingNoise(self.seed + self.group_rank())
            if self._restored_noise is not None:
                self._noise.load_state_dict(self._restored_noise)
                self._restored_noise = None
        return self._noise

    def state_dict(self) -> dict:
        if self._noise is not None:
            return {"noise": self._noise.state_dict()}
        return {} if self._restored_noise is None else {"noise": dict(self._restored_noise)}

    def load_state_dict(self, state: dict) -> None:
        self._noise, self._restored_noise = None, state.get("noise")
        if self._restored_noise is None and "generator" in state:
            warnings.warn(f"{self.codec}: the checkpoint holds the stochastic-rounding state of an older gradsync "
                          "(a torch generator); the rounding noise restarts from --strategy.seed", stacklevel=2)

    def runtime_state_names(self) -> list[str]:
        return ["stochastic-rounding noise counter"]

    # ---- messages: one row per shard, [payload | float32 scales] -------------------------------
    def payload_bytes(self, shard: int) -> int:
        return shard * self.bits // 8

    def message_bytes(self, shard: int) -> int:
        return message_bytes(shard, self.chunk_size, self.bits)

    def codes_buffer(self, rows: int, shard: int, device: torch.device) -> Optional[torch.Tensor]:
        """Where :func:`encode_codes` writes; ``None``: straight into the payload (int8)."""
        return None

    def write_payload(self, codes: Optional[torch.Tensor], payload: torch.Tensor) -> None:
        """Turn the codes (``q + 2^e``) into the wire payload (``codes`` is ``None`` when they are in it)."""
        payload.sub_(128)  # wraps: q + 128 -> q in two's complement

    def encode(self, x: torch.Tensor, msgs: torch.Tensor, work: torch.Tensor, divisor: float = 1.0) -> None:
        """Quantize every row of ``x`` (rows, shard) into the messages ``msgs`` (rows, message bytes),
        with scales divided by ``divisor``."""
        rows, shard = x.shape
        payload = msgs[:, : self.payload_bytes(shard)]
        codes = self.codes_buffer(rows, shard, x.device)
        scales = encode_codes(x, self.chunk_size, self.levels, self.noise(), payload if codes is None else codes, work,
                              nibbles=self.bits == 4)
        if divisor != 1:
            scales.div_(scales.new_tensor(float(divisor)))  # correctly rounded on CUDA too (see decode_codes)
        self.write_payload(codes, payload)
        msgs[:, payload.shape[1]:].copy_(scales.view(torch.uint8))

    def decode(self, msgs: torch.Tensor, shard: int, out: torch.Tensor) -> torch.Tensor:
        """Decode every row of ``msgs`` into ``out`` (rows, shard) float32."""
        pay = self.payload_bytes(shard)
        scales = scales_of(msgs, pay)
        return decode_codes(msgs[:, :pay].view(torch.int8), scales, self.chunk_size, self.levels, out)

    # ---- the reduction --------------------------------------------------------------------------
    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        world = self.world_size()
        n = sum(t.numel() for t in tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        shard = shard_length(n, world, multiple=8 // self.bits)
        x = torch.empty(world * shard, dtype=torch.float32, device=device)
        flatten_into(tensors, x)[n:].zero_()
        x = x.view(world, shard)
        msg = self.message_bytes(shard)
        # one float32 buffer: encoding scratch, then the decoded shards of hop 1, then hop 2's scratch
        work = torch.empty(world, shard, dtype=torch.float32, device=device)

        # Hop 1 (all-to-all): rank j gets every rank's quantized shard j and sums the decoded values.
        # The input is divided by N through the scales.
        send = torch.empty(world, msg, dtype=torch.uint8, device=device)
        self.encode(x, send, work, divisor=world)
        sent = None
        if self.need_sent:
            mine = self.decode(send, shard, x).view(-1)[:n].mul_(world)  # x is free: reuse it
            sent = unflatten(mine, tensors)
        recv = torch.empty_like(send)
        yield self.ledger.all_to_all_single(recv.view(-1), send.view(-1), **self.account(sync))
        total = self.decode(recv, shard, work).sum(dim=0, keepdim=True)

        # Hop 2 (all-gather): the re-quantized sums. Even this rank decodes its own shard from the
        # bytes it sent, so every rank ends with bit-identical means.
        own = torch.empty(1, msg, dtype=torch.uint8, device=device)
        self.encode(total, own, work)
        gathered = torch.empty(world * msg, dtype=torch.uint8, device=device)
        gathered = yield self.ledger.all_gather_single(gathered, own.view(-1), **self.account(sync))
        out = torch.empty(world, shard, dtype=torch.float32, device=device)
        self.decode(gathered.view(world, msg), shard, out)
        return unflatten(out.view(-1)[:n], tensors), sent


class Int8Reducer(QuantizedReducer):
    """``int8``: 8-bit integers, 127 levels a side, per-chunk scale (~4x fewer bytes)."""

    codec = "int8"
    bits = 8


class Int4Reducer(QuantizedReducer):
    """``int4``: 4-bit integers, 7 levels a side, two per byte, per-chunk scale (~8x fewer bytes).

    The 4-bit communication of Streaming DiLoCo (Douillard et al. 2025) and of INTELLECT-style
    pseudo-gradient compression; meant for DiLoCo's pseudo-gradients with error feedback, where
    rounding error is carried to the next round. As a per-step gradient codec it is noisy.

    Wire payload of a shard of L entries: byte i holds ``q + 8`` (1..15) of entry i in its high
    nibble and of entry i + L/2 in its low nibble, so packing and unpacking work on two
    contiguous halves instead of every other entry.
    """

    codec = "int4"
    bits = 4

    def write_payload(self, codes: Optional[torch.Tensor], payload: torch.Tensor) -> None:
        pass  # encode_codes packed the nibbles into the payload

    def decode(self, msgs: torch.Tensor, shard: int, out: torch.Tensor) -> torch.Tensor:
        pay = self.payload_bytes(shard)
        payload = msgs[:, :pay]
        scales = scales_of(msgs, pay)
        if payload.numel() and native.rows_usable(payload) and native.usable(out):
            fn = native.kernel("int4_decode", _probe_int4)
            if fn is not None:
                step = scales / scales.new_tensor(float(self.levels))
                fn(payload.data_ptr(), msgs.shape[0], pay, payload.stride(0), self.chunk_size, step.data_ptr(),
                   out.data_ptr())
                return out
        return decode_codes(_int4_codes(payload, shard), scales, self.chunk_size, self.levels, out)
