"""Codec properties on single tensors and a one-process group: bounds, unbiasedness, error feedback."""

import math

import pytest
import torch
import torch.distributed as dist

from gradsync.errors import OptionError
from gradsync.strategies.codecs import (
    Bf16State, Fp16State, Int8State, PowerSGDState, SignState, TopKState, bf16_hook, fp16_hook, int8_hook,
    powersgd_hook, sign_hook, topk_hook,
)
from gradsync.strategies.codecs import int8, powersgd, sign, topk
from gradsync.strategies.ledger import CommLedger


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


def run_hook(hook, state, params, grads):
    bucket = FakeBucket(params, grads)
    return hook(state, bucket).wait().clone()


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
@pytest.mark.parametrize("hook,state_cls,rel", [(fp16_hook, Fp16State, 2**-11), (bf16_hook, Bf16State, 2**-8)])
def test_cast_codecs_round_trip_within_their_precision(hook, state_cls, rel):
    params = model_params()
    grads = [torch.randn_like(p) for p in params]
    out = run_hook(hook, state_cls(ledger=CommLedger()), params, grads)
    x = torch.cat([g.flatten() for g in grads])
    assert bool(((out - x).abs() <= x.abs() * rel).all())
    assert not torch.equal(out, x)


# ---- error feedback -----------------------------------------------------------------------------
@pytest.mark.usefixtures("one_process_group")
def test_topk_residual_is_input_minus_sent():
    params = model_params()
    state = TopKState(ledger=CommLedger(), fraction=0.1).bind([(f"p{i}", p) for i, p in enumerate(params)])
    keys = [(f"p{i}", p.numel()) for i, p in enumerate(params)]
    residual = torch.zeros(sum(p.numel() for p in params))
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        x = torch.cat([g.flatten() for g in grads]) + residual
        sent = run_hook(topk_hook, state, params, grads)
        assert int((sent != 0).sum()) == math.ceil(0.1 * x.numel())
        residual = state.residuals.gather(keys, x)
        torch.testing.assert_close(residual, x - sent, rtol=0, atol=0)
        # what was sent is exactly the largest-magnitude part of input + old residual
        kept = sent != 0
        assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())


@pytest.mark.usefixtures("one_process_group")
def test_sign_worker_and_reducer_residuals_conserve_the_gradient():
    params = model_params()
    state = SignState(ledger=CommLedger(), chunk_size=64).bind([(f"p{i}", p) for i, p in enumerate(params)])
    keys = [(f"p{i}", p.numel()) for i, p in enumerate(params)]
    carried = torch.zeros(sum(p.numel() for p in params))
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        x = torch.cat([g.flatten() for g in grads])
        m = x + state.worker_residuals.gather(keys, x)
        sent = run_hook(sign_hook, state, params, grads)
        worker = state.worker_residuals.gather(keys, x)
        reducer = state.reducer_residuals.gather(keys, x)
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
    state = PowerSGDState(ledger=CommLedger(), rank=2).bind([(f"p{i}", p) for i, p in enumerate(params)])
    keys = [(f"p{i}", p.numel()) for i, p in enumerate(params)]
    carried = {}
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        out = run_hook(powersgd_hook, state, params, grads)
        offset = 0
        for (name, numel), g in zip(keys, grads):
            piece = out[offset:offset + numel].view_as(g)
            if g.dim() == 1:
                torch.testing.assert_close(piece, g)  # uncompressed
            else:
                m = g + carried.get(name, torch.zeros_like(g))
                err = state.errors.pieces[name].view_as(g)
                torch.testing.assert_close(err, m - piece, rtol=0, atol=1e-5)
                assert torch.linalg.matrix_rank(piece) <= 2
                carried[name] = err
            offset += numel


@pytest.mark.usefixtures("one_process_group")
def test_int8_hook_is_unbiased_and_seeded():
    params = model_params()
    grads = [torch.randn_like(p) for p in params]
    x = torch.cat([g.flatten() for g in grads])
    a = run_hook(int8_hook, Int8State(ledger=CommLedger(), chunk_size=64, seed=3), params, grads)
    b = run_hook(int8_hook, Int8State(ledger=CommLedger(), chunk_size=64, seed=3), params, grads)
    assert torch.equal(a, b)
    state = Int8State(ledger=CommLedger(), chunk_size=64, seed=4)
    mean = torch.stack([run_hook(int8_hook, state, params, grads) for _ in range(400)]).mean(0)
    assert float((mean - x).abs().max()) < float((a - x).abs().max()) / 4


# ---- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,option", [
    (lambda: Int8State(chunk_size=4), "chunk_size"),
    (lambda: SignState(chunk_size=100), "chunk_size"),
    (lambda: TopKState(fraction=0), "fraction"),
    (lambda: TopKState(fraction=1.5), "fraction"),
    (lambda: PowerSGDState(rank=0), "rank"),
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
    from gradsync.strategies.codecs import CODECS

    params = model_params()
    torch.manual_seed(5)
    grads = [torch.randn_like(p) for p in params]
    state_cls, hook = CODECS[codec]
    outs = []
    for order in (range(3), reversed(range(3))):
        order = list(order)
        state = state_cls(ledger=CommLedger()).bind([(f"p{i}", p) for i, p in enumerate(params)])
        bucket = FakeBucket([params[i] for i in order], [grads[i] for i in order])
        out = hook(state, bucket).wait()
        pieces = dict(zip(order, torch.split(out, [params[i].numel() for i in order])))
        outs.append(torch.cat([pieces[i] for i in range(3)]))
    assert torch.equal(outs[0], outs[1])
