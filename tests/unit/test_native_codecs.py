"""The native CPU codec kernels (``native.c``) give the eager code's bytes, for every codec they serve.

Each case encodes (and decodes) the same input twice, with ``GRADSYNC_NATIVE_CODECS=0`` (and the
compiled int8 kernel off) for the eager reference and with the kernels on, and compares the bytes:
tails and odd sizes, values from fp16 and bf16 (many equal magnitudes: sparseloco's and top-k's
ties), zeros and -0.0. Building the library takes about a second, once per machine.
"""


import pytest
import torch

from gradsync.comm.codecs import int8, native, sign, sparse, topk
from gradsync.comm.codecs.int8 import Int4Reducer, Int8Reducer

pytestmark = pytest.mark.timeout(120)


def values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.logspace(-3, 1, n)).to(dtype).float()
    x[: n // 10] = 0.0
    x[n // 10: n // 10 + 3] = -0.0
    return x


@pytest.fixture
def eager(monkeypatch):
    """Run a function with every kernel off: the eager reference."""
    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setenv("GRADSYNC_NATIVE_CODECS", "0")
            m.setenv("GRADSYNC_COMPILED_CODECS", "0")
            return fn(*args, **kwargs)
    return run


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    monkeypatch.setenv("GRADSYNC_NATIVE_CODECS", "1")
    monkeypatch.setenv("GRADSYNC_COMPILED_CODECS", "0")  # the native kernel, not Inductor's


def used(*names: str) -> bool:
    """The native kernels ``names`` passed their probes and so ran (a failed probe falls back to eager)."""
    return all(native._checked.get(name) is True for name in names)


def test_the_library_builds_here_and_every_probe_passes():
    assert native.build().exists()
    assert sparse._probe_encode() and sparse._probe_decode()
    assert sign._probe_compress() and sign._probe_decompress()
    assert topk._probe_candidates() and topk._probe_decode()
    assert int8._probe_scales() and int8._probe_decode() and int8._probe_int4() and int8._probe_round()


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,chunk,k,bits", [
    (3 * 4096, 4096, 64, 2),     # whole chunks, the defaults
    (10_000, 4096, 64, 4),       # a short last chunk
    (777, 64, 5, 8),             # small chunks, odd size
    (50, 64, 60, 2),             # one chunk, k near the chunk, mostly padding
    (4097, 2048, 1, 2),          # k = 1
])
def test_sparse_messages_and_sums_are_the_eager_bytes(eager, dtype, n, chunk, k, bits):
    x = values(n, dtype, seed=n + k)
    msg = sparse.encode(x, chunk, k, bits)
    assert torch.equal(msg, eager(sparse.encode, x, chunk, k, bits))
    msgs = torch.stack([msg, sparse.encode(x.flip(0), chunk, k, bits), sparse.encode(-x, chunk, k, bits)])
    assert torch.equal(sparse.decode_sum(msgs, n, chunk, k, bits), eager(sparse.decode_sum, msgs, n, chunk, k, bits))
    assert used("sparse_encode", "sparse_decode_sum")


def test_sparse_ties_go_to_the_lower_index(eager):
    # magnitudes 3, 1, 3, 3, 2 in a chunk of 8 (3 padding zeros), k = 2: the first two 3s
    x = torch.tensor([3.0, 1.0, -3.0, 3.0, 2.0])
    for fn in (sparse.encode, lambda *a: eager(sparse.encode, *a)):
        positions, vals = sparse.decode(fn(x, 8, 2, 2), 5, 8, 2, 2)
        assert positions.tolist() == [0, 2] and vals.tolist() == [3.0, -3.0]
    assert used("sparse_encode")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,chunk", [(4096, 512), (1000, 64), (8, 1024), (2056, 2048), (1 << 20, 2048)])
