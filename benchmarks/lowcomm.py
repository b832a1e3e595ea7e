"""lowcomm: low-communication training where communication dominates, over a shaped 10 Mbit/s link.

Across data centres a GPU step computes in tens of milliseconds and its fp32 all-reduce takes
seconds: communication is 10-100x the compute. A 2-core CPU computes slowly, so the same ratio
needs a slow link: two namespaces joined by a ``tbf``-shaped veth (as in ``slowlink``), 10 Mbit/s
by default, where ``sync`` spends over 90% of each step waiting. Each strategy trains the same small
chargpt model; the report gives the time to ``sync``'s final validation loss + 2%, the compute
utilization (the step time of a one-process run with no communication, over this run's mean step
time), wire bytes, the ratio of bytes per optimizer step against fp32 sync, and the peak bytes of
one sync (Streaming DiLoCo's bandwidth claim).

The configurations follow the papers: INTELLECT-1's DiLoCo with H = 100 inner steps and int8
pseudo-gradients; Streaming DiLoCo's 4 fragments, overlapped (sync delay) and 4-bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import slowlink
from benchmarks.common import Report, command_line

#: name -> (extra CLI flags, optimizer steps). Low-communication runs get more steps: they are cheap,
#: and the question is how soon (in wall time) they reach the loss sync reaches.
STRATEGIES = {
    "sync": ([], 160),
    "diloco H=100 int8": (["--strategy", "diloco", "--strategy.period", "100", "--strategy.codec", "int8"], 400),
    "diloco H=100 int4 F=4 delay 2": (["--strategy", "diloco", "--strategy.period", "100", "--strategy.codec", "int4",
                                       "--strategy.fragments", "4", "--strategy.sync_delay", "2"], 400),
    "local_sgd H=32 int8": (["--strategy", "local_sgd", "--strategy.period", "32", "--strategy.codec", "int8"], 400),
}
QUICK = ("sync", "diloco H=100 int8")



def compute_reference(steps: int, val_every: int, model: list[str], tmp: Path) -> float:
    """Mean seconds per optimizer step with no communication: two one-process runs at once, one per
    node, so they share the machine as the two nodes of the measured runs do (same micro-batch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    procs, outs = [], [tmp / f"reference{i}" for i in range(2)]
    for out in outs:
        cmd = [sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "chargpt", *model, "--accelerator",
               "cpu", "--devices", "1", "--max-steps", str(steps), "--val-every", str(val_every), "--output-dir",
               str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        err = p.communicate(timeout=1800)[1]
        if p.returncode:
            raise RuntimeError(f"reference run failed:\n{err[-2000:]}")
    return sum(mean_step_seconds(slowlink.read_curve(out)) for out in outs) / len(outs)


def mean_step_seconds(curve: list) -> float:
    step, wall, _ = curve[-1]
    return wall / step


def run(out: Path, quick: bool = False, rate: str = "") -> Report:
    rate = rate or os.environ.get("GRADSYNC_LOWCOMM_RATE", "10mbit")
    rep = Report("lowcomm", f"Low-communication training, two nodes over a {rate} link: chargpt to sync's loss",
                 ["strategy", "steps", "time to target s", "speedup vs sync", "utilization", "wire MB / rank",
                  "bytes / step vs sync", "peak KB / sync", "final val_loss"],
                 command=command_line())
    if slowlink.skipped(rep, out):
        return rep
    model, val_every = (slowlink.QUICK_MODEL, 4) if quick else (slowlink.MODEL, 16)
    plan = {k: (flags, 8 if quick else steps) for k, (flags, steps) in STRATEGIES.items() if not quick or k in QUICK}
    if quick:
        plan = {k: ([f if f != "100" else "4" for f in flags], steps) for k, (flags, steps) in plan.items()}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        reference = compute_reference(plan["sync"][1], val_every, model, Path(tmp))
        try:
            slowlink.link_up(rate)
            measured = slowlink.measure_link(1.0 if quick else 3.0)
            for name, (flags, steps) in plan.items():
                results[name] = slowlink.train(name, flags, steps, val_every, model, Path(tmp))
        finally:
            slowlink.link_down()
    target = results["sync"]["curve"][-1][2] * 1.02
    base_time, base_bytes_per_step = None, None
    for name, r in results.items():
        s, steps = r["summary"], plan[name][1]
        hit = slowlink.time_to_target(r["curve"], target)
        t_target = hit if hit is not None else float("nan")
        per_step = s["comm"]["wire_bytes"] / steps
        if name == "sync":
            base_time, base_bytes_per_step = t_target, per_step
        speedup = (base_time / t_target) if hit is not None and base_time else "not reached"
        rep.rows.append([name, steps, t_target, speedup,
                         reference / mean_step_seconds(r["curve"]), s["comm"]["wire_bytes"] / 1e6,
                         base_bytes_per_step / per_step, s["comm"]["peak_sync_bytes"] / 1e3,
                         s["metrics"].get("val_loss")])
    rep.notes.append(f"link: veth pair between two namespaces, tbf {rate} on both ends; measured {measured:.1f} "
                     "Mbit/s with a TCP stream just before the runs; one process per namespace (node).")
    rep.notes.append(f"target val_loss {target:.3f} = sync's final loss + 2%; validation every {val_every} steps; time "
                     "to target = wall time of the first validation at or below it.")
    rep.notes.append(f"utilization = {reference:.3f} s (mean step with no communication: two one-process runs at "
                     "once, sharing the machine like the two nodes) / the run's mean step time (validation included "
                     "in both).")
    rep.notes.append("bytes / step vs sync: sync's wire bytes per optimizer step over this run's (the ledger's "
                     "compression ratio, final rounds included); peak = the most one sync sent.")
    rep.data = {"rate": rate, "measured_mbit": measured, "target": target, "reference_step_seconds": reference,
                "curves": {k: v["curve"] for k, v in results.items()},
                "summaries": {k: {"comm": v["summary"]["comm"], "metrics": v["summary"]["metrics"]}
                              for k, v in results.items()}}

    rep.write(out, slowlink.loss_plot(results, target, log_time=True))
    return rep
