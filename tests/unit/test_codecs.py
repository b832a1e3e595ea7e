"""Codec properties on single tensors and a one-process group: bounds, unbiasedness, error feedback."""

import math

import pytest
import torch
import torch.distributed as dist

from gradsync.errors import OptionError
from gradsync.comm import build_reducer
from gradsync.comm.codecs import int8, powersgd, sign, topk
from gradsync.comm.ddp import ReducerHookState, reducer_hook
from gradsync.comm.codecs.cast import Bf16Reducer, Fp16Reducer
from gradsync.comm.codecs.common import RoundingNoise
from gradsync.comm.codecs.int8 import HEADROOM, Int4Reducer, Int8Reducer
from gradsync.comm.futures import completed
from gradsync.comm.ledger import CommLedger


@pytest.fixture(scope="module")
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FakeBucket:
    """What a DDP hook reads from a GradBucket: the flat buffer and its parameters, in order."""

    def __init__(self, params: list, grads: list) -> None:
        self._params = params
        self._buffer = torch.cat([g.flatten() for g in grads]).clone()

    def buffer(self): return self._buffer
    def parameters(self): return self._params
    def index(self): return 0
    def is_last(self): return True


def model_params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(16)),
            torch.nn.Parameter(torch.randn(8, 16))]


def hook_state(codec, params=(), **options):
    """``compressed``'s DDP hook state for ``codec``: its reducer (error feedback on for the codecs that
    need it, as compressed sets it), the parameters named p0, p1, ..."""
    options.setdefault("error_feedback", codec in ("sign", "topk", "powersgd"))
    reducer = build_reducer(codec, ledger=CommLedger(), **options)
    return ReducerHookState(reducer=reducer).bind([(f"p{i}", p) for i, p in enumerate(params)])


def run_hook(state, params, grads):
    bucket = FakeBucket(params, grads)
    return reducer_hook(state, bucket).wait().clone()


# ---- round trips -------------------------------------------------------------------------------
def test_int8_round_trip_error_is_below_one_level_per_chunk():
    x = torch.randn(1000) * torch.linspace(0.01, 10, 1000)
    q, scales = int8.quantize(x, 64, torch.Generator().manual_seed(0))
    assert q.dtype == torch.int8 and scales.numel() == math.ceil(1000 / 64)
    err = (int8.dequantize(q, scales, 64) - x).abs()
    level = (scales / 127).repeat_interleave(64)[:1000]
    assert bool((err <= level * (1 + 1e-5)).all())
    assert float(err.max()) > 0


def test_int8_stochastic_rounding_is_unbiased():
    torch.manual_seed(1)
    x = torch.randn(256)
    trials = 4000
    # One chunk per trial (chunk = 256), so every trial has the same scale max|x|.
    q, scales = int8.quantize(x.repeat(trials), 256, torch.Generator().manual_seed(2))
    decoded = int8.dequantize(q, scales, 256).view(trials, 256)
    level = float(x.abs().max()) / 127
    mean_err = (decoded - x).mean(dim=0)
    # Each trial's error has std <= level / 2; the mean of 4000 shrinks it ~63x.
    assert float(mean_err.abs().max()) < 5 * (level / 2) / math.sqrt(trials)
    # Round-to-nearest would not pass: its error is a fixed bias per entry of up to level / 2.
    nearest = torch.round(x / x.abs().max() * 127) * level
    assert float((nearest - x).abs().max()) > 10 * float(mean_err.abs().max())


def test_sign_round_trip_is_scaled_sign():
    x = torch.randn(200)
    packed, scales = sign.compress(x, 64)
    assert packed.dtype == torch.uint8 and packed.numel() == 25
    out = sign.decompress(packed, scales, 64)
    assert torch.equal(torch.sign(out), torch.where(x >= 0, 1.0, -1.0))
    expected_scales = torch.stack([x[i:i + 64].abs().mean() for i in range(0, 200, 64)])
    torch.testing.assert_close(scales, expected_scales)
    torch.testing.assert_close(out.abs(), expected_scales.repeat_interleave(64)[:200])


