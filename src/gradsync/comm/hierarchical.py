"""The mean over every rank of a multi-node job: full precision inside a node, the codec only between nodes.

Links inside a node (NVLink, PCIe, shared memory) are 10-1000x faster than the links between
nodes, so only the slow hop should be compressed (the hierarchical all-reduce of INTELLECT-1's
local and global groups, and of torch's HSDP). With K processes per node, for a flat vector of n
entries cut into K shards:

1. **reduce-scatter inside the node** (fp32): local rank j gets the node's sum of shard j, and
   divides it by K — the node's mean of shard j;
2. **the codec across nodes** on that shard, over the inter-node group of local rank j (one such
   group per local rank): the mean over nodes of the node means, i.e. the mean over every rank;
3. **all-gather inside the node** (fp32): every process gets every shard.

Each process sends n/K entries across nodes, through the codec. When the inputs are already
identical inside a node (``replicated``: DiLoCo's pseudo-gradient or local SGD's parameters when
inner steps are synchronized per node), step 1 is a slice, not a reduce-scatter.

Per-tensor state of the inner reducer (error-feedback residuals, PowerSGD memories) is kept under
the shard's own name, which says which tensors it covers; a resume on another layout starts it
afresh.
"""

from __future__ import annotations

import math
from typing import Hashable, Optional

import torch
import torch.distributed as dist

from gradsync.comm.codecs.common import flatten, pad_to, unflatten
from gradsync.comm.futures import Reduction
from gradsync.comm.reducer import Reducer, WrappingReducer

INTRA, INTER = "intra_node", "inter_node"


class NodeReducer(WrappingReducer):
    """Full-precision reduce-scatter and all-gather in ``intra``; ``inner`` (any codec) across nodes."""

    def __init__(self, inner: Reducer, *, intra: Optional[dist.ProcessGroup], replicated: bool = False) -> None:
        super().__init__(ledger=inner.ledger, group=intra, scope=INTRA)
        self.inner = inner
        self.replicated = replicated
        self.codec = inner.codec
        self.lossy = inner.lossy
        self.logical_scope = INTER  # what flat fp32 sync would send is compared with the slow hop

    def world_size(self) -> int:
        """Every rank of the job: processes per node x nodes (the mean is over all of them)."""
        return super().world_size() * self.inner.world_size()

    def options(self) -> dict:
        return {**self.inner.options(), "scope": "node"}

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        per_node, j = super().world_size(), self.group_rank()
        flat = flatten(tensors)
        n = flat.numel()
        shard = math.ceil(n / per_node) if n else 0
        x = pad_to(flat, shard * per_node)
        if self.replicated:
            mine = x[j * shard:(j + 1) * shard].clone()
        elif dist.get_backend(self.group) == "nccl":
            mine = torch.empty(shard, dtype=torch.float32, device=flat.device)
            yield self.ledger.reduce_scatter_tensor(mine, x, **self.account(sync))
            mine.div_(per_node)
        else:
            # gloo's reduce-scatter has no Future to chain on: an all-to-all moves the same bytes,
            # (K-1)/K of the vector, and the sum of the K received shards is taken here
            recv = torch.empty_like(x)
            recv = yield self.ledger.all_to_all_single(recv, x, **self.account(sync))
            mine = recv.view(per_node, shard).sum(0).div_(per_node)
        key = f"node-shard {j}/{per_node} of {names[0]}..{names[-1]} ({len(names)} tensors)" if names else "empty"
        (mean,), _ = yield from self.inner.run([mine], [key], sync)
        gathered = torch.empty(shard * per_node, dtype=torch.float32, device=flat.device)
        gathered = yield self.ledger.all_gather_single(gathered, mean.to(torch.float32).contiguous(),
                                                       **self.account(sync))
        return unflatten(gathered[:n], tensors), None

