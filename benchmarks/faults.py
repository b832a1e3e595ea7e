"""faults: a replica group killed about once a minute, against no failure and against torchrun's whole-job restart.

Three one-process replica groups of chargpt under ``diloco`` with ``int8`` meet at ``gradsync lighthouse``
(a quorum of two) with ``--fault-tolerance torchft``. On a fixed, seeded schedule (one failure every ``period``
seconds of the failure-free run's pace, the victim drawn with a seeded generator) a group dies with
SIGKILL at the start of a training step and torchrun (the group's ``--max-restarts``) starts it again at
once, forked from its agent, which imported torch, Lightning and gradsync when the group started; it heals
from a live group while the other two train on. The same schedule, applied to one three-process job that torchrun
restarts whole (``--max-restarts``) from its last checkpoint (``--checkpoint-every``), is today's
alternative. Each is compared with its own failure-free run:

* **goodput**: the failure-free run's time for the same steps ÷ this run's (steps completed ÷ steps a
  failure-free run completes in the same wall time), both timed from the first training step to the
  last group's end;
* **recovery**: kill → the restarted group (or job) takes its first training step, holding the others'
  state (a healed group) or the checkpoint's (a restarted job);
* **steps lost**: process-steps whose work never reached the model: the dead group's local steps since
  its last round and the steps the others took without it (a healed group), every process's steps since
  the last checkpoint (a restarted job, whose other processes stop while it restarts);
* **process-steps kept**: 1 - steps lost ÷ all process-steps, which does not depend on how the groups share
  this machine's cores (the goodput does: a dead group frees them for the others);
* **final loss**: against the failure-free run's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks import slowlink
from benchmarks.common import Report, command_line
from gradsync.recipes.chargpt import CharGPT

EVENTS_ENV, DIE_ENV, PACE_ENV = "GRADSYNC_FAULTS_EVENTS", "GRADSYNC_FAULTS_DIE", "GRADSYNC_FAULTS_STEP_SECONDS"
GROUPS = 3


class DyingCharGPT(CharGPT):
    """chargpt that records when it trains and dies on schedule.

    ``$GRADSYNC_FAULTS_DIE``: ``rank:step,rank:step,...``, entry *i* for the process's *i*-th attempt
    (torchrun's restart count): that rank SIGKILLs itself at the first training step at or after ``step``.
    ``$GRADSYNC_FAULTS_EVENTS``: a folder; each process appends there when its model is built (its
    interpreter has started and imported everything), its first step, its death and its end.
    ``$GRADSYNC_FAULTS_STEP_SECONDS``: every step also sleeps this long (the quick run's pace).
    """

    _started = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._event("built")

    def _event(self, kind: str) -> None:
        folder = os.environ.get(EVENTS_ENV)
        if folder:
            attached = self._trainer is not None
            record = {"event": kind, "t": time.time(), "step": int(self.trainer.global_step) if attached else None,
                      "rank": int(os.environ.get("RANK", 0)), "group": os.environ.get("REPLICA_GROUP_ID"),
                      "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "pid": os.getpid()}
            with open(Path(folder) / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if not self._started:
            self._started = True
            self._event("first_step")
        plan = [e for e in os.environ.get(DIE_ENV, "").split(",") if e]
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if attempt < len(plan):
            rank, step = (int(v) for v in plan[attempt].split(":"))
            if rank == self.trainer.global_rank and self.trainer.global_step >= step:
                self._event("die")
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(os.environ.get(PACE_ENV, 0)))

    def on_train_end(self) -> None:
        super().on_train_end()
        self._event("end")


def _events(folder: Path) -> list[dict]:
    out = []
    for path in folder.glob("*.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["t"])


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo",
            "GRADSYNC_FT_HOSTNAME": "127.0.0.1", **extra}


def _gradsync(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradsync.cli.main", *args]


#: what crosses between the groups (the issue's setting: DiLoCo H = 16 with int8 and error feedback)
CODEC = "int8"


def _fit_args(model: list[str], steps: int, period: int, out: Path) -> list[str]:
    return ["fit", "--model", f"{__name__}.DyingCharGPT", "--data", "gradsync.recipes.chargpt.CharData", *model,
            "--strategy", "diloco", "--strategy.period", str(period), "--strategy.codec", CODEC, "--accelerator", "cpu",
            "--max-steps",
            str(steps), "--val-every", str(steps), "--timeout", "120", "--output-dir", str(out)]


class _Lighthouse:
    def __init__(self, tmp: Path) -> None:
        address = tmp / "lighthouse.address"
        self.proc = subprocess.Popen(_gradsync("lighthouse", "--min-replicas", "2", "--port", "0", "--address-file",
                                               str(address)), env=_env(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not address.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gradsync lighthouse did not start")
            time.sleep(0.1)
        self.address = f"http://127.0.0.1:{address.read_text().strip().rsplit(':', 1)[1]}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run_groups(model: list[str], steps: int, period: int, out: Path, kills: dict[int, list[int]],
               timeout: float, env: Optional[dict] = None) -> dict:
    """Three replica groups; ``kills[g]``: the steps at which group g dies. Each group is a job that torchrun
    restarts (``--max-restarts``), as it would be run on a node of its own: its agent forks the new process."""
    events = out / "events"
    events.mkdir(parents=True)
    lighthouse = _Lighthouse(out)

    def start(g: int) -> subprocess.Popen:
        die = ",".join(f"0:{step}" for step in kills.get(g, []))  # entry i: the i-th attempt dies there
        args = _fit_args(model, steps, period, out / f"group{g}")
        args += ["--devices", "1", "--max-restarts", str(len(kills.get(g, []))), "--fault-tolerance", "torchft",
                 "--lighthouse", lighthouse.address, "--replica-group", str(g), "--replica-groups", str(GROUPS)]
        log = open(out / f"group{g}.log", "a")
        return subprocess.Popen(_gradsync(*args), env=_env(**{EVENTS_ENV: str(events), DIE_ENV: die,
                                                              "REPLICA_GROUP_ID": str(g), **(env or {})}),
                                stdout=log, stderr=subprocess.STDOUT)

    try:
        procs = {g: start(g) for g in range(GROUPS)}
        deadline = time.monotonic() + timeout
        while procs:
            for g, p in list(procs.items()):
                code = p.poll()
                if code is None:
                    continue
                if code != 0:
                    raise RuntimeError(f"replica group {g} failed ({code}): {(out / f'group{g}.log').read_text()[-3000:]}")
                del procs[g]
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica groups did not finish within {timeout:.0f} s")
            time.sleep(0.05)
    finally:
        for p in locals().get("procs", {}).values():
            p.kill()
        lighthouse.stop()
    summaries = {g: json.loads((out / f"group{g}" / "summary.json").read_text()) for g in range(GROUPS)}
    # (the membership figures of a group that never died: a restarted group's summary is its last process's)
    survivor = min(range(GROUPS), key=lambda g: len(kills.get(g, [])))
    return {"events": _events(events), "summary": summaries[0], "survivor": summaries[survivor]}


def run_job(model: list[str], steps: int, period: int, out: Path, kills: list[tuple[int, int]], checkpoint_every: int,
            timeout: float, env: Optional[dict] = None) -> dict:
    """One three-process job; ``kills``: (rank, step) per attempt; torchrun restarts the job from its checkpoint."""
    events = out / "events"
    events.mkdir(parents=True)
    args = _fit_args(model, steps, period, out / "job") + [
        "--devices", str(GROUPS), "--checkpoint-every", str(checkpoint_every), "--max-restarts", str(len(kills))]
    die = ",".join(f"{r}:{s}" for r, s in kills)
    r = subprocess.run(_gradsync(*args), env=_env(**{EVENTS_ENV: str(events), DIE_ENV: die, **(env or {})}),
                       capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"the torchrun job failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {"events": _events(events), "summary": json.loads((out / "job" / "summary.json").read_text())}


def _span(events: list[dict]) -> float:
    """First training step of the run to the end of its last process."""
    starts = [e["t"] for e in events if e["event"] == "first_step"]
    ends = [e["t"] for e in events if e["event"] == "end"]
    return max(ends) - min(starts)


def _recoveries(events: list[dict], key: str) -> list[tuple[float, int, int, float]]:
    """For each death: (seconds until the next process of the same ``key`` trained, step it died at, step it
    came back at, seconds of that spent until the new process had built its model)."""
    out = []
    for i, e in enumerate(events):
        if e["event"] != "die":
            continue
        same = [f for f in events[i + 1:] if key == "attempt" and f["attempt"] > e["attempt"] or
                key != "attempt" and f[key] == e[key]]
        back = next((f for f in same if f["event"] == "first_step"), None)
        built = next((f for f in same if f["event"] == "built"), None)
        if back is not None and built is not None:
            out.append((back["t"] - e["t"], e["step"], back["step"], built["t"] - e["t"]))
    return out


def plot_steps(ax: Any, runs: dict[str, list[dict]]) -> None:
    """Each run's global step against wall time, from its events (starts, deaths, ends)."""
    for name, events in runs.items():
        t0 = min(e["t"] for e in events if e["event"] == "first_step")
        pts = sorted((e["t"] - t0, e["step"]) for e in events if e["event"] in ("first_step", "die", "end"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("global step")
    ax.legend(fontsize=8)


def _whole_corpus(model: list[str]) -> list[str]:
    i = model.index("--data.max_chars")
    return [*model[:i + 1], "4400000", *model[i + 2:]]


def schedule(pace: float, steps: int, every: float, seed: int) -> list[tuple[int, int]]:
    """(victim, step) of each failure: one every ``every`` seconds of a run at ``pace`` steps/s, the
    victim drawn with ``seed``; none in the last tenth of the run."""
    rng = random.Random(seed)
    out, k = [], 1
    while (step := int(round(k * every * pace))) < 0.9 * steps:
        out.append((rng.randrange(GROUPS), step))
        k += 1
    return out


def run(out: Path, quick: bool = False, every: Optional[float] = None, seed: int = 0) -> Report:
    rep = Report("faults", "Lose a replica group about once a minute (torchft heal) vs whole-job restart: chargpt, "
                           "diloco, 3 groups", ["run", "steps", "failures", "seconds", "goodput", "recovery s (mean)",
                                                "recovery s (max)", "of which start-up s", "process-steps lost",
                                                "process-steps kept", "final val_loss",
                                                "loss vs failure-free"], command=command_line())
    model = slowlink.QUICK_MODEL if quick else _whole_corpus(slowlink.with_batch(slowlink.MODEL, 8))
    # about four minutes of training here: three failures a minute apart, within one epoch (no epoch-end save)
    steps, period = (48, 4) if quick else (2400, 16)
    timeout = 240 if quick else 1800
    # quick: one failure at a fifth of the run, and paced steps, so that the survivors outlast the restart
    pace_env = {PACE_ENV: "0.1"} if quick else {}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        clean = run_groups(model, steps, period, tmp_path / "groups", {}, timeout, pace_env)
        pace = steps / _span(clean["events"])
        every = every or (0.2 * steps / pace if quick else 60.0)
        plan = schedule(pace, steps, every, seed)[:1 if quick else None]
        kills: dict[int, list[int]] = {}
        for victim, step in plan:
            kills.setdefault(victim, []).append(step)
        results["replica groups, no failure"] = clean
        results["replica groups, failures (heal)"] = run_groups(model, steps, period, tmp_path / "groups-faults",
                                                                 kills, timeout, pace_env)
        results["torchrun job, no failure"] = run_job(model, steps, period, tmp_path / "job", [], period, timeout,
                                                      pace_env)
        results["torchrun job, failures (restart)"] = run_job(model, steps, period, tmp_path / "job-faults", plan,
                                                              period, timeout, pace_env)
    for name, r in results.items():
        events, s = r["events"], r["summary"]
        failed = "failures" in name
        base = results[name.split(",")[0] + ", no failure"]
        span, base_span = _span(events), _span(base["events"])
        job = name.startswith("torchrun")
        rec = _recoveries(events, "attempt" if job else "group")
        if job:  # every process redoes the steps since the checkpoint the job resumes from
            lost = sum(GROUPS * max(died - back, 0) for _, died, back, _ in rec)
        else:  # the dead group's local steps since its last round, and the steps the others took without it
            lost = sum(died % period + max(back - died, 0) for _, died, back, _ in rec)
        loss, base_loss = s["metrics"].get("val_loss"), base["summary"]["metrics"].get("val_loss")
        rep.rows.append([name, s["global_step"], len([e for e in events if e["event"] == "die"]), span,
                         base_span / span, (sum(r[0] for r in rec) / len(rec)) if rec else "-",
                         max((r[0] for r in rec), default="-"), (sum(r[3] for r in rec) / len(rec)) if rec else "-",
                         lost if failed else 0, 1 - (lost if failed else 0) / (GROUPS * steps), loss,
                         f"{100 * (loss / base_loss - 1):+.2f}%" if loss and base_loss else "-"])
    rep.notes.append(f"failures: one every {every:.0f} s of the failure-free groups' pace ({pace:.2f} steps/s), "
                     f"victims drawn with seed {seed}: {', '.join(f'group {v} at step {s}' for v, s in plan)}; "
                     "the same (rank, step) schedule kills the torchrun job's processes.")
    rep.notes.append("recovery: kill -> the new process's first training step (a healed group: in the quorum, holding "
                     "the others' state; a restarted job: resumed from its checkpoint); start-up: kill -> the new "
                     "process has built its model (interpreter start, imports, set-up), the rest is joining, "
                     "healing or loading the checkpoint.")
    rep.notes.append(f"diloco period {period}, codec {CODEC} with error feedback, {steps} steps, lighthouse "
                     "--min-replicas 2 (heartbeat timeout 2 s, join timeout 5 s); the torchrun job checkpoints every "
                     f"{period} steps (each round) and restarts with --max-restarts; so do the groups (each its own). A restarted "
                     "group's process is forked by its torchrun agent, which imported torch, Lightning and gradsync "
                     "when the group started (--fault-tolerance runs torchrun's agent as python -m gradsync.cli.elastic, with "
                     "--start-method fork); the torchrun job's processes are fresh interpreters that import them "
                     "again. All processes share this machine's cores.")
    rep.notes.append("goodput on this machine: three groups share two cores, so while a group is down (and after it "
                     "heals over the steps it missed, which it never computes) the others step faster; goodput above "
                     "1 is that, not a gain. process-steps kept (1 - lost / all) does not depend on the cores: for "
                     "the healed groups it is the goodput that groups on machines of their own would see, less any "
                     "wait of the survivors at a quorum; a restarted job also loses every process's time while it "
                     "restarts, which only its goodput column holds.")
    rep.notes.append("a healed group starts from no error-feedback residual (what it owed died with it); the "
                     "survivors keep theirs.")
    rep.notes.append("goals (issue): goodput >= 0.90 with one failure a minute, recovery <= 10 s, final loss within "
                     "2% of the failure-free run.")
    rep.data = {"pace": pace, "every": every, "seed": seed, "plan": plan,
                "events": {k: v["events"] for k, v in results.items()},
                "fault_tolerance": {k: v.get("survivor", v["summary"]).get("strategy_stats", {}).get("fault_tolerance")
                                    for k, v in results.items()}}

    rep.write(out, lambda ax: plot_steps(ax, {name: r["events"] for name, r in results.items()}))
    return rep
