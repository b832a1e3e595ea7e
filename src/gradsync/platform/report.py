"""Human-readable run summaries (rich; plain text without control characters when not on a terminal)."""

from __future__ import annotations

from typing import Any


def _fmt_bytes(n: Any) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    comm = summary.get("comm") or {}
    rows = [
        ("recipe", summary.get("recipe", "")),
        ("strategy", summary.get("strategy", "")),
        ("processes x nodes", f"{summary.get('world_size')} x {summary.get('num_nodes')} ({summary.get('backend')}, "
                              f"{summary.get('accelerator')})"),
        ("global batch", f"{summary.get('global_batch_size')} = {summary.get('micro_batch_size')} micro-batch x "
                         f"{summary.get('accumulation_steps', 1)} accumulation x {summary.get('world_size')} processes"),
        ("optimizer steps", _fmt(summary.get("global_step"))),
    ]
    rows += [(k, _fmt(v)) for k, v in (summary.get("metrics") or {}).items()]
    rows += [
        ("wire bytes (per rank)", _fmt_bytes(comm.get("wire_bytes"))),
        ("fp32 sync would send", _fmt_bytes(comm.get("logical_bytes"))),
        ("compression ratio", _fmt(comm.get("compression_ratio"))),
        ("collectives", _fmt(comm.get("collectives"))),
        ("wall time", f"{_fmt(summary.get('wall_seconds'))} s"),
        ("samples/s", _fmt(summary.get("samples_per_second"))),
    ]
    if summary.get("resumed_from_step") is not None:
        rows.append(("resumed from step", _fmt(summary["resumed_from_step"])))
    if summary.get("checkpoint"):
        rows.append(("checkpoint", summary["checkpoint"]))
    return rows


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gradsync {summary.get('command', 'fit')} summary", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for k, v in summary_rows(summary):
        table.add_row(k, v)
    Console().print(table)
