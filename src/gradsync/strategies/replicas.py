"""What a strategy needs to train as one of several fault-tolerant replica groups (``--fault-tolerance torchft``).

:class:`ReplicaGroupMember` is the part shared by ``sync`` and ``compressed`` (a quorum per optimizer step,
torchft's FT-DDP: :class:`QuorumPerStep`) and ``local_sgd`` / ``diloco`` (a quorum per averaging round): the configuration and its refusals, the
data split across groups, the state a healing group receives from a live one and how it takes it over,
the configuration check between groups, and the telemetry in the run summary. When the quorums are
formed and what crosses between groups is the strategy's own.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from gradsync.errors import GradsyncError, spell
from gradsync.strategies.lightning_private import batches_that_stepped, set_batches_that_stepped


def codec_across_groups(codec: Any) -> tuple[bool, str, Any, Any]:
    """The refusal entry (see :meth:`ReplicaGroupMember._unsupported_across_groups`) of a round's codec
    (a :class:`~gradsync.comm.CodecSpec`): one whose state cannot follow a change of membership."""
    return not codec.traits.survives_membership_change, "codec", codec.name, "int8"


class ReplicaGroupMember:
    """Mixed into a :class:`~gradsync.strategies.base.GradsyncStrategy`. Subclasses say what they cannot
    do across groups (:meth:`_unsupported_across_groups`) and what algorithm state a healing group
    takes over (:meth:`_shared_algorithm_state` / :meth:`_load_shared_algorithm_state`)."""

    fault_tolerance: Optional[Any] = None  # gradsync.comm.managed.FaultToleranceConfig
    _ft_fingerprint: Optional[dict[str, str]] = None
    replicas: Optional[Any] = None  # gradsync.comm.managed.ReplicaGroup, while training

    def _unsupported_across_groups(self) -> list[tuple[bool, str, Any, Any]]:
        """``(bad, option, value, fix)`` for every option this strategy cannot run across replica groups."""
        return []

    def enable_fault_tolerance(self, config: Any, fingerprint: Optional[dict[str, str]] = None) -> None:
        """Train as one of ``config.replica_groups`` fault-tolerant replica groups (``--fault-tolerance
        torchft``), healing from a live group when this one rejoins. ``fingerprint`` (field -> digest of
        the run's configuration) must be the same on every group: groups that start together compare it
        before their first step, a healing group with the group it heals from, and any field that
        differs stops the group(s) in one line naming it."""
        from gradsync.comm.managed import import_torchft

        for bad, option, value, fix in self._unsupported_across_groups():
            if bad:
                raise GradsyncError(f"--fault-tolerance torchft: {spell(option, value)} is not supported across "
                                    f"replica groups yet; use {spell(option, fix)}")
        import_torchft()
        self.fault_tolerance = config
        self._ft_fingerprint = fingerprint
        if config.processes > 1 or self.sharded:  # type: ignore[attr-defined]
            # the group is one replica, as a node of a node-scoped job is: DDP (or FSDP2, shard node) inside
            # it, and each process meets the processes of its local rank in the other groups
            self._set_scope("node", config.processes)  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict:
        kwargs = dict(super().distributed_sampler_kwargs)  # type: ignore[misc]
        ft = self.fault_tolerance
        if ft is not None:  # replica group g holds ranks g*W .. g*W+W-1 of the data across all groups
            kwargs["rank"] = ft.replica_group * kwargs["num_replicas"] + kwargs["rank"]
            kwargs["num_replicas"] *= ft.replica_groups
        return kwargs

    def _new_replica_group(self) -> Any:
        from gradsync.comm.managed import ReplicaGroup

        group = ReplicaGroup(self.fault_tolerance, state_dict=self._heal_state, load_state_dict=self._heal,
                             ledger=self.ledger)  # type: ignore[attr-defined]
        if self._restored_telemetry is not None:  # the group's earlier processes' figures (a restart)
            group.telemetry.load_state_dict(self._restored_telemetry)
            self._restored_telemetry = None
        return group

    _restored_telemetry: Optional[dict] = None

    # ---- checkpoints: the membership figures, with the ledger they agree with ----------------------
    def algorithm_state_dict(self) -> dict:
        state = super().algorithm_state_dict()  # type: ignore[misc]
        if self.replicas is not None:
            state["replica_telemetry"] = self.replicas.telemetry.state_dict()
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)  # type: ignore[misc]
        if state.get("replica_telemetry") is not None:
            if self.replicas is not None:
                self.replicas.telemetry.load_state_dict(state["replica_telemetry"])
            else:  # restored before the group is joined
                self._restored_telemetry = state["replica_telemetry"]

    def _refuse_mismatch(self, fields: list[str], between: str) -> None:
        if fields:
            raise GradsyncError(f"replica groups were started with different configurations: {', '.join(fields)} "
                                f"differ ({between}); start every group with the same flags and code")

    def _within_group(self, across: Any, *, replicated: bool = False) -> Any:
        """``across`` (a reducer between the groups of a quorum) as this process's reducer: in a group of several
        unsharded processes, wrapped in the hierarchical mean — each process's share of the group's mean
        (``replicated``: of its replica) crosses to its local rank's peers, and the group gathers the shares
        (as ``scope node`` does between the nodes of one job). Sharded, each process holds its share already."""
        from gradsync.comm.hierarchical import NodeReducer

        topology = self.topology  # type: ignore[attr-defined]
        if (self.scope == "node" and topology is not None and topology.procs_per_node > 1  # type: ignore[attr-defined]
                and not self.sharded):  # type: ignore[attr-defined]
            return NodeReducer(across, intra=topology.intra, replicated=replicated)
        return across

    def _across_scope(self) -> str:
        """The ledger's scope of what crosses between groups (the slow hop of a node-scoped job)."""
        from gradsync.comm.hierarchical import INTER

        return INTER if self.scope == "node" else "world"  # type: ignore[attr-defined]

    # ---- healing ----------------------------------------------------------------------------------
    def _shared_algorithm_state(self) -> Any:
        """The algorithm state every group holds the same (a healing group takes it over)."""
        return None

    def _load_shared_algorithm_state(self, state: Any) -> None:
        pass

    def _step_progress(self) -> Any:
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total

    def _heal_state(self) -> dict:
        """What a healing group receives from this one: the model, the optimizer and scheduler states, the
        algorithm's shared state and the step counters."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        progress = self._step_progress()
        # A quorum is formed inside an optimizer step, which Lightning counts as ready, and as completed
        # only once it returns: ``ready - completed`` says whether this group is inside one.
        # (Sharded, FSDP2: this process's shards, which the healing group's process of its local rank holds.)
        return {"module": _local_parts(self.lightning_module.state_dict()),  # type: ignore[attr-defined]
                "optimizers": [_local_parts(o.state_dict()) for o in self.optimizers],  # type: ignore[attr-defined]
                "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                "algorithm": self._shared_algorithm_state(), "global_step": progress.ready,
                "in_step": progress.ready - progress.completed, "batches_that_stepped": batches_that_stepped(trainer),
                "config": self._ft_fingerprint}

    def _heal(self, state: dict) -> None:
        """Take over a live group's state. Its step counters too: when the donor was inside a step and this
        group is not (it heals before its first step), that step counts as done here."""
        mine, theirs = self._ft_fingerprint, state.get("config")
        if mine is not None and theirs is not None:
            differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            self._refuse_mismatch(differ, "this group and the one it heals from")
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = module.trainer
        if self.sharded:  # type: ignore[attr-defined]
            _load_shards(module, self.optimizers, state)  # type: ignore[attr-defined]
        else:
            module.load_state_dict(state["module"])
            for optimizer, saved in zip(self.optimizers, state["optimizers"]):  # type: ignore[attr-defined]
                optimizer.load_state_dict(saved)
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(saved)
        self._load_shared_algorithm_state(state["algorithm"])
        progress = self._step_progress()
        before, mine_in_step = progress.ready, progress.ready - progress.completed
        theirs_in_step = int(state.get("in_step", 1))
        progress.ready = int(state["global_step"])
        progress.completed = progress.ready - mine_in_step
        set_batches_that_stepped(trainer, int(state["batches_that_stepped"]) + theirs_in_step - mine_in_step)
        self.replicas.telemetry.steps_healed_over += progress.ready - before

    # ---- reporting and the end -------------------------------------------------------------------
    def _replica_group_stats(self) -> dict:
        if self.fault_tolerance is None:
            return {}
        return {"fault_tolerance": {**self.fault_tolerance.describe(),
                                    **(self.replicas.telemetry.summary() if self.replicas is not None else {})}}

    def _leave_replica_groups(self) -> None:
        if self.replicas is not None:
            self.replicas.shutdown()


def _local_parts(tree: Any) -> Any:
    """``tree`` with every DTensor (an FSDP2 shard) replaced by this process's local tensor, which torchft's
    transport sends as it sends any tensor (a DTensor would carry its device mesh)."""
    from gradsync.algorithms.layout import local_part

    if isinstance(tree, torch.Tensor):
        return local_part(tree)
    if isinstance(tree, dict):
        return {k: _local_parts(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local_parts(v) for v in tree)
    return tree


@torch.no_grad()
def _load_shards(module: torch.nn.Module, optimizers: list, state: dict) -> None:
    """A peer's local shards (:func:`_local_parts`) into this process's sharded module and optimizers: the
    module's in place, the optimizers' state rebuilt as DTensors laid out as their parameters."""
    from torch.distributed.tensor import DTensor

    from gradsync.algorithms.layout import local_part

    saved = state["module"]
    for name, value in module.state_dict().items():
        local_part(value).copy_(saved[name])
    for optimizer, theirs in zip(optimizers, state["optimizers"]):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        rebuilt = dict(theirs, state={})
        for index, entries in theirs["state"].items():
            p = params[int(index)]
            rebuilt["state"][index] = {
                key: (DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                      if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == local_part(p).shape
                      and v.dim() > 0 else v)
                for key, v in entries.items()}
        optimizer.load_state_dict(rebuilt)


class QuorumPerStep(ReplicaGroupMember):
    """A quorum per optimizer step (torchft's fault-tolerant DDP): ``sync`` and ``compressed``.

    Every step forms a quorum before its backward; DDP's buckets are collected and the step's gradients
    cross between groups in one reduction (:func:`~gradsync.comm.ddp.whole_step_hook`) through the
    strategy's :meth:`_step_reducer`. A restarted group heals inside a step of the others: it joins its
    quorum and reduction sending zeros, takes a live group's state at the step's commit (inside the
    optimizer closure) and applies the same mean. A step that a failure leaves uncommitted does not step
    the optimizer and leaves the reducer's state (error-feedback residuals) as it was.
    """

    #: True for a step whose quorum holds groups past their first backward while this one is at its own
    _behind_layout = False
    #: lay each step's message out in the model's order (a codec's), not DDP's (see WholeStepState)
    _canonical_layout = False
    _step_state: Optional[Any] = None  # gradsync.comm.ddp.WholeStepState

    def _unsupported_across_groups(self) -> list:
        # (DDP never rebuilds its buckets with find_unused_parameters: the layouts the groups agree on
        # assume it does)
        return [(self.find_unused_parameters, "find_unused_parameters", True, False)]  # type: ignore[attr-defined]

    def _step_reducer(self) -> Any:
        """The reducer of a step's gradients across the groups of its quorum (``self.replicas`` exists)."""
        raise NotImplementedError

    def _step_count(self) -> Any:
        """The owner of the optimizer-step count (``num_steps``), which a healing group takes over."""
        raise NotImplementedError

    def _join_step_quorums(self) -> None:
        """Become a replica group (at set-up): refuse what groups cannot share step by step, then join."""
        module = self.lightning_module  # type: ignore[attr-defined]
        floating = [name for name, b in module.named_buffers() if b.is_floating_point()]
        if floating:
            raise GradsyncError(
                f"--fault-tolerance torchft with {self.strategy_name}: the model has floating-point buffers "  # type: ignore[attr-defined]
                f"({floating[0]}, e.g. BatchNorm statistics), which replica groups do not share step by step yet; "
                "use a model without them, or diloco / local_sgd, which average them at every round")
        self.ledger.timed = True  # type: ignore[attr-defined]
        self.replicas = self._new_replica_group()

    def _managed_hook(self) -> tuple[Any, Callable]:
        """DDP's hook: each step's gradients, reduced over the groups of the step's quorum at once (the
        quorum is formed in :meth:`_quorum_step` before backward; DDP calls this hook during backward)."""
        from gradsync.comm.ddp import WholeStepState, whole_step_hook

        module = self.lightning_module  # type: ignore[attr-defined]
        self._join_step_quorums()
        state = WholeStepState(self._step_reducer(), steps=self._step_count(), canonical=self._canonical_layout,
                               behind=lambda: self.replicas.healing or self._behind_layout)
        self._step_state = state.bind(module.named_parameters())
        return state, whole_step_hook

    # ---- FSDP2 inside the group (shard node) ---------------------------------------------------
    #: sharded: the reducer of each step's gradient shards across the groups (no DDP hook: FSDP2's
    #: reduce-scatter inside the group, then this, after backward)
    _shard_reducer: Optional[Any] = None

    def configure_ddp(self) -> None:
        super().configure_ddp()  # type: ignore[misc]
        if self.fault_tolerance is not None and self.sharded:  # type: ignore[attr-defined]
            self._join_step_quorums()
            self._shard_reducer = self._step_reducer()

    def _shards_cross(self) -> bool:
        return self.replicas is not None or super()._shards_cross()  # type: ignore[misc]

    # ---- a step inside its quorum -------------------------------------------------------------
    #: inside :meth:`_quorum_step`: the reducer's mark to roll back to, and whether the step was kept
    _in_step: Optional[tuple] = None
    _kept = False

    def _quorum_step(self, optimizer: Any, closure: Callable[[], Any], step: Callable[[Callable[[], Any]], Any]) -> Any:
        """``step(closure)`` (the strategy's own optimizer step) inside this step's quorum; the commit comes
        once the step's gradients are reduced (:meth:`_gradients_reduced`)."""
        replicas, started = self.replicas, time.perf_counter()
        replicas.begin_round()  # this step's quorum; a group behind the others fetches a live one's state
        if replicas.step == 0 and not replicas.healing:  # no step committed yet: groups that start together
            if self._ft_fingerprint is not None:  # agree on the run first,
                self._refuse_mismatch(replicas.disagreeing(self._ft_fingerprint), "the groups of this quorum")
            if self._step_state is not None:
                self._agree_on_layout()  # and on how the step's message is laid out (DDP's buckets)
        reducer = self._step_state.reducer if self._step_state is not None else self._shard_reducer
        self._in_step, self._kept = (reducer, reducer.mark()), False
        if self._step_state is not None:
            self._step_state.ready.clear()  # (the order of this step's last backward; accumulated ones came before)
        try:
            return step(closure)
        finally:
            self._in_step, self._behind_layout = None, False
            replicas.telemetry.note_step(time.perf_counter() - started, self._kept)

    def _gradients_reduced(self, optimizer: Any, result: Any) -> Any:
        """The step's gradients are reduced over the quorum (by DDP's hook during backward, or after it for
        gradient shards): commit, or drop the step."""
        if self._in_step is None:
            return super()._gradients_reduced(optimizer, result)  # type: ignore[misc]
        reducer, mark = self._in_step
        self._kept = self.replicas.commit()  # (a healing group loads the live group's state here)
        if not self._kept:
            # a group failed during the step: every gradient may be partial, the optimizer does not step
            # (None: a mixed-precision scaler skips it too), and the codec's residuals are as before
            reducer.roll_back(mark)
            optimizer.zero_grad(set_to_none=True)
            return None
        return result

    def _agree_on_layout(self) -> None:
        """Before the first committed step, some groups may have run a backward already (a step 0 that a
        failure undid) while a restarted one has not: DDP lays a process's first backward out in model
        order and the rest in ready order, so the fresh group sends in the others' (one 4-byte all-reduce)."""
        fresh = self._step_state.backwards == 0
        flag = self.replicas.mean(torch.tensor([1.0 if fresh else 0.0]), purpose="control")
        self._behind_layout = fresh and 0.0 < float(flag) < 1.0

    def _shared_algorithm_state(self) -> Any:
        return {"num_steps": self._step_count().num_steps}

    def _load_shared_algorithm_state(self, state: Any) -> None:
        self._step_count().num_steps = int(state["num_steps"])

    def teardown(self) -> None:
        self._leave_replica_groups()
        super().teardown()  # type: ignore[misc]

    def run_stats(self) -> dict:
        return {**super().run_stats(), **self._replica_group_stats()}  # type: ignore[misc]
