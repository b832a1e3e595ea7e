"""Codecs on real 2- and 3-process gloo groups: identical results on every rank, exact wire bytes.

Each codec's reducer is registered as a DDP communication hook (``reducer_hook``) on a small MLP (one bucket), trained a few
SGD steps on rank-dependent data. The ledger's wire bytes must equal the codec's byte formula
(docs/strategies/compressed.md), written out here independently of the code.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.comm import build_reducer
from gradsync.comm.ddp import ReducerHookState, reducer_hook
from gradsync.comm.ledger import CommLedger
from harness import run_gloo

pytestmark = pytest.mark.timeout(120)

STEPS = 4
IN, HIDDEN, OUT = 20, 32, 10
NUMEL = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # 1002


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def train_with_codec(rank: int, world: int, codec: str, options: dict) -> dict:
    model = mlp()
    ddp = DDP(model)
    ledger = CommLedger(world_size=world)
    feedback = codec in ("sign", "topk", "powersgd")  # as compressed sets it
    state = ReducerHookState(reducer=build_reducer(codec, ledger=ledger, error_feedback=feedback, **options))
    ddp.register_comm_hook(state.bind(model.named_parameters()), reducer_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1000 + rank)  # every rank sees different data
    grads = []
    for _ in range(STEPS):
        x, y = torch.randn(16, IN, generator=g), torch.randint(0, OUT, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        opt.step()
    return {"params": {k: v.clone() for k, v in model.state_dict().items()}, "grads": grads,
            "ledger": ledger.state_dict(), "codec_state": state.reducer.state_dict()}


def allreduce(n, world, nbytes_per_entry):
    return (2 * (world - 1) * nbytes_per_entry * n) // world


def expected_wire_bytes(codec: str, world: int, options: dict) -> int:
    """Per step, for the MLP's single bucket of NUMEL entries (the formulas of the docs)."""
    n, N = NUMEL, world
    if codec == "identity":
        return allreduce(n, N, 4)
    if codec in ("fp16", "bf16"):
        return allreduce(n, N, 2)
    if codec == "int8":
        shard = math.ceil(n / N)
        msg = shard + 4 * math.ceil(shard / options.get("chunk_size", 512))
        return 2 * (N - 1) * msg  # all-to-all (N-1)/N * N*msg, all-gather (N-1) * msg
    if codec == "sign":
        shard = math.ceil(math.ceil(n / N) / 8) * 8
        msg = shard // 8 + 4 * math.ceil(shard / options.get("chunk_size", 512))
        return 2 * (N - 1) * msg
    if codec == "topk":
        k = math.ceil(options.get("fraction", 0.01) * n)
        return (N - 1) * 8 * k
    if codec == "powersgd":
        r = options.get("rank", 4)
        p_entries = HIDDEN * r + OUT * r + HIDDEN + OUT  # P of both weights, biases uncompressed
        q_entries = IN * r + HIDDEN * r
        return allreduce(p_entries, N, 4) + allreduce(q_entries, N, 4)
    raise AssertionError(codec)


CASES = [
    ("identity", {}), ("fp16", {}), ("bf16", {}), ("int8", {"chunk_size": 64}), ("sign", {"chunk_size": 64}),
    ("topk", {"fraction": 0.05}), ("powersgd", {"rank": 2}),
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec,options", CASES, ids=[c for c, _ in CASES])
def test_codec_ranks_agree_and_wire_bytes_match_formula(tmp_path, world, codec, options):
    results = run_gloo(train_with_codec, world, codec, options, tmp=tmp_path)
    first = results[0]
    for r in results[1:]:
        for k in first["params"]:
            assert torch.equal(r["params"][k], first["params"][k]), f"{codec}: rank params differ at {k}"
    # the run really trained
    start = mlp().state_dict()
    assert max(float((first["params"][k] - start[k]).abs().max()) for k in start) > 1e-3
    for r in results:
        ledger = r["ledger"]
        assert ledger["wire_bytes"] == STEPS * expected_wire_bytes(codec, world, options), codec
        assert ledger["logical_bytes"] == STEPS * allreduce(NUMEL, world, 4)
    ratio = first["ledger"]["compression_ratio"]
    minimum = {"identity": 1.0, "fp16": 2.0, "bf16": 2.0, "int8": 3.5, "sign": 20.0, "topk": 1 / (world * 0.05) - 1,
               "powersgd": 2.0}[codec]
    assert ratio >= minimum, f"{codec}: compression ratio {ratio:.2f} < {minimum}"


def test_codec_mean_gradient_is_close_to_exact_mean(tmp_path):
    """The averaged gradient the int8 hook delivers is within its rounding bound of the exact mean."""
    exact = run_gloo(train_with_codec, 2, "identity", {}, tmp=tmp_path)
    int8 = run_gloo(train_with_codec, 2, "int8", {"chunk_size": 64}, tmp=tmp_path)
    # Same first step input on both runs: compare the first averaged gradient.
    g_exact, g_int8 = exact[0]["grads"][0], int8[0]["grads"][0]
    # Two unbiased rounding hops of at most one level (max|chunk| / 127) per entry: a few percent.
    rel = float((g_int8 - g_exact).norm() / g_exact.norm())
    assert 0 < rel < 0.05, f"int8 mean gradient relative error {rel}"
