"""``gradsync compare RUN_DIR...``: finished runs side by side, as a table and as plots.

    gradsync compare runs/sync runs/int8 runs/local_sgd --output-dir runs/compare

Reads each run's ``summary.json`` and ``logs/metrics.csv`` (written by every run with
``--output-dir``), prints a table with one column per run, writes it as ``comparison.md`` and
draws three PNG plots (matplotlib, no display needed):

* ``loss_vs_step.png``: training loss against training steps: what each strategy does per step;
* ``loss_vs_wire_bytes.png``: training loss against the bytes each rank sent: what it costs on the
  network (the picture that shows which strategy wins on a slow link);
* ``val_vs_wall_time.png``: the validation metric against training wall time.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from gradsync.errors import GradsyncError
from gradsync.platform.report import per_node

PLOTS = ("loss_vs_step.png", "loss_vs_wire_bytes.png", "val_vs_wall_time.png")


@dataclass
class RunRecord:
    """One run's output directory, read back."""

    path: Path
    label: str
    summary: dict
    rows: list[dict] = field(default_factory=list)  # metrics.csv, numbers parsed, empty cells dropped

    @property
    def val_metric(self) -> str:
        """The recipe's headline validation metric (e.g. ``val_acc``), else ``val_loss``."""
        names = [k for k in (self.summary.get("metrics") or {}) if k.startswith("val_") and k != "val_loss"]
        return names[0] if names else "val_loss"

    def series(self, y: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(xs, ys) of the rows holding both ``x`` and ``y``, sorted by step."""
        pts = [(r[x], r[y]) for r in self.rows if x in r and y in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    def at_step(self, key: str, steps: list[float]) -> list[Optional[float]]:
        """``key`` (logged per training step) at each of ``steps``, interpolated linearly."""
        xs, ys = self.series(key)
        return [_interp(s, xs, ys) for s in steps]


def _interp(x: float, xs: list[float], ys: list[float]) -> Optional[float]:
    if not xs:
        return None
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def read_run(path: Path, label: Optional[str] = None) -> RunRecord:
    """Read one run dir; a one-line error when it is missing or not a gradsync run."""
    path = Path(path)
    if not path.is_dir():
        raise GradsyncError(f"compare: run directory {path} does not exist")
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        raise GradsyncError(f"compare: {path} has no summary.json; pass the --output-dir of a finished gradsync run")
    try:
        summary = json.loads(summary_file.read_text())
    except (OSError, ValueError) as exc:
        raise GradsyncError(f"compare: {summary_file} is not valid JSON ({' '.join(str(exc).split())})") from None
    rows: list[dict] = []
    metrics_file = path / "logs" / "metrics.csv"
    if metrics_file.is_file():
        with open(metrics_file, newline="") as f:
            for raw in csv.DictReader(f):
                row = {}
                for k, v in raw.items():
                    try:
                        if k and v not in (None, ""):
                            row[k] = float(v)
                    except ValueError:
                        pass
                if "step" in row:
                    rows.append(row)
        rows.sort(key=lambda r: r["step"])
    return RunRecord(path=path, label=label or path.name or str(path), summary=summary, rows=rows)


def read_runs(paths: Sequence[Path], labels: Optional[Sequence[str]] = None) -> list[RunRecord]:
    if labels and len(labels) != len(paths):
        raise GradsyncError(f"compare: --labels has {len(labels)} names for {len(paths)} run directories")
    runs = [read_run(Path(p), labels[i] if labels else None) for i, p in enumerate(paths)]
    seen: dict[str, int] = {}
    for r in runs:  # two runs named "run" in different parents: tell them apart
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = str(r.path)
    return runs


# ---- the table -------------------------------------------------------------------------------
def _b(n: Any) -> str:
    from gradsync.platform.report import _fmt_bytes

    return _fmt_bytes(n)


def _f(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}g}"
    return str(v)


def comparison_rows(runs: list[RunRecord]) -> list[tuple[str, list[str]]]:
    """(row name, one cell per run)."""
    def col(fn) -> list[str]:
        out = []
        for r in runs:
            try:
                out.append(fn(r.summary))
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                out.append("n/a")
        return out

    shared = shared_options(runs)  # listed once under the table; each column shows what sets its run apart

    def opts(s: dict) -> str:
        o = s.get("strategy_options") or {}
        return ", ".join(f"{k}={v}" for k, v in o.items()
                         if (k, json.dumps(v, sort_keys=True, default=str)) not in shared) or "-"

    def metric(name: str):
        return lambda s: _f((s.get("metrics") or {}).get(name))

    metric_names: list[str] = []
    for r in runs:
        for k in (r.summary.get("metrics") or {}):
            if k not in metric_names:
                metric_names.append(k)
    rows = [
        ("strategy", col(lambda s: s["strategy"])),
        ("options", col(opts)),
        ("recipe", col(lambda s: s["recipe"])),
        ("processes x nodes", col(lambda s: f"{per_node(s)} x {s['num_nodes']}")),
        ("global batch", col(lambda s: f"{s['global_batch_size']} (K={s.get('accumulation_steps', 1)})")),
        ("training steps", col(lambda s: str(s["global_step"]))),
    ]
    rows += [(k, col(metric(k))) for k in metric_names]
    rows += [
        ("wire bytes / rank", col(lambda s: _b(s["comm"]["wire_bytes"]))),
        ("fp32 sync would send", col(lambda s: _b(s["comm"]["logical_bytes"]))),
        ("compression ratio", col(lambda s: _f(s["comm"]["compression_ratio"]))),
        ("collectives", col(lambda s: str(s["comm"]["collectives"]))),
        ("communication s", col(lambda s: _f(s["comm"]["seconds"], 3))),
        ("train time s", col(lambda s: _f(s.get("train_seconds"), 3))),
        ("wall time s", col(lambda s: _f(s["wall_seconds"], 3))),
        ("samples/s", col(lambda s: _f(s["samples_per_second"]))),
    ]
    if any(r.summary.get("tokens_per_second") is not None for r in runs):
        rows.append(("tokens/s", col(lambda s: _f(s.get("tokens_per_second")))))
    return rows


def shared_options(runs: list[RunRecord]) -> set:
    """(option, JSON value) pairs every run has in common (none for a single run)."""
    pairs = [{(k, json.dumps(v, sort_keys=True, default=str)) for k, v in (r.summary.get("strategy_options") or {}).items()}
             for r in runs]
    return set.intersection(*pairs) if len(runs) > 1 else set()


def shared_options_line(runs: list[RunRecord]) -> str:
    shared = shared_options(runs)
    return ("Options of every run: " + ", ".join(f"{k}={json.loads(v)}" for k, v in sorted(shared))) if shared else ""


def markdown_table(runs: list[RunRecord]) -> str:
    head = "| | " + " | ".join(r.label for r in runs) + " |"
    sep = "|---|" + "---|" * len(runs)
    body = ["| " + name + " | " + " | ".join(c.replace("|", "/") for c in cells) + " |"
            for name, cells in comparison_rows(runs)]
    shared = shared_options_line(runs)
    return "\n".join([head, sep, *body]) + "\n" + (f"\n{shared}\n" if shared else "")


def print_table(runs: list[RunRecord]) -> None:
    from rich.table import Table

    from gradsync.platform.report import console

    table = Table(title="gradsync compare")
    table.add_column("", style="bold")
    for r in runs:
        table.add_column(r.label, overflow="fold")
    for name, cells in comparison_rows(runs):
        table.add_row(name, *cells)
    out = console()
    out.print(table)
    if shared_options_line(runs):
        out.print(shared_options_line(runs), highlight=False)


# ---- the plots -------------------------------------------------------------------------------
def write_plots(runs: list[RunRecord], out_dir: Path) -> list[Path]:
    """Draw the three comparison plots into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    styles = {r.label: ("-", "--", "-.", ":")[i % 4] for i, r in enumerate(runs)}  # overlapping lines stay visible

    def finish(fig, ax, name: str, title: str, xlabel: str, ylabel: str, *, log_x: bool = False) -> None:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log_x:
            ax.set_xscale("symlog", linthresh=1e-3)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no data in logs/metrics.csv", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    # loss vs optimizer step
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        xs, ys = r.series("train_loss")
        if xs:
            ax.plot(xs, _smooth(ys), styles[r.label], label=r.label)
    finish(fig, ax, PLOTS[0], "training loss per optimizer step", "optimizer step", "train_loss (smoothed)")

    # loss vs bytes on the wire
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        xs, ys = r.series("train_loss", x="comm/wire_bytes")
        if xs:
            ax.plot([x / 1e6 for x in xs], _smooth(ys), styles[r.label], label=r.label)
    finish(fig, ax, PLOTS[1], "training loss against communication", "MB sent per rank (cumulative)",
           "train_loss (smoothed)")

    # validation metric vs training wall time
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = {r.val_metric for r in runs}
    ylabel = names.pop() if len(names) == 1 else "validation metric"
    for r in runs:
        steps, vals = r.series(r.val_metric)
        if not steps:
            continue
        walls = r.at_step("time/wall_seconds", steps)
        pts = [(w, v) for w, v in zip(walls, vals) if w is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[r.label], marker="o",
                    label=f"{r.label} ({r.val_metric})")
    finish(fig, ax, PLOTS[2], "validation against training wall time", "training wall time (s)", ylabel)
    return written


def _smooth(ys: list[float], alpha: float = 0.2) -> list[float]:
    """An exponential moving average: per-step losses are noisy, the trend is what compares."""
    out, acc = [], None
    for y in ys:
        acc = y if acc is None else (1 - alpha) * acc + alpha * y
        out.append(acc)
    return out


# ---- the command -----------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line through the CLI's error path, not argparse's usage dump
        raise GradsyncError(f"compare: {message}; usage: gradsync compare RUN_DIR... [--output-dir DIR] "
                            f"[--labels a,b]")

def cmd_compare(argv: Sequence[str]) -> int:
    parser = _Parser(
        prog="gradsync compare", description="Compare finished runs: a side-by-side table and PNG plots.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="--output-dir of finished gradsync runs")
    parser.add_argument("--output-dir", "--output_dir", default="compare",
                        help="where comparison.md and the PNG plots go (default: ./compare)")
    parser.add_argument("--labels", default=None, help="comma-separated names for the runs (default: dir names)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    args = parser.parse_args(list(argv))
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    runs = read_runs([Path(p) for p in args.runs], labels)
    print_table(runs)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(markdown_table(runs))
    written = [out / "comparison.md"]
    if not args.no_plots:
        try:
            written += write_plots(runs, out)
        except ImportError:
            raise GradsyncError("compare: the plots need matplotlib: pip install matplotlib (or pass --no-plots)") \
                from None
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    return 0
