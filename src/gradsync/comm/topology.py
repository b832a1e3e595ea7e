"""Where ranks sit: the world, one intra-node group per node, one inter-node group per local rank.

On a real cluster the links inside a node (NVLink, PCIe, shared memory) are 10-1000x faster than
the links between nodes, so a strategy that knows the layout can synchronize fast inside a node and
thriftily across nodes (INTELLECT-1's local and global NCCL groups; torch's HSDP replica groups).
The layout comes from what the launcher already says: torchrun's ``LOCAL_WORLD_SIZE`` (processes on
this node) and ``GROUP_RANK`` (this node's index), or SLURM's ``SLURM_NTASKS_PER_NODE`` /
``SLURM_NODEID``; ranks are numbered node by node, as torchrun and srun number them. For tests on
one machine a layout can be forced (``procs_per_node``): ranks 0..K-1 then play node 0, K..2K-1
node 1, and so on.

Every group here is gradsync's own (``dist.new_group``): reducers issue their collectives from
communication threads, and on a group of their own no other collective — Lightning's per-step
broadcast, a logged metric's all-reduce — can come between two hops of a reduction.

Pure torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist


def launcher_layout(world_size: int) -> tuple[int, int]:
    """``(processes per node, number of nodes)`` as the launcher set them (1 node when it did not say)."""
    per_node = None
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "").split("(")[0]  # SLURM may write "4(x2)"
        if value.isdigit() and int(value) > 0:
            per_node = int(value)
            break
    if per_node is None or world_size % per_node:
        per_node = world_size
    return per_node, world_size // per_node


@dataclass
class Topology:
    """The process groups of one job, as seen from one rank."""

    world_size: int
    rank: int
    procs_per_node: int
    #: True when the layout was forced (``procs_per_node``) rather than read from the launcher.
    forced: bool = False
    world: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    intra: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    inter: Optional[dist.ProcessGroup] = field(default=None, repr=False)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.procs_per_node

    @property
    def node_rank(self) -> int:
        return self.rank // self.procs_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.procs_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of ``node``."""
        return list(range(node * self.procs_per_node, (node + 1) * self.procs_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with ``local_rank`` on every node (one inter-node group)."""
        return [n * self.procs_per_node + local_rank for n in range(self.num_nodes)]

    def describe(self) -> str:
        how = "forced" if self.forced else "from the launcher"
        return f"{self.num_nodes} node(s) x {self.procs_per_node} process(es) per node ({how})"

    @classmethod
    def build(cls, *, procs_per_node: Optional[int] = None, node_groups: bool = False,
              timeout: Optional[timedelta] = None, backend: Optional[str] = None) -> "Topology":
        """Create gradsync's groups (a collective call: every rank must call it, in the same order).

        ``node_groups``: also create the intra- and inter-node groups (only strategies with node
        scope need them).
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        forced = procs_per_node is not None
        if procs_per_node is None:
            procs_per_node, _ = launcher_layout(world)
        if world % procs_per_node:
            raise ValueError(f"procs_per_node={procs_per_node} does not divide the world size {world}")
        topo = cls(world_size=world, rank=rank, procs_per_node=procs_per_node, forced=forced)
        kwargs = {"timeout": timeout} if timeout is not None else {}
        if backend is not None:
            kwargs["backend"] = backend
        topo.world = dist.new_group(list(range(world)), **kwargs)
        if node_groups:
            for node in range(topo.num_nodes):
                group = dist.new_group(topo.node_ranks(node), **kwargs)
                if node == topo.node_rank:
                    topo.intra = group
            for local in range(procs_per_node):
                group = dist.new_group(topo.peer_ranks(local), **kwargs)
                if local == topo.local_rank:
                    topo.inter = group
        return topo
