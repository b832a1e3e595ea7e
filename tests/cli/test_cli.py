"""The `gradsync` command end to end: real processes through torchrun, and every bad input."""

import json
import os
import sys

import cli_process
import pytest
import torch

from gradsync.cli.main import main
from gradsync.strategies.parts import read_parts

pytestmark = pytest.mark.timeout(240)

REQUIRED_SUMMARY_KEYS = {
    "recipe", "strategy", "strategy_options", "world_size", "num_nodes", "backend", "accelerator", "seed",
    "global_step", "micro_batch_size", "global_batch_size", "metrics", "comm", "wall_seconds",
    "samples_per_second", "restarts", "resumed_from_step", "checkpoint",
}


def gradsync(*args, timeout=200):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return cli_process.run([sys.executable, "-m", "gradsync.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_fit_two_processes_writes_summary_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    r = gradsync("fit", "--recipe", "digits", "--strategy", "sync", "--devices", "2", "--accelerator", "cpu",
                 "--max-steps", "20", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert REQUIRED_SUMMARY_KEYS <= summary.keys()
    assert summary["world_size"] == 2 and summary["num_nodes"] == 1 and summary["backend"] == "gloo"
    assert summary["global_step"] == 20 and summary["strategy"] == "sync"
    assert summary["global_batch_size"] == 2 * summary["micro_batch_size"]
    assert {"train_loss", "val_loss", "val_acc"} <= summary["metrics"].keys()
    assert all(v is not None for v in summary["metrics"].values())
    # what each process holds, from tensor storage: fp32 weights, their gradients and SGD's momentum
    # buffer, 4 bytes per parameter each, on both processes alike; sync keeps no state of its own
    from gradsync.recipes import DigitsClassifier

    numel = sum(p.numel() for p in DigitsClassifier().parameters())
    memory = summary["memory"]
    assert (memory["parameter_bytes"], memory["gradient_bytes"], memory["optimizer_state_bytes"]) == (4 * numel,) * 3
    assert memory["algorithm_state_bytes"] == 0
    assert memory["total_bytes"] == memory["max_total_bytes_any_process"] == 12 * numel
    assert "memory / process" in r.stdout
    comm = summary["comm"]
    assert comm["compression_ratio"] == 1.0 and comm["collectives"] == 20 and comm["wire_bytes"] > 0
    # DDP's own all-reduce (no Python hook): its bytes are booked, its time is not measured, and no
    # share of training time is made up for it
    assert comm["seconds"] is None and summary["comm_time_share"] is None
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 20 and "conv1.weight" in ckpt["state_dict"]
    # every rank's algorithm state, each in its own file next to last.ckpt (none gathered to rank 0)
    assert "ranks" not in ckpt["gradsync"] and len(read_parts(out / "checkpoints" / "last.ckpt")) == 2
    assert sorted(p.name.split("-")[0] for p in (out / "checkpoints" / "last.ckpt.ranks").iterdir()) == \
        ["rank00000", "rank00001"]  # the previous checkpoints' parts were removed


def test_memory_counts_diloco_global_parameters_and_outer_momentum_as_algorithm_state(tmp_path):
    from gradsync.recipes import DigitsClassifier

    out = tmp_path / "run"
    assert main(["fit", "--recipe", "digits", "--strategy", "diloco", "--strategy.period", "2", "--accelerator", "cpu",
                 "--max-steps", "4", "--output-dir", str(out)]) == 0
    memory = json.loads((out / "summary.json").read_text())["memory"]
    numel = sum(p.numel() for p in DigitsClassifier().parameters())
    assert memory["parameter_bytes"] == memory["optimizer_state_bytes"] == 4 * numel
    # θ and the outer Nesterov momentum, 4 bytes per parameter each (plus a few step counters)
    assert 8 * numel <= memory["algorithm_state_bytes"] <= 8 * numel + 1024, memory


def test_fit_accumulate_reports_k(tmp_path):
    out = tmp_path / "acc"
    r = gradsync("fit", "--recipe", "digits", "--strategy", "accumulate", "--global-batch-size", "128",
                 "--batch-size", "16", "--devices", "2", "--accelerator", "cpu", "--max-steps", "5",
                 "--output-dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "global batch 128 = 16 micro-batch x 4 accumulation x 2 processes" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accumulation_steps"] == 4 and summary["global_batch_size"] == 128
    assert summary["comm"]["collectives"] == 5  # one all-reduce per optimizer step


def test_bad_input_is_one_line_exit_2_no_traceback():
    r = gradsync("fit", "--recipe", "nope")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "nope" in r.stderr and "digits" in r.stderr


@pytest.mark.parametrize("args, expected", [
    (["--recipe", "nope"], "--recipe 'nope' is unknown; available recipes: digits"),
    (["--strategy", "nope"], "--strategy 'nope' is unknown; gradsync strategies: sync"),
    (["--lr", "-1"], "--lr -1.0: must be > 0"),
    (["--devices", "0"], "--devices 0: must be >= 1"),
    (["--batch-size", "0"], "--batch-size 0: must be an integer >= 1"),
    (["--model", "no_such_pkg.Model", "--data", "gradsync.recipes.digits.DigitsData"], "--model 'no_such_pkg.Model'"),
    (["--model", "gradsync.recipes.digits.Nope", "--data", "gradsync.recipes.digits.DigitsData"], "has no class 'Nope'"),
    (["--strategy.bucket_cap_mb", "0"], "--strategy.bucket_cap_mb 0.0: must be > 0"),
    (["--max-steps", "0"], "--max-steps 0: must be >= 1"),
    (["--global-batch-size", "100", "--batch-size", "16", "--devices", "2"], "valid values include 32, 64"),
    (["--global-batch-size", "16", "--batch-size", "16", "--devices", "2"], "multiple of batch size 16 x 2"),
    (["--strategy", "accumulate"], "--strategy accumulate needs --global-batch-size"),
    (["--strategy", "ddp", "--strategy.bucket_cap_mb", "3"], "unrecognized arguments"),
    (["--model.channels", "abc"], "model.channels"),
    (["--resume", "/nonexistent/last.ckpt"], "does not exist"),
    (["--output-dir", "/proc/gradsync-run"], "--output-dir /proc/gradsync-run: cannot be created"),
    (["--nnodes", "0"], "--nnodes 0: must be >= 1"),
    (["--num-nodes", "0"], "--num-nodes 0: must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2: must be in 0..1 (one less than --nnodes)"),
    (["--master-port", "0"], "--master-port 0: must be a TCP port"),
    (["--max-restarts", "-1"], "--max-restarts -1: must be >= 0"),
    (["--timeout", "0"], "must be > 0 seconds"),
    (["--config", "/nonexistent/run.yaml"], "/nonexistent/run.yaml"),
    (["--strategy", "diloco", "--strategy.scope", "node", "--devices", "2"],
     "--strategy.scope node: synchronizes across nodes, and this run has 1 node (2 process(es))"),
    (["--strategy", "compressed", "--strategy.scope", "node", "--strategy.procs_per_node", "3", "--devices", "2"],
     "--strategy.procs_per_node 3: must divide the number of processes (2)"),
    (["--strategy", "diloco", "--strategy.outer_momentum_warmup", "-1"], "--strategy.outer_momentum_warmup -1"),
    (["--strategy", "diloco", "--strategy.period", "6", "--strategy.fragments", "4"],
     "--strategy.fragments 4: must divide --strategy.period 6"),
    (["--strategy", "diloco", "--strategy.period", "8", "--strategy.fragments", "2", "--strategy.sync_delay", "4"],
     "--strategy.sync_delay 4: must be < period/fragments = 4"),
    (["--strategy", "local_sgd", "--strategy.codec", "int8", "--strategy.rank", "8"],
     "--strategy.rank 8: is not used by codec int8"),
    (["--model", "os.path", "--data", "gradsync.recipes.digits.DigitsData"], "--model 'os.path': module 'os' has no class"),
    (["--model", "collections.OrderedDict", "--recipe", "digits"], "must be a subclass of lightning.pytorch.core.module"),
    (["--data", "collections.OrderedDict", "--recipe", "digits"], "must be a subclass of lightning.pytorch.core.datamodule"),
    (["--model", "gradsync.recipes.digits.DigitsClassifier"], "--model gradsync.recipes.digits.DigitsClassifier needs --data"),
    (["--strategy.backend", "nccl"], "--strategy.backend nccl: NCCL needs CUDA devices"),
    # Lightning's own strategies are checked against the accelerator as L.Trainer does, before launch
    (["--strategy", "fsdp", "--accelerator", "cpu", "--devices", "2"],
     "--strategy: fsdp with --accelerator cpu: The strategy `fsdp` requires a GPU accelerator"),
    (["--strategy", "compressed", "--strategy.backend", "nccl", "--devices", "2"], "--strategy.backend nccl"),
    (["--devcies", "2"], "unknown flag --devcies; did you mean --devices?"),
    (["--strategy", "no_such_pkg.Strategy"], "--strategy 'no_such_pkg.Strategy': cannot import module"),
    (["--strategy", "collections.OrderedDict"], "must be a subclass of lightning.pytorch.strategies"),
])
def test_bad_inputs(capsys, args, expected):
    assert main(["fit", "--accelerator", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradsync: error: ") and "\n" not in err
    assert expected in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_accelerator_without_a_gpu_is_one_line(capsys):
    assert main(["fit", "--accelerator", "gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--accelerator gpu: no GPU here" in err and "use --accelerator cpu" in err


def test_doctor_bad_devices_is_one_line(capsys):
    assert main(["doctor", "--devices", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "gradsync: error: --devices 0: must be >= 1"


def test_hand_written_yaml_takes_strategy_by_name(tmp_path):
    from gradsync.cli.main import parse_run

    cfg = tmp_path / "run.yaml"
    cfg.write_text("recipe: digits\nstrategy: local_sgd\nmax_steps: 3\n")
    spec = parse_run("fit", ["--config", str(cfg), "--strategy.period", "2"])
    assert (spec.strategy, spec.strategy_options["period"], spec.max_steps) == ("local_sgd", 2, 3)


def test_unknown_command_is_one_line(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "gradsync: error: unknown command 'frobnicate'; choose one of fit, validate, test, list, doctor, " \
                  "compare, sample, export, lighthouse"


def test_corrupt_checkpoint_is_one_line(tmp_path, capsys):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["fit", "--accelerator", "cpu", "--resume", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "corrupt or not a checkpoint" in err and str(bad) in err and "\n" not in err


def test_list_names_recipes_and_strategies(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "digits" in out and "sync" in out and "accumulate" in out


def test_user_model_by_import_path_and_output_dir_protection(tmp_path, capsys, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    # the user writes the network, the loss (with its weight) and the data; the base does the rest
    (pkg / "models.py").write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "from gradsync.recipes import Recipe, RecipeData\n\n"
        "class Tiny(Recipe):\n"
        "    def __init__(self, *, hidden: int = 8, **kwargs):\n"
        "        super().__init__(**kwargs)\n"
        "        self.save_hyperparameters()\n"
        "        self.net = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))\n\n"
        "    def compute_loss(self, batch):\n"
        "        x, y = batch\n"
        "        return torch.nn.functional.cross_entropy(self.net(x), y), len(y)\n\n"
        "class Blobs(RecipeData):\n"
        "    def setup(self, stage):\n"
        "        g = torch.Generator().manual_seed(0)\n"
        "        x = torch.randn(96, 6, generator=g)\n"
        "        y = x[:, :3].argmax(1)\n"
        "        self.train_set, self.val_set = TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    args = ["fit", "--model", "userpkg.models.Tiny", "--data", "userpkg.models.Blobs", "--batch-size", "8",
            "--model.hidden", "12", "--model.scheduler", "cosine", "--model.warmup_steps", "2",
            "--accelerator", "cpu", "--max-steps", "3", "--output-dir", str(out)]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "userpkg.models.Tiny" and summary["model_options"]["hidden"] == 12
    assert summary["data"] == "userpkg.models.Blobs" and summary["model_options"]["scheduler"] == "cosine"
    assert summary["global_step"] == 3
    logged = (out / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train_loss", "lr", "train_samples_per_sec", "val_loss"} <= set(logged)
    before = (out / "checkpoints" / "last.ckpt").read_bytes()
    # a second run into the same directory must not touch its checkpoint unless resuming it
    capsys.readouterr()
    assert main(args) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert (out / "checkpoints" / "last.ckpt").read_bytes() == before
    # resuming it is allowed: the run continues from step 3 to 5
    assert main([*args[:-4], "--max-steps", "5", "--output-dir", str(out), "--resume", "auto"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 5 and summary["resumed_from_step"] == 3


def test_print_config_round_trips_through_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--strategy", "sync", "--strategy.bucket_cap_mb", "7", "--lr", "0.02", "--print_config"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    from gradsync.cli.main import parse_run

    spec = parse_run("fit", ["--config", str(cfg)])
    assert spec.strategy == "sync" and spec.strategy_options["bucket_cap_mb"] == 7.0
    assert spec.model_options["lr"] == 0.02
    # a flag after --config wins over the file
    spec = parse_run("fit", ["--config", str(cfg), "--lr", "0.3"])
    assert spec.model_options["lr"] == 0.3


def test_time_figures_are_cumulative_across_resumes(tmp_path):
    """Training time, samples/s and the communication share count every attempt of the run, so a
    resume neither divides the run's communication by one attempt's time nor resets the throughput.
    (``compressed``: its hook times its collectives; ``sync``'s run inside DDP, untimed.)"""
    out = tmp_path / "run"
    args = ["fit", "--recipe", "digits", "--strategy", "compressed", "--strategy.codec", "int8", "--accelerator", "cpu",
            "--output-dir", str(out)]

    def summary_after(*extra):
        assert main([*args, *extra]) == 0
        return json.loads((out / "summary.json").read_text())

    first = summary_after("--max-steps", "6")
    second = summary_after("--max-steps", "12", "--resume", "auto")
    again = summary_after("--max-steps", "12", "--resume", "auto")  # a finished run: no step runs
    assert (first["global_step"], second["global_step"], again["global_step"]) == (6, 12, 12)
    assert second["train_seconds"] > first["train_seconds"] > 0
    for s in (first, second, again):
        assert s["comm_time_share"] == pytest.approx(s["comm"]["seconds"] / s["train_seconds"], rel=0.01, abs=1e-4)
        assert 0 < s["comm_time_share"] < 1
        assert s["samples_per_second"] == pytest.approx(s["global_step"] * 32 / s["train_seconds"], rel=0.01)
    assert again["train_seconds"] == pytest.approx(second["train_seconds"], abs=2e-3)
    assert again["comm_time_share"] == pytest.approx(second["comm_time_share"], abs=2e-3)
    assert again["samples_per_second"] == pytest.approx(second["samples_per_second"], rel=0.01)
