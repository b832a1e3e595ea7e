"""The Lightning side of ``local_sgd`` and ``diloco``: configuration, and the algorithm installed.

The algorithm itself — the schedule, the rounds, what they send and what the mean becomes — is
:class:`gradsync.algorithms.periodic.PeriodicAveraging`, pure torch. This adapter:

* validates the options (one line each, naming the option);
* keeps DDP from averaging local steps: its communication hook (:func:`local_or_warmup_hook`)
  hands each bucket back untouched, except during ``warmup_steps`` of synchronous training
  (post-local SGD), and under node scope, where it averages inside the node;
* runs the algorithm around every optimizer step, and its final round before any callback sees
  the end of training;
* puts the algorithm's state registry into the checkpoint with this rank's local parameters and
  optimizer state (Lightning's checkpoint holds rank 0's only), and reshards it on another world
  size with one warning.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
import time
import warnings
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from gradsync.algorithms import PeriodicAveraging, Schedule
from gradsync.algorithms.state import codec_change
from gradsync.comm import CODEC_OPTIONS, REDUCERS, Codec, CodecSpec
from gradsync.comm.ddp import AllReduceState, allreduce_hook, local_hook
from gradsync.comm.hierarchical import INTRA, NodeReducer
from gradsync.comm.reducer import Reducer
from gradsync.errors import GradsyncError, check, spell
from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.lightning_private import ddp_kwargs
from gradsync.strategies.replicas import ReplicaGroupMember, codec_across_groups
from gradsync.strategies.sharding import Shard, ShardDtype

Scope = Literal["world", "node"]



class PeriodicHookState:
    """What the DDP hook of local steps reads: the schedule (is this a warm-up step?) and the groups."""

    def __init__(self, schedule: Schedule, sync: AllReduceState) -> None:
        self.schedule, self.sync = schedule, sync
        #: node scope: the intra-node all-reduce of every local step (None: local steps send nothing)
        self.node: Optional[AllReduceState] = None

    @property
    def in_warmup(self) -> bool:
        return self.schedule.in_warmup


def local_or_warmup_hook(state: PeriodicHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """During warm-up, average the bucket like ``sync``; afterwards keep the local gradient (node
    scope: average it inside the node)."""
    if state.in_warmup:
        return allreduce_hook(state.sync, bucket)
    if state.node is not None:
        return allreduce_hook(state.node, bucket)
    return local_hook(state, bucket)


class PeriodicAveragingStrategy(ReplicaGroupMember, GradsyncStrategy):
    """Base of strategies that train locally and average every ``period`` optimizer steps.

    Subclasses say what a round sends and makes of the mean (:meth:`build_payload`).
    """

    #: Local steps: ranks' gradients differ, so the non-finite check must ask every rank.
    gradients_synchronized = False

    #: Streaming settings; only ``diloco`` exposes them as options.
    fragments: int = 1
    sync_delay: int = 0
    fragment_alpha: float = 0.0

    def __init__(
        self,
        *,
        period: int = 8,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        overlap: bool = False,
        codec: Codec = "identity",
        error_feedback: Optional[bool] = None,
        chunk_size: int = CODEC_OPTIONS["chunk_size"][0],
        fraction: float = CODEC_OPTIONS["fraction"][0],
        rank: int = CODEC_OPTIONS["rank"][0],
        warm_start: bool = CODEC_OPTIONS["warm_start"][0],
        seed: int = CODEC_OPTIONS["seed"][0],
        sparse_chunk_size: int = CODEC_OPTIONS["sparse_chunk_size"][0],
        sparse_k: int = CODEC_OPTIONS["sparse_k"][0],
        value_bits: int = CODEC_OPTIONS["value_bits"][0],
        error_decay: Optional[float] = None,
        scope: Scope = "world",
        procs_per_node: Optional[int] = None,
        shard: Shard = "none",
        param_dtype: ShardDtype = "fp32",
        reduce_dtype: ShardDtype = "fp32",
        **kwargs: Any,
    ) -> None:
        """
        Args:
            period: optimizer steps between averaging rounds, >= 1.
            warmup_steps: synchronous (all-reduced) optimizer steps before local training starts.
            average_buffers: also average floating-point buffers (e.g. BatchNorm statistics) once per
                period, in fp32; otherwise each rank keeps its own.
            overlap: issue each round's reduction without waiting and apply it one period later.
            codec: how a round's tensors cross the network: ``identity`` (fp32, exact), ``fp16``,
                ``bf16``, ``int8``, ``int4``, ``sign``, ``topk``, ``powersgd``, ``sparseloco`` — the codecs of
                ``compressed``, with the same options.
            error_feedback: carry what the codec dropped into the next round (per rank, per
                parameter). Default: on for every lossy codec, off for ``identity``.
            chunk_size: int8, int4, sign: entries that share one float32 scale.
            fraction: topk: share of entries sent per round, in (0, 1].
            rank: powersgd: rank of the approximation, >= 1.
            warm_start: powersgd: start each power iteration from the previous round's Q.
            seed: int8, int4: stochastic-rounding seed (rank r uses seed + r); powersgd: initial Q.
            sparse_chunk_size: sparseloco: entries per top-k chunk, a power of two.
            sparse_k: sparseloco: entries sent per chunk.
            value_bits: sparseloco: bits per sent value, 2, 4 or 8.
            error_decay: sparseloco: factor on the error-feedback residual before it is added, in (0, 1].
                Default: SparseLoCo's 0.95 with error feedback on, else 1.
            scope: ``world``: every rank trains its own replica and rounds average all of them;
                ``node``: every inner step all-reduces gradients inside the node (fp32, as DDP), so
                each node holds one replica, and rounds (with their codec) run across nodes only.
            procs_per_node: force the layout (K processes play one node), for tests on one machine;
                default: what torchrun / SLURM say.
            shard: ``none``: every process holds a full replica; ``node``: each node is one replica whose
                parameters, gradients and optimizer state are sharded over its processes (FSDP2), and a
                round reduces each process's parameter shard across nodes (implies ``scope node``).
            param_dtype: with ``shard node``: the dtype FSDP2 gathers and computes each unit in (``fp32``,
                ``bf16``, ``fp16``); the sharded parameters and the optimizer stay fp32.
            reduce_dtype: with ``shard node``: the dtype of FSDP2's intra-node gradient reduce-scatter.
            **kwargs: DDP and process-group options of :class:`~gradsync.strategies.base.GradsyncStrategy`.
        """
        if error_decay is None:
            traits = REDUCERS.get(codec)  # (an unknown codec is refused by CodecSpec.parse below)
            with_feedback = traits is not None and traits.lossy and error_feedback is not False
            error_decay = traits.round_error_decay if with_feedback else CODEC_OPTIONS["error_decay"][0]
        #: the round's codec with its options and error feedback (on by default for every lossy codec)
        self.codec_spec = CodecSpec.parse(codec, {
            "chunk_size": chunk_size, "fraction": fraction, "rank": rank, "warm_start": warm_start, "seed": seed,
            "sparse_chunk_size": sparse_chunk_size, "sparse_k": sparse_k, "value_bits": value_bits,
            "error_decay": error_decay}, error_feedback)
        self.period, self.warmup_steps = period, warmup_steps
        self.average_buffers, self.overlap = bool(average_buffers), bool(overlap)
        self.codec, self.error_feedback = codec, self.codec_spec.error_feedback
        for option, value in self.codec_spec.options.items():
            setattr(self, option, value)
        super().__init__(**kwargs)
        self._set_shard(shard, param_dtype, reduce_dtype)
        # a sharded node holds one replica: rounds run across nodes
        self._set_scope("node" if self.sharded else scope, procs_per_node)
        # Buffers are averaged at rounds (average_buffers) or stay local; DDP's per-forward
        # broadcast of rank 0's buffers would be unaccounted traffic that overrides both.
        ddp_kwargs(self)["broadcast_buffers"] = False
        self._schedule: Optional[Schedule] = None
        self._algorithm: Optional[PeriodicAveraging] = None
        self._round_reducer: Optional[Reducer] = None
        self._restored_optimizer_states: Optional[list] = None

    def _configure_streaming(self, fragments: int = 1, sync_delay: int = 0, fragment_alpha: float = 0.0) -> None:
        """Set and validate the schedule (subclasses with streaming options pass them here)."""
        self.fragments, self.sync_delay, self.fragment_alpha = fragments, sync_delay, float(fragment_alpha)
        self._schedule = Schedule(period=self.period, warmup_steps=self.warmup_steps, fragments=fragments,
                                  sync_delay=sync_delay)
        check(0.0 <= self.fragment_alpha <= 1.0, "fragment_alpha", fragment_alpha,
              "must be in [0, 1] (0: take the global parameters)", f"e.g. {spell('fragment_alpha', 0)}")
        check(not (self.overlap and (fragments > 1 or sync_delay > 0)), "overlap", self.overlap,
              "is the whole-model, one-period-stale variant and cannot be combined with fragments or sync_delay",
              f"drop {spell('overlap')} and use {spell('sync_delay')}")
        self.payload = self.build_payload()

    def build_payload(self) -> Any:
        """What a round sends and makes of the mean (an :class:`~gradsync.algorithms.periodic.Payload`)."""
        raise NotImplementedError

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            self._configure_streaming()
        return self._schedule

    # ---- the algorithm ---------------------------------------------------------------------------
    @property
    def algorithm(self) -> PeriodicAveraging:
        """The algorithm over this module (built once the module is known)."""
        if self._algorithm is None:
            self._algorithm = PeriodicAveraging(
                None, self.payload, self.schedule, reducer=lambda: self.reducer, ledger=self.ledger,
                overlap=self.overlap, fragment_alpha=self.fragment_alpha, average_buffers=self.average_buffers)
            # Lightning's checkpoint holds rank 0's weights and optimizer state only; between rounds
            # every rank has its own
            registry = self._algorithm.registry
            if not self.sharded:  # sharded: each node's shards are in the checkpoint's own folder
                registry.register("local_params", "averaged", self._local_params, self._load_local_params)
                registry.register("local_optimizer_states", "per_rank",
                                  lambda: [o.state_dict() for o in self.optimizers], self._keep_optimizer_states)
        algorithm = self._algorithm
        # the module is known once the trainer connects it, gradsync's groups once they are set up
        if algorithm.module is None and self.lightning_module is not None:
            algorithm.module = self.lightning_module
        if self.topology is not None and algorithm.buffer_group is None:
            algorithm.buffer_group, algorithm.scope = self.comm_group, self.round_scope()
            if self.sharded:  # parameter-shaped tensors are shards: equal in shape across nodes only
                algorithm.param_group = self.topology.inter
        return algorithm

    @property
    def reducer(self) -> Reducer:
        """The reducer of rounds (built on gradsync's own group at first use)."""
        if self._round_reducer is None and self.replicas is not None:
            from gradsync.comm.managed import ManagedReducer

            scope = self._across_scope()
            reducer = (ManagedReducer(self.replicas, ledger=self.ledger, scope=scope) if not self.codec_spec.lossy
                       else self.replicas.codec_reducer(self.codec_spec, scope))
            # a group of several processes holds one replica: each sends its 1/K share across groups
            self._round_reducer = self._within_group(reducer, replicated=True)
        if self._round_reducer is None:
            reducer = self.codec_spec.build(ledger=self.ledger, group=self.round_group(), scope=self.round_scope())
            if self.scope == "node" and not self.sharded:
                # every process of a node holds the same replica: each sends its 1/K shard across nodes
                reducer = NodeReducer(reducer, intra=self.topology.intra, replicated=True)
            self._round_reducer = reducer
        return self._round_reducer

    #: At a checkpoint the nodes' local parameters differ: each node's shards are kept.
    nodes_may_differ = True

    def sharded_gradient_reducer(self) -> Optional[Reducer]:
        # warm-up steps are synchronous across nodes; local steps stay inside the node
        return self.inter_node_reducer() if self.schedule.in_warmup else None

    def round_group(self) -> Optional[dist.ProcessGroup]:
        """The process group rounds average over (node scope: this local rank's inter-node group)."""
        if self.scope == "node" and self.topology is not None:
            return self.topology.inter
        return self.comm_group

    def round_scope(self) -> str:
        return self._across_scope()

    def finish(self) -> None:
        """End of fit: apply anything in flight, then sync every fragment the ranks disagree on, once."""
        if self._algorithm is not None:
            self._algorithm.finish()

    def flush(self) -> None:
        if self._algorithm is not None:
            self._algorithm.flush()

    # ---- hooks into Lightning ------------------------------------------------------------------
    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        state = PeriodicHookState(self.schedule, AllReduceState(ledger=self.ledger))
        if self.scope == "node" and self.topology is not None:
            state.node = AllReduceState(ledger=self.ledger, group=self.topology.intra, scope=INTRA, logical=False)
        return state, local_or_warmup_hook

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # Lightning calls every callback's on_train_end (ModelCheckpoint's last save, a user's export
        # hook), then the module's, and only then the strategy's: the final round must come first,
        # or they all see ranks that still disagree.
        if not any(isinstance(c, _FinalRound) and c.strategy is self for c in trainer.callbacks):
            trainer.callbacks.insert(0, _FinalRound(self))

    def on_train_start(self) -> None:
        super().on_train_start()
        self.algorithm.finished = False
        if len(self.optimizers) != 1:
            raise GradsyncError(
                f"{self.strategy_name} counts optimizer steps of one optimizer; this module configures "
                f"{len(self.optimizers)}. Use one optimizer, or the sync strategy")
        if self.fault_tolerance is not None and self.replicas is None:
            self._join_replica_groups()

    # ---- fault-tolerant replica groups (torchft) -----------------------------------------------
    def _unsupported_across_groups(self) -> list:
        return [
            codec_across_groups(self.codec_spec),
            (self.sync_delay != 0, "sync_delay", self.sync_delay, 0),
            (self.overlap, "overlap", self.overlap, False),
            (self.warmup_steps != 0, "warmup_steps", self.warmup_steps, 0),
            (self.scope != "world" and not self.sharded, "scope", self.scope, "world"),
        ]

    def _join_replica_groups(self) -> None:
        """Join the quorum before the first step. A group behind the others (restarted after a failure)
        takes part in the round they are in — sending nothing — and takes a live group's state at its
        commit; groups that start together agree on step 0 and go on."""
        algorithm = self.algorithm
        self.replicas = self._new_replica_group()
        self._round_reducer = None
        algorithm.coordinator = _JoinedRound(self.replicas, lambda: algorithm.reducer, self.schedule.fragments)
        algorithm.logical_world = self.world_size * self.fault_tolerance.replica_groups
        algorithm.coordinator.begin_round()
        if self.replicas.healing:  # in the others' round, of the fragment that round is for
            algorithm.before_step()
            s, k = algorithm.schedule.local_steps, algorithm.coordinator.fragment
            algorithm.rounds[k].prepare(s, "heal")
            algorithm.rounds[k].land(s)
        else:
            if self._ft_fingerprint is not None:
                self._refuse_mismatch(self.replicas.disagreeing(self._ft_fingerprint), "the groups of this quorum")
            algorithm.coordinator.commit()

    def _shared_algorithm_state(self) -> dict:
        registry = self.algorithm.registry
        return {name: e.get() for name, e in registry.entries.items() if e.kind == "replicated" and name != "pending"}

    def _load_shared_algorithm_state(self, state: dict) -> None:
        self.algorithm.registry.load_state_dict(state)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        algorithm = self.algorithm
        started = time.perf_counter()
        algorithm.before_step()  # the hook reads the same count during this step's backward
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        algorithm.after_step()
        if self.replicas is not None:
            self.replicas.telemetry.note_step(time.perf_counter() - started)
        return output

    def averaged_over(self) -> tuple[Optional[Any], int]:
        if self.schedule.in_warmup:  # read during the step's closure, before the count moves on
            return super().averaged_over()
        if self.scope == "node" and self.topology is not None:
            return self.topology.intra, self.topology.procs_per_node
        return None, 1  # a local step: the gradient is this rank's own

    def on_train_end(self) -> None:
        self.finish()  # already done by _FinalRound, before any callback's on_train_end
        super().on_train_end()

    def teardown(self) -> None:
        # Normal ends have flushed in on_train_end; after an error, drop what is in flight.
        if self._algorithm is not None:
            self._algorithm.drop_in_flight()
        self._leave_replica_groups()
        super().teardown()

    # ---- algorithm state -----------------------------------------------------------------------
    def _local_params(self) -> dict:
        return {k: v.detach() for k, v in self.lightning_module.state_dict().items()}

    def _load_local_params(self, saved: Optional[dict]) -> None:
        if saved is not None:
            with torch.no_grad():
                for name, value in self.lightning_module.state_dict().items():
                    value.copy_(saved[name])

    def _keep_optimizer_states(self, saved: Optional[list]) -> None:
        self._restored_optimizer_states = saved  # loaded with Lightning's, in load_optimizer_state_dict

    def algorithm_state_dict(self) -> dict:
        return {**super().algorithm_state_dict(), **self.algorithm.state_dict(), "codec": self.codec_spec.signature()}

    def algorithm_memory_state(self) -> dict:
        mirrors = ("local_params", "local_optimizer_states")  # the module's own parameters and optimizer state
        return {name: e.get() for name, e in self.algorithm.registry.entries.items() if name not in mirrors}

    def load_algorithm_state_dict(self, state: dict) -> None:
        super().load_algorithm_state_dict(state)
        state = dict(state)
        change = codec_change(state.get("codec"), self.codec_spec.signature()) if state.get("reducer") else None
        if change:
            if self.global_rank == 0:
                warnings.warn(f"{self.strategy_name}: {change}; reset the codec state "
                              f"({', '.join(state['reducer']) or 'empty'}): the {self.codec} codec starts from scratch",
                              stacklevel=2)
            state["reducer"] = None
        self.algorithm.load_state_dict(state)
        self._round_reducer = None

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._restored_optimizer_states is not None:
            # torch's load_state_dict moves the state to each parameter's device
            for optimizer, opt_state in zip(self.optimizers, self._restored_optimizer_states):
                optimizer.load_state_dict(opt_state)
            self._restored_optimizer_states = None

    def reshard_algorithm_state(self, parts: list, saved_world_size: int) -> Optional[dict]:
        """Keep what every rank shares, average the ranks' local parameters, reset the rest — by the
        kinds the algorithm's state registry declares — and say so in one warning."""
        out = self.algorithm.reshard(parts)
        if self.sharded:
            _drop_shard_shaped(out)
        if "codec state" in out.reset:
            names = self.codec_spec.state_names()
            out.reset[out.reset.index("codec state")] = \
                f"codec state ({self.codec}{': ' + ', '.join(names) if names else ''})"
        if self.global_rank == 0:
            warnings.warn(out.describe(self.strategy_name, self.written_by(saved_world_size), len(parts)), stacklevel=2)
        return {"ledger": parts[0].get("ledger", {}), **out.state}

    def run_stats(self) -> dict:
        return {**self.algorithm.stats(), **self._replica_group_stats()}


#: Algorithm state shaped like this process's shards: it cannot follow a change of processes per node.
_SHARD_SHAPED = ("global_params", "outer_optimizer", "last_common", "pending", "anchor", "reducer")


def _drop_shard_shaped(out: Any) -> None:
    """A sharded run resumed on another layout: the model and optimizer follow (the checkpoint's
    folder reshards), state shaped by the old shards restarts from the loaded model."""
    for name in _SHARD_SHAPED:
        if name in out.state:
            out.state.pop(name)
            label = {"reducer": "codec state", "global_params": "global parameters (from the loaded model)",
                     "outer_optimizer": "outer momentum", "last_common": "last common point (the loaded model)",
                     "pending": "pending (the fragment in flight)", "anchor": "anchor"}[name]
            out.kept = [k for k in out.kept if not k.startswith(name)]
            if label not in out.reset:
                out.reset.append(label)


class _JoinedRound:
    """The algorithm's coordinator over a :class:`~gradsync.comm.managed.ReplicaGroup`: one quorum per
    round (a round that already formed its quorum, as the join does, does not ask again). A round this
    group drops leaves the reducer's state (error-feedback residuals) as it was before the round.

    With fragments, a group that heals in a round learns which fragment the round is for from the live
    groups: every group of a quorum that holds a healing one (its process group is larger than its
    participants, which every member sees alike) all-reduces the round's fragment index, which the
    healing group sends as zero and is not counted in, so the mean is the live groups' index."""

    def __init__(self, replicas: Any, reducer: Callable[[], Reducer], fragments: int = 1) -> None:
        self.replicas, self.reducer, self.fragments, self.open = replicas, reducer, fragments, False
        self._mark: Any = None
        #: the fragment of the round in progress
        self.fragment = 0

    def begin_round(self, fragment: int = 0) -> None:
        if not self.open:
            replicas = self.replicas
            replicas.begin_round()
            self._mark = self.reducer().mark()
            self.open = True
            self.fragment = fragment
            if self.fragments > 1 and replicas.wire_size() > replicas.participants:
                index = replicas.mean(torch.tensor([float(fragment)]), purpose="control")
                self.fragment = int(round(float(index)))

    def commit(self) -> bool:
        self.open = False
        ok = self.replicas.commit()
        if not ok and self._mark is not None:
            self.reducer().roll_back(self._mark)
        self._mark = None
        return ok

    def mean(self, tensor: torch.Tensor, sync: Any) -> None:
        self.replicas.mean(tensor, sync=sync)


class _FinalRound(Callback):
    """Runs the strategy's final round at the start of on_train_end, before every other callback."""

    def __init__(self, strategy: PeriodicAveragingStrategy) -> None:
        self.strategy = strategy

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.finish()
