"""Native CPU kernels for the selection and bit-packing codecs (``native.c``, built with the system C compiler).

The sign, top-k and sparse codecs spend their eager time in passes a vectorized loop does at
once: sign's mean |x| and bit packing, top-k's search for candidates above a threshold,
sparseloco's per-chunk top-k, quantization and bit packing (the eager code sorts every chunk).
``native.c`` does each in one pass over the input. It is plain C with no torch headers, so it
builds in well under a second with ``gcc -O3 -march=native -ffp-contract=off`` (no fused
multiply-add, so every float operation rounds as the eager code's does), once per machine: the
shared library is cached under ``$XDG_CACHE_HOME/gradsync`` (``~/.cache/gradsync``), keyed by the
source, the compiler and the CPU, and written atomically.

The eager code stays the reference. Before first use, each kernel runs next to it on a probe
(random values with ties, a short last chunk, NaN-free) and is used only if every byte agrees;
a missing compiler, a failed build or a mismatch switches the kernels off with one warning and the
eager code runs. The kernels take contiguous float32 CPU tensors; anything else (CUDA, other
dtypes) takes the eager path. ``GRADSYNC_NATIVE_CODECS=0`` turns them off (the eager code, or on
CUDA and without them the ``torch.compile`` kernel of :mod:`~gradsync.comm.codecs.fused`, runs).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")

_lock = threading.RLock()  # a probe, run under it, loads the library again
_lib: Optional[ctypes.CDLL] = None
_state = "unbuilt"  # unbuilt | on | off
_checked: dict[str, bool] = {}  # kernel -> passed its probe

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
SIGNATURES = {
    "sign_encode": ([_ptr, _i64, _i64, _ptr, _ptr], None),
    "sign_decode": ([_ptr, _ptr, _i64, _i64, _ptr], None),
    "topk_candidates": ([_ptr, _i64, _f32, _ptr, _ptr, _i64], _i64),
    "topk_decode": ([_ptr, _ptr, _i64, _i64, _ptr], _int),
    "sparse_encode": ([_ptr, _i64, _i64, _i64, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr], None),
    "absmax_chunks": ([_ptr, _i64, _i64, _i64, _ptr], None),
    "int8_decode": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], None),
    "int4_decode": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], None),
    "quant_round": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _int], None),
    "sparse_decode_sum": ([_ptr, _i64, _i64, _i64, _i64, _i64, _int, _int, _ptr, _ptr], None),
}


def enabled() -> bool:
    return os.environ.get("GRADSYNC_NATIVE_CODECS", "1") != "0"


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_signature() -> str:
    """The CPU model and its feature flags: -march=native code is only valid on the CPU it was built for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor() or platform.machine()


def library_path(compiler: str) -> Path:
    """Where the library built from this source, with this compiler, for this CPU is cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature()]).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradsync"
    return cache / f"codecs-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Build the library (or find it cached) and return its path; raises on a failed build."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    path = library_path(compiler)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, path)  # atomic: concurrent ranks each build, the last rename wins, all equal
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _state
    with _lock:
        if _state == "unbuilt":
            try:
                lib = ctypes.CDLL(str(build()))
                for name, (args, result) in SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, result
                _lib, _state = lib, "on"
            except Exception as err:  # no compiler, a failed build: eager is always correct
                _state = "off"
                warnings.warn(f"gradsync: the native codec kernels are off ({type(err).__name__}: {err}); "
                              "the eager codecs run", stacklevel=3)
        return _lib if _state == "on" else None


def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernels may take these tensors: on, CPU, contiguous."""
    return enabled() and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def rows_usable(t: torch.Tensor) -> bool:
    """True for a CPU matrix whose rows are contiguous (any row stride): the kernels that take a stride."""
    return enabled() and t.device.type == "cpu" and t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


def raw(name: str) -> Optional[Callable]:
    """The native function ``name`` without its check (probes and tests call this), or None when off."""
    lib = _load()
    return getattr(lib, name) if lib is not None else None


def kernel(name: str, probe: Callable[[], bool]) -> Optional[Callable]:
    """The native function ``name``, or None: off, failed to build, or its ``probe`` (run once per
    process: does :func:`raw` ``name`` give the eager code's bytes?) failed."""
    if _load() is None:
        return None
    with _lock:
        if name not in _checked:
            try:
                ok = bool(probe())
                if not ok:
                    warnings.warn(f"gradsync: the native {name} kernel gives other bytes than the eager code on "
                                  "this machine; the eager code runs", stacklevel=3)
            except Exception as err:
                ok = False
                warnings.warn(f"gradsync: the native {name} kernel failed its check ({type(err).__name__}: {err}); "
                              "the eager code runs", stacklevel=3)
            _checked[name] = ok
    return raw(name) if _checked[name] else None


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()
