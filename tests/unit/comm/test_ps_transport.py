"""The parameter server's transport (gradsync.comm.ps) on a real gloo group, without Lightning: a
synchronous round (max_staleness 0) of two workers against one shard on rank 0, the update checked
by hand, and every byte either side sent booked in the ledger as a ``send``."""

import torch
import torch.distributed as dist

from gradsync.algorithms.param_server import ShardState
from gradsync.comm.ledger import CommLedger
from gradsync.comm.ps import HEADER, PSClient, ServerThread
from harness import run_gloo


def _one_round(rank, world):
    torch.manual_seed(0)
    params = [torch.randn(3, 4), torch.randn(5)]  # the same start on both ranks
    groups = [(dist.new_group([0, 1], backend="gloo"), dist.new_group([0, 1], backend="gloo"))]
    ledger = CommLedger(world_size=world)
    servers = {}
    if rank == 0:
        shard = ShardState(params, lambda copies: torch.optim.SGD(copies, lr=0.5), [0], num_workers=world,
                           max_staleness=0)
        servers[0] = ServerThread(shard, request_group=groups[0][0], reply_group=groups[0][1], rank=0,
                                  world_size=world, num_lrs=1, ledger=ledger, name="ps0")
        servers[0].start()
    client = PSClient(params, [[0, 1]], [0], groups, servers, rank=rank, num_lrs=1, timeout=30, ledger=ledger)
    assert client.pull() == [0]
    grads = [torch.full((3, 4), float(rank + 1)), torch.full((5,), 2.0 * (rank + 1))]
    client.push(grads, weight=1.0, lrs=[0.5], skip=False)
    versions = client.pull()  # waits for the update both pushes make
    client.stop()
    if rank == 0:
        servers[0].join(timeout=30)
    dist.barrier()
    return {"versions": versions, "params": [p.clone() for p in params], "sent": ledger.wire_bytes,
            "by": dict(ledger.by_collective)}


def test_a_synchronous_round_and_its_bytes(tmp_path):
    torch.manual_seed(0)
    start = [torch.randn(3, 4), torch.randn(5)]
    # the mean of the two workers' gradients (1 and 2; 2 and 4), one SGD step of lr 0.5
    expected = [start[0] - 0.5 * 1.5, start[1] - 0.5 * 3.0]
    model_bytes = 4 * (12 + 5)
    header = 8 * (HEADER + 1)  # float64: op, worker, version, weight, skip, one learning rate
    r0, r1 = run_gloo(_one_round, 2, tmp=tmp_path)
    for r in (r0, r1):
        assert r["versions"] == [1]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], expected))
    # rank 0 hosts the shard: its own worker asks in-process; it replies to rank 1's two pulls
    # (version 8 bytes + the parameters each)
    assert r0["sent"] == 2 * (8 + model_bytes) and r0["by"]["send"]["count"] == 4
    # rank 1: pull, push (header + gradient), pull, stop — four headers and one gradient
    assert r1["sent"] == 4 * header + model_bytes and r1["by"]["send"]["count"] == 5
