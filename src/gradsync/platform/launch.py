"""Starting processes: torchrun (``torch.distributed.run``) or SLURM's ``srun``; never a home-made launcher.

* Outside any launcher, ``gradsync fit --devices N [--nnodes M --node-rank R ...]`` re-runs itself
  under torchrun's elastic agent on this node.
* Inside torchrun (its variables are set) or inside ``srun`` with one task per device, gradsync
  runs the job in the current process and lets Lightning read the environment.

Precedence of every launch setting: flag > environment variable > default. A single-node run
rendezvouses on 127.0.0.1.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
DEFAULT_PORT = 29500


def inside_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    return all(v in env for v in TORCHRUN_VARS)


def inside_srun(env: Mapping[str, str] = os.environ) -> bool:
    """True inside an ``srun`` job step (not merely inside an ``sbatch`` allocation's batch script)."""
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def inside_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """True when a launcher (torchrun or srun) already started this process: don't launch again."""
    return inside_torchrun(env) or inside_srun(env)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,09],cpu1`` -> ``gpu03``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


@dataclass(frozen=True)
class SlurmTask:
    """What one ``srun`` task is in torch.distributed terms."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int


def slurm_task(env: Mapping[str, str] = os.environ, master_port: Optional[int] = None) -> SlurmTask:
    """Map SLURM's variables to ranks and the rendezvous address (first host of the node list).

    The port is the flag's, else ``MASTER_PORT``, else derived from the job id so that every task
    of the job agrees on it without talking.
    """
    # the step's own variables first: a step may run on part of the allocation (one replica group's node)
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    per_node = (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
                or str(world // nodes))
    port = master_port or (int(env["MASTER_PORT"]) if "MASTER_PORT" in env
                           else 15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return SlurmTask(
        rank=int(env["SLURM_PROCID"]),
        local_rank=int(env["SLURM_LOCALID"]),
        world_size=world,
        local_world_size=int(re.match(r"\d+", per_node).group()),
        node_rank=int(env.get("SLURM_NODEID", 0)),
        num_nodes=nodes,
        master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                                         or env["SLURM_NODELIST"]),
        master_port=port,
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LaunchConfig:
    """torchrun settings; ``None`` means "from the environment, else the default"."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    max_restarts: int = 0
    rdzv_backend: str = "static"
    rdzv_id: Optional[str] = None
    timeout: Optional[float] = None  #: seconds a node waits for its peers at rendezvous

    def resolved(self, env: Mapping[str, str] = os.environ) -> "LaunchConfig":
        addr = self.master_addr or env.get("MASTER_ADDR") or "127.0.0.1"
        port = self.master_port or (int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None)
        if port is None:
            # one node: any free port; several: they must agree without talking, so a fixed one
            port = free_port(addr) if self.nnodes == 1 and addr in ("127.0.0.1", "localhost") else DEFAULT_PORT
        node_rank = self.node_rank if self.node_rank is not None else int(env.get("NODE_RANK", 0))
        rdzv_id = self.rdzv_id or env.get("SLURM_JOB_ID") or "gradsync"
        return LaunchConfig(self.nproc_per_node, self.nnodes, node_rank, addr, port, self.max_restarts,
                            self.rdzv_backend, rdzv_id, self.timeout)


def torchrun_args(cfg: LaunchConfig, *, node_rank: Optional[int] = None) -> list[str]:
    """torchrun's own arguments for ``cfg`` (already resolved)."""
    args = ["--nnodes", str(cfg.nnodes), "--nproc-per-node", str(cfg.nproc_per_node),
            "--max-restarts", str(cfg.max_restarts)]
    if cfg.rdzv_backend == "static":
        args += ["--node-rank", str(cfg.node_rank if node_rank is None else node_rank),
                 "--master-addr", str(cfg.master_addr), "--master-port", str(cfg.master_port)]
    else:
        args += ["--rdzv-backend", cfg.rdzv_backend, "--rdzv-endpoint", f"{cfg.master_addr}:{cfg.master_port}",
                 "--rdzv-id", str(cfg.rdzv_id)]
    if cfg.timeout:
        # a peer that never arrives fails the rendezvous after this long instead of waiting forever
        key = "timeout" if cfg.rdzv_backend == "static" else "join_timeout"
        args += ["--rdzv-conf", f"{key}={int(cfg.timeout)}"]
    return args


def torchrun_command(argv: Sequence[str], cfg: LaunchConfig, *, python: Optional[str] = None,
                     node_rank: Optional[int] = None) -> list[str]:
    """The command that re-runs ``gradsync <argv>`` under torchrun on one node (with this interpreter,
    ``sys.executable`` when it is called, unless ``python`` is given)."""
    return [python or sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg, node_rank=node_rank),
            "-m", "gradsync.cli.main", *argv]


