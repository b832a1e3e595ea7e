"""``gradsync.comm``: how bytes move. Pure torch, no Lightning.

* :mod:`~gradsync.comm.ledger` — what every collective costs on the wire, by scope and purpose;
* :mod:`~gradsync.comm.reducer` and :mod:`~gradsync.comm.codecs` — the mean of a list of tensors
  across a process group, one reducer per codec (fp32, fp16, bf16, int8, int4, sign, top-k,
  PowerSGD, SparseLoCo's chunked 2-bit top-k), each returning a Future and never blocking its caller;
* :mod:`~gradsync.comm.error_feedback` — error feedback as a wrapper around any lossy reducer;
* :mod:`~gradsync.comm.ddp` — the DDP bucket adapter, the only code that knows ``GradBucket``;
* :mod:`~gradsync.comm.topology` — the world, intra-node and inter-node process groups;
* :mod:`~gradsync.comm.hierarchical` — the node-scoped mean: fp32 inside a node, the codec between nodes.

Strategies (:mod:`gradsync.strategies`) decide *when* to communicate; this package decides *how*.
A codec is written once and serves DDP buckets, DiLoCo pseudo-gradients, local-SGD parameters and
node-scoped rounds alike::

    reducer = build_reducer("int8", ledger=ledger, group=group, error_feedback=True)
    means = reducer.reduce(tensors, names=names).wait()
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Optional

import torch.distributed as dist

from gradsync.comm.codecs import (
    Bf16Reducer, Fp16Reducer, Int4Reducer, Int8Reducer, PowerSGDReducer, SignReducer, SparseLoCoReducer,
    TopKReducer,
)
from gradsync.comm.error_feedback import ErrorFeedback
from gradsync.comm.ledger import CommLedger, fp32_allreduce_bytes, wire_bytes
from gradsync.comm.reducer import IdentityReducer, Reducer
from gradsync.errors import check, spell

#: Codec name -> reducer class. ``--strategy.codec NAME`` chooses one.
REDUCERS: dict[str, type[Reducer]] = {
    "identity": IdentityReducer,
    "fp16": Fp16Reducer,
    "bf16": Bf16Reducer,
    "int8": Int8Reducer,
    "int4": Int4Reducer,
    "sign": SignReducer,
    "topk": TopKReducer,
    "powersgd": PowerSGDReducer,
    "sparseloco": SparseLoCoReducer,
}

#: The codec names as a type: every strategy's ``codec`` option (the CLI's choices come from it).
#: The same names as :data:`REDUCERS` (a test holds them equal).
Codec = Literal["identity", "fp16", "bf16", "int8", "int4", "sign", "topk", "powersgd", "sparseloco"]

#: Codec options: name -> (default, the codecs that read it). Strategies take these as
#: ``--strategy.<option>`` and refuse one the chosen codec does not read.
CODEC_OPTIONS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "chunk_size": (512, ("int8", "int4", "sign")),
    "fraction": (0.01, ("topk",)),
    "rank": (4, ("powersgd",)),
    "warm_start": (True, ("powersgd",)),
    "seed": (0, ("int8", "int4", "powersgd")),
    "sparse_chunk_size": (4096, ("sparseloco",)),
    "sparse_k": (64, ("sparseloco",)),
    "value_bits": (2, ("sparseloco",)),
    "error_decay": (1.0, ("sparseloco",)),
}

#: Options read by the error-feedback wrapper, not by the codec's reducer.
FEEDBACK_OPTIONS: tuple[str, ...] = ("error_decay",)

LOSSY: tuple[str, ...] = tuple(name for name, cls in REDUCERS.items() if cls.lossy)


def check_codec_options(codec: str, given: dict[str, Any], *, flag: str = "--strategy") -> None:
    """Refuse an unknown codec, or an option given a non-default value that ``codec`` does not read."""
    check(codec in REDUCERS, "codec", codec, f"must be one of {', '.join(REDUCERS)}", f"e.g. {flag}.codec int8")
    for option, value in given.items():
        default, users = CODEC_OPTIONS[option]
        check(value == default or codec in users, option, value,
              f"is not used by codec {codec} (only by {', '.join(users)})",
              f"drop {flag}.{option} or choose {flag}.codec {users[0]}")


def build_reducer(codec: str, *, ledger: Optional[CommLedger] = None, group: Optional[dist.ProcessGroup] = None,
                  scope: str = "world", error_feedback: bool = False,
                  wrap: Optional[Callable[[Reducer], Reducer]] = None, **options: Any) -> Reducer:
    """The reducer of ``codec`` (options it does not read are ignored), wrapped in error feedback on request.

    ``error_feedback`` applies to lossy codecs only; for ``sign`` it also turns on the reducer-side
    residual of its second hop. ``wrap`` goes around the codec itself, inside error feedback.
    """
    check(codec in REDUCERS, "codec", codec, f"must be one of {', '.join(REDUCERS)}", "e.g. --strategy.codec int8")
    cls = REDUCERS[codec]
    kwargs = {k: v for k, v in options.items() if k in CODEC_OPTIONS and codec in CODEC_OPTIONS[k][1]}
    feedback = {k: kwargs.pop(k) for k in FEEDBACK_OPTIONS if k in kwargs}
    if codec == "sign":
        kwargs["reducer_feedback"] = bool(error_feedback)
    reducer = cls(ledger=ledger, group=group, scope=scope, **kwargs)
    if wrap is not None:
        reducer = wrap(reducer)
    decay = feedback.get("error_decay", 1.0)
    check(isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0 < decay <= 1, "error_decay", decay,
          "must be in (0, 1] (the residual is multiplied by it before each reduction)",
          "e.g. --strategy.error_decay 1 keeps the whole residual")
    check(decay == 1 or error_feedback, "error_decay", decay, "needs error feedback, which is off",
          "drop --strategy.error_decay or set --strategy.error_feedback true")
    if error_feedback and cls.lossy:
        return ErrorFeedback(reducer, decay=decay)
    return reducer


@dataclass(frozen=True)
class CodecSpec:
    """A codec with its options and its error feedback: what a strategy's codec arguments mean, once.

    ``options`` holds every :data:`CODEC_OPTIONS` entry (the given value or the default); the codec
    reads its own and ignores the rest. :meth:`parse` validates (one line naming the option),
    :meth:`build` makes the reducer, :meth:`signature` says what its checkpointed state belongs to."""

    name: str
    error_feedback: bool
    options: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, name: str, given: dict[str, Any], error_feedback: Optional[bool], *,
              feedback_by_default: Optional[tuple[str, ...]] = LOSSY) -> "CodecSpec":
        """Validate ``name`` with the options ``given``; error feedback defaults to on for the codecs
        in ``feedback_by_default`` (None: the biased ones) and must not be asked of an exact codec."""
        check_codec_options(name, given)
        if feedback_by_default is None:
            feedback_by_default = tuple(n for n, c in REDUCERS.items() if c.biased)
        check(not (error_feedback and name not in LOSSY), "error_feedback", error_feedback,
              f"is not used by codec {name} (it is exact)", f"drop {spell('error_feedback')} or choose a lossy codec")
        feedback = (name in feedback_by_default) if error_feedback is None else bool(error_feedback)
        spec = cls(name, feedback, {**{k: default for k, (default, _) in CODEC_OPTIONS.items()}, **given})
        spec.build()  # the codec's own checks (chunk sizes, bits, decay), now rather than at the first step
        return spec

    def with_options(self, **options: Any) -> "CodecSpec":
        return replace(self, options={**self.options, **options})

    def build(self, *, ledger: Optional[CommLedger] = None, group: Optional[dist.ProcessGroup] = None,
              scope: str = "world", wrap: Optional[Callable[[Reducer], Reducer]] = None) -> Reducer:
        return build_reducer(self.name, ledger=ledger, group=group, scope=scope, error_feedback=self.error_feedback,
                             wrap=wrap, **self.options)

    def signature(self) -> dict:
        """The codec, error feedback and the options it reads: what its state in a checkpoint belongs to."""
        read = {k: v for k, v in self.options.items() if self.name in CODEC_OPTIONS[k][1]}
        return {"name": self.name, "error_feedback": self.error_feedback, **read}

    # ---- the codec's traits (see Reducer) ----------------------------------------------------------
    @property
    def traits(self) -> type[Reducer]:
        """The codec's reducer class, whose class attributes are its traits (``spec.traits.masks_sent``)."""
        return REDUCERS[self.name]

    @property
    def lossy(self) -> bool:
        return self.traits.lossy

    def keeps_memory(self) -> bool:
        return self.traits.keeps_memory(self.error_feedback, self.options)

    @staticmethod
    def having(trait: str) -> tuple[str, ...]:
        """The codecs with ``trait`` set, for messages that list them."""
        return tuple(name for name, cls in REDUCERS.items() if getattr(cls, trait))

    def state_names(self) -> list[str]:
        """What a resume on another world size resets of this codec's state, in words."""
        return self.build().runtime_state_names()


__all__ = ["CODEC_OPTIONS", "LOSSY", "REDUCERS", "Codec", "CodecSpec", "CommLedger", "ErrorFeedback", "Reducer",
           "build_reducer", "check_codec_options", "fp32_allreduce_bytes", "wire_bytes"]
