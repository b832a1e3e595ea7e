import multiprocessing
import os
import sys
import threading
from pathlib import Path

# Tests never touch the network or prompt: W&B runs offline, and worker threads stay few on 2 cores.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_environment():
    """Lightning's launchers write MASTER_*, WORLD_SIZE, LOCAL_RANK ... into os.environ; a later test
    that starts processes would inherit them and think it runs under a launcher. Restore after each test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_threads_or_children_left():
    """The in-process fits fork this process, so nothing with threads may outlive a test: a process
    group an in-process fit left behind (tests/harness.py collects its garbage before forking), W&B's
    service threads. Any worker a failed or timed-out fit left behind is killed, so one hang costs one
    test, not the suite (multiprocessing's exit hook would otherwise wait on it forever)."""
    def group_is_up() -> bool:
        dist = sys.modules.get("torch.distributed")
        return dist is not None and dist.is_available() and dist.is_initialized()

    had_group = group_is_up()  # a wider fixture's group (e.g. a module's one-process group) stays
    yield
    if group_is_up() and not had_group:
        sys.modules["torch.distributed"].destroy_process_group()
    if "wandb" in sys.modules and any(t.name.startswith("wandb") for t in threading.enumerate()):
        sys.modules["wandb"].teardown()
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)
