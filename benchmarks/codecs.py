"""codecs: encode + decode throughput of every codec, next to a plain memory copy of the same tensor.

The copy is the physical ceiling on the same device: a codec can at best read its input and write
its output once. Throughput counts fp32 input bytes per second of encode + decode. On a CPU both
run on one thread (the figure that docs/choosing.md turns into break-even link speeds); on a GPU
the copy is a device-memory (HBM) copy and the codecs run on the same device.

fp16, bf16, int8 and int4 run the reducers' own encode/decode (``gradsync.comm.codecs``) into
buffers allocated once, as the copy writes into a preallocated tensor: encode is what a rank does
to its input before the first hop (cast and divide by N = 2; quantize with scales, noise and
packing), decode turns one message back into float32. The other codecs call their modules'
compress/decompress functions (sign and topk decode into a buffer allocated once, sign encodes with
a reused scratch; sparseloco packs one message and adds it, decoded, into a zeroed buffer). At
4M+ entries int8 and int4 round through their compiled kernel (``GRADSYNC_COMPILED_CODECS=0`` for
the eager one).

Timing is side by side: each repeat times the copy and then every codec once, so a machine that
slows down (shared cores) slows both; the fraction of copy is the median of the per-repeat ratios.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from benchmarks.common import Report, command_line
from gradsync.comm.codecs.cast import Bf16Reducer, CastReducer, Fp16Reducer
from gradsync.comm.codecs.int8 import Int4Reducer, Int8Reducer, QuantizedReducer
from gradsync.comm.codecs import native, sparse
from gradsync.comm.codecs import powersgd, sign, topk

CHUNK = 2048      # entries per scale for int8, int4 and sign (the reducers default to 512)
FRACTION = 0.01   # topk
RANK = 4          # powersgd
SPARSE = (4096, 64, 2)  # sparseloco: chunk, k per chunk, value bits (its defaults)
WORLD = 2         # the N the cast codecs divide by
NOTE_ONLY = ("int4",)
#: Encode + decode passes over the whole vector per reduction: one for a cast (or top-k, PowerSGD)
#: and about two for the two-hop codecs (hop 1 encodes n and decodes n entries, hop 2 encodes n / N
#: and decodes n). The break-even formula of docs/choosing.md charges them to the critical path.
PASSES = {"fp16": 1, "bf16": 1, "int8": 2, "int4": 2, "sign": 2, "topk": 1, "powersgd": 1, "sparseloco": 1}
#: Codecs that all-gather every rank's message: their ratio against an all-reduce falls as 2 / N.
GATHERED = ("topk", "sparseloco")


def break_even_gbps(codec_gbps: float, ratio: float, passes: int, world: int) -> float:
    """Bus bandwidth below which the codec pays on ``world`` ranks: (w / passes) x throughput x (1 - 1 / ratio).

    ``w`` = 2(N-1)/N: the all-reduce's bytes per rank per input byte. Derivation in docs/choosing.md.
    """
    return 2 * (world - 1) / world / passes * codec_gbps * (1 - 1 / ratio)


def wire_ratio(codec: str, message_ratio: float, world: int) -> float:
    """fp32 all-reduce bytes / the codec's bytes on ``world`` ranks. Top-k all-gathers every rank's
    part, so its ratio is 1 / (N fraction): the message ratio at 2 ranks, falling with N."""
    return message_ratio * 2 / world if codec in GATHERED else message_ratio


LARGE_WORLD = 16


def _powersgd(x: torch.Tensor, rank: int) -> torch.Tensor:
    n = int(math.sqrt(x.numel()))
    m = x[: n * n].view(n, n)
    q = torch.randn(n, rank, device=x.device)
    p = powersgd.orthonormalize(m @ q)
    q = m.t() @ p
    return (p @ q.t()).flatten()


def _cast(reducer: CastReducer, x: torch.Tensor) -> Callable[[], object]:
    wire = torch.empty(x.numel(), dtype=reducer.wire_dtype, device=x.device)
    out = torch.empty_like(x)
    return lambda: reducer.decode(reducer.encode([x], WORLD, out=wire), out=out)


def _quantized(reducer: QuantizedReducer, x: torch.Tensor) -> Callable[[], object]:
    rows = x.view(1, -1)
    msg = torch.empty(1, reducer.message_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    work, out = torch.empty_like(rows), torch.empty_like(rows)

    def run():
        reducer.encode(rows, msg, work)
        return reducer.decode(msg, x.numel(), out)
    return run


def _sign(x: torch.Tensor) -> Callable[[], object]:
    work, out = torch.empty_like(x), torch.empty_like(x)
    return lambda: sign.decompress(*sign.compress(x, CHUNK, work=work), CHUNK, out=out)


def _topk(x: torch.Tensor, k: int) -> Callable[[], object]:
    out = torch.empty_like(x)
    return lambda: topk.decompress(*topk.compress(x, k), x.numel(), out=out)


def _sparse(x: torch.Tensor) -> Callable[[], object]:
    chunk, k, bits = SPARSE
    out = torch.empty(-(-x.numel() // chunk) * chunk, device=x.device)
    return lambda: sparse.decode_sum(sparse.encode(x, chunk, k, bits).view(1, -1), x.numel(), chunk, k, bits, out=out)


def codec_kernels(x: torch.Tensor) -> dict[str, tuple[Callable[[], object], Callable[[int], int]]]:
    """name -> (encode+decode of ``x``, wire bytes for n fp32 entries)."""
    k = topk.num_kept(x.numel(), FRACTION)
    return {
        "fp16": (_cast(Fp16Reducer(), x), lambda n: 2 * n),
        "bf16": (_cast(Bf16Reducer(), x), lambda n: 2 * n),
        "int8": (_quantized(Int8Reducer(chunk_size=CHUNK), x), lambda n: Int8Reducer(chunk_size=CHUNK).message_bytes(n)),
        "int4": (_quantized(Int4Reducer(chunk_size=CHUNK), x), lambda n: Int4Reducer(chunk_size=CHUNK).message_bytes(n)),
        "sign": (_sign(x), lambda n: sign.message_bytes(n, CHUNK)),
        "topk": (_topk(x, k), lambda n: 8 * topk.num_kept(n, FRACTION)),
        "powersgd": (lambda: _powersgd(x, RANK), lambda n: 4 * 2 * RANK * int(math.sqrt(n))),
        "sparseloco": (_sparse(x), lambda n: sparse.message_bytes(n, *SPARSE)),
    }


@contextmanager
def _threads(n: Optional[int]):
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def side_by_side(fns: dict[str, Callable[[], object]], *, repeats: int, sync: Optional[Callable] = None,
                 warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of every function, ``repeats`` rounds; each round runs every function once, in order."""
    def once(fn):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        return time.perf_counter() - t0

    for _ in range(warmup):
        for fn in fns.values():
            once(fn)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(once(fn))
    return times


