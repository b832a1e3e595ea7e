"""The strategy registry: pinned names, Lightning lookup by name, and a smoke run of every strategy.

A new strategy without an entry in SMOKE_SETTINGS fails here: every registered name must run.
"""

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import STRATEGIES, GradsyncStrategy
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(180)

# One registry name per idea; variants are options. Changing this list is an API change.
PINNED_NAMES = ["sync", "accumulate", "local_sgd", "diloco", "compressed", "async_ps"]

# Options that make each strategy do its thing in a 4-step run on 2 processes.
SMOKE_SETTINGS = {
    "sync": ({}, {}),
    "accumulate": ({}, {"accumulate_grad_batches": 2}),
    "local_sgd": ({"period": 2}, {}),
    "diloco": ({"period": 2}, {}),
    "compressed": ({"codec": "int8"}, {}),
    "async_ps": ({"max_staleness": 2, "num_servers": 2}, {"accumulate_grad_batches": 2}),
}


def test_registered_names_are_pinned():
    assert sorted(STRATEGIES) == sorted(PINNED_NAMES)
    for name, cls in STRATEGIES.items():
        assert name in StrategyRegistry, f"{name} is not in Lightning's StrategyRegistry"
        assert StrategyRegistry[name]["strategy"] is cls
        assert cls.describe() and issubclass(cls, GradsyncStrategy)


def test_lightning_resolves_names_to_gradsync_strategies():
    trainer = L.Trainer(strategy="sync", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert type(trainer.strategy) is STRATEGIES["sync"]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_registered_strategy_runs(tmp_path, name):
    assert name in SMOKE_SETTINGS, f"strategy {name!r} has no smoke-test settings in {__file__}"
    options, trainer_kwargs = SMOKE_SETTINGS[name]
    L.seed_everything(0, verbose=False)
    ranks = fit(DigitsClassifier(lr=0.05), DigitsData(batch_size=8), strategy=STRATEGIES[name](**options),
                devices=2, max_steps=4, out=tmp_path, **trainer_kwargs)
    assert all(r["global_step"] == 4 for r in ranks)
    # every strategy ends a run with all ranks holding the same model
    assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    assert ranks[0]["ledger"]["collectives"] > 0 and ranks[0]["ledger"]["wire_bytes"] > 0
