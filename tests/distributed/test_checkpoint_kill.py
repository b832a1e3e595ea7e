"""A rank killed in the middle of writing a checkpoint, through Lightning's own save path with two
ranks: the previous last.ckpt and its parts stay whole, and the run resumes from them.

The kill is deterministic: ``torch.save`` is wrapped so that, on the chosen rank and file, it writes
half of the file's bytes, flushes them, and SIGKILLs its own process while the file is open."""

import io
import os
import signal

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from gradsync.platform.checkpoint import load_checkpoint_file
from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies.local_sgd import LocalSGDStrategy
from gradsync.strategies.parts import read_parts
from harness import assert_resumed_at, fit

pytestmark = pytest.mark.timeout(180)

ARMED = {"on": False}
real_save = torch.save


def half_then_die(target_rank: int, kind: str):
    def save(obj, f, *args, **kwargs):
        is_manifest = isinstance(obj, dict) and "state_dict" in obj
        if ARMED["on"] and dist.get_rank() == target_rank and is_manifest == (kind == "manifest"):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)  # dies with the file open, half written
        return real_save(obj, f, *args, **kwargs)
    return save


class SaveAt(Callback):
    def __init__(self, path, steps):
        self.path, self.steps = path, steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            ARMED["on"] = trainer.global_step == max(self.steps)  # the second save is the one killed
            trainer.save_checkpoint(self.path)


def model():
    torch.manual_seed(0)
    return DigitsClassifier()


@pytest.mark.parametrize("rank, kind", [(1, "part"), (0, "manifest")])
def test_rank_killed_mid_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch, rank, kind):
    ckpt = tmp_path / "last.ckpt"
    monkeypatch.setattr(torch, "save", half_then_die(rank, kind))
    with pytest.raises(Exception):  # the killed rank ends the fit
        fit(model(), DigitsData(batch_size=16), strategy=LocalSGDStrategy(period=3), devices=2, max_steps=12,
            out=tmp_path / "killed", callbacks=(SaveAt(ckpt, (4, 8)),))
    saved = load_checkpoint_file(ckpt)
    assert saved["global_step"] == 4  # the step-4 checkpoint, not a torn step-8 one
    assert any(tmp_path.rglob(".*.tmp")), "the kill did not land inside a write"  # the half-written temp file
    parts = read_parts(ckpt)
    assert len(parts) == 2  # both ranks' parts of the step-4 checkpoint load
    monkeypatch.setattr(torch, "save", real_save)
    ARMED["on"] = False
    resumed = fit(model(), DigitsData(batch_size=16), strategy=LocalSGDStrategy(period=3), devices=2, max_steps=12,
                  out=tmp_path / "resumed", ckpt_path=str(ckpt))
    assert_resumed_at(resumed, 4, 12)
