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


def _processes_x_nodes(summary: dict) -> str:
    where = f"({summary.get('backend')}, {summary.get('accelerator')})"
    layout = summary.get("layout")
    if layout:  # nodes played by --strategy.procs_per_node processes each
        return (f"{layout['procs_per_node']} x {layout['num_nodes']} {where}, nodes played by "
                f"--strategy.procs_per_node {layout['procs_per_node']} on {summary.get('num_nodes')} machine(s)")
    return f"{per_node(summary)} x {summary.get('num_nodes')} {where}"


def _headline_ratio(comm: dict) -> str:
    """The ratio across nodes where a topology is in use (what a slow link carries), with the overall one
    beside it, labelled; the overall ratio alone otherwise."""
    inter = (comm.get("by_scope") or {}).get("inter_node") or {}
    if inter.get("logical_bytes") and comm.get("by_scope", {}).get("intra_node", {}).get("wire_bytes"):
        return (f"{_fmt(inter.get('compression_ratio'))} across nodes ({_fmt(comm.get('compression_ratio'))} "
                f"with the intra-node traffic)")
    return _fmt(comm.get("compression_ratio"))


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    comm = summary.get("comm") or {}
    rows = [
        ("recipe", summary.get("recipe", "")),
        ("strategy", summary.get("strategy", "")),
        ("processes x nodes", _processes_x_nodes(summary)),
        ("global batch", f"{summary.get('global_batch_size')} = {summary.get('micro_batch_size')} micro-batch x "
                         f"{summary.get('accumulation_steps', 1)} accumulation x {summary.get('world_size')} processes"),
        ("training steps", _fmt(summary.get("global_step"))
         + (f" ({summary['optimizer_steps']} optimizer steps)" if summary.get("optimizer_steps") else "")),
    ]
    rows += [(k, _fmt(v)) for k, v in (summary.get("metrics") or {}).items()]
    rows += [
        ("wire bytes (per rank)", _fmt_exact_bytes(comm.get("wire_bytes"))),
        ("fp32 sync would send", _fmt_exact_bytes(comm.get("logical_bytes"))),
        ("compression ratio", _headline_ratio(comm)),
        ("peak bytes in one sync", _fmt_exact_bytes(comm.get("peak_sync_bytes"))),
        ("collectives", _fmt(comm.get("collectives"))),
        ("communication time", _comm_time(comm.get("seconds"), summary.get("comm_time_share"))),
        ("training time", f"{_fmt(summary.get('train_seconds'))} s (training steps, since the run first started)"),
        ("wall time", f"{_fmt(summary.get('wall_seconds'))} s (this command, start-up included)"),
        ("samples/s", _fmt(summary.get("samples_per_second"))),
    ]
    memory = summary.get("memory") or {}
    if memory.get("total_bytes"):
        rows.append(("memory / process", f"{_fmt_bytes(memory['total_bytes'])}: parameters "
                     f"{_fmt_bytes(memory.get('parameter_bytes'))}, gradients {_fmt_bytes(memory.get('gradient_bytes'))}, "
                     f"optimizer {_fmt_bytes(memory.get('optimizer_state_bytes'))}, algorithm "
                     f"{_fmt_bytes(memory.get('algorithm_state_bytes'))} (tensor storage)"))
    for scope, t in (comm.get("by_scope") or {}).items():
        # the ratio is against flat fp32 sync, whose bytes are booked to the scope a strategy replaces
        ratio = f", ratio {_fmt(t.get('compression_ratio'))}" if t.get("logical_bytes") else ""
        rows.append((f"{scope.replace('_', '-')} bytes", f"{_fmt_exact_bytes(t.get('wire_bytes'))}{ratio}, "
                     f"peak sync {_fmt_bytes(t.get('peak_sync_bytes'))}, {_fmt(t.get('collectives'))} collectives"))
    other = comm.get("other") or {}
    if any((t or {}).get("wire_bytes") for t in other.values()):
        rows.append(("other traffic", ", ".join(f"{p} {_fmt_bytes(t.get('wire_bytes'))}" for p, t in other.items())))
    ps = summary.get("strategy_stats") or {}
    if ps.get("staleness"):  # strategies with stale gradients (async_ps)
        hist = " ".join(f"{k}:{v}" for k, v in ps["staleness"].items())
        rows += [
            ("server updates", f"{_fmt(ps.get('server_updates'))} ({_fmt(ps.get('gradients_per_update'))} gradients each)"),
            ("staleness", f"mean {_fmt(ps.get('staleness_mean'))}, max {_fmt(ps.get('staleness_max_observed'))} "
                          f"(bound {ps.get('max_staleness')}); histogram {hist}"),
        ]
    ft = ps.get("fault_tolerance")
    if ft:  # --fault-tolerance torchft: who took part, what failed, what healing cost
        parts = ft.get("participants") or {}
        heal = (f"healed {ft['heals']}x from a live group ({_fmt(ft['heal_seconds'])} s, "
                f"{_fmt_bytes(ft['heal_bytes'])}, {_fmt(ft['steps_healed_over'])} steps taken over)" if ft.get("heals")
                else "never healed")
        fewer = " (a round over fewer groups averages a smaller global batch)" if (parts.get("min") or 0) < \
            ft["replica_groups"] else ""
        rows.append(("replica groups", f"group {ft['replica_group']} of {ft['replica_groups']}; rounds averaged over "
                                       f"{parts.get('min')}..{parts.get('max')} groups{fewer}; failures seen "
                                       f"{ft['failures_seen']}; {heal}"
                                       + (f"; goodput {ft['goodput']:.3f}" if ft.get("goodput") is not None else "")))
    if summary.get("tokens_per_second") is not None:
        rows.append(("tokens/s", _fmt(summary["tokens_per_second"])))
    if summary.get("resumed_from_step") is not None:
        rows.append(("resumed from step", _fmt(summary["resumed_from_step"])))
    if summary.get("checkpoint"):
        rows.append(("checkpoint", summary["checkpoint"]))
    tracking = summary.get("tracking") or {}
    if tracking.get("wandb_run_id"):
        mode = f", {tracking['wandb_mode']}" if tracking.get("wandb_mode") else ""
        rows.append(("W&B run", f"{tracking['wandb_run_id']}{mode}"))
    return rows


