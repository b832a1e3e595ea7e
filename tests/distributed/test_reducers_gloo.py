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


# ---- error feedback of sign, topk and powersgd on 2 and 3 ranks --------------------------------
def flat_store(store, names=SHAPES) -> torch.Tensor:
    """A ParamStore's pieces in SHAPES order (zeros where a name has none yet)."""
    return torch.cat([store.pieces[n].reshape(-1) if n in store.pieces else torch.zeros(math.prod(s))
                      for n, s in zip(names, SHAPES.values())])


def rounds_of(rank: int, world: int, codec: str, feedback: bool, options: dict) -> list[dict]:
    """Each round's input, the mean every rank got, and the worker (and sign's reducer) residuals
    before and after it."""
    reducer = build_reducer(codec, ledger=CommLedger(world_size=world), error_feedback=feedback, seed=3, **options)
    stores = {}
    if feedback:
        stores["worker"] = reducer.residuals
        if codec == "sign":
            stores["reducer"] = reducer.inner.reducer_residuals
    rows = []
    for t in range(ROUNDS):
        x = pseudo_gradient(rank, t)
        before = {k: flat_store(s) for k, s in stores.items()}
        means = reducer.reduce([v.clone() for v in x], names=list(SHAPES), sync=("round", t, 0)).wait()
        rows.append({"x": torch.cat([v.reshape(-1) for v in x]), "before": before,
                     "after": {k: flat_store(s) for k, s in stores.items()},
                     "mean": torch.cat([m.reshape(-1) for m in means])})
    return rows


def assert_feedback_matters(on: list, off: list) -> None:
    """Round 0 has no residual yet, so feedback off gives the same mean; later rounds differ."""
    assert torch.equal(on[0][0]["mean"], off[0][0]["mean"])
    assert not torch.equal(on[0][-1]["mean"], off[0][-1]["mean"]), "error feedback made no difference"