def reference_sign(x: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sign message written out plainly: signs packed high bit first (x >= 0 is +), and each
    chunk's mean |x| over its own entries, from a zero-padded (chunks, chunk_size) table, summed in
    float64 and rounded once to float32 (so the order of the additions does not show)."""
    n = x.numel()
    rows = max(1, math.ceil(n / chunk_size))
    table = torch.zeros(rows * chunk_size)
    table[:n] = x
    counts = torch.full((rows,), float(chunk_size), dtype=torch.float64)
    counts[-1] = n - chunk_size * (rows - 1)
    scales = (table.view(rows, chunk_size).abs().double().sum(dim=1) / counts).float()
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    packed = (bits << torch.arange(7, -1, -1, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)
    return packed, scales


@pytest.mark.parametrize("n,chunk", [(8, 8), (200, 64), (4096, 512), (8008, 2048), (1 << 20, 2048), (3 * 5000 + 8, 512)])
def test_sign_messages_are_bit_identical_to_the_reference_encoding(n, chunk):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4)
    x[::97] = 0.0
    x[1::89] = -0.0  # counts as + (x >= 0), like +0
    packed, scales = sign.compress(x, chunk)
    ref_packed, ref_scales = reference_sign(x, chunk)
    assert torch.equal(packed, ref_packed), "not the same sign bits on the wire"
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32)), "not the same scales"
    work, out = torch.empty(n), torch.empty(n)  # the same with the buffers a caller reuses
    again = sign.compress(x, chunk, work=work)
    assert torch.equal(again[0], packed) and torch.equal(again[1], scales)
    decoded = sign.decompress(packed, scales, chunk, out=out)
    assert decoded.data_ptr() == out.data_ptr()
    expect = torch.where(x >= 0, 1.0, -1.0) * ref_scales.repeat_interleave(chunk)[:n]
    assert torch.equal(decoded, expect)


@pytest.mark.parametrize("n,fraction", [(5000, 0.01), (1 << 20, 0.01), (1 << 20, 0.001), (3 << 19, 0.05), (1 << 20, 0.2),
                                        ((1 << 20) + 13, 0.01)])  # + 13: entries past the last full column
def test_topk_sends_exactly_the_entries_of_a_full_selection(n, fraction):
    """The sampled-threshold fast path picks the same (index, value) pairs as torch.topk over the
    whole vector, in ascending index order (the message is canonical)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3)
    k = topk.num_kept(n, fraction)
    idx, vals = topk.compress(x, k)
    ref = torch.topk(x.abs(), k).indices.sort().values
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), ref)
    assert torch.equal(vals, x[ref])


def test_topk_falls_back_when_the_sample_misjudges_the_threshold():
    n = 1 << 20
    k = topk.num_kept(n, 0.01)
    x = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 50
    sampled = x[:: n // topk.SAMPLE]  # the sample sees a few large entries and zeros: its threshold,
    sampled.zero_()                   # 100, keeps fewer than k candidates, and the whole vector is searched
    sampled[:3000] = 100.0
    idx, vals = topk.compress(x, k)
    ref = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(idx.long(), ref) and torch.equal(vals, x[ref])


def test_topk_keeps_largest_entries():
    x = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0])
    idx, vals = topk.compress(x, 2)
    out = topk.decompress(idx, vals, 6)
    assert torch.equal(out, torch.tensor([0, -5.0, 0, 4.0, 0, 0]))


def test_powersgd_full_rank_is_exact_and_low_rank_is_worth_it():
    assert powersgd.matrix_shape(torch.Size([16]), 4) is None            # vectors stay uncompressed
    assert powersgd.matrix_shape(torch.Size([4, 4]), 4) is None          # would not shrink
    assert powersgd.matrix_shape(torch.Size([32, 16, 3, 3]), 4) == (32, 144, 4)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("codec,rel", [("fp16", 2**-11), ("bf16", 2**-8)])
def test_cast_codecs_round_trip_within_their_precision(codec, rel):
    params = model_params()
    grads = [torch.randn_like(p) for p in params]
    out = run_hook(hook_state(codec, params), params, grads)
    x = torch.cat([g.flatten() for g in grads])
    assert bool(((out - x).abs() <= x.abs() * rel).all())
    assert not torch.equal(out, x)


