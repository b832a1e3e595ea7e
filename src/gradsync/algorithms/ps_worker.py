"""The worker's side of the parameter server: each shard's optimizer, the worker's clock, the
merge of saved shards on resume, the one-line report when a peer is lost, and the run summary.

Pure torch (the shard rule is :mod:`gradsync.algorithms.param_server`, the transport
:mod:`gradsync.comm.ps`); :mod:`gradsync.strategies.async_ps` installs it under Lightning.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch


def shard_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], idx: list[int]) -> Any:
    """``(make_optimizer, lr_groups)`` for the shard holding ``params[i] for i in idx``.

    ``make_optimizer(copies)`` builds the worker's optimizer class with its hyperparameters over the
    shard's own copies, one param group per worker group the shard touches (``lr_groups``, their
    indices: a push carries every group's current learning rate)."""
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    lr_groups = sorted({group_of[id(params[i])] for i in idx})

    def make_optimizer(copies: list) -> torch.optim.Optimizer:
        param_groups = []
        for wg in lr_groups:
            hyper = {k: v for k, v in optimizer.param_groups[wg].items() if k != "params"}
            mine = [c for c, i in zip(copies, idx) if group_of[id(params[i])] == wg]
            param_groups.append({**hyper, "params": mine})
        try:
            return type(optimizer)(param_groups, **optimizer.defaults)
        except TypeError:
            return type(optimizer)(param_groups)

    return make_optimizer, lr_groups


def merge_saved_shards(parts: list[dict]) -> tuple[Optional[dict], int]:
    """Every saved shard's parameters, optimizer state and version, whichever rank hosted it:
    ``(merged or None, number of shards)``."""
    merged: dict = {"params": {}, "optimizer": {}, "versions": {}, "version": 0}
    count = 0
    for part in parts:
        for j, shard in part.get("shards", {}).items():
            merged["params"].update(shard["params"])
            merged["optimizer"].update(shard["optimizer"])
            merged["versions"][int(j)] = shard["version"]
            count += 1
    if not count:
        return None, 0
    merged["version"] = max(merged["versions"].values())
    return merged, count


class WorkerClock:
    """One worker's steps and the seconds it spent waiting on pulls and sending pushes."""

    def __init__(self) -> None:
        self.steps, self.pull_wait_seconds, self.push_seconds = 0, 0.0, 0.0
        self.first_step: Optional[float] = None
        self.last_step: Optional[float] = None

    def pulled(self, seconds: float) -> None:
        self.pull_wait_seconds += seconds
        if self.first_step is None:
            self.first_step = time.perf_counter()

    def pushed(self, seconds: float) -> None:
        self.push_seconds += seconds
        self.steps += 1
        self.last_step = time.perf_counter()

    def summary(self) -> dict:
        seconds = (self.last_step - self.first_step) if self.first_step is not None and self.last_step is not None \
            else 0.0
        # steps after the first one, over the time between the first pull and the last push
        rate = round((self.steps - 1) / seconds, 3) if seconds > 0 and self.steps > 1 else None
        return {"steps": self.steps, "pull_wait_seconds": round(self.pull_wait_seconds, 4),
                "push_seconds": round(self.push_seconds, 4), "seconds": round(seconds, 4), "steps_per_second": rate}


def shard_stats(servers: dict) -> dict:
    """Each local server thread's counters and staleness histogram (read under its lock)."""
    out = {}
    for j, thread in servers.items():
        with thread.lock:
            out[j] = {**thread.shard.stats(), "staleness": dict(thread.shard.staleness)}
    return out


def summarize(parts: list[dict], *, max_staleness: int, num_servers: int, staleness_scaling: str) -> dict:
    """The run summary from every rank's ``{"rank", "worker", "shards"}``."""
    shards = {j: s for p in parts for j, s in p["shards"].items()}
    first = shards[min(shards)] if shards else {"staleness": {}}
    hist = {int(k): int(v) for k, v in first["staleness"].items()}
    n = sum(hist.values())
    return {
        "max_staleness": max_staleness,
        "num_servers": num_servers,
        "staleness_scaling": staleness_scaling,
        # every gradient is applied once per shard; shard 0's view is the distribution
        "staleness": {str(k): hist[k] for k in sorted(hist)},
        "staleness_mean": round(sum(k * v for k, v in hist.items()) / n, 4) if n else None,
        "staleness_max_observed": max(hist) if hist else None,
        "server_updates": first.get("updates"),
        "server_version": first.get("version"),
        "gradients_per_update": (round(first["gradients_applied"] / first["updates"], 3)
                                 if first.get("updates") else None),
        "pushes": sum(s["pushes"] for s in shards.values()),
        "pulls": sum(s["pulls"] for s in shards.values()),
        "shards": {str(j): {k: v for k, v in s.items() if k != "staleness"} for j, s in sorted(shards.items())},
        "workers": [{"rank": p["rank"], **p["worker"]} for p in parts],
    }


def lost_report(what: str, exc: BaseException, *, rank: int, world_size: int, servers: dict) -> str:
    """One line naming the likely lost worker, from the local servers' view of their workers."""
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = detail.split("] ", 1)[-1].split(". This is", 1)[0]
    msg = f"async_ps: lost contact with another process during {what} on rank {rank} ({detail})"
    seen: dict = {}
    computing: dict = {}
    for thread in servers.values():
        with thread.lock:
            seen.update(thread.last_seen)
            computing.update({w: v for w, (state, v) in thread.shard.claims.items() if state == "pulled"})
    if seen:
        now = time.monotonic()
        ages = {w: now - t for w, (t, _) in seen.items()}
        ages.update({w: float("inf") for w in range(world_size) if w not in ages})
        listed = ", ".join(f"rank {w} {'never' if ages[w] == float('inf') else f'{ages[w]:.1f} s ago'}"
                           + (f" at version {seen[w][1]}" if w in seen else "") for w in sorted(ages))
        msg += f"; last request per worker: {listed}"
        # a worker that pulled and never pushed is the one the others were waiting for
        suspects = sorted(computing, key=lambda w: (computing[w], -ages[w])) or [max(ages, key=lambda w: ages[w])]
        w = suspects[0]
        held = f" (pulled version {computing[w]} and never pushed)" if w in computing else ""
        msg += f"; rank {w} is the likely lost worker{held}"
    return msg + "; torchrun --max-restarts (gradsync --max-restarts N) restarts the job from last.ckpt"
