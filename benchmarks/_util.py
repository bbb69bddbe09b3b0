"""What every benchmark shares: --quick, timing helpers, and a results file per benchmark.

Each benchmark measures weenv and its baseline in the same run and records rows of
(metric, value, baseline, ratio, goal). Results land in benchmarks/results/<name>.json;
`python -m benchmarks.run` turns them into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed(fn: Callable[[], object], repeat: int = 1) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def drop_caches() -> bool:
    """Drop the page cache (root only); True when it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@dataclass
class Row:
    metric: str
    value: float
    unit: str
    p99: float | None = None
    baseline: float | None = None
    baseline_label: str | None = None
    ratio: float | None = None  # value / baseline (or baseline / value when higher_is_better), >1 = weenv better
    goal: str | None = None
    ok: bool | None = None
    note: str | None = None


@dataclass
class Report:
    name: str
    title: str
    quick: bool
    rows: list[Row] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    series: dict[str, list] = field(default_factory=dict)  # raw samples for plots (benchmarks/_docs.py)
    peers: dict[str, dict[str, str]] = field(default_factory=dict)  # docker/podman beside weenv: version, how run

    def add(self, metric: str, value: float, unit: str, *, p99: float | None = None, baseline: float | None = None,
            baseline_label: str | None = None, higher_is_better: bool = False, goal: str | None = None,
            ok: bool | None = None, note: str | None = None) -> Row:
        ratio = None
        if baseline:
            ratio = (value / baseline) if higher_is_better else (baseline / value if value else None)
        row = Row(metric, value, unit, p99, baseline, baseline_label, ratio, goal, ok, note)
        self.rows.append(row)
        return row

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{self.title}{' (quick)' if self.quick else ''}")
        for col in ("metric", "value", "p99", "baseline", "ratio", "goal", "ok"):
            t.add_column(col)
        for r in self.rows:
            t.add_row(r.metric, f"{_fmt(r.value)} {r.unit}", _fmt(r.p99), 
                      f"{_fmt(r.baseline)} ({r.baseline_label})" if r.baseline is not None else "",
                      f"{r.ratio:.2f}x" if r.ratio is not None else "", r.goal or "",
                      {True: "yes", False: "NO", None: ""}[r.ok])
        Console(width=160).print(t)
        for n in self.notes:
            print("note:", n)

    def save(self) -> Path:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{self.name}{'.quick' if self.quick else ''}.json"
        data = {**asdict(self), "machine": machine(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "commit": _commit(), "command": _command()}
        path.write_text(json.dumps(data, indent=1) + "\n")
        return path


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.4g}"


def _command() -> str:
    """How this result was produced: ``python -m benchmarks.NAME ARGS``."""
    return " ".join(["python -m", f"benchmarks.{Path(sys.argv[0]).stem}", *sys.argv[1:]])


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def machine() -> dict:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version()}


def arg_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a smoke run in under a minute (numbers not meaningful)")
    return p