def assert_scaled_sign(values: torch.Tensor, of: torch.Tensor, pad_to_len: int, shards: int) -> None:
    """``values`` is the scaled sign of ``of`` as the sign codec's docs define it, written out here:
    shards of ``pad_to_len / shards`` entries (``of`` zero-padded), each cut into CHUNK-entry chunks
    that carry ``mean |chunk|`` (padding counted) and the signs (0 counts as +)."""
    padded = torch.zeros(pad_to_len)
    padded[:of.numel()] = of
    shard = pad_to_len // shards
    expect = torch.empty(pad_to_len)
    for s in range(0, pad_to_len, shard):
        for c in range(s, s + shard, CHUNK):
            chunk = padded[c:min(c + CHUNK, s + shard)]
            expect[c:c + chunk.numel()] = chunk.abs().mean() * torch.where(chunk >= 0, 1.0, -1.0)
    torch.testing.assert_close(values, expect[:values.numel()], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_sign_feedback_conserves_the_mean_across_both_hops(tmp_path, world):
    ranks = run_gloo(rounds_of, world, "sign", True, {"chunk_size": CHUNK}, tmp=tmp_path)
    n = ranks[0][0]["x"].numel()
    shard = math.ceil(math.ceil(n / world) / 8) * 8
    for t in range(ROUNDS):
        rows = [r[t] for r in ranks]
        out = rows[0]["mean"]
        assert all(torch.equal(out, row["mean"]) for row in rows[1:])
        for j, row in enumerate(rows):
            meant = row["x"] + row["before"]["worker"]
            sent = meant - row["after"]["worker"]
            # hop 1: what rank j sent is the scaled sign of what it meant (its input over N)
            assert_scaled_sign(sent / world, meant / world, shard * world, world)
            # its reducer residual lives on its own shard only, and is in use
            own = torch.zeros(n, dtype=torch.bool)
            own[j * shard:(j + 1) * shard] = True
            assert (row["after"]["reducer"][~own] == 0).all() and row["after"]["reducer"][own].abs().max() > 0
            if t:
                assert torch.equal(row["before"]["worker"], ranks[j][t - 1]["after"]["worker"])
        # hop 2: the delivered mean is the scaled sign of each owner's sum (plus its reducer residual)
        hop1 = sum(row["x"] + row["before"]["worker"] - row["after"]["worker"] for row in rows) / world
        carried = sum(row["before"]["reducer"] for row in rows)
        assert_scaled_sign(out, hop1 + carried, shard * world, world)
        # nothing lost, only delayed: mean + what both hops hold back == inputs + what they held before
        held_after = sum(row["after"]["worker"] for row in rows) / world + sum(row["after"]["reducer"] for row in rows)
        held_before = sum(row["before"]["worker"] for row in rows) / world + carried
        inputs = sum(row["x"] for row in rows) / world
        torch.testing.assert_close(out + held_after, inputs + held_before, rtol=0, atol=1e-5)
    assert_feedback_matters(ranks, run_gloo(rounds_of, world, "sign", False, {"chunk_size": CHUNK}, tmp=tmp_path))


@pytest.mark.parametrize("world", [2, 3])
def test_topk_feedback_sends_the_largest_of_input_plus_residual(tmp_path, world):
    ranks = run_gloo(rounds_of, world, "topk", True, {"fraction": 0.1}, tmp=tmp_path)
    k = math.ceil(0.1 * ranks[0][0]["x"].numel())
    for t in range(ROUNDS):
        rows = [r[t] for r in ranks]
        sent = []
        for row in rows:
            meant = row["x"] + row["before"]["worker"]
            s = meant - row["after"]["worker"]
            kept = s != 0
            assert int(kept.sum()) == k
            torch.testing.assert_close(s[kept], meant[kept], rtol=0, atol=0)  # whole entries go
            assert float(meant[kept].abs().min()) >= float(meant[~kept].abs().max())  # the largest ones
            sent.append(s)
        torch.testing.assert_close(rows[0]["mean"], sum(sent) / world, rtol=0, atol=1e-6)
    assert_feedback_matters(ranks, run_gloo(rounds_of, world, "topk", False, {"fraction": 0.1}, tmp=tmp_path))


@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_feedback_keeps_what_lies_outside_the_shared_subspace(tmp_path, world):
    rank = 2
    ranks = run_gloo(rounds_of, world, "powersgd", True, {"rank": rank}, tmp=tmp_path)
    (n, m), nw = SHAPES["w"], math.prod(SHAPES["w"])
    for t in range(ROUNDS):
        rows = [r[t] for r in ranks]
        out = rows[0]["mean"]
        # the bias is a vector: sent whole, nothing held back
        torch.testing.assert_close(out[nw:], sum(row["x"][nw:] for row in rows) / world, rtol=0, atol=1e-6)
        assert all((row["after"]["worker"][nw:] == 0).all() for row in rows)
        # the matrix: the mean has rank <= r; every rank sent its projection onto that shared
        # column space, and its residual is what lies outside it
        mean_w = out[:nw].view(n, m)
        u = torch.linalg.svd(mean_w.double(), full_matrices=False).U[:, :rank].float()
        assert torch.linalg.matrix_rank(mean_w, atol=1e-5) <= rank
        sent = []
        for row in rows:
            meant = (row["x"] + row["before"]["worker"])[:nw].view(n, m)
            residual = row["after"]["worker"][:nw].view(n, m)
            torch.testing.assert_close(meant - residual, u @ (u.T @ meant), rtol=0, atol=1e-4)
            assert float((u.T @ residual).abs().max()) < 1e-4 < float(residual.abs().max())
            sent.append(meant - residual)
        torch.testing.assert_close(mean_w, sum(sent) / world, rtol=0, atol=1e-5)
    assert_feedback_matters(ranks, run_gloo(rounds_of, world, "powersgd", False, {"rank": rank}, tmp=tmp_path))