LAUNCH_FLAGS = ("--print-launch", "--print_launch")


def print_launch(argv: Sequence[str], cfg: LaunchConfig, fault_tolerance: Any = None) -> str:
    """Copy-paste commands: one torchrun line per node, and an sbatch script for SLURM; with
    ``fault_tolerance`` (torchft), the lighthouse and one job per replica group instead."""
    job = [a for a in argv if a not in LAUNCH_FLAGS]
    if fault_tolerance is not None:
        return _print_replica_groups(job, fault_tolerance)
    lines = [f"# torchrun: run on each node ({cfg.nnodes} node(s) x {cfg.nproc_per_node} process(es))"]
    for r in range(cfg.nnodes):
        cmd = ["torchrun", *torchrun_args(cfg, node_rank=r), "-m", "gradsync.cli.main", *job]
        lines.append(f"# node {r}:" if cfg.rdzv_backend == "static" else "# any node:")
        lines.append(shlex.join(cmd))
        if cfg.rdzv_backend != "static":
            break
    srun_job = _strip_launch_flags(job)
    lines += [
        "",
        "# SLURM: save the lines below as job.sbatch and submit with `sbatch job.sbatch`",
        "# (srun starts one task per device; gradsync maps SLURM's variables to ranks itself)",
        "#!/bin/bash",
        f"#SBATCH --nodes={cfg.nnodes}",
        f"#SBATCH --ntasks-per-node={cfg.nproc_per_node}",
        f"#SBATCH --gpus-per-node={cfg.nproc_per_node}",
        "#SBATCH --job-name=gradsync",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        "srun " + shlex.join(["gradsync", *srun_job, "--devices", str(cfg.nproc_per_node), "--nnodes", str(cfg.nnodes)]),
    ]
    return "\n".join(lines)


def _without(argv: Sequence[str], flags: set) -> tuple[list[str], dict]:
    """``argv`` without ``flags`` (each with its value, ``--flag v`` or ``--flag=v``), and their values."""
    out, values, skip = [], {}, None
    for a in argv:
        if skip:
            values[skip] = a
            skip = None
            continue
        key, eq, value = a.partition("=")
        if key in flags:
            if eq:
                values[key] = value
            else:
                skip = key
            continue
        out.append(a)
    return out, values


_GROUP_FLAGS = {"--lighthouse", "--replica-group", "--replica_group", "--replica-groups", "--replica_groups",
                "--output-dir", "--output_dir"}


