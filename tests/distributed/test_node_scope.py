"""Node scope: fast synchronization inside a node, the strategy's thrifty one across nodes.

Two nodes of two processes are played on one machine by forcing the layout
(``procs_per_node=2``: ranks 0-1 are node 0, ranks 2-3 node 1).
"""

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from gradsync.comm import build_reducer
from gradsync.comm.hierarchical import NodeReducer
from gradsync.comm.ledger import CommLedger
from gradsync.comm.topology import Topology
from gradsync.errors import OptionError
from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import DiLoCoStrategy, LocalSGDStrategy, SyncStrategy
from gradsync.strategies.compressed import CompressedStrategy
from gradsync.strategies.parts import read_parts
from harness import digest, fit, max_abs_diff, run_gloo

pytestmark = pytest.mark.timeout(240)


def model(momentum=0.0, seed=0):
    L.seed_everything(seed, verbose=False)
    return DigitsClassifier(lr=0.1, momentum=momentum)


def numel() -> int:
    return sum(p.numel() for p in model().parameters())


class Hashes(Callback):
    """Every rank's parameter hash after every optimizer step, and its final parameters."""

    def __init__(self, out):
        self.out, self.rows = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(digest(pl_module.parameters()))

    def on_fit_end(self, trainer, pl_module):
        torch.save({"rows": self.rows, "final": digest(pl_module.parameters())},
                   self.out / f"hashes{trainer.global_rank}.pt")


def test_diloco_node_scope_period_1_is_sync_on_four_processes(tmp_path):
    sync = fit(model(), DigitsData(batch_size=8), strategy=SyncStrategy(), devices=4, max_steps=8, out=tmp_path / "s")
    node = fit(model(), DigitsData(batch_size=8),
               strategy=DiLoCoStrategy(scope="node", procs_per_node=2, period=1, outer_lr=1.0, outer_momentum=0.0),
               devices=4, max_steps=8, out=tmp_path / "n")
    for a, b in zip(sync, node):
        assert max_abs_diff(a["params"], b["params"]) <= 1e-5
    assert max_abs_diff(node[0]["params"], model().state_dict()) > 1e-3  # it trained


@pytest.mark.parametrize("codec", ["identity", "int8"])
def test_one_process_per_node_is_world_scope(tmp_path, codec):
    world = fit(model(0.9), DigitsData(batch_size=16), strategy=DiLoCoStrategy(period=4, codec=codec), devices=2,
                max_steps=10, out=tmp_path / "w")
    node = fit(model(0.9), DigitsData(batch_size=16),
               strategy=DiLoCoStrategy(period=4, codec=codec, scope="node", procs_per_node=1), devices=2,
               max_steps=10, out=tmp_path / "n")
    for a, b in zip(world, node):
        assert max_abs_diff(a["params"], b["params"]) <= 1e-6
    assert node[0]["ledger"]["by_scope"]["inter_node"]["wire_bytes"] == world[0]["ledger"]["wire_bytes"]


@pytest.mark.parametrize("cls", [DiLoCoStrategy, LocalSGDStrategy], ids=["diloco", "local_sgd"])
def test_a_node_agrees_every_step_and_every_rank_after_rounds(tmp_path, cls):
    period, steps = 4, 10
    fit(model(0.9), DigitsData(batch_size=8), strategy=cls(period=period, scope="node", procs_per_node=2),
        devices=4, max_steps=steps, out=tmp_path, callbacks=(Hashes(tmp_path),))
    h = [torch.load(tmp_path / f"hashes{r}.pt") for r in range(4)]
    for step in range(steps):
        row = [h[r]["rows"][step] for r in range(4)]
        assert row[0] == row[1] and row[2] == row[3], f"a node's processes differ after step {step + 1}"
        if (step + 1) % period == 0:
            assert row[0] == row[2], f"nodes differ after the round at step {step + 1}"
        else:
            assert row[0] != row[2], f"nodes agree after local step {step + 1}: the step was not local"
    assert len({x["final"] for x in h}) == 1  # the final round makes every rank agree


