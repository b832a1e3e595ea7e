"""nodes: two nodes of two processes, a shaped link between them and loopback inside each.

The ``slowlink`` namespaces, with two processes in each (torchrun ``--nproc-per-node 2`` per
namespace): traffic between the nodes crosses the shaped veth, traffic inside a node stays on the
namespace's loopback, as NVLink inside a node and Ethernet between nodes. Compares flat ``sync``,
flat ``diloco`` (four replicas), and ``diloco --strategy.scope node`` (one replica per node, the
inner steps all-reduced inside the node) with and without int8 pseudo-gradients, on time to
``sync``'s final validation loss + 2%, and bytes that crossed between the nodes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from benchmarks import slowlink
from benchmarks.common import Report, command_line

DILOCO = ["--strategy", "diloco", "--strategy.period", "16"]
STRATEGIES = {
    "sync": [],
    "diloco (4 replicas)": DILOCO,
    "diloco scope node (2 replicas)": [*DILOCO, "--strategy.scope", "node"],
    "diloco scope node + int8": [*DILOCO, "--strategy.scope", "node", "--strategy.codec", "int8"],
}
QUICK = ("sync", "diloco scope node (2 replicas)")


def inter_node_bytes(summary: dict) -> float:
    """Bytes one process sent between the nodes: the inter-node scope, or (flat) everything it sent.

    A flat collective's ring crosses the link, so all of a flat strategy's bytes are counted."""
    scopes = summary["comm"].get("by_scope") or {}
    return scopes["inter_node"]["wire_bytes"] if "inter_node" in scopes else summary["comm"]["wire_bytes"]


def run(out: Path, quick: bool = False, rate: str = "") -> Report:
    rate = rate or os.environ.get("GRADSYNC_NODES_RATE", "100mbit")
    rep = Report("nodes", f"Two nodes x two processes over a {rate} link (loopback inside a node): chargpt",
                 ["strategy", "steps", "time to target s", "speedup vs sync", "inter-node MB / process",
                  "intra-node MB / process", "s / step", "final val_loss"], command=command_line())
    if slowlink.skipped(rep, out):
        return rep
    # four processes share the machine: half slowlink's per-process batch keeps the global batch at 32
    model = slowlink.QUICK_MODEL if quick else slowlink.with_batch(slowlink.MODEL, 8)
    steps, val_every = (8, 4) if quick else (160, 16)
    plan = {k: v for k, v in STRATEGIES.items() if not quick or k in QUICK}
    if quick:
        plan = {k: [f if f != "16" else "4" for f in flags] for k, flags in plan.items()}
    results = {}
    try:
        slowlink.link_up(rate)
        measured = slowlink.measure_link(1.0 if quick else 3.0)
        with tempfile.TemporaryDirectory() as tmp:
            for name, flags in plan.items():
                # DiLoCo's steps are cheap: give it more of them; the question is how soon it gets there
                n = steps if name == "sync" or quick else 2 * steps
                results[name] = slowlink.train(name, flags, n, val_every, model, Path(tmp), devices=2)
    finally:
        slowlink.link_down()
    target = results["sync"]["curve"][-1][2] * 1.02
    base = None
    for name, r in results.items():
        s = r["summary"]
        hit = slowlink.time_to_target(r["curve"], target)
        t_target = hit if hit is not None else float("nan")
        if name == "sync":
            base = t_target
        intra = (s["comm"].get("by_scope") or {}).get("intra_node", {}).get("wire_bytes", 0)
        speedup = (base / t_target) if hit is not None and base else "not reached"
        rep.rows.append([name, r["curve"][-1][0], t_target, speedup,
                         inter_node_bytes(s) / 1e6, intra / 1e6, r["curve"][-1][1] / r["curve"][-1][0],
                         s["metrics"].get("val_loss")])
    rep.notes.append(f"link: veth pair between two namespaces, tbf {rate} on both ends; measured {measured:.0f} Mbit/s; "
                     "two processes per namespace (torchrun --nproc-per-node 2), loopback between them.")
    rep.notes.append(f"target val_loss {target:.3f} = sync's final loss + 2%; global batch "
                     f"4 x 8, validation every {val_every}; s / step = wall time at the last validation / steps.")
    rep.notes.append("inter-node bytes: the ledger's inter_node scope for node-scoped runs; all bytes for flat ones "
                     "(their rings cross the link).")
    rep.data = {"rate": rate, "measured_mbit": measured, "target": target,
                "curves": {k: v["curve"] for k, v in results.items()},
                "summaries": {k: {"comm": v["summary"]["comm"], "metrics": v["summary"]["metrics"]}
                              for k, v in results.items()}}

    rep.write(out, slowlink.loss_plot(results, target))
    return rep
