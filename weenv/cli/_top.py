"""``weenv top``: the elastic monitor's live view (quotas, usage, last change, refusals)."""

from __future__ import annotations

import time
from typing import Any

import click

from . import main
from ._common import human_bytes, print_json, stdout, unsqueezed


def _cores(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _bytes(n: int | None) -> str:
    return "-" if n is None else human_bytes(n).replace(" ", "")


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def last_change_text(change: dict[str, Any] | None, now_wall_s: float) -> str:
    if not change:
        return "-"
    arrow = "↑" if change["direction"] == "up" else "↓"
    if change["resource"] == "cpu":
        what = f"cpu {arrow} {_cores(change['from'])}→{_cores(change['to'])}"
    else:
        what = f"mem {arrow} {_bytes(change['from'])}→{_bytes(change['to'])}"
    wall = change.get("wall_s")
    return what if wall is None else f"{what} {_age(max(0.0, now_wall_s - wall))} ago"


def render(top: dict[str, Any], *, now_wall_s: float | None = None) -> Any:
    """A rich renderable for one ``GET /v1/top`` answer: a node line and one row per env."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now_wall_s is None else now_wall_s
    node = top.get("node") or {}
    stats = top.get("statistics") or {}
    admission = top.get("admission") or {}
    envs = top.get("envs") or {}
    plural = "" if len(envs) == 1 else "s"
    head = Text(
        f"{len(envs)} env{plural} · memory {_bytes(node.get('memory_available_bytes'))} available of "
        f"{_bytes(node.get('memory_total_bytes'))}, {_bytes(node.get('memory_promised_bytes'))} promised, "
        f"{_bytes(node.get('memory_reserved_bytes'))} reserved for bursts, "
        f"{node.get('memory_waiters', 0)} waiting, "
        f"headroom {_bytes(max(0, node['memory_headroom_bytes'])) if 'memory_headroom_bytes' in node else '-'} · "
        f"cpu burst {_cores(node.get('cpu_burst_committed_cores'))} of {_cores(node.get('cpu_cores'))} cores · "
        f"tick {top.get('interval_ms', '-')} ms (last {stats.get('last_tick_s', 0) * 1000:.1f} ms, "
        f"{stats.get('late_ticks', 0)} late) · admission refused {admission.get('refused', 0)}"
    )
    trees = top.get("layer_trees")
    if trees:
        head.append(f"\nlayer trees {trees['trees']} ({_bytes(trees['bytes'])} of {_bytes(trees['budget_bytes'])}), "
                    f"{trees['copies']} made, {trees['evictions']} evicted, {trees['queued']} queued")
    t = Table(box=None, header_style="bold")
    for col, justify in (("ENV", "left"), ("CPU USED/QUOTA", "right"), ("MIN-MAX", "right"), ("THR", "right"),
                         ("MEM USED/LIMIT", "right"), ("MAX", "right"), ("LAST CHANGE", "left"),
                         ("UP/DOWN", "right"), ("REFUSED", "right"), ("OOM", "right"),
                         ("NET OUT/IN", "right"), ("NET DENIED", "right")):
        t.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    egress = top.get("network") or {}  # egress envs' accounting (docs/network.md)
    for env_id in sorted(envs):
        e = envs[env_id]
        net = egress.get(env_id)
        cpu, mem, m = e["cpu"], e["memory"], e["metrics"]
        thr = cpu.get("throttled_share")
        refused = f"{m['cpu_refusals']}/{m['memory_refusals']}"
        if cpu.get("refused") or mem.get("refused"):
            refused = f"[bold red]{refused}[/]"
        oom = str(m["oom_kills"])
        if m["oom_kills"]:
            oom = f"[bold red]{oom}[/]"
        t.add_row(
            env_id if not e.get("error") else f"{env_id} [red](!)[/]",
            f"{_cores(cpu.get('used_cores'))}/{_cores(cpu['quota_cores'])}",
            f"{_cores(cpu.get('min_cores'))}-{_cores(cpu.get('max_cores'))}",
            "-" if thr is None else f"{thr:.0%}",
            f"{_bytes(mem.get('used_bytes'))}/{_bytes(mem['limit_bytes'])}",
            _bytes(mem.get("max_bytes")),
            last_change_text(e.get("last_change"), now),
            f"{m['cpu_up'] + m['memory_up']}/{m['cpu_down'] + m['memory_down']}",
            refused,
            oom,
            f"{_bytes(net['bytes_out'])}/{_bytes(net['bytes_in'])}" if net else "-",
            f"{net['packets_denied']} pkts" if net else "-",
        )
    return Group(head, unsqueezed(t))


@main.command("top")
@click.option("--once", is_flag=True, help="Print the table once and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the monitor's snapshot as JSON and exit.")
@click.option("--interval", "interval_s", type=click.FloatRange(0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("-n", "--count", type=click.IntRange(1), default=None,
              help="Stop after this many refreshes [default: until Ctrl-C].")
def top_cmd(once: bool, as_json: bool, interval_s: float, count: int | None) -> None:
    """Live view of every env's CPU and memory quota, usage, last change and refusals."""
    from .._client import Client, WeenvError

    try:
        with Client() as c:
            if as_json:
                print_json(c.top())
                return
            if once:
                stdout.print(render(c.top()))
                return
            if not stdout.is_terminal:
                # Piped (`| cat`, `| tee`): one whole frame per refresh, flushed at once; a live
                # view would redraw in place and print nothing until it ends.
                shown = 0
                while count is None or shown < count:
                    if shown:
                        time.sleep(interval_s)
                        stdout.print()
                    stdout.print(render(c.top()))
                    stdout.file.flush()
                    shown += 1
                return
            from rich.live import Live

            with Live(render(c.top()), console=stdout, auto_refresh=False, screen=False) as live:
                shown = 1
                while count is None or shown < count:
                    time.sleep(interval_s)
                    live.update(render(c.top()), refresh=True)
                    shown += 1
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a live view ends
    except WeenvError as e:
        raise click.ClickException(str(e)) from None
