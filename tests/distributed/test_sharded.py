"""Sharding inside the node (``shard="node"``): FSDP2 over a node's processes, gradsync across nodes.

Two nodes of two processes are played on one machine (``procs_per_node=2``: ranks 0-1 are node 0,
ranks 2-3 node 1), as in the node-scope tests.
"""

from pathlib import Path

import lightning as L
import pytest
import torch

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import DiLoCoStrategy, LocalSGDStrategy, SyncStrategy
from gradsync.strategies.compressed import CompressedStrategy
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(300)


def model(momentum=0.0, seed=0, **kwargs):
    L.seed_everything(seed, verbose=False)
    return DigitsClassifier(lr=0.1, momentum=momentum, **kwargs)


def test_sharded_sync_is_sync_on_four_processes(tmp_path):
    sync = fit(model(0.9), DigitsData(batch_size=8), strategy=SyncStrategy(), devices=4, max_steps=8,
               out=tmp_path / "s")
    sharded = fit(model(0.9), DigitsData(batch_size=8), strategy=SyncStrategy(shard="node", procs_per_node=2),
                  devices=4, max_steps=8, out=tmp_path / "h")
    for a, b in zip(sync, sharded):
        assert max_abs_diff(a["params"], b["params"]) <= 1e-5
    assert max_abs_diff(sharded[0]["params"], model().state_dict()) > 1e-3  # it trained


@pytest.mark.parametrize("cls", [DiLoCoStrategy, LocalSGDStrategy], ids=["diloco", "local_sgd"])
def test_sharded_rounds_equal_node_scoped_replicas(tmp_path, cls):
    """Each node one replica, sharded over its two processes == each node one replica held whole by
    both (node scope): the same inner steps, the same rounds across nodes."""
    kwargs = dict(period=3, procs_per_node=2)
    node = fit(model(0.9), DigitsData(batch_size=8), strategy=cls(scope="node", **kwargs), devices=4, max_steps=8,
               out=tmp_path / "n")
    sharded = fit(model(0.9), DigitsData(batch_size=8), strategy=cls(shard="node", **kwargs), devices=4, max_steps=8,
                  out=tmp_path / "h")
    for a, b in zip(node, sharded):
        assert max_abs_diff(a["params"], b["params"]) <= 1e-5
    assert max_abs_diff(sharded[0]["params"], model().state_dict()) > 1e-3  # it trained
    # the rounds crossed nodes as shards: each process sent its half, through gradsync's ledger
    inter = [r["ledger"]["by_scope"]["inter_node"]["wire_bytes"] for r in sharded]
    replicated = [r["ledger"]["by_scope"]["inter_node"]["wire_bytes"] for r in node]
    assert sum(inter) == pytest.approx(sum(replicated), rel=0.01)


def test_sharded_compressed_identity_is_sharded_sync(tmp_path):
    sync = fit(model(0.9), DigitsData(batch_size=8), strategy=SyncStrategy(shard="node", procs_per_node=2),
               devices=4, max_steps=6, out=tmp_path / "s")
    ident = fit(model(0.9), DigitsData(batch_size=8),
                strategy=CompressedStrategy(codec="identity", shard="node", procs_per_node=2), devices=4, max_steps=6,
                out=tmp_path / "c")
    for a, b in zip(sync, ident):
        assert max_abs_diff(a["params"], b["params"]) <= 1e-6
