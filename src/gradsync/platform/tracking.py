"""Run tracking: which loggers a run writes to, what they record, and one W&B run per output dir.

Every run with ``--output-dir DIR`` keeps a CSV log in ``DIR/logs/metrics.csv`` (``gradsync compare``
reads it); ``--logger wandb`` or ``--logger tensorboard`` adds Lightning's ``WandbLogger`` or
``TensorBoardLogger`` on top. ``--logger`` defaults to ``wandb`` when W&B is configured (a
``--wandb.*`` flag or ``$WANDB_PROJECT``), else ``csv``.

What is recorded, from rank 0 only:

* the resolved run config (recipe, strategy and its options, world size, nodes, global batch,
  accumulation, precision, versions) as the logger's hyperparameters;
* every metric the recipe logs (with its throughput, ``train_samples_per_sec`` and, for recipes
  that count tokens, ``train_tokens_per_sec``), and per optimizer step the ``comm/*`` ledger (wire
  and logical bytes, compression ratio, seconds, collectives) with ``comm/time_share``, the share of
  the step's wall time spent communicating, and the run's own throughput and communication share
  (``perf/samples_per_second``, ``comm/run_time_share``: the figures the progress line and the
  summary show, see :class:`RunTelemetry`);
* the final run summary (``summary.json``) as the W&B run summary.

The W&B run id is stored in ``DIR/wandb_run_id``: a resumed run or a torchrun restart continues the
same W&B run instead of starting one per attempt. Precedence of every W&B setting: flag > W&B's own
environment variable (``WANDB_PROJECT``, ``WANDB_MODE``, ...) > gradsync's default.

No secret reaches a log: config values whose key looks like a credential, and any value equal to a
credential in the environment (``WANDB_API_KEY``, ``*_KEY``, ``*_TOKEN``, ...), are replaced.
"""

from __future__ import annotations

import csv
import netrc
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union
from urllib.parse import urlparse

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from gradsync.errors import GradsyncError
from gradsync.platform.steps import training_steps
from gradsync.platform.trainer_args import changed as changed_trainer_options
from gradsync.strategies.lightning_private import wandb_init_kwargs

LoggerName = Literal["csv", "wandb", "tensorboard"]
WandbMode = Literal["online", "offline", "disabled"]

RUN_ID_FILE = "wandb_run_id"
DEFAULT_PROJECT = "gradsync"
REDACTED = "<redacted>"
# WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, HF_TOKEN, api_key, password ... (not "tokens_per_second")
_SECRET_NAME = re.compile(r"(^|_)(api_?key|key|token|secret|password|passwd|credentials?)$|secret", re.IGNORECASE)


# ---- configuration ---------------------------------------------------------------------------
@dataclass
class WandbOptions:
    """The ``--wandb.*`` flags; ``None`` defers to W&B's environment variables, then the default."""

    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None
    tags: Optional[list[str]] = None
    mode: Optional[WandbMode] = None

    def given(self) -> bool:
        return any(v is not None for v in (self.project, self.entity, self.name, self.tags, self.mode))

    def effective_mode(self, env=os.environ) -> str:
        mode = self.mode or env.get("WANDB_MODE") or "online"
        return {"dryrun": "offline", "run": "online"}.get(mode, mode)


