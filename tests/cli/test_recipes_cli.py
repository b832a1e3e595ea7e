"""The recipes through the `gradsync` command (in-process, one process): fit, sample, list, missing data."""

import json

import pytest

from gradsync.cli.main import main

pytestmark = pytest.mark.timeout(120)

TINY_GPT = ["--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "16", "--model.block_size", "16",
            "--data.max_chars", "20000", "--batch-size", "4"]


def test_list_shows_every_recipe(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("digits", "chargpt", "synthetic", "cifar10"))


def test_chargpt_fit_then_sample_from_its_checkpoint(tmp_path, capsys):
    out = tmp_path / "gpt"
    assert main(["fit", "--recipe", "chargpt", *TINY_GPT, "--accelerator", "cpu", "--max-steps", "3",
                 "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"] == "chargpt" and summary["global_step"] == 3
    assert summary["metrics"]["val_ppl"] > 1 and summary["model_options"]["block_size"] == 16
    # the network is built at set-up from the data's vocabulary: resuming must still restore it
    assert main(["fit", "--recipe", "chargpt", *TINY_GPT, "--accelerator", "cpu", "--max-steps", "5",
                 "--output-dir", str(out), "--resume", "auto"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 5 and summary["resumed_from_step"] == 3
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(out), "--prompt", "import", "--num-chars", "40", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("import") and len(text) == len("import") + 40 + 1  # print's newline
    # the same seed gives the same text; a prompt outside the vocabulary is one clear line
    assert main(["sample", "--checkpoint", str(out / "checkpoints" / "last.ckpt"), "--prompt", "import",
                 "--num-chars", "40", "--seed", "1"]) == 0
    assert capsys.readouterr().out == text
    assert main(["sample", "--checkpoint", str(out), "--prompt", "\u00e9\u00e9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradsync: error: ") and "not in the model's vocabulary" in err and "\n" not in err


@pytest.mark.parametrize("args, expected", [
    (["--checkpoint", "/nonexistent/run"], "no checkpoint there"),
    ([], "the following arguments are required: --checkpoint"),
    (["--checkpoint", "x", "--num-chars", "many"], "invalid int value"),
])
def test_sample_bad_input_is_one_line(capsys, args, expected):
    assert main(["sample", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradsync: error: ") and "\n" not in err and expected in err


def test_cifar10_without_data_says_what_to_put_where(tmp_path, capsys):
    assert main(["fit", "--recipe", "cifar10", "--data.root", str(tmp_path), "--accelerator", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradsync: error: --data.root") and "\n" not in err and "Traceback" not in err
    assert f"{tmp_path}/cifar-10-batches-py/data_batch_1..5" in err and "cifar-10-python.tar.gz" in err


def test_synthetic_size_from_the_command_line(tmp_path):
    out = tmp_path / "syn"
    assert main(["fit", "--recipe", "synthetic", "--model.num_params", "50_000", "--model.num_layers", "2",
                 "--data.num_samples", "64", "--accelerator", "cpu", "--max-steps", "2", "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_options"]["num_params"] == 50_000 and summary["metrics"]["val_acc"] is not None
