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
import secrets
import warnings
from datetime import timedelta
from typing import Any, Callable, ClassVar, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from gradsync.comm.ledger import CommLedger
from gradsync.comm.topology import Topology, launcher_layout
from gradsync.errors import GradsyncError, check, spell
from gradsync.strategies import parts as rank_parts
from gradsync.strategies.lightning_private import (
    fit_batch_progress, layer_sync, process_group_backend, process_group_timeout, set_layer_sync,
    set_process_group_backend,
)
from gradsync.strategies.sync_batchnorm import layer_sync_for

Backend = Literal["auto", "nccl", "gloo"]
log = logging.getLogger("gradsync")

# torch's DDP error for parameters without a gradient (Lightning's rewording of it too).
_UNUSED_PARAMETERS = re.compile(r"Expected to have finished reduction in the prior iteration|parameters that were "
                                r"not used in producing the loss")
# Options of the base that are DDP wrapper settings (passed to torch's DistributedDataParallel).
_DDP_OPTIONS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters")


class GradsyncStrategy(DDPStrategy):
    """Base of all gradsync strategies. Not registered itself; subclasses set ``strategy_name``."""

    strategy_name: ClassVar[str] = ""
    #: True for strategies that only make sense with gradient accumulation (a global batch > b*N).
    requires_global_batch: ClassVar[bool] = False

    def __init__(
        self,
        *,
        backend: Backend = "auto",
        timeout_seconds: float = 1800.0,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        nonfinite_grads: Literal["off", "skip", "stop"] = "off",
    ) -> None:
        """
        Args:
            backend: process-group backend; ``auto`` picks NCCL on CUDA devices and gloo on CPU.
            timeout_seconds: how long a collective may wait for a peer before the run fails.
            bucket_cap_mb: DDP gradient bucket size in MiB; larger buckets mean fewer, bigger collectives.
            gradient_as_bucket_view: let gradients alias DDP's buckets (saves one gradient-sized copy).
            static_graph: tell DDP the set of used parameters never changes (enables extra overlap).
            find_unused_parameters: let DDP tolerate parameters that get no gradient in a step.
            nonfinite_grads: what to do when any rank has a NaN/Inf gradient: ``off`` (nothing),
                ``skip`` (every rank skips that optimizer step together, and it is logged) or
                ``stop`` (the run ends with an error naming the step). Decided for all ranks at
                once, so one rank never steps while another skips.
        """
        check(backend in ("auto", "nccl", "gloo"), "backend", backend, "must be one of auto, nccl, gloo")
        check(timeout_seconds > 0, "timeout_seconds", timeout_seconds, "must be > 0 seconds")
        check(bucket_cap_mb > 0, "bucket_cap_mb", bucket_cap_mb, "must be > 0 MiB", "25 is DDP's default")
        self.backend = backend
        self.timeout_seconds = float(timeout_seconds)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.find_unused_parameters = bool(find_unused_parameters)
        check(nonfinite_grads in ("off", "skip", "stop"), "nonfinite_grads", nonfinite_grads,
              "must be one of off, skip, stop")
        self.nonfinite_grads = nonfinite_grads
        super().__init__(
            process_group_backend=None if backend == "auto" else backend,
            timeout=timedelta(seconds=self.timeout_seconds),
            start_method="popen",
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            find_unused_parameters=self.find_unused_parameters,
            checkpoint_io=rank_parts.AtomicCheckpointIO(),  # last.ckpt is whole under a plain L.Trainer too
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
                if named and name != "self" and hasattr(self, name):
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
    def _get_process_group_backend(self) -> str:
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
            set_process_group_backend(self, self._get_process_group_backend())
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
            super().setup_distributed()
        self.ledger.world_size = self.world_size
        if dist.is_available() and dist.is_initialized():
            self.topology = self.build_topology()

    # ---- node scope ------------------------------------------------------------------------
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
            return result

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

    def _all_gradients_finite(self, optimizer: Any) -> bool:
        finite = all(bool(torch.isfinite(p.grad).all()) for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None)
        if self.gradients_synchronized or not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return finite
        flag = torch.tensor([0.0 if finite else 1.0], device=self.root_device)
        self.ledger.all_reduce(flag, purpose="control")  # 4 bytes: the ranks agree before anyone steps
        return float(flag.item()) == 0.0

    def averaged_over(self) -> tuple[Optional[Any], int]:
        """The ranks whose gradients this step's backward averaged: ``(group, size)``; size 1 with
        group None when the step is local (nothing to ask anyone). Default: every rank."""
        return None, self.world_size

    def _normalize_weighted_gradients(self, optimizer: Any) -> None:
        # After backward the gradient holds mean over the n averaged ranks of sum_mb w*grad(mean_mb) / K:
        # multiply by K*n / W, W the weight summed over those ranks. A local step asks no one.
        group, n = self.averaged_over()
        total = torch.tensor([self._weight_sum], dtype=torch.float64)
        if n > 1 and dist.is_available() and dist.is_initialized():
            total = total.to(self.root_device)
            self.ledger.all_reduce(total, group=group, scope="world" if group is None else "intra_node")
        scale = self.accumulation_steps * n / float(total.item())
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)

    # ---- Lightning's collectives, counted as control traffic ----------------------------------
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and self._distributed():
            self.ledger.record("all_reduce", tensor.numel() * tensor.element_size(), purpose="control")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._distributed():
            self.ledger.record("all_reduce", 4, purpose="control")  # a barrier moves a token's worth
        super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        out = super().broadcast(obj, src)
        if self._distributed():
            import pickle

            self.ledger.record("broadcast", len(pickle.dumps(out)) + 8, is_root=self.global_rank == src,
                               purpose="control")
        return out

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

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

    # ---- reporting -------------------------------------------------------------------------
    def run_stats(self) -> dict:
        """Strategy-specific figures for the run summary (``strategy_stats``). Called on every rank."""
        return {}

    # ---- algorithm state -------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        """This rank's algorithm state (tensors on CPU). Subclasses extend it; keep the ledger."""
        return {"ledger": self.ledger.state_dict()}

    def load_algorithm_state_dict(self, state: dict) -> None:
        """Restore this rank's part of :meth:`algorithm_state_dict`."""
        if "ledger" in state:
            world = self.ledger.world_size
            self.ledger.load_state_dict(state["ledger"])
            self.ledger.world_size = world

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        # Every rank reaches here (Trainer.save_checkpoint runs on all ranks). Each writes its own
        # part of the algorithm state next to the checkpoint; only a token and a flag cross the
        # network, and rank 0 commits the manifest once every part is on disk (see parts.py).
        local = _to_cpu(self.algorithm_state_dict())
        token = self._checkpoint_token()
        path = str(filepath)
        failure = ""
        try:
            rank_parts.write_part(path, self.global_rank, token, local)
        except OSError as exc:
            failure = f"rank {self.global_rank} could not write its checkpoint part under {rank_parts.parts_dir(path)}: {exc}"
        if not self._all_ranks_ok(not failure):
            raise GradsyncError(failure or f"checkpoint {path} not written: another rank could not write its part "
                                           "(its error is in that rank's log); the previous checkpoint is intact")
        checkpoint["gradsync"] = {"strategy": self.strategy_name, "world_size": self.world_size, "token": token,
                                  "parts": rank_parts.parts_dir(path).name,
                                  "accumulation_steps": self.accumulation_steps, **self.checkpoint_layout()}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # rank 0 commits
        # Once the new manifest is in place (rank 0 says so), no manifest names the older parts.
        if self._all_ranks_ok(True):
            rank_parts.remove_stale_parts(path, self.global_rank, keep={token})

    def checkpoint_layout(self) -> dict:
        """Facts about the job a resume needs to reshard (e.g. processes per node); JSON-able."""
        if self.scope != "node" or self.topology is None:
            return {}
        return {"scope": "node", "procs_per_node": self.topology.procs_per_node, "num_nodes": self.topology.num_nodes}

    def remove_checkpoint(self, filepath: Any) -> None:
        rank_parts.remove_parts(filepath, self.global_rank)
        super().remove_checkpoint(filepath)

    def _checkpoint_token(self) -> str:
        """A fresh token for a save, the same on every rank (8 random bytes from rank 0)."""
        raw = torch.tensor(list(secrets.token_bytes(8)), dtype=torch.uint8)
        if self._distributed():
            raw = raw.to(self.root_device)
            self.ledger.broadcast(raw, src=0, purpose="checkpoint")
        return bytes(raw.cpu().tolist()).hex()

    def _all_ranks_ok(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        if self._distributed():
            flag = flag.to(self.root_device)
            self.ledger.all_reduce(flag, purpose="checkpoint")
        return int(flag.item()) == 0

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # Applied in configure_ddp, once hooks and their state exist (DDP restores before setup).
        manifest = checkpoint.get("gradsync")
        self._restored_algorithm_state = rank_parts.SavedParts(manifest, checkpoint_path) if manifest else None
        trainer = None
        if self.lightning_module is not None:
            try:
                trainer = self.lightning_module.trainer
            except RuntimeError:  # not attached to a Trainer
                pass
        if manifest and trainer is not None:
            _rescale_micro_batch_progress(checkpoint, int(manifest.get("accumulation_steps", 1)),
                                          int(trainer.accumulate_grad_batches))
        return checkpoint

    def configure_ddp(self) -> None:
        super().configure_ddp()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self._register_comm_hook()
        self._apply_restored_state()
        self._restored_algorithm_state = None

    def _apply_restored_state(self) -> None:
        saved = self._restored_algorithm_state
        if not saved:
            return
        if saved.world_size != self.world_size or not self.same_layout(saved.manifest):
            self._saved_manifest = saved.manifest
            state = self.reshard_algorithm_state(saved.all(), saved.world_size)
        else:
            state = saved.part(self.global_rank)
        if state is not None:
            self.load_algorithm_state_dict(state)

    _saved_manifest: Optional[dict] = None

    def written_by(self, saved_world_size: int) -> str:
        """'checkpoint was written by 2 processes (2 node(s) x 1), this run has 4 (2 node(s) x 2)', for warnings."""
        def layout(manifest: Optional[dict]) -> str:
            if manifest and manifest.get("procs_per_node"):
                return f" ({manifest['num_nodes']} node(s) x {manifest['procs_per_node']})"
            return ""
        return (f"checkpoint was written by {saved_world_size} processes{layout(self._saved_manifest)}, "
                f"this run has {self.world_size}{layout(self.checkpoint_layout())}")

    def same_layout(self, manifest: dict) -> bool:
        """Whether a checkpoint's parts map one to one onto this job's ranks (beyond the world size)."""
        mine = self.checkpoint_layout()
        return all(manifest.get(k) == v for k, v in mine.items()) and (bool(mine) or "procs_per_node" not in manifest)

    def reshard_algorithm_state(self, parts: list, saved_world_size: int) -> Optional[dict]:
        """Map state saved on ``saved_world_size`` ranks onto this world size.

        The default keeps the ledger totals of rank 0 and resets everything else, with a warning
        that names what was reset. Subclasses with per-rank state override this.
        """
        reset = sorted(k for k in parts[0] if k != "ledger")
        if reset and self.global_rank == 0:
            warnings.warn(
                f"{self.strategy_name}: {self.written_by(saved_world_size)}; "
                f"reset per-rank algorithm state: {', '.join(reset)}",
                stacklevel=2,
            )
        return {"ledger": parts[0].get("ledger", {})}


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


def _rescale_micro_batch_progress(checkpoint: dict, old_k: int, new_k: int) -> None:
    """Re-express the fit loop's micro-batch counters for a new accumulation K.

    Lightning counts batches in micro-batches and decides when to step from that count; resuming
    with the same global batch on another world size changes K, and unscaled counters would misalign
    the accumulation windows (a step after too few micro-batches). Optimizer steps are unchanged.
    """
    if old_k == new_k:
        return
    progress = fit_batch_progress(checkpoint)
    if not progress:
        return
    for part in ("total", "current"):
        counts = progress.get(part)
        if not counts:
            continue
        ready = counts["ready"]
        if (ready * new_k) % old_k:
            warnings.warn(f"resume: {ready} micro-batches of {old_k} per step cannot be re-expressed with {new_k} "
                          "micro-batches per step; accumulation windows may be misaligned", stacklevel=3)
            return
        lag = {k: ready - v for k, v in counts.items()}
        new_ready = ready * new_k // old_k  # same optimizer steps, new micro-batches per step
        progress[part] = {k: new_ready - lag[k] for k in counts}


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj

