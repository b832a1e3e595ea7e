"""What every suite shares: timing, the machine's description, writing tables, JSON and plots."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    if torch.cuda.is_available():
        gpu = f", GPU {torch.cuda.get_device_name(0)}"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM{gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def time_it(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1, sync: Optional[Callable] = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Report:
    """One suite's result: a table, notes, the command that made it, and its raw data."""

    suite: str
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    command: str = ""

    def markdown(self) -> str:
        def cell(v: Any) -> str:
            if isinstance(v, float):
                return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
            return str(v)

        lines = [f"## {self.title}", "", f"Command: `{self.command}`  ", f"Machine: {machine()}  ",
                 f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
                 "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def write(self, out: Path, plot: Optional[Callable[[Any], None]] = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.suite}.md").write_text(self.markdown())
        (out / f"{self.suite}.json").write_text(json.dumps(
            {"suite": self.suite, "title": self.title, "command": self.command, "machine": machine(),
             "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "columns": self.columns,
             "rows": self.rows, "notes": self.notes, "data": self.data}, indent=2, default=str) + "\n")
        if plot is not None:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4.2))
            plot(ax)
            ax.set_title(self.title, fontsize=10)
            fig.tight_layout()
            fig.savefig(out / f"{self.suite}.png", dpi=110)
            plt.close(fig)


def command_line() -> str:
    return "python -m benchmarks " + " ".join(sys.argv[1:])


def run_cli(args: list[str], *, env: Optional[dict] = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``gradsync <args>`` in a fresh interpreter and fail loudly if it fails."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})}
    r = subprocess.run([sys.executable, "-m", "gradsync.cli.main", *args], capture_output=True, text=True,
                       timeout=timeout, env=full_env)
    if r.returncode != 0:
        raise RuntimeError(f"gradsync {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r
