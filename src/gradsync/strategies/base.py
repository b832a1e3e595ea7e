"""What every gradsync strategy shares.

A gradsync strategy is a real Lightning ``DDPStrategy``: it works in plain Lightning code
(``L.Trainer(strategy=SyncStrategy())`` or ``L.Trainer(strategy="sync")`` after ``import gradsync``)
and through the ``gradsync`` CLI. This base adds:

* backend choice (NCCL on CUDA, gloo on CPU) and a process-group timeout;
* the communication ledger (:mod:`gradsync.comm.ledger`), counting training traffic and, apart from
  it, checkpoint coordination and metric/control traffic;
* gradsync's own process groups (:mod:`gradsync.comm.topology`), on which reducers run;
* communication hooks that run on CPU/gloo as well as CUDA/NCCL (Lightning's ``DDPStrategy``
  silently skips ``ddp_comm_hook`` off CUDA; this base never does);
* checkpointed algorithm state of *every* rank, each rank writing its own part next to the
  checkpoint (:mod:`gradsync.strategies.parts`; nothing crosses the network but a token and a
  flag), restored on resume;
* registration in Lightning's ``StrategyRegistry`` under one short name per strategy.

The constructor's keyword-only arguments are the strategy's configuration: the CLI derives its
``--strategy.<option>`` flags from them, and :attr:`options` reads them back for the run summary.
Subclasses store each option as an attribute of the same name.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from datetime import timedelta
from typing import Any, Callable, ClassVar, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from gradsync.comm.ledger import CommLedger
from gradsync.comm.topology import Topology
from gradsync.errors import GradsyncError, check, spell
from gradsync.strategies import parts as rank_parts
from gradsync.strategies.lightning_private import (
    layer_sync, process_group_backend, process_group_timeout, set_device_mesh, set_layer_sync,
    set_process_group_backend,
)
from gradsync.algorithms.gradients import all_finite, normalize_weighted
from gradsync.strategies.checkpointing import RankCheckpointing
from gradsync.strategies.collectives import CountedCollectives
from gradsync.strategies.scope import NodeScope
from gradsync.strategies.sharding import NodeSharding, is_sharded
from gradsync.strategies.sync_batchnorm import layer_sync_for

Backend = Literal["auto", "nccl", "gloo"]
log = logging.getLogger("gradsync")

# torch's DDP error for parameters without a gradient (Lightning's rewording of it too).
_UNUSED_PARAMETERS = re.compile(r"Expected to have finished reduction in the prior iteration|parameters that were "
                                r"not used in producing the loss")
# Options of the base that are DDP wrapper settings (passed to torch's DistributedDataParallel).
_DDP_OPTIONS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters")
#: ``DDPStrategy``'s own constructor arguments, taken with ``DDPStrategy``'s meaning, so code written for
#: ``DDPStrategy(process_group_backend="gloo", timeout=...)`` runs when the class is swapped. They are for
#: Python callers (objects, hooks): the CLI has its own flags for what they set and does not offer them.
DDP_ARGUMENTS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                 "ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period",
                 "process_group_backend", "timeout", "start_method")


def _ddp_wrapper_arguments() -> frozenset:
    """What ``DDPStrategy(**kwargs)`` passes on to ``DistributedDataParallel`` (Lightning sets the rest)."""
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return frozenset(params) - {"self", "module"}


class GradsyncStrategy(RankCheckpointing, NodeSharding, NodeScope, CountedCollectives, DDPStrategy):
    """Base of all gradsync strategies. Not registered itself; subclasses set ``strategy_name``."""

    strategy_name: ClassVar[str] = ""
    #: True for strategies that only make sense with gradient accumulation (a global batch > b*N).
    requires_global_batch: ClassVar[bool] = False
    #: True for strategies whose step is DDP's own all-reduce, so a ``ddp_comm_hook`` can replace it.
    takes_ddp_comm_hook: ClassVar[bool] = False
    #: Constructor arguments that are not ``--strategy.*`` flags (objects and hooks from Python callers).
    python_only_options: ClassVar[tuple[str, ...]] = DDP_ARGUMENTS + tuple(sorted(
        set(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)
        - {"self", "module", *_DDP_OPTIONS}))

    def __init__(
        self,
        *,
        backend: Backend = "auto",
        timeout_seconds: float = 1800.0,
        bucket_cap_mb: Optional[float] = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        nonfinite_grads: Literal["off", "skip", "stop"] = "off",
        accelerator: Any = None,
        parallel_devices: Optional[list] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        model_averaging_period: Optional[int] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        """
        Args:
            backend: process-group backend; ``auto`` picks NCCL on CUDA devices and gloo on CPU.
            timeout_seconds: how long a collective may wait for a peer before the run fails.
            bucket_cap_mb: DDP gradient bucket size in MiB; larger buckets mean fewer, bigger collectives.
                Default: DDP's own, 25 MiB buckets with a first bucket of 1 MiB, so the all-reduce of the
                last layers' gradients starts early (a given size applies to every bucket).
            gradient_as_bucket_view: let gradients alias DDP's buckets (saves one gradient-sized copy).
            static_graph: tell DDP the set of used parameters never changes (enables extra overlap).
            find_unused_parameters: let DDP tolerate parameters that get no gradient in a step.
            nonfinite_grads: what to do when any rank has a NaN/Inf gradient: ``off`` (nothing),
                ``skip`` (every rank skips that optimizer step together, and it is logged) or
                ``stop`` (the run ends with an error naming the step). Decided for all ranks at
                once, so one rank never steps while another skips.
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, ddp_comm_state,
                ddp_comm_hook, ddp_comm_wrapper, model_averaging_period, process_group_backend, timeout,
                start_method, **ddp_kwargs: ``DDPStrategy``'s arguments, with its meaning
                (``process_group_backend`` and ``timeout`` are ``backend`` and ``timeout_seconds``; a
                ``ddp_comm_hook`` is registered on every device, not on CUDA only; ``**ddp_kwargs`` go to
                ``DistributedDataParallel``). Only ``sync`` and ``accumulate`` take a comm hook or model
                averaging: the other strategies send their own messages.
        """
        if process_group_backend is not None:
            check(backend in ("auto", process_group_backend), "process_group_backend", process_group_backend,
                  f"disagrees with backend={backend!r}, which names the same thing", "give one of them")
            backend = process_group_backend
        if timeout is not None:
            check(isinstance(timeout, timedelta), "timeout", timeout, "must be a datetime.timedelta, as for DDPStrategy",
                  "or give timeout_seconds")
            check(timeout_seconds == 1800.0 or timeout_seconds == timeout.total_seconds(), "timeout", timeout,
                  f"disagrees with timeout_seconds={timeout_seconds!r}, which names the same thing", "give one of them")
            timeout_seconds = timeout.total_seconds()
        unknown = sorted(set(ddp_kwargs) - _ddp_wrapper_arguments())
        check(not unknown, unknown[0] if unknown else "", ddp_kwargs.get(unknown[0]) if unknown else None,
              f"is not an option of {type(self).__name__} nor an argument of DistributedDataParallel",
              f"see help({type(self).__name__})")
        own_messages = not getattr(self, "takes_ddp_comm_hook", False)
        for option, value in (("ddp_comm_hook", ddp_comm_hook), ("model_averaging_period", model_averaging_period)):
            check(value is None or not own_messages, option, value,
                  f"{type(self).__name__} sends its own messages, so a DDP hook or model averager has nothing to do",
                  "give it to SyncStrategy, or use this strategy's codec / period options")
        check(backend in ("auto", "nccl", "gloo"), "backend", backend, "must be one of auto, nccl, gloo")
        check(timeout_seconds > 0, "timeout_seconds", timeout_seconds, "must be > 0 seconds")
        check(bucket_cap_mb is None or bucket_cap_mb > 0, "bucket_cap_mb", bucket_cap_mb, "must be > 0 MiB",
              "omit it for DDP's default")
        self.backend = backend
        self.timeout_seconds = float(timeout_seconds)
        self.bucket_cap_mb = None if bucket_cap_mb is None else float(bucket_cap_mb)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.find_unused_parameters = bool(find_unused_parameters)
        check(nonfinite_grads in ("off", "skip", "stop"), "nonfinite_grads", nonfinite_grads,
              "must be one of off, skip, stop")
        self.nonfinite_grads = nonfinite_grads
        # the hook is registered by gradsync on every device type (_register_comm_hook); Lightning would
        # register it on CUDA only, so it does not see it
        self._user_comm_hook = (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper) if ddp_comm_hook else None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            model_averaging_period=model_averaging_period,
            process_group_backend=None if backend == "auto" else backend,
            timeout=timedelta(seconds=self.timeout_seconds),
            start_method=start_method,
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            find_unused_parameters=self.find_unused_parameters,
            # last.ckpt is whole under a plain L.Trainer too
            checkpoint_io=checkpoint_io if checkpoint_io is not None else rank_parts.AtomicCheckpointIO(),
            **ddp_kwargs,
        )
        self.ledger = CommLedger()
        self.accumulation_steps = 1
        self._weight_sum, self._weighted = 0.0, False
        self.skipped_steps: list[int] = []  # optimizer steps skipped for non-finite gradients
        self._restored_algorithm_state: Optional[rank_parts.SavedParts] = None
        self.topology: Optional[Topology] = None

    # ---- configuration ---------------------------------------------------------------------
    @classmethod
    def describe(cls) -> str:
        """One line for ``gradsync list``: the first line of the class docstring."""
        return (inspect.getdoc(cls) or "").strip().splitlines()[0] if cls.__doc__ else cls.__name__

    @property
    def options(self) -> dict[str, Any]:
        """The constructor options as given (after validation), for summaries and trackers."""
        out: dict[str, Any] = {}
        for klass in reversed(type(self).__mro__):
            init = klass.__dict__.get("__init__")
            if init is None or not issubclass(klass, GradsyncStrategy):
                continue
            for name, p in inspect.signature(init).parameters.items():
                named = p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                if named and name != "self" and name not in DDP_ARGUMENTS and hasattr(self, name):
                    out[name] = getattr(self, name)
        return out

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`~gradsync.errors.OptionError` if an option cannot work with ``world_size`` processes.

        Called before any process is launched (by the CLI) and again at setup."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name:
            strategy_registry.register(cls.strategy_name, cls, description=cls.describe(), override=True)

    # ---- process group ---------------------------------------------------------------------
    def resolved_backend(self) -> str:
        """The process-group backend this job uses: the one given, else NCCL on CUDA and gloo elsewhere."""
        backend = process_group_backend(self) or ("nccl" if self.root_device.type == "cuda" else "gloo")
        check(not (backend == "nccl" and self.root_device.type != "cuda"), "backend", backend,
              "NCCL needs CUDA devices", "use backend gloo or --accelerator gpu")
        return backend

    def setup_distributed(self) -> None:
        # Under torchrun's elastic agent, build the default group from a store whose keys are
        # prefixed by the restart attempt: with a static rendezvous the agent reuses one store
        # across restarts, and restarted workers would otherwise read dead workers' addresses.
        if not dist.is_initialized() and "TORCHELASTIC_RESTART_COUNT" in os.environ and "MASTER_ADDR" in os.environ:
            self.set_world_ranks()
            set_process_group_backend(self, self.resolved_backend())
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            rank, world = self.global_rank, self.world_size
            use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                is_master=(not use_agent_store and rank == 0), timeout=process_group_timeout(self),
                wait_for_workers=False,
            )
            prefix = f"gradsync/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}"
            dist.init_process_group(process_group_backend(self), store=dist.PrefixStore(prefix, store),
                                    rank=rank, world_size=world, timeout=process_group_timeout(self))
        else:
            # Lightning picks the same default; the backend is settled first so that NCCL on CPU
            # devices fails in one line before any group is built
            set_process_group_backend(self, self.resolved_backend())
            super().setup_distributed()
        self.ledger.world_size = self.world_size
        if dist.is_available() and dist.is_initialized():
            self.topology = self.build_topology()
            if self.sharded and self.lightning_module is not None:
                # a module that shards itself in configure_model uses it (Lightning's FSDP2 convention)
                set_device_mesh(self.lightning_module, self.node_mesh())

    # ---- training loop -----------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        _finish_group_at_exit(trainer.state)
        accumulation = getattr(trainer, "accumulate_grad_batches", 1)
        # DDP's static graph with no_sync can silently stop all-reducing (pytorch#143580,
        # Lightning#19354): refuse the combination instead of training on local gradients.
        check(not (self.static_graph and accumulation > 1), "static_graph", True,
              f"cannot be combined with gradient accumulation ({accumulation} micro-batches per step)",
              "drop static_graph, or use a global batch without accumulation")
        self.accumulation_steps = accumulation
        self.check_world_size(self.world_size)
        # sync_batchnorm=True: torch's SyncBatchNorm runs on CUDA only; elsewhere use one that all-reduces
        set_layer_sync(self, layer_sync_for(layer_sync(self), self.root_device.type))
        if self.sharded and trainer.state.fn != "fit":
            # validate / test / predict: DDP's set-up would broadcast rank 0's weights, which are shards
            # here; the module keeps (or gets) its sharding and needs no optimizer
            self.accelerator.setup(trainer)
            if not is_sharded(self.model):
                self.model = self.shard_module(self.model)
            self.setup_precision_plugin()
            return
        super().setup(trainer)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if isinstance(out, dict) and out.get("weight") is not None:
            # Weighted loss: back-propagate the *sum* (mean x weight); optimizer_step divides by
            # the weight summed over micro-batches and ranks. Exact for unequal micro-batches.
            weight = out["weight"]
            weight = float(weight.item() if isinstance(weight, torch.Tensor) else weight)
            out = {**out, "loss": out["loss"] * weight}
            self._weight_sum += weight
            self._weighted = True
        return out

    def on_exception(self, exception: BaseException) -> None:
        # DDPStrategy's advice for unused parameters (strategy='ddp_find_unused_parameters_true') would
        # replace this strategy with stock DDP; name this strategy's own option instead, spelled for the
        # entry point in use (the CLI flag, or the constructor argument under plain L.Trainer).
        if _UNUSED_PARAMETERS.search(str(exception)):
            message = (f"{type(self).__name__}: some parameters got no gradient in a training step (a layer the "
                       f"loss does not use); set {spell('find_unused_parameters', True)} to let DDP skip them, or "
                       "freeze them (requires_grad=False)")
            exception.args = (message,)
            exception.gradsync_message = message  # type: ignore[attr-defined]  # the CLI prints it as one line
            return
        super().on_exception(exception)

    #: True when every rank holds the same gradients after backward (DDP-style all-reduce), so a
    #: rank's own finiteness check is already the global answer; False for local-step strategies.
    gradients_synchronized: ClassVar[bool] = True

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def normalized_closure() -> Any:
            result = closure()
            if self._weighted:
                self._normalize_weighted_gradients(optimizer)
            if self.sharded:  # the node's mean gradient shards, averaged across nodes as the strategy says
                self.reduce_gradient_shards(optimizer, self.lightning_module.trainer.global_step)
            return self._gradients_reduced(optimizer, result)

        try:
            if self.nonfinite_grads == "off":
                return super().optimizer_step(optimizer, normalized_closure, model, **kwargs)
            # Run forward/backward first, decide for all ranks together, then step or skip.
            result = normalized_closure()
            if self._all_gradients_finite(optimizer):
                return super().optimizer_step(optimizer, lambda: result, model, **kwargs)
            step = self.lightning_module.trainer.global_step if self.lightning_module is not None else -1
            if self.nonfinite_grads == "stop":
                raise GradsyncError(
                    f"non-finite gradient (NaN/Inf) at optimizer step {step} on at least one rank; stopping "
                    f"({spell('nonfinite_grads', 'skip')} would skip such steps on every rank)")
            self.skipped_steps.append(step)
            if self.global_rank == 0:
                log.warning(f"gradsync: skipped optimizer step {step} on every rank: non-finite gradient")
            optimizer.zero_grad()
            return result
        finally:
            self._weight_sum, self._weighted = 0.0, False

    def _gradients_reduced(self, optimizer: Any, result: Any) -> Any:
        """Called once a step's gradients are reduced, before the optimizer steps: what the closure returns
        (None skips the step)."""
        return result

    def _all_gradients_finite(self, optimizer: Any) -> bool:
        # shards differ per process: every process must be asked
        ask = not self.gradients_synchronized or self.sharded
        return all_finite(optimizer, ledger=self.ledger, ask_every_rank=ask,
                          device=self.root_device)

    def averaged_over(self) -> tuple[Optional[Any], int]:
        """The ranks whose gradients this step's backward averaged: ``(group, size)``; size 1 with
        group None when the step is local (nothing to ask anyone). Default: every rank."""
        return None, self.world_size

    def _normalize_weighted_gradients(self, optimizer: Any) -> None:
        group, n = self.averaged_over()
        normalize_weighted(optimizer, weight_sum=self._weight_sum, micro_batches=self.accumulation_steps, group=group,
                           n=n, ledger=self.ledger, device=self.root_device)

    # ---- communication hooks ---------------------------------------------------------------
    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        """Return ``(state, hook)`` to register on the DDP model, or ``None`` for no hook."""
        return None

    def _register_comm_hook(self) -> None:
        # Unlike Lightning's DDPStrategy, register on every device type: a strategy that says it
        # compresses must compress on gloo too, not silently fall back to plain all-reduce. Called
        # from the public configure_ddp, not by overriding Lightning's private _register_ddp_hooks.
        built = self.build_comm_hook()
        if built is not None:
            state, hook = built
            self.model.register_comm_hook(state, hook)

    def configure_ddp(self) -> None:
        if self.sharded:  # FSDP2 over the node's processes instead of a DDP replica
            self.model = self.shard_module(self.model)
            return  # the checkpoint is restored after set-up, into the shards (load_model_state_dict)
        super().configure_ddp()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self._register_comm_hook()
        self._apply_restored_state()
        self._restored_algorithm_state = None

    # ---- reporting -------------------------------------------------------------------------
    def run_stats(self) -> dict:
        """Strategy-specific figures for the run summary (``strategy_stats``). Called on every rank."""
        return {}

_exit_state: list = []  # the latest trainer state; the exit hook is installed once per process


def _finish_group_at_exit(state: Any) -> None:
    """Tear the default process group down when the process exits (``L.Trainer`` never does).

    A process that exits with its group alive lets gloo's threads be destroyed mid-flight: some
    runs then die after a successful fit with "terminate called without an active exception"
    (exit 134). After a fit that finished, the ranks first meet in a barrier (bounded: a peer
    that is gone costs at most a minute), so no rank closes its sockets while another still talks;
    after a failure the group is destroyed without waiting for peers that may never come.
    """
    if not _exit_state:
        import atexit

        atexit.register(_destroy_default_group)
    _exit_state[:] = [state]


def _destroy_default_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return  # the gradsync command (or the user) has torn it down already
    from datetime import timedelta

    from lightning.pytorch.trainer.states import TrainerStatus

    try:
        if _exit_state and _exit_state[0].status == TrainerStatus.FINISHED:
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=60))
    except Exception:  # a peer is gone: nothing to wait for
        pass
    dist.destroy_process_group()


