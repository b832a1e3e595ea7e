"""Assemble and run one job: strategy, recipe, Trainer, checkpoints, run summary.

The CLI parses flags into a :class:`RunSpec`; :func:`execute` builds the parts, trains, and writes
``DIR/summary.json`` and ``DIR/checkpoints/last.ckpt`` (DESIGN.md "Run output").
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from gradsync.catalog import strategy_class_path
from gradsync.errors import GradsyncError
from gradsync.platform.checkpoint import AtomicCheckpointIO, atomic_torch_save, load_checkpoint_file
from gradsync.platform.steps import TrainingStepLimit, micro_batch_of, training_steps
from gradsync.platform.trainer_args import changed as changed_trainer_options
from gradsync.strategies import STRATEGIES, GradsyncStrategy

log = logging.getLogger("gradsync")

Command = Literal["fit", "validate", "test"]


@dataclass
class RunSpec:
    """Everything one run needs, resolved from flags and config files."""

    command: Command = "fit"
    recipe: str = "digits"
    model_class: type = None  # type: ignore[assignment]
    model_options: dict = field(default_factory=dict)
    data_class: type = None  # type: ignore[assignment]
    data_options: dict = field(default_factory=dict)
    strategy: str = "sync"
    strategy_options: dict = field(default_factory=dict)
    accelerator: str = "auto"
    devices: int = 1
    num_nodes: int = 1
    max_steps: int = -1
    max_epochs: Optional[int] = None
    seed: int = 0
    output_dir: Optional[Path] = None
    resume: Optional[str] = None
    checkpoint_every: int = 0
    global_batch_size: Optional[int] = None
    val_every: int = 0  #: validate every N optimizer steps (0: at epoch ends)
    launch: Any = None  # gradsync.platform.launch.LaunchConfig, when started from the CLI
    print_launch: bool = False
    tracking: Any = None  # gradsync.platform.tracking.TrackingConfig (--logger, --wandb.*); None: CSV only
    #: Any other ``L.Trainer`` argument (``precision``, ``gradient_clip_val``, ``sync_batchnorm`` ...), as
    #: ``L.Trainer`` takes it; None for an argument gradsync derives (platform/trainer_args.py DERIVED).
    trainer_options: dict = field(default_factory=dict)
    #: ``--fault-tolerance torchft``: this job's replica group (gradsync.comm.managed.FaultToleranceConfig)
    fault_tolerance: Any = None

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def micro_batch_size(self) -> int:
        return int(self.data_options.get("batch_size") or 0)

    @property
    def checkpoint_path(self) -> Optional[Path]:
        return self.output_dir / "checkpoints" / "last.ckpt" if self.output_dir else None


# ---- building -------------------------------------------------------------------------------
def accumulation_steps(global_batch: Optional[int], micro_batch: int, world_size: int) -> int:
    """K = G / (b*N), the micro-batches per optimizer step; a clear error when G does not fit."""
    if global_batch is None:
        return 1
    if micro_batch <= 0:
        raise GradsyncError(
            f"--global-batch-size {global_batch} needs the micro-batch size, and this DataModule has no "
            "`batch_size` attribute; give it one (the per-process batch size its train loader uses)")
    unit = micro_batch * world_size
    if global_batch < 1 or global_batch % unit != 0:
        valid = ", ".join(str(unit * k) for k in (1, 2, 4, 8))
        raise GradsyncError(
            f"--global-batch-size {global_batch} must be a positive multiple of batch size {micro_batch} x "
            f"{world_size} processes = {unit}; valid values include {valid}")
    return global_batch // unit


def batch_arithmetic(global_batch: int, micro: int, k: int, world: int) -> str:
    return f"global batch {global_batch} = {micro} micro-batch x {k} accumulation x {world} processes"


def checkpoint_run_info(path: Optional[Path]) -> dict:
    """The run facts a checkpoint was written with (global batch, world size), or {}."""
    if path is None:
        return {}
    return dict(load_checkpoint_file(path).get("gradsync_run") or {})


def import_class(path: str, flag: str, base: type) -> type:
    """The class at ``module.Class``, a subclass of ``base``; a one-line error naming ``flag`` otherwise."""
    module_name, _, cls_name = path.rpartition(".")
    if not module_name:
        raise GradsyncError(f"{flag} {path!r} is not an import path; give module.Class, e.g. my_pkg.models.MyModel")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise GradsyncError(f"{flag} {path!r}: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise GradsyncError(f"{flag} {path!r}: module {module_name!r} has no class {cls_name!r}")
    if not issubclass(cls, base):
        raise GradsyncError(f"{flag} {path!r} must be a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def strategy_class(name: str) -> Optional[type]:
    """The one strategy lookup: a gradsync strategy's class (``sync``, ``diloco``, ...), a plugin's
    (registered entry point) or ``module.Class``; None for a stock Lightning strategy name."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    path = strategy_class_path(name)  # a plugin's registered name, or module.Class
    return import_class(path, "--strategy", Strategy) if path is not None else None


