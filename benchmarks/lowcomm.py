"""lowcomm: low-communication training where communication dominates, over a shaped link.

Across data centres a GPU step computes in tens of milliseconds and its fp32 all-reduce takes
seconds: communication is 10-100x the compute. A 2-core CPU computes slowly, so the same ratio
needs a slow link: two namespaces joined by a ``tbf``-shaped veth (as in ``slowlink``). The link is
paced to the compute: after the no-communication reference has timed a step, the rate is set so
that fp32 sync's all-reduce of a step's gradients takes ``LINK_TO_COMPUTE`` (25) times that step,
which is what 10 Mbit/s gave on this kind of machine at its usual pace (a 0.05-0.06 s step). On a
machine that computes twice as slowly the link is twice as slow, so the speedups measure the
algorithms in one regime rather than the machine's pace on the day. ``GRADSYNC_LOWCOMM_RATE``
(a ``tc`` rate such as ``10mbit``) fixes the rate instead. Each strategy trains the same small
chargpt model; the report gives the steps and the time to ``sync``'s final validation loss + 2%,
the compute utilization, wire bytes, the ratio of bytes per optimizer step against fp32 sync, and
the peak bytes of one sync (Streaming DiLoCo's bandwidth claim).

Utilization is the steady-state step time of a run that sends nothing over that of the run
measured, both measured the same way: the same two processes, one per namespace, as a 2-node job
over the shaped link (the reference is ``local_sgd`` with a period longer than the run, so no step
communicates), the same validation schedule, and the mean step time between the run's first and
last validation (start-up and the end-of-fit round excluded, validation included in both). A
reference runs before the first run and after every run, and each run is divided by the mean of
the two around it: the machine's pace drifts during a 20-minute suite by more than a round costs.

The configurations follow the papers: INTELLECT-1's DiLoCo with H = 100 inner steps and int8
pseudo-gradients; Streaming DiLoCo's 4 fragments, overlapped (sync delay) and 4-bit; SparseLoCo's
chunked top-k (64 of every 4096 entries, 2-bit values, error feedback) at H = 30, 50 and 100, at
gradsync's defaults for it (Elias-Fano-coded indices, outer step 2).
"""

from __future__ import annotations

import os
import re
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
    # the sparse codec needs rounds (it delivers ~1.6% of the entries per round, the rest follows
    # through error feedback): 800 steps give H = 50 sixteen rounds
    **{f"diloco H={h} sparseloco": (["--strategy", "diloco", "--strategy.period", str(h), "--strategy.codec",
                                     "sparseloco"], 800) for h in (30, 50, 100)},
}
QUICK = ("sync", "diloco H=100 int8")
#: The quick run's length: start-up dominates its cost, and a timing window of 40 steps (validation
#: every 8) keeps a utilization's noise well under the gap between a run and its reference.
QUICK_STEPS = 48



#: The no-communication reference: local SGD whose first round would come after the run ends.
REFERENCE = "no communication"


#: fp32 sync's all-reduce of one step's gradients takes this many times a step's compute on the
#: paced link (the ratio 10 Mbit/s gave against a 0.05-0.06 s step; cross-data-centre training is at 10-100x).
LINK_TO_COMPUTE = 25
#: The quick run's ratio: enough for sync to wait on the link for most of each step, in a few seconds.
QUICK_LINK_TO_COMPUTE = 8


def link_rate(sync_bytes_per_step: float, step_seconds: float, ratio: float = LINK_TO_COMPUTE) -> str:
    """The ``tc`` rate (whole kbit/s) at which a rank sends ``sync_bytes_per_step`` in ``ratio`` x
    ``step_seconds``: in a 2-rank ring all-reduce each rank sends, and receives, the fp32 gradients once."""
    if sync_bytes_per_step <= 0 or step_seconds <= 0 or ratio <= 0:
        raise ValueError(f"link_rate needs positive bytes, seconds and ratio, got {sync_bytes_per_step}, "
                         f"{step_seconds}, {ratio}")
    return f"{max(1, round(sync_bytes_per_step * 8 / (ratio * step_seconds) / 1e3))}kbit"


def reference_flags(steps: int) -> list[str]:
    return ["--strategy", "local_sgd", "--strategy.period", str(steps + 1)]


def steady_step_seconds(curve: list) -> float:
    """Mean seconds per optimizer step between the first and the last timed validation of ``curve``
    (a validation after the end-of-fit round has no step time logged with it)."""
    timed = [(step, wall) for step, wall, _ in curve if wall is not None]
    if len(timed) < 2 or timed[-1][0] <= timed[0][0]:
        raise ValueError("the run validated once: a steady-state step time needs two timed validations")
    (first, t0), (last, t1) = timed[0], timed[-1]
    return (t1 - t0) / (last - first)


