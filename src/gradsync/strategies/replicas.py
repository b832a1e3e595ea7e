"""What a strategy needs to train as one of several fault-tolerant replica groups (``--fault-tolerance torchft``).

:class:`ReplicaGroupMember` is the part shared by ``sync`` (a quorum per optimizer step, torchft's FT-DDP)
and ``local_sgd`` / ``diloco`` (a quorum per averaging round): the configuration and its refusals, the
data split across groups, the state a healing group receives from a live one and how it takes it over,
the configuration check between groups, and the telemetry in the run summary. When the quorums are
formed and what crosses between groups is the strategy's own.
"""

from __future__ import annotations

from typing import Any, Optional

from gradsync.errors import GradsyncError, spell
from gradsync.strategies.lightning_private import batches_that_stepped, set_batches_that_stepped


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

        return ReplicaGroup(self.fault_tolerance, state_dict=self._heal_state, load_state_dict=self._heal,
                            ledger=self.ledger)  # type: ignore[attr-defined]

    def _refuse_mismatch(self, fields: list[str], between: str) -> None:
        if fields:
            raise GradsyncError(f"replica groups were started with different configurations: {', '.join(fields)} "
                                f"differ ({between}); start every group with the same flags and code")

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
        return {"module": self.lightning_module.state_dict(),  # type: ignore[attr-defined]
                "optimizers": [o.state_dict() for o in self.optimizers],  # type: ignore[attr-defined]
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
