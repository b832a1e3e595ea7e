"""What a lossy codec across replica groups (:class:`~gradsync.comm.managed.ManagedCodec`) does when a collective
of its round fails: torchft's managed all-reduce semantics. The membership is a stand-in here (the quorum itself
is torchft's, exercised in tests/distributed/test_managed_codec.py); the codec and error feedback are real."""

import torch

from gradsync.comm import CodecSpec
from gradsync.comm.futures import completed
from gradsync.comm.managed import ManagedCodec
from gradsync.comm.reducer import Reducer


class Membership:
    """What ManagedCodec asks of a ReplicaGroup: healing, participants, errors."""

    healing, participants = False, 2

    def __init__(self):
        self.reported = []

    @property
    def errored(self):
        return bool(self.reported)

    def report_error(self, exc):
        self.reported.append(exc)


class PeerDies(Reducer):
    """A codec whose second collective fails, as gloo's does when a peer's socket closes."""

    codec, lossy = "int8", True
    calls = 0

    def run(self, tensors, names, sync):
        PeerDies.calls += 1
        yield completed(None)
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")


def test_a_failed_round_sends_nothing_more_keeps_no_residual_and_is_reported():
    members = Membership()
    reducer = CodecSpec.parse("int8", {}, None).build(wrap=lambda codec: ManagedCodec(PeerDies(), members))
    before = {"w": torch.full((6,), 0.5)}
    reducer.load_state_dict({"residuals": before})
    x = [torch.arange(6, dtype=torch.float32)]
    means = reducer.reduce(x, names=["w"]).wait()
    # its own values back (never applied: the round does not commit), the error reported to the Manager
    assert torch.equal(means[0], x[0] + 0.5) and len(members.reported) == 1
    assert "Connection closed" in str(members.reported[0])
    # (error feedback saw all of it sent: the coordinator rolls the residual back to the mark it took)
    assert torch.equal(reducer.residuals.pieces["w"], torch.zeros(6))
    # the rest of the round issues no collective
    calls = PeerDies.calls
    again = reducer.reduce(x, names=["w"]).wait()
    assert PeerDies.calls == calls and torch.equal(again[0], x[0])


def test_a_dropped_round_rolls_the_residuals_back_to_the_mark():
    members = Membership()
    reducer = CodecSpec.parse("int8", {}, None).build(wrap=lambda codec: ManagedCodec(PeerDies(), members))
    reducer.load_state_dict({"residuals": {"w": torch.full((6,), 0.5)}})
    mark = reducer.mark()
    reducer.reduce([torch.ones(6)], names=["w"]).wait()
    reducer.roll_back(mark)
    assert torch.equal(reducer.residuals.pieces["w"], torch.full((6,), 0.5))
