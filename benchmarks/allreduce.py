"""allreduce: an nccl-tests-style sweep of message sizes, raw ``all_reduce`` against gradsync's sync path.

For each size S both paths run alternately on the same process group: the raw collective, and what
the ``sync`` strategy's hook does (all-reduce through the ledger, wait on the future; the mean's 1/N
is folded into the loss before backward, so the hook does not divide).
Algorithm bandwidth = S / time; bus bandwidth = algbw * 2(N-1)/N (the nccl-tests convention), which
is what one rank's link carries and is comparable across N.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import Report, command_line


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out: str, backend: str) -> None:
    from gradsync.comm.ledger import CommLedger

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    ledger = CommLedger(world_size=world)
    sync = (lambda: torch.cuda.synchronize()) if backend == "nccl" else (lambda: None)
    results = []
    for size in sizes:
        t = torch.ones(size // 4, device=dev)

        def raw():
            dist.all_reduce(t)

        def gradsync_path():
            ledger.all_reduce(t, async_op=True).wait()

        times = {"raw": [], "sync": []}
        for fn in (raw, gradsync_path):  # warm-up
            fn()
        for _ in range(repeats):
            for name, fn in (("raw", raw), ("sync", gradsync_path)):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
        results.append({"bytes": size, **{k: statistics.median(v) for k, v in times.items()}})
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def sweep(world: int, sizes: list[int], repeats: int, backend: str, tmp: Path) -> list[dict]:
    out = str(tmp / "allreduce_raw.pt")
    mp.start_processes(_worker, args=(world, _port(), sizes, repeats, out, backend), nprocs=world,
                       start_method="fork" if backend == "gloo" else "spawn", join=True)
    return torch.load(out, weights_only=False)


def run(out: Path, quick: bool = False, world: int = 2, backend: str = "") -> Report:
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        world = min(world, torch.cuda.device_count())
    top = 4 * 2**20 if quick else 256 * 2**20
    sizes = [2**k for k in range(10, top.bit_length()) if 2**k <= top][:: 1 if quick else 2]
    repeats = 3 if quick else 7
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = sweep(world, sizes, repeats, backend, Path(tmp))
    factor = 2 * (world - 1) / world if world > 1 else 1.0
    rep = Report("allreduce", f"All-reduce sweep, {world} process(es), {backend}",
                 ["size", "raw ms", "sync path ms", "raw busbw GB/s", "sync busbw GB/s", "sync / raw throughput"],
                 command=command_line())
    for r in results:
        size = r["bytes"]
        label = f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"
        raw_bw = size / r["raw"] / 1e9 * factor
        sync_bw = size / r["sync"] / 1e9 * factor
        rep.rows.append([label, r["raw"] * 1e3, r["sync"] * 1e3, raw_bw, sync_bw, r["raw"] / r["sync"]])
    rep.notes.append("median of alternating runs; bus bandwidth = size/time x 2(N-1)/N (nccl-tests convention).")
    if world == 1:
        rep.notes.append("one process (NCCL takes one GPU per rank and this machine has one): an all-reduce over one "
                         "rank moves no bytes, so the times are the call's fixed cost and the bandwidth columns are "
                         "size / that cost, not a link figure.")
    if backend == "gloo":
        rep.notes.append("link: loopback between processes on one machine; MACHINE-NOTES measured ~1.16 GB/s "
                         "algorithm bandwidth for 100 MB on this kind of machine.")
    rep.data = {"world_size": world, "backend": backend, "results": results}

    def plot(ax):
        xs = [r["bytes"] for r in results]
        ax.plot(xs, [row[3] for row in rep.rows], "o-", label="raw all_reduce")
        ax.plot(xs, [row[4] for row in rep.rows], "s--", label="gradsync sync path")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.legend()

    rep.write(out, plot)
    return rep
