"""Sharding inside the node (``shard="node"``): FSDP2 inside, gradsync's synchronization across nodes.

With ``shard="node"`` the parameters, gradients and optimizer state of every process are a 1/K
shard of the model (K processes per node): torch's FSDP2 ``fully_shard`` over the node's processes
all-gathers a layer's parameters for its forward and backward and reduce-scatters its gradients
inside the node. Nothing FSDP2 sends leaves the node. What crosses nodes is gradsync's, between
the processes of the same local rank (each holds the same shard of the model on every node):

* ``sync`` / ``compressed``: after backward, each process's gradient *shard* is averaged across
  nodes by a gradsync reducer (fp32, or the codec) — HSDP, with the inter-node hop counted by the
  ledger and compressible;
* ``local_sgd`` / ``diloco``: inner steps stay inside the node; a round reduces each process's
  *parameter shard* (its part of the pseudo-gradient) across nodes. No process ever holds the full
  model; DiLoCo's global parameters and outer momentum are sharded the same way.

Which modules become FSDP units: a module that shards itself in ``configure_model`` (Lightning's
FSDP2 convention, with :attr:`LightningModule.device_mesh` ``["data_parallel"]`` the node's mesh) is
left as it is; otherwise every submodule of a class the module lists in ``shard_modules`` (e.g. the
transformer block) becomes a unit, then the root.

FSDP2's own collectives do not pass through gradsync; their bytes are booked in the ledger's
intra-node scope from its schedule: per micro-batch, each unit's parameters are all-gathered for
the forward and again for the backward (the root once) and its gradients reduce-scattered.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
import torch.distributed as dist

from gradsync.algorithms.layout import local_part as local
from gradsync.comm.hierarchical import INTER, INTRA
from gradsync.comm.ledger import fp32_allreduce_bytes
from gradsync.comm.reducer import Reducer
from gradsync.errors import GradsyncError, check, spell

SHARD_CHOICES = ("none", "node")
Shard = Literal["none", "node"]
#: FSDP2's mixed precision, as ``MixedPrecisionPolicy`` (and Lightning's FSDP ``MixedPrecision``) name its fields
ShardDtype = Literal["fp32", "bf16", "fp16"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The name of the node's mesh dimension, as Lightning's ``ModelParallelStrategy`` names its FSDP dimension.
MESH_DIM = "data_parallel"


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def fsdp_units(module: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """Every FSDP2 unit of ``module`` (root last) with the parameters it manages itself."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    owned: set[int] = set()
    out = []
    for unit in reversed(units):  # children before parents: a parent manages what no child does
        params = [p for p in unit.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        out.append((unit, params))
    return out


class NodeSharding:
    """Mixed into :class:`~gradsync.strategies.base.GradsyncStrategy`: the ``shard`` option, the
    FSDP2 wrapping, the cross-node reduction of gradient shards and the ledger's intra-node bytes."""

    #: ``none``: every process holds a full replica; ``node``: FSDP2 shards over the node's processes.
    shard: str = "none"
    _mesh: Any = None
    _grad_reducer: Optional[Reducer] = None
    _units: Optional[list] = None

    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"

    def _set_shard(self, shard: str, param_dtype: str = "fp32", reduce_dtype: str = "fp32") -> None:
        check(shard in SHARD_CHOICES, "shard", shard,
              "must be none (a full replica per process) or node (parameters, gradients and optimizer state "
              "sharded over the processes of a node with FSDP2)", f"e.g. {spell('shard', 'node')}")
        for option, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            check(value in DTYPES, option, value, "must be fp32, bf16 or fp16")
            check(value == "fp32" or shard == "node", option, value,
                  "sets FSDP2's mixed precision and applies only to shard node", f"add {spell('shard', 'node')}")
        self.shard, self.param_dtype, self.reduce_dtype = shard, param_dtype, reduce_dtype

    @property
    def sharded(self) -> bool:
        return self.shard == "node"

    def wants_node_groups(self) -> bool:
        return self.sharded or super().wants_node_groups()

    def check_layout(self, world_size: int, num_nodes: int) -> None:
        k = self.procs_per_node
        if self.sharded and k is not None:
            check(world_size % k == 0, "procs_per_node", k, f"must divide the number of processes ({world_size})",
                  f"e.g. {spell('procs_per_node', 1)} (every process plays a node)")
        if self.sharded and self.scope == "node" and k is None:
            # shard node makes each node one replica (node scope implied): one node leaves nothing to average
            check(num_nodes > 1, "shard", "node",
                  f"makes each node one replica that rounds average across nodes, and this run has 1 node "
                  f"({world_size} process(es))",
                  f"use {spell('shard', 'none')}, or {spell('procs_per_node')} K to let K processes play one node")
        super().check_layout(world_size, num_nodes)

    # ---- the node's mesh and the wrapping ---------------------------------------------------------
    def node_mesh(self) -> Any:
        """The 1-D device mesh of this node's processes (named ``data_parallel``), built once."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            topology = self.topology
            if topology is None or topology.intra is None:
                raise GradsyncError(f"{spell('shard', 'node')} needs the node's process group; it is built at set-up")
            self._mesh = DeviceMesh.from_group(topology.intra, self.root_device.type, mesh_dim_names=(MESH_DIM,))
        return self._mesh

    def shard_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Apply FSDP2 over the node: respect a module that sharded itself, else wrap by ``shard_modules``."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = self.node_mesh()
        kwargs: dict = {"mesh": mesh}
        if self.param_dtype != "fp32" or self.reduce_dtype != "fp32":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            # the sharded parameters (and the optimizer) stay fp32; units are gathered and computed in
            # param_dtype, gradients reduce-scattered in reduce_dtype
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[self.param_dtype],
                                                       reduce_dtype=DTYPES[self.reduce_dtype])
        if not is_sharded(module):
            classes = tuple(getattr(module, "shard_modules", ()) or ())
            if classes:
                for sub in module.modules():
                    if sub is not module and isinstance(sub, classes):
                        fully_shard(sub, **kwargs)
        if not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)
        self._units = fsdp_units(module)
        self._broadcast_initial_state(module)
        return module

    @torch.no_grad()
    def _broadcast_initial_state(self, module: torch.nn.Module) -> None:
        """Every node starts from node 0's weights, as DDP's constructor makes every replica start from
        rank 0's: each process's shard from its peer on node 0, buffers from rank 0."""
        topology = self.topology
        if topology.num_nodes > 1:
            src = dist.get_global_rank(topology.inter, 0)
            for p in module.parameters():
                dist.broadcast(local(p).data, src=src, group=topology.inter)
        if topology.world_size > 1:
            for b in module.buffers():
                dist.broadcast(b.data, src=dist.get_global_rank(topology.world, 0), group=topology.world)

    # ---- what crosses nodes after backward ------------------------------------------------------
    def sharded_gradient_reducer(self) -> Optional[Reducer]:
        """The reducer that averages this step's gradient shards across nodes (None: nothing crosses)."""
        return None

    def inter_node_reducer(self) -> Reducer:
        """An exact fp32 mean of shards across nodes, on this local rank's inter-node group (built once)."""
        if self._grad_reducer is None:
            from gradsync.comm.reducer import IdentityReducer

            self._grad_reducer = IdentityReducer(ledger=self.ledger, group=self.topology.inter, scope=INTER)
        return self._grad_reducer

    def _shards_cross(self) -> bool:
        """True when gradient shards cross to other processes of the same local rank (other nodes)."""
        return self.topology.num_nodes > 1

    def parameter_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.lightning_module.named_parameters()}

    @torch.no_grad()
    def reduce_gradient_shards(self, optimizer: Any, step: int) -> None:
        """Average every gradient shard of ``optimizer``'s parameters across nodes (blocking)."""
        reducer = self.sharded_gradient_reducer()
        self._book_fsdp_bytes(step)
        if reducer is None:
            return
        names = self.parameter_names()
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [local(p.grad) for p in params]
        if self._shards_cross():
            means = reducer.reduce(grads, names=[names.get(id(p), str(i)) for i, p in enumerate(params)],
                                   sync=("grad", step)).wait()
            for g, m in zip(grads, means):
                g.copy_(m)
        numel = sum(p.numel() for p in params)  # global sizes: what flat fp32 sync of the model would send
        self.ledger.add_logical(fp32_allreduce_bytes(numel, self.world_size), scope=INTER)

    def _book_fsdp_bytes(self, step: int) -> None:
        """FSDP2's all-gathers and reduce-scatters of this step inside the node, from its schedule."""
        k = self.topology.procs_per_node if self.topology is not None else 1
        if k == 1 or not self._units:
            return
        micro_batches = max(1, int(self.accumulation_steps))
        root = self._units[-1][0]
        gathered = DTYPES[self.param_dtype].itemsize
        reduced = DTYPES[self.reduce_dtype].itemsize
        for unit, params in self._units:
            numel = sum(p.numel() for p in params)
            if not numel:
                continue
            gathers = 1 if unit is root else 2  # the root keeps its parameters between forward and backward
            for _ in range(micro_batches):
                for _ in range(gathers):
                    self.ledger.record("all_gather", -(-numel // k) * gathered, group_size=k, scope=INTRA,
                                       sync=("fsdp", step))
                self.ledger.record("reduce_scatter", numel * reduced, group_size=k, scope=INTRA, sync=("fsdp", step))

    # ---- sharded checkpoints (torch.distributed.checkpoint) --------------------------------------
    #: True when the nodes' models may differ at a checkpoint (local steps): each node's shards are
    #: saved under its own key, so no node's local progress is deduplicated away.
    nodes_may_differ: bool = False

    def _dcp_key(self, per_node: bool, saved_nodes: Optional[int] = None) -> Optional[str]:
        """The key of this node's shards (None: one copy for every node); a node the checkpoint did
        not have takes node 0's."""
        if not per_node:
            return None
        node = self.topology.node_rank
        return f"node{node if saved_nodes is None or node < saved_nodes else 0}"

    def _sharded_state(self, key: Optional[str]) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.lightning_module, self.optimizers)
        state = {"model": model, "optimizer": optimizer}
        return {key: state} if key else state

    def write_sharded_state(self, folder: Any) -> dict:
        """Each node's processes write their shards of the model and optimizer state under
        ``folder/node<k>`` (DCP over the node's own group, which holds a whole replica): a node's directory
        is complete on its own, with no filesystem shared between nodes. Returns the manifest's facts."""
        import torch.distributed.checkpoint as dcp

        node = folder / f"node{self.topology.node_rank}"
        try:
            dcp.save(self._sharded_state(None), checkpoint_id=str(node), process_group=self.topology.intra)
        except Exception as exc:  # DCP gathers every process's failure and raises on all of them alike
            raise GradsyncError(f"checkpoint: the sharded state could not be written under {node} "
                                f"({_first_line(exc)}); the previous checkpoint is intact") from None
        return {"shards": folder.name, "per_node": self.nodes_may_differ, "node_dirs": True,
                "num_nodes": self.topology.num_nodes, "procs_per_node": self.topology.procs_per_node}

    def read_sharded_state(self, folder: Any, manifest: dict) -> None:
        """Load the model and optimizer shards from ``folder`` into this job's sharding (DCP reshards):
        this node's own replica, or node 0's for a node the checkpoint did not have."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if manifest.get("node_dirs"):
            key, group = None, self.topology.intra
            node = self.topology.node_rank
            source = folder / f"node{node if node < int(manifest.get('num_nodes', 1)) else 0}"
            if not (source / ".metadata").is_file():
                raise GradsyncError(f"--resume: the sharded state {source} is missing or incomplete (no .metadata); "
                                    "resume each node from its own --output-dir, or copy the checkpoints directory "
                                    "of a node that has it")
        else:  # written by an earlier gradsync: one DCP checkpoint across every node
            key, group = self._dcp_key(bool(manifest.get("per_node")), int(manifest.get("num_nodes", 1))), None
            source = folder
        state = self._sharded_state(key)
        try:
            dcp.load(state, checkpoint_id=str(source), process_group=group)
        except Exception as exc:
            raise GradsyncError(f"--resume: the sharded state under {source} could not be read "
                                f"({_first_line(exc)})") from None
        state = state[key] if key else state
        set_state_dict(self.lightning_module, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    # ---- Lightning's checkpoint hooks, when sharded ----------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # a sharded checkpoint loads into the sharded module and its optimizer
        return self.sharded or super().restore_checkpoint_after_setup

    #: Set for the checkpoint written once fit is over: it also holds the whole model, gathered inside each
    #: node to its first process, so that ``load_from_checkpoint``, ``gradsync sample`` and ``torch.load``
    #: read it as they read a replicated run's. Checkpoints during training hold only the shards (no gather
    #: of the model per save; ``gradsync export`` consolidates them).
    full_model_in_checkpoint: bool = False

    def lightning_module_state_dict(self) -> dict:
        if not self.sharded:
            return super().lightning_module_state_dict()
        if not self.full_model_in_checkpoint:
            return {}  # the shards are written by every process (write_sharded_state)
        keep = self.topology is None or self.topology.local_rank == 0
        state = {}
        for name, value in self.lightning_module.state_dict().items():  # the same order on every process
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value  # (gathered in the node)
            if keep:
                state[name] = whole.detach().cpu()
            del whole
        return state

    def optimizer_state(self, optimizer: Any) -> dict:
        return {} if self.sharded else super().optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self.sharded:
            return super().load_model_state_dict(checkpoint, strict=strict)
        saved = self._restored_algorithm_state
        manifest = (checkpoint.get("gradsync") or {}).get("sharded")
        if saved is None or not manifest:
            raise GradsyncError(f"--resume: the checkpoint holds a full model, and {spell('shard', 'node')} resumes "
                                "only its own sharded checkpoints; resume without it")
        from gradsync.strategies import parts as rank_parts

        self.read_sharded_state(rank_parts.parts_dir(saved.checkpoint) / manifest["shards"], manifest)
        self._apply_restored_state()  # the algorithm's state, once the module and optimizer hold theirs
        self._restored_algorithm_state = None

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self.sharded:
            super().load_optimizer_state_dict(checkpoint)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
