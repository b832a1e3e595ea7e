"""A process killed while writing a checkpoint never leaves a corrupt last.ckpt."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from gradsync.errors import GradsyncError
from gradsync.platform.checkpoint import atomic_torch_save, load_checkpoint_file

N = 4_000_000  # 16 MB: a save takes long enough to be interrupted


def _writer(path: str, started) -> None:
    i = 0
    while True:
        i += 1
        # every entry equals the step, so a torn mix of two saves would show
        atomic_torch_save({"step": i, "w": torch.full((N,), float(i))}, path)
        started.set()


@pytest.mark.timeout(120)
def test_sigkill_during_saves_never_corrupts(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 0, "w": torch.zeros(N)}, path)
    ctx = mp.get_context("fork")
    steps = []
    for delay in (0.05, 0.13, 0.21, 0.29, 0.37, 0.45):
        started = ctx.Event()
        proc = ctx.Process(target=_writer, args=(str(path), started))
        proc.start()
        assert started.wait(30)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        ckpt = load_checkpoint_file(path)
        assert ckpt["w"].numel() == N and bool((ckpt["w"] == ckpt["step"]).all())
        steps.append(ckpt["step"])
    assert all(s >= 1 for s in steps) and max(steps) >= 2


def test_truncated_checkpoint_is_a_one_line_error(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])   # what a non-atomic write killed halfway leaves
    with pytest.raises(GradsyncError, match="corrupt or not a checkpoint") as exc:
        load_checkpoint_file(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)