# ---- error feedback -----------------------------------------------------------------------------
@pytest.mark.usefixtures("one_process_group")
def test_topk_residual_is_input_minus_sent():
    params = model_params()
    state = hook_state("topk", params, fraction=0.1)
    keys = [(f"p{i}", p.numel()) for i, p in enumerate(params)]
    residual = torch.zeros(sum(p.numel() for p in params))
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        x = torch.cat([g.flatten() for g in grads]) + residual
        sent = run_hook(state, params, grads)
        assert int((sent != 0).sum()) == math.ceil(0.1 * x.numel())
        residual = state.reducer.residuals.gather(keys, x)
        torch.testing.assert_close(residual, x - sent, rtol=0, atol=0)
        # what was sent is exactly the largest-magnitude part of input + old residual
        kept = sent != 0
        assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())


@pytest.mark.usefixtures("one_process_group")
def test_sign_worker_and_reducer_residuals_conserve_the_gradient():
    params = model_params()
    state = hook_state("sign", params, chunk_size=64)
    worker_residuals, reducer_residuals = state.reducer.residuals, state.reducer.inner.reducer_residuals
    keys = [(f"p{i}", p.numel()) for i, p in enumerate(params)]
    carried = torch.zeros(sum(p.numel() for p in params))
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        x = torch.cat([g.flatten() for g in grads])
        m = x + worker_residuals.gather(keys, x)
        sent = run_hook(state, params, grads)
        worker = worker_residuals.gather(keys, x)
        reducer = reducer_residuals.gather(keys, x)
        # worker side: residual == input (+ old residual) minus what it sent
        packed, scales = sign.compress(m, 64)
        torch.testing.assert_close(worker, m - sign.decompress(packed, scales, 64))
        # both sides together: nothing is lost, only delayed
        torch.testing.assert_close(worker + reducer + sent, x + carried, rtol=0, atol=1e-5)
        carried = worker + reducer
        assert float(worker.abs().max()) > 0


@pytest.mark.usefixtures("one_process_group")
def test_powersgd_residual_is_input_minus_low_rank_part():
    params = model_params()
    state = hook_state("powersgd", params, rank=2)
    keys = [(f"p{i}", p.numel()) for i, p in enumerate(params)]
    carried = {}
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        out = run_hook(state, params, grads)
        offset = 0
        for (name, numel), g in zip(keys, grads):
            piece = out[offset:offset + numel].view_as(g)
            if g.dim() == 1:
                torch.testing.assert_close(piece, g)  # uncompressed
            else:
                m = g + carried.get(name, torch.zeros_like(g))
                err = state.reducer.residuals.pieces[name].view_as(g)
                torch.testing.assert_close(err, m - piece, rtol=0, atol=1e-5)
                assert torch.linalg.matrix_rank(piece) <= 2
                carried[name] = err
            offset += numel


@pytest.mark.usefixtures("one_process_group")
def test_int8_hook_is_unbiased_and_seeded():
    params = model_params()
    grads = [torch.randn_like(p) for p in params]
    x = torch.cat([g.flatten() for g in grads])
    a = run_hook(hook_state("int8", params, chunk_size=64, seed=3), params, grads)
    b = run_hook(hook_state("int8", params, chunk_size=64, seed=3), params, grads)
    assert torch.equal(a, b)
    state = hook_state("int8", params, chunk_size=64, seed=4)
    mean = torch.stack([run_hook(state, params, grads) for _ in range(400)]).mean(0)
    assert float((mean - x).abs().max()) < float((a - x).abs().max()) / 4


