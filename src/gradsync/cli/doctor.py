"""``gradsync doctor``: what a user needs to debug a cluster, and a short all-reduce check.

    gradsync doctor                      # versions, devices, environment, a 1-process check
    gradsync doctor --devices 8          # the same on 8 local processes (through torchrun)
    torchrun --nnodes 2 ... -m gradsync.cli.main doctor    # across nodes

Secrets (``*_KEY``, ``*_TOKEN``, ``*SECRET*``, ``*PASSWORD*``) are never printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time

ENV_PATTERNS = ("NCCL_", "GLOO_", "MASTER_", "TORCHELASTIC_", "SLURM_", "CUDA_", "OMP_NUM_THREADS", "WANDB_",
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "TORCH_")
SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)", re.IGNORECASE)


def relevant_environment(env=os.environ) -> dict[str, str]:
    out = {}
    for k in sorted(env):
        if any(k == p or k.startswith(p) for p in ENV_PATTERNS):
            out[k] = "<redacted>" if SECRET.search(k) else env[k]
    return out


def report_lines() -> list[str]:
    import torch
    import torch.distributed as dist

    lines = [f"python      {platform.python_version()} ({sys.executable})",
             f"torch       {torch.__version__}"]
    try:
        import lightning

        lines.append(f"lightning   {lightning.__version__}")
    except ImportError:
        lines.append("lightning   not installed")
    cuda = torch.cuda.is_available()
    lines.append(f"cuda        {'available, ' + str(torch.version.cuda) if cuda else 'not available'}")
    if cuda:
        lines.append(f"nccl        {'.'.join(map(str, torch.cuda.nccl.version()))}")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"gpu {i}       {p.name}, {p.total_memory / 2**30:.0f} GiB")
    lines.append(f"backends    nccl={dist.is_nccl_available()} gloo={dist.is_gloo_available()} "
                 f"(gradsync uses {'nccl' if cuda else 'gloo'} by default here)")
    env = relevant_environment()
    lines.append("environment " + (", ".join(f"{k}={v}" for k, v in env.items()) or "(none of the relevant variables set)"))
    return lines


def allreduce_check(size_mb: float, accelerator: str) -> list[str]:
    """Run in every process of the group: correctness and speed of an all-reduce."""
    import torch
    import torch.distributed as dist

    # auto: NCCL when every local process has a GPU of its own; more processes than GPUs (e.g. 2 on a
    # 1-GPU machine) check gloo on CPU instead of failing on a device that does not exist.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = accelerator in ("gpu", "cuda") or (
        accelerator == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local)
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # one process, no launcher
            from gradsync.platform.launch import free_port

            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        t = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(t)
        expected = world * (world + 1) / 2
        ok = bool((t == expected).all())
        n = max(1, int(size_mb * 2**20 / 4))
        x = torch.ones(n, device=device)
        dist.all_reduce(x)  # warm-up
        if use_cuda:
            torch.cuda.synchronize()
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        if use_cuda:
            torch.cuda.synchronize()
        sec = (time.perf_counter() - t0) / reps
        algbw = n * 4 / sec / 1e9
        busbw = algbw * 2 * (world - 1) / world
        return [f"all-reduce  {world} process(es), backend {backend}: sum {'correct' if ok else 'WRONG'}; "
                f"{size_mb:g} MiB in {sec * 1e3:.1f} ms, algorithm bandwidth {algbw:.2f} GB/s, "
                f"bus bandwidth {busbw:.2f} GB/s"], ok
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gradsync doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1, help="processes on this node (through torchrun)")
    parser.add_argument("--accelerator", choices=("cpu", "gpu", "auto"), default="auto")
    parser.add_argument("--size-mb", type=float, default=16.0, help="all-reduce size for the speed check")
    args = parser.parse_args(argv)
    if args.devices < 1:
        print(f"gradsync: error: --devices {args.devices}: must be >= 1", file=sys.stderr)
        return 2
    from gradsync.platform import launch

    if args.devices > 1 and not launch.inside_launcher():
        cfg = launch.LaunchConfig(nproc_per_node=args.devices).resolved()
        return launch.run_torchrun(launch.torchrun_command(["doctor", *argv], cfg))[0]
    lines, ok = allreduce_check(args.size_mb, args.accelerator)
    if int(os.environ.get("RANK", 0)) == 0:
        print("\n".join(report_lines() + lines), flush=True)
    return 0 if ok else 1