def _print_replica_groups(job: Sequence[str], ft: Any) -> str:
    """The lighthouse, then one ordinary job per replica group, each writing to ``OUTPUT_DIR/group<g>``."""
    from urllib.parse import urlsplit

    groups = ft.replica_groups
    # the fewest groups a round may average over: a majority, and at least one fewer than all, so the
    # others go on when a group dies (with every group required, they would wait for it to come back)
    quorum = max(1, min(groups - 1, groups // 2 + 1))
    port = urlsplit(ft.lighthouse).port or 29510
    rest, values = _without(job, _GROUP_FLAGS)
    out_dir = values.get("--output-dir", values.get("--output_dir"))

    def group_cmd(g: Any, flags: list[str]) -> str:  # g: a number, or a shell variable under SLURM
        line = shlex.join(["gradsync", *rest, *flags])
        return line + (f" --output-dir {shlex.quote(out_dir)}/group{g}" if out_dir else "")

    lines = [f"# torchft: one lighthouse, then one gradsync job per replica group ({groups} groups)",
             "# the lighthouse: once, on a machine every group reaches (its address is --lighthouse)",
             shlex.join(["gradsync", "lighthouse", "--min-replicas", str(quorum), "--port", str(port)])]
    for g in range(groups):
        flags = ["--lighthouse", ft.lighthouse, "--replica-group", str(g), "--replica-groups", str(groups)]
        lines += [f"# replica group {g}: on its own machine", group_cmd(g, flags)]
    lines += [
        "",
        "# SLURM: save the lines below as job.sbatch and submit with `sbatch job.sbatch`",
        "# (the lighthouse runs on the batch host, the allocation's first node; one group per node, one task",
        "# per process of the group)",
        "#!/bin/bash",
        f"#SBATCH --nodes={groups}",
        f"#SBATCH --ntasks-per-node={ft.processes}",
        "#SBATCH --job-name=gradsync",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        f"export TORCHFT_LIGHTHOUSE=http://$(hostname):{port} NUM_REPLICA_GROUPS={groups}",
        f"gradsync lighthouse --min-replicas {quorum} --port {port} &",
        f"for g in $(seq 0 {groups - 1}); do",
        f"  REPLICA_GROUP_ID=$g srun --nodes=1 --ntasks={ft.processes} --exclusive " + group_cmd("$g", []) + " &",
        "done",
        "wait",
    ]
    return "\n".join(lines)


def _strip_launch_flags(argv: Sequence[str]) -> list[str]:
    """Remove flags that srun supplies itself (devices, nodes, node rank, rendezvous)."""
    drop_with_value = {"--devices", "--nnodes", "--num-nodes", "--num_nodes", "--node-rank", "--node_rank",
                       "--master-addr", "--master_addr", "--master-port", "--master_port", "--rdzv-backend",
                       "--rdzv_backend", "--rdzv-id", "--rdzv_id", "--max-restarts", "--max_restarts"}
    return _without(argv, drop_with_value)[0]


#: The last line of torchrun's own traceback when this node's peers never joined the rendezvous.
_RENDEZVOUS_TIMEOUT = re.compile(r"(DistStoreError|RendezvousTimeoutError|RendezvousError|TimeoutError).*"
                                 r"(clients joined|[Tt]imed out|timeout)")


#: A worker's one-line user error. Workers share torchrun's stderr, so two ranks' copies of it can
#: arrive run together on one line ("gradsync: error: ab" + "gradsync: error: abc"): the last copy on
#: the line is the one that reached its newline whole.
_WORKER_ERROR = re.compile(r"^(?:.*)gradsync: error: (.*)$")
_EXIT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


class TorchrunOutput:
    """Passes torchrun's stderr (its workers' included) through line by line, except the traceback
    of a rendezvous that timed out, which it keeps back: ``rendezvous_timeout`` is then its last
    line, and the caller reports it in one line. Every other traceback is passed on whole."""

    def __init__(self, sink=None) -> None:
        self.sink = sink if sink is not None else sys.stderr
        self.held: list[str] = []
        self.rendezvous_timeout: Optional[str] = None
        self.worker_error: Optional[str] = None  # the first "gradsync: error: ..." line of a worker
        self.after_error: list[str] = []  # what followed it: torchrun's report, other ranks' echoes
        self._report_shown = False

    def feed(self, line: str) -> None:
        # A worker's user error is already one line: show it once (every rank may print it) and hold
        # what follows; torchrun's report of the failed workers is shown only when some worker failed
        # otherwise (close).
        if self.worker_error is not None:
            self.after_error.append(line)
            if "will restart worker group" in line:  # --max-restarts: show it all, stream the next attempt
                self.sink.write("".join(x for x in self.after_error if not _WORKER_ERROR.match(x)))
                self.sink.flush()
                self.worker_error, self.after_error = None, []
            return
        found = _WORKER_ERROR.match(line)
        if found and not self.held:
            self.worker_error = found.group(1).strip()
            self.sink.write(f"gradsync: error: {self.worker_error}\n")
            self.sink.flush()
            return
        if self.held or line.startswith("Traceback (most recent call last):"):
            self.held.append(line)
            if line[:1] not in (" ", "\t", "\n", "") and not line.startswith(("Traceback", "During handling",
                                                                             "The above exception")):
                self._settle(line.strip())  # the exception line ends the traceback
            return
        self.sink.write(line)
        self.sink.flush()

    def _settle(self, last: str) -> None:
        if _RENDEZVOUS_TIMEOUT.search(last):
            self.rendezvous_timeout = last
        else:
            self.close()
        self.held = []

    @property
    def only_user_error(self) -> bool:
        """A worker's user error, and no worker that failed otherwise: every exit status torchrun
        reports is gradsync's 2 for a user error, or the SIGTERM torchrun itself sent the others."""
        codes = {int(c) for line in self.after_error for c in _EXIT_CODE.findall(line)}
        return self.worker_error is not None and codes <= {2, -15}

    def close(self) -> None:
        if self.held:
            self.sink.write("".join(self.held))
            self.sink.flush()
        self.held = []
        if self.after_error and not self.only_user_error and not self._report_shown:
            self._report_shown = True
            self.sink.write("".join(line for line in self.after_error if not _WORKER_ERROR.match(line)))
            self.sink.flush()


#: Where a launcher's workers find the run it parsed (:func:`hand_over`), so they do not parse it again.
SPEC_ENV = "GRADSYNC_RUN_SPEC"


def hand_over(spec: Any, argv: Sequence[str], directory: str | os.PathLike) -> dict[str, str]:
    """Write the parsed run for the workers this launcher starts; returns the environment that says where.

    The workers of ``gradsync <argv>`` under torchrun are started with the same ``argv``; each takes
    the launcher's spec instead of scanning and parsing the flags, resolving the recipe and the
    strategy class again (:func:`handed_over`). A torchrun restart reads the same file."""
    path = Path(directory) / "run-spec.pkl"
    try:
        payload = pickle.dumps({"argv": list(argv), "spec": spec})
    except (pickle.PicklingError, TypeError, AttributeError):
        return {}  # an option that does not pickle: the workers parse the flags themselves, as they can
    path.write_bytes(payload)
    return {SPEC_ENV: str(path)}


def handed_over(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> Any:
    """The spec this process's launcher parsed for these ``argv``, or None (then parse them here):
    only a worker started by a launcher, with the very arguments the launcher parsed, takes it."""
    path = env.get(SPEC_ENV)
    if not path or not inside_launcher(env):
        return None
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return None
    return saved["spec"] if isinstance(saved, dict) and saved.get("argv") == list(argv) else None


def run_torchrun(cmd: list[str], extra_env: Optional[Mapping[str, str]] = None) -> tuple[int, Optional[str]]:
    """Run torchrun; return its exit status and, when the rendezvous timed out (a peer node never
    came), the exception line torchrun raised (its traceback is not shown)."""
    env = {**os.environ, **(extra_env or {})}
    # Several processes on few cores: one thread each, or they oversubscribe the CPUs.
    env.setdefault("OMP_NUM_THREADS", "1")
    out = TorchrunOutput()
    try:
        with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1) as proc:
            for line in proc.stderr:
                out.feed(line)
            rc = proc.wait()
    except KeyboardInterrupt:
        return 130, None
    finally:
        out.close()
    if rc != 0 and out.only_user_error:
        rc = 2  # a user error, printed in one line by the worker: the command's own exit status for one
    return rc, out.rendezvous_timeout


#: what an elastic job's agent imports once, before it forks the workers (:func:`run_elastic`); a module that is
#: not installed is left out
PRELOAD = ["gradsync.platform.run", "gradsync.recipes", "gradsync.comm.managed", "torchft"]

#: the module that runs :func:`run_elastic` as a command (:func:`elastic_command`)
ELASTIC_MODULE = "gradsync.cli.elastic"


def elastic_command(argv: Sequence[str], cfg: LaunchConfig, *, python: Optional[str] = None) -> list[str]:
    """As :func:`torchrun_command`, for :func:`run_elastic`: torchrun's arguments, ``--``, then gradsync's."""
    return [python or sys.executable, "-m", ELASTIC_MODULE, *torchrun_args(cfg), "--", *argv]


def run_elastic(argv: Sequence[str], torchrun_argv: Sequence[str], worker: Callable[[list[str]], None]) -> int:
    """Run ``gradsync <argv>`` under torchrun's elastic agent, in this process, with workers forked from it
    once it has imported torch, Lightning and gradsync (torchrun's ``--start-method fork``).

    The agent, the rendezvous and the restart policy are torchrun's own: its configuration is parsed from
    torchrun's own arguments (``torchrun_argv``, :func:`torchrun_args`). A worker that torchrun starts again
    after a failure (``--max-restarts``) trains again in about a second instead of paying a new
    interpreter's start-up: under ``--fault-tolerance torchft`` a replica group whose process died is back
    in the quorum, healed, that much sooner. Should an import have initialized CUDA here (which a forked
    child cannot use), the workers are forked from a fresh server instead (``forkserver``, the same imports
    made there once). ``worker(argv)`` is each worker's body (the CLI's own entry point). The launcher runs
    this as a command (:func:`elastic_command`) through :func:`run_torchrun`, which reads its output as
    torchrun's. Returns the exit status (2 when every failed worker stopped on a user error)."""
    import multiprocessing

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    method = "fork"
    if torch_cuda_initialized():
        method = "forkserver"
        multiprocessing.set_forkserver_preload(PRELOAD)
    args = torchrun.parse_args([*torchrun_argv, "--start-method", method, "-m", "gradsync.cli.main"])
    config, _, _ = torchrun.config_from_args(args)
    try:
        elastic_launch(config, worker)(list(argv))
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        return 2 if codes and all(c == 2 for c in codes) else 1
    except KeyboardInterrupt:
        return 130
    return 0


def torch_cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def missing_master_address(cfg: LaunchConfig, env: Mapping[str, str] = os.environ) -> Optional[str]:
    """A one-line warning when several nodes would meet at 127.0.0.1 because no address was given."""
    if cfg.nnodes > 1 and not cfg.master_addr and not env.get("MASTER_ADDR"):
        return (f"--nnodes {cfg.nnodes} without --master-addr: the nodes would meet at 127.0.0.1, which only "
                "works when every node is this machine; pass --master-addr <node 0's host name or address>")
    return None


def wait_for_node_zero(cfg: LaunchConfig, timeout: float) -> bool:
    """On a node other than 0 (static rendezvous): whether node 0's rendezvous port answered within
    ``timeout`` seconds. A node started without its node 0 then fails in one line, not in a
    traceback from torchrun's agent."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((cfg.master_addr, cfg.master_port), timeout=min(5.0, timeout)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
