"""gradsync strategies leave DDP's bucket layout as stock DDP has it unless told otherwise: DDP's
default puts the last layers' gradients in a 1 MiB first bucket so their all-reduce starts early;
passing its 25 MiB explicitly turns that off (torch: a given size applies to every bucket)."""

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from gradsync.strategies import CompressedStrategy, SyncStrategy
from gradsync.strategies.lightning_private import ddp_kwargs
from harness import free_port


def _first_bucket_is_small(kwargs: dict) -> bool:
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4), **kwargs)
    return ddp.bucket_bytes_cap_default


def test_buckets_are_ddps_own_unless_given(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        stock = _first_bucket_is_small(ddp_kwargs(DDPStrategy()))
        assert stock  # Lightning's ddp keeps torch's small first bucket
        for strategy in (SyncStrategy(), CompressedStrategy(codec="int8")):
            assert _first_bucket_is_small(ddp_kwargs(strategy)) == stock, type(strategy).__name__
        assert not _first_bucket_is_small(ddp_kwargs(SyncStrategy(bucket_cap_mb=25)))
        assert ddp_kwargs(SyncStrategy(bucket_cap_mb=7))["bucket_cap_mb"] == 7.0
    finally:
        dist.destroy_process_group()
