"""A LightningModule and DataModule gradsync did not write, through `gradsync fit --model --data`."""

import json
import os
import sys
from pathlib import Path

import cli_process
import pytest

from gradsync.cli.main import main

pytestmark = pytest.mark.timeout(240)

PROBE = (Path(__file__).parents[1] / "probe.py").read_text()  # tests/probe.py


def test_plain_datamodule_is_split_across_processes_and_no_validation_is_fine(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PROBE_DIR": str(tmp_path),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = cli_process.run([sys.executable, "-m", "gradsync.cli.main", "fit", "--model", "probe.Probe", "--data",
                        "probe.ProbeData", "--devices", "2", "--accelerator", "cpu", "--max-steps", "8",
                        "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation_step" not in r.stderr  # no final validation of a module that has none
    seen = [[int(v) for line in (tmp_path / f"rank{k}.txt").read_text().split("\n") if line for v in line.split()]
            for k in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 8 * 4  # 8 steps of 4 samples on each rank: one epoch in all
    assert not set(seen[0]) & set(seen[1]), "both ranks trained on the same samples"
    assert set(seen[0]) | set(seen[1]) == set(range(64)), "the ranks did not cover the epoch"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 8
    # the batch size is the train loader's (the DataModule has no batch_size attribute)
    assert summary["micro_batch_size"] == 4 and summary["global_batch_size"] == 8
    assert summary["samples_per_second"] > 0
    # train_loss as Lightning finds it (the training_step's return value): the module logs nothing
    loss = summary["metrics"]["train_loss"]
    assert loss is not None and 0 < loss < 1e4, loss
    progress = [line for line in r.stdout.splitlines() if line.startswith("step 8/8")]
    assert progress and f"samples/s {summary['samples_per_second']:,.0f}" in progress[0], r.stdout[-2000:]


def test_global_batch_size_without_a_batch_size_attribute_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["fit", "--model", "probe.Probe", "--data", "probe.ProbeData", "--strategy", "accumulate",
                 "--global-batch-size", "8", "--accelerator", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert "--global-batch-size 8 needs the micro-batch size" in err and "`batch_size` attribute" in err