def recipe_entry(name: str) -> Any:
    """The catalog entry of recipe ``name`` (its model and data classes), or None."""
    from gradsync.recipes import RECIPES

    return RECIPES.get(name)


def build_strategy(name: str, options: dict) -> Union[Strategy, str]:
    """A gradsync strategy instance, or a stock Lightning strategy name (which takes no options)."""
    cls = strategy_class(name)
    if cls is not None:
        return cls(**options)
    if name in StrategyRegistry:
        if options:
            raise GradsyncError(
                f"--strategy {name} is a stock Lightning strategy and takes no --strategy.* options "
                f"(got {', '.join(sorted(options))})")
        return name
    raise GradsyncError(unknown_strategy_message(name))


def unknown_strategy_message(name: str) -> str:
    from gradsync.catalog import plugin_strategies


    stock = sorted(n for n in StrategyRegistry.available_strategies()
                   if n not in STRATEGIES and "find_unused" not in n and "offload" not in n)
    plugins = f"; plugins: {', '.join(plugin_strategies())}" if plugin_strategies() else ""
    return (f"--strategy {name!r} is unknown; gradsync strategies: {', '.join(STRATEGIES)}{plugins}; "
            f"Lightning strategies: {', '.join(stock)}; or a class path, module.Class")


def resolve_checkpoint_to_resume(spec: RunSpec) -> Optional[Path]:
    """The checkpoint a run resumes from, or None. Refuses to overwrite another run's checkpoint."""
    if spec.resume:
        path = spec.checkpoint_path if spec.resume == "auto" else Path(spec.resume)
        if spec.resume == "auto" and (path is None or not path.exists()):
            return None  # nothing to resume yet: a fresh start
        load_checkpoint_file(path)  # one-line error for a missing or corrupt file, before any work
        return path
    if spec.command == "fit" and spec.checkpoint_path is not None and spec.checkpoint_path.exists():
        raise GradsyncError(
            f"--output-dir {spec.output_dir} already holds a checkpoint; pass --resume auto to continue it "
            f"or choose another --output-dir")
    return None


