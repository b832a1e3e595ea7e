"""``whole_step_hook`` (fault-tolerant ``sync``) sends a step's gradients as one message in DDP's own order.

DDP lays its buckets out in the model's order for a process's first backward and in the order the
gradients became ready ever after. A replica group that heals into the others' step runs its first
backward while theirs are laid out by readiness: told it is ``behind``, it lays its message out in
that order too, and reads back each parameter's own entries."""

import torch
from torch.nn.parallel import DistributedDataParallel

from gradsync.comm.ddp import WholeStepState, whole_step_hook
from gradsync.comm.ledger import CommLedger
from gradsync.comm.reducer import Reducer
from harness import run_gloo


class _Recording(Reducer):
    """Records the names of each message, and answers every entry with its parameter's index + 1."""

    codec = "identity"

    def __init__(self, ledger, order):
        super().__init__(ledger=ledger)
        self.order, self.messages = order, []

    def reduce(self, tensors, *, names=None, sync=None):
        self.messages.append(list(names))
        fut = torch.futures.Future()
        fut.set_result([torch.full_like(t, float(self.order.index(n) + 1)) for t, n in zip(tensors, names)])
        return fut

    def world_size(self):
        return 1


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3)
        self.mid = torch.nn.Linear(8 * 6 * 6, 64)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.relu(self.mid(torch.relu(self.conv(x)).flatten(1))))


def _messages(rank, world, behind_at_first, steps, bucket_cap_mb):
    torch.manual_seed(0)
    model = _Net()
    names = [n for n, _ in model.named_parameters()]
    reducer = _Recording(CommLedger(world_size=world), names)
    state = WholeStepState(reducer, behind=lambda: behind_at_first and len(reducer.messages) == 0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(state.bind(model.named_parameters()), whole_step_hook)
    applied = []
    for _ in range(steps):
        model.zero_grad()
        state.ready.clear()
        ddp(torch.randn(2, 1, 8, 8)).square().mean().backward()
        applied.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return reducer.messages, applied, names


def test_a_process_behind_the_others_sends_their_layout_and_reads_back_its_own_entries(tmp_path):
    for cap in (25, 0.004):  # one bucket; several (4 KB)
        (fresh,) = run_gloo(_messages, 1, False, 2, cap, tmp=tmp_path)
        (healing,) = run_gloo(_messages, 1, True, 1, cap, tmp=tmp_path)
        (messages, _, names), (behind, applied, _) = fresh, healing
        assert messages[0] == names  # a first backward: the model's order
        assert messages[1] != names and sorted(messages[1]) == sorted(names)  # then the order of readiness
        assert behind[0] == messages[1], cap  # the healing process's first message is laid out as the others'
        for i, name in enumerate(names):  # and every parameter got its own answer back
            assert torch.equal(applied[0][name], torch.full_like(applied[0][name], float(i + 1))), name
