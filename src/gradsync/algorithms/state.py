"""The state registry: every piece of algorithm state declared once, with how it survives a resume.

An algorithm registers each piece of its state under a name, with a getter, a setter and a kind:

* ``replicated`` — identical on every rank (a step count, DiLoCo's global parameters and outer
  optimizer, an agreed mean in flight): kept as it is by a resume on any number of processes;
* ``averaged`` — differs per rank, and the mean of the ranks' values is what the next round would
  have made of them (local parameters mid-period): averaged over the saved ranks;
* ``per_rank`` — this rank's own and meaningless to another world size (error-feedback
  residuals, a local optimizer's state, an overlapped round's anchor): reset.

Saving and loading on the same world size is generic (each rank its own part); :meth:`reshard`
maps the parts of another world size with one rule per kind and reports what it kept, averaged
and reset, for the one warning a resume prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch

Kind = Literal["replicated", "averaged", "per_rank"]


@dataclass
class Entry:
    name: str
    kind: Kind
    get: Callable[[], Any]
    set: Callable[[Any], None]
    #: how the warning names it when it is reset (default: its name)
    label: Optional[str] = None


@dataclass
class Resharded:
    """The state mapped onto a new world size, and what happened to each piece."""

    state: dict
    kept: list[str] = field(default_factory=list)
    averaged: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)

    def describe(self, who: str, written_by: str, saved_ranks: int) -> str:
        """The one warning of a resume on another layout, the same sentence for every strategy:
        ``who: <written_by>; kept ...; averaged ... of the N saved ranks; reset ...``."""
        parts = [f"{who}: {written_by}"]
        if self.kept:
            parts.append(f"kept {', '.join(self.kept)}")
        if self.averaged:
            parts.append(f"averaged {', '.join(self.averaged)} of the {saved_ranks} saved ranks")
        if self.reset:
            parts.append(f"reset {', '.join(self.reset)}")
        return "; ".join(parts)


class StateRegistry:
    """Named pieces of state, each replicated, averaged or per rank."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def register(self, name: str, kind: Kind, get: Callable[[], Any], set: Callable[[Any], None], *,
                 label: Optional[str] = None) -> None:
        if name in self.entries:
            raise ValueError(f"algorithm state {name!r} is registered twice")
        if kind not in ("replicated", "averaged", "per_rank"):
            raise ValueError(f"algorithm state {name!r}: kind {kind!r} is not replicated, averaged or per_rank")
        self.entries[name] = Entry(name, kind, get, set, label)

    def state_dict(self) -> dict:
        return {name: e.get() for name, e in self.entries.items()}

    def load_state_dict(self, state: dict) -> None:
        """Set every registered piece the state holds (a piece it lacks keeps its current value)."""
        for name, e in self.entries.items():
            if name in state:
                e.set(state[name])

    def reshard(self, parts: list[dict]) -> Resharded:
        """Map the parts saved by ``len(parts)`` ranks onto this rank of another world size."""
        first = parts[0]
        out = Resharded(state={})
        for name, e in self.entries.items():
            if first.get(name) is None:
                continue
            if e.kind == "replicated":
                out.state[name] = first[name]
                out.kept.append(name)
            elif e.kind == "averaged":
                out.state[name] = mean_of([p[name] for p in parts])
                out.averaged.append(e.label or name)
            else:
                out.reset.append(e.label or name)
        return out


def codec_change(saved: Optional[dict], current: dict) -> Optional[str]:
    """None when codec state saved under the signature ``saved`` (the codec's name and whatever its
    state depends on) may be loaded under ``current``; else the sentence a resume warns with.

    The residuals of one codec are not those of another (int8's are rounding errors, sign's most of
    the signal), so a change of codec, of its options or of what it is sent resets its state."""
    if saved is None or saved == current:
        return None

    def spell(sig: dict) -> str:
        rest = ", ".join(f"{k} {v}" for k, v in sig.items() if k != "name")
        return f"{sig.get('name')}{f' ({rest})' if rest else ''}"

    return f"checkpoint was written with codec {spell(saved)}, this run uses {spell(current)}"


def mean_of(values: list[Any]) -> Any:
    """The element-wise mean of matching structures (floating tensors averaged in float64; other
    tensors and plain values taken from the first)."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not first.is_floating_point():
            return first
        return sum(v.double() for v in values).div(len(values)).to(first.dtype)
    if isinstance(first, dict):  # the keys every value holds (a rank may lack a piece another has)
        return {k: mean_of([v[k] for v in values]) for k in first if all(k in v for v in values)}
    if isinstance(first, (list, tuple)):
        return type(first)(mean_of([v[i] for v in values]) for i in range(len(first)))
    return first
