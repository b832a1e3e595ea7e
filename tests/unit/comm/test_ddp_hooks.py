"""The DDP hook of ``compressed`` reads the step count its owner advances at each optimizer step."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradsync.algorithms import Schedule
from gradsync.comm import build_reducer
from gradsync.comm.ddp import ReducerHookState, reducer_hook
from gradsync.comm.ledger import CommLedger
from gradsync.comm.reducer import IdentityReducer
from harness import run_gloo


def _wire_bytes_per_step(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 64)
    ddp = DistributedDataParallel(model)
    ledger = CommLedger(world_size=world)
    owner = Schedule(warmup_steps=2)  # the optimizer side's count (compressed: CompressedStrategy.schedule)
    state = ReducerHookState(reducer=build_reducer("int8", ledger=ledger), warmup=IdentityReducer(ledger=ledger),
                             warmup_steps=owner.warmup_steps, steps=owner).bind(model.named_parameters())
    ddp.register_comm_hook(state, reducer_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    sent, counts = [], []

    def step():
        before = ledger.wire_bytes
        opt.zero_grad()
        ddp(torch.randn(8, 256) * (rank + 1)).square().mean().backward()
        opt.step()
        owner.num_steps += 1  # what CompressedStrategy.optimizer_step does after the step
        sent.append(ledger.wire_bytes - before)
        counts.append(owner.num_steps)

    for _ in range(4):
        step()
    owner.num_steps = 0  # a checkpoint restores the count: the warm-up's exact steps come again
    step()
    return sent, counts, state.num_steps


def test_the_hook_reads_the_optimizer_steps_count_and_never_advances_it(tmp_path):
    numel = 256 * 64 + 64
    fp32 = 2 * (2 - 1) / 2 * 4 * numel  # ring all-reduce of fp32, per rank
    for sent, counts, own in run_gloo(_wire_bytes_per_step, 2, tmp=tmp_path):
        assert counts == [1, 2, 3, 4, 1]  # only the optimizer side moved the count
        assert own == 0  # the hook kept no count of its own
        assert sent[0] == sent[1] == sent[4] == fp32  # the warm-up's exact all-reduce, and again after the reset
        assert 0 < sent[2] == sent[3] < fp32 / 3  # int8 from the owner's step 2 on


def _builtin_against_hook(rank, world):
    """The same multi-bucket model and steps, booked twice: from its gradients with no hook
    (``sync``'s path) and by a per-bucket Python hook that sees every bucket DDP reduces."""
    from gradsync.comm.ddp import AllReduceState, allreduce_hook, record_builtin_allreduce

    out = {}
    for booked_by in ("buckets", "hook"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Linear(400, 500), torch.nn.Linear(500, 8))
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.5)  # several buckets, rebuilt after step 1
        ledger = CommLedger(world_size=world)
        if booked_by == "hook":
            ddp.register_comm_hook(AllReduceState(ledger=ledger), allreduce_hook)
        for step in range(3):
            with ddp.no_sync():  # an accumulated micro-batch: DDP sends nothing, nothing is booked
                ddp(torch.randn(4, 300)).square().mean().backward()
            ddp(torch.randn(4, 300) * (rank + 1)).square().mean().backward()
            if booked_by == "buckets":
                record_builtin_allreduce(ledger, ddp, step)
        grads = [p.grad.clone() for p in model.parameters()]
        out[booked_by] = (ledger.wire_bytes, ledger.logical_bytes, ledger.collectives, ledger.peak_sync_bytes, grads)
    return out


def test_bytes_booked_from_ddp_buckets_equal_what_a_per_bucket_hook_sees(tmp_path):
    numel = 300 * 400 + 400 + 400 * 500 + 500 + 500 * 8 + 8
    for r in run_gloo(_builtin_against_hook, 2, tmp=tmp_path):
        wire, logical, collectives, peak, grads = r["buckets"]
        assert (wire, logical, peak) == (r["hook"][0], r["hook"][1], r["hook"][3])
        assert wire == logical == 3 * 4 * numel  # ring all-reduce of fp32 on 2 ranks: 2(N-1)/N x bytes
        assert peak == 4 * numel  # one step's buckets together are one sync
        assert collectives == 3 < r["hook"][2]  # one per synchronized step; the hook sees each bucket
        assert all(torch.equal(a, b) for a, b in zip(grads, r["hook"][4]))  # and DDP's own mean is the hook's
