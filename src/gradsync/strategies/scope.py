"""Node scope, for strategies that synchronize inside a node one way and across nodes another.

``world``: every rank alike; ``node``: fast synchronization inside a node, the strategy's thrifty
one across nodes. Strategies that offer it take ``scope`` and ``procs_per_node`` and call
:meth:`NodeScope._set_scope`; the groups themselves are :class:`~gradsync.comm.topology.Topology`.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from gradsync.comm.topology import Topology, launcher_layout
from gradsync.errors import check, spell
from gradsync.strategies.lightning_private import process_group_timeout


class NodeScope:
    """Mixed into :class:`~gradsync.strategies.base.GradsyncStrategy`: the scope option, its checks
    against the job's layout, and the process groups it asks for."""

    topology: Optional[Topology] = None

    #: ``world``: every rank alike; ``node``: fast synchronization inside a node, the strategy's
    #: thrifty one across nodes. Strategies that offer it take ``scope`` and ``procs_per_node``.
    scope: str = "world"
    #: Forced layout (ranks 0..K-1 play node 0, ...); None reads it from torchrun / SLURM.
    procs_per_node: Optional[int] = None

    def _set_scope(self, scope: str, procs_per_node: Optional[int]) -> None:
        check(scope in ("world", "node"), "scope", scope,
              "must be world (every rank alike) or node (sync inside a node, the strategy across nodes)",
              f"e.g. {spell('scope', 'node')}")
        check(procs_per_node is None or (isinstance(procs_per_node, int) and not isinstance(procs_per_node, bool)
                                         and procs_per_node >= 1), "procs_per_node", procs_per_node,
              "must be an integer >= 1 (processes that play one node)",
              "omit it to take the layout from torchrun / SLURM")
        self.scope, self.procs_per_node = scope, procs_per_node

    def check_layout(self, world_size: int, num_nodes: int) -> None:
        """Refuse a node scope the job's layout cannot serve (called by the CLI and at set-up)."""
        if self.scope != "node":
            return
        k = self.procs_per_node
        if k is not None:
            check(world_size % k == 0, "procs_per_node", k, f"must divide the number of processes ({world_size})",
                  f"e.g. {spell('procs_per_node', 1)} (every process plays a node)")
            return
        check(num_nodes > 1, "scope", "node",
              f"synchronizes across nodes, and this run has 1 node ({world_size} process(es))",
              f"use {spell('scope', 'world')}, or {spell('procs_per_node')} K to let K processes play one node")

    def wants_node_groups(self) -> bool:
        """True when the strategy synchronizes per node (it gets intra- and inter-node groups)."""
        return self.scope == "node"

    def build_topology(self) -> Topology:
        """gradsync's process groups for this job (a collective call, made once at set-up)."""
        world = dist.get_world_size()
        if self.procs_per_node is None:
            self.check_layout(world, launcher_layout(world)[1])
        else:
            self.check_layout(world, 0)
        return Topology.build(procs_per_node=self.procs_per_node, node_groups=self.wants_node_groups(),
                              timeout=process_group_timeout(self))

    @property
    def comm_group(self) -> Optional[dist.ProcessGroup]:
        """gradsync's own group of every rank, where reducers run (None before set-up)."""
        return self.topology.world if self.topology is not None else None
