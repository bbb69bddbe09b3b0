"""``make bench``: run every benchmark, then write docs/benchmarks.md (tables and PNG plots).

    python -m benchmarks.run [--quick] [--only NAME[,NAME…]] [--docs-only]

Each benchmark runs as its own process (``python -m benchmarks.NAME``) and saves its results in
benchmarks/results/NAME[.quick].json; a benchmark that fails is reported and the others go on.
``--quick`` is the smoke run CI does on every change: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = [
    # (module, what it compares, timeout of a full run in seconds)
    ("layer_build", "layer build vs tar | zstd; TOC open time", 1800),
    ("registry_range", "store Range reads vs raw httpx; republish; upload vs oras", 900),
    ("envlet_read", "envlet reads vs native ext4", 900),
    ("envlet_lazy_start", "cold start: lazy envlet vs full pull + extract", 2400),
    ("envlet_fair", "cold reads under a neighbour's lookup storm vs alone, fairness off and on", 900),
    ("layer_trees", "hot layers as local trees vs served by the envlet", 900),
    ("start_crun", "runtime: create+start+exec vs bare crun run", 900),
    ("start", "warm start through the daemon vs bare crun run, docker run and podman run", 900),
    ("runtimes", "crun vs gVisor: start latency and exec round trip in the same run", 900),
    ("isolation", "user namespaces: start latency and exec round trip with vs without, same run", 900),
    ("e2b_api", "E2B SDK through weenv serve vs the native client: start, command, files, 64 at once", 900),
    ("docker_api", "docker-py via weenv serve --docker vs dockerd: create → first exec, 16-way SWE round", 900),
    ("network", "egress envs: start vs network = none, NAT vs loopback throughput", 900),
    ("snapshot", "pause, resume, commit, fork vs cp -a", 900),
    ("memory_snapshots", "gVisor memory snapshots: park, resume, fork ×3 vs cold start + rebuild, vs bare runsc", 900),
    ("peers_fork", "commit + fork x8 of a running env vs docker / podman commit + 8 x run", 900),
    ("peers_cold", "cold start from a registry at 100 MB/s: weenv lazy (± prefetch list) vs docker pull + run", 1800),
    ("monitor_overhead", "monitor CPU per 100 envs", 900),
    ("density", "density and overcommit: static vs elastic sizing, vs Docker's static limits", 5400),
    ("rollout", "slime rollout step: fresh env per sample vs fork per group", 1800),
    ("repo_rollout", "real-repo rollout: toolz's test suite, 32 episodes at a time, weenv vs docker", 2400),
    ("package", "task packaging: group per task vs image per task", 1800),
    ("cluster", "placement time at 1,000 nodes; cache-aware vs round-robin registry bytes", 600),
    ("peer_tier", "K nodes cold-starting one image at once: registry bytes and start time, peer tier on vs off", 1800),
    ("intake", "image intake: weenv pull (per-layer conversion) vs docker pull of a 1 GiB image", 1800),
    ("corpus", "task corpus: regrouped vs registry bytes, bytes fetched to start, weenv build -f vs docker build", 2400),
]
ROOT = Path(__file__).resolve().parent.parent


def run_one(name: str, quick: bool, timeout_s: float) -> tuple[bool, float, str]:
    module = f"benchmarks.{name}"
    if not (ROOT / "benchmarks" / f"{name}.py").exists():
        return False, 0.0, "not written yet"
    cmd = [sys.executable, "-m", module, *(["--quick"] if quick else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s if not quick else 300, text=True,
                           capture_output=True)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - t0, "timed out"
    out = (p.stdout + p.stderr)[-3000:]
    sys.stdout.write(p.stdout[-6000:])
    return p.returncode == 0, time.perf_counter() - t0, "" if p.returncode == 0 else out


def goal_misses(names: list[str], quick: bool) -> list[str]:
    """Every goal a saved result marks missed ("NAME: metric: value (goal ...)"), for the names run."""
    import json

    out = []
    for name in names:
        path = ROOT / "benchmarks" / "results" / f"{name}{'.quick' if quick else ''}.json"
        try:
            rows = json.loads(path.read_text()).get("rows", [])
        except (OSError, ValueError):
            continue
        for r in rows:
            if r.get("ok") is False:
                base = (f" vs {r['baseline']:.4g} ({r.get('baseline_label') or 'baseline'})"
                        if r.get("baseline") is not None else "")
                out.append(f"{name}: {r['metric']}: {r['value']:.4g} {r['unit']}{base}; goal {r.get('goal')}")
    return out


def print_misses(names: list[str], quick: bool) -> None:
    misses = goal_misses(names, quick)
    kind = "quick run: smoke numbers on small inputs, not measurements" if quick else "this run"
    print(f"=== goals missed ({kind}): {len(misses)}")
    for line in misses:
        print("  MISSED " + line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--docs-only", action="store_true", help="regenerate docs/benchmarks.md from saved results")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md (CI smoke runs)")
    args = ap.parse_args()
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    failures: list[tuple[str, str]] = []
    if not args.docs_only:
        for name, what, timeout_s in BENCHMARKS:
            if only and name not in only:
                continue
            print(f"=== {name}: {what}", flush=True)
            ok, seconds, detail = run_one(name, args.quick, timeout_s)
            print(f"=== {name}: {'ok' if ok else 'FAILED'} in {seconds:.0f}s", flush=True)
            if not ok:
                failures.append((name, detail))
                print(detail, flush=True)
    if not args.docs_only:
        print_misses([n for n, _, _ in BENCHMARKS if not only or n in only], args.quick)
    if args.quick and not args.no_docs:
        print("quick run: docs/benchmarks.md left as it is (smoke runs measure nothing)")
    elif not args.no_docs:
        from ._docs import write_docs

        path = write_docs(failures=failures)
        print(f"wrote {path}")
    if failures:
        print("failed:", ", ".join(n for n, _ in failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
