"""Checkpoints of every rank's algorithm state, for :class:`~gradsync.strategies.base.GradsyncStrategy`.

Lightning saves rank 0's model and optimizer; a gradsync strategy's algorithm state differs per rank
(error-feedback residuals, local parameters mid-period, server shards). Each rank writes its own part
next to the checkpoint (:mod:`gradsync.strategies.parts`); only a token and a flag cross the network,
and rank 0 commits the manifest once every part is on disk. A resume on the same layout gives each
rank its own part back; on another world size or node layout the strategy reshards them (by default:
keep the ledger, reset the rest, say so once).
"""

from __future__ import annotations

import secrets
import warnings
from typing import Any, Optional

import torch

from gradsync.algorithms.state import Resharded
from gradsync.errors import GradsyncError
from gradsync.strategies import parts as rank_parts
from gradsync.strategies.lightning_private import fit_batch_progress


class RankCheckpointing:
    """Mixed into :class:`~gradsync.strategies.base.GradsyncStrategy` (ahead of Lightning's
    ``DDPStrategy``, whose save and load it extends): save, load and reshard of per-rank state."""

    _restored_algorithm_state: Optional[rank_parts.SavedParts] = None

    def algorithm_state_dict(self) -> dict:
        """This rank's algorithm state (tensors on CPU). Subclasses extend it; keep the ledger."""
        return {"ledger": self.ledger.state_dict()}

    def algorithm_memory_state(self) -> dict:
        """The algorithm's own state, as counted in the run summary's memory: :meth:`algorithm_state_dict`
        without the ledger and without what mirrors the module's parameters or optimizer state."""
        state = self.algorithm_state_dict()
        state.pop("ledger", None)
        return state

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
        sharded = None
        if self.sharded:  # every process writes its shards of the model and optimizer state (collective)
            sharded = self.write_sharded_state(rank_parts.shards_dir(path, token))
        if not self._all_ranks_ok(not failure):
            raise GradsyncError(failure or f"checkpoint {path} not written: another rank could not write its part "
                                           "(its error is in that rank's log); the previous checkpoint is intact")
        checkpoint["gradsync"] = {"strategy": self.strategy_name, "world_size": self.world_size, "token": token,
                                  "parts": rank_parts.parts_dir(path).name,
                                  "accumulation_steps": self.accumulation_steps, **self.checkpoint_layout()}
        if sharded is not None:
            checkpoint["gradsync"]["sharded"] = sharded
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # rank 0 commits
        if self.global_rank != 0 and self.local_rank == 0 and not rank_parts.part_path(path, 0, token).exists():
            # This machine does not see rank 0's files (no filesystem shared between nodes): its directory
            # keeps a manifest of its own, so that it resumes, and exports, from what it holds.
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        # Once the new manifest is in place (rank 0 says so), no manifest names the older parts.
        if self._all_ranks_ok(True):
            rank_parts.remove_stale_parts(path, self.global_rank, keep={token}, shards=self.local_rank == 0)

    def checkpoint_layout(self) -> dict:
        """Facts about the job a resume needs to reshard (e.g. processes per node); JSON-able."""
        if (self.scope != "node" and not self.sharded) or self.topology is None:
            return {}
        layout = {"scope": self.scope, "procs_per_node": self.topology.procs_per_node,
                  "num_nodes": self.topology.num_nodes}
        return {**layout, "shard": "node"} if self.sharded else layout

    def remove_checkpoint(self, filepath: Any) -> None:
        rank_parts.remove_parts(filepath, self.global_rank, shards=self.local_rank == 0)
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
        if manifest and manifest.get("sharded") and not self.sharded:
            raise GradsyncError(f"--resume: {checkpoint_path} was written with --strategy.shard node (each process "
                                "wrote its shards); resume with --strategy.shard node, or write one plain state_dict "
                                "with `gradsync export`")
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
            said = Resharded(state={}, reset=reset).describe(self.strategy_name, self.written_by(saved_world_size),
                                                              len(parts))
            warnings.warn(said, stacklevel=2)
        return {"ledger": parts[0].get("ledger", {})}


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

