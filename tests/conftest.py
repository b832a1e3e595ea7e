import os
import sys
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
