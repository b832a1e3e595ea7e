"""`gradsync fit --strategy compressed` end to end: the issue's command works and reports its ratio."""

import json
import math
import os
import sys

import cli_process
import pytest

pytestmark = pytest.mark.timeout(240)


def test_fit_compressed_int8_reports_its_compression_ratio(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = cli_process.run(
        [sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "digits", "--strategy", "compressed",
         "--strategy.codec", "int8", "--devices", "2", "--accelerator", "cpu", "--max-steps", "5",
         "--output-dir", str(out)],
        capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "compressed" and summary["strategy_options"]["codec"] == "int8"
    assert summary["global_step"] == 5
    # int8 with 512-entry chunks: 4 / (1 + 4/512) minus shard padding
    assert 3.9 < summary["comm"]["compression_ratio"] < 4.0
    # both byte counts written out independently: the model fits one bucket; fp32 sync on 2 ranks sends
    # 4 bytes per entry, int8's two hops 2 x (shard + 4 bytes per 512-entry chunk)
    from gradsync.recipes import DigitsClassifier

    n = sum(p.numel() for p in DigitsClassifier().parameters())
    shard = math.ceil(n / 2)
    assert summary["comm"]["logical_bytes"] == 5 * 4 * n
    assert summary["comm"]["wire_bytes"] == 5 * 2 * (shard + 4 * math.ceil(shard / 512))
