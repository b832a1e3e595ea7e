"""``sync``: synchronous data parallel (DDP) with a communication ledger."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from gradsync.algorithms import Schedule
from gradsync.comm.ddp import AllReduceState, allreduce_hook, allreduce_sum_hook, record_builtin_allreduce
from gradsync.comm.reducer import Reducer
from gradsync.errors import check
from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.replicas import QuorumPerStep
from gradsync.strategies.sharding import Shard, ShardDtype

__all__ = ["AllReduceState", "SyncStrategy", "allreduce_hook", "allreduce_sum_hook"]


class SyncStrategy(QuorumPerStep, GradsyncStrategy):
    """Synchronous data parallel: every step all ranks apply the mean of all ranks' gradients.

    The reduction is DDP's own (C++, bucketed, overlapped with backward), with no Python hook, so
    ``sync`` costs what stock DDP costs; the ledger books each synchronized backward as one fp32
    all-reduce of the gradients. Its time in flight is not measured (``comm.seconds`` is ``null`` in
    the summary) unless ``time_comm`` routes every bucket through a timed hook.
    """

    strategy_name = "sync"
    takes_ddp_comm_hook = True

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
        check(not (time_comm and kwargs.get("ddp_comm_hook")), "time_comm", time_comm,
              "times gradsync's own all-reduce hook, and a ddp_comm_hook replaces it", "give one of them")
        self.time_comm = time_comm
        super().__init__(**kwargs)
        self._set_shard(shard, param_dtype, reduce_dtype)
        self._set_scope("world", procs_per_node)

    def sharded_gradient_reducer(self) -> Reducer:
        return self._shard_reducer if self.replicas is not None else self.inter_node_reducer()

    #: True once :meth:`build_comm_hook` chose the summing hook: then backward divides the loss by N.
    _mean_in_loss = False

    def build_comm_hook(self) -> Optional[tuple[Any, Any]]:
        if self.fault_tolerance is not None:
            return self._managed_hook()
        if self._user_comm_hook is not None:  # DDPStrategy(ddp_comm_hook=...)'s meaning, on every device
            state, hook, wrapper = self._user_comm_hook
            # its bytes are booked as the fp32 all-reduce it replaces: gradsync cannot see inside it
            self.ledger.timed = False
            self._synced_steps = 0
            return state, (wrapper(hook) if wrapper is not None else hook)
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
    def _step_reducer(self) -> Reducer:
        from gradsync.comm.managed import ManagedReducer

        # each group divides by the participants and the quorum sums, as DDP's own all-reduce does
        return self._within_group(ManagedReducer(self.replicas, ledger=self.ledger, divide_first=True,
                                                       scope=self._across_scope()))

    def _step_count(self) -> Schedule:
        if self._steps is None:
            self._steps = Schedule()  # the optimizer steps taken (a healing group takes over the others')
        return self._steps

    _steps: Optional[Schedule] = None

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        step = super().optimizer_step
        if self.replicas is None:
            return step(optimizer, closure, model, **kwargs)
        try:
            return self._quorum_step(optimizer, closure, lambda managed: step(optimizer, managed, model, **kwargs))
        finally:
            self._step_count().num_steps += 1


