"""The one owner of the optimizer-step count, and everything derived from it.

Warm-up, the position in the period and the fragment schedule of streaming DiLoCo all follow from
``num_steps``; a DDP hook that must know whether a step is a warm-up step reads the same object,
and the count is checkpointed (a counter that restarts at 0 on resume, as in pytorch#74556, would
silently re-run the warm-up and shift every round).

The schedule of F fragments over a period H: fragment k is sent after local step s when
``s % (H/F) == 0`` and ``(s % H) // (H/F) == k`` (offset k·H/F), and lands ``sync_delay`` T local
steps later; T < H/F, so a fragment lands before the next one is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gradsync.errors import check, spell


def _is_int(x: object, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


@dataclass
class Schedule:
    """Optimizer steps of a periodic algorithm: ``warmup_steps`` synchronous ones, then rounds every
    ``period`` local steps, fragment by fragment."""

    period: int = 1
    warmup_steps: int = 0
    fragments: int = 1
    sync_delay: int = 0
    #: optimizer steps taken (checkpointed)
    num_steps: int = 0

    def __post_init__(self) -> None:
        check(_is_int(self.period, 1), "period", self.period,
              "must be an integer >= 1 (optimizer steps between averaging rounds)", f"e.g. {spell('period', 8)}")
        check(_is_int(self.warmup_steps, 0), "warmup_steps", self.warmup_steps, "must be an integer >= 0",
              "0 disables the synchronous warm-up")
        f, t = self.fragments, self.sync_delay
        check(_is_int(f, 1), "fragments", f, "must be an integer >= 1 (1: the whole model every round)",
              f"e.g. {spell('fragments', 4)}")
        check(self.period % f == 0, "fragments", f, f"must divide {spell('period', self.period)} (fragment k "
              f"syncs at offset k*period/fragments)", f"e.g. {spell('period', self.period - self.period % f or f)}")
        check(_is_int(t, 0), "sync_delay", t, "must be an integer >= 0 (0: blocking)", f"e.g. {spell('sync_delay', 2)}")
        check(t < self.period // f, "sync_delay", t,
              f"must be < period/fragments = {self.period // f} (a fragment must land before the next one is sent)",
              f"use {spell('sync_delay', self.period // f - 1)} or fewer fragments")

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step is a synchronous warm-up step."""
        return self.num_steps < self.warmup_steps

    @property
    def local_steps(self) -> int:
        """Local steps taken after the warm-up."""
        return max(0, self.num_steps - self.warmup_steps)

    @property
    def steps_in_period(self) -> int:
        """Local steps since the last round of the whole model (0 right after one, and in warm-up)."""
        return 0 if self.in_warmup else self.local_steps % self.period

    @property
    def every(self) -> int:
        """Local steps between two fragments' rounds."""
        return self.period // self.fragments

    def fragment_offset(self, k: int) -> int:
        """Local step (mod period) at which fragment ``k`` is sent."""
        return k * self.every

    def due_fragment(self, s: int) -> Optional[int]:
        """The fragment sent after local step ``s`` (> 0), or None."""
        if s <= 0 or s % self.every:
            return None
        return (s % self.period) // self.every

    def lands(self, issued_at: int, s: int) -> bool:
        """Whether a fragment sent after local step ``issued_at`` is applied after local step ``s``."""
        return s >= issued_at + self.sync_delay
