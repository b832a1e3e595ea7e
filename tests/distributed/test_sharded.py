"""Sharding inside the node (``shard="node"``): FSDP2 over a node's processes, gradsync across nodes.

Two nodes of two processes are played on one machine (``procs_per_node=2``: ranks 0-1 are node 0,
ranks 2-3 node 1), as in the node-scope tests.
"""

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from gradsync.cli.export import export
from gradsync.errors import OptionError
from gradsync.platform.memory import optimizer_state_bytes, tensor_bytes
from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import DiLoCoStrategy, LocalSGDStrategy, SyncStrategy
from gradsync.strategies.compressed import CompressedStrategy
from gradsync.strategies.parts import parts_dir, read_parts
from test_demo_modules import OfflineTransformer, Tokens
from test_node_scope import Warnings
from harness import assert_resumed_at, digest, fit, max_abs_diff

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


class RoundProbe(Callback):
    """Per rank: a digest of this process's shards after every landed round, the largest tensor a round
    sent, and the parameter + optimizer-state bytes this process holds at the end."""

    def __init__(self, out):
        self.out, self.landed, self.largest_sent = Path(out), [], 0

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.algorithm.listeners.append(self.listen)

    def listen(self, event, facts):
        if event == "landed":
            self.landed.append((facts["step"], facts["fragment"], digest(facts["values"])))
        if event == "issue":
            self.largest_sent = max([self.largest_sent, *(t.numel() for t in facts["payload"])])

    def on_train_end(self, trainer, pl_module):
        held = tensor_bytes(pl_module.parameters()) + optimizer_state_bytes(trainer.optimizers)
        torch.save({"landed": self.landed, "largest_sent": self.largest_sent, "held": held,
                    "largest_param": max(p.numel() for p in pl_module.parameters())},
                   self.out / f"probe{trainer.global_rank}.pt")


