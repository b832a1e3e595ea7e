"""The DDP bucket adapter: the only code in gradsync that knows DDP's ``GradBucket``.

A DDP communication hook is ``hook(state, bucket) -> Future[Tensor]`` (torch's
``ddp_comm_hooks``). :func:`reducer_hook` turns any :class:`~gradsync.comm.reducer.Reducer` into
one: it cuts the bucket's flat buffer into one view per parameter, in the model's own order,
names each by its parameter name, asks the reducer for the mean, and writes the mean back into the
bucket when it arrives. It returns at once, so compression and the later hops of a multi-hop codec
overlap the rest of backward.

Parameters are presented in *canonical* (model) order, not bucket order: DDP's first iteration
uses buckets in the reverse of registration order and then rebuilds them in the order gradients
became ready (and does so again after every resume, since the DDP wrapper is new); chunk scales,
shards and random draws then do not depend on that order, and a resumed run compresses exactly
like the uninterrupted one.

Also here: the plain all-reduce hooks (one fp32 all-reduce per bucket, recorded in the ledger), the
hook of local steps (no communication at all), and :func:`record_builtin_allreduce`, which books
what DDP's own C++ all-reduce moved when no hook is installed (``sync``'s path: it costs what stock
DDP costs).

Use a reducer directly on a plain DDP model::

    reducer = build_reducer("int8", ledger=CommLedger(world_size=dist.get_world_size()))
    ddp_model.register_comm_hook(ReducerHookState(reducer).bind(model.named_parameters()), reducer_hook)
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at runtime.
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from gradsync.comm.futures import completed
from gradsync.comm.ledger import CommLedger, fp32_allreduce_bytes
from gradsync.comm.reducer import Reducer


@dataclass
class BucketLayout:
    """A bucket's parameters in the model's own order, with where each sits in the bucket buffer."""

    keys: list  # (name, numel), canonical order
    offsets: list  # offset of each in the bucket buffer
    shapes: list

    def views(self, buffer: torch.Tensor) -> list:
        """One view of the buffer per parameter, shaped like it, in canonical order."""
        return [buffer[o:o + n].view(s) for o, (_, n), s in zip(self.offsets, self.keys, self.shapes)]

    def gather(self, buffer: torch.Tensor) -> torch.Tensor:
        """The buffer's entries in canonical order, as a new float32 vector."""
        parts = [buffer[o:o + n] for o, (_, n) in zip(self.offsets, self.keys)]
        return torch.cat(parts).to(torch.float32) if parts else buffer.new_zeros(0, dtype=torch.float32)

    def scatter(self, flat: torch.Tensor, buffer: torch.Tensor) -> None:
        """Write a canonical-order vector back into the bucket buffer."""
        pos = 0
        for o, (_, n) in zip(self.offsets, self.keys):
            buffer[o:o + n].copy_(flat[pos:pos + n])
            pos += n


def name_parameters(named_parameters: Iterable) -> dict:
    """id(parameter) -> (position, name), the canonical order of :func:`bucket_layout`."""
    return {id(p): (i, name) for i, (name, p) in enumerate(named_parameters)}


def bucket_layout(bucket: dist.GradBucket, param_names: dict) -> BucketLayout:
    """The bucket's parameters in canonical (model) order; unnamed ones keep bucket order, last."""
    entries, offset = [], 0
    for i, p in enumerate(bucket.parameters()):
        order, name = param_names.get(id(p), ((1 << 40) + i, f"bucket{bucket.index()}.{i}"))
        entries.append((order, name, p.numel(), offset, p.shape))
        offset += p.numel()
    entries.sort(key=lambda e: e[0])
    return BucketLayout(keys=[(e[1], e[2]) for e in entries], offsets=[e[3] for e in entries],
                        shapes=[e[4] for e in entries])


