"""gradsync's ``diloco`` against torchft's ``DiLoCo`` (the ``ft`` extra), at matched settings.

torchft runs one replica group per process here, each with its own Manager, quorum through a
Lighthouse on 127.0.0.1 and a gloo process group it reconfigures per quorum; gradsync runs two
ranks under Lightning. Both train the same model from the same start on the same batches (each
gradsync rank's, recorded), with the same inner SGD and an outer Nesterov SGD (lr 0.7, momentum
0.9). torchft has no outer-momentum warm-up, so gradsync's is off (``outer_momentum_warmup=0``);
``init_sync`` is off so that neither replica takes the other's state at the first quorum.
"""

import os

import pytest
import torch

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import DiLoCoStrategy
from harness import fit, max_abs_diff, torchft_context
from test_peers import RecordBatches, model

torchft = pytest.importorskip("torchft", reason="the ft extra (pip install gradsync[ft]) is not installed")

pytestmark = pytest.mark.timeout(180)


class RecordBatchesAndLast(RecordBatches):
    """The batches this rank trained on, and the model after the last step's round (before the end-of-fit
    round, which torchft has not)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_end(self, trainer, pl_module):
        torch.save((self.batches, self.last), self.out / f"batches{trainer.global_rank}.pt")


def _replica(index: int, lighthouse: str, batches: list, start: dict, period: int, fragments: int, out: str) -> None:
    """One torchft replica group (one process): DiLoCo around plain torch training on ``batches``."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    net = DigitsClassifier(lr=0.1, momentum=0.9)
    net.load_state_dict(start)
    inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if fragments == 1:
        parts = [net]
    else:  # gradsync's strided split of the three layers: fragment 0 conv1 + head, fragment 1 conv2. Both send
        # one fragment every period / F steps; gradsync's fragment k goes at offset k * period / F of its period
        # (conv2 first, at step period / F), torchft's in list order: so conv2 is torchft's first fragment
        parts = [torch.nn.ModuleList([net.conv2]), torch.nn.ModuleList([net.conv1, net.head])]
    outer = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
    # the replica group's store, which torchrun would host: the Manager only connects to it
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=2, load_state_dict=lambda s: None, state_dict=lambda: {},
                      replica_id=f"replica{index}", lighthouse_addr=lighthouse, store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1, use_async_quorum=False, init_sync=False,
                      hostname="127.0.0.1")
    try:
        with DiLoCo(manager, parts, inner, outer if fragments > 1 else outer[0], sync_every=period * fragments,
                    backup_device=torch.device("cpu"), pin_memory=False):
            for x, y in batches:
                inner.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                inner.step()
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, os.path.join(out, f"ft{index}.pt"))
    finally:
        manager.shutdown(wait=False)
    # The result is saved. torchft's background threads can abort the interpreter's own teardown
    # ("terminate called without an active exception", exit -6) after all work is done: leave without it.
    os._exit(0)


@pytest.mark.parametrize("fragments", [1, 2], ids=["diloco", "streaming"])
def test_diloco_equals_torchfts_diloco(tmp_path, monkeypatch, fragments):
    from torchft.coordination import LighthouseServer

    period, rounds = 4, 3  # steps between rounds; a round syncs the whole model, or one of the fragments
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    start = model().state_dict()
    fit(model(), DigitsData(batch_size=16),
        strategy=DiLoCoStrategy(period=period * fragments, outer_momentum_warmup=0, fragments=fragments),
        devices=2, max_steps=period * rounds, out=tmp_path / "gradsync", callbacks=(RecordBatchesAndLast(tmp_path),))
    batches, ours = zip(*[torch.load(tmp_path / f"batches{r}.pt") for r in (0, 1)])
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        ctx = torchft_context()  # a fork of a process running the Rust lighthouse crashes
        procs = [ctx.Process(target=_replica, args=(i, lighthouse.address(), batches[i], start, period, fragments,
                                                   str(tmp_path))) for i in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, "torchft replicas hung"
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        lighthouse.shutdown()
    theirs = [torch.load(tmp_path / f"ft{i}.pt") for i in (0, 1)]
    assert max_abs_diff(theirs[0], start) > 1e-3  # it trained
    for r in (0, 1):
        diff = max_abs_diff(ours[r], theirs[r])
        assert diff <= 1e-6, f"replica {r}: gradsync's diloco differs from torchft's DiLoCo by {diff}"