def test_sharded_diloco_nodes_agree_after_every_round_and_no_process_holds_the_model(tmp_path):
    def run(name, **kwargs):
        out = tmp_path / name
        out.mkdir()
        ranks = fit(model(optimizer="adamw"), DigitsData(batch_size=8), devices=4, max_steps=9, out=out,
                    callbacks=(RoundProbe(out),),
                    strategy=DiLoCoStrategy(period=4, codec="int8", procs_per_node=2, **kwargs))
        return ranks, [torch.load(out / f"probe{r}.pt", weights_only=False) for r in range(4)]

    _, replicated = run("replicated", scope="node")
    ranks, sharded = run("sharded", shard="node")
    # after every round (steps 4, 8 and the final one) the two nodes hold the same shards: rank r of node 0
    # and rank r of node 1 hold the same part of the model, and the parts differ inside a node
    for local in (0, 1):
        rounds = sharded[local]["landed"]
        assert [s for s, _, _ in rounds] == [4, 8, 9]
        assert rounds == sharded[local + 2]["landed"]
    assert sharded[0]["landed"][0][2] != sharded[1]["landed"][0][2]
    # no round sent (so none allocated) a tensor as large as the model's largest parameter whole
    full = {n: p for n, p in model().named_parameters()}
    assert all(p["largest_sent"] <= -(-max(t.numel() for t in full.values()) // 2) for p in sharded)
    assert replicated[0]["largest_sent"] == max(t.numel() for t in full.values())
    # parameters + AdamW state per process: at most 1/K + 5% of the replicated run's (K = 2)
    for s, r in zip(sharded, replicated):
        assert s["held"] <= (0.5 + 0.05) * r["held"], (s["held"], r["held"])
    # inter-node bytes, by hand: local rank j holds rows [j c, (j+1) c) of every parameter, c = ceil(rows / 2)
    # (FSDP2's dim-0 chunks), n_j values in all; a round sends them through int8 between 2 nodes:
    # all-to-all + all-gather of a half (ceil(n_j / 2) bytes and a 4-byte scale per chunk of 512) each
    for j in (0, 1):
        n = 0
        for t in full.values():
            c = -(-t.shape[0] // 2)
            n += max(0, min(c, t.shape[0] - j * c)) * (t.numel() // t.shape[0])
        half = -(-n // 2)
        per_round = 2 * (half + 4 * -(-half // 512))
        for r in (j, j + 2):
            assert ranks[r]["ledger"]["by_scope"]["inter_node"]["wire_bytes"] == 3 * per_round


class SelfShardingTransformer(OfflineTransformer):
    """Lightning's demo transformer, sharded in its own ``configure_model`` as Lightning's FSDP2 guide
    writes it: each encoder and decoder layer a unit, over ``self.device_mesh["data_parallel"]``."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in [*self.model.transformer.encoder.layers, *self.model.transformer.decoder.layers]:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def test_lightning_transformer_sharding_itself_trains_under_sharded_diloco_from_a_plain_trainer(tmp_path):
    torch.manual_seed(0)
    module = SelfShardingTransformer(vocab_size=64)
    start = {k: v.clone() for k, v in module.state_dict().items()}
    ranks = fit(module, Tokens(), strategy=DiLoCoStrategy(shard="node", procs_per_node=2, period=3), devices=4,
                max_steps=4, out=tmp_path, use_distributed_sampler=True, callbacks=(Units(tmp_path),))
    assert [r["global_step"] for r in ranks] == [4] * 4
    assert max_abs_diff(ranks[0]["params"], start) > 0
    for r in ranks[1:]:  # the final round leaves every process of both nodes with the same model
        assert max_abs_diff(ranks[0]["params"], r["params"]) == 0.0
    # its own units (2 encoder + 2 decoder layers, the transformer) and the root gradsync adds
    assert torch.load(tmp_path / "units0.pt") == 6


class Units(Callback):
    def __init__(self, out):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.fsdp import FSDPModule

        torch.save(sum(isinstance(m, FSDPModule) for m in pl_module.modules()), self.out / f"units{trainer.global_rank}.pt")


def test_sharded_diloco_resumes_on_another_number_of_processes_per_node_with_one_warning(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    make = lambda k: DiLoCoStrategy(shard="node", procs_per_node=k, period=4)  # noqa: E731
    fit(model(0.9), DigitsData(batch_size=8), strategy=make(2), devices=4, max_steps=6, out=tmp_path / "first",
        callbacks=(ModelCheckpoint(dirpath=ckpt_dir, filename="mid", every_n_train_steps=6),))
    ranks = fit(model(0.9), DigitsData(batch_size=16), strategy=make(1), devices=2, max_steps=8,
                out=tmp_path / "resumed", ckpt_path=str(ckpt_dir / "mid.ckpt"), callbacks=(Warnings(tmp_path),))
    text = (tmp_path / "warnings.txt").read_text()
    assert "2 node(s) x 2" in text and "2 node(s) x 1" in text and "global parameters (from the loaded model)" in text, text
    assert_resumed_at(ranks, 6, 8)
    for r in ranks:
        assert r["algorithm"]["num_steps"] == 8  # the round fell at 8, as scheduled before the resume
    assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0


def test_sharded_mixed_precision_gathers_in_bf16_and_keeps_fp32_shards(tmp_path):
    fp32 = fit(model(0.9), DigitsData(batch_size=8), strategy=SyncStrategy(shard="node", procs_per_node=2),
               devices=4, max_steps=4, out=tmp_path / "a")
    bf16 = fit(model(0.9), DigitsData(batch_size=8),
               strategy=SyncStrategy(shard="node", procs_per_node=2, param_dtype="bf16"), devices=4, max_steps=4,
               out=tmp_path / "b")
    assert all(v.dtype == torch.float32 for v in bf16[0]["params"].values())  # the shards (and AdamW) stay fp32
    assert 0 < max_abs_diff(fp32[0]["params"], bf16[0]["params"]) < 0.05  # computed in bf16: close, not equal
    # inside the node, per step: an all-gather of the other half of the weights (one unit: the root) and a
    # reduce-scatter sending half the gradients, 2 + 2 bytes a parameter in fp32; the gather in bf16: 1 + 2
    intra = [r["ledger"]["by_scope"]["intra_node"]["wire_bytes"] for r in (fp32[0], bf16[0])]
    assert intra[1] / intra[0] == pytest.approx(0.75, rel=1e-3)


def test_mixed_precision_without_shard_is_one_line():
    with pytest.raises(OptionError, match="param_dtype.*sets FSDP2's mixed precision and applies only to shard node"):
        DiLoCoStrategy(param_dtype="bf16")


def test_sharded_sync_is_bit_identical_to_the_hierarchical_all_reduce_of_replicas(tmp_path):
    """Sharded sync averages inside the node (FSDP2's reduce-scatter), then across nodes: exactly the
    sums node-scoped compressed with the identity codec does on replicas, so the weights are bit-identical
    (flat sync sums in another order: within rounding, which AdamW can amplify over many steps)."""
    node = fit(model(optimizer="adamw"), DigitsData(batch_size=8),
               strategy=CompressedStrategy(codec="identity", scope="node", procs_per_node=2), devices=4, max_steps=6,
               out=tmp_path / "n")
    sharded = fit(model(optimizer="adamw"), DigitsData(batch_size=8),
                  strategy=SyncStrategy(shard="node", procs_per_node=2), devices=4, max_steps=6, out=tmp_path / "h")
    for a, b in zip(node, sharded):
        assert max_abs_diff(a["params"], b["params"]) == 0.0
