"""``async_ps``: asynchronous SGD through a parameter server, with bounded staleness.

Every rank is a worker; the first ``num_servers`` ranks also host one *server shard* each in a
background thread (co-located servers, as in BytePS-style deployments: no rank idles as a pure
server and no data shard goes unused). A shard holds the authoritative copy of its parameters and
the optimizer for them (the recipe's optimizer class and hyperparameters). Each optimizer step a
worker

1. **pulls** the current parameters from every shard (waiting only if the staleness bound says so),
2. runs forward and backward on its own batch,
3. **pushes** the gradient, tagged with the versions it was computed from, and goes on — no barrier
   with the other workers.

A shard applies the mean of the gradients it holds as one update. ``max_staleness`` bounds how many
updates a gradient may lag behind the parameters it is applied to; ``0`` is synchronous SGD (every
update averages one gradient from each worker, all computed from the same parameters). The rule
and its proof sketch are in :mod:`gradsync.algorithms.param_server`.

Lightning's loop stays in charge: validation, checkpoints and the end of fit first wait for every
worker (a barrier), then read the server's parameters, so every rank evaluates and saves the same,
authoritative model. The checkpoint's ``state_dict`` is the server's parameters and its algorithm
state holds each shard's parameters, optimizer state and version; a resume continues from them
(also on another world size or shard count).

Transport: point-to-point ``send``/``recv`` on one gloo group per shard (``torch.distributed``), also
when training runs on CUDA/NCCL; the server keeps its parameters and optimizer on the CPU.

Usage::

    L.Trainer(strategy=AsyncPSStrategy(max_staleness=4), devices=3)
    gradsync fit --recipe digits --strategy async_ps --strategy.max_staleness 4 --devices 3
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
import time
import warnings
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from gradsync.algorithms.param_server import ShardState, split_shards
from gradsync.algorithms.ps_worker import (
    WorkerClock, lost_report, merge_saved_shards, shard_optimizer, shard_stats, summarize,
)
from gradsync.comm.ledger import fp32_allreduce_bytes
from gradsync.comm.ps import PSClient, ServerError, ServerThread
from gradsync.errors import GradsyncError, check, spell
from gradsync.strategies.base import GradsyncStrategy
from gradsync.strategies.lightning_private import ddp_kwargs, mark_optimizer_stepped, replace_sigterm_broadcast


def _make_sigterm_check_local(trainer: Any) -> None:
    """Lightning broadcasts a SIGTERM flag from rank 0 before every training batch: a per-step
    collective that would put the workers back in lockstep. Each worker checks its own flag instead
    (torchrun and SLURM signal every process)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def local_check(self: Any) -> None:
        if getattr(self.trainer, "received_sigterm", False):
            raise SIGTERMException()

    replace_sigterm_broadcast(trainer, local_check)