# ---- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,option", [
    (lambda: build_reducer("int8", chunk_size=4), "chunk_size"),
    (lambda: build_reducer("sign", chunk_size=100), "chunk_size"),
    (lambda: build_reducer("topk", fraction=0), "fraction"),
    (lambda: build_reducer("topk", fraction=1.5), "fraction"),
    (lambda: build_reducer("powersgd", rank=0), "rank"),
])
def test_bad_codec_options_fail_at_construction_with_one_line(make, option):
    with pytest.raises(OptionError) as info:
        make()
    assert info.value.option == option
    assert "\n" not in str(info.value) and "must" in str(info.value)


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("codec", ["int8", "sign", "topk", "powersgd"])
def test_compression_does_not_depend_on_ddp_bucket_order(codec):
    """DDP reorders a bucket's parameters after its first step (and on resume): same result either way."""
    params = model_params()
    torch.manual_seed(5)
    grads = [torch.randn_like(p) for p in params]
    outs = []
    for order in (range(3), reversed(range(3))):
        order = list(order)
        state = hook_state(codec, params)
        bucket = FakeBucket([params[i] for i in order], [grads[i] for i in order])
        out = reducer_hook(state, bucket).wait()
        pieces = dict(zip(order, torch.split(out, [params[i].numel() for i in order])))
        outs.append(torch.cat([pieces[i] for i in range(3)]))
    assert torch.equal(outs[0], outs[1])



# ---- fast codecs: the same messages as the straightforward encodings; unbiased rounding ----------
class MessageSpy:
    """A ledger that records each all-reduce message; one rank, so the sum is the message."""

    def __init__(self) -> None:
        self.messages = []

    def all_reduce(self, tensor, **account):
        self.messages.append(tensor.clone())
        return completed(tensor.clone())


def awkward_tensors():
    """Values that stress a half-precision cast: fp16 overflow and subnormals, fp32 subnormals,
    signed zeros, infinities, NaN, ties, values that round into the next binade; a bf16 and an
    fp64 tensor (converted on the way in)."""
    torch.manual_seed(11)
    special = torch.tensor([0.0, -0.0, 1e-8, -6e-8, 3e-5, 6.1e-5, 65504.0, 65520.0, 7e4, -1e5, 1e-40,
                            -3e-39, float("inf"), float("-inf"), float("nan"), 1.0009765625, 3.0e38])
    return [torch.randn(7, 13) * torch.logspace(-9, 6, 13), special,
            (torch.randn(33) * 100).to(torch.bfloat16), torch.randn(5).to(torch.float64)]


def reference_cast_message(tensors, wire_dtype, world):
    """The straightforward encoding: round every entry to the wire type, divide by N in float32,
    round again (what ``flat.to(wire).div_(N)`` did, and what torch's fp16/bf16 hooks do)."""
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    return (flat.to(wire_dtype).to(torch.float32) / world).to(wire_dtype)


def run_cast(reducer_cls, tensors, world):
    """(message, means, sent) of one reduction over a one-rank 'group' of size ``world``."""
    spy = MessageSpy()
    reducer = reducer_cls(ledger=spy)
    reducer.world_size = lambda: world
    reducer.need_sent = True
    reduction = reducer.run(tensors, [str(i) for i in range(len(tensors))], None)
    fut = reduction.send(None)
    with pytest.raises(StopIteration) as stop:
        reduction.send(fut.wait())
    means, sent = stop.value.value
    assert len(spy.messages) == 1
    return spy.messages[0], means, sent