@dataclass
class TrackingConfig:
    """Which loggers a run writes to (``--logger``) and the W&B settings (``--wandb.*``)."""

    logger: LoggerName = "csv"
    wandb: WandbOptions = field(default_factory=WandbOptions)

    @classmethod
    def from_flags(cls, logger: Optional[str], wandb: Optional[dict], env=os.environ) -> "TrackingConfig":
        """Resolve ``--logger`` and ``--wandb.*``; raises a one-line error on a contradiction."""
        opts = WandbOptions(**{k: v for k, v in (wandb or {}).items() if k in WandbOptions.__dataclass_fields__})
        if isinstance(opts.tags, str):
            opts.tags = [t.strip() for t in opts.tags.split(",") if t.strip()]
        if logger is None:
            logger = "wandb" if opts.given() or env.get("WANDB_PROJECT") else "csv"
        elif logger != "wandb" and opts.given():
            flags = ", ".join(f"--wandb.{k}" for k, v in vars(opts).items() if v is not None)
            raise GradsyncError(f"{flags} only apply to --logger wandb (got --logger {logger}); "
                                f"drop them or pass --logger wandb")
        cfg = cls(logger=logger, wandb=opts)  # type: ignore[arg-type]
        cfg.validate(env)
        return cfg

    def validate(self, env=os.environ) -> None:
        """Refuse, before any work, a W&B run that would prompt for a login or fail after training."""
        if self.logger == "tensorboard":
            import importlib.util

            if not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
                raise GradsyncError("--logger tensorboard needs the tensorboard package: pip install tensorboard")
        if self.logger == "wandb" and self.wandb.effective_mode(env) == "online" and not wandb_login_found(env):
            raise GradsyncError(
                "--logger wandb is online but no W&B login was found (WANDB_API_KEY or `wandb login`); "
                "log in, or pass --wandb.mode offline and upload later with `wandb sync DIR/wandb/offline-run-*`")


def add_tracking_arguments(parser: Any) -> None:
    """The ``--logger`` and ``--wandb.*`` flags, on a jsonargparse parser."""
    parser.add_argument("--logger", type=Optional[LoggerName], default=None,
                        help="csv | wandb | tensorboard (default: wandb when --wandb.* or $WANDB_PROJECT is set, "
                             "else csv). The CSV log in DIR/logs is always written when --output-dir is given")
    parser.add_argument("--wandb.project", type=Optional[str], default=None,
                        help=f"W&B project (flag > $WANDB_PROJECT > {DEFAULT_PROJECT!r})")
    parser.add_argument("--wandb.entity", type=Optional[str], default=None,
                        help="W&B team or user (flag > $WANDB_ENTITY > your default entity)")
    parser.add_argument("--wandb.name", type=Optional[str], default=None,
                        help="W&B run name (flag > $WANDB_NAME > the output dir's name)")
    parser.add_argument("--wandb.tags", type=Optional[Union[list[str], str]], default=None,
                        help="W&B tags, comma-separated or a list (flag > $WANDB_TAGS)")
    parser.add_argument("--wandb.mode", type=Optional[WandbMode], default=None,
                        help="online | offline | disabled (flag > $WANDB_MODE > online); offline writes "
                             "DIR/wandb/offline-run-*, upload it with `wandb sync`")