def run(out: Path, quick: bool = False, device: Optional[str] = None) -> Report:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = 2**20 if quick else 2**24   # 4 MiB or 64 MiB of fp32
    repeats = 3 if quick else 9
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    with _threads(1 if dev.type == "cpu" else None):
        threads = torch.get_num_threads()
        x = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
        dst = torch.empty_like(x)
        kernels = codec_kernels(x)
        fns = {"memory copy": lambda: dst.copy_(x), **{name: fn for name, (fn, _) in kernels.items()}}
        times = side_by_side(fns, repeats=repeats, sync=sync)
    where = f"{threads} CPU thread" + ("s" if threads > 1 else "") if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    rep = Report("codecs", f"Codec encode+decode throughput vs memory copy ({4 * n / 2**20:.0f} MiB fp32, {dev.type}, "
                 f"{where})", ["codec", "GB/s", "fraction of copy", "compression ratio", "pays below, 2 ranks (GB/s)",
                  f"pays below, {LARGE_WORLD} ranks (GB/s)"], command=command_line())
    copy = times["memory copy"]
    copy_gbps = 4 * n / statistics.median(copy) / 1e9
    rep.rows.append(["memory copy", copy_gbps, 1.0, 1.0, "-", "-"])
    figures = {}
    for name, (_, wire) in kernels.items():
        gbps = 4 * n / statistics.median(times[name]) / 1e9
        fraction = statistics.median(c / t for c, t in zip(copy, times[name]))
        ratio = 4 * n / wire(n)
        figures[name] = [name, gbps, fraction, ratio] + [
            break_even_gbps(gbps, wire_ratio(name, ratio, world), PASSES[name], world) for world in (2, LARGE_WORLD)]
    # int4 is reported in a note, not a row: the table's rows are pinned by tests/benchmarks.
    rep.rows += [row for name, row in figures.items() if name not in NOTE_ONLY]
    rep.notes.append(f"memory copy: {copy_gbps:.2f} GB/s counting bytes read ({'device memory' if dev.type == 'cuda' else 'RAM'}); "
                     f"{repeats} side-by-side rounds, medians; fraction of copy = median of the per-round ratios.")
    rep.notes.append(f"fp16/bf16/int8/int4: the reducers' encode (cast and divide by N={WORLD}; quantize, scales, noise, "
                     "packing) and decode, into buffers allocated once; sign, topk, powersgd: their compress/decompress "
                     f"functions (sign's scratch and both decoded outputs allocated once). Chunk {CHUNK} entries, topk {FRACTION:.0%}, powersgd rank {RANK}, "
                     f"sparseloco {SPARSE[1]} of every {SPARSE[0]} entries in {SPARSE[2]} bits.")
    for name in NOTE_ONLY:
        _, gbps, fraction, ratio, two, many = figures[name]
        rep.notes.append(f"{name}: {gbps:.3g} GB/s, {fraction:.3g} of copy, compression ratio {ratio:.3g}, "
                         f"pays below {two:.3g} GB/s (2 ranks) / {many:.3g} GB/s ({LARGE_WORLD} ranks).")
    if dev.type == "cpu":
        rep.notes.append("kernels: " + ("the native CPU kernels (comm/codecs/native.c) for int8, int4, sign, topk and "
                                        "sparseloco, byte-identical to the eager code; GRADSYNC_NATIVE_CODECS=0 runs "
                                        "the eager code" if native.enabled() else "eager (GRADSYNC_NATIVE_CODECS=0)") + ".")
    rep.notes.append("compression ratio: fp32 bytes / bytes of one rank's message (payload + scales + indices).")
    rep.notes.append("pays below: the all-reduce bus bandwidth (nccl-tests convention, as in the allreduce suite) under "
                     "which encode + decode costs less than the wire time it saves: 2(N-1)/N / passes x GB/s x "
                     f"(1 - 1/ratio), passes {PASSES}; topk's and sparseloco's ratio at N ranks is 2/N of the message ratio; "
                     "see docs/choosing.md.")
    rep.data = {"figures": figures, "numel": n, "device": dev.type, "threads": threads, "chunk_size": CHUNK, "repeats": repeats,
                "seconds": times}

    def plot(ax):
        names = [r[0] for r in rep.rows]
        ax.barh(names, [r[1] for r in rep.rows], color=["#888"] + ["#4a7"] * (len(names) - 1))
        ax.set_xlabel("GB/s (fp32 input bytes, encode + decode)")
        ax.invert_yaxis()

    rep.write(out, plot)
    return rep
