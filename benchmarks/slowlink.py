"""slowlink: two "nodes" joined by a shaped link; each strategy trains to a target validation loss.

The suite builds two Linux network namespaces on this machine, joins them with a veth pair, and
shapes both ends with a ``tbf`` qdisc (100 Mbit/s by default; ``netem`` is absent on these kernels,
so no delay is added). One gradsync process runs per namespace, as node 0 and node 1 of a 2-node
job (``--nnodes 2``), so every collective crosses the shaped link. Each strategy trains the same
small ``chargpt`` model; the report gives wall time to the target validation loss, time per step,
wire bytes and the final loss, each relative to ``sync``. The namespaces are removed afterwards.

Needs root and iproute2; without them it says so and exits cleanly.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from benchmarks.common import Report, command_line

NS = ("gsbench0", "gsbench1")
VETH = ("gsveth0", "gsveth1")
ADDR = ("10.233.77.1", "10.233.77.2")  # inside this suite's own namespaces only

STRATEGIES = {
    "sync": [],
    "compressed int8": ["--strategy", "compressed", "--strategy.codec", "int8"],
    "compressed powersgd": ["--strategy", "compressed", "--strategy.codec", "powersgd"],  # AdamW: rank 8
    "local_sgd period 8": ["--strategy", "local_sgd", "--strategy.period", "8"],
    "diloco period 8": ["--strategy", "diloco", "--strategy.period", "8"],
}


#: The chargpt model every link suite trains (quick: seconds; full: 0.4M parameters, AdamW).
QUICK_MODEL = ["--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32",
               "--data.max_chars", "200000", "--data.val_windows", "32", "--batch-size", "8"]
MODEL = ["--model.n_layer", "2", "--model.n_head", "4", "--model.n_embd", "128", "--model.block_size", "64",
         "--data.max_chars", "1000000", "--data.val_windows", "64", "--batch-size", "16", "--lr", "0.003",
         "--model.optimizer", "adamw"]


def with_batch(model: list[str], batch: int) -> list[str]:
    """``model``'s flags with another per-process batch size."""
    i = model.index("--batch-size")
    return [*model[:i + 1], str(batch), *model[i + 2:]]


def skipped(rep: Report, out: Path) -> bool:
    """Write ``rep`` saying why the suite cannot run here, if it cannot; True then."""
    why = available()
    if why:
        rep.notes.append(f"not run: {why}")
        rep.write(out)
        print(f"{rep.suite}: skipped, {why}")
    return bool(why)


