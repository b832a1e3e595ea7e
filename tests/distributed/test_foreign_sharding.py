"""A plain DataModule (an ordinary DataLoader, no sharding of its own) under every gradsync strategy
from a plain ``L.Trainer``: the ranks train on disjoint samples whose union is the epoch."""

import os

import pytest

from gradsync.strategies import STRATEGIES
from harness import fit
from probe import Probe, ProbeData

pytestmark = pytest.mark.timeout(120)

SAMPLES, BATCH = 64, 4  # as tests/probe.py's ProbeData


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_plain_datamodule_is_sharded_under_every_strategy(tmp_path, monkeypatch, name):
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    steps = SAMPLES // (2 * BATCH)  # one epoch over both ranks
    # (use_distributed_sampler is Lightning's default; the harness turns it off for the recipes)
    ranks = fit(Probe(), ProbeData(), strategy=STRATEGIES[name](), devices=2, max_steps=steps, out=tmp_path,
                use_distributed_sampler=True)
    seen = [[int(v) for line in (tmp_path / f"rank{r}.txt").read_text().split("\n") if line for v in line.split()]
            for r in (0, 1)]
    assert ranks[0]["global_step"] == steps
    assert len(seen[0]) == len(seen[1]) == SAMPLES // 2, [len(s) for s in seen]
    assert not set(seen[0]) & set(seen[1]), f"{name}: both ranks trained on the same samples"
    assert set(seen[0]) | set(seen[1]) == set(range(SAMPLES)), f"{name}: the ranks did not cover the epoch"
