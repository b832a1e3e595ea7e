"""Run tracking end to end: an offline W&B run read back with W&B's record schema, one W&B run across
resumes, plain CI output and its summary table, `gradsync compare`, and no secret in a run's files."""

import json
import os
import re
import sys

import cli_process
import pytest
import torch

from gradsync.cli.main import main
from wandb_records import OfflineRun

pytestmark = pytest.mark.timeout(240)

FAKE_KEY = "gradsync-fake-api-key-0123456789abcdef"
FAKE_TOKEN = "gradsync-fake-hf-token-9876543210"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but \t and \n: colours, \r redraws, bells
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """One 2-process run with --logger wandb in offline mode, a fake API key and token in its environment."""
    out = tmp_path_factory.mktemp("tracking") / "local_sgd"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_API_KEY": FAKE_KEY,
           "HF_TOKEN": FAKE_TOKEN}
    env.pop("WANDB_DIR", None)
    r = cli_process.run(
        [sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "digits", "--strategy", "local_sgd",
         "--strategy.period", "4", "--devices", "2", "--accelerator", "cpu", "--max-steps", "12",
         "--batch-size", "16", "--output-dir", str(out), "--logger", "wandb", "--wandb.project", "gradsync-tests",
         "--wandb.tags", "ci,local_sgd"],
        capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_offline_wandb_run_holds_config_and_comm_history(wandb_run):
    out, _ = wandb_run
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, run_dirs  # rank 0 only: one W&B run for two processes
    run = OfflineRun(run_dirs[0])
    summary = json.loads((out / "summary.json").read_text())
    assert run.run_id == (out / "wandb_run_id").read_text().strip() == summary["tracking"]["wandb_run_id"]
    assert run.project == "gradsync-tests" and run.tags == ["ci", "local_sgd"]
    # the resolved config: strategy and its options, world size, global batch, versions
    cfg = run.config
    assert cfg["strategy"] == "local_sgd" and cfg["strategy_options"]["period"] == 4
    assert cfg["world_size"] == 2 and cfg["num_nodes"] == 1 and cfg["global_batch_size"] == 32
    assert cfg["accumulation_steps"] == 1 and cfg["precision"] and cfg["versions"]["torch"]
    # the ledger every optimizer step
    steps = [h for h in run.history if "comm/wire_bytes" in h]
    assert [h["trainer/global_step"] for h in steps] == list(range(12))
    wire = [h["comm/wire_bytes"] for h in steps]
    assert wire == sorted(wire) and wire[-1] == summary["comm"]["wire_bytes"] > 0
    # local SGD with period 4 averages after steps 4, 8 and 12 only: the bytes grow in three equal jumps
    assert wire[3] > 0 and wire == [wire[3] * ((i + 1) // 4) for i in range(12)]
    assert all(0 <= h["comm/time_share"] for h in steps) and all(h["perf/step_seconds"] > 0 for h in steps)
    assert any("val_acc" in h for h in run.history)
    # the final run summary
    assert run.summary["global_step"] == 12 and run.summary["comm"]["wire_bytes"] == summary["comm"]["wire_bytes"]
    assert run.summary["metrics"]["val_acc"] == pytest.approx(summary["metrics"]["val_acc"])


def test_offline_run_is_syncable(wandb_run):
    out, _ = wandb_run
    r = cli_process.run([sys.executable, "-m", "wandb", "sync", "--dry-run", *map(str, (out / "wandb").glob("offline-run-*"))],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr
    assert "Would sync 1 run" in r.stdout + r.stderr


def test_no_secret_in_output_dir_or_output(wandb_run):
    out, r = wandb_run
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) > 5
    for p in files:
        data = p.read_bytes()
        assert FAKE_KEY.encode() not in data and FAKE_TOKEN.encode() not in data, p
    assert FAKE_KEY not in r.stdout + r.stderr and FAKE_TOKEN not in r.stdout + r.stderr


def _table(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if len(cells) == 2 and cells[0]:
            rows[cells[0]] = cells[1]
    return rows


def test_plain_output_and_summary_table(wandb_run):
    """Output to a pipe (as in CI): no control characters, progress as lines, the table's numbers right."""
    out, r = wandb_run
    assert not CONTROL.search(r.stdout) and not CONTROL.search(r.stderr)
    progress = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert progress and progress[-1].startswith("step 12/12  train_loss ") and "comm " in progress[-1]
    assert "samples/s" in progress[-1]
    summary = json.loads((out / "summary.json").read_text())
    table = _table(r.stdout)
    assert table["strategy"] == "local_sgd" and table["training steps"] == "12"
    assert table["processes x nodes"].startswith("2 x 1 (gloo")
    assert table["train_loss"] == f"{summary['metrics']['train_loss']:.4g}"
    assert table["val_acc"] == f"{summary['metrics']['val_acc']:.4g}"
    assert f"({summary['comm']['wire_bytes']:,} B)" in table["wire bytes (per rank)"]
    assert f"({summary['comm']['logical_bytes']:,} B)" in table["fp32 sync would send"]
    assert table["compression ratio"] == f"{summary['comm']['compression_ratio']:.4g}"
    assert table["collectives"] == str(summary["comm"]["collectives"])
    assert table["W&B run"] == f"{summary['tracking']['wandb_run_id']}, offline"


def test_resumed_run_appends_to_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = tmp_path / "run"
    args = ["fit", "--accelerator", "cpu", "--logger", "wandb", "--output-dir", str(out)]
    assert main([*args, "--max-steps", "3"]) == 0
    run_id = (out / "wandb_run_id").read_text().strip()
    assert main([*args, "--max-steps", "6", "--resume", "auto"]) == 0
    assert (out / "wandb_run_id").read_text().strip() == run_id
    runs = [OfflineRun(d) for d in sorted((out / "wandb").glob("offline-run-*"))]
    assert [r.run_id for r in runs] == [run_id, run_id]  # `wandb sync` uploads both into one run, in order
    first, second = ([h["trainer/global_step"] for h in r.history if "comm/wire_bytes" in h] for r in runs)
    assert first == [0, 1, 2] and second == [3, 4, 5]
    assert runs[1].summary["resumed_from_step"] == 3 and runs[1].summary["global_step"] == 6
    # the CSV log keeps the first attempt's rows: every step once
    import csv

    with open(out / "logs" / "metrics.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train_loss")]
    assert steps == list(range(6))


def test_compare_two_runs_writes_table_and_plots(wandb_run, tmp_path, capsys):
    local_sgd, _ = wandb_run
    sync = tmp_path / "sync"
    # a 1-process run, through TensorBoard as well (its event file is the TensorBoard logger's proof)
    assert main(["fit", "--accelerator", "cpu", "--max-steps", "8", "--batch-size", "32", "--logger",
                 "tensorboard", "--output-dir", str(sync)]) == 0
    assert list((sync / "tensorboard").glob("events.out.tfevents.*"))
    capsys.readouterr()
    plots = tmp_path / "plots"
    assert main(["compare", str(sync), str(local_sgd), "--output-dir", str(plots)]) == 0
    text = capsys.readouterr().out
    assert not CONTROL.search(text)
    header = next(line for line in text.splitlines() if "sync" in line and "local_sgd" in line)
    assert header.index("sync") < header.index("local_sgd")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in (plots / "comparison.md").read_text().splitlines()[2:] if line.startswith("|")}
    assert rows["strategy"] == ["sync", "local_sgd"] and rows["training steps"] == ["8", "12"]
    # numbers, and the runs' own: each run's samples/s and final loss as its summary.json has them
    for i, run in enumerate((sync, local_sgd)):
        summary = json.loads((run / "summary.json").read_text())
        assert float(rows["samples/s"][i].replace(",", "")) == pytest.approx(summary["samples_per_second"], rel=0.01)
        assert float(rows["wall time s"][i]) == pytest.approx(summary["wall_seconds"], rel=0.01)
    assert rows["processes x nodes"] == ["1 x 1", "2 x 1"] and "period=4" in rows["options"][1]
    assert "Options of every run: " in (plots / "comparison.md").read_text()  # the shared DDP options, once
    for name in ("loss_vs_step.png", "loss_vs_wire_bytes.png", "val_vs_wall_time.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert (width, height) == (700, 420), name
        # drawn lines, not an empty frame: pixels of both runs' colours (matplotlib's C0 and C1)
        assert _pixels_of(plots / name, (31, 119, 180)) > 80 and _pixels_of(plots / name, (255, 127, 14)) > 80, name


def _pixels_of(png, rgb, tol=40):
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3] * 255
    return int((abs(img - torch.tensor(rgb, dtype=torch.float32).numpy()).max(axis=-1) < tol).sum())


def test_compare_missing_or_foreign_dir_is_one_line(tmp_path, capsys):
    assert main(["compare", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gradsync: error: compare: run directory {tmp_path / 'nope'} does not exist"
    assert main(["compare", str(tmp_path)]) == 2  # exists, but no run finished there
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradsync: error: ") and "\n" not in err and "has no summary.json" in err


@pytest.mark.parametrize("args, env, expected", [
    (["--logger", "csv", "--wandb.project", "p"], {}, "--wandb.project only apply to --logger wandb"),
    (["--logger", "wandb", "--wandb.mode", "online"], {"WANDB_API_KEY": None},
     "no W&B login was found (WANDB_API_KEY or `wandb login`); log in, or pass --wandb.mode offline"),
    (["--logger", "nope"], {}, "logger"),
])
def test_tracking_flag_errors(tmp_path, monkeypatch, capsys, args, env, expected):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    for k, v in env.items():
        monkeypatch.delenv(k, raising=False) if v is None else monkeypatch.setenv(k, v)
    assert main(["fit", "--accelerator", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradsync: error: ") and "\n" not in err and expected in err


def test_list_is_a_plain_table_off_a_terminal(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert not CONTROL.search(out)
    names = [c.strip() for line in out.splitlines() for c in re.split(r"[│┃]", line)[1:2]]
    assert {"digits", "sync", "local_sgd", "compressed"} <= set(names)


SECRET_OPTION_MODULE = '''
from gradsync.recipes import DigitsClassifier


class TokenDigits(DigitsClassifier):
    """The digits model with two string options a user might pass a credential through."""

    def __init__(self, *, api_token: str = "", note: str = "", **kwargs):
        super().__init__(**kwargs)
        self.api_token, self.note = api_token, note
'''


def test_secrets_in_options_and_environment_are_redacted_everywhere(tmp_path, monkeypatch, capsys):
    """A credential-named option, and an option whose value equals a credential in the environment,
    reach no file of the run: summary, logs, hyperparameters, checkpoint, W&B run files."""
    (tmp_path / "tokmod.py").write_text(SECRET_OPTION_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    named_secret = "literal-api-token-55555"
    out = tmp_path / "run"
    assert main(["fit", "--model", "tokmod.TokenDigits", "--recipe", "digits", "--model.api_token", named_secret,
                 "--model.note", FAKE_TOKEN, "--accelerator", "cpu", "--max-steps", "3", "--output-dir", str(out),
                 "--logger", "wandb", "--wandb.mode", "offline", "--wandb.project", "gradsync-tests"]) == 0
    printed = capsys.readouterr()
    files = [p for p in out.rglob("*") if p.is_file()]
    kinds = {p.name for p in files}
    assert {"summary.json", "metrics.csv", "hparams.yaml", "last.ckpt"} <= kinds and any(
        p.suffix == ".wandb" for p in files), kinds
    for p in files:
        data = p.read_bytes()
        for secret in (named_secret, FAKE_TOKEN, FAKE_KEY):
            assert secret.encode() not in data, f"{secret} in {p.relative_to(out)}"
    for secret in (named_secret, FAKE_TOKEN, FAKE_KEY):
        assert secret not in printed.out + printed.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_options"]["api_token"] == summary["model_options"]["note"] == "<redacted>"
