"""``sparseloco``: its bit layout, message size and options (the reduction itself: distributed/test_sparse_gloo.py)."""

import math

import pytest
import torch

from gradsync.comm import build_reducer, check_codec_options
from gradsync.comm.codecs import sparse
from gradsync.errors import OptionError


def test_codes_are_packed_end_to_end_most_significant_bit_first():
    # 3-bit codes 1, 2, 7, 0, 5 -> 001 010 111 000 101 (+ one pad bit) -> 00101011 10001010
    packed = sparse.pack_bits(torch.tensor([1, 2, 7, 0, 5]), 3)
    assert packed.tolist() == [0b00101011, 0b10001010]
    codes = torch.randint(0, 2**14, (1001,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(sparse.unpack_bits(sparse.pack_bits(codes, 14), 14, 1001), codes)


def test_message_is_index_then_value_code_per_entry_then_float32_scales():
    # one chunk of 8 entries, k = 2, 2-bit values: 5-bit codes (index << 2 | q), then the scale
    x = torch.tensor([0.0, -4.0, 0.0, 0.0, 0.0, 0.0, 1.5, 0.0])
    msg = sparse.encode(x, 8, 2, 2)
    # index 1 at -4 = -s: q = 0 -> 00100; index 6 at 1.5 ~ s/3 = 1.333: q = 2 -> 11010
    assert msg[:2].tolist() == [0b00100110, 0b10000000]
    assert msg[2:].clone().view(torch.float32).item() == 4.0
    positions, values = sparse.decode(msg, 8, 8, 2, 2)
    assert positions.tolist() == [1, 6] and values.tolist() == [-4.0, pytest.approx(4 / 3)]


@pytest.mark.parametrize("n,chunk,k,bits", [(10_000, 4096, 64, 2), (4096, 4096, 64, 4), (1, 2, 1, 8), (777, 64, 5, 2)])
def test_message_bytes_is_the_formula(n, chunk, k, bits):
    chunks = math.ceil(n / chunk)
    expected = math.ceil(chunks * k * (math.log2(chunk) + bits) / 8) + 4 * chunks
    assert sparse.encode(torch.randn(n), chunk, k, bits).numel() == expected == sparse.message_bytes(n, chunk, k, bits)


def test_defaults_send_64_of_4096_in_14_bits_each():
    r = build_reducer("sparseloco", error_feedback=True)
    assert r.options() == {"sparse_chunk_size": 4096, "sparse_k": 64, "value_bits": 2, "error_feedback": True}
    n = 4096 * 1000
    bits_per_entry = 8 * sparse.message_bytes(n, 4096, 64, 2) / n
    assert bits_per_entry == pytest.approx(64 / 4096 * 14 + 32 / 4096)
    assert 32 / bits_per_entry == pytest.approx(141.24, abs=0.01)


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
