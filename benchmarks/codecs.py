"""codecs: encode + decode throughput of every codec, next to a plain memory copy of the same tensor.

The copy is the physical ceiling on the same device: a codec can at best read its input and write
its output once. Throughput counts fp32 input bytes per second of encode + decode.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks.common import Report, command_line, time_it
from gradsync.strategies.codecs import int8, powersgd, sign, topk


def _powersgd(x: torch.Tensor, rank: int) -> torch.Tensor:
    n = int(math.sqrt(x.numel()))
    m = x[: n * n].view(n, n)
    q = torch.randn(n, rank, device=x.device)
    p = powersgd.orthonormalize(m @ q)
    q = m.t() @ p
    return (p @ q.t()).flatten()


def codec_kernels(chunk: int = 2048, fraction: float = 0.01, rank: int = 4) -> dict:
    """name -> (encode+decode function of x, wire bytes for n fp32 entries)."""
    g = torch.Generator().manual_seed(0)
    return {
        "fp16": (lambda x: x.to(torch.float16).to(torch.float32), lambda n: 2 * n),
        "bf16": (lambda x: x.to(torch.bfloat16).to(torch.float32), lambda n: 2 * n),
        "int8": (lambda x: int8.dequantize(*int8.quantize(x, chunk, g), chunk), lambda n: int8.message_bytes(n, chunk)),
        "sign": (lambda x: sign.decompress(*sign.compress(x, chunk), chunk), lambda n: sign.message_bytes(n, chunk)),
        "topk": (lambda x: topk.decompress(*topk.compress(x, topk.num_kept(x.numel(), fraction)), x.numel()),
                 lambda n: 8 * topk.num_kept(n, fraction)),
        "powersgd": (lambda x: _powersgd(x, rank),
                     lambda n: 4 * 2 * rank * int(math.sqrt(n))),
    }


def run(out: Path, quick: bool = False, device: str = "cpu") -> Report:
    n = 2**20 if quick else 2**24   # 4 MiB or 64 MiB of fp32
    dev = torch.device(device)
    x = torch.randn(n, device=dev)
    dst = torch.empty_like(x)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    repeats = 3 if quick else 7
    copy_s = time_it(lambda: dst.copy_(x), repeats=repeats, sync=sync)
    copy_gbps = 4 * n / copy_s / 1e9
    rep = Report("codecs", f"Codec encode+decode throughput vs memory copy ({4 * n / 2**20:.0f} MiB fp32, {dev.type})",
                 ["codec", "GB/s", "fraction of copy", "compression ratio"], command=command_line())
    rep.rows.append(["memory copy", copy_gbps, 1.0, 1.0])
    for name, (fn, wire) in codec_kernels().items():
        s = time_it(lambda: fn(x), repeats=repeats, sync=sync)
        gbps = 4 * n / s / 1e9
        rep.rows.append([name, gbps, gbps / copy_gbps, 4 * n / wire(n)])
    rep.notes.append(f"memory copy: {copy_gbps:.2f} GB/s counting bytes read; median of {repeats} runs each; "
                     f"{torch.get_num_threads()} CPU thread(s).")
    rep.notes.append("compression ratio: fp32 bytes / bytes of one rank's message (payload + scales + indices).")
    rep.data = {"numel": n, "device": dev.type}

    def plot(ax):
        names = [r[0] for r in rep.rows]
        ax.barh(names, [r[1] for r in rep.rows], color=["#888"] + ["#4a7"] * (len(names) - 1))
        ax.set_xlabel("GB/s (fp32 input bytes, encode + decode)")
        ax.invert_yaxis()

    rep.write(out, plot)
    return rep