def available() -> Optional[str]:
    """None when the suite can run here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2 ({tool} not found)"
    return None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def link_up(rate: str) -> None:
    link_down()
    for ns in NS:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, veth, addr in zip(NS, VETH, ADDR):
        _sh("ip", "link", "set", veth, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        _sh("ip", "-n", ns, "link", "set", veth, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _shape(ns, veth, "add", rate)


def set_rate(rate: str) -> None:
    """Reshape the link that :func:`link_up` made to ``rate`` (a ``tc`` rate: ``10mbit``, ``4650kbit``)."""
    for ns, veth in zip(NS, VETH):
        _shape(ns, veth, "change", rate)


def _shape(ns: str, veth: str, op: str, rate: str) -> None:
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", op, "dev", veth, "root", "tbf", "rate", rate, "burst", "256kb",
        "latency", "50ms")


def link_down() -> None:
    """Remove this suite's namespaces and veth pair, and anything an interrupted run left in them: its
    processes (which would hold the port) and a pair not yet moved into the namespaces."""
    for ns in NS:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", VETH[0]], capture_output=True)


def measure_link(seconds: float = 2.0) -> float:
    """Mbit/s through the shaped link: a TCP stream from node 1 to node 0 (Python sockets)."""
    server = ("import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{ADDR[0]}',29599));s.listen(1);c,_=s.accept();n=0;t=time.time()\n"
              "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
              "print(n*8/(time.time()-t)/1e6)")
    # the client retries until the server listens (an interpreter's start-up is not a fixed delay)
    client = ("import socket,time\nd=time.time()+60\nwhile True:\n try:\n"
              f"  c=socket.create_connection(('{ADDR[0]}',29599));break\n"
              " except OSError:\n  if time.time()>d: raise\n  time.sleep(0.05)\n"
              f"b=b'x'*(1<<16);t=time.time()\nwhile time.time()-t<{seconds}: c.sendall(b)\nc.close()")
    srv = subprocess.Popen(["ip", "netns", "exec", NS[0], sys.executable, "-c", server], stdout=subprocess.PIPE,
                           text=True)
    subprocess.run(["ip", "netns", "exec", NS[1], sys.executable, "-c", client], check=True, timeout=120)
    return float(srv.communicate(timeout=60)[0].strip())


def train(name: str, extra: list[str], steps: int, val_every: int, model: list[str], tmp: Path,
          devices: int = 1) -> dict:
    """Train on two nodes (one namespace each) of ``devices`` processes; processes of a node talk over loopback."""
    out = tmp / name.replace(" ", "_")
    port = "29511"
    procs = []
    for rank, (ns, veth) in enumerate(zip(NS, VETH)):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": veth, "WANDB_MODE": "disabled"}
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "chargpt",
               *model, *extra, "--accelerator", "cpu", "--devices", str(devices), "--nnodes", "2",
               "--node-rank", str(rank),
               "--master-addr", ADDR[0], "--master-port", port, "--max-steps", str(steps), "--val-every",
               str(val_every), "--timeout", "600", "--output-dir", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name} failed:\n{logs[0][-2000:]}\n{logs[1][-2000:]}")
    return {"summary": json.loads((out / "summary.json").read_text()), "curve": read_curve(out)}


def read_curve(out: Path) -> list[tuple[int, Optional[float], float]]:
    """(step, wall seconds, val_loss) at every validation of the run written to ``out``."""
    wall_at_step, curve = {}, []
    with open(out / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        if r.get("time/wall_seconds"):
            wall_at_step[int(r["step"])] = float(r["time/wall_seconds"])
    for r in rows:
        if r.get("val_loss"):
            step = int(r["step"])
            curve.append((step, wall_at_step.get(step), float(r["val_loss"])))
    return curve


def time_to_target(curve: list, target: float) -> Optional[float]:
    """Wall seconds of the first validation at or below ``target`` (None: never reached)."""
    return next((wall for _, wall, loss in curve if loss <= target and wall is not None), None)


def loss_plot(results: dict, target: float, *, log_time: bool = False):
    """A plot function for :meth:`Report.write`: validation loss against wall time, per strategy."""
    def plot(ax):
        for name, r in results.items():
            pts = [(w, loss) for _, w, loss in r["curve"] if w is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
        ax.axhline(target, color="#888", ls="--", lw=1, label="target")
        if log_time:
            ax.set_xscale("log")
        ax.set_xlabel("wall time (s, log)" if log_time else "wall time (s)")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
    return plot


def run(out: Path, quick: bool = False, rate: str = "") -> Report:
    rate = rate or os.environ.get("GRADSYNC_SLOWLINK_RATE", "100mbit")
    rep = Report("slowlink", f"Two nodes over a {rate} link: chargpt to a target validation loss",
                 ["strategy", "time to target s", "speedup vs sync", "s / step", "wire MB / rank", "final val_loss"],
                 command=command_line())
    if skipped(rep, out):
        return rep
    steps, val_every = (12, 6) if quick else (160, 16)
    model = QUICK_MODEL if quick else MODEL
    strategies = {k: v for k, v in STRATEGIES.items() if not quick or k in ("sync", "local_sgd period 8")}
    results = {}
    try:
        link_up(rate)
        measured = measure_link(1.0 if quick else 3.0)
        with tempfile.TemporaryDirectory() as tmp:
            for name, extra in strategies.items():
                results[name] = train(name, extra, steps, val_every, model, Path(tmp))
    finally:
        link_down()
    # target: what sync reaches at the end, relaxed by 2% so strategies that get there count
    target = results["sync"]["curve"][-1][2] * 1.02
    base = None
    for name, r in results.items():
        s = r["summary"]
        hit = time_to_target(r["curve"], target)
        t_target = hit if hit is not None else float("nan")
        if name == "sync":
            base = t_target
        step_s = s.get("median_step_seconds") or float("nan")
        rep.rows.append([name, t_target, (base / t_target) if hit is not None and base else "not reached", step_s,
                         s["comm"]["wire_bytes"] / 1e6, s["metrics"].get("val_loss")])
    rep.notes.append(f"link: veth pair between two namespaces, tbf {rate} on both ends; measured {measured:.0f} "
                     "Mbit/s with a TCP stream just before the runs.")
    rep.notes.append(f"target val_loss {target:.3f} = sync's final loss + 2%; {steps} optimizer steps each, validation "
                     f"every {val_every}; time to target = wall time of the first validation at or below it.")
    rep.data = {"rate": rate, "measured_mbit": measured, "target": target,
                "curves": {k: v["curve"] for k, v in results.items()},
                "summaries": {k: {"comm": v["summary"]["comm"], "metrics": v["summary"]["metrics"],
                                  "median_step_seconds": v["summary"].get("median_step_seconds")}
                              for k, v in results.items()}}

    rep.write(out, loss_plot(results, target))
    return rep
