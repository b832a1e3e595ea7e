"""`--recipe hf_causal_lm`: a Hugging Face transformers GPT-2 (tiny config, tied embedding and LM-head
weights, byte vocabulary) trains from the CLI under sync, compressed int8 and streaming diloco."""

import json
import math
import os
import sys

import cli_process
import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

SMALL = ["--model.block_size", "32", "--data.max_chars", "20000", "--batch-size", "8", "--model.warmup_steps", "2"]


# (compressed codecs on the same model, tied weights included: tests/distributed/test_local_clip.py, in-process)
@pytest.mark.parametrize("strategy", [["sync"], ["diloco", "--strategy.period", "4", "--strategy.fragments", "2"]],
                         ids=["sync", "diloco-fragments"])
def test_gpt2_trains_with_tied_weights_equal_on_every_rank(tmp_path, strategy):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    r = cli_process.run([sys.executable, "-m", "gradsync.cli.main", "fit", "--recipe", "hf_causal_lm", *SMALL,
                        "--devices", "2", "--accelerator", "cpu", "--max-steps", "12", "--strategy", *strategy,
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "gradsync.recipes.hf_causal_lm.HFCausalLM" and summary["global_step"] == 12
    assert summary["params_agree"] is True  # every rank ends with the same weights
    # it learns: a random byte model starts at ln(256) = 5.55
    assert summary["metrics"]["val_loss"] < 0.9 * math.log(256), summary["metrics"]
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    # GPT-2 ties its LM head to the token embedding: still one tensor after training under the strategy
    assert torch.equal(state["net.lm_head.weight"], state["net.transformer.wte.weight"])


def test_the_hf_recipe_options_are_checked_before_launch(capsys):
    from gradsync.cli.main import main

    assert main(["fit", "--recipe", "hf_causal_lm", "--model.arch", "no_such_arch", "--accelerator", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradsync: error: --model.arch no_such_arch:") and "\n" not in err, err
    assert main(["fit", "--recipe", "hf_causal_lm", "--model.n_head", "3", "--accelerator", "cpu"]) == 2
    assert "--model.n_head 3: must divide n_embd=64" in capsys.readouterr().err