def test_inter_node_bytes_fall_period_fold_and_intra_node_bytes_are_ddps(tmp_path):
    steps, period, n = 16, 8, numel()
    sync = fit(model(), DigitsData(batch_size=8), strategy=SyncStrategy(), devices=4, max_steps=steps,
               out=tmp_path / "s")[0]["ledger"]
    node = fit(model(), DigitsData(batch_size=8), strategy=DiLoCoStrategy(period=period, scope="node",
                                                                            procs_per_node=2),
               devices=4, max_steps=steps, out=tmp_path / "n")[0]["ledger"]
    inter, intra = node["by_scope"]["inter_node"], node["by_scope"]["intra_node"]
    assert inter["wire_bytes"] / steps <= sync["wire_bytes"] / steps / period
    # by hand: each process sends its half of the pseudo-gradient across the 2 nodes (fp32
    # all-reduce, 2(2-1)/2 x 4 bytes per entry) once per round
    shard, rounds = math.ceil(n / 2), steps // period
    assert inter["wire_bytes"] == rounds * 4 * shard
    # inside the node: DDP's fp32 all-reduce of the gradients over 2 processes every step, and the
    # all-gather of the shards after each round
    assert intra["wire_bytes"] == steps * 4 * n + rounds * 4 * shard
    assert sync["wire_bytes"] == steps * 2 * 3 * n  # 2(4-1)/4 x 4 bytes per entry
    # the ratio a user of a slow inter-node link cares about
    assert inter["compression_ratio"] == pytest.approx(steps * 6 * n / inter["wire_bytes"])


def hierarchical(rank: int, world: int, codec: str) -> dict:
    topo = Topology.build(procs_per_node=2, node_groups=True)
    ledger = CommLedger(world_size=world)
    inner = build_reducer(codec, ledger=ledger, group=topo.inter, scope="inter_node", chunk_size=64)
    reducer = NodeReducer(inner, intra=topo.intra)
    g = torch.Generator().manual_seed(rank)
    x = [torch.randn(30, 7, generator=g), torch.randn(11, generator=g)]
    means = reducer.reduce([t.clone() for t in x], names=["w", "b"]).wait()
    every = [torch.zeros(221) for _ in range(world)]
    dist.all_gather(every, torch.cat([t.reshape(-1) for t in x]))
    return {"mean": torch.cat([m.reshape(-1) for m in means]), "inputs": torch.stack(every),
            "ledger": ledger.summary()}


@pytest.mark.parametrize("codec", ["identity", "fp16", "int8"])
def test_compressed_node_scope_reduces_like_the_hand_reference(tmp_path, codec):
    ranks = run_gloo(hierarchical, 4, codec, tmp=tmp_path)
    inputs = ranks[0]["inputs"]
    n, shard = 221, 111
    for r in ranks[1:]:
        assert torch.equal(r["mean"], ranks[0]["mean"])  # every rank decodes the same bytes
    # by hand: each node's mean in fp32, then the codec between the two nodes
    node_means = [inputs[0:2].mean(0), inputs[2:4].mean(0)]
    if codec == "identity":
        expect = (node_means[0] + node_means[1]) / 2
        assert (ranks[0]["mean"] - expect).abs().max() <= 1e-6
    elif codec == "fp16":
        halves = [(m / 2).half().float() for m in node_means]
        expect = (halves[0] + halves[1]).half().float()
        assert (ranks[0]["mean"] - expect).abs().max() <= 1e-6
    else:
        exact = inputs.mean(0)
        assert (ranks[0]["mean"] - exact).abs().max() <= 2 * 2 * exact.abs().max() / 127  # two roundings
    for r in ranks:
        ledger = r["ledger"]
        intra, inter = ledger["by_scope"]["intra_node"], ledger["by_scope"]["inter_node"]
        # inside the node, fp32: reduce-scatter and all-gather of n entries over 2 processes
        assert intra["wire_bytes"] == 2 * 4 * shard
        fp32_on_shard = 4 * shard  # an fp32 all-reduce of the shard between 2 nodes
        if codec == "int8":  # two hops of the shard's int8 message: ~1/4 of fp32
            half = math.ceil(shard / 2)
            assert inter["wire_bytes"] == 2 * (half + 4 * math.ceil(half / 64))
            assert inter["wire_bytes"] == pytest.approx(fp32_on_shard / 4, rel=0.1)
        else:
            assert inter["wire_bytes"] == fp32_on_shard // (2 if codec == "fp16" else 1)


