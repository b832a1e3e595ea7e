"""Every L.Trainer argument is a `gradsync fit` flag, and each reaches the Trainer.

The flags come from Lightning's own signature, so these tests build the Trainer from parsed flags
(no fit) and check the Trainer holds each value; one real CLI run checks the path end to end.
"""

import inspect
import json
import os
import sys

import cli_process
import lightning as L
import pytest

from gradsync.cli.main import main, parse_run
from gradsync.platform.run import _RunClock, build_strategy, build_trainer, resolve_accumulation
from gradsync.platform.trainer_args import OWNED, flag_names, trainer_parameter_names

pytestmark = pytest.mark.timeout(240)


def trainer_from(*flags, tmp_path=None):
    spec = parse_run("fit", ["--recipe", "digits", "--accelerator", "cpu", *flags])
    data = spec.data_class(**spec.data_options)
    global_batch, k = resolve_accumulation(spec, None, int(data.batch_size))
    trainer = build_trainer(spec, build_strategy(spec.strategy, spec.strategy_options), _RunClock(),
                            accumulation=k, global_batch=global_batch, shards_itself=True)
    return spec, trainer


def test_the_flags_are_lightnings_signature_less_what_gradsync_flags_set():
    signature = [n for n in inspect.signature(L.Trainer.__init__).parameters if n != "self"]
    assert list(trainer_parameter_names()) == signature  # read from Lightning's source without importing it
    names = set(flag_names().values())
    assert names == set(signature) - set(OWNED)
    assert {"--precision", "--gradient-clip-val", "--gradient_clip_val", "--accumulate-grad-batches",
            "--val-check-interval", "--log-every-n-steps", "--sync-batchnorm"} <= set(flag_names())


def test_short_flags_reach_the_trainer():
    _, trainer = trainer_from("--precision", "bf16-mixed", "--gradient-clip-val", "1.0",
                              "--gradient_clip_algorithm", "value", "--accumulate-grad-batches", "3",
                              "--val-check-interval", "7", "--log-every-n-steps", "5", "--sync-batchnorm",
                              "--limit-val-batches", "2", "--detect-anomaly", "true", "--max-time", "00:00:10:00")
    assert trainer.precision == "bf16-mixed"
    assert trainer.gradient_clip_val == 1.0 and trainer.gradient_clip_algorithm == "value"
    assert trainer.accumulate_grad_batches == 3
    assert trainer.val_check_interval == 7 and trainer.log_every_n_steps == 5
    assert trainer.strategy._layer_sync is not None  # --sync-batchnorm alone means true
    assert trainer.limit_val_batches == 2
    assert trainer._detect_anomaly is True
    from lightning.pytorch.callbacks import Timer

    timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
    assert timer._duration == 600


def test_gradsync_defaults_and_derived_values_hold_when_not_given():
    _, trainer = trainer_from("--global-batch-size", "128", "--batch-size", "32")
    assert trainer.precision == "32-true" and trainer.gradient_clip_val is None
    assert trainer.accumulate_grad_batches == 4  # derived from --global-batch-size
    assert trainer.log_every_n_steps == 1 and trainer.num_sanity_val_steps == 0
    assert trainer.strategy._layer_sync is None


def test_val_every_counts_optimizer_steps_across_epochs():
    """Lightning's own default (check_val_every_n_epoch=1) never overrides what --val-every derives."""
    _, trainer = trainer_from("--val-every", "500")
    assert trainer.check_val_every_n_epoch is None and trainer.val_check_interval == 500
    _, trainer = trainer_from("--val-every", "5", "--global-batch-size", "96", "--batch-size", "32")
    assert trainer.accumulate_grad_batches == 3 and trainer.val_check_interval == 15  # batches: steps x K
    _, trainer = trainer_from()  # not given: Lightning's once per epoch
    assert trainer.check_val_every_n_epoch == 1 and trainer.val_check_interval == 1.0


@pytest.mark.parametrize("flags, check", [
    # each derived option keeps its derived value unless the user gives it
    ((), lambda t: t.accumulate_grad_batches == 1 and t.num_sanity_val_steps == 0 and t.log_every_n_steps == 1),
    (("--num-sanity-val-steps", "2", "--log-every-n-steps", "7"),
     lambda t: t.num_sanity_val_steps == 2 and t.log_every_n_steps == 7),
    (("--check-val-every-n-epoch", "3"), lambda t: t.check_val_every_n_epoch == 3 and t.val_check_interval == 1.0),
    (("--use-distributed-sampler", "true"), lambda t: t._accelerator_connector.use_distributed_sampler),
    ((), lambda t: not t._accelerator_connector.use_distributed_sampler),  # the recipes shard their own data
    (("--enable-checkpointing", "false"), lambda t: t.checkpoint_callback is None),
])
def test_derived_options_yield_only_to_what_the_user_gave(flags, check):
    _, trainer = trainer_from(*flags)
    assert check(trainer), flags


