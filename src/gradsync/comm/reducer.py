"""Reducers: the mean of a list of tensors across a process group, as one codec puts it on the wire.

A :class:`Reducer` is what every strategy uses to move bytes, whatever it moves: the gradient
buckets of a DDP step (:mod:`gradsync.comm.ddp`), DiLoCo's pseudo-gradients, local SGD's
parameters, one fragment of a streaming round. It is written once per codec, in
:mod:`gradsync.comm.codecs`, and :func:`gradsync.comm.build_reducer` makes one by name.

``reducer.reduce(tensors, names=...)`` returns at once with a Future of the means (new tensors,
shaped and typed like the inputs; the inputs are only read, and only once the reduction starts,
so they must stay untouched until the Future completes). ``names`` identify each tensor across
calls: per-tensor state (error-feedback residuals, PowerSGD's Q, the reducer-side residual of
``sign``) is kept per name, so it survives DDP bucket rebuilds, fragments and resumes.

A subclass implements :meth:`Reducer.run`, a generator of collective Futures (see
:mod:`gradsync.comm.futures`) that returns ``(means, sent)``: ``sent`` is what this rank's
contribution decodes to, in the units of its input (``None`` for exact codecs, and unless
:attr:`Reducer.need_sent` asks for it). Error feedback (:mod:`gradsync.comm.error_feedback`) keeps
``input - sent``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from gradsync.comm.futures import Reduction, Sequencer
from gradsync.comm.ledger import CommLedger

_SEQUENCERS: dict = {}


def sequencer_for(group: Optional[dist.ProcessGroup]) -> Sequencer:
    """The one :class:`~gradsync.comm.futures.Sequencer` of ``group`` in this process."""
    key = None if group is None else id(group)
    if key not in _SEQUENCERS:
        _SEQUENCERS[key] = Sequencer()
    return _SEQUENCERS[key]


class Reducer:
    """Base of every codec's reducer: the group, the ledger, the scope, and the non-blocking entry point."""

    #: The codec's name (``--strategy.codec``).
    codec: ClassVar[str] = ""
    #: True when the mean is approximate (error feedback applies).
    lossy: ClassVar[bool] = False
    # ---- traits: what a strategy needs to know of a codec, read through CodecSpec (no name tests) ----
    #: Its messages are biased, so ``compressed`` turns error feedback on by default.
    biased: ClassVar[bool] = False
    #: Coarse enough that error feedback compounds with the optimizer's momentum: ``compressed`` sends
    #: the SGD velocity instead unless ``momentum_correction`` is off (DGC's momentum correction).
    momentum_correctable: ClassVar[bool] = False
    #: Its sparse messages mask the velocity where they were sent (DGC's momentum factor masking).
    masks_sent: ClassVar[bool] = False
    #: Its state follows a change of membership (a healed replica group, a quorum of another size).
    survives_membership_change: ClassVar[bool] = True
    #: Every rank's message is all-gathered and decoded (a round delivers a few entries of each chunk).
    all_gathered: ClassVar[bool] = False
    #: The error-feedback decay of a round (local SGD / DiLoCo) when none is given.
    round_error_decay: ClassVar[float] = 1.0
    #: Options that suit Adam-family optimizers, used where the user gave none.
    adam_options: ClassVar[dict] = {}

    @classmethod
    def keeps_memory(cls, error_feedback: bool, options: dict) -> bool:
        """Whether it carries state across steps that DDP's first, settling steps must not feed."""
        return False

    def __init__(self, *, ledger: Optional[CommLedger] = None, group: Optional[dist.ProcessGroup] = None,
                 scope: str = "world") -> None:
        self.ledger = ledger if ledger is not None else CommLedger()
        self.group = group
        self.scope = scope
        #: The scope whose ``logical_bytes`` (what flat fp32 sync would send) this reducer's work replaces.
        self.logical_scope = scope
        #: Set by a wrapper that needs ``sent`` (error feedback); codecs skip the work otherwise.
        self.need_sent = False

    # ---- the group ------------------------------------------------------------------------------
    @property
    def sequencer(self) -> Sequencer:
        return sequencer_for(self.group)

    def world_size(self) -> int:
        if self.group is not None:  # asked of the group itself: it may be one torch does not register (torchft's)
            return self.group.size()
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def group_rank(self) -> int:
        if self.group is not None:
            return self.group.rank()
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def account(self, sync: Optional[Hashable]) -> dict:
        """Keyword arguments for the ledger's collectives: this reducer's group, scope and sync."""
        return {"group": self.group, "async_op": True, "scope": self.scope, "sync": sync}

    # ---- entry points ---------------------------------------------------------------------------
    def reduce(self, tensors: Sequence[torch.Tensor], *, names: Optional[Sequence[str]] = None,
               sync: Optional[Hashable] = None) -> torch.futures.Future:
        """Start averaging ``tensors`` across the group; a Future of the means, in order.

        ``sync`` groups collectives into one synchronization for the ledger's ``peak_sync_bytes``
        (e.g. all buckets of one optimizer step); by default each call is its own.
        """
        tensors = list(tensors)
        names = [str(i) for i in range(len(tensors))] if names is None else list(names)
        if len(names) != len(tensors):
            raise ValueError(f"reduce: {len(tensors)} tensors but {len(names)} names")
        key = sync if sync is not None else ("reduce", self.sequencer.submitted)
        device = tensors[0].device if tensors else None
        fut = self.sequencer.submit(lambda: self.run(tensors, names, key), device)
        return fut.then(lambda f: f.value()[0])

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        """The reduction itself: yields collective Futures, returns ``(means, sent)``."""
        raise NotImplementedError
        yield  # pragma: no cover - makes this a generator for type checkers

    # ---- runtime state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's runtime state (CPU tensors), to checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    def mark(self) -> Any:
        """A token of the runtime state now, for :meth:`roll_back` (a round that ran but was dropped: a replica
        group failed during it). A wrapper passes it through to its ``inner`` reducer; a reducer with state
        of its own overrides both (:class:`~gradsync.comm.error_feedback.ErrorFeedback`, whose residuals a
        reduction replaces rather than changes, so that the token is a shallow copy)."""
        inner = getattr(self, "inner", None)
        return inner.mark() if isinstance(inner, Reducer) else None

    def roll_back(self, mark: Any) -> None:
        """Return the runtime state to what it was at :meth:`mark`."""
        inner = getattr(self, "inner", None)
        if isinstance(inner, Reducer):
            inner.roll_back(mark)

    def runtime_state_names(self) -> list[str]:
        """Human names of the runtime state, for the warning when a world-size change resets it."""
        return []

    def options(self) -> dict[str, Any]:
        """The codec options this reducer was built with."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


class WrappingReducer(Reducer):
    """A reducer around another (``self.inner``), whose runtime state and options are the inner one's."""

    inner: Reducer

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def runtime_state_names(self) -> list[str]:
        return self.inner.runtime_state_names()

    def options(self) -> dict[str, Any]:
        return self.inner.options()


def unflatten_into(out: list, flat: torch.Tensor, tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
    """``out[i]`` = the view of ``flat`` shaped like ``tensors[i]``, for ``indices`` laid end to end in ``flat``."""
    pos = 0
    for i in indices:
        n = tensors[i].numel()
        out[i] = flat[pos:pos + n].view(tensors[i].shape)
        pos += n


def split_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


class IdentityReducer(Reducer):
    """``identity``: the exact mean, one fp32 (or native-dtype) all-reduce per dtype. Compression ratio 1.

    Sums, then divides by N: every rank divides the same bit pattern, so all hold identical
    results. Bytes: 2(N-1)/N x the tensors' bytes.
    """

    codec = "identity"

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        world = self.world_size()
        groups = split_by_dtype(tensors)
        flats = {dtype: torch.cat([tensors[i].reshape(-1) for i in idx]) for dtype, idx in groups.items()}
        futures = [self.ledger.all_reduce(flat, **self.account(sync)) for flat in flats.values()]
        for fut in futures:
            yield fut
        means: list[Optional[torch.Tensor]] = [None] * len(tensors)
        for (dtype, idx), flat in zip(groups.items(), flats.values()):
            flat.div_(world)
            unflatten_into(means, flat, tensors, idx)
        return means, None