class _RunClock(Callback):
    """Times the training loop and remembers the step of the last validation."""

    def __init__(self) -> None:
        self.fit_start: Optional[float] = None
        self.start_step = 0
        self.last_val_step = -1
        self.train_metrics: dict = {}
        self._step_marks: list[float] = []  # time at each optimizer-step boundary

    def on_fit_start(self, trainer, pl_module) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if len(self._step_marks) <= training_steps(trainer) - self.start_step:
            self._step_marks.append(time.perf_counter())

    def on_validation_start(self, trainer, pl_module) -> None:
        self._step_marks.append(float("nan"))  # validation time is not a training step's

    @property
    def median_step_seconds(self) -> Optional[float]:
        """Median optimizer-step time after the first two steps (warm-up), validation excluded."""
        marks = self._step_marks
        gaps = [b - a for a, b in zip(marks, marks[1:]) if a == a and b == b][2:]
        return sorted(gaps)[len(gaps) // 2] if gaps else None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = training_steps(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.last_val_step = training_steps(trainer)


class RunInfo(Callback):
    """Stores the run facts a resume needs (the global batch survives a change of world size)."""

    def __init__(self, info: dict) -> None:
        self.info = info

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint["gradsync_run"] = {**self.info, "world_size": trainer.world_size}
        # No credential reaches a checkpoint either: the module's and DataModule's saved options are
        # redacted as the loggers' are (a credential-named option, or a credential's value).
        from gradsync.platform.tracking import redact

        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            if key in checkpoint:
                checkpoint[key] = redact(dict(checkpoint[key]))


class FitLoopAtLastStep(Callback):
    """Keeps the fit loop's state as it stood after the last training step (its data position in the epoch
    included) for the checkpoint written once fit has returned. By then Lightning has closed the epoch
    that ``--max-steps`` cut short and dropped the train loader, so ``last.ckpt`` would send a continued run
    to the next epoch's first batch, skipping the rest of this one."""

    def __init__(self) -> None:
        self.snapshot: Optional[tuple[int, int, dict]] = None
        self.fitting = False

    def on_train_start(self, trainer, pl_module) -> None:
        self.fitting = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import copy

        self.snapshot = (trainer.global_step, trainer.current_epoch, copy.deepcopy(trainer.fit_loop.state_dict()))

    def on_train_end(self, trainer, pl_module) -> None:
        self.fitting = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.fitting or self.snapshot is None or self.snapshot[0] != checkpoint.get("global_step"):
            return  # saved during training (Lightning's own state is right), or not at the last step
        _, epoch, fit_loop = self.snapshot
        checkpoint["epoch"] = epoch
        checkpoint.setdefault("loops", {})["fit_loop"] = fit_loop


class CommMetrics(Callback):
    """Logs the strategy's ledger as ``comm/*`` metrics after every optimizer step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ledger = getattr(trainer.strategy, "ledger", None)
        if ledger is None:
            return
        pl_module.log_dict({f"comm/{k}": v for k, v in ledger.metrics().items()}, on_step=True, on_epoch=False,
                           rank_zero_only=True)


def build_trainer(spec: RunSpec, strategy: Union[Strategy, str], clock: _RunClock, *,
                  accumulation: int = 1, global_batch: Optional[int] = None, shards_itself: bool = True) -> L.Trainer:
    from gradsync.platform.consistency import ConfigConsistency, config_fingerprint
    from gradsync.platform.trainer_args import GRADSYNC_DEFAULTS, changed, instantiate

    # Only what the user gave overrides gradsync's own and derived options: the parsed options also hold
    # every Lightning default (check_val_every_n_epoch=1 would undo --val-every past an epoch).
    given = {k: v for k, v in instantiate(changed(spec.trainer_options)).items() if v is not None}
    given.pop("accumulate_grad_batches", None)  # resolved into `accumulation` (resolve_accumulation)
    user_callbacks = given.pop("callbacks", None) or []
    user_callbacks = list(user_callbacks) if isinstance(user_callbacks, (list, tuple)) else [user_callbacks]
    user_plugins = given.pop("plugins", None) or []
    user_plugins = list(user_plugins) if isinstance(user_plugins, (list, tuple)) else [user_plugins]
    from gradsync.platform.memory import MemoryProbe

    callbacks: list[Callback] = [clock, MemoryProbe(), TrainingStepLimit(spec.max_steps), CommMetrics(),
                                 RunInfo({"global_batch_size": global_batch}), FitLoopAtLastStep(),
                                 ConfigConsistency(config_fingerprint(spec)), *user_callbacks]
    from gradsync.platform.progress import GradsyncProgressBar
    from gradsync.platform.tracking import RunTelemetry, build_loggers

    callbacks.append(RunTelemetry(spec))
    if given.get("enable_progress_bar", True):
        callbacks.append(GradsyncProgressBar())
    logger: Any = build_loggers(spec) or False  # CSV in DIR/logs, plus W&B or TensorBoard (--logger)
    wants_checkpoints = bool(given.pop("enable_checkpointing", True))
    checkpointing = spec.command == "fit" and spec.output_dir is not None and wants_checkpoints
    if checkpointing:
        callbacks.append(ModelCheckpoint(
            dirpath=str(spec.output_dir / "checkpoints"), filename="last", save_top_k=1,
            every_n_train_steps=spec.checkpoint_every or None, enable_version_counter=False))
    plugins = [AtomicCheckpointIO()] if not isinstance(strategy, Strategy) else []
    if isinstance(strategy, Strategy):
        strategy.checkpoint_io = AtomicCheckpointIO()
    plugins += user_plugins
    options = {
        **GRADSYNC_DEFAULTS,
        **({"val_check_interval": spec.val_every * accumulation, "check_val_every_n_epoch": None}
           if spec.val_every else {}),
        # Recipes shard their own data (DESIGN.md "Data order"); any other DataModule gets Lightning's
        # distributed sampler, as under a plain L.Trainer, unless it declares `shards_itself = True`.
        "use_distributed_sampler": not shards_itself,
        **given,  # every other L.Trainer argument given on the command line or in --config
    }
    return L.Trainer(
        accelerator=spec.accelerator,
        devices=spec.devices,
        num_nodes=spec.num_nodes,
        strategy=strategy,
        max_steps=spec.max_steps,
        max_epochs=spec.max_epochs,
        **options,
        accumulate_grad_batches=accumulation,  # (--accumulate-grad-batches is resolved into it)
        logger=logger,
        callbacks=callbacks,
        plugins=plugins or None,
        enable_checkpointing=checkpointing,
        default_root_dir=str(spec.output_dir) if spec.output_dir else None,
    )


def with_fault_tolerance(strategy: Any, spec: RunSpec) -> Any:
    """``strategy`` as one fault-tolerant replica group when the run asks for it (one line if it cannot be)."""
    if spec.fault_tolerance is None:
        return strategy
    if not hasattr(strategy, "enable_fault_tolerance"):
        name = strategy if isinstance(strategy, str) else spec.strategy
        raise GradsyncError(f"--fault-tolerance torchft runs sync and compressed (a quorum per step), local_sgd and "
                            f"diloco (a quorum per round); --strategy {name} does not support it yet")
    from gradsync.platform.consistency import config_fingerprint

    strategy.enable_fault_tolerance(spec.fault_tolerance, fingerprint=config_fingerprint(spec))
    return strategy


# ---- running --------------------------------------------------------------------------------
def execute(spec: RunSpec) -> dict:
    """Run ``spec.command`` and return the run summary (also written to ``DIR/summary.json``)."""
    from gradsync.platform.quiet import quiet_run

    quiet_run()
    t0 = time.time()
    started = float(os.environ.get(STARTED_AT_ENV, t0))  # when the command started (the launcher sets it)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 and spec.resume is None:
        # torchrun restarted the group after a worker died: continue from the last checkpoint
        spec.resume = "auto"
    ckpt = resolve_checkpoint_to_resume(spec)
    L.seed_everything(spec.seed, workers=True, verbose=False)
    model = spec.model_class(**spec.model_options)
    data = spec.data_class(**spec.data_options)
    strategy = with_fault_tolerance(build_strategy(spec.strategy, spec.strategy_options), spec)
    micro = int(getattr(data, "batch_size", 0) or 0)
    global_batch, k = resolve_accumulation(spec, ckpt, micro)
    clock = _RunClock()
    trainer = build_trainer(spec, strategy, clock, accumulation=k, global_batch=global_batch,
                            shards_itself=bool(getattr(data, "shards_itself", False)))
    world = trainer.world_size
    if trainer.is_global_zero:
        batch = (batch_arithmetic(micro * k * world, micro, k, world) if micro else
                 "micro-batch read from the train loader (the DataModule has no batch_size)")
        print(f"gradsync: {spec.command} recipe={spec.recipe} strategy={spec.strategy} on {world} "
              f"process(es), {spec.num_nodes} node(s); {batch}", flush=True)
    resumed_from = _checkpoint_step(ckpt) if ckpt else None
    from gradsync.platform.consistency import RESUMED_FROM, ConfigConsistency

    for callback in trainer.callbacks:  # every process must resume from the same step (own directories)
        if isinstance(callback, ConfigConsistency):
            callback.fingerprint[RESUMED_FROM] = f"step {resumed_from}" if ckpt else "no checkpoint"

    if spec.command == "fit":
        try:
            trainer.fit(model, datamodule=data, ckpt_path=str(ckpt) if ckpt else None)
        except Exception as exc:
            # A training error the strategy has reworded for the user (e.g. unused parameters): one line.
            if getattr(exc, "gradsync_message", None):
                raise GradsyncError(exc.gradsync_message) from None
            raise
        clock.train_metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("train_")}
        if clock.last_val_step != training_steps(trainer) and is_overridden("validation_step", model):
            trainer.validate(model, datamodule=data, verbose=False)  # (a module without one has no validation)
        if spec.checkpoint_path is not None:
            if hasattr(strategy, "full_model_in_checkpoint"):  # a sharded run's last.ckpt holds the model whole
                strategy.full_model_in_checkpoint = True
            trainer.save_checkpoint(str(spec.checkpoint_path), weights_only=False)
    elif spec.command == "validate":
        trainer.validate(model, datamodule=data, ckpt_path=str(ckpt) if ckpt else None, verbose=False)
    else:
        trainer.test(model, datamodule=data, ckpt_path=str(ckpt) if ckpt else None, verbose=False)

    summary = build_summary(spec, trainer, model, data, clock, time.time() - min(started, t0), resumed_from)
    if trainer.is_global_zero:
        from gradsync.platform.tracking import finish_tracking

        summary = finish_tracking(trainer, summary)  # the W&B run summary; closes the W&B run
        if spec.output_dir is not None:
            write_json(spec.output_dir / "summary.json", summary)
        from gradsync.platform.report import print_summary

        print_summary(summary)
    _teardown()
    return summary


def resolve_accumulation(spec: RunSpec, ckpt: Optional[Path], micro: int) -> tuple[Optional[int], int]:
    """(global batch, micro-batches per optimizer step K): from --accumulate-grad-batches K, or derived
    from the global batch (--global-batch-size, else the resumed checkpoint's); both given must agree."""
    given = spec.trainer_options.get("accumulate_grad_batches")
    if given is not None and spec.global_batch_size is None:
        return (micro * int(given) * spec.world_size if micro else None), int(given)
    global_batch = resolve_global_batch(spec, ckpt)
    k = accumulation_steps(global_batch, micro, spec.world_size)
    if given is not None and int(given) != k:
        raise GradsyncError(
            f"--accumulate-grad-batches {given} disagrees with --global-batch-size {global_batch}, which gives "
            f"{global_batch} / ({micro} batch size x {spec.world_size} processes) = {k}; give one of the two")
    return global_batch, k


def resolve_global_batch(spec: RunSpec, ckpt: Optional[Path]) -> Optional[int]:
    """The run's global batch: the flag, else the resumed checkpoint's (so a resume on another
    world size keeps G and recomputes K), else none (no accumulation)."""
    if spec.global_batch_size is not None:
        return spec.global_batch_size
    saved = checkpoint_run_info(ckpt).get("global_batch_size")
    if saved is not None:
        return int(saved)
    if getattr(strategy_class(spec.strategy), "requires_global_batch", False):
        raise GradsyncError(f"--strategy {spec.strategy} needs --global-batch-size G (a multiple of batch size x "
                            f"processes = {spec.micro_batch_size * spec.world_size})")
    return None


def _checkpoint_step(path: Path) -> int:
    return int(load_checkpoint_file(path).get("global_step", 0))


def _teardown() -> None:
    # Without a final barrier + destroy, torchrun workers sometimes die at exit and the agent hangs.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


#: Set by the ``gradsync`` command (seconds since the epoch) so every process of a launched run
#: reports the command's wall time, start-up and launch included.
STARTED_AT_ENV = "GRADSYNC_STARTED_AT"


def build_summary(spec: RunSpec, trainer: L.Trainer, model: Any, data: Any, clock: _RunClock,
                  wall_seconds: float, resumed_from: Optional[int]) -> dict:
    strategy = trainer.strategy
    metric_name = getattr(model, "metric_name", "val_loss")
    cm = {**clock.train_metrics, **trainer.callback_metrics}
    metrics = {k: _num(cm.get(k)) for k in ("train_loss", "val_loss", metric_name)}
    for k, v in cm.items():
        if k.startswith(("val_", "test_")) and k not in metrics:
            metrics[k] = _num(v)
    world = trainer.world_size
    from gradsync.platform.tracking import telemetry_of

    telemetry = telemetry_of(trainer)
    micro = micro_batch_of(data, trainer) or (telemetry.micro_batch if telemetry is not None else 0)
    k = int(trainer.accumulate_grad_batches)
    global_batch = micro * world * k
    train_seconds = telemetry.train_seconds if telemetry is not None else 0.0
    sps = telemetry.samples_per_second() if telemetry is not None else None
    share = telemetry.comm_share(trainer) if telemetry is not None else None
    ledger = getattr(strategy, "ledger", None)
    comm = ledger.summary() if ledger is not None else {
        "wire_bytes": None, "logical_bytes": None, "compression_ratio": None, "seconds": None, "collectives": None}
    backend = None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
    from gradsync.platform.memory import MemoryProbe

    probe = next((c for c in trainer.callbacks if isinstance(c, MemoryProbe)), MemoryProbe())
    memory = probe.summary(trainer, model, strategy.algorithm_memory_state() if isinstance(strategy, GradsyncStrategy)
                           else None)
    params_agree = ranks_agree(list(model.parameters()))
    buffers_agree = ranks_agree(list(model.buffers()))
    nccl = None
    if backend == "nccl":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "recipe": spec.recipe,
        "model": f"{spec.model_class.__module__}.{spec.model_class.__qualname__}",
        "data": f"{spec.data_class.__module__}.{spec.data_class.__qualname__}",
        "command": spec.command,
        "strategy": spec.strategy,
        "strategy_options": strategy.options if isinstance(strategy, GradsyncStrategy) else {},
        "model_options": _jsonable(spec.model_options),
        "trainer_options": _jsonable(changed_trainer_options(spec.trainer_options)),  # the L.Trainer flags given
        "world_size": world,
        "num_nodes": trainer.num_nodes,
        **played_layout(strategy),
        "backend": backend,
        "nccl_version": nccl,
        "accelerator": type(trainer.accelerator).__name__.replace("Accelerator", "").lower(),
        "seed": spec.seed,
        "global_step": training_steps(trainer),  # training steps (platform/steps.py)
        **({"optimizer_steps": trainer.global_step} if training_steps(trainer) != trainer.global_step else {}),
        "micro_batch_size": micro,
        "accumulation_steps": k,
        "global_batch_size": global_batch,
        "metrics": metrics,
        "comm": comm,
        "memory": memory,
        "wall_seconds": round(wall_seconds, 3),
        "train_seconds": round(train_seconds, 3),
        "samples_per_second": sps if sps else None,  # rounded once, by RunTelemetry
        "comm_time_share": round(share, 4) if share is not None else None,
        "median_step_seconds": clock.median_step_seconds,
        "steady_samples_per_second": (round(global_batch / clock.median_step_seconds, 2)
                                      if clock.median_step_seconds else None),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "resumed_from_step": resumed_from,
        "params_agree": params_agree,
        "buffers_agree": buffers_agree,
        "nonfinite_skipped_steps": list(getattr(strategy, "skipped_steps", [])),
        "strategy_stats": strategy.run_stats() if isinstance(strategy, GradsyncStrategy) else {},
        "checkpoint": str(spec.checkpoint_path) if spec.checkpoint_path and spec.checkpoint_path.exists() else None,
        "versions": {"torch": torch.__version__, "lightning": L.__version__},
    }


def played_layout(strategy: Any) -> dict:
    """``{"layout": ...}`` where the strategy's nodes are played by ``procs_per_node`` processes each on fewer
    machines (a forced layout): the nodes the algorithm saw, beside the machines the launcher counted."""
    topology = getattr(strategy, "topology", None)
    if topology is None or not getattr(topology, "forced", False):
        return {}
    return {"layout": {"num_nodes": topology.num_nodes, "procs_per_node": topology.procs_per_node, "forced": True}}


def ranks_agree(tensors: list) -> bool:
    """Whether every rank holds the same values of ``tensors`` (the parameters, or the buffers such as
    BatchNorm's running statistics): a float64 fingerprint, compared exactly. A collective: every rank calls it."""
    import torch.distributed as dist

    params = [t.detach() for t in tensors]
    if not params or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True  # (every rank holds the same module, so every rank returns here alike)
    # a sharded (DTensor) module: each process holds its shard, which must agree with the same shard
    # on the other nodes (the processes of the same coordinate in the node's mesh)
    mesh = getattr(params[0], "device_mesh", None)
    shard = float(mesh.get_local_rank()) if mesh is not None else 0.0
    from gradsync.algorithms.layout import local_part

    params = [local_part(p) for p in params]
    fp = torch.zeros(4, dtype=torch.float64, device=params[0].device)
    fp[0] = shard
    # chunk by chunk, so that the fingerprint of a large model costs megabytes, not a float64 copy of it
    chunk, pos = 1 << 20, 0
    for p in params:
        flat = p.reshape(-1)
        for start in range(0, flat.numel(), chunk):
            x = flat[start:start + chunk].double()
            weight = torch.arange(pos + start, pos + start + x.numel(), dtype=torch.float64, device=x.device) % 97 + 1
            fp[1:] += torch.stack([x.sum(), (x * x).sum(), (x * weight).sum()])
        pos += flat.numel()
    parts = [torch.zeros_like(fp) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, fp)
    first: dict = {}
    for p in parts:
        first.setdefault(float(p[0]), p)
    return all(torch.equal(first[float(p[0])], p) for p in parts)


def _num(v: Any) -> Optional[float]:
    if v is None:
        return None
    return float(v.item() if isinstance(v, torch.Tensor) else v)


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


__all__ = ["RunSpec", "build_strategy", "build_trainer", "execute", "atomic_torch_save"]
