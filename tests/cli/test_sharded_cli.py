"""``--strategy.shard node`` from the command line: chargpt under sharded diloco with int8 across nodes,
two nodes of two processes played on one machine, then ``gradsync export`` of its sharded checkpoint."""

import json

import pytest
import torch

from gradsync.cli.main import main
from gradsync.recipes import CharGPT

pytestmark = pytest.mark.timeout(240)


def test_sharded_diloco_trains_from_the_cli_and_exports_one_state_dict(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["fit", "--recipe", "chargpt", "--model.n_layer", "2", "--model.n_embd", "64", "--strategy", "diloco",
            "--strategy.shard", "node", "--strategy.codec", "int8", "--strategy.procs_per_node", "2",
            "--strategy.period", "4", "--devices", "4", "--accelerator", "cpu", "--max-steps", "8",
            "--data.max_chars", "200000", "--data.val_windows", "8",  # a slice of the corpus: start-up in seconds
            "--output-dir", str(out)]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    vocab = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["chargpt_vocab"]
    full, fresh = CharGPT(n_layer=2, n_embd=64), CharGPT(n_layer=2, n_embd=64)
    full.build(vocab)
    fresh.build(vocab)
    model_bytes = sum(p.numel() * 4 for p in full.parameters())
    memory = summary["memory"]
    # each process holds half the model (FSDP2 over the node's 2 processes), and half its AdamW state
    assert memory["parameter_bytes"] <= 0.55 * model_bytes
    assert memory["optimizer_state_bytes"] <= 0.55 * 2 * model_bytes
    scopes = summary["comm"]["by_scope"]
    assert scopes["intra_node"]["wire_bytes"] > 0  # FSDP2's all-gathers and reduce-scatters
    assert scopes["inter_node"]["compression_ratio"] > 3.5  # rounds every 4 steps, int8
    # FSDP2's gathers have no fp32-sync equivalent: no ratio (not 0.0); the headline is the ratio across nodes
    assert scopes["intra_node"]["compression_ratio"] is None and scopes["intra_node"]["logical_bytes"] == 0
    from gradsync.platform.report import summary_rows

    rows = dict(summary_rows(summary))
    inter = scopes["inter_node"]["compression_ratio"]
    assert rows["compression ratio"].startswith(f"{inter:.4g} across nodes (")
    # two nodes played by two processes each on one machine: said so, not "4 x 1"
    assert summary["layout"] == {"num_nodes": 2, "procs_per_node": 2, "forced": True}
    assert rows["processes x nodes"].startswith("2 x 2 (gloo, cpu), nodes played by --strategy.procs_per_node 2")
    # every node's replica holds the same shards after the last round (each process compares its own shard
    # with the same shard on the other node)
    assert summary["params_agree"] is True
    capsys.readouterr()
    assert main(["export", str(out)]) == 0
    state = torch.load(out / "model.pt", weights_only=True)
    full.load_state_dict(state)  # strict: the unsharded module's every key
    assert any(not torch.equal(state[k], v) for k, v in fresh.state_dict().items())
    # gradsync sample reads the sharded checkpoint: the recipe's own class (not FSDP2's generated FSDPCharGPT),
    # its weights gathered from the shards
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["gradsync_recipe"]["model_class"] == "gradsync.recipes.chargpt.CharGPT"
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(out), "--prompt", "def ", "--num-chars", "40",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    full.eval()
    assert text == "def " + full.sample("def ", 40, temperature=0) + "\n"  # (print's newline)
    # the checkpoint written after fit also holds the whole model: Lightning's load_from_checkpoint reads it
    loaded = CharGPT.load_from_checkpoint(out / "checkpoints" / "last.ckpt", map_location="cpu")
    assert all(torch.equal(loaded.state_dict()[k], state[k]) for k in state)
