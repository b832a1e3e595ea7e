"""The digits model, scripted for fault-tolerance tests.

* ``$FT_STEP_SECONDS``: every training step sleeps this long;
* ``$FT_DIE_AT``: the process dies (SIGKILL, no clean-up) when that training step begins (under torchrun: on
  its first attempt, and only the process of global rank ``$FT_DIE_RANK`` when that is set);
* ``$FT_HOLD_AT`` and ``$FT_HOLD_FILE``: at that step, create ``<FT_HOLD_FILE>.waiting`` and wait (up to
  180 s) until the file exists;
* ``$FT_STARTED_FILE``: create this file when training starts;
* ``$FT_RESTARTED_FILE``: create this file when training starts in an attempt that torchrun restarted;
* ``$FT_FIRST_STEP_FILE``: create this file when the first training step begins.

``GradientDigits`` also writes, when ``$FT_GRADS_DIR`` is set, ``step<N>.pt`` there for every step: this
group's own gradient of the step's loss (taken from the same graph before backward, so before any
all-reduce) and the gradient the optimizer is about to apply (None when the step was dropped).

So a test can kill a group mid-period and keep the others training until the restarted one is back,
however slow the machine is to start a process.
"""

import os
import signal
import time
from pathlib import Path

import torch

from gradsync.recipes import DigitsClassifier


class PacedDigits(DigitsClassifier):
    def on_train_start(self):
        super().on_train_start()
        if os.environ.get("FT_STARTED_FILE"):
            Path(os.environ["FT_STARTED_FILE"]).touch()
        if os.environ.get("FT_RESTARTED_FILE") and _attempt() > 0:
            Path(os.environ["FT_RESTARTED_FILE"]).touch()

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        if os.environ.get("FT_FIRST_STEP_FILE"):
            Path(os.environ["FT_FIRST_STEP_FILE"]).touch()
        step = self.trainer.global_step
        rank = os.environ.get("FT_DIE_RANK")
        if (os.environ.get("FT_DIE_AT") and step == int(os.environ["FT_DIE_AT"]) and _attempt() == 0
                and (rank is None or int(rank) == self.trainer.global_rank)):
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("FT_HOLD_AT") and step == int(os.environ["FT_HOLD_AT"]):
            Path(os.environ["FT_HOLD_FILE"] + ".waiting").touch()
            deadline = time.monotonic() + 180
            while not Path(os.environ["FT_HOLD_FILE"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(float(os.environ.get("FT_STEP_SECONDS", "0")))


def _attempt() -> int:
    """Which attempt of torchrun's this process is (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class GradientDigits(PacedDigits):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if os.environ.get("FT_GRADS_DIR"):
            params = [p for p in self.parameters() if p.requires_grad]
            self._own = [g.detach().clone() for g in torch.autograd.grad(loss, params, retain_graph=True)]
        return loss

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        if os.environ.get("FT_GRADS_DIR"):
            params = [p for p in self.parameters() if p.requires_grad]
            applied = None if any(p.grad is None for p in params) else [p.grad.detach().clone() for p in params]
            torch.save({"own": self._own, "applied": applied},
                       Path(os.environ["FT_GRADS_DIR"]) / f"step{self.trainer.global_step}.pt")
