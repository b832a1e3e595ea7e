"""The ``gradsync`` command.

    gradsync fit --recipe digits --strategy sync --devices 2 --accelerator cpu --max-steps 200 --output-dir runs/a
    gradsync fit --model my_pkg.MyModel --data my_pkg.MyData --strategy sync --devices 2
    gradsync fit --config run.yaml --strategy.bucket_cap_mb 50
    gradsync fit ... --print_config > run.yaml
    gradsync list
    gradsync fit ... --logger wandb --wandb.project my-proj --wandb.mode offline
    gradsync compare runs/a runs/b --output-dir runs/compare

Flags follow the Lightning ecosystem (jsonargparse, as in LightningCLI): the options of the model,
the data and the strategy are read from their constructors' signatures and spelled
``--model.<arg>``, ``--data.<arg>``, ``--strategy.<arg>``; ``--config`` loads YAML; precedence is
flag > config file > default. ``--devices N`` on one machine re-runs the command under torchrun.

A user error prints one line (``gradsync: error: ...``) and exits with status 2.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

USAGE = """usage: gradsync {fit,validate,test} [--recipe NAME | --model CLASS --data CLASS] [--strategy NAME] [flags]
       gradsync list
       gradsync doctor [--devices N]          (versions, devices, environment, an all-reduce check)
       gradsync compare RUN_DIR... [--output-dir DIR]   (side-by-side table and plots of finished runs)
       gradsync sample --checkpoint RUN_DIR|FILE [--prompt TEXT] [--num-chars N]   (text from a chargpt checkpoint)
       gradsync export RUN_DIR|FILE [--output FILE]   (the model as one plain state_dict, default RUN_DIR/model.pt)
       gradsync lighthouse --min-replicas N [--port P]   (torchft's lighthouse for --fault-tolerance torchft)
       gradsync {fit,validate,test} --help     (flags of the chosen recipe and strategy)"""

COMMANDS = ("fit", "validate", "test")

# Shorthand run flags that set a recipe option: flag -> (component, option).
ALIASES = {"--lr": ("model", "lr"), "--batch-size": ("data", "batch_size"), "--batch_size": ("data", "batch_size")}


# Run flags: (spellings, argparse keywords); the first spelling is the parser key.
RUN_FLAGS: list[tuple[tuple[str, ...], dict]] = [
    (("--accelerator",), dict(type=str, default="auto", help="cpu | gpu | auto")),
    (("--devices",), dict(type=int, default=1,
          help="processes per node (GPUs, or CPU processes)")),
    (("--num_nodes", "--num-nodes", "--nnodes"), dict(type=int, default=1,
          help="number of nodes (flag > default 1); under srun, SLURM's node count")),
    (("--node_rank", "--node-rank"), dict(type=Optional[int], default=None,
          help="this node's rank, 0..nnodes-1 (flag > $NODE_RANK > 0)")),
    (("--master_addr", "--master-addr"), dict(type=Optional[str], default=None,
          help="rendezvous host (flag > $MASTER_ADDR > 127.0.0.1)")),
    (("--master_port", "--master-port"), dict(type=Optional[int], default=None,
          help="rendezvous port (flag > $MASTER_PORT > a free port on one node, 29500 on several)")),
    (("--max_restarts", "--max-restarts"), dict(type=int, default=0,
          help="restart the process group this many times after a worker dies; training resumes from the output "
               "dir's last checkpoint (flag > default 0)")),
    (("--rdzv_backend", "--rdzv-backend"), dict(type=Literal["static", "c10d"], default="static",
          help="static: --master-addr/--node-rank; c10d: elastic rendezvous at --master-addr:--master-port")),
    (("--rdzv_id", "--rdzv-id"), dict(type=Optional[str], default=None,
          help="c10d rendezvous id, the same on every node (flag > $SLURM_JOB_ID > 'gradsync')")),
    (("--val_every", "--val-every"), dict(type=int, default=0,
          help="validate every N optimizer steps (default 0: at the end of each epoch)")),
    (("--timeout",), dict(type=Optional[float], default=None,
          help="seconds a rank waits for a peer (rendezvous and every collective) before the run fails on every "
               "rank (flag > --strategy.timeout_seconds > 1800)")),
    (("--print_launch", "--print-launch"), dict(action="store_true",
          help="print the per-node torchrun commands and an sbatch script, then exit")),
    (("--max_steps", "--max-steps"), dict(type=int, default=-1,
          help="stop after this many training steps: optimizer steps, or batches under manual optimization "
               "(a module that steps several optimizers per batch)")),
    (("--max_epochs", "--max-epochs"), dict(type=Optional[int], default=None,
          help="stop after this many epochs")),
    (("--seed",), dict(type=int, default=0,
          help="seed of model init and data order")),
    (("--output_dir", "--output-dir"), dict(type=Optional[str], default=None,
          help="where summary.json and checkpoints/last.ckpt go")),
    (("--resume",), dict(type=Optional[str], default=None,
          help="checkpoint to resume from, or 'auto' for the output dir's last.ckpt if it exists")),
    (("--global_batch_size", "--global-batch-size"), dict(type=Optional[int], default=None,
          help="samples per optimizer step across all processes; accumulation K = G / (batch size x processes) "
               "is derived (default: batch size x processes, K = 1)")),
    (("--checkpoint_every", "--checkpoint-every"), dict(type=int, default=0,
          help="also save last.ckpt every N optimizer steps (0: at epoch ends and at the end)")),
    (("--fault_tolerance", "--fault-tolerance"), dict(type=Literal["none", "torchft"], default="none",
          help="torchft: this job is one fault-tolerant replica group; groups that die drop out of the next "
               "quorum and rejoin healed (the ft extra; sync and compressed: a quorum per step, local_sgd and "
               "diloco: per round)")),
    (("--lighthouse",), dict(type=Optional[str], default=None,
          help="with --fault-tolerance torchft: the lighthouse, http://HOST:PORT (flag > $TORCHFT_LIGHTHOUSE)")),
    (("--replica_group", "--replica-group"), dict(type=Optional[int], default=None,
          help="with --fault-tolerance torchft: this group's index, 0..N-1 (flag > $REPLICA_GROUP_ID)")),
    (("--replica_groups", "--replica-groups"), dict(type=Optional[int], default=None,
          help="with --fault-tolerance torchft: how many replica groups share the data (flag > "
               "$NUM_REPLICA_GROUPS)")),
]


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


# ---- phase 1: which classes? ----------------------------------------------------------------
def _split_flag(arg: str) -> tuple[str, Optional[str]]:
    if arg.startswith("--") and "=" in arg:
        k, v = arg.split("=", 1)
        return k, v
    return arg, None


def _scan(argv: Sequence[str], names: Sequence[str]) -> dict[str, str]:
    """Last value of each flag in ``names`` (``--x v`` or ``--x=v``)."""
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        key, val = _split_flag(argv[i])
        if key in names:
            if val is None:
                if i + 1 >= len(argv):
                    raise UsageError(f"{key} needs a value")
                val = argv[i + 1]
                i += 1
            found[key] = val
        i += 1
    return found


def _from_configs(argv: Sequence[str]) -> dict[str, Any]:
    """The selector keys (recipe, strategy.name, model_class, data_class) from --config files."""
    import yaml

    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        key, val = _split_flag(argv[i])
        if key == "--config":
            if val is None:
                val = argv[i + 1] if i + 1 < len(argv) else None
            if not val or not Path(val).is_file():
                raise UsageError(f"--config: file {val} does not exist")
            try:
                cfg = yaml.safe_load(Path(val).read_text()) or {}
            except yaml.YAMLError as exc:
                raise UsageError(f"--config: {val} is not valid YAML ({str(exc).splitlines()[0]})") from None
            if not isinstance(cfg, dict):
                raise UsageError(f"--config: {val} must hold a mapping of options")
            for k in ("recipe", "model_class", "data_class"):
                if cfg.get(k):
                    out[k] = cfg[k]
            strat = cfg.get("strategy")
            if isinstance(strat, dict) and strat.get("name"):
                out["strategy"] = strat["name"]
            elif isinstance(strat, str):
                out["strategy"] = strat
        i += 1
    return out


def _selectors(argv: Sequence[str]) -> dict[str, Any]:
    from gradsync import catalog

    sel = {"recipe": "digits", "strategy": "sync", "model_class": None, "data_class": None}
    configured = _from_configs(argv)
    sel.update(configured)
    flags = _scan(argv, ("--recipe", "--strategy", "--model", "--data"))
    if "--recipe" in flags:
        sel["recipe"] = flags["--recipe"]
    if "--strategy" in flags:
        sel["strategy"] = flags["--strategy"]
    if "--model" in flags:
        sel["model_class"] = flags["--model"]
    if "--data" in flags:
        sel["data_class"] = flags["--data"]
    recipe_chosen = "--recipe" in flags or "recipe" in configured
    if sel["model_class"] and not sel["data_class"] and not recipe_chosen:
        raise UsageError(f"--model {sel['model_class']} needs --data module.Class (your LightningDataModule), or "
                         "--recipe NAME to train it on a recipe's data")
    if sel["data_class"] and not sel["model_class"] and not recipe_chosen:
        raise UsageError(f"--data {sel['data_class']} needs --model module.Class (your LightningModule), or "
                         "--recipe NAME to train a recipe's model on it")
    if sel["recipe"] not in catalog.RECIPES and not (sel["model_class"] and sel["data_class"]):
        raise UsageError(f"--recipe {sel['recipe']!r} is unknown; available recipes: {', '.join(catalog.RECIPES)}")
    return sel


def _known_flag(key: str) -> bool:
    from gradsync.platform.trainer_args import flag_names

    trainer = flag_names()
    return (key in _KNOWN_FLAGS or key in ALIASES or key.startswith(_OPTION_PREFIXES)
            or key.startswith("--print_config") or key in trainer
            or key.rstrip("+") in trainer or key.split(".", 1)[0] in trainer)  # --callbacks+, --profiler.help


_KNOWN_FLAGS = {name for spellings, _ in RUN_FLAGS for name in spellings} | {
    "--config", "--recipe", "--strategy", "--model", "--data", "--model_class", "--data_class", "--strategy.name",
    "--logger", "--help", "-h"}
_OPTION_PREFIXES = ("--model.", "--data.", "--strategy.", "--wandb.")


def precheck(command: str, argv: Sequence[str]) -> None:
    """The errors that need no import of torch or Lightning: an unknown flag, recipe or missing
    class pairing, answered in a fraction of a second (the full parser needs the classes)."""
    import difflib

    for arg in argv:
        key = _split_flag(arg)[0]
        if key.startswith("--") and not _known_flag(key):
            from gradsync.platform.trainer_args import flag_names

            close = difflib.get_close_matches(key, sorted(_KNOWN_FLAGS | set(ALIASES) | set(flag_names())), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UsageError(f"unknown flag {key}; {hint}`gradsync {command} --help` lists the flags")
    _selectors(argv)


# ---- phase 2: the full parser for those classes -------------------------------------------
def build_parser(command: str, sel: dict[str, Any]):
    import lightning as L
    from jsonargparse import ActionConfigFile, ArgumentParser

    from gradsync.platform.run import import_class, recipe_entry, strategy_class

    entry = recipe_entry(sel["recipe"])
    model_cls = import_class(sel["model_class"], "--model", L.LightningModule) if sel["model_class"] else entry.model
    data_cls = import_class(sel["data_class"], "--data", L.LightningDataModule) if sel["data_class"] else entry.data

    p = ArgumentParser(prog=f"gradsync {command}", exit_on_error=False, default_env=False,
                       description=f"gradsync {command}: recipe, strategy and run flags (flag > --config > default)")
    p.add_argument("--config", action=ActionConfigFile, help="YAML file of options (as --print_config writes)")
    p.add_argument("--recipe", type=str, default="digits", help="recipe name (see `gradsync list`)")
    p.add_argument("--model_class", type=Optional[str], default=None,
                   help="--model module.Class: your own LightningModule (default: the recipe's)")
    p.add_argument("--data_class", type=Optional[str], default=None,
                   help="--data module.Class: your own LightningDataModule (default: the recipe's)")
    p.add_argument("--strategy.name", type=str, default="sync",
                   help="--strategy NAME: a gradsync strategy or a stock Lightning one such as ddp")
    for spellings, kwargs in RUN_FLAGS:
        p.add_argument(*spellings, **kwargs)
    from gradsync.platform.tracking import add_tracking_arguments

    add_tracking_arguments(p)  # --logger, --wandb.*
    from gradsync.platform.trainer_args import add_trainer_arguments

    add_trainer_arguments(p)  # --precision, --gradient-clip-val, ...: every other L.Trainer argument
    p.add_class_arguments(model_cls, "model", fail_untyped=False)
    p.add_class_arguments(data_cls, "data", fail_untyped=False)
    strat_cls = strategy_class(sel["strategy"])
    if strat_cls is not None:
        # DDPStrategy's own arguments are for Python callers; --strategy.backend / --timeout set the same
        skip = set(getattr(strat_cls, "python_only_options", ()))
        p.add_class_arguments(strat_cls, "strategy", fail_untyped=False, skip=skip)
    return p, model_cls, data_cls


def _config_text(path: str) -> str:
    """A --config file as the parser takes it: ``strategy: NAME`` (a hand-written shorthand) is
    read as ``strategy: {name: NAME}``, the form ``--print_config`` writes."""
    import yaml

    cfg = yaml.safe_load(Path(path).read_text()) or {}
    if isinstance(cfg.get("strategy"), str):
        cfg["strategy"] = {"name": cfg["strategy"]}
        return yaml.safe_dump(cfg, sort_keys=False)
    return path


def _rewrite(argv: Sequence[str], bools: Sequence[str] = ()) -> list[str]:
    """Map the short selector flags onto parser keys; aliases go last so they override --config.
    A flag of a ``bool`` Trainer argument in ``bools`` given alone (``--sync-batchnorm``) means ``true``."""
    out: list[str] = []
    tail: list[str] = []
    renames = {"--strategy": "--strategy.name", "--model": "--model_class", "--data": "--data_class"}
    i = 0
    while i < len(argv):
        key, val = _split_flag(argv[i])
        if key == "--config":
            path = val if val is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if val is None else 0
            out += ["--config", _config_text(path)]
        elif key in renames or key in ALIASES:
            if val is None:
                if i + 1 >= len(argv):
                    raise UsageError(f"{key} needs a value")
                val = argv[i + 1]
                i += 1
            if key in renames:
                out += [renames[key], val]
            else:
                comp, opt = ALIASES[key]
                tail += [f"--{comp}.{opt}", val]
        else:
            out.append(argv[i])
            if val is None and key.lstrip("-").replace("-", "_") in bools and (
                    i + 1 >= len(argv) or argv[i + 1].startswith("--")):
                out.append("true")
        i += 1
    return out + tail


def parse_run(command: str, argv: Sequence[str]):
    """Parse ``argv`` of a fit/validate/test command into a :class:`RunSpec` (or print help/config)."""
    from jsonargparse import ArgumentError

    from gradsync.platform.run import RunSpec, strategy_class, unknown_strategy_message

    sel = _selectors(argv)
    if strategy_class(sel["strategy"]) is None:
        from lightning.pytorch.strategies import StrategyRegistry

        if sel["strategy"] not in StrategyRegistry:
            raise UsageError(unknown_strategy_message(sel["strategy"]))
    parser, model_cls, data_cls = build_parser(command, sel)
    from gradsync.platform.trainer_args import OWNED, bool_flags, trainer_parameter_names

    try:
        cfg = parser.parse_args(_rewrite(argv, bools=bool_flags()))
    except ArgumentError as exc:
        raise UsageError(_choice_error(parser, exc, argv) or _one_line(exc)) from None
    d = cfg.as_dict()
    d.pop("config", None)
    _check_run_flags(d, argv)
    strategy = dict(d.get("strategy") or {})
    name = strategy.pop("name")
    if d["timeout"] is not None:
        if d["timeout"] <= 0:
            raise UsageError(f"--timeout {d['timeout']}: must be > 0 seconds")
        if "timeout_seconds" in strategy:
            strategy["timeout_seconds"] = d["timeout"]
    spec = RunSpec(
        command=command, recipe=d["recipe"] if not (d["model_class"] or d["data_class"]) else "custom",
        model_class=model_cls, model_options=d.get("model") or {},
        data_class=data_cls, data_options=d.get("data") or {},
        strategy=name, strategy_options=strategy,
        accelerator=d["accelerator"], devices=d["devices"], num_nodes=d["num_nodes"],
        max_steps=d["max_steps"], max_epochs=d["max_epochs"], seed=d["seed"],
        output_dir=Path(d["output_dir"]) if d["output_dir"] else None, resume=d["resume"],
        checkpoint_every=d["checkpoint_every"], global_batch_size=d["global_batch_size"], val_every=d["val_every"],
        trainer_options={name: d[name] for name in trainer_parameter_names() if name in d and name not in OWNED},
    )
    from gradsync.platform.launch import LaunchConfig

    spec.launch = LaunchConfig(
        nproc_per_node=d["devices"], nnodes=d["num_nodes"], node_rank=d["node_rank"], master_addr=d["master_addr"],
        master_port=d["master_port"], max_restarts=d["max_restarts"], rdzv_backend=d["rdzv_backend"],
        rdzv_id=d["rdzv_id"], timeout=d["timeout"])
    spec.print_launch = bool(d["print_launch"])
    spec.fault_tolerance = _fault_tolerance(d)
    from gradsync.platform.tracking import TrackingConfig

    spec.tracking = TrackingConfig.from_flags(d.get("logger"), d.get("wandb"))
    if spec.command == "fit" and spec.max_steps == -1 and spec.max_epochs is None:
        spec.max_epochs = 10
    return spec


def _fault_tolerance(d: dict):
    """The replica group this job is (``--fault-tolerance torchft``), with torchft's environment names as
    fallbacks; None without fault tolerance."""
    from gradsync.platform.fault_tolerance import (LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_GROUP_ENV,
                                                   FaultToleranceConfig)

    given = [f for f, k in (("--lighthouse", "lighthouse"), ("--replica-group", "replica_group"),
                            ("--replica-groups", "replica_groups")) if d[k] is not None]
    if d["fault_tolerance"] == "none":
        if given:
            raise UsageError(f"{given[0]} needs --fault-tolerance torchft")
        return None
    lighthouse = d["lighthouse"] or os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise UsageError(f"--fault-tolerance torchft needs --lighthouse http://HOST:PORT (or ${LIGHTHOUSE_ENV}); "
                         "start one with `gradsync lighthouse --min-replicas N`")
    values = {}
    for key, flag, env in (("replica_group", "--replica-group", REPLICA_GROUP_ENV),
                           ("replica_groups", "--replica-groups", NUM_REPLICA_GROUPS_ENV)):
        value = d[key] if d[key] is not None else os.environ.get(env)
        if value is None:
            raise UsageError(f"--fault-tolerance torchft needs {flag} (or ${env})")
        try:
            values[key] = int(value)
        except ValueError:
            raise UsageError(f"${env} {value!r}: must be an integer") from None
    if values["replica_groups"] < 1:
        raise UsageError(f"--replica-groups {values['replica_groups']}: must be >= 1")
    if not 0 <= values["replica_group"] < values["replica_groups"]:
        raise UsageError(f"--replica-group {values['replica_group']}: must be in 0..{values['replica_groups'] - 1} "
                         "(one less than --replica-groups)")
    if d["num_nodes"] != 1:
        raise UsageError("--fault-tolerance torchft: a replica group is one node for now; use --nnodes 1 per group "
                         "and start one job per group")
    wait = ({} if d["timeout"] is None else
            {"quorum_timeout": d["timeout"], "timeout": d["timeout"], "connect_timeout": d["timeout"]})
    return FaultToleranceConfig(lighthouse=lighthouse, **values, **wait, processes=d["devices"])


def _typed(argv: Sequence[str], spellings: Sequence[str]) -> str:
    """The spelling of a flag the user typed (the first of ``spellings`` when none was typed)."""
    for arg in argv:
        key = arg.split("=", 1)[0]
        if key in spellings:
            return key
    return spellings[0]


def _check_run_flags(d: dict, argv: Sequence[str] = ()) -> None:
    nodes_flag = _typed(argv, ("--num-nodes", "--nnodes", "--num_nodes"))
    rules = [
        ("--devices", d["devices"], d["devices"] >= 1, "must be >= 1 (processes per node)"),
        (nodes_flag, d["num_nodes"], d["num_nodes"] >= 1, "must be >= 1"),
        ("--max-steps", d["max_steps"], d["max_steps"] == -1 or d["max_steps"] >= 1, "must be >= 1 (or -1: no limit)"),
        ("--max-epochs", d["max_epochs"], d["max_epochs"] is None or d["max_epochs"] >= 1, "must be >= 1"),
        ("--checkpoint-every", d["checkpoint_every"], d["checkpoint_every"] >= 0, "must be >= 0 steps"),
        ("--max-restarts", d["max_restarts"], d["max_restarts"] >= 0, "must be >= 0"),
        ("--val-every", d["val_every"], d["val_every"] >= 0, "must be >= 0 optimizer steps"),
        ("--node-rank", d["node_rank"], d["node_rank"] is None or 0 <= d["node_rank"] < d["num_nodes"],
         f"must be in 0..{d['num_nodes'] - 1} (one less than {nodes_flag})"),
        ("--master-port", d["master_port"], d["master_port"] is None or 0 < d["master_port"] < 65536,
         "must be a TCP port, 1..65535"),
        ("--accelerator", d["accelerator"], d["accelerator"] in ("cpu", "gpu", "cuda", "auto"),
         "must be cpu, gpu or auto"),
    ]
    for flag, value, ok, rule in rules:
        if not ok:
            raise UsageError(f"{flag} {value}: {rule}")
    if d["val_every"] and d.get("val_check_interval") is not None:
        raise UsageError(f"--val-every {d['val_every']} and --val-check-interval {d['val_check_interval']} both say "
                         "when to validate; give one (--val-every counts optimizer steps, --val-check-interval "
                         "batches as in Lightning)")
    k = d.get("accumulate_grad_batches")
    if k is not None and k < 1:
        raise UsageError(f"--accumulate-grad-batches {k}: must be >= 1")
    if d["accelerator"] in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            build = f"this torch ({torch.__version__}) is a CPU build" if torch.version.cuda is None else \
                "torch sees no CUDA device (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
            raise UsageError(f"--accelerator {d['accelerator']}: no GPU here, {build}; use --accelerator cpu "
                             "(or auto)")


def _choices(annotation: Any) -> list:
    """The values a ``Literal`` (inside ``Optional`` / ``Union``) admits, in order; [] for an open type."""
    import typing

    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Union:
        found = [c for arg in typing.get_args(annotation) for c in _choices(arg)]
        open_type = any(a not in (type(None),) and typing.get_origin(a) is not Literal
                        for a in typing.get_args(annotation))
        return [] if open_type and not found else list(dict.fromkeys(found))
    return []


def _choice_error(parser: Any, exc: BaseException, argv: Sequence[str]) -> Optional[str]:
    """A closed-choice flag given a value outside its choices, as one line that lists them
    (``--precision fp17: not one of 64, 32, 16, ...``); None for any other parse error."""
    import re

    match = re.search(r'Parser key "([^"]+)"', str(exc))
    if not match:
        return None
    key = match.group(1)
    action = next((a for a in parser._actions if a.dest == key), None)
    choices = [c for c in _choices(getattr(action, "_typehint", None)) if c is not None]
    if not choices:
        return None
    spellings = [o for o in (action.option_strings or []) if o.startswith("--")] or [f"--{key}"]
    spellings += [s.replace("_", "-") for s in spellings]
    spellings += [f for f, (c, o) in ALIASES.items() if f"{c}.{o}" == key]
    given = {**_scan(argv, spellings)}
    flag = next((s for s in spellings if s in given), spellings[0].replace("_", "-"))
    value = given.get(flag, "")
    names = ", ".join(dict.fromkeys(str(c) for c in choices if str(c) != value))  # 64 is an int and a str
    return f"{flag} {value}: not one of its values; use one of {names}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:400]


def _option_error_flag(component: str, option: str) -> str:
    for flag, (comp, opt) in ALIASES.items():
        if comp == component and opt == option and "_" not in flag:
            return flag
    return f"--{component}.{option}"


def _check_strategy(strategy, world_size: int, num_nodes: int, accelerator: str = "auto") -> None:
    if isinstance(strategy, str):  # one of Lightning's own: as L.Trainer checks it against the accelerator
        _check_lightning_strategy(strategy, accelerator)
        return
    backend = (getattr(strategy, "options", None) or {}).get("backend")
    if backend == "nccl":
        import torch

        if accelerator == "cpu" or not torch.cuda.is_available():
            raise UsageError("--strategy.backend nccl: NCCL needs CUDA devices and this run has none; use "
                             "--strategy.backend gloo (or auto), or --accelerator gpu on a machine with GPUs")
    if hasattr(strategy, "check_world_size"):
        strategy.check_world_size(world_size)
    if hasattr(strategy, "check_layout"):
        strategy.check_layout(world_size, num_nodes)


def _check_lightning_strategy(name: str, accelerator: str) -> None:
    """Lightning's strategy ``name`` with ``accelerator``, as L.Trainer accepts it (one process, nothing
    set up): a pairing it refuses (``fsdp`` on CPU) fails here in one line, not in every launched worker."""
    import logging

    import lightning as L

    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        L.Trainer(accelerator=accelerator, devices=1, strategy=name, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
    except Exception as exc:  # Lightning's MisconfigurationException, ValueError ...
        hint = "; gradsync's strategies run on CPU (gradsync list)" if accelerator == "cpu" else ""
        raise ValueError(f"{name} with --accelerator {accelerator}: {_one_line(exc).rstrip('.')}{hint}") from None
    finally:
        quiet.setLevel(level)


def validate_spec(spec) -> None:
    """Construct the parts once, cheaply, so bad values fail before any process is launched."""
    from gradsync.errors import OptionError
    from gradsync.platform.run import (build_strategy, resolve_accumulation, resolve_checkpoint_to_resume,
                                       with_fault_tolerance)

    for component, build in (("model", lambda: spec.model_class(**spec.model_options)),
                             ("data", lambda: spec.data_class(**spec.data_options)),
                             ("strategy", lambda: _check_strategy(
                                 with_fault_tolerance(build_strategy(spec.strategy, spec.strategy_options), spec),
                                 spec.world_size, spec.num_nodes, spec.accelerator))):
        try:
            build()
        except OptionError as exc:
            flag = _option_error_flag(component, exc.option)
            raise UsageError(f"{flag} {exc.value}: {exc.rule}" + (f" ({exc.fix})" if exc.fix else "")) from None
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--{component}: {_one_line(exc)}") from None
    _check_trainer_options(spec)
    if spec.output_dir is not None and spec.command == "fit":
        try:
            spec.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--output-dir {spec.output_dir}: cannot be created ({exc.strerror or exc}); "
                             "choose a writable directory") from None
    ckpt = resolve_checkpoint_to_resume(spec)
    resolve_accumulation(spec, ckpt, spec.micro_batch_size)


def _check_trainer_options(spec) -> None:
    """The Trainer flags as L.Trainer checks them (one process, no strategy): a value it refuses
    fails here in one line, not in every launched worker."""
    import logging

    from gradsync.platform.trainer_args import defaults, instantiate

    given = {k: v for k, v in spec.trainer_options.items()
             if v is not None and k not in ("accumulate_grad_batches", "enable_checkpointing")}
    changed = [k for k, v in given.items() if v != defaults().get(k)]
    if not changed:
        return
    import lightning as L

    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # (its device lines are for the run itself)
    try:
        L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, **instantiate(given))
    except Exception as exc:  # Lightning's MisconfigurationException, ValueError, TypeError ...
        flag = next((k for k in changed if k in str(exc)), changed[0])
        raise UsageError(f"--{flag.replace('_', '-')} {given[flag]}: {_one_line(exc)}") from None
    finally:
        quiet.setLevel(level)


# ---- commands -------------------------------------------------------------------------------
def cmd_list() -> int:
    from gradsync import catalog
    from gradsync.platform.report import print_list

    strategies = {name: text for name, (_, text) in catalog.STRATEGIES.items()}
    strategies.update({name: f"(plugin) {value}" for name, value in catalog.plugin_strategies().items()})
    print_list({name: text for name, (_, _, text) in catalog.RECIPES.items()}, strategies)
    return 0


def cmd_run(command: str, argv: list[str], spec: Any = None) -> int:
    """Run (or launch) one fit/validate/test; ``spec``: the run as the launcher parsed it, if it did."""
    from gradsync.platform import launch

    if spec is None:
        spec = parse_run(command, argv)  # --help / --print_config exit inside jsonargparse
    warning = launch.missing_master_address(spec.launch)
    if warning and not launch.inside_launcher():
        print(f"gradsync: warning: {warning}", file=sys.stderr)
    if spec.print_launch:
        print(launch.print_launch([command, *argv], spec.launch.resolved(), spec.fault_tolerance))
        return 0
    if launch.inside_srun() and not launch.inside_torchrun():
        task = launch.slurm_task(master_port=spec.launch.master_port)
        os.environ.setdefault("MASTER_ADDR", task.master_addr)
        os.environ.setdefault("MASTER_PORT", str(task.master_port))
    elif not launch.inside_launcher():
        validate_spec(spec)
        if spec.devices > 1 or spec.num_nodes > 1 or spec.launch.max_restarts > 0:
            cfg = spec.launch.resolved()
            if cfg.nnodes > 1 and cfg.node_rank > 0 and cfg.rdzv_backend == "static":
                wait = cfg.timeout or 1800.0
                if not launch.wait_for_node_zero(cfg, wait):
                    raise UsageError(f"node 0 did not answer at {cfg.master_addr}:{cfg.master_port} within {wait:g} s; "
                                     "start node 0 too, or check --master-addr and --master-port (and --timeout)")
            with tempfile.TemporaryDirectory(prefix="gradsync-launch-") as handover:
                # the workers take this parse instead of doing it again (same argv, so same result)
                # a replica group: torchrun's agent with its workers (and their restarts) forked from it
                # once it imported everything, so a restarted process heals back in seconds
                run = launch.elastic_command if spec.fault_tolerance is not None else launch.torchrun_command
                rc, rendezvous_timeout = launch.run_torchrun(run([command, *argv], cfg),
                                                             launch.hand_over(spec, [command, *argv], handover))
            if rendezvous_timeout:
                wait = f" within {cfg.timeout:g} s" if cfg.timeout else ""
                print(f"gradsync: error: not every node joined at {cfg.master_addr}:{cfg.master_port}{wait} "
                      f"(torchrun: {rendezvous_timeout}); start all {cfg.nnodes} nodes with the same --master-addr "
                      "and --master-port, or raise --timeout", file=sys.stderr)
            elif rc not in (0, 2):
                print(f"gradsync: error: the launched processes failed (torchrun exit status {rc}); the first "
                      f"worker error is above", file=sys.stderr)
            return rc
    from gradsync.platform.run import execute

    execute(spec)
    return 0


def elastic_worker(argv: list[str]) -> None:
    """A worker of :func:`gradsync.platform.launch.run_elastic` (``python -m gradsync.cli.elastic``): ``gradsync
    <argv>``, exiting with its status."""
    rc = main(list(argv))
    if rc:
        # A worker that failed (its error is printed) leaves at once: a thread still waiting on a dead peer
        # (torchft's quorum, a collective) would hold its interpreter's exit until the agent's SIGTERM
        # grace (30 s) runs out, and with it the group's restart. (What the exit would have closed first: the
        # W&B run, whose own exit hook is skipped.)
        wandb = sys.modules.get("wandb")
        if wandb is not None and getattr(wandb, "run", None) is not None:
            try:
                wandb.finish(exit_code=rc)
            except Exception:  # noqa: BLE001 - the worker is failing already; its error is printed
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["GRADSYNC_ENTRY"] = "cli"  # errors.ENTRY_ENV: messages name flags, not constructor arguments
    import time

    os.environ.setdefault("GRADSYNC_STARTED_AT", repr(time.time()))  # run.STARTED_AT_ENV: the command's wall time
    from gradsync.errors import GradsyncError

    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(USAGE)
            return 0 if argv else 2
        command, rest = argv[0], argv[1:]
        if command == "list":
            return cmd_list()
        if command == "doctor":
            from gradsync.cli.doctor import main as doctor

            return doctor(rest)
        if command == "compare":
            from gradsync.platform.compare import cmd_compare

            return cmd_compare(rest)
        if command == "sample":
            from gradsync.cli.sample import cmd_sample

            return cmd_sample(rest)
        if command == "export":
            from gradsync.cli.export import cmd_export

            return cmd_export(rest)
        if command == "lighthouse":
            from gradsync.cli.lighthouse import cmd_lighthouse

            return cmd_lighthouse(rest)
        if command in COMMANDS:
            from gradsync.platform.launch import handed_over

            spec = handed_over([command, *rest])  # a worker of gradsync's launcher: parsed there already
            if spec is None and not ({"-h", "--help"} & set(rest)):
                precheck(command, rest)
            return cmd_run(command, rest, spec)
        raise UsageError(f"unknown command {command!r}; choose one of fit, validate, test, list, doctor, compare, sample, "
                         "export, lighthouse")
    except (UsageError, GradsyncError) as exc:
        # one write: every rank may print it into the same pipe, and print() writes the newline apart
        sys.stderr.write(f"gradsync: error: {exc}\n")
        sys.stderr.flush()
        return 2


if __name__ == "__main__":
    sys.exit(main())
