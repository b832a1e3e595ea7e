"""The compiled int8/int4 encoder gives the eager encoder's bytes (tails, odd sizes, fp16/bf16 inputs).

One compile (~10-25 s on a 2-core CPU, then cached on disk by Inductor) serves the whole module.
"""

import pytest
import torch

from gradsync.comm.codecs import fused
from gradsync.comm.codecs.int8 import Int4Reducer, Int8Reducer

pytestmark = pytest.mark.timeout(300)


def messages(cls, x: torch.Tensor, chunk: int, compiled: bool, monkeypatch) -> torch.Tensor:
    """Every row of ``x`` (rows, shard) encoded by a fresh reducer (the same noise draw either way)."""
    monkeypatch.setenv("GRADSYNC_COMPILED_CODECS", "1" if compiled else "0")
    monkeypatch.setenv("GRADSYNC_NATIVE_CODECS", "0")  # the native kernels come first on CPU: tested apart
    reducer = cls(chunk_size=chunk, seed=5)
    rows, shard = x.shape
    msgs = torch.empty(rows, reducer.message_bytes(shard), dtype=torch.uint8)
    reducer.encode(x, msgs, torch.empty(rows, shard), divisor=2)
    return msgs


@pytest.mark.parametrize("cls", [Int8Reducer, Int4Reducer])
@pytest.mark.parametrize("rows,shard,chunk,dtype", [
    (1, 4096, 512, torch.float32),      # whole chunks
    (2, 1000, 64, torch.float32),       # a partial last chunk (40 entries), two rows
    (3, 2050, 2048, torch.float16),     # one whole chunk and a 2-entry tail, fp16 values
    (2, 778, 8, torch.bfloat16),        # the smallest chunk, bf16 values
])
def test_compiled_messages_are_the_eager_bytes(cls, rows, shard, chunk, dtype, monkeypatch):
    g = torch.Generator().manual_seed(shard)
    x = (torch.randn(rows, shard, generator=g) * torch.logspace(-4, 2, shard)).to(dtype).float()
    eager = messages(cls, x, chunk, False, monkeypatch)
    compiled = messages(cls, x, chunk, True, monkeypatch)
    kernel = fused._kernels.get("cpu")
    assert kernel is not None, "the compiled encoder was not used (compile failed here?)"
    assert torch.equal(compiled, eager)
    # random messages rarely land a rounding away from a code boundary; the probe's entries all do
    probe = fused.probe_inputs(torch.device("cpu"))
    assert torch.equal(kernel(*probe), fused.round_codes_eager(*probe))


def test_the_probe_catches_a_kernel_that_rounds_twice():
    # Without contraction the compiled x * inv + noise is rounded twice, eager addcmul once: the probe
    # (inputs a rounding away from an integer) shows it, so such a kernel is never used.
    probe = fused.probe_inputs(torch.device("cpu"))
    eager = fused.round_codes_eager(*probe)
    w = torch.bitwise_xor(probe[2].unsqueeze(2), probe[3]).view(torch.float32)
    twice = (probe[0] * probe[1].unsqueeze(2)).add(w).to(torch.uint8)  # eager, two roundings
    assert (twice != eager).sum() > 100


def test_small_vectors_stay_eager(monkeypatch):
    monkeypatch.setenv("GRADSYNC_COMPILED_CODECS", "auto")
    assert not fused.wanted(fused.MIN_NUMEL - 1) and fused.wanted(fused.MIN_NUMEL)
    monkeypatch.setenv("GRADSYNC_COMPILED_CODECS", "0")
    assert not fused.wanted(1 << 30)
