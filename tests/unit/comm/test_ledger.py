"""Communication ledger arithmetic, per collective, and on a real 2-process gloo group."""

import pytest
import torch

from gradsync.comm.ledger import CommLedger, fp32_allreduce_bytes, wire_bytes
from harness import run_gloo

S = 1_000_000


@pytest.mark.parametrize("collective, world, nbytes, expected", [
    ("all_reduce", 1, S, 0),
    ("all_reduce", 2, S, S),                       # 2(N-1)/N = 1
    ("all_reduce", 4, S, 3 * S // 2),              # 2*3/4
    ("all_reduce", 8, S, 7 * S // 4),
    ("reduce_scatter", 4, S, 3 * S // 4),          # (N-1)/N
    ("all_to_all", 2, S, S // 2),
    ("all_gather", 4, S, 3 * S),                   # (N-1) * own part
    ("all_gather", 1, S, 0),
    ("broadcast", 4, S, S),                        # root sends S
    ("send", 3, S, S),
])
def test_wire_bytes_formulas(collective, world, nbytes, expected):
    assert wire_bytes(collective, nbytes, world) == expected


def test_broadcast_non_root_sends_nothing():
    assert wire_bytes("broadcast", S, 4, is_root=False) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("gossip", S, 2)
    with pytest.raises(ValueError, match="world_size"):
        wire_bytes("all_reduce", S, 0)


def test_ratio_and_state_round_trip():
    ledger = CommLedger(world_size=4)
    ledger.record("all_reduce", 400)
    ledger.add_logical(fp32_allreduce_bytes(1000, 4))   # 4000 bytes of fp32 gradients
    assert ledger.wire_bytes == 600 and ledger.logical_bytes == 6000
    assert ledger.compression_ratio == 10.0
    restored = CommLedger(world_size=4)
    restored.load_state_dict(ledger.state_dict())
    assert restored.summary() == ledger.summary()
    assert CommLedger().compression_ratio == 1.0   # nothing sent, nothing replaced


def _collectives(rank, world):
    ledger = CommLedger(world_size=world)
    t = torch.full((1000,), float(rank + 1))
    ledger.all_reduce(t)                                      # 4000 bytes
    out = torch.empty(world * 10)
    ledger.all_gather_into_tensor(out, torch.full((10,), float(rank)))   # 40 bytes own part
    a2a_in, a2a_out = torch.arange(world * 5, dtype=torch.float32), torch.empty(world * 5)
    ledger.all_to_all_single(a2a_out, a2a_in)                # 20*world bytes
    b = torch.full((25,), float(rank))
    ledger.broadcast(b, src=0)                                # 100 bytes from rank 0
    fut = ledger.all_reduce(torch.ones(4), async_op=True)
    reduced = fut.wait()
    return {"sum": t[0].item(), "gathered": out.tolist(), "bcast": b[0].item(), "async": reduced.tolist(),
            "summary": ledger.summary(), "by": ledger.by_collective}


def test_ledger_on_real_gloo_group(tmp_path):
    world = 2
    results = run_gloo(_collectives, world, tmp=tmp_path)
    for rank, r in enumerate(results):
        assert r["sum"] == 3.0 and r["bcast"] == 0.0 and r["async"] == [2.0] * 4
        assert r["gathered"] == [0.0] * 10 + [1.0] * 10
        expected = (4000 + 40 + (4 * 10 // 2) + (100 if rank == 0 else 0) + 16)
        assert r["summary"]["wire_bytes"] == expected
        assert r["summary"]["collectives"] == 5
        assert r["by"]["all_reduce"]["count"] == 2
        assert r["summary"]["seconds"] > 0

