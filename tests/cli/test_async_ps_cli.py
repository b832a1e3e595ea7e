"""`gradsync fit --strategy async_ps` end to end: three workers, the staleness distribution in the summary."""

import json
import os
import re
import sys

import cli_process
import pytest
import torch

from gradsync.cli.main import main
from gradsync.strategies.parts import read_parts

pytestmark = pytest.mark.timeout(240)


def test_async_ps_on_three_processes_reports_staleness(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    r = cli_process.run([sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "digits", "--strategy", "async_ps",
                        "--strategy.max_staleness", "3", "--devices", "3", "--accelerator", "cpu", "--max-steps", "20",
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    ps = summary["strategy_stats"]
    hist = {int(k): v for k, v in ps["staleness"].items()}
    assert sum(hist.values()) == 60  # every pushed gradient of the 3 workers x 20 steps was applied once
    assert max(hist) <= 3 == ps["max_staleness"]  # the bound held for every applied gradient
    assert ps["pushes"] == 60 and ps["pulls"] == 60 and ps["server_version"] == ps["server_updates"]
    assert [w["steps"] for w in ps["workers"]] == [20, 20, 20]
    assert summary["params_agree"] is True  # every rank ends with the server's model
    assert "staleness" in r.stdout and "histogram" in r.stdout
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert read_parts(out / "checkpoints" / "last.ckpt")[0]["shards"][0]["version"] == ps["server_version"]


def test_too_many_servers_is_a_one_line_error(capsys):
    code = main(["fit", "--recipe", "digits", "--strategy", "async_ps", "--strategy.num_servers", "4",
                 "--devices", "3", "--accelerator", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--strategy.num_servers 4" in err and "<= the number of processes (3)" in err


DYING = '''
import os
from gradsync.recipes import DigitsClassifier


class DyingDigits(DigitsClassifier):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 2 and self.trainer.global_step == 5:
            os._exit(17)  # the process is gone: no exception, no goodbye
        return super().training_step(batch, batch_idx)
'''


def test_a_worker_that_dies_stops_the_job_and_is_named(tmp_path):
    (tmp_path / "dying.py").write_text(DYING)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = cli_process.run([sys.executable, "-m", "gradsync.cli.main", "fit", "--model", "dying.DyingDigits",
                        "--data", "gradsync.recipes.digits.DigitsData", "--strategy", "async_ps", "--devices", "3",
                        "--accelerator", "cpu", "--max-steps", "40", "--output-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=200, env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    # torchrun's report lists every process that failed. Its "Root Cause" is the smallest timestamp, in whole
    # seconds with ties going to the lowest rank, so a survivor that dies in the same second as the lost worker
    # can take that slot: look for the lost worker's own entry instead, wherever the report puts it.
    report = out[out.index("FAILED\n"):]
    entries = re.split(r"\n\s*\[\d+\]:\n", report)[1:]
    assert any("rank      : 2 (" in e and "exitcode  : 17" in e for e in entries), report[:1500]
    assert "gradsync: error: the launched processes failed" in out
