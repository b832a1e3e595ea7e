"""Faults through the real launcher: a killed worker, a missing peer, mismatched configurations, secrets."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cli_process
import pytest
import torch

from harness import free_port

pytestmark = pytest.mark.timeout(300)

SECRET = "fake-secret-key-0123456789"


def _env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(var, None)
    return env


def _cmd(*args):
    return [sys.executable, "-m", "gradsync.cli.main", *args]


def _workers(marker: str) -> list[int]:
    """The worker processes of the run whose command line holds ``marker``: started by torchrun, so ``-u``
    precedes ``-m gradsync.cli.main``; the launcher's own command has no ``-u``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in argv and b"-u" in argv and b"gradsync.cli.main" in argv:
                found.append(int(entry.name))
    return found


RUN = ["fit", "--recipe", "digits", "--strategy", "sync", "--accelerator", "cpu", "--devices", "2",
       "--batch-size", "16", "--max-steps", "150", "--checkpoint-every", "10"]


def test_killed_worker_restarts_resumes_and_matches_uninterrupted_run(tmp_path):
    env = _env(WANDB_API_KEY=SECRET, MY_SERVICE_TOKEN=SECRET)
    out = tmp_path / "killed"
    wandb = ["--logger", "wandb", "--wandb.mode", "offline", "--wandb.project", "gradsync-tests"]
    proc = cli_process.popen(_cmd(*RUN, *wandb, "--max-restarts", "1", "--output-dir", str(out)), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ckpt = out / "checkpoints" / "last.ckpt"
    deadline = time.time() + 120
    while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert ckpt.exists(), "no checkpoint appeared"
    workers = _workers(str(out))
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    log = proc.communicate(timeout=200)[0]
    assert proc.returncode == 0, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["global_step"] == 150
    assert summary["resumed_from_step"] is not None and 10 <= summary["resumed_from_step"] < 150
    # one W&B run across torchrun's restart: each attempt wrote into the run the output dir names
    run_id = (out / "wandb_run_id").read_text().strip()
    attempts = sorted((out / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(d.name.endswith(f"-{run_id}") for d in attempts), attempts
    assert summary["tracking"]["wandb_run_id"] == run_id

    ref = tmp_path / "ref"
    r = cli_process.run(_cmd(*RUN, "--output-dir", str(ref)), env=_env(), capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    a = torch.load(ckpt, weights_only=True)["state_dict"]
    b = torch.load(ref / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6

    # no secret from the environment reaches any file of the run, or its output
    assert SECRET not in log
    for f in out.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f"secret leaked into {f}"


def test_missing_peer_fails_within_the_timeout(tmp_path):
    start = time.time()
    r = cli_process.run(_cmd("fit", "--recipe", "digits", "--accelerator", "cpu", "--devices", "1", "--nnodes", "2",
                            "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                            "--max-steps", "5", "--timeout", "4", "--output-dir", str(tmp_path / "run")),
                       env=_env(), capture_output=True, text=True, timeout=120)
    elapsed = time.time() - start
    assert r.returncode != 0
    # one line, naming the address and the wait, with torchrun's own reason; not its traceback
    err = r.stderr.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("gradsync: error: not every node joined at 127.0.0.1:") and "within 4 s" in err, err
    assert "1/2 clients joined" in err or "Timed out" in err, err
    assert elapsed < 60, f"took {elapsed:.0f} s to notice the missing peer"


def test_mismatched_configs_stop_every_rank_naming_the_field(tmp_path):
    port = free_port()
    base = ["fit", "--recipe", "digits", "--accelerator", "cpu", "--devices", "1", "--nnodes", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-steps", "5", "--timeout", "60",
            "--output-dir", str(tmp_path / "run")]
    procs = [cli_process.popen(_cmd(*base, "--node-rank", "0"), env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True),
             cli_process.popen(_cmd(*base, "--node-rank", "1", "--strategy.bucket_cap_mb", "30"), env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    logs = [p.communicate(timeout=200)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode != 0
        assert "ranks were started with different configurations: strategy.bucket_cap_mb differ" in log
