"""A finished reduction lets go of its buffers at once, not when Python's cyclic collector runs."""

import gc
import weakref

import torch

from gradsync.comm.futures import Sequencer, completed


def _reduction(x):
    # the shape of every reducer's run(): yield collective Futures, receive their results, return the means
    y = yield completed(x * 2)
    z = yield _later(y + 1)
    return [z]


def _nothing():
    return None
    yield  # a generator that ends at once


_pending: list = []


def _later(value):
    """A Future completed later (as gloo completes a collective on its own thread)."""
    fut = torch.futures.Future()
    _pending.append((fut, value))
    return fut


def test_a_finished_reduction_holds_no_reference_cycle():
    gc.disable()
    try:
        seq = Sequencer()
        first = seq.submit(lambda: _reduction(torch.ones(1000)))
        fut, value = _pending.pop()
        fut.set_result(value)  # the callback resumes the reduction to its end
        (mean,) = first.wait()
        assert torch.equal(mean, torch.full((1000,), 3.0))
        ref = weakref.ref(mean)
        del mean, first, fut, value
        second = seq.submit(_nothing)  # the sequencer's tail moves on
        second.wait()
        assert ref() is None, "the finished reduction's result is kept alive by a reference cycle"
    finally:
        gc.enable()