def wandb_login_found(env=os.environ) -> bool:
    """Whether W&B can authenticate without prompting: an API key in the environment or ~/.netrc."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


# ---- secrets ---------------------------------------------------------------------------------
def secret_values(env=os.environ) -> set[str]:
    """Values of credential-looking environment variables (long enough to be worth hiding)."""
    return {v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= 12}  # short values: too common


def redact(obj: Any, secrets_: Optional[set[str]] = None) -> Any:
    """``obj`` with credential-named keys and known secret values replaced by ``<redacted>``."""
    secrets_ = secret_values() if secrets_ is None else secrets_
    if isinstance(obj, dict):
        return {k: REDACTED if isinstance(k, str) and _SECRET_NAME.search(k) and v not in (None, "")
                else redact(v, secrets_) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, secrets_) for v in obj)
    if isinstance(obj, str):
        for s in secrets_:
            if s in obj:
                obj = obj.replace(s, REDACTED)
    return obj


# ---- W&B run id --------------------------------------------------------------------------------
def _is_rank_zero(env=os.environ) -> bool:
    return int(env.get("RANK", env.get("SLURM_PROCID", 0)) or 0) == 0


def wandb_run_id(output_dir: Optional[Path], env=os.environ) -> Optional[str]:
    """The W&B run id of this output dir: stored > ``$WANDB_RUN_ID`` > new (then stored, by rank 0).

    The file makes every resume and torchrun restart of the run log into one W&B run.
    """
    if output_dir is None:
        return env.get("WANDB_RUN_ID")
    path = Path(output_dir) / RUN_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = env.get("WANDB_RUN_ID") or _new_run_id()
    if _is_rank_zero(env):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(run_id + "\n")
        os.replace(tmp, path)
    return run_id


def _new_run_id() -> str:
    # W&B's own format: 8 characters of [a-z0-9]
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(8))


# ---- building the loggers ----------------------------------------------------------------------
def build_loggers(spec: Any) -> list:
    """The Lightning loggers of a run (an empty list: no logging)."""
    cfg: TrackingConfig = getattr(spec, "tracking", None) or TrackingConfig()
    out_dir = Path(spec.output_dir) if spec.output_dir is not None else None
    loggers: list = []
    if out_dir is not None:
        loggers.append(ResumableCSVLogger(save_dir=str(out_dir), name="logs", version="",
                                          keep_history=spec.command == "fit"))
    if cfg.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(out_dir or "."), name="tensorboard", version="",
                                         default_hp_metric=False))
    elif cfg.logger == "wandb":
        loggers.append(build_wandb_logger(spec, cfg.wandb, out_dir))
    return [_redacting(lg) for lg in loggers]


def _redacting(logger: Any) -> Any:
    """``logger`` whose ``log_hyperparams`` redacts first: Lightning also logs the module's own saved
    hyperparameters (``save_hyperparameters``) to every logger, and those bypass gradsync's config."""
    log_hyperparams = logger.log_hyperparams

    def redacted(params: Any, *args: Any, **kwargs: Any) -> Any:
        as_dict = vars(params) if hasattr(params, "__dict__") and not isinstance(params, dict) else dict(params)
        return log_hyperparams(redact(as_dict), *args, **kwargs)

    logger.log_hyperparams = redacted
    return logger


def build_wandb_logger(spec: Any, opts: WandbOptions, out_dir: Optional[Path], env=os.environ) -> Any:
    from lightning.pytorch.loggers import WandbLogger

    name = opts.name or env.get("WANDB_NAME") or (out_dir.name if out_dir is not None else
                                                   f"{spec.recipe}-{spec.strategy}")
    kwargs: dict[str, Any] = {}
    if opts.entity:
        kwargs["entity"] = opts.entity
    if opts.tags:
        kwargs["tags"] = list(opts.tags)
    if opts.mode:
        kwargs["mode"] = opts.mode
    save_dir = None if env.get("WANDB_DIR") else (str(out_dir) if out_dir is not None else None)
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
    logger = WandbLogger(
        name=name, project=opts.project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        save_dir=save_dir, id=wandb_run_id(out_dir, env), log_model=False, **kwargs)
    # Lightning passes anonymous=None, which W&B >= 0.19 answers with a deprecation warning per run.
    wandb_init_kwargs(logger).pop("anonymous", None)
    if _is_rank_zero(env):
        start_wandb_run(logger)
    return logger


def start_wandb_run(logger: Any) -> None:
    """Start the W&B run now, before any process group or training exists, so that a W&B that
    cannot start (no route to the server, a rejected key) fails the run at once with the fix."""
    try:
        logger.experiment
    except Exception as exc:  # wandb raises several types (CommError, UsageError, AuthenticationError ...)
        raise GradsyncError(
            f"W&B could not start its run ({redact(' '.join(str(exc).split()))[:300]}); check the network and the "
            f"login, or pass --wandb.mode offline and upload later with `wandb sync DIR/wandb/offline-run-*`") from None


def _ledger(trainer: Any) -> Any:
    return getattr(trainer.strategy, "ledger", None)


