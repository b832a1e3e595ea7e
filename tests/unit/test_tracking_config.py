"""Tracking pieces without a run: logger choice, W&B run id precedence, redaction, the resumable CSV log."""

import csv

import pytest

from gradsync.errors import GradsyncError
from gradsync.platform.tracking import (REDACTED, TrackingConfig, _AppendingWriter, redact, secret_values,
                                        wandb_run_id)


@pytest.mark.parametrize("logger, wandb, env, expected", [
    (None, None, {}, "csv"),
    (None, None, {"WANDB_PROJECT": "p", "WANDB_MODE": "offline"}, "wandb"),  # W&B configured by its variables
    (None, {"mode": "offline"}, {}, "wandb"),  # ... or by any --wandb.* flag
    ("tensorboard", None, {"WANDB_PROJECT": "p"}, "tensorboard"),
    ("wandb", {"mode": "disabled"}, {}, "wandb"),  # disabled needs no login
])
def test_logger_choice(logger, wandb, env, expected):
    assert TrackingConfig.from_flags(logger, wandb, env=env).logger == expected


def test_tags_from_a_comma_list():
    cfg = TrackingConfig.from_flags("wandb", {"tags": "a, b,,c", "mode": "offline"}, env={})
    assert cfg.wandb.tags == ["a", "b", "c"]


def test_online_without_login_is_refused_before_any_work(tmp_path):
    env = {"NETRC": str(tmp_path / "netrc")}
    with pytest.raises(GradsyncError, match="no W&B login was found"):
        TrackingConfig.from_flags("wandb", None, env=env)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert TrackingConfig.from_flags("wandb", None, env=env).logger == "wandb"  # `wandb login` wrote ~/.netrc


def test_run_id_stored_beats_environment_beats_new(tmp_path):
    a = wandb_run_id(tmp_path / "a", env={"WANDB_RUN_ID": "fromenv1"})
    assert a == "fromenv1" and (tmp_path / "a" / "wandb_run_id").read_text().strip() == "fromenv1"
    assert wandb_run_id(tmp_path / "a", env={"WANDB_RUN_ID": "other"}) == "fromenv1"  # a resume keeps its run
    b = wandb_run_id(tmp_path / "b", env={})
    assert len(b) == 8 and wandb_run_id(tmp_path / "b", env={}) == b
    wandb_run_id(tmp_path / "c", env={"RANK": "1"})  # only rank 0 writes the file
    assert not (tmp_path / "c" / "wandb_run_id").exists()


def test_redaction_by_name_and_by_value():
    env = {"WANDB_API_KEY": "k" * 40, "HF_TOKEN": "hf_" + "t" * 30, "PATH": "/usr/bin:/bin/long/enough"}
    secrets = secret_values(env)
    assert secrets == {"k" * 40, "hf_" + "t" * 30}
    out = redact({"api_key": "x", "tokens_per_second": 5.0, "note": f"url?key={'k' * 40}",
                  "nested": {"password": "hunter2", "list": ["hf_" + "t" * 30, 1]}}, secrets)
    assert out == {"api_key": REDACTED, "tokens_per_second": 5.0, "note": f"url?key={REDACTED}",
                   "nested": {"password": REDACTED, "list": [REDACTED, 1]}}


def _rows(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if v} for r in csv.DictReader(f)]


def test_csv_log_keeps_history_and_drops_repeated_steps(tmp_path):
    first = _AppendingWriter(str(tmp_path), trim=True)
    for step in range(8):
        first.log_metrics({"train_loss": 1.0 / (step + 1)}, step=step)
    first.log_metrics({"val_loss": 0.5}, step=5)  # validated the step-5 checkpoint
    first.save()
    # the run died after step 7; the restart resumes from the step-5 checkpoint and logs steps 5.. again
    second = _AppendingWriter(str(tmp_path), trim=True)
    for step in (5, 6):
        second.log_metrics({"train_loss": 9.0, "comm/wire_bytes": 1.0}, step=step)
    second.save()
    rows = _rows(tmp_path / "metrics.csv")
    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if "train_loss" in r]
    assert train == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 0.25), (4, 0.2), (5, 9.0), (6, 9.0)]
    assert [int(r["step"]) for r in rows if "val_loss" in r] == [5]  # the checkpoint's validation stays
    # validate/test on a run dir only appends
    third = _AppendingWriter(str(tmp_path), trim=False)
    third.log_metrics({"val_loss": 0.4}, step=0)
    third.save()
    assert len(_rows(tmp_path / "metrics.csv")) == len(rows) + 1
