import os
import sys
from pathlib import Path

# Tests never touch the network or prompt: W&B runs offline, and worker threads stay few on 2 cores.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

sys.path.insert(0, str(Path(__file__).parent))