def resolved_config(spec: Any, trainer: Any) -> dict:
    """The run's resolved configuration, as logged to every logger (secrets redacted)."""
    import json

    import lightning
    import torch

    import gradsync

    strategy = trainer.strategy
    options = getattr(strategy, "options", None)
    datamodule = getattr(trainer, "datamodule", None)
    micro = int(getattr(datamodule, "batch_size", 0) or spec.micro_batch_size or 0)
    k = int(trainer.accumulate_grad_batches)
    versions = {"gradsync": getattr(gradsync, "__version__", None), "torch": torch.__version__,
                "lightning": lightning.__version__, "python": sys.version.split()[0]}
    if "wandb" in sys.modules:
        versions["wandb"] = getattr(sys.modules["wandb"], "__version__", None)
    cfg = {
        "command": spec.command,
        "recipe": spec.recipe,
        "model": f"{spec.model_class.__module__}.{spec.model_class.__qualname__}" if spec.model_class else None,
        "model_options": dict(spec.model_options),
        "data": f"{spec.data_class.__module__}.{spec.data_class.__qualname__}" if spec.data_class else None,
        "data_options": dict(spec.data_options),
        "strategy": spec.strategy,
        "strategy_options": dict(options) if isinstance(options, dict) else dict(spec.strategy_options),
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.num_devices,
        "micro_batch_size": micro,
        "accumulation_steps": k,
        "global_batch_size": micro * k * trainer.world_size,
        "precision": str(trainer.precision),
        "trainer_options": changed_trainer_options(getattr(spec, "trainer_options", {})),
        "accelerator": type(trainer.accelerator).__name__.replace("Accelerator", "").lower(),
        "seed": spec.seed,
        "max_steps": spec.max_steps,
        "max_epochs": spec.max_epochs,
        "output_dir": str(spec.output_dir) if spec.output_dir else None,
        "resume": spec.resume,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "versions": versions,
    }
    return redact(json.loads(json.dumps(cfg, default=str)))


# ---- per-step telemetry ----------------------------------------------------------------------
def _scalar(v: Any) -> Optional[float]:
    if v is None:
        return None
    try:
        return float(v.item() if hasattr(v, "item") else v)
    except (TypeError, ValueError):
        return None


