"""Starting processes: torchrun (torch.distributed.run) on one machine; never a home-made launcher.

Inside a launcher already (torchrun's environment) gradsync runs the job in the current process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Sequence

LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def inside_launcher(env: os._Environ | dict = os.environ) -> bool:
    """True when this process was started by torchrun (or another launcher that sets its variables)."""
    return all(v in env for v in LAUNCHER_VARS)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(argv: Sequence[str], *, nproc_per_node: int, master_addr: str = "127.0.0.1",
                     master_port: int | None = None) -> list[str]:
    """The torchrun command that re-runs ``gradsync <argv>`` in ``nproc_per_node`` processes."""
    port = master_port or free_port(master_addr)
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc_per_node),
        "--master-addr", master_addr, "--master-port", str(port),
        "-m", "gradsync.cli.main", *argv,
    ]


def run_torchrun(cmd: list[str]) -> int:
    env = dict(os.environ)
    # Several processes on few cores: one thread each, or they oversubscribe the CPUs.
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130
