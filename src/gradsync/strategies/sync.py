"""``sync``: synchronous data parallel (DDP) with a communication ledger."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from gradsync.comm.ddp import (AllReduceState, WholeStepState, allreduce_hook, allreduce_sum_hook,
                               record_builtin_allreduce, whole_step_hook)
from gradsync.comm.reducer import Reducer
from gradsync.errors import GradsyncError, check
from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.replicas import ReplicaGroupMember
from gradsync.strategies.sharding import Shard, ShardDtype

__all__ = ["AllReduceState", "SyncStrategy", "allreduce_hook", "allreduce_sum_hook"]


class SyncStrategy(ReplicaGroupMember, GradsyncStrategy):
    """Synchronous data parallel: every step all ranks apply the mean of all ranks' gradients.

    The reduction is DDP's own (C++, bucketed, overlapped with backward), with no Python hook, so
    ``sync`` costs what stock DDP costs; the ledger books each synchronized backward as one fp32
    all-reduce of the gradients. Its time in flight is not measured (``comm.seconds`` is ``null`` in
    the summary) unless ``time_comm`` routes every bucket through a timed hook.
    """

    strategy_name = "sync"

    def __init__(self, *, time_comm: bool = False, shard: Shard = "none", procs_per_node: Optional[int] = None,
                 param_dtype: ShardDtype = "fp32", reduce_dtype: ShardDtype = "fp32", **kwargs: Any) -> None:
        """
        Args:
            time_comm: time every bucket's all-reduce (issue to completion) through a Python hook, so the
                summary and the logs show the communication share of training time (``comm/time_share``);
                costs about 2% of throughput against DDP's own all-reduce (``python -m benchmarks overhead``).
            shard: ``none``: every process holds a full replica (DDP); ``node``: parameters, gradients and
                optimizer state are sharded over the processes of a node (FSDP2), and the gradient shards
                are averaged across nodes in fp32 by gradsync (HSDP, counted by the ledger).
            procs_per_node: with ``shard node``, force the layout (K processes play one node), for tests
                on one machine; default: what torchrun / SLURM say.
            param_dtype: with ``shard node``: the dtype FSDP2 gathers and computes each unit in (``fp32``,
                ``bf16``, ``fp16``); the sharded parameters and the optimizer stay fp32.
            reduce_dtype: with ``shard node``: the dtype of FSDP2's intra-node gradient reduce-scatter.
            **kwargs: :class:`~gradsync.strategies.base.GradsyncStrategy`'s options.
        """
        check(isinstance(time_comm, bool), "time_comm", time_comm, "must be true or false")
        self.time_comm = time_comm
        super().__init__(**kwargs)
        self._set_shard(shard, param_dtype, reduce_dtype)
        self._set_scope("world", procs_per_node)

    def sharded_gradient_reducer(self) -> Reducer:
        return self.inter_node_reducer()

    #: True once :meth:`build_comm_hook` chose the summing hook: then backward divides the loss by N.
    _mean_in_loss = False

    def build_comm_hook(self) -> Optional[tuple[Any, Any]]:
        if self.fault_tolerance is not None:
            return self._managed_hook()
        if self.time_comm:
            self._mean_in_loss = True
            return AllReduceState(ledger=self.ledger), allreduce_sum_hook
        self.ledger.timed = False  # DDP's reducer runs the collectives; their bytes are booked in backward
        self._synced_steps = 0
        return None

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._mean_in_loss and self.world_size > 1:
            # d(loss/N) = grad/N: the mean's division rides on the backward pass (exact for N a power
            # of two, within rounding otherwise) and the timed hook only sums.
            closure_loss = closure_loss / self.world_size
        ddp = self.model if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) else None
        # DDP all-reduces in this backward unless Lightning's no_sync holds it (accumulated micro-batches)
        synced = (not self._mean_in_loss and self.fault_tolerance is None and ddp is not None
                  and ddp.require_backward_grad_sync and self.world_size > 1)
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if synced:
            record_builtin_allreduce(self.ledger, ddp, self._synced_steps)
            self._synced_steps += 1
        return out

    _synced_steps = 0

    # ---- fault-tolerant replica groups (torchft's FT-DDP: a quorum per optimizer step) -------------
    def _unsupported_across_groups(self) -> list:
        # (DDP never rebuilds its buckets with find_unused_parameters: the layouts the groups agree on below
        # assume it does)
        return [(self.sharded, "shard", self.shard, "none"),
                (self.find_unused_parameters, "find_unused_parameters", True, False)]

    #: True for a step whose quorum holds groups past their first backward while this one is at its own
    _behind_layout = False

    def _managed_hook(self) -> tuple[Any, Callable]:
        """Each step's gradients, averaged over the groups of the step's quorum in one all-reduce (the
        group forms it in :meth:`optimizer_step` before backward; DDP calls this hook during backward)."""
        from gradsync.comm.managed import ManagedReducer

        module = self.lightning_module
        floating = [name for name, b in module.named_buffers() if b.is_floating_point()]
        if floating:
            raise GradsyncError(
                f"--fault-tolerance torchft with sync: the model has floating-point buffers ({floating[0]}, e.g. "
                "BatchNorm statistics), which replica groups do not share step by step yet; use a model without "
                "them, or diloco / local_sgd, which average them at every round")
        self.ledger.timed = True
        self._steps = _StepCount()
        self.replicas = self._new_replica_group()
        reducer = ManagedReducer(self.replicas, ledger=self.ledger, divide_first=True)
        state = WholeStepState(reducer, steps=self._steps, behind=lambda: self.replicas.healing or self._behind_layout)
        self._hook_state = state.bind(module.named_parameters())
        return state, whole_step_hook

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.replicas is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        replicas = self.replicas
        replicas.begin_round()  # this step's quorum; a group behind the others fetches a live one's state
        if replicas.step == 0 and not replicas.healing:  # no step committed yet: groups that start together
            if self._ft_fingerprint is not None:  # agree on the run first,
                self._refuse_mismatch(replicas.disagreeing(self._ft_fingerprint), "the groups of this quorum")
            self._agree_on_layout()  # and on how the step's message is laid out

        def managed_closure() -> Any:
            result = closure()  # backward: whole_step_hook averages the gradients over the quorum
            if not replicas.commit():  # (a healing group loads the live group's state here)
                # a group failed during the step: every gradient may be partial, the optimizer does not step
                # (None: a mixed-precision scaler skips it too)
                optimizer.zero_grad(set_to_none=True)
                return None
            return result

        self._hook_state.ready.clear()  # (the order of this step's last backward; accumulated ones came before)
        try:
            return super().optimizer_step(optimizer, managed_closure, model, **kwargs)
        finally:
            self._steps.num_steps += 1
            self._behind_layout = False

    def _agree_on_layout(self) -> None:
        """Before the first committed step, some groups may have run a backward already (a step 0 that a
        failure undid) while a restarted one has not: DDP lays a process's first backward out in model
        order and the rest in ready order, so the fresh group sends in the others' (one 4-byte all-reduce)."""
        fresh = self._hook_state.backwards == 0
        flag = torch.tensor([1.0 if fresh else 0.0])
        self.replicas.allreduce_mean(flag)
        self.ledger.record("all_reduce", 4, group_size=self.replicas.wire_size(), purpose="control")
        self._behind_layout = fresh and 0.0 < float(flag) < 1.0

    def _shared_algorithm_state(self) -> Any:
        return {"num_steps": self._steps.num_steps}

    def _load_shared_algorithm_state(self, state: Any) -> None:
        self._steps.num_steps = int(state["num_steps"])

    def teardown(self) -> None:
        self._leave_replica_groups()
        super().teardown()

    def run_stats(self) -> dict:
        return {**super().run_stats(), **self._replica_group_stats()}


class _StepCount:
    """The optimizer steps of a fault-tolerant ``sync`` group (a healing group takes over the others')."""

    num_steps = 0