class RunTelemetry(Callback):
    """The one source of a run's time and throughput figures, and its per-step telemetry.

    The progress line, the text summary, ``summary.json``, the loggers (CSV, W&B) and
    ``gradsync compare`` all read these figures from here, so they agree:

    * ``perf/samples_per_second``: samples trained (training steps x global batch) over training
      time, both counted since the run first started (carried across resumes in the checkpoint).
      Training time is the time of optimizer steps: validation and checkpoint writes at the end of
      a step interval are inside it, start-up (imports, rendezvous, the first data loader) is not.
    * ``comm/run_time_share``: the ledger's communication seconds over that training time, since
      the run first started (the ledger is checkpointed too, so a resume does not change it).
    * ``comm/time_share``: the same for the last optimizer step alone.
    * ``perf/step_seconds``: wall time of the optimizer step (all its micro-batches; validation
      excluded).
    * ``time/wall_seconds``: training wall time since the run first started (downtime between
      attempts excluded).
    * ``train_loss``: logged here from what ``training_step`` returned (the tensor, or its
      ``"loss"``), as Lightning finds the loss, when the module does not log ``train_loss`` itself.

    For collectives that overlap the backward pass (DDP buckets, overlapped averaging rounds), the
    ledger counts time in flight, so the shares are upper bounds on time spent waiting.
    """

    def __init__(self, spec: Any = None) -> None:
        self.spec = spec
        self.wall_offset = 0.0  # training wall time of earlier attempts (from the checkpoint)
        self.train_offset = 0.0  # training (step) seconds of earlier attempts
        self.samples_offset = 0  # samples trained in earlier attempts
        self.train_seconds_now = 0.0  # this attempt's
        self.samples_now = 0
        self._fit_start: Optional[float] = None
        self._t: Optional[float] = None
        self._step = 0
        self._comm = 0.0
        self._global_batch = 0
        self.micro_batch = 0  # per process, read when training starts (the train loader exists then)
        self._log_loss: Optional[bool] = None
        self.latest: dict[str, float] = {}
        self._config_logged = False

    @property
    def state_key(self) -> str:
        return "gradsync.RunTelemetry"

    def state_dict(self) -> dict:
        return {"wall_seconds": self.wall_seconds(), "train_seconds": self.train_seconds, "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.wall_offset = float(state.get("wall_seconds", 0.0))
        self.train_offset = float(state.get("train_seconds", 0.0))
        self.samples_offset = int(state.get("samples", 0))

    def wall_seconds(self) -> float:
        return self.wall_offset + (time.perf_counter() - self._fit_start if self._fit_start is not None else 0.0)

    @property
    def train_seconds(self) -> float:
        """Training seconds since the run first started."""
        return self.train_offset + self.train_seconds_now

    @property
    def samples(self) -> int:
        """Samples trained since the run first started."""
        return self.samples_offset + self.samples_now

    def samples_per_second(self) -> Optional[float]:
        """Samples per training second, rounded once here to 2 decimals: the progress line, the
        summary and the loggers all show this one value (a figure rounded twice can differ by 1)."""
        return round(self.samples / self.train_seconds, 2) if self.train_seconds > 0 else None

    def comm_share(self, trainer: Any) -> Optional[float]:
        ledger = _ledger(trainer)
        if ledger is None or not ledger.timed or self.train_seconds <= 0:
            return None
        return float(ledger.seconds) / self.train_seconds

    # ---- config ----
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._config_logged or not trainer.loggers or self.spec is None:
            return
        self._config_logged = True
        config = resolved_config(self.spec, trainer)
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.log_hyperparams(config)

    # ---- timing ----
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from gradsync.platform.steps import micro_batch_of

        self._fit_start = time.perf_counter()
        self.micro_batch = micro_batch_of(trainer.datamodule, trainer)
        self._global_batch = self.micro_batch * trainer.world_size * int(trainer.accumulate_grad_batches)
        self._mark(trainer)

    def _mark(self, trainer: Any) -> None:
        ledger = _ledger(trainer)
        self._t = time.perf_counter()
        self._step = training_steps(trainer)
        self._comm = float(ledger.seconds) if ledger is not None else 0.0

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "fit" and self._t is not None:
            self._mark(trainer)  # throughput counts training steps only

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._log_loss is None:  # decided at the first batch: does the module log train_loss itself?
            self._log_loss = "train_loss" not in trainer.callback_metrics
        if self._log_loss:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                pl_module.log("train_loss", loss.detach().float(), on_step=True, on_epoch=False)
        if self._t is None or training_steps(trainer) == self._step:
            return  # still accumulating micro-batches of this optimizer step
        now = time.perf_counter()
        dt = max(now - self._t, 1e-9)
        steps = training_steps(trainer) - self._step
        self.train_seconds_now += dt
        self.samples_now += steps * self._global_batch
        ledger = _ledger(trainer)
        metrics = {"perf/step_seconds": dt / steps, "time/wall_seconds": self.wall_seconds()}
        sps = self.samples_per_second()
        if sps is not None and self._global_batch:
            metrics["perf/samples_per_second"] = sps
        if ledger is not None and ledger.timed:
            metrics["comm/time_share"] = (float(ledger.seconds) - self._comm) / dt
            metrics["comm/run_time_share"] = self.comm_share(trainer)
        replicas = getattr(trainer.strategy, "replicas", None)  # --fault-tolerance torchft: who is in the quorum
        if replicas is not None and replicas.telemetry.participants:
            ft = replicas.telemetry
            metrics.update({"ft/participants": float(ft.participants[-1]), "ft/failures_seen": float(ft.failures_seen),
                            "ft/heals": float(ft.heals), "ft/quorum_seconds": float(ft.quorum_seconds)})
            goodput = ft.goodput()
            if goodput is not None:
                metrics["ft/goodput"] = goodput
        self.latest = metrics
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        self._mark(trainer)


def telemetry_of(trainer: Any) -> Optional[RunTelemetry]:
    return next((cb for cb in trainer.callbacks if isinstance(cb, RunTelemetry)), None)


# ---- the end of a run ------------------------------------------------------------------------
def finish_tracking(trainer: Any, summary: dict) -> dict:
    """On rank 0: push the run summary to W&B as the run summary, close the W&B run, and return
    ``summary`` with a ``tracking`` entry (logger, W&B run id and directory)."""
    from lightning.pytorch.loggers import WandbLogger

    extra: dict[str, Any] = {}
    tokens = _scalar(trainer.callback_metrics.get("train_tokens_per_sec"))
    if tokens is not None and "tokens_per_second" not in summary:
        extra["tokens_per_second"] = round(tokens, 2)  # the recipe's count, averaged over the run
    names = {"ResumableCSVLogger": "csv", "CSVLogger": "csv", "WandbLogger": "wandb", "TensorBoardLogger": "tensorboard"}
    tracking: dict[str, Any] = {"loggers": [names.get(type(lg).__name__, type(lg).__name__) for lg in trainer.loggers]}
    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger):
            run = lg.experiment
            tracking["wandb_run_id"] = getattr(run, "id", None)
            tracking["wandb_mode"] = getattr(getattr(run, "settings", None), "mode", None)
            run_dir = getattr(getattr(run, "settings", None), "sync_dir", None)
            tracking["wandb_dir"] = str(run_dir) if run_dir else None
            run.summary.update(redact({**summary, **extra, "tracking": tracking}))
            run.finish()
    return redact({**summary, **extra, "tracking": tracking})


