"""Ranks must run the same job: compare a fingerprint of the resolved configuration at start.

Each rank hashes every field of its resolved configuration (options flattened to ``strategy.x``,
``model.x`` ...) and the source of the model and data modules; the fingerprints are gathered on
every rank and any field that differs stops the run on every rank with an error naming it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from gradsync.errors import GradsyncError


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _module_source_digest(cls: type) -> str:
    try:
        return hashlib.sha256(inspect.getsource(sys.modules[cls.__module__]).encode()).hexdigest()[:16]
    except (OSError, TypeError, KeyError):
        return "unknown"


def config_fingerprint(spec: Any) -> dict[str, str]:
    """Field -> short hash, for the fields that must agree across ranks."""
    import gradsync

    fields: dict[str, Any] = {
        "recipe": spec.recipe,
        "model": f"{spec.model_class.__module__}.{spec.model_class.__qualname__}",
        "data": f"{spec.data_class.__module__}.{spec.data_class.__qualname__}",
        "model_code": _module_source_digest(spec.model_class),
        "data_code": _module_source_digest(spec.data_class),
        "strategy": spec.strategy,
        "global_batch_size": spec.global_batch_size,
        "seed": spec.seed,
        "max_steps": spec.max_steps,
        "max_epochs": spec.max_epochs,
        "gradsync_version": gradsync.__version__,
    }
    for prefix, options in (("model", spec.model_options), ("data", spec.data_options),
                            ("strategy", spec.strategy_options),
                            ("trainer", getattr(spec, "trainer_options", None))):
        for k, v in (options or {}).items():
            fields[f"{prefix}.{k}"] = v
    return {k: _digest(v) for k, v in fields.items()}


def find_mismatch(fingerprints: list[dict[str, str]]) -> list[str]:
    """Fields whose hash differs between any two ranks (a field missing on a rank counts)."""
    keys = sorted(set().union(*fingerprints))
    return [k for k in keys if len({fp.get(k) for fp in fingerprints}) > 1]


#: The fingerprint's field for the step the run resumes from (a raw value, shown when it differs).
RESUMED_FROM = "resumed_from_step"


class ConfigConsistency(Callback):
    """Stops the run on every rank when ranks were started with different configurations."""

    def __init__(self, fingerprint: dict[str, str]) -> None:
        self.fingerprint = fingerprint

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.fingerprint)
        bad = find_mismatch(gathered)
        if RESUMED_FROM in bad:  # each node resolved --resume in its own directory
            steps = {r: fp.get(RESUMED_FROM) for r, fp in enumerate(gathered)}
            said = ", ".join(f"rank {r} from {v}" for r, v in steps.items())
            raise GradsyncError(f"--resume: the processes would resume from different checkpoints ({said}); give every "
                                "node the checkpoint of the same step (each node's --output-dir keeps its own)")
        if bad:
            field = bad[0]
            ranks = [r for r, fp in enumerate(gathered) if fp.get(field) != gathered[0].get(field)]
            raise GradsyncError(
                f"ranks were started with different configurations: {', '.join(bad)} differ "
                f"(rank 0 vs rank(s) {', '.join(map(str, ranks))} on {field}); start every node with the same "
                f"flags and code")
