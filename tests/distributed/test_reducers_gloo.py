"""The reducers of ``gradsync.comm`` on real 2- and 3-process gloo groups, outside any strategy.

Error feedback on DiLoCo's pseudo-gradients: what a rank meant to send (its tensor plus the last
residual) minus what it sent is the new residual, and what it sent is checked here to be a true
quantization of what it meant (on the codec's integer grid, each chunk with its own scale), not
taken from the reducer. Turning error feedback off changes the result.
"""

import math

import pytest
import torch

from gradsync.comm import build_reducer
from gradsync.comm.ledger import CommLedger
from harness import run_gloo

pytestmark = pytest.mark.timeout(120)

SHAPES = {"w": (7, 13), "b": (13,)}  # 104 entries: uneven shards and a partial last chunk
CHUNK = 16
ROUNDS = 3


def pseudo_gradient(rank: int, t: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + t)
    return [torch.randn(*shape, generator=g) * (1 + rank) for shape in SHAPES.values()]


def rounds_with_feedback(rank: int, world: int, codec: str, feedback: bool) -> dict:
    reducer = build_reducer(codec, ledger=CommLedger(world_size=world), error_feedback=feedback,
                            chunk_size=CHUNK, seed=3)
    names = list(SHAPES)
    rows = []
    for t in range(ROUNDS):
        x = pseudo_gradient(rank, t)
        before = {n: reducer.residuals.pieces.get(n) for n in names} if feedback else {}
        means = reducer.reduce([v.clone() for v in x], names=names, sync=("round", t, 0)).wait()
        after = {n: reducer.residuals.pieces[n].clone() for n in names} if feedback else {}
        rows.append({"x": x, "before": before, "after": after, "means": [m.clone() for m in means]})
    return {"rows": rows}


def on_grid(meant: torch.Tensor, sent: torch.Tensor, world: int, bits: int) -> None:
    """``sent`` is a quantization of ``meant`` as the codec's docs define it, written out independently.

    The codec quantizes ``meant / world``, cut into ``world`` shards of ceil(n / world) entries (even,
    for 4 bits), each shard in chunks of CHUNK entries that share the scale max|chunk|."""
    levels = 2 ** (bits - 1) - 1
    n = meant.numel()
    shard = math.ceil(math.ceil(n / world) / (8 // bits)) * (8 // bits)
    x, y = meant / world, sent / world
    for start in range(0, n, shard):
        for c in range(start, min(start + shard, n), CHUNK):
            end = min(c + CHUNK, start + shard, n)
            scale = x[c:end].abs().max() / levels
            q = y[c:end] / scale
            assert (q - q.round()).abs().max() < 1e-3, "sent is not on the chunk's integer grid"
            assert q.abs().max() <= levels + 1e-3
            assert ((x[c:end] - y[c:end]).abs() < scale * (1 + 1e-4)).all(), "rounded by more than one level"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_residual_is_meant_minus_sent_and_sent_is_a_quantization(tmp_path, world, codec):
    bits = 8 if codec == "int8" else 4
    ranks = run_gloo(rounds_with_feedback, world, codec, True, tmp=tmp_path)
    off = run_gloo(rounds_with_feedback, world, codec, False, tmp=tmp_path)
    for t in range(ROUNDS):
        sent_by_rank = []
        for r in ranks:
            row = r["rows"][t]
            meant = torch.cat([v.reshape(-1) + (row["before"][n] if row["before"][n] is not None else 0)
                               for n, v in zip(SHAPES, row["x"])])
            residual = torch.cat([row["after"][n] for n in SHAPES])
            sent = meant - residual
            on_grid(meant, sent, world, bits)
            assert residual.abs().max() > 0  # lossy: something was held back
            if t:  # the residual carried into this round is the one the last round left
                assert all(torch.equal(row["before"][n], r["rows"][t - 1]["after"][n]) for n in SHAPES)
            sent_by_rank.append(sent)
        # every rank decodes the same bytes: identical means, close to the mean of what was sent
        # (the second hop re-quantizes the shard sums: one more rounding, at most one level of it)
        means = [torch.cat([m.reshape(-1) for m in r["rows"][t]["means"]]) for r in ranks]
        assert all(torch.equal(means[0], m) for m in means[1:])
        exact = torch.stack(sent_by_rank).mean(0)
        assert (means[0] - exact).abs().max() <= exact.abs().max() * 2 / (2 ** (bits - 1) - 1)
    # the first round has no residual to add, so it is the same with feedback off; later ones differ
    first = [torch.cat([m.reshape(-1) for m in r["rows"][0]["means"]]) for r in (ranks[0], off[0])]
    assert torch.equal(first[0], first[1])
    last = [torch.cat([m.reshape(-1) for m in r["rows"][-1]["means"]]) for r in (ranks[0], off[0])]
    assert not torch.equal(last[0], last[1]), "error feedback made no difference"