# ---- CSV that survives resumes ---------------------------------------------------------------
class ResumableCSVLogger(CSVLogger):
    """Lightning's CSVLogger, except that a resumed run keeps the earlier attempts' rows.

    Lightning deletes ``metrics.csv`` when its directory exists. Here, with ``keep_history``, the
    old rows stay, except those the new attempt logs again (the steps after the checkpoint it
    resumed from), so every step appears once.
    Without ``keep_history`` (validate/test on a run dir) new rows are simply appended.
    """

    def __init__(self, *args: Any, keep_history: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keep_history = keep_history

    @property
    def experiment(self) -> Any:
        if self._experiment is None:
            from lightning.fabric.utilities.rank_zero import rank_zero_only

            if rank_zero_only.rank > 0:
                return super().experiment
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir, trim=self._keep_history)
        return self._experiment


class _AppendingWriter(ExperimentWriter):
    def __init__(self, log_dir: str, trim: bool) -> None:
        self._trim = trim
        self._first_save = True
        super().__init__(log_dir=log_dir)
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = sorted(csv.DictReader(f).fieldnames or [])

    def _check_log_dir_exists(self) -> None:
        pass  # keep earlier attempts' metrics.csv (Lightning would delete it)

    def save(self) -> None:
        if self._first_save and self.metrics and self._trim and os.path.isfile(self.metrics_file_path):
            first = min(int(m.get("step", 0)) for m in self.metrics)
            keys = {k for m in self.metrics if int(m.get("step", 0)) == first for k in m} - {"step", "epoch"}
            self._drop_repeated_rows(first, keys)
        self._first_save = self._first_save and not self.metrics
        super().save()

    def _drop_repeated_rows(self, first: int, keys: set) -> None:
        # Rows after the resumed step are logged again by this attempt; at the resumed step itself
        # only rows with the same metrics are (a validation of the checkpointed model is kept).
        def keep(r: dict) -> bool:
            if not r.get("step"):
                return True
            step = int(float(r["step"]))
            return step < first or (step == first and not {k for k, v in r.items() if v} & keys)

        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            fields = reader.fieldnames or []
            rows = [r for r in reader if keep(r)]
        tmp = self.metrics_file_path + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.metrics_file_path)