def test_compressed_node_scope_trains_with_ranks_agreeing(tmp_path):
    ranks = fit(model(), DigitsData(batch_size=8),
                strategy=CompressedStrategy(codec="int8", scope="node", procs_per_node=2), devices=4, max_steps=6,
                out=tmp_path)
    for r in ranks[1:]:
        assert max_abs_diff(r["params"], ranks[0]["params"]) == 0.0
    ledger = ranks[0]["ledger"]
    assert set(ledger["by_scope"]) == {"intra_node", "inter_node"}
    assert ledger["by_scope"]["inter_node"]["compression_ratio"] > 2 * 3.9  # half the model, int8, per process


def test_one_node_is_refused_unless_the_layout_is_forced(monkeypatch):
    # the fix is spelled as the user sets it: the constructor argument in Python, the flag on the CLI
    with pytest.raises(OptionError, match="use scope='world', or procs_per_node K"):
        DiLoCoStrategy(scope="node").check_layout(4, 1)
    monkeypatch.setenv("GRADSYNC_ENTRY", "cli")
    with pytest.raises(OptionError, match="--strategy.scope world, or --strategy.procs_per_node K"):
        DiLoCoStrategy(scope="node").check_layout(4, 1)
    monkeypatch.delenv("GRADSYNC_ENTRY")
    DiLoCoStrategy(scope="node", procs_per_node=2).check_layout(4, 1)
    with pytest.raises(OptionError, match="must divide the number of processes"):
        CompressedStrategy(scope="node", procs_per_node=3).check_layout(4, 1)
    with pytest.raises(OptionError, match="must be world"):
        LocalSGDStrategy(scope="rack")


class Warnings(Callback):
    """The warnings rank 0 raised while the fit set up (the reshard warning among them)."""

    def __init__(self, out):
        self.out, self.catcher, self.caught = Path(out), None, None

    def setup(self, trainer, pl_module, stage):
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module):
        self.catcher.__exit__(None, None, None)
        if trainer.global_rank == 0:
            (self.out / "warnings.txt").write_text("\n".join(str(w.message) for w in self.caught))


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)], ids=["2x2-to-2x1", "2x1-to-2x2"])
def test_resume_with_another_number_of_processes_per_node(tmp_path, before, after):
    ckpt_dir = tmp_path / "ckpt"
    make = lambda k: DiLoCoStrategy(period=4, scope="node", procs_per_node=k)  # noqa: E731
    fit(model(0.9), DigitsData(batch_size=8), strategy=make(before), devices=2 * before, max_steps=6,
        out=tmp_path / "first", callbacks=(ModelCheckpoint(dirpath=ckpt_dir, filename="mid", every_n_train_steps=6),))
    manifest = torch.load(ckpt_dir / "mid.ckpt", weights_only=False)["gradsync"]
    assert (manifest["num_nodes"], manifest["procs_per_node"]) == (2, before)
    saved = read_parts(ckpt_dir / "mid.ckpt")[0]
    ranks = fit(model(0.9), DigitsData(batch_size=8), strategy=make(after), devices=2 * after, max_steps=8,
                out=tmp_path / "resumed", ckpt_path=str(ckpt_dir / "mid.ckpt"),
                callbacks=(Hashes(tmp_path), Warnings(tmp_path)))
    text = (tmp_path / "warnings.txt").read_text()
    assert f"2 node(s) x {before}" in text and f"2 node(s) x {after}" in text and "kept" in text, text
    for r in ranks:
        assert r["algorithm"]["num_steps"] == 8  # the round fell at 8, as scheduled before the resume
        assert not torch.equal(r["algorithm"]["global_params"][0], saved["global_params"][0])
    finals = {torch.load(tmp_path / f"hashes{r}.pt")["final"] for r in range(2 * after)}
    assert len(finals) == 1