def _fmt_exact_bytes(n: Any) -> str:
    """``1.2 MB (1,234,567 B)``: readable, and exact for comparing runs."""
    if n is None:
        return "n/a"
    if abs(float(n)) < 1000:
        return _fmt_bytes(n)
    return f"{_fmt_bytes(n)} ({int(n):,} B)"


def _comm_time(seconds: Any, share: Any) -> str:
    if seconds is None:  # sync's collectives run inside DDP's own all-reduce (sync --strategy.time_comm times them)
        return "not timed"
    text = f"{float(seconds):.3g} s"
    if share is not None:
        text += f" ({100 * float(share):.1f}% of training time, in flight)"
    return text


def console() -> Any:
    """A rich Console; off a terminal it writes plain text (no colour codes), 120 columns wide."""
    import os

    from rich.console import Console

    c = Console()
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(width=120)
    return c


def print_list(recipes: dict, strategies: dict) -> None:
    """``gradsync list``: recipes and strategies as tables."""
    from rich.table import Table

    out = console()
    table = Table(title="Recipes (--recipe NAME)", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("description")
    for name, text in recipes.items():
        table.add_row(name, text)
    out.print(table)
    table = Table(title="Strategies (--strategy NAME; options as --strategy.<option>)", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("description")
    for name, text in strategies.items():
        table.add_row(name, text)
    out.print(table)
    out.print("Any stock Lightning strategy name (e.g. ddp) works too; `gradsync fit --strategy NAME --help` "
              "lists a strategy's options.", highlight=False)


def print_summary(summary: dict) -> None:
    from rich.table import Table

    table = Table(title=f"gradsync {summary.get('command', 'fit')} summary", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for k, v in summary_rows(summary):
        table.add_row(k, v)
    console().print(table)


def per_node(summary: dict) -> object:
    """Processes per node (the ``processes x nodes`` row multiplies to the world size)."""
    world, nodes = summary.get("world_size"), summary.get("num_nodes")
    if isinstance(world, int) and isinstance(nodes, int) and nodes > 0 and world % nodes == 0:
        return world // nodes
    return world