class _ServerModelFirst(Callback):
    """Runs :meth:`AsyncPSStrategy.finish` before any other callback's ``on_train_end``."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if isinstance(trainer.strategy, AsyncPSStrategy):
            trainer.strategy.finish()


def keep_local_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hand the bucket back untouched: gradients go to the parameter server, not to an all-reduce."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class AsyncPSStrategy(GradsyncStrategy):
    """Asynchronous SGD through parameter-server shards, staleness bounded by `max_staleness`."""

    strategy_name = "async_ps"
    gradients_synchronized = False

    def __init__(self, *, max_staleness: int = 4, num_servers: int = 1,
                 staleness_scaling: Literal["none", "inverse"] = "inverse", **kwargs: Any) -> None:
        """
        Args:
            max_staleness: the most updates a gradient may lag behind the parameters it is applied
                to; 0 is synchronous SGD. A fast worker waits only when it would get more than this
                many updates ahead of a worker still computing; 2-16 is typical.
            num_servers: how many ranks (the first ones) host a shard of the parameters and the
                optimizer, so one server is not the bottleneck; 1 <= num_servers <= world size.
            staleness_scaling: ``inverse`` scales a gradient applied tau >= 1 updates late by 1/tau
                (staleness-dependent learning rate; keeps momentum 0.9 stable under asynchrony);
                ``none`` applies every gradient at full weight. No effect at max_staleness 0.
            **kwargs: process-group options of :class:`~gradsync.strategies.base.GradsyncStrategy`.
        """
        check(isinstance(max_staleness, int) and not isinstance(max_staleness, bool) and max_staleness >= 0,
              "max_staleness", max_staleness, "must be an integer >= 0",
              f"0 is synchronous; e.g. {spell('max_staleness', 4)}")
        check(isinstance(num_servers, int) and not isinstance(num_servers, bool) and num_servers >= 1,
              "num_servers", num_servers, "must be an integer >= 1", f"e.g. {spell('num_servers', 2)}")
        check(staleness_scaling in ("none", "inverse"), "staleness_scaling", staleness_scaling,
              "must be one of none, inverse")
        self.max_staleness = max_staleness
        self.num_servers = num_servers
        self.staleness_scaling = staleness_scaling
        super().__init__(**kwargs)
        # Buffers stay local (there is no per-step collective to broadcast them with).
        ddp_kwargs(self)["broadcast_buffers"] = False
        self.client: Optional[PSClient] = None
        self.servers: dict[int, ServerThread] = {}
        self._params: list[torch.Tensor] = []
        self._shard_indices: list[list[int]] = []
        self._need_pull = True
        self._restored_ps: Optional[dict] = None
        self._final_stats: Optional[dict] = None
        self.reshard_note: Optional[str] = None
        self.clock = WorkerClock()

    def build_comm_hook(self) -> Optional[tuple[Any, Callable]]:
        return None, keep_local_hook

    def check_world_size(self, world_size: int) -> None:
        check(self.num_servers <= world_size, "num_servers", self.num_servers,
              f"must be <= the number of processes ({world_size})", f"use {spell('num_servers', world_size)} or fewer")

    # ---- start and stop the servers --------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if getattr(trainer.state, "fn", None) == "fit":
            self._start(trainer)

    def _start(self, trainer: Any) -> None:
        from lightning.pytorch.plugins.precision import MixedPrecision

        if isinstance(self.precision_plugin, MixedPrecision) and getattr(self.precision_plugin, "scaler", None):
            raise GradsyncError("--strategy async_ps applies gradients on the server and cannot use 16-mixed "
                                "precision's loss scaling; use --precision bf16-mixed or 32-true")
        if len(self.optimizers) != 1:
            raise GradsyncError(f"async_ps runs one server optimizer; this module configures {len(self.optimizers)} "
                                "optimizers. Use one optimizer, or the sync strategy")
        world = self.world_size
        module = self.lightning_module
        params = [p for p in module.parameters() if p.requires_grad]
        check(self.num_servers <= len(params), "num_servers", self.num_servers,
              f"must be <= the number of trainable parameter tensors ({len(params)})")
        self._params = params
        optimizer = self.optimizers[0]
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [i for i, p in enumerate(params) if id(p) not in in_optimizer]
        if missing:
            raise GradsyncError(f"async_ps: {len(missing)} trainable parameters are not in the optimizer; "
                                "give every trainable parameter to the optimizer or freeze it")
        self._shard_indices = shards = split_shards([p.numel() for p in params], self.num_servers)
        # Per shard a request group (on the server's rank only its thread receives on it) and a reply
        # group; creating them is collective, in the same order on every rank.
        everyone = list(range(world))
        groups = [(dist.new_group(everyone, backend="gloo"), dist.new_group(everyone, backend="gloo"))
                  if world > 1 else (None, None) for _ in shards]
        _make_sigterm_check_local(trainer)
        if not any(isinstance(c, _ServerModelFirst) for c in trainer.callbacks):
            # First in the list, so every other callback's on_train_end sees the server's model.
            trainer.callbacks.insert(0, _ServerModelFirst())
        restored = self._restored_ps
        num_lrs = len(optimizer.param_groups)
        for j, idx in enumerate(shards):
            if j != self.global_rank:
                continue
            init = [restored["params"][i] if restored else params[i] for i in idx]
            make_optimizer, lr_groups = shard_optimizer(optimizer, params, idx)
            shard = ShardState(init, make_optimizer, lr_groups, num_workers=world, max_staleness=self.max_staleness,
                               staleness_scaling=self.staleness_scaling,
                               version=int(restored["versions"].get(j, restored["version"])) if restored else 0)
            if restored:
                shard.load(idx, restored["params"], restored["optimizer"])
            thread = ServerThread(shard, request_group=groups[j][0], reply_group=groups[j][1], rank=self.global_rank,
                                  world_size=world, num_lrs=num_lrs, ledger=self.ledger, name=f"gradsync-ps{j}")
            thread.start()
            self.servers[j] = thread
        self.client = PSClient(params, shards, list(range(len(shards))), groups, self.servers,
                               rank=self.global_rank, num_lrs=num_lrs, timeout=self.timeout_seconds,
                               ledger=self.ledger)
        self._need_pull = True
        self._restored_ps = None

    def _stop(self) -> None:
        if self.client is None:
            return
        client, self.client = self.client, None
        try:
            client.stop()
        finally:
            for thread in self.servers.values():
                thread.join(timeout=self.timeout_seconds)
        self._final_stats = self._local_stats()

    def teardown(self) -> None:
        # After an error the servers are daemon threads; they end with the process.
        self.client = None
        super().teardown()

    # ---- the training loop -------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.client is not None and self._need_pull:
            t0 = time.perf_counter()
            self._call(self.client.pull, what="pull")
            waited = time.perf_counter() - t0
            self.clock.pulled(waited)
            self.ledger.add_seconds(waited)  # transfer and any wait the staleness bound imposes (the ledger locks)
            self._need_pull = False
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.client is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        try:
            result = closure()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
            weight = 1.0
            if self._weighted:
                # backward saw sum(weight x mean loss) / K: push the sum, and its weight
                weight = self._weight_sum
                grads = [g * self.accumulation_steps for g in grads]
            skip = False
            if self.nonfinite_grads != "off" and not all(bool(torch.isfinite(g).all()) for g in grads):
                step = self.lightning_module.trainer.global_step
                if self.nonfinite_grads == "stop":
                    raise GradsyncError(f"non-finite gradient (NaN/Inf) at optimizer step {step} on rank "
                                        f"{self.global_rank}; stopping ({spell('nonfinite_grads', 'skip')} would drop it)")
                skip = True
                self.skipped_steps.append(step)
            t0 = time.perf_counter()
            lrs = [g["lr"] for g in optimizer.param_groups]
            self._call(self.client.push, grads, what="push", weight=weight, lrs=lrs, skip=skip)
            self.ledger.add_seconds(time.perf_counter() - t0)
            self.ledger.add_logical(fp32_allreduce_bytes(sum(p.numel() for p in self._params), self.world_size))
            optimizer.zero_grad()
            # The step happened on the server: tell torch's LR schedulers, which otherwise warn that
            # the scheduler stepped before the optimizer ever did.
            mark_optimizer_stepped(optimizer)
            self.clock.pushed(time.perf_counter() - t0)
            self._need_pull = True
            return result
        finally:
            self._weight_sum, self._weighted = 0.0, False

    def _call(self, fn: Callable, *args: Any, what: str = "", **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ServerError as exc:
            raise GradsyncError(str(exc)) from exc
        except (RuntimeError, TimeoutError) as exc:  # gloo: a peer closed its connection or stopped answering
            raise GradsyncError(lost_report(what or getattr(fn, "__name__", "request"), exc, rank=self.global_rank,
                                             world_size=self.world_size, servers=self.servers)) from exc

    def _read_server(self) -> None:
        """Wait for every worker, then take the server's parameters (same on every rank)."""
        if self.client is None:
            return
        if self.world_size > 1:
            self._call(self.barrier, "async_ps_read", what="the barrier before reading the server")
        self._call(self.client.read, what="read")
        self._need_pull = True

    def on_validation_start(self) -> None:
        self._read_server()
        super().on_validation_start()

    def finish(self) -> None:
        """End of fit: every rank takes the server's final parameters, then the servers stop."""
        self._read_server()
        self._stop()

    def on_train_end(self) -> None:
        self.finish()  # already done by _ServerModelFirst unless the callback was removed
        super().on_train_end()

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self.client is not None:
            self._read_server()
            # Lightning took the state_dict before this call; the server's parameters are the model.
            checkpoint["state_dict"] = self.lightning_module_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    # ---- algorithm state ---------------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        state = super().algorithm_state_dict()
        state["worker_stats"] = {"steps": self.clock.steps}
        state["shards"] = {}
        for j, thread in self.servers.items():
            with thread.lock:
                indices = self._shard_indices[j]
                state["shards"][j] = {"indices": indices, **thread.shard.state_dict(indices)}
        return state

    def _apply_restored_state(self) -> None:
        saved = self._restored_algorithm_state
        if not saved:
            return
        parts = saved.all()  # every shard's server state, whichever rank hosted it
        merged, shard_count = merge_saved_shards(parts)
        if merged is not None:
            self._restored_ps = merged
        same = len(parts) == self.world_size and shard_count == self.num_servers
        if not same:
            if merged is not None:
                merged["versions"] = {}  # a new sharding continues from the newest shard's count
            self.reshard_note = (f"async_ps: checkpoint was written by {len(parts)} processes with {shard_count} "
                                 f"server shard(s), this run has {self.world_size} with {self.num_servers}; kept the "
                                 "server parameters, optimizer state and update count, re-sharded them")
            if self.global_rank == 0:
                warnings.warn(self.reshard_note, stacklevel=2)
        own = parts[self.global_rank] if len(parts) == self.world_size else {"ledger": parts[0].get("ledger", {})}
        self.load_algorithm_state_dict(own)

    # ---- reporting ---------------------------------------------------------------------------------
    def _local_stats(self) -> dict:
        return {"rank": self.global_rank, "worker": self.clock.summary(), "shards": shard_stats(self.servers)}

    def run_stats(self) -> dict:
        """Staleness distribution, server counters and each worker's step rate (collective)."""
        local = self._final_stats or self._local_stats()
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            parts: list = [None] * self.world_size
            dist.all_gather_object(parts, local)
        else:
            parts = [local]
        return summarize(parts, max_staleness=self.max_staleness, num_servers=self.num_servers,
                         staleness_scaling=self.staleness_scaling)