def test_sign_messages_and_values_are_the_eager_bytes(eager, dtype, n, chunk):
    x = values(n, dtype, seed=n)
    packed, scales = sign.compress(x, chunk)
    ref_packed, ref_scales = eager(sign.compress, x, chunk)
    assert torch.equal(packed, ref_packed) and torch.equal(scales, ref_scales)
    assert torch.equal(sign.decompress(packed, scales, chunk), eager(sign.decompress, packed, scales, chunk))
    assert used("sign_encode", "sign_decode")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,fraction", [(1 << 20, 0.01), ((1 << 20) + 13, 0.003), (5000, 0.01)])
def test_topk_messages_and_values_are_the_eager_bytes(eager, dtype, n, fraction):
    x = values(n, dtype, seed=n)
    k = topk.num_kept(n, fraction)
    idx, vals = topk.compress(x, k)
    ref_idx, ref_vals = eager(topk.compress, x, k)
    assert torch.equal(idx, ref_idx) and torch.equal(vals, ref_vals)
    assert torch.equal(topk.decompress(idx, vals, n), eager(topk.decompress, idx, vals, n))
    assert used("topk_decode") and (n < 4 * topk.SAMPLE or used("topk_candidates"))


@pytest.mark.parametrize("cls", [Int8Reducer, Int4Reducer])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,shard,chunk", [(1, 4096, 512), (2, 1000, 64), (3, 2050, 2048), (2, 778, 8)])
def test_quantized_messages_and_values_are_the_eager_bytes(eager, cls, dtype, rows, shard, chunk):
    x = values(rows * shard, dtype, seed=shard).view(rows, shard)

    def roundtrip():
        reducer = cls(chunk_size=chunk, seed=5)
        msgs = torch.empty(rows, reducer.message_bytes(shard), dtype=torch.uint8)
        reducer.encode(x, msgs, torch.empty(rows, shard), divisor=2)
        return msgs, reducer.decode(msgs, shard, torch.empty(rows, shard))

    (msgs, out), (ref_msgs, ref_out) = roundtrip(), eager(roundtrip)
    assert torch.equal(msgs, ref_msgs) and torch.equal(out, ref_out)
    assert used("absmax_chunks", "quant_round", "int4_decode" if cls is Int4Reducer else "int8_decode")


def test_a_kernel_that_fails_its_probe_is_not_used(monkeypatch):
    monkeypatch.setattr(native, "_checked", {})
    with pytest.warns(UserWarning, match="gives other bytes than the eager code"):
        assert native.kernel("sign_encode", lambda: False) is None
    assert native.kernel("sign_encode", lambda: True) is None  # decided once per process
    monkeypatch.setattr(native, "_checked", {})
    assert native.kernel("sign_encode", lambda: True) is not None


def test_the_rounding_probe_catches_a_kernel_that_rounds_twice():
    # int8/int4's native rounding is one fused multiply-add, as torch's addcmul on a CPU with FMA.
    # A kernel rounding x * inv and then + noise gives other codes on the probe's entries.
    from gradsync.comm.codecs import fused
    x, inv, a, b = fused.probe_inputs(torch.device("cpu"))
    w = torch.bitwise_xor(a.unsqueeze(2), b).view(torch.float32)
    twice = (x * inv.unsqueeze(2)).add(w).to(torch.uint8)
    assert (twice != fused.round_codes_eager(x, inv, a, b)).sum() > 100
    assert int8._probe_round()


def test_without_a_compiler_the_eager_code_runs_with_one_warning(monkeypatch, tmp_path, eager):
    monkeypatch.setattr(native, "_state", "unbuilt")
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there
    x = values(5000, torch.float32, seed=0)
    with pytest.warns(UserWarning, match="native codec kernels are off"):
        msg = sparse.encode(x, 4096, 64, 2)
    assert torch.equal(msg, eager(sparse.encode, x, 4096, 64, 2))
    assert native._load() is None


def test_the_library_is_cached_by_source_compiler_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = native.build()
    mtime = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert first.parent == tmp_path / "gradsync" and not [p for p in first.parent.iterdir() if p != first]
    assert first.name.startswith("codecs-") and first.suffix == ".so"
