"""The ``sparseloco`` codec on real 2- and 3-process gloo groups, checked by hand.

Every figure is recomputed here from the codec's definition (docs: comm/codecs/sparse.py), not
taken from its functions: what each rank meant to send is its tensor plus its decayed residual;
the entries it sent are the top k of every chunk of that; each sent value sits on the chunk's
grid of 2^b levels over [-s, s] (s the chunk's largest kept magnitude), at most half a level off;
the new residual is meant - sent; the mean every rank gets is the sum of every rank's sent values
divided by N; the ledger holds (N - 1) x the packed message size per round.
"""

import math

import pytest
import torch

from gradsync.comm import build_reducer
from gradsync.comm.ledger import CommLedger
from harness import run_gloo

pytestmark = pytest.mark.timeout(120)

ROUNDS = 3
CHUNK, K = 32, 4


def pseudo_gradient(rank: int, t: int, shapes: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + t)
    return [(torch.randn(*shape, generator=g) * (1 + rank)).to(dtype) for shape in shapes.values()]


def rounds(rank: int, world: int, shapes: dict, dtype: torch.dtype, bits: int, decay: float) -> dict:
    ledger = CommLedger(world_size=world)
    reducer = build_reducer("sparseloco", ledger=ledger, error_feedback=True, sparse_chunk_size=CHUNK,
                            sparse_k=K, value_bits=bits, error_decay=decay)
    names = list(shapes)
    rows = []
    for t in range(ROUNDS):
        x = pseudo_gradient(rank, t, shapes, dtype)
        before = {n: reducer.residuals.pieces.get(n) for n in names}
        means = reducer.reduce([v.clone() for v in x], names=names, sync=("round", t)).wait()
        after = {n: reducer.residuals.pieces[n].clone() for n in names}
        rows.append({"x": x, "before": before, "after": after, "means": [m.clone() for m in means]})
    return {"rows": rows, "wire_bytes": ledger.wire_bytes}


def check_sent(meant: torch.Tensor, sent: torch.Tensor, bits: int) -> None:
    """``sent`` keeps the top K of every chunk of ``meant``, each on the chunk's 2^bits-level grid."""
    top = 2**bits - 1
    n = meant.numel()
    for c in range(0, n, CHUNK):
        m, s = meant[c:c + CHUNK].double(), sent[c:c + CHUNK].double()
        kept = min(K, m.numel())  # a short last chunk: its zero padding never outranks a real entry
        chosen = set(m.abs().argsort(descending=True)[:kept].tolist())
        assert set(s.nonzero().flatten().tolist()) == chosen, "sent entries are not the chunk's top k"
        scale = m.abs()[sorted(chosen)].max()
        levels = (s[sorted(chosen)] / scale * top + top) / 2  # q in 0..top
        assert (levels - levels.round()).abs().max() < 1e-4, "a sent value is off the chunk's grid"
        assert levels.min() > -1e-4 and levels.max() < top + 1e-4
        off = (s - m)[sorted(chosen)].abs().max()
        assert off <= scale / top * (1 + 1e-5), "rounded by more than half a level (not to the nearest)"


def message_bytes(n: int, bits: int) -> int:
    """Elias-Fano: K codes of ``low`` index bits and a value, then a K + CHUNK / 2^low-bit bitmap, per chunk."""
    chunks = math.ceil(n / CHUNK)
    low = math.floor(math.log2(CHUNK / K))
    return math.ceil(chunks * (K * (low + bits) + K + CHUNK // 2**low) / 8) + 4 * chunks


CASES = [
    # world, shapes, dtype, bits, decay
    (2, {"w": (7, 13), "b": (13,)}, torch.float32, 2, 1.0),   # 104 entries: a last chunk of 8
    (3, {"w": (7, 12), "b": (14,)}, torch.float32, 2, 1.0),   # 98: a last chunk of 2 < K
    (2, {"w": (7, 13), "b": (13,)}, torch.float32, 4, 0.5),   # decayed residual, 4-bit values
    (3, {"w": (7, 13), "b": (13,)}, torch.float16, 8, 1.0),
    (2, {"w": (7, 12), "b": (14,)}, torch.bfloat16, 2, 0.9),
]


@pytest.mark.parametrize("world,shapes,dtype,bits,decay", CASES)
def test_sparse_codec_by_hand(tmp_path, world, shapes, dtype, bits, decay):
    ranks = run_gloo(rounds, world, shapes, dtype, bits, decay, tmp=tmp_path)
    n = sum(math.prod(s) for s in shapes.values())
    for t in range(ROUNDS):
        total = torch.zeros(n, dtype=torch.float64)
        for r in ranks:
            row = r["rows"][t]
            previous = [row["before"][name] for name in shapes]
            if t:  # the residual carried in is the one the last round left
                assert all(torch.equal(p, r["rows"][t - 1]["after"][name]) for p, name in zip(previous, shapes))
            meant = torch.cat([v.reshape(-1).float() + (0 if p is None else decay * p)
                               for v, p in zip(row["x"], previous)])
            residual = torch.cat([row["after"][name] for name in shapes])
            sent = meant - residual  # residual = meant - sent, so this is what went out
            check_sent(meant, sent, bits)
            total += sent.double()
        means = [torch.cat([m.reshape(-1) for m in r["rows"][t]["means"]]) for r in ranks]
        assert all(m.dtype == dtype for r in ranks for m in r["rows"][t]["means"])
        assert all(torch.equal(means[0], m) for m in means[1:]), "ranks disagree on the mean"
        # The sum of every rank's decoded message is N x the mean (to the mean's own precision).
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(means[0].double() * world, total, atol=tol * total.abs().max(), rtol=tol)
    assert all(r["wire_bytes"] == ROUNDS * (world - 1) * message_bytes(n, bits) for r in ranks)
