"""Compiled kernels for the codecs' elementwise passes (``torch.compile``: C++ on CPU, Triton on CUDA).

The eager code stays the reference and the fallback. A fused kernel is used only where it gives
the eager path's bytes: once per process and device type it runs next to the eager code on a
probe and, should one byte differ, it is switched off with a warning; any compile or run error
switches it off too. Compiling costs ~20 s on a 2-core CPU (then it is in Inductor's on-disk
cache for later runs), so only vectors of at least :data:`MIN_NUMEL` entries use it.

``GRADSYNC_COMPILED_CODECS=0`` turns it off; ``=1`` keeps it on at any size (tests). On CPU the
native kernels of :mod:`~gradsync.comm.codecs.native` (plain C, built in a second) come first and
this one serves where they are off (``GRADSYNC_NATIVE_CODECS=0``) or cannot run (CUDA: Triton).

**int8 / int4 encode.** Eager stochastic rounding takes three passes over the chunked message
(``bitwise_xor`` of the noise tables into a float32 buffer, ``addcmul`` into it, a conversion to
bytes); fused it is one read of ``x`` and one write of the codes (~1 ms instead of 6-14 ms for 4M
entries on one CPU thread). Eager ``addcmul`` rounds ``x * inv + noise`` once (a fused
multiply-add on CPUs that have one); the kernel is compiled with floating-point contraction
(``-ffp-contract=fast``) so that its ``x * inv + noise`` is one FMA too — without it, 3 of 4M codes
differed by one.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Optional

import torch

#: Entries below which the eager path runs (a compile is not repaid by a short run's small messages).
MIN_NUMEL = 1 << 22

_lock = threading.Lock()
_kernels: dict[str, Optional[Callable]] = {}  # device type -> compiled kernel (None: off here)


def _mode() -> str:
    return os.environ.get("GRADSYNC_COMPILED_CODECS", "auto")


def round_codes_eager(x: torch.Tensor, inv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reference: ``floor(x inv + 2^e + u)`` as bytes, ``2^e + u`` the float32 bits ``a[r, c] ^ b[j]``.

    ``x`` (rows, chunks, chunk) float32, ``inv`` (rows, chunks) float32, ``a`` (rows, chunks) and
    ``b`` (chunk) int32. Every value lies in [1, 256): truncation is the floor."""
    w = torch.bitwise_xor(a.unsqueeze(2), b).view(torch.float32)
    return torch.addcmul(w, x, inv.unsqueeze(2)).to(torch.uint8)


def _round_codes(x: torch.Tensor, inv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    w = torch.bitwise_xor(a.unsqueeze(2), b).view(torch.float32)
    return (x * inv.unsqueeze(2) + w).to(torch.uint8)


def probe_inputs(device: torch.device) -> tuple[torch.Tensor, ...]:
    """int8-shaped inputs whose ``x inv + noise`` lies within float32 rounding of an integer: where one
    rounding (FMA) and two (multiply, then add) give codes that differ by one."""
    g = torch.Generator().manual_seed(0)
    rows, chunks, chunk = 2, 8, 1024
    inv = torch.rand(rows, chunks, generator=g, dtype=torch.float64).mul(100).add(1).float()
    a = torch.randint(0, 1 << 16, (rows, chunks), generator=g, dtype=torch.int32).bitwise_or((127 + 7) << 23)
    b = torch.randint(0, 1 << 16, (chunk,), generator=g, dtype=torch.int32)
    w = torch.bitwise_xor(a.unsqueeze(2), b).view(torch.float32).double()
    k = torch.randint(1, 255, (rows, chunks, chunk), generator=g).double()
    x = ((k - w) / inv.double().unsqueeze(2)).float()  # x inv + w = k, up to float32 rounding
    return tuple(t.to(device) for t in (x, inv, a, b))


def _build(device: torch.device) -> Optional[Callable]:
    try:
        kernel = torch.compile(_round_codes, dynamic=True,
                               options={"cpp.enable_floating_point_contract_flag": "fast"})
        probe = probe_inputs(device)
        if torch.equal(kernel(*probe), round_codes_eager(*probe)):
            return kernel
        warnings.warn(f"gradsync: the compiled int8/int4 encoder gives other bytes than the eager one on {device.type}; "
                      "using the eager encoder", stacklevel=3)
    except Exception as err:  # a missing compiler, an unsupported backend: eager is always correct
        warnings.warn(f"gradsync: compiling the int8/int4 encoder failed ({type(err).__name__}: {err}); "
                      "using the eager encoder", stacklevel=3)
    return None


def wanted(numel: int) -> bool:
    """True when a vector of ``numel`` entries should take the compiled kernel (if it works here)."""
    mode = _mode()
    return mode != "0" and (mode == "1" or numel >= MIN_NUMEL)


def round_codes(x: torch.Tensor, inv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`round_codes_eager`, by the compiled kernel where it is on and ``x`` is large enough."""
    if not wanted(x.numel()):
        return round_codes_eager(x, inv, a, b)
    kind = x.device.type
    # One caller at a time: encodes run on the caller's thread and on gloo's callback threads, and a
    # call that meets new shapes or strides recompiles.
    with _lock:
        if kind not in _kernels:
            _kernels[kind] = _build(x.device)
        kernel = _kernels[kind]
        if kernel is not None:
            try:
                return kernel(x, inv, a, b)
            except Exception as err:
                _kernels[kind] = None
                failure = err
    if kernel is not None:
        warnings.warn(f"gradsync: the compiled int8/int4 encoder failed ({type(failure).__name__}: {failure}); "
                      "using the eager encoder", stacklevel=2)
    return round_codes_eager(x, inv, a, b)
