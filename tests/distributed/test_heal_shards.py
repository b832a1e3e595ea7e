"""A replica group sharded with FSDP2 heals shard by shard: each process of a restarted group receives, through
torchft's transport, the local shards of the live group's process of its local rank (module and optimizer) and
takes them over. Two processes, gloo, pure torch: the healed replica then steps exactly as the donor does."""

import io

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh  # imported once, before the workers fork
from torch.distributed.fsdp import fully_shard

from gradsync.strategies.replicas import _load_shards, _local_parts
from harness import run_gloo

pytestmark = pytest.mark.timeout(120)


def _replica(seed: int):
    torch.manual_seed(seed)
    # 7 x 5 and 3 x 7 entries: shards of unequal sizes over two processes
    module = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return module, torch.optim.AdamW(module.parameters(), lr=0.05)


def _step(module, optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(module(x), y).backward()
    optimizer.step()


def _shards(module, optimizer) -> list:
    from gradsync.algorithms.layout import local_part

    params = [local_part(p).detach().clone() for p in module.parameters()]
    moments = [local_part(s[k]).detach().clone() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return params + moments


def _heal(rank: int, world: int) -> dict:
    donor, donor_opt = _replica(0)
    for s in range(3):
        _step(donor, donor_opt, s)
    # what the donor's process hands torchft's transport, serialized and read back as the peer receives it
    sent = io.BytesIO()
    torch.save(_local_parts({"module": donor.state_dict(), "optimizers": [donor_opt.state_dict()]}), sent)
    received = torch.load(io.BytesIO(sent.getvalue()), weights_only=True)
    healed, healed_opt = _replica(1)  # a restarted replica: other weights, no optimizer state yet
    fresh = [t.clone() for t in _shards(healed, healed_opt)]
    _load_shards(healed, [healed_opt], received)
    at_heal = (_shards(donor, donor_opt), _shards(healed, healed_opt))
    for s in range(3, 5):  # both go on with the same batches
        _step(donor, donor_opt, s)
        _step(healed, healed_opt, s)
    return {"fresh": fresh, "at_heal": at_heal, "after": (_shards(donor, donor_opt), _shards(healed, healed_opt)),
            "sizes": [t.numel() for t in fresh]}


def test_a_sharded_replica_heals_from_its_peers_local_shards_and_then_steps_as_they_do(tmp_path):
    results = run_gloo(_heal, 2, tmp=tmp_path)
    assert results[0]["sizes"] != results[1]["sizes"]  # the processes hold shards of different sizes
    for r in results:
        donor, healed = r["at_heal"]
        assert len(donor) == len(healed) == 4 + 8  # 4 parameters, 2 AdamW moments each
        assert all(torch.equal(a, b) for a, b in zip(donor, healed))
        assert not all(torch.equal(a, b) for a, b in zip(r["fresh"][:4], healed[:4]))  # it did change
        # the same optimizer state, step count included: the next steps are the donor's, bit for bit
        donor, healed = r["after"]
        assert all(torch.equal(a, b) for a, b in zip(donor, healed))
