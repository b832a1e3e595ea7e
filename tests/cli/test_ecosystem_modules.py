"""Modules of kinds gradsync did not write (tests/ecosystem_modules.py) from `gradsync fit --model --data`
and from plain L.Trainer: a layer the loss never uses, BatchNorm buffers, two optimizers."""

import json
import os
import sys
from pathlib import Path

import cli_process
import pytest

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parents[1]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
            "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def gradsync(*args, timeout=200):
    return cli_process.run([sys.executable, "-m", "gradsync.cli.main", "fit", "--data", "ecosystem_modules.RandomData",
                           "--devices", "2", "--accelerator", "cpu", *args],
                          capture_output=True, text=True, timeout=timeout, env=env())


def test_unused_layer_names_the_strategy_option_on_the_cli(tmp_path):
    r = gradsync("--model", "ecosystem_modules.UnusedLayer", "--strategy", "diloco", "--max-steps", "4")
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.strip() and "available:" not in line]
    assert errors == [
        "gradsync: error: DiLoCoStrategy: some parameters got no gradient in a training step (a layer the loss "
        "does not use); set --strategy.find_unused_parameters true to let DDP skip them, or freeze them "
        "(requires_grad=False)"], r.stderr[-3000:]
    # the option it names is the fix: the flag is the strategy's argument of that name (checked in-process,
    # a second CLI run costs ~18 s)
    from ecosystem_modules import RandomData, UnusedLayer
    from gradsync.strategies import DiLoCoStrategy
    from harness import fit

    ranks = fit(UnusedLayer(), RandomData(), strategy=DiLoCoStrategy(find_unused_parameters=True), devices=2,
                max_steps=4, out=tmp_path / "run")
    assert [r["global_step"] for r in ranks] == [4, 4]


PLAIN = """
import lightning as L
from gradsync.strategies.compressed import CompressedStrategy
from ecosystem_modules import RandomData, UnusedLayer

trainer = L.Trainer(strategy=CompressedStrategy(codec="int8"), accelerator="cpu", devices=2, max_steps=4,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(UnusedLayer(), datamodule=RandomData())
"""


def test_unused_layer_names_the_constructor_argument_under_plain_lightning(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    e = env()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GRADSYNC_ENTRY"):
        e.pop(var, None)
    r = cli_process.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=e,
                       cwd=tmp_path)
    assert r.returncode != 0
    assert ("RuntimeError: CompressedStrategy: some parameters got no gradient in a training step (a layer the "
            "loss does not use); set find_unused_parameters=True to let DDP skip them") in r.stderr, r.stderr[-3000:]
    assert "ddp_find_unused_parameters_true" not in r.stderr and "--strategy." not in r.stderr


def summary_of(tmp_path, name, *args):
    out = tmp_path / name
    r = gradsync("--model", "ecosystem_modules.BatchNormNet", "--output-dir", str(out), *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_buffers_agree_says_whether_batchnorm_statistics_match_across_ranks(tmp_path):
    # sync: DDP broadcasts rank 0's buffers before each forward, then each rank's forward updates its
    # running statistics from its own batch, so the ranks end apart while the weights agree
    sync = summary_of(tmp_path, "sync", "--strategy", "sync", "--max-steps", "6")
    assert sync["params_agree"] is True and sync["buffers_agree"] is False
    # (--sync-batchnorm makes them agree under sync: tests/distributed/test_sync_batchnorm.py computes its
    # statistics over the global batch, tests/cli/test_trainer_flags.py takes the flag to the trainer)
    # diloco's rounds average the buffers with the parameters
    diloco = summary_of(tmp_path, "diloco", "--strategy", "diloco", "--strategy.period", "3", "--max-steps", "6")
    assert diloco["params_agree"] is True and diloco["buffers_agree"] is True


def test_two_optimizers_count_batches_as_training_steps(tmp_path):
    # manual optimization, two optimizer.step() per batch: Lightning's global_step grows by 2 a batch
    out = tmp_path / "two"
    # (each backward reaches half the parameters: DDP needs find_unused_parameters, as for any GAN)
    r = gradsync("--model", "ecosystem_modules.TwoOptimizers", "--strategy", "sync", "--max-steps", "10",
                 "--strategy.find_unused_parameters", "true", "--batch-size", "8", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # 10 batches of 8 samples on each of 2 processes: 160 samples
    assert summary["global_step"] == 10 and summary["optimizer_steps"] == 20
    assert summary["global_batch_size"] == 16
    sps, train_seconds = summary["samples_per_second"], summary["train_seconds"]
    assert sps == pytest.approx(10 * 16 / train_seconds, rel=0.02), (sps, train_seconds)
    progress = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert progress[0].startswith("step 1/10") and progress[-1].startswith("step 10/10"), progress
    assert f"samples/s {sps:,.0f}" in progress[-1]
    assert "10 (20 optimizer steps)" in r.stdout  # the text summary shows both counts
