"""Reductions that never block the caller: generators of collectives, driven by future callbacks.

A reducer writes its algorithm as straight-line code that ``yield``s the Future of each
collective it issues and receives that collective's result back::

    def run(self, x):
        recv = yield ledger.all_to_all_single(out, send, group=g, async_op=True)
        ...
        gathered = yield ledger.all_gather_single(buf, mine, group=g, async_op=True)
        return decoded

:func:`drive` runs such a generator: it resumes it from the completion callback of each yielded
Future (``Future.then``, the way torch's PowerSGD hook chains its two all-reduces), so the
thread that started the reduction returns at once and encoding, decoding and the later hops run
while it goes on (with backward, or with inner steps). On NCCL a collective's Future completes as
soon as it is enqueued on its stream, so the whole chain is enqueued immediately; on gloo the
callbacks run on gloo's worker threads when each hop has arrived.

Collectives on one process group must be issued in the same order on every rank. Chains whose
hops are issued from callback threads could interleave differently on different ranks, so every
reduction on a group goes through that group's :class:`Sequencer`: reductions start one after
another, each once the one before it has finished. Gradsync issues these on process groups of its
own (see :mod:`gradsync.comm.topology`), so no other collective — Lightning's, or the caller's —
can slip in between.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generator, Optional

import torch

Reduction = Generator[torch.futures.Future, Any, Any]


def new_future(device: Optional[torch.device] = None) -> torch.futures.Future:
    """A Future that (on CUDA) records and waits for stream events, so consumers see finished work."""
    if device is not None and device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def completed(value: Any, device: Optional[torch.device] = None) -> torch.futures.Future:
    fut = new_future(device)
    fut.set_result(value)
    return fut


def drive(reduction: Reduction, result: torch.futures.Future) -> torch.futures.Future:
    """Run ``reduction`` to its end without blocking; its return value (or error) completes ``result``."""
    _Driver(reduction, result).step(None)
    return result


class _Driver:
    """Resumes a reduction from its collectives' callbacks. An object rather than two closures that
    call each other: such closures form a reference cycle with the finished reduction's result (the
    means: as large as what was reduced), which only Python's cyclic collector would free — the
    resident memory of a 60M-parameter sharded run grew by 120 MB a step between its passes. The
    driver lets go of the generator and the result when the reduction ends."""

    __slots__ = ("reduction", "result", "__weakref__")

    def __init__(self, reduction: Reduction, result: torch.futures.Future) -> None:
        self.reduction: Optional[Reduction] = reduction
        self.result: Optional[torch.futures.Future] = result

    def step(self, value: Any, error: Optional[BaseException] = None) -> None:
        reduction, result = self.reduction, self.result
        assert reduction is not None and result is not None
        try:
            while True:
                fut = reduction.throw(error) if error is not None else reduction.send(value)
                error = None
                if fut.done():  # NCCL (enqueued), or already finished: no need to wait for a callback
                    try:
                        value = fut.wait()
                    except BaseException as exc:  # noqa: BLE001 - handed to the generator
                        error = exc
                    continue
                fut.then(self.resume)
                return
        except StopIteration as stop:
            self.reduction = self.result = None
            result.set_result(stop.value)
        except BaseException as exc:  # noqa: BLE001 - the caller sees it when it waits
            self.reduction = self.result = None
            result.set_exception(exc)

    def resume(self, fut: torch.futures.Future) -> None:
        try:
            value = fut.wait()
        except BaseException as exc:  # noqa: BLE001
            self.step(None, exc)
            return
        self.step(value)


class Sequencer:
    """Runs the reductions of one process group one after another, in submission order.

    Every rank submits the same reductions in the same order (DDP's bucket order, the strategy's
    round schedule), so every rank issues the same collectives in the same order, whichever
    thread issues them. :meth:`submit` never blocks.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tail: torch.futures.Future = completed(None)
        self.submitted = 0

    def submit(self, make: Callable[[], Reduction], device: Optional[torch.device] = None) -> torch.futures.Future:
        """Start ``make()`` once every earlier reduction has finished; a Future of its return value."""
        result = new_future(device)
        with self._lock:
            previous, self._tail = self._tail, result
            self.submitted += 1

        def start(_: torch.futures.Future) -> None:
            try:
                reduction = make()
            except BaseException as exc:  # noqa: BLE001
                result.set_exception(exc)
                return
            drive(reduction, result)

        previous.then(start)  # runs at once when the group is idle
        return result

    def idle(self) -> bool:
        return self._tail.done()

    def wait(self) -> None:
        """Block until every submitted reduction has finished (errors stay with their own Futures)."""
        tail = self._tail
        try:
            tail.wait()
        except BaseException:  # noqa: BLE001 - reported to whoever waits on that reduction
            pass
