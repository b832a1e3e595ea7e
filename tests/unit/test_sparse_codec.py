"""``sparseloco``: its bit layout, message size and options (the reduction itself: distributed/test_sparse_gloo.py)."""

import math

import pytest
import torch

from gradsync.comm import build_reducer, check_codec_options
from gradsync.comm.codecs import sparse
from gradsync.errors import OptionError


def test_codes_are_packed_end_to_end_most_significant_bit_first():
    # 3-bit codes 1, 2, 7, 0, 5 -> 001 010 111 000 101 (+ one pad bit) -> 00101011 10001010
    packed = sparse.bits_to_bytes(sparse.to_bits(torch.tensor([1, 2, 7, 0, 5]), 3).view(-1))
    assert packed.tolist() == [0b00101011, 0b10001010]
    codes = torch.randint(0, 2**14, (1001,), generator=torch.Generator().manual_seed(0))
    stream = sparse.bytes_to_bits(sparse.bits_to_bytes(sparse.to_bits(codes, 14).view(-1)))
    assert torch.equal(sparse.from_bits(stream[: 1001 * 14].view(1001, 14)), codes)


def test_message_is_low_index_and_value_code_per_entry_then_upper_bitmap_then_float32_scales():
    # one chunk of 8 entries, k = 2, 2-bit values: an index's low l = log2(8 / 2) = 2 bits go with
    # its value code (low << 2 | q), its high bit in unary in a 2 + 8 / 4 = 4-bit upper bitmap
    x = torch.tensor([0.0, -4.0, 0.0, 0.0, 0.0, 0.0, 1.5, 0.0])
    msg = sparse.encode(x, 8, 2, 2)
    # index 1 = 0b0|01 at -4 = -s: q = 0 -> 0100; index 6 = 0b1|10 at 1.5 ~ s/3: q = 2 -> 1010;
    # upper bitmap: high 0 + 0 and high 1 + 1 set -> 1010
    assert msg[:2].tolist() == [0b01001010, 0b10100000]
    assert msg[2:].clone().view(torch.float32).item() == 4.0
    positions, values = sparse.decode(msg, 8, 8, 2, 2)
    assert positions.tolist() == [1, 6] and values.tolist() == [-4.0, pytest.approx(4 / 3)]


def _chunk_bits(chunk, k, bits):
    """Elias-Fano's cost of k sorted indices below chunk, at the best split l, plus the value codes."""
    return k * bits + min(k * low + k + chunk // 2**low for low in range(int(math.log2(chunk)) + 1))


@pytest.mark.parametrize("n,chunk,k,bits", [(10_000, 4096, 64, 2), (4096, 4096, 64, 4), (1, 2, 1, 8), (777, 64, 5, 2),
                                            (300, 64, 64, 2), (5000, 1024, 100, 2)])
def test_message_bytes_is_the_formula(n, chunk, k, bits):
    chunks = math.ceil(n / chunk)
    expected = math.ceil(chunks * _chunk_bits(chunk, k, bits) / 8) + 4 * chunks
    assert sparse.encode(torch.randn(n), chunk, k, bits).numel() == expected == sparse.message_bytes(n, chunk, k, bits)


@pytest.mark.parametrize("chunk,k", [(4096, 64), (64, 1), (64, 64), (64, 63), (256, 5), (8, 3)])
def test_every_index_comes_back_from_its_code_and_the_upper_bitmap(chunk, k):
    # indices bunched at the start and at the end of a chunk fill the upper bitmap's ends
    g = torch.Generator().manual_seed(chunk + k)
    x = torch.randn(3 * chunk + chunk // 2, generator=g).mul_(0.01)
    x[:k] = torch.randn(k, generator=g).sign_().mul_(5)
    x[2 * chunk - k: 2 * chunk] = 7.0
    positions, _ = sparse.decode(sparse.encode(x, chunk, k, 2), x.numel(), chunk, k, 2)
    idx, _ = sparse.select(x, chunk, k)
    assert torch.equal(positions, (idx + torch.arange(idx.shape[0]).mul(chunk).unsqueeze(1)).view(-1))
    assert positions[:k].tolist() == list(range(k))
    assert positions[k:2 * k].tolist() == list(range(2 * chunk - k, 2 * chunk))


def test_defaults_send_64_of_4096_in_2_plus_8_bits_each_and_a_128_bit_bitmap():
    r = build_reducer("sparseloco", error_feedback=True)
    assert r.options() == {"sparse_chunk_size": 4096, "sparse_k": 64, "value_bits": 2, "error_feedback": True}
    n = 4096 * 1000
    bits_per_entry = 8 * sparse.message_bytes(n, 4096, 64, 2) / n
    # 64 x (2 value bits + 6 low index bits) + 128 bitmap bits + a 32-bit scale per 4096 entries
    assert bits_per_entry == pytest.approx((64 * 8 + 128 + 32) / 4096)
    assert 32 / bits_per_entry == pytest.approx(195.05, abs=0.01)


@pytest.mark.parametrize("options,named", [
    ({"sparse_chunk_size": 1000}, "sparse_chunk_size"),   # not a power of two
    ({"sparse_chunk_size": 1}, "sparse_chunk_size"),
    ({"sparse_k": 0}, "sparse_k"),
    ({"sparse_chunk_size": 64, "sparse_k": 65}, "sparse_k"),
    ({"value_bits": 3}, "value_bits"),
    ({"error_decay": 0.0}, "error_decay"),
    ({"error_decay": 1.5}, "error_decay"),
])
def test_bad_options_name_the_option_and_the_fix(options, named):
    with pytest.raises(OptionError) as err:
        build_reducer("sparseloco", error_feedback=True, **options)
    msg = str(err.value)
    assert named in msg and f"--strategy.{named}" in msg and "\n" not in msg


def test_decay_needs_error_feedback_and_other_codecs_refuse_sparse_options():
    with pytest.raises(OptionError, match="error_decay.*error_feedback"):
        build_reducer("sparseloco", error_feedback=False, error_decay=0.9)
    with pytest.raises(OptionError, match="sparse_k.*only by sparseloco"):
        check_codec_options("int8", {"sparse_k": 32})
    check_codec_options("sparseloco", {"sparse_k": 32, "chunk_size": 512, "fraction": 0.01})  # defaults pass


def test_periodic_strategies_run_rounds_through_it():
    from gradsync.strategies.diloco import DiLoCoStrategy
    from gradsync.strategies.local_sgd import LocalSGDStrategy

    for cls in (DiLoCoStrategy, LocalSGDStrategy):
        reducer = cls(codec="sparseloco", period=4).reducer
        assert reducer.codec == "sparseloco" and reducer.inner.options()["sparse_k"] == 64


def test_compressed_takes_the_codec_and_its_options():
    from gradsync.strategies.compressed import CompressedStrategy

    s = CompressedStrategy(codec="sparseloco", sparse_chunk_size=1024, sparse_k=16, value_bits=4, error_decay=0.9)
    reducer = s._new_reducer()
    assert reducer.decay == 0.9  # error feedback, decayed
    assert reducer.inner.options() == {"sparse_chunk_size": 1024, "sparse_k": 16, "value_bits": 4}
    assert s.corrects_momentum
    with pytest.raises(OptionError, match="--strategy.sparse_k"):
        CompressedStrategy(codec="sparseloco", sparse_k=5000)
    with pytest.raises(OptionError, match="sparse_k.*only by sparseloco"):
        CompressedStrategy(codec="topk", sparse_k=16)
