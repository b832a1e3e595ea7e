"""The goodput a fault-tolerant replica group reports online (summary, progress line, W&B): steps it kept ÷ steps
it would have taken in its stepping time at its own failure-free pace (the steps no failure touched)."""

import pytest

from gradsync.comm.managed import Telemetry


def _steps(t, seconds, n=1, kept=True):
    for _ in range(n):
        t.note_step(seconds, kept)


def test_a_run_without_failures_has_goodput_one_even_with_slow_round_steps():
    # every 16th step carries a round ten times as long as a local step: part of the pace, not a loss
    t = Telemetry()
    for i in range(160):
        _steps(t, 1.0 if i % 16 == 15 else 0.1)
    assert t.goodput() == pytest.approx(1.0)
    assert t.summary()["goodput"] == 1.0


def test_a_failure_costs_the_time_of_the_steps_it_touched_and_the_work_of_dropped_ones():
    t = Telemetry()
    _steps(t, 0.1, 100)
    t.failures_seen += 1  # a quorum without the dead group, which waited 5 s for its heartbeat to stop
    _steps(t, 5.1)
    assert t.goodput() == pytest.approx(101 * 0.1 / 15.1)
    # a sync step that a failure left uncommitted: its time was spent, its work is gone
    t.uncommitted += 1
    _steps(t, 0.1, kept=False)
    assert t.goodput() == pytest.approx(101 * 0.1 / 15.2)
    # the steps after it are calm again: they count at the pace
    _steps(t, 0.1, 10)
    assert t.goodput() == pytest.approx(111 * 0.1 / 16.2)


def test_no_figure_before_sixteen_calm_steps():
    t = Telemetry()
    _steps(t, 0.1, 15)
    assert t.goodput() is None and t.summary()["goodput"] is None
    _steps(t, 0.1)
    assert t.goodput() == pytest.approx(1.0)