def run(out: Path, quick: bool = False, rate: str = "") -> Report:
    rate = rate or os.environ.get("GRADSYNC_LOWCOMM_RATE", "auto")
    if rate != "auto" and not re.fullmatch(r"\d+(\.\d+)?[kmg]?bit", rate):
        raise SystemExit(f"GRADSYNC_LOWCOMM_RATE={rate}: not a rate; use auto (paced to the compute) or a tc rate "
                         "such as 10mbit or 4500kbit")
    ratio = QUICK_LINK_TO_COMPUTE if quick else LINK_TO_COMPUTE
    rep = Report("lowcomm", "Low-communication training, two nodes over a "
                 + (f"link paced to {ratio}x the compute" if rate == "auto" else f"{rate} link")
                 + ": chargpt to sync's loss",
                 ["strategy", "steps", "steps to target", "time to target s", "speedup vs sync", "utilization",
                  "wire MB / rank", "bytes / step vs sync", "peak KB / sync", "final val_loss"],
                 command=command_line())
    if slowlink.skipped(rep, out):
        return rep
    model, val_every = (slowlink.QUICK_MODEL, 8) if quick else (slowlink.MODEL, 16)
    plan = {k: (flags, QUICK_STEPS if quick else steps) for k, (flags, steps) in STRATEGIES.items()
            if not quick or k in QUICK}
    if quick:
        plan = {k: ([f if f != "100" else "4" for f in flags], steps) for k, (flags, steps) in plan.items()}
    results = {}
    ref_steps = plan["sync"][1]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            paced = rate == "auto"
            # the reference sends nothing until its end-of-fit round, so the link's rate does not time it
            slowlink.link_up("10mbit" if paced else rate)
            refs = [slowlink.train(REFERENCE, reference_flags(ref_steps), ref_steps, val_every, model, Path(tmp))]
            # fp32 sync's bytes per step: what the ledger counts as the logical bytes of every step
            sync_bytes_per_step = refs[0]["summary"]["comm"]["logical_bytes"] / ref_steps
            first_reference = steady_step_seconds(refs[0]["curve"])
            if paced:
                rate = link_rate(sync_bytes_per_step, first_reference, ratio)
                slowlink.set_rate(rate)
            measured = slowlink.measure_link(1.0 if quick else 3.0)
            # a reference after every run: each run is timed against the two that bracket it, so a machine
            # whose pace drifts during the suite (20% in 20 minutes has been seen) does not skew the late rows
            for i, (name, (flags, steps)) in enumerate(plan.items()):
                results[name] = slowlink.train(name, flags, steps, val_every, model, Path(tmp))
                refs.append(slowlink.train(f"{REFERENCE} {i + 1}", reference_flags(ref_steps), ref_steps, val_every,
                                           model, Path(tmp)))
        finally:
            slowlink.link_down()
    # the reference's only bytes are the end-of-fit round, after its last validation
    ref_steps_seconds = [steady_step_seconds(r["curve"]) for r in refs]
    reference = {name: (ref_steps_seconds[i] + ref_steps_seconds[i + 1]) / 2 for i, name in enumerate(results)}
    target = results["sync"]["curve"][-1][2] * 1.02
    base_time, base_bytes_per_step = None, None
    for name, r in results.items():
        s, steps = r["summary"], plan[name][1]
        hit = slowlink.time_to_target(r["curve"], target)
        t_target = hit if hit is not None else float("nan")
        hit_step = next((step + 1 for step, wall, loss in r["curve"] if loss <= target and wall is not None),
                        "not reached")
        per_step = s["comm"]["wire_bytes"] / steps
        if name == "sync":
            base_time, base_bytes_per_step = t_target, per_step
        speedup = (base_time / t_target) if hit is not None and base_time else "not reached"
        rep.rows.append([name, steps, hit_step, t_target, speedup,
                         reference[name] / steady_step_seconds(r["curve"]), s["comm"]["wire_bytes"] / 1e6,
                         base_bytes_per_step / per_step, s["comm"]["peak_sync_bytes"] / 1e3,
                         s["metrics"].get("val_loss")])
    sync_step = steady_step_seconds(results["sync"]["curve"])
    pacing = (f"paced to the compute: fp32 sync's {sync_bytes_per_step / 1e6:.2f} MB per step in {ratio}x "
              f"the first reference's {first_reference:.3f} s step; " if paced else "")
    rep.notes.append(f"link: veth pair between two namespaces, tbf {rate} on both ends ({pacing}measured "
                     f"{measured:.1f} Mbit/s with a TCP stream just before the runs); one process per namespace "
                     f"(node). Sync's step took {sync_step:.2f} s: its communication cost "
                     f"{sync_step / reference['sync'] - 1:.1f}x the compute.")
    rep.notes.append(f"target val_loss {target:.3f} = sync's final loss + 2%; validation every {val_every} steps; time "
                     "to target = wall time of the first validation at or below it, steps to target = the optimizer "
                     "steps before it. The speedup is sync's time over the run's: (sync's steps x its step time) / "
                     "(the run's steps x its step time), so it grows with the link's cost against the compute's, "
                     "while the steps to target do not depend on either.")
    rep.notes.append("utilization = the mean step of the same 2-node job with no communication (local_sgd with "
                     f"period {ref_steps + 1}, {ref_steps} steps), averaged over the one run just before the row's "
                     "run and the one just after it, / the run's mean step, both between the first and last "
                     "validation (start-up and the end-of-fit round out, validation in); the references took "
                     f"{min(ref_steps_seconds):.3f}-{max(ref_steps_seconds):.3f} s.")
    rep.notes.append("bytes / step vs sync: sync's wire bytes per optimizer step over this run's (the ledger's "
                     "compression ratio, final rounds included); peak = the most one sync sent.")
    rep.data = {"rate": rate, "paced": paced, "link_to_compute": ratio if paced else None,
                "sync_bytes_per_step": sync_bytes_per_step, "measured_mbit": measured, "target": target,
                "reference_step_seconds": reference,  # per row: the mean of the two references around it
                "reference_curves": [r["curve"] for r in refs],
                "curves": {k: v["curve"] for k, v in results.items()},
                "summaries": {k: {"comm": v["summary"]["comm"], "metrics": v["summary"]["metrics"]}
                              for k, v in results.items()}}

    rep.write(out, slowlink.loss_plot(results, target, log_time=True))
    return rep
