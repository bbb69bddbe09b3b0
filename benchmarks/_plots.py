"""PNG plots of the benchmarks (matplotlib, the ``bench`` extra), from a report's series.

``quota_over_time``: one env's CPU quota and memory limit against its usage under bursts.
``density``: completion time against memory overcommit for static and elastic sizing, and the
node's memory over time in the densest elastic run that held. ``write_all`` redraws both from
saved results (``benchmarks/_docs.py`` calls it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
MIB = 1 << 20


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, name: str) -> str:
    """Lay out, write and close ``fig``; its path relative to docs/."""
    fig.tight_layout()
    PLOTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOTS / name, dpi=110)
    _pyplot().close(fig)
    return f"benchmarks/{name}"


def start_latency(data: dict[str, Any]) -> str | None:
    """Warm start latency distributions (``benchmarks/start.py``)."""
    s = data.get("series", {})
    if not s.get("start_ms"):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    curves = [("start_ms", "weenv: create → first exec output"), ("start_pool_ms", "weenv with a warm pool of 2"),
              ("bare_crun_ms", "bare crun run (echo)"), ("docker_run_ms", "docker run --rm (echo)"),
              ("podman_run_ms", "podman run --rm (echo)")]
    present = [(k, label) for k, label in curves if s.get(k)]
    bins: Any = 40
    if any(k in s for k in ("docker_run_ms", "podman_run_ms")):
        # the peers are ~10x slower: one log-spaced set of bins shows every system side by side
        import numpy as np

        lo = max(0.1, min(min(s[k]) for k, _ in present))
        hi = max(max(s[k]) for k, _ in present)
        bins = np.geomspace(lo, hi * 1.01, 60)
        ax.set_xscale("log")
    for k, label in present:
        ax.hist(s[k], bins=bins, alpha=0.6, label=label)
    ax.set_xlabel("milliseconds")
    ax.set_ylabel("starts")
    ax.set_title("Start latency distribution per system (same run, interleaved)")
    ax.legend()
    return _save(fig, "start_latency.png")


def lazy_bytes_over_time(data: dict[str, Any]) -> str | None:
    """Bytes fetched over time during lazy cold starts (``benchmarks/envlet_lazy_start.py``)."""
    series = {k: v for k, v in data.get("series", {}).items() if k.endswith("bytes_over_time") and v}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key, points in series.items():
        profile, title, _ = key.split("|")
        ax.plot([p[0] for p in points], [p[1] / 1e6 for p in points], label=f"{title}, {profile}")
    ax.set_xlabel("seconds since the start request")
    ax.set_ylabel("MB fetched")
    ax.set_title("Bytes fetched over time during a lazy cold start")
    ax.legend(fontsize=7)
    return _save(fig, "lazy_bytes_over_time.png")


def quota_over_time(series: dict[str, Any]) -> str | None:
    traces = series.get("quota_trace") or []
    if not traces:
        return None
    tr = traces[0]
    plt = _pyplot()
    fig, (ax_cpu, ax_mem) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    t = tr["t"]
    ax_cpu.step(t, tr["cpu_quota"], where="post", label="CPU quota (cores)", color="tab:blue")
    ax_cpu.plot(t, [u if u is not None else float("nan") for u in tr["cpu_used"]], label="CPU used (cores)",
                color="tab:orange", alpha=0.8)
    ax_cpu.set_ylabel("cores")
    ax_cpu.set_ylim(0, 1.15)
    ax_cpu.legend(loc="upper right", fontsize=8)
    ax_cpu.set_title("One env under bursts: CPU 0.25-1 core, memory 8-448 MiB (200 ms monitor)")
    ax_mem.step(t, [(x or 0) / MIB for x in tr["mem_limit"]], where="post", label="memory limit", color="tab:blue")
    ax_mem.plot(t, [(x or 0) / MIB for x in tr["mem_used"]], label="memory used", color="tab:orange", alpha=0.8)
    ax_mem.set_ylabel("MiB")
    ax_mem.set_xlabel("seconds")
    ax_mem.legend(loc="upper right", fontsize=8)
    return _save(fig, "quota_over_time.png")


def density(series: dict[str, Any]) -> str | None:
    runs = [r for r in series.get("runs") or [] if r.get("n")]
    if not runs:
        return None
    plt = _pyplot()
    over = series.get("node_over_time") or []
    fig, axes = plt.subplots(1, 2 if over else 1, figsize=(11 if over else 6, 4))
    ax = axes[0] if over else axes
    limit = (series.get("slowdown_limit") or [1.10])[0]
    for sizing, color, marker in (("static", "tab:gray", "s"), ("elastic", "tab:green", "o"),
                                  ("docker", "tab:blue", "^")):
        rs = sorted((r for r in runs if r["sizing"] == sizing), key=lambda r: r["n"])
        ran = [r for r in rs if r["mean_slowdown"] is not None]
        if ran:
            ax.plot([r["overcommit"] for r in ran], [(r["mean_slowdown"] - 1) * 100 for r in ran], marker=marker,
                    color=color, label=f"{sizing}: mean completion vs alone")
            for r in ran:
                ax.annotate(f"N={r['n']}" + ("" if r["oom_kills"] == 0 else f", {r['oom_kills']} OOM"),
                            (r["overcommit"], (r["mean_slowdown"] - 1) * 100), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
        for r in rs:
            if r["refused"]:
                ax.scatter([r["overcommit"]], [0], marker="x", color=color, s=60,
                           label=f"{sizing}: N={r['n']} refused by admission")
    ax.axhline((limit - 1) * 100, color="tab:red", linestyle="--", linewidth=1,
               label=f"{(limit - 1) * 100:g} % slowdown")
    ax.axvline(10, color="tab:purple", linestyle=":", linewidth=1, label="10x overcommit")
    ax.set_xlabel("memory overcommit: Σ declared max ÷ node RAM")
    ax.set_ylabel("completion time vs the workload alone (%)")
    ax.set_title("Density: static vs elastic sizing, and Docker's static limits")
    ax.legend(fontsize=7, loc="upper left")
    if over:
        s = over[0]
        n = (series.get("node_over_time_n") or ["?"])[0]
        node = (series.get("node_bytes") or [0])[0]
        ax2 = axes[1]
        ax2.plot(s["t"], [x / MIB for x in s["limits"]], label="Σ memory limits", color="tab:blue")
        if s.get("reserved") and len(s["reserved"]) == len(s["limits"]):
            ax2.plot(s["t"], [(x + (r or 0)) / MIB for x, r in zip(s["limits"], s["reserved"])],
                     label="Σ limits + burst reservations", color="tab:purple", alpha=0.7)
        ax2.plot(s["t"], [x / MIB for x in s["used"]], label="Σ memory used", color="tab:orange")
        if node:
            ax2.axhline(node / MIB, color="black", linewidth=1, label="node RAM")
        declared = n * (series.get("max_bytes") or [0])[0] / MIB if isinstance(n, int) else None
        ax2.set_title(f"Elastic, N={n}: node memory over time"
                      + (f" (Σ max = {declared / 1024:.1f} GiB)" if declared else ""))
        ax2.set_xlabel("seconds")
        ax2.set_ylabel("MiB")
        ax2.legend(fontsize=7, loc="upper right")
    return _save(fig, "density.png")


def write_all(results: dict[str, dict[str, Any]]) -> list[str]:
    """Redraw the elastic plots from saved results (``benchmarks/results/density*.json``)."""
    data = results.get("density")
    if not data:
        return []
    series = data.get("series") or {}
    return [p for p in (quota_over_time(series), density(series)) if p]


def corpus_bytes(data: dict[str, Any]) -> str | None:
    """A task corpus stored four ways, and its sharing histogram (``benchmarks/corpus.py``)."""
    s = data.get("series", {})
    if not s.get("stored"):
        return None
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["registry\nlayers", "weenv\nper layer", "by file", "by chunk", "weenv\nregroup"]
    a.bar(labels, [v / 1e6 for v in s["stored"]], color=["#888", "#aaa", "#4a7", "#47a", "#c63"])
    a.set_ylabel("MB stored (compressed)")
    a.set_title("Bytes stored for the corpus")
    share = s.get("sharing") or []
    b.bar([str(n) for n, _ in share], [v / 1e6 for _, v in share], color="#47a")
    b.set_xlabel("images holding the content")
    b.set_ylabel("MB (compressed)")
    b.set_title("Sharing histogram")
    return _save(fig, "corpus_bytes.png")


def rollout_throughput(series: dict[str, Any]) -> str | None:
    """Episodes finished over time per system, and their episode times (``benchmarks/repo_rollout.py``)."""
    systems = [k for k in ("weenv", "docker") if series.get(k)]
    if not systems:
        return None
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for k in systems:
        done = series.get(f"{k}_done_s")
        if done:
            a.step([0.0, *done], range(len(done) + 1), where="post", label=k)
        b.hist(series[k], bins=30, alpha=0.6, label=k)
    a.set_xlabel("seconds since the first create (pulls included)")
    a.set_ylabel("episodes finished")
    a.set_title("Rollout throughput")
    a.legend()
    b.set_xlabel("episode seconds (create, patch, tests, result, destroy)")
    b.set_ylabel("episodes")
    b.set_title("Episode time")
    b.legend()
    return _save(fig, "rollout_throughput.png")


def intake_times(data: dict[str, Any]) -> str | None:
    """``weenv pull`` against ``docker pull`` and the read floor, run by run (``benchmarks/intake.py``)."""
    s = data.get("series", {})
    if not s.get("weenv_s"):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    runs = range(1, len(s["weenv_s"]) + 1)
    for key, label in (("weenv_s", "weenv pull (convert, verify, upload)"), ("docker_s", "docker pull"),
                       ("floor_s", "read floor: download + gunzip + sha256")):
        if s.get(key):
            ax.plot(list(runs), s[key], marker="o", label=label)
    ax.set_xticks(list(runs))
    ax.set_xlabel("run (alternating, each from nothing)")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title("Pulling a 1 GiB image")
    ax.legend()
    return _save(fig, "intake_times.png")