@pytest.mark.parametrize("reducer_cls", [Fp16Reducer, Bf16Reducer])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_cast_messages_are_bit_identical_to_the_reference_encoding(reducer_cls, world):
    tensors = awkward_tensors()
    msg, means, sent = run_cast(reducer_cls, tensors, world)
    ref = reference_cast_message(tensors, reducer_cls.wire_dtype, world)
    assert msg.dtype == reducer_cls.wire_dtype and msg.shape == ref.shape
    assert torch.equal(msg.view(torch.int16), ref.view(torch.int16)), "not the same bytes on the wire"
    pos = 0
    for t, mean, s in zip(tensors, means, sent):
        want = ref[pos:pos + t.numel()].to(torch.float32).view(t.shape)
        assert mean.dtype == t.dtype and mean.shape == t.shape
        torch.testing.assert_close(mean, want.to(t.dtype), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(s, (want * world).to(t.dtype), rtol=0, atol=0, equal_nan=True)
        pos += t.numel()


def test_reference_cast_message_differs_from_a_single_rounding():
    """The bit-identity test can fail: dividing before rounding (one rounding) gives other bytes."""
    tensors = awkward_tensors()
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    once = (flat / 3).to(torch.float16)
    assert not torch.equal(once.view(torch.int16), reference_cast_message(tensors, torch.float16, 3).view(torch.int16))


def quantized_round_trip(reducer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded rows, per-entry level) of one encode + decode of ``x`` (rows, length)."""
    rows, length = x.shape
    msgs = torch.empty(rows, reducer.message_bytes(length), dtype=torch.uint8)
    reducer.encode(x, msgs, torch.empty_like(x))
    decoded = reducer.decode(msgs, length, torch.empty_like(x))
    scales = int8.scales_of(msgs, reducer.payload_bytes(length))
    level = (scales / reducer.levels).repeat_interleave(reducer.chunk_size, dim=1)[:, :length]
    return decoded, level


@pytest.mark.parametrize("reducer_cls", [Int8Reducer, Int4Reducer])
def test_quantized_rounding_is_unbiased_over_many_draws_and_within_one_level(reducer_cls):
    torch.manual_seed(3)
    x = (torch.randn(300) * torch.linspace(0.1, 3, 300)).view(1, -1)  # 4 full chunks of 64 + 44
    reducer = reducer_cls(chunk_size=64, seed=7)
    trials = 2000
    errors, levels = [], []
    for _ in range(trials):  # one noise draw per trial, as one draw per reduction hop
        decoded, level = quantized_round_trip(reducer, x)
        errors.append(decoded - x)
        levels.append(level)
    err, level = torch.cat(errors), torch.cat(levels)
    assert torch.equal(level, level[:1].expand_as(level))  # fixed input, fixed scales
    assert bool((err.abs() <= level * (1 + 1e-5)).all()), "rounded by more than one level"
    # The rounding error of one entry has standard deviation <= level / 2.
    bound = 0.5 / math.sqrt(trials)
    per_entry = err.mean(0) / level[0]
    assert float(per_entry.abs().max()) < 5 * bound
    overall = float((err / level).mean())
    assert abs(overall) < 5 * 0.5 / math.sqrt(err.numel())
    # Deterministic rounding to nearest would fail the per-entry test on most entries: its bias is fixed.
    nearest = (torch.round(x / level[:1]) * level[:1] - x) / level[:1]
    assert float((nearest.abs() >= 5 * bound).float().mean()) > 0.8


@pytest.mark.parametrize("reducer_cls", [Int8Reducer, Int4Reducer])
def test_quantized_rounding_errors_are_uncorrelated_between_entries_and_draws(reducer_cls):
    """Pairwise independent noise: over draws, the errors of two entries (neighbours, other
    chunks) are uncorrelated, and so are one entry's errors in consecutive draws. Within one
    draw every row of the layout gets its own noise: the same input on 4000 rows averages out."""
    torch.manual_seed(4)
    x = torch.randn(1, 96)
    reducer = reducer_cls(chunk_size=32, seed=1)
    draws = 3000
    err = torch.cat([(lambda d: (d[0] - x) / d[1])(quantized_round_trip(reducer, x)) for _ in range(draws)])
    limit = 5 / math.sqrt(draws)  # corrcoef of independent samples has std ~1/sqrt(draws)
    # entries within 1% of a level from the grid (the chunk maxima) round almost deterministically
    live = err.std(0) > 0.1

    def corr(a, b, pairs):
        return torch.stack([torch.corrcoef(torch.stack([a(i), b(j)]))[0, 1] for i, j in pairs if live[i] and live[j]])

    neighbours = corr(lambda c: err[:, c], lambda c: err[:, c], [(c, c + 1) for c in range(95)])
    far = corr(lambda c: err[:, c], lambda c: err[:, c], [(c, c + 50) for c in range(46)])
    consecutive = corr(lambda c: err[:-1, c], lambda c: err[1:, c], [(c, c) for c in range(96)])
    assert len(neighbours) > 80
    for c in (neighbours, far, consecutive):
        assert float(c.abs().max()) < limit and abs(float(c.mean())) < limit / 3
    decoded, level = quantized_round_trip(reducer, x.expand(4000, -1).contiguous())
    assert float(((decoded - x) / level).mean(0).abs().max()) < 5 * 0.5 / math.sqrt(4000)


@pytest.mark.parametrize("reducer_cls", [Int8Reducer, Int4Reducer])
def test_quantized_payload_layout_and_scales(reducer_cls):
    """Known answer for the wire format: int8 payload is q (two's complement); int4 byte i holds
    q + 8 of entry i (high nibble) and of entry i + L/2 (low nibble); scales are max|chunk| raised
    by the headroom; the largest entries land exactly on +-levels, never beyond."""
    torch.manual_seed(5)
    x = torch.randn(2, 40)
    x[0, 3], x[1, 39] = 10.0, -10.0  # chunk maxima
    reducer = reducer_cls(chunk_size=16, seed=0)
    decoded, level = quantized_round_trip(reducer, x)
    q = torch.round(decoded / level).long()
    torch.testing.assert_close(q * level, decoded, rtol=1e-6, atol=0)
    assert int(q.abs().max()) == reducer.levels
    assert int(q[0, 3]) == reducer.levels and int(q[1, 39]) == -reducer.levels
    msgs = torch.empty(2, reducer.message_bytes(40), dtype=torch.uint8)
    reducer.noise().draws -= 1  # replay the draw of the round trip above
    reducer.encode(x, msgs, torch.empty_like(x))
    pay = reducer.payload_bytes(40)
    if reducer.bits == 8:
        assert torch.equal(msgs[:, :pay].view(torch.int8).long(), q)
    else:
        assert torch.equal(msgs[:, :pay].long(), ((q[:, :20] + 8) << 4) | (q[:, 20:] + 8))
    scales = int8.scales_of(msgs, pay)
    expected = torch.stack([x[:, c:c + 16].abs().amax(1) for c in range(0, 40, 16)], dim=1) * HEADROOM
    torch.testing.assert_close(scales, expected)


def test_quantized_zero_and_tiny_chunks_decode_finite():
    x = torch.zeros(1, 48)
    x[0, 16:32] = torch.tensor([1e-42, -3e-41] * 8)  # float32 subnormals
    x[0, 32:] = torch.tensor([1e-36, -2e-37] * 8)
    for reducer_cls in (Int8Reducer, Int4Reducer):
        decoded, level = quantized_round_trip(reducer_cls(chunk_size=16), x)
        assert torch.equal(decoded[0, :16], torch.zeros(16)) and bool(decoded.isfinite().all())
        assert bool(((decoded - x).abs() <= level * (1 + 1e-5)).all())
        levels = reducer_cls(chunk_size=16).levels
        assert float(level[0, 16]) == pytest.approx(int8.TINY_SCALE / levels)  # the smallest scale
        assert float(level[0, 32]) == pytest.approx(1e-36 * HEADROOM / levels)


def test_rounding_noise_is_uniform_reproducible_and_checkpointable():
    a, b = RoundingNoise(5).tables(4096, 512, torch.device("cpu"))
    values = (a.unsqueeze(1) ^ b.unsqueeze(0)).flatten()
    assert int(values.min()) >= 0 and int(values.max()) < 2**16
    bits = torch.stack([(values >> i) & 1 for i in range(16)]).float().mean(1)
    assert float((bits - 0.5).abs().max()) < 0.005  # every bit fair; 2M values: std 3.5e-4
    counts = torch.bincount(values >> 8, minlength=256).float()
    chi2 = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
    assert chi2 < 400  # 255 degrees of freedom: mean 255, std 22.6
    # same seed and draw count -> same noise; a restored state continues the sequence exactly
    n1, n2 = RoundingNoise(5), RoundingNoise(5)
    first = n1.tables(100, 64, torch.device("cpu"))
    state = n1.state_dict()
    second = n1.tables(100, 64, torch.device("cpu"))
    assert all(torch.equal(u, v) for u, v in zip(first, n2.tables(100, 64, torch.device("cpu"))))
    n3 = RoundingNoise(0)
    n3.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(second, n3.tables(100, 64, torch.device("cpu"))))
    assert not torch.equal(first[1], second[1])
    assert not torch.equal(RoundingNoise(6).tables(100, 64, torch.device("cpu"))[1], first[1])
    # consecutive draws are uncorrelated, entry by entry
    d1 = RoundingNoise(9)
    u = [(lambda ab: (ab[0].unsqueeze(1) ^ ab[1].unsqueeze(0)).flatten().float())(d1.tables(512, 512, "cpu"))
         for _ in range(2)]
    assert abs(float(torch.corrcoef(torch.stack(u))[0, 1])) < 0.01


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("reducer_cls", [Int8Reducer, Int4Reducer])
def test_quantized_reducer_state_resumes_exactly_and_ranks_draw_their_own_noise(reducer_cls, monkeypatch):
    torch.manual_seed(6)
    x = [torch.randn(300), torch.randn(7, 5)]
    a = reducer_cls(ledger=CommLedger(), chunk_size=64, seed=3)
    first = a.reduce([t.clone() for t in x]).wait()
    state = a.state_dict()
    assert int(state["noise"]["seed"]) == 3 and int(state["noise"]["draws"]) == 2  # one draw per hop
    second = a.reduce([t.clone() for t in x]).wait()
    assert not all(torch.equal(u, v) for u, v in zip(first, second))
    resumed = reducer_cls(ledger=CommLedger(), chunk_size=64, seed=3)
    resumed.load_state_dict(torch.load(_roundtrip(state), weights_only=True))
    assert all(torch.equal(u, v) for u, v in zip(second, resumed.reduce([t.clone() for t in x]).wait()))
    # rank r draws from seed + r
    rank1 = reducer_cls(ledger=CommLedger(), chunk_size=64, seed=3)
    monkeypatch.setattr(rank1, "group_rank", lambda: 1)
    other = rank1.reduce([t.clone() for t in x]).wait()
    assert not all(torch.equal(u, v) for u, v in zip(first, other))
    seed4 = reducer_cls(ledger=CommLedger(), chunk_size=64, seed=4).reduce([t.clone() for t in x]).wait()
    assert all(torch.equal(u, v) for u, v in zip(other, seed4))


def _roundtrip(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_quantized_reducer_warns_on_an_old_generator_checkpoint():
    reducer = Int8Reducer()
    with pytest.warns(UserWarning, match="older gradsync"):
        reducer.load_state_dict({"generator": torch.zeros(16, dtype=torch.uint8)})
    assert reducer.noise().draws == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rounding_noise_and_quantized_codes_agree_on_cuda():
    cpu = RoundingNoise(2).tables(1000, 512, torch.device("cpu"))
    gpu = RoundingNoise(2).tables(1000, 512, torch.device("cuda"))
    assert all(torch.equal(u, v.cpu()) for u, v in zip(cpu, gpu))
    x = torch.randn(3, 1000)
    for reducer_cls in (Int8Reducer, Int4Reducer):
        d_cpu, _ = quantized_round_trip(reducer_cls(chunk_size=64), x)
        r = reducer_cls(chunk_size=64)
        msgs = torch.empty(3, r.message_bytes(1000), dtype=torch.uint8, device="cuda")
        xg = x.cuda()
        r.encode(xg, msgs, torch.empty_like(xg))
        d_gpu = r.decode(msgs, 1000, torch.empty_like(xg)).cpu()
        # the same noise, the same integer codes and correctly rounded scales: the same bits (CUDA's
        # division by a host scalar, a multiply by its reciprocal, made 4% of the int4 entries differ)
        assert torch.equal(d_cpu, d_gpu), f"{reducer_cls.__name__}: {int((d_cpu != d_gpu).sum())} entries differ"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_topk_and_sign_messages_on_cuda_equal_the_cpu_ones():
    """Selection and sign are comparisons, not arithmetic: the CUDA messages must be the CPU's bytes."""
    n = (1 << 20) + 13  # topk's column-peak path and its tail
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    k = topk.num_kept(n, 0.01)
    for a, b in zip(topk.compress(x, k), topk.compress(x.cuda(), k)):
        assert torch.equal(a, b.cpu())
    x = x[: 1 << 20]  # sign packs whole bytes: a multiple of 8 entries
    packed, scales = sign.compress(x, 512)
    packed_gpu, scales_gpu = sign.compress(x.cuda(), 512)
    assert torch.equal(packed, packed_gpu.cpu())
    assert torch.allclose(scales, scales_gpu.cpu(), rtol=1e-5, atol=0)  # a mean: summation order differs