def reduce_bucket(reducer: Reducer, bucket: dist.GradBucket, param_names: dict, *,
                  sync: Optional[object] = None) -> torch.futures.Future:
    """Average ``bucket`` through ``reducer`` without blocking; a Future of the bucket buffer.

    Adds the bucket's fp32 all-reduce to the ledger's logical bytes (what sync DDP would send).
    """
    buffer = bucket.buffer()
    reducer.ledger.add_logical(fp32_allreduce_bytes(buffer.numel(), reducer.world_size()),
                               scope=reducer.logical_scope)
    layout = bucket_layout(bucket, param_names)
    views = layout.views(buffer)
    fut = reducer.reduce(views, names=[name for name, _ in layout.keys], sync=sync)

    def write_back(f: torch.futures.Future) -> torch.Tensor:
        for view, mean in zip(views, f.value()):
            view.copy_(mean)
        return buffer

    return fut.then(write_back)


@dataclass
class ReducerHookState:
    """State of :func:`reducer_hook`: the reducer, the parameters' names, the step count, the warm-up."""

    reducer: Reducer
    param_names: dict = field(default_factory=dict, repr=False)
    #: Optimizer steps whose gradients went through this hook, counted by the hook itself (the last
    #: bucket of a step counts it) when no ``steps`` owner is given.
    num_steps: int = 0
    #: Reducer of the first ``warmup_steps`` steps (e.g. exact fp32 before PowerSGD starts).
    warmup: Optional[Reducer] = None
    warmup_steps: int = 0
    #: The owner of the step count (an object with ``num_steps``, e.g. a
    #: :class:`gradsync.algorithms.Schedule` that the optimizer step advances): the hook only reads it.
    steps: Any = field(default=None, repr=False)

    def bind(self, named_parameters: Iterable) -> "ReducerHookState":
        """Name the model's parameters so per-name state survives bucket rebuilds and resume."""
        self.param_names = name_parameters(named_parameters)
        return self


