"""Sharding inside the node (``shard="node"``): FSDP2 over a node's processes, gradsync across nodes.

Two nodes of two processes are played on one machine (``procs_per_node=2``: ranks 0-1 are node 0,
ranks 2-3 node 1), as in the node-scope tests.
"""

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning.pytorch.callbacks import ModelCheckpoint

from gradsync.cli.export import export
from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import DiLoCoStrategy, LocalSGDStrategy, SyncStrategy
from gradsync.strategies.compressed import CompressedStrategy
from gradsync.strategies.parts import parts_dir, read_parts
from harness import assert_resumed_at, fit, max_abs_diff

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


def _resume_pair(tmp_path, make, *, steps, at, before=2, after=2, momentum=0.9):
    """(uninterrupted run, run resumed from a checkpoint at step ``at``), ``before``/``after`` processes per node."""
    ckpt_dir = tmp_path / "ckpt"
    data = lambda k: DigitsData(batch_size=16 // k)  # noqa: E731  # the same global batch of 32 on 2 nodes
    whole = fit(model(momentum), data(before), strategy=make(before), devices=2 * before,
                max_steps=steps, out=tmp_path / "whole")
    fit(model(momentum), data(before), strategy=make(before), devices=2 * before, max_steps=at,
        out=tmp_path / "first", callbacks=(ModelCheckpoint(dirpath=ckpt_dir, filename="mid", every_n_train_steps=at),))
    resumed = fit(model(momentum), data(after), strategy=make(after), devices=2 * after, max_steps=steps,
                  out=tmp_path / "resumed", ckpt_path=str(ckpt_dir / "mid.ckpt"))
    return whole, resumed, ckpt_dir / "mid.ckpt"


def test_sharded_diloco_resumes_exactly_mid_period_with_a_fragment_in_flight(tmp_path):
    make = lambda k: DiLoCoStrategy(shard="node", procs_per_node=k, period=4, fragments=2, sync_delay=1,  # noqa: E731
                                    codec="int8")
    whole, resumed, ckpt = _resume_pair(tmp_path, make, steps=10, at=6)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["gradsync"]["sharded"]["per_node"] and saved["state_dict"] == {}
    assert saved["gradsync"]["sharded"]["shards"] in {p.name for p in parts_dir(ckpt).iterdir()}
    assert read_parts(ckpt)[0]["pending"] is not None  # fragment 1, issued at step 6, lands at 7
    assert_resumed_at(resumed, 6, 10)
    for a, b in zip(whole, resumed):
        assert max_abs_diff(a["params"], b["params"]) <= 1e-6
        assert a["algorithm"]["num_steps"] == b["algorithm"]["num_steps"] == 10


def test_sharded_sync_resumes_on_another_number_of_processes_per_node(tmp_path):
    """2 nodes x 2 processes -> 2 x 1: the checkpoint's folder reshards the model and optimizer state
    (DCP), and the resumed run continues the same trajectory."""
    make = lambda k: SyncStrategy(shard="node", procs_per_node=k)  # noqa: E731
    whole, resumed, ckpt = _resume_pair(tmp_path, make, steps=8, at=4, after=1)
    assert_resumed_at(resumed, 4, 8)
    assert max_abs_diff(whole[0]["params"], resumed[0]["params"]) <= 1e-5
    # export: one plain state_dict, loadable into the unsharded module, equal to the saved step's weights
    out, state = export(str(ckpt), str(tmp_path / "model.pt"))
    plain = model()
    plain.load_state_dict(torch.load(out, weights_only=True))
    first = torch.load(tmp_path / "first" / "rank0.pt", weights_only=False)["params"]
    assert max_abs_diff(state, first) == 0.0


def test_a_sharded_checkpoint_is_refused_without_shard_in_one_line(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    fit(model(), DigitsData(batch_size=8), strategy=SyncStrategy(shard="node", procs_per_node=2), devices=4,
        max_steps=2, out=tmp_path / "a", callbacks=(ModelCheckpoint(dirpath=ckpt_dir, filename="mid", every_n_train_steps=2),))
    with pytest.raises(Exception, match="written with --strategy.shard node"):
        fit(model(), DigitsData(batch_size=8), strategy=SyncStrategy(), devices=2, max_steps=4, out=tmp_path / "b",
            ckpt_path=str(ckpt_dir / "mid.ckpt"))