def test_val_every_past_an_epoch_in_a_real_run(tmp_path):
    """--val-every 30 on digits (45 batches an epoch on 1 process): validation at steps 30 and 60, the
    second in the second epoch (a count restarted each epoch would put it at 75; one refused past an epoch
    would end in Lightning's ValueError)."""
    import csv

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    r = cli_process.run([sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "digits", "--devices", "1",
                        "--accelerator", "cpu", "--max-steps", "70", "--val-every", "30", "--batch-size", "32",
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader((out / "logs" / "metrics.csv").open()))
    assert max(int(row["epoch"]) for row in rows) >= 1  # the run crossed an epoch
    validated = [int(row["step"]) + 1 for row in rows if row.get("val_loss")]
    assert validated[:2] == [30, 60] and all(step > 70 for step in validated[2:]), validated  # (+ the final one)


def test_callbacks_and_profiler_by_class_path_are_built():
    _, trainer = trainer_from("--callbacks+", "lightning.pytorch.callbacks.LearningRateMonitor",
                              "--profiler", "simple", "--enable-progress-bar", "false")
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.profilers import SimpleProfiler

    from gradsync.platform.progress import GradsyncProgressBar

    assert any(isinstance(c, LearningRateMonitor) for c in trainer.callbacks)
    assert isinstance(trainer.profiler, SimpleProfiler)
    assert not any(isinstance(c, GradsyncProgressBar) for c in trainer.callbacks)


def test_trainer_flags_from_a_config_file(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("precision: bf16-mixed\ngradient_clip_val: 0.5\n")
    _, trainer = trainer_from("--config", str(cfg), "--gradient-clip-val", "2.0")
    assert trainer.precision == "bf16-mixed" and trainer.gradient_clip_val == 2.0  # flag > config


@pytest.mark.parametrize("args, expected", [
    (["--precision", "bf17"], "--precision bf17: not one of its values; use one of 64, 32, 16, "),
    (["--precision=fp17"], "bf16-mixed, 32-true"),
    (["--strategy", "compressed", "--strategy.codec", "int3"],
     "--strategy.codec int3: not one of its values; use one of identity, fp16, bf16, int8, int4, sign, topk"),
    (["--strategy", "diloco", "--strategy.shard", "node", "--devices", "2"],
     "--strategy.shard node: makes each node one replica"),
    (["--gradient-clip-vall", "1"], "did you mean --gradient-clip-val"),
    (["--val-every", "5", "--val-check-interval", "3"], "--val-every 5 and --val-check-interval 3"),
    # refused by L.Trainer itself, before any process is launched
    (["--gradient-clip-algorithm", "foo"], "--gradient-clip-algorithm foo: `gradient_clip_algorithm` foo is invalid"),
    (["--max-time", "abc"], "--max-time abc: `Timer(duration='abc')` is not a valid duration"),
    (["--accumulate-grad-batches", "3", "--global-batch-size", "64", "--batch-size", "32"],
     "--accumulate-grad-batches 3 disagrees with --global-batch-size 64"),
])
def test_bad_trainer_flags_are_one_line(capsys, args, expected):
    assert main(["fit", "--recipe", "digits", "--accelerator", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


def test_help_lists_the_trainer_flags(capsys):
    os.environ["COLUMNS"] = "200"
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    for flag in ("--precision", "--gradient-clip-val", "--accumulate-grad-batches", "--val-check-interval",
                 "--log-every-n-steps", "--sync-batchnorm", "--callbacks"):
        assert flag in out, flag


def test_precision_and_clipping_reach_the_trainer_of_a_real_run(tmp_path):
    out = tmp_path / "run"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": f"{tests}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = cli_process.run([sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "digits", "--devices", "2",
                        "--accelerator", "cpu", "--max-steps", "4", "--precision", "bf16-mixed",
                        "--gradient-clip-val", "0.5", "--callbacks+", "trainer_probe.TrainerArgsProbe",
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads((out / "trainer_args.json").read_text())
    assert seen == {"precision": "bf16-mixed", "gradient_clip_val": 0.5, "world_size": 2,
                    "autocast_dtype": "torch.bfloat16"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 4
    assert summary["trainer_options"]["precision"] == "bf16-mixed" and summary["trainer_options"]["gradient_clip_val"] == 0.5
    assert "fast_dev_run" not in summary["trainer_options"]  # only what was given
