"""Every recipe trains on 1 and 2 processes under sync and under a non-sync strategy.

Tiny model sizes keep each fit near a second. Under sync, 2 processes x batch b must equal
1 process x batch 2b for the recipes without batch norm (the data-order contract and, for chargpt,
the per-token loss weight); cifar10's batch norm keeps per-process statistics between rounds (checked below).
"""

import importlib.util
import math

import lightning as L
import pytest
import torch

from fake_cifar import write_fake_cifar10
from gradsync.recipes import (CharData, CharGPT, Cifar10Data, Cifar10ResNet, SyntheticData, SyntheticModel)
from gradsync.recipes.base import lr_factor
from gradsync.strategies import STRATEGIES
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(180)

STEPS = 4
SCHEDULE = dict(scheduler="cosine", warmup_steps=2, min_lr_ratio=0.1)


def make_chargpt(batch, root):
    # SGD so that equivalence is tight; the schedule is on, to be checked against the logged lr.
    return (CharGPT(n_layer=1, n_head=2, n_embd=32, block_size=16, optimizer="sgd", lr=0.5, weight_decay=0.0,
                    **SCHEDULE),
            CharData(max_chars=20_000, batch_size=batch))


def make_synthetic(batch, root):
    return (SyntheticModel(num_params=20_000, num_layers=2, lr=0.05, **SCHEDULE),
            SyntheticData(num_samples=256, num_val_samples=32, batch_size=batch))


def make_cifar10(batch, root):
    write_fake_cifar10(root, per_batch=8)
    return Cifar10ResNet(width=4, lr=0.05, **SCHEDULE), Cifar10Data(root=str(root), batch_size=batch)


def make_hf_causal_lm(batch, root):
    from gradsync.recipes.hf_causal_lm import HFCausalLM, TextData

    return (HFCausalLM(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=16, optimizer="sgd", lr=0.5,
                       weight_decay=0.0, **SCHEDULE),
            TextData(max_chars=20_000, batch_size=batch))


RECIPES = {
    # recipe: (builder, a non-sync strategy with options that act within 4 steps, exact under sync)
    "chargpt": (make_chargpt, ("compressed", {"codec": "int8"}), True),
    "synthetic": (make_synthetic, ("local_sgd", {"period": 2}), True),
    "cifar10": (make_cifar10, ("diloco", {"period": 2}), False),
}
if importlib.util.find_spec("transformers") is not None:  # the optional extra gradsync[hf]
    RECIPES["hf_causal_lm"] = (make_hf_causal_lm, ("diloco", {"period": 2, "fragments": 2}), True)


def params_only(model_state: dict) -> dict:
    # batch-norm running statistics are per process (not synchronized by DDP after the last step)
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    return {k: v for k, v in model_state.items() if not k.endswith(buffers)}


def run(recipe, tmp_path, *, strategy, options, devices, batch):
    L.seed_everything(0, verbose=False)
    model, data = RECIPES[recipe][0](batch, tmp_path / "data")
    ranks = fit(model, data, strategy=STRATEGIES[strategy](**options), devices=devices, max_steps=STEPS,
                out=tmp_path / f"{strategy}{devices}")
    for r in ranks:
        assert r["global_step"] == STEPS
        assert all(torch.isfinite(v.float()).all() for v in r["params"].values())
        assert r["metrics"]["train_samples_per_sec"] > 0
    # the logged lr is the last step's: warm-up then cosine, as the schedule says
    expected_lr = model.lr * lr_factor(STEPS - 1, decay_steps=STEPS, **SCHEDULE)
    assert ranks[0]["metrics"]["lr"] == pytest.approx(expected_lr, rel=1e-5)
    # every strategy ends these runs with all ranks holding the same weights
    for r in ranks[1:]:
        assert max_abs_diff(params_only(ranks[0]["params"]), params_only(r["params"])) == 0.0
    return model, ranks


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_under_sync_one_and_two_processes(tmp_path, recipe):
    model, one = run(recipe, tmp_path, strategy="sync", options={}, devices=1, batch=4)
    _, two = run(recipe, tmp_path, strategy="sync", options={}, devices=2, batch=2)
    assert math.isfinite(one[0]["metrics"]["train_loss"]) and math.isfinite(two[0]["metrics"]["train_loss"])
    if RECIPES[recipe][2]:
        diff = max_abs_diff(params_only(one[0]["params"]), params_only(two[0]["params"]))
        assert diff <= 1e-5, f"{recipe}: 2 processes x batch 2 differ from 1 process x batch 4 by {diff}"
    if recipe == "chargpt":  # tokens per sample = block size, and throughput counts all processes
        m = two[0]["metrics"]
        assert m["train_tokens_per_sec"] == pytest.approx(m["train_samples_per_sec"] * 16, rel=1e-4)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_under_a_non_sync_strategy_one_and_two_processes(tmp_path, recipe):
    name, options = RECIPES[recipe][1]
    for devices in (1, 2):
        _, ranks = run(recipe, tmp_path, strategy=name, options=options, devices=devices, batch=2)
        assert ranks[0]["ledger"]["collectives"] > 0 or devices == 1


def val_loss(model, data) -> float:
    model.eval()
    with torch.no_grad():
        losses = [model.compute_loss((x.unsqueeze(0), y.unsqueeze(0)))[0] for x, y in data.val_set]
    return float(torch.stack(losses).mean())


def test_chargpt_loss_falls_and_the_model_writes_from_its_vocabulary(tmp_path):
    L.seed_everything(0, verbose=False)
    model = CharGPT(n_layer=1, n_head=2, n_embd=48, block_size=32, lr=3e-3, warmup_steps=5)
    data = CharData(max_chars=60_000, val_windows=64, batch_size=16)
    data.block_size = model.block_size
    data.setup("fit")
    model.build(data.vocab)
    before = val_loss(model, data)
    assert before == pytest.approx(math.log(len(data.vocab)), abs=0.2)  # an untrained model guesses uniformly
    fit(model, data, max_steps=60, out=tmp_path)
    after = val_loss(model, data)
    assert after < before - 1.0, f"validation loss only went from {before:.3f} to {after:.3f}"
    text = model.sample("def ", 80, seed=0)
    assert len(text) == 80 and set(text) <= set(data.vocab)


@pytest.mark.parametrize("strategy", ["local_sgd", "diloco"])
def test_batch_norm_statistics_agree_after_rounds_unless_kept_local(tmp_path, strategy):
    """cifar10's ResNet keeps BatchNorm statistics; rounds average them (average_buffers, the default)."""
    def buffers(average):
        _, ranks = run("cifar10", tmp_path / str(average), strategy=strategy,
                       options={"period": 2, "average_buffers": average}, devices=2, batch=2)
        return [{k: v for k, v in r["params"].items() if k.endswith(("running_mean", "running_var"))}
                for r in ranks]
    averaged, local = buffers(True), buffers(False)
    assert averaged[0] and max_abs_diff(averaged[0], averaged[1]) <= 1e-6  # the round at step 4 averaged them
    assert max_abs_diff(local[0], local[1]) > 1e-4  # each rank's own data: they differ when kept local
