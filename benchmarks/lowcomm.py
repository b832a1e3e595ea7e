"""lowcomm: low-communication training where communication dominates, over a shaped 10 Mbit/s link.

Across data centres a GPU step computes in tens of milliseconds and its fp32 all-reduce takes
seconds: communication is 10-100x the compute. A 2-core CPU computes slowly, so the same ratio
needs a slow link: two namespaces joined by a ``tbf``-shaped veth (as in ``slowlink``), 10 Mbit/s
by default, where ``sync`` spends over 90% of each step waiting. Each strategy trains the same small
chargpt model; the report gives the time to ``sync``'s final validation loss + 2%, the compute
utilization, wire bytes, the ratio of bytes per optimizer step against fp32 sync, and the peak
bytes of one sync (Streaming DiLoCo's bandwidth claim).

Utilization is the steady-state step time of a run that sends nothing over that of the run
measured, both measured the same way: the same two processes, one per namespace, as a 2-node job
over the shaped link (the reference is ``local_sgd`` with a period longer than the run, so no step
communicates), the same validation schedule, and the mean step time between the run's first and
last validation (start-up and the end-of-fit round excluded, validation included in both). The
reference runs before and after the others and the faster of the two counts, so a machine that
speeds up or slows down during the suite does not push a fraction above 1.

The configurations follow the papers: INTELLECT-1's DiLoCo with H = 100 inner steps and int8
pseudo-gradients; Streaming DiLoCo's 4 fragments, overlapped (sync delay) and 4-bit; SparseLoCo's
chunked top-k (64 of every 4096 entries, 2-bit values, error feedback) at H = 30, 50 and 100, at
gradsync's defaults for it (Elias-Fano-coded indices, outer step 2).
"""

from __future__ import annotations

import os
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
    rate = rate or os.environ.get("GRADSYNC_LOWCOMM_RATE", "10mbit")
    rep = Report("lowcomm", f"Low-communication training, two nodes over a {rate} link: chargpt to sync's loss",
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
            slowlink.link_up(rate)
            measured = slowlink.measure_link(1.0 if quick else 3.0)
            refs = [slowlink.train(REFERENCE, reference_flags(ref_steps), ref_steps, val_every, model, Path(tmp))]
            for name, (flags, steps) in plan.items():
                results[name] = slowlink.train(name, flags, steps, val_every, model, Path(tmp))
            refs.append(slowlink.train(f"{REFERENCE} after", reference_flags(ref_steps), ref_steps, val_every, model,
                                       Path(tmp)))
        finally:
            slowlink.link_down()
    # the reference's only bytes are the end-of-fit round, after its last validation
    reference = min(steady_step_seconds(r["curve"]) for r in refs)
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
                         reference / steady_step_seconds(r["curve"]), s["comm"]["wire_bytes"] / 1e6,
                         base_bytes_per_step / per_step, s["comm"]["peak_sync_bytes"] / 1e3,
                         s["metrics"].get("val_loss")])
    rep.notes.append(f"link: veth pair between two namespaces, tbf {rate} on both ends; measured {measured:.1f} "
                     "Mbit/s with a TCP stream just before the runs; one process per namespace (node).")
    rep.notes.append(f"target val_loss {target:.3f} = sync's final loss + 2%; validation every {val_every} steps; time "
                     "to target = wall time of the first validation at or below it, steps to target = the optimizer "
                     "steps before it. The speedup is sync's time over the run's: (sync's steps x its step time) / "
                     "(the run's steps x its step time), so it grows with the link's cost against the compute's, "
                     "while the steps to target do not depend on either.")
    rep.notes.append(f"utilization = {reference:.3f} s (the mean step of the same 2-node job with no communication: "
                     f"local_sgd with period {ref_steps + 1}, {ref_steps} steps, the faster of a run before and one after "
                     "the others) / the run's mean step, both between the first and last validation (start-up and the "
                     "end-of-fit round out, validation in).")
    rep.notes.append("bytes / step vs sync: sync's wire bytes per optimizer step over this run's (the ledger's "
                     "compression ratio, final rounds included); peak = the most one sync sent.")
    rep.data = {"rate": rate, "measured_mbit": measured, "target": target, "reference_step_seconds": reference,
                "reference_curves": [r["curve"] for r in refs],
                "curves": {k: v["curve"] for k, v in results.items()},
                "summaries": {k: {"comm": v["summary"]["comm"], "metrics": v["summary"]["metrics"]}
                              for k, v in results.items()}}

    rep.write(out, slowlink.loss_plot(results, target, log_time=True))
    return rep