def reducer_hook(state: ReducerHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average each gradient bucket through ``state.reducer`` (all buckets of a step are one sync).

    During the first ``state.warmup_steps`` optimizer steps, through ``state.warmup`` instead.
    """
    warmup = getattr(state, "warmup", None)
    owner = getattr(state, "steps", None)
    step = state.num_steps if owner is None else owner.num_steps
    in_warmup = warmup is not None and step < getattr(state, "warmup_steps", 0)
    reducer = warmup if in_warmup else state.reducer
    fut = reduce_bucket(reducer, bucket, state.param_names, sync=("step", step))
    if bucket.is_last() and owner is None:
        # DDP launches buckets in index order, so this is the step's final bucket.
        state.num_steps += 1
    return fut


@dataclass
class WholeStepState:
    """State of :func:`whole_step_hook`: the reducer, the parameters' names, the step count's owner."""

    reducer: Reducer
    param_names: dict = field(default_factory=dict, repr=False)
    #: the owner of the step count (an object with ``num_steps``), read for the ledger's sync id
    steps: Any = field(default=None, repr=False)
    #: True while this process joins the others' step behind them (a replica group healing into it)
    behind: Any = field(default=None, repr=False)
    #: lay the message out in the model's order rather than DDP's: what a codec compresses then does not
    #: depend on DDP's bucket rebuild (a codec's chunks and rounding depend on where an entry sits), and
    #: it matches the per-bucket hook's layout of a model DDP holds in one bucket
    canonical: bool = False
    #: names of the parameters in the order their gradients became ready in this backward
    ready: list = field(default_factory=list, repr=False)
    #: backwards whose gradients this hook averaged (DDP rebuilds its buckets after the first)
    backwards: int = 0
    #: the buckets of this step that wait for its last one
    pending: list = field(default_factory=list, repr=False)

    def bind(self, named_parameters: Iterable) -> "WholeStepState":
        named_parameters = list(named_parameters)
        self.param_names = name_parameters(named_parameters)
        for name, p in named_parameters:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _, name=name: self.ready.append(name))
        return self


def whole_step_hook(state: WholeStepState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a step's gradients through ``state.reducer`` in one reduction, once the last bucket is ready.

    The message is the buckets' buffers in DDP's order (in the model's with ``state.canonical``), which is
    the order of DDP's own all-reduce:
    averaged over one bucket's worth of processes, the result is DDP's to the bit. DDP lays its
    buckets out in the model's order for the first backward of a process and in the order the
    gradients became ready in it ever after; a process whose first backward joins others past theirs
    (``state.behind()``: a replica group healing into the others' step) lays its message out in that
    ready order, so that every process reads back the same entries.
    """
    fut: torch.futures.Future = torch.futures.Future()
    state.pending.append((bucket.buffer(), bucket_layout(bucket, state.param_names), fut))
    if not bucket.is_last():
        return fut
    waiting, state.pending = state.pending, []
    state.backwards += 1
    if state.canonical:  # the model's order (unnamed parameters last, in DDP's)
        position = {name: i for i, name in state.param_names.values()}

        def key(b: int, name: str, offset: int) -> Any:
            return position.get(name, 1 << 40), b, offset
    elif state.behind is not None and state.behind():  # the order of this backward's ready gradients
        ready = {name: i for i, name in enumerate(state.ready)}

        def key(b: int, name: str, offset: int) -> Any:
            return ready[name]
    else:  # DDP's
        def key(b: int, name: str, offset: int) -> Any:
            return b, offset
    entries = sorted(((key(b, name, offset), name, view)
                      for b, (buffer, layout, _) in enumerate(waiting)
                      for (name, _), offset, view in zip(layout.keys, layout.offsets, layout.views(buffer))),
                     key=lambda e: e[0])
    step = state.steps.num_steps if state.steps is not None else 0
    reducer = state.reducer
    reducer.ledger.add_logical(fp32_allreduce_bytes(sum(e[2].numel() for e in entries), reducer.world_size()),
                               scope=reducer.logical_scope)
    done = reducer.reduce([e[2] for e in entries], names=[e[1] for e in entries], sync=("step", step))
    for (_, _, view), mean in zip(entries, done.wait()):
        view.copy_(mean)
    for buffer, _, bucket_done in waiting:
        bucket_done.set_result(buffer)
    return fut


# ---- the hooks of sync and of local steps ---------------------------------------------------------
@dataclass
class AllReduceState:
    """State of :func:`allreduce_hook`: where to record bytes and which group to use."""

    ledger: CommLedger
    group: Optional[dist.ProcessGroup] = None
    scope: str = "world"
    num_steps: int = 0
    #: Add what fp32 sync would send to the ledger's logical bytes (off for the intra-node
    #: all-reduce of node-scoped local steps: their optimizer step accounts the whole job's).
    logical: bool = True


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket across ranks with one all-reduce, and record it in the ledger.

    Numerically the same as DDP's built-in reduction (divide by N, then sum).
    """
    bucket.buffer().div_(dist.get_world_size(state.group))
    return allreduce_sum_hook(state, bucket)


def allreduce_sum_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum a gradient bucket across ranks with one all-reduce, and record it in the ledger.

    For gradients that already carry the 1/N of the mean (``sync`` divides the loss by N before
    backward): this saves the hook's pass over the bucket that :func:`allreduce_hook` spends on
    dividing — the pass DDP's built-in reduction fuses into its copy into the bucket.
    """
    tensor = bucket.buffer()
    if getattr(state, "logical", True):
        state.ledger.add_logical(fp32_allreduce_bytes(tensor.numel(), dist.get_world_size(state.group)),
                                 scope=state.scope)
    fut = state.ledger.all_reduce(tensor, group=state.group, async_op=True, scope=state.scope,
                                  sync=("step", state.num_steps))
    if bucket.is_last():
        state.num_steps += 1
    return fut


def record_builtin_allreduce(ledger: CommLedger, model: torch.nn.parallel.DistributedDataParallel,
                             step: int) -> None:
    """Book one synchronized backward of a DDP model without a comm hook: the fp32 all-reduce of every
    gradient DDP reduces, as one collective with sync id ``("step", step)`` (DDP cuts it into buckets,
    which it rebuilds after the first step and does not report; the bytes are the same), and the same
    logical bytes. Its time runs inside DDP's reducer, overlapped with backward, and is not measured."""
    world = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    ledger.add_logical(fp32_allreduce_bytes(sum(p.numel() for p in params), world))
    ledger.record("all_reduce", sum(p.numel() * p.element_size() for p in params), group_size=world,
                  sync=("step", step))


def local_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Keep the local gradient: DDP copies the bucket back into the gradients, nothing is sent."""
    return completed(bucket.buffer())
