"""Warm start: create → first exec output through the daemon, vs a bare ``crun run`` of the same rootfs.

    python -m benchmarks.start [--quick]

Layers are cached (registered once before timing). Measures, in one run:
- bare ``crun run`` (echo) of the busybox tree extracted on disk (no overlay, no envlet, no cgroups);
- weenv: ``Client.create(lock)`` + ``env.exec(["echo", "hi"])`` until the output is back (p50/p99),
  with the daemon's own per-step breakdown;
- 64 envs created concurrently (async client): wall time and per-env p50;
- exec round trip of ``echo`` in a running env.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import trio

from benchmarks.start_crun import bare_crun_run
from weenv.provision.runtime._hostcheck import detect_host
from weenv.testing import leftovers

from ._daemon import bench_daemon
from ._util import Report, arg_parser, median, percentile


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    n = 20 if args.quick else 120
    concurrent = 16 if args.quick else 64
    report = Report("start", "Warm start through the daemon", args.quick)
    with bench_daemon("start", replace={"min = 0.05": "min = 0.02"}) as d:  # 64 concurrent envs fit 2 cores
        lock, home = d.plan_lock, d.home
        with d.client() as c:
            for _ in range(3):  # warm: layers registered and cached, code paths hot
                with c.create(lock) as env:
                    env.exec(["echo", "hi"])
            starts, steps = [], []
            for _ in range(n):
                t0 = time.perf_counter()
                env = c.create(lock)
                r = env.exec(["echo", "hi"])
                starts.append(time.perf_counter() - t0)
                assert r.stdout == b"hi\n"
                steps.append(env.info.get("timings_ms", {}))
                env.kill()
            rtts = []
            with c.create(lock) as env:
                for _ in range(n):
                    t0 = time.perf_counter()
                    env.exec(["echo", "hi"])
                    rtts.append(time.perf_counter() - t0)
        bare_root = os.path.join(home, "bare-rootfs")
        shutil.copytree(os.path.join(home, "src-busybox"), bare_root, symlinks=True)
        bare = bare_crun_run(tempfile.mkdtemp(dir=home), bare_root, n, detect_host())

        p50, p99 = median(starts) * 1000, percentile(starts, 99) * 1000
        b50 = median(bare) * 1000
        report.add("create → first exec output", p50, "ms", p99=p99, baseline=b50, baseline_label="bare crun run",
                   goal="≤50 ms p50, ≤150 ms p99, ≤2.5x bare crun", ok=p50 <= 50 and p99 <= 150 and p50 <= 2.5 * b50)
        report.add("exec round trip (echo)", median(rtts) * 1000, "ms", p99=percentile(rtts, 99) * 1000)
        report.series["start_ms"] = [x * 1000 for x in starts]
        report.series["bare_crun_ms"] = [x * 1000 for x in bare]
        keys = sorted({k for s in steps for k in s})
        report.notes.append("daemon-side create steps, median ms: " + ", ".join(
            f"{k} {statistics.median([s.get(k, 0.0) for s in steps]):.1f}" for k in keys))

        async def burst() -> tuple[float, list[float]]:
            each: list[float] = []
            envs = []

            async def one(cl) -> None:  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                env = await cl.create(lock)
                await env.exec(["echo", "hi"])
                each.append(time.perf_counter() - t0)
                envs.append(env)

            async with d.async_client() as cl:
                t0 = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(concurrent):
                        nursery.start_soon(one, cl)
                wall = time.perf_counter() - t0
                async with trio.open_nursery() as nursery:
                    for env in envs:
                        nursery.start_soon(env.kill)
            return wall, each

        wall, each = trio.run(burst)
        report.add(f"{concurrent} envs started concurrently: wall time", wall * 1000, "ms",
                   note=f"per env p50 {median(each) * 1000:.0f} ms, p99 {percentile(each, 99) * 1000:.0f} ms")
        left = leftovers(d)
        if left:
            report.notes.append(f"LEAKS: {left}")
    # the same lock with a warm pool of 2: create takes an env that is already started
    os.environ["WEENV_POOL_SIZE"] = "2"
    try:
        with bench_daemon("start-pool") as d, d.client() as c:
            lock = d.plan_lock
            with c.create(lock) as env:  # a first miss starts the pool
                env.exec(["echo", "hi"])
            pooled = []
            for _ in range(n):
                time.sleep(0.15)  # a sampler's pace: the pool refills in the background
                t0 = time.perf_counter()
                env = c.create(lock)
                env.exec(["echo", "hi"])
                pooled.append(time.perf_counter() - t0)
                env.kill()
        p50, p99 = median(pooled) * 1000, percentile(pooled, 99) * 1000
        report.add("create → first exec output, warm pool of 2", p50, "ms", p99=p99, baseline=b50,
                   baseline_label="bare crun run", goal="≤50 ms p50, ≤150 ms p99, ≤2.5x bare crun",
                   ok=p50 <= 50 and p99 <= 150 and p50 <= 2.5 * b50)
        report.series["start_pool_ms"] = [x * 1000 for x in pooled]
    finally:
        del os.environ["WEENV_POOL_SIZE"]
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
