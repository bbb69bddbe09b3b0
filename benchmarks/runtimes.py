"""crun vs gVisor through the same daemon: start latency and exec round trip, interleaved.

    python -m benchmarks.runtimes [--quick]

One daemon, one busybox lock, and a copy of it with ``runtime = "gvisor"``. Layers are cached
(warm-up envs of both kinds first). Measures, in one run and alternating crun and gVisor so that
load on the node hits both alike:
- create → first exec output (``Client.create`` + ``exec(["echo", "hi"])``), p50/p99, with the
  daemon's per-step breakdown for each runtime;
- exec round trip of ``echo`` in a running env;
- kill (the env gone, its sandbox reaped).
The gVisor platform the runtime probed (kvm or ptrace) is in the notes.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from weenv.testing import leftovers

from ._daemon import bench_daemon
from ._util import Report, arg_parser, median, percentile

GOAL_GVISOR_START_P50_MS = 250.0


def _steps_note(label: str, steps: list[dict]) -> str:
    keys = sorted({k for s in steps for k in s})
    return f"{label} daemon-side create steps, median ms: " + ", ".join(
        f"{k} {statistics.median([s.get(k, 0.0) for s in steps]):.1f}" for k in keys)


def main() -> None:
    ap = arg_parser(__doc__ or "")
    ap.add_argument("--cpu-min", type=float, default=None, help="the plan's CPU min (default the test plan's 0.05)")
    args = ap.parse_args()
    n = 10 if args.quick else 40
    rtt_n = 20 if args.quick else 100
    report = Report("runtimes", "crun vs gVisor: start and exec round trip", args.quick)
    replace = {"min = 0.05": f"min = {args.cpu_min}"} if args.cpu_min else None
    with bench_daemon("runtimes", replace=replace) as d:
        crun_lock = d.plan_lock
        with open(crun_lock) as f:
            text = f.read()
        gvisor_lock = os.path.join(d.home, "gvisor.lock.toml")
        with open(gvisor_lock, "w") as f:
            f.write('runtime = "gvisor"\n' + text)
        locks = {"crun": crun_lock, "gvisor": gvisor_lock}
        starts: dict[str, list[float]] = {k: [] for k in locks}
        kills: dict[str, list[float]] = {k: [] for k in locks}
        rtts: dict[str, list[float]] = {k: [] for k in locks}
        steps: dict[str, list[dict]] = {k: [] for k in locks}
        with d.client() as c:
            for _ in range(2):  # warm: layers registered and cached, the gVisor platform probed
                for lock in locks.values():
                    with c.create(lock) as env:
                        env.exec(["echo", "hi"])
            for _ in range(n):
                for name, lock in locks.items():
                    t0 = time.perf_counter()
                    env = c.create(lock)
                    r = env.exec(["echo", "hi"])
                    starts[name].append(time.perf_counter() - t0)
                    assert r.stdout == b"hi\n", (name, r)
                    steps[name].append(env.info.get("timings_ms", {}))
                    t0 = time.perf_counter()
                    env.kill()
                    kills[name].append(time.perf_counter() - t0)
            envs = {name: c.create(lock) for name, lock in locks.items()}
            try:
                kernel = envs["gvisor"].exec(["uname", "-r"]).stdout.strip().decode()
                assert kernel != os.uname().release, "the gvisor env runs on the host kernel"
                for _ in range(rtt_n):
                    for name, env in envs.items():
                        t0 = time.perf_counter()
                        env.exec(["echo", "hi"])
                        rtts[name].append(time.perf_counter() - t0)
            finally:
                for env in envs.values():
                    env.kill()
        probe = os.path.join(d.home, "run", "runsc", "platform.json")
        try:
            with open(probe) as f:
                found = json.load(f)
            report.notes.append(f"gVisor platform: {found['platform']} (probe: {found['results']}; "
                                f"{found['runsc_version']})")
        except OSError:
            report.notes.append("gVisor platform: no probe result found")
        left = leftovers(d)
        if left:
            report.notes.append(f"LEAKS: {left}")

    c50 = median(starts["crun"]) * 1000
    g50, g99 = median(starts["gvisor"]) * 1000, percentile(starts["gvisor"], 99) * 1000
    report.add("crun: create → first exec output", c50, "ms", p99=percentile(starts["crun"], 99) * 1000)
    report.add("gVisor: create → first exec output", g50, "ms", p99=g99, baseline=c50, baseline_label="crun",
               goal=f"≤{GOAL_GVISOR_START_P50_MS:.0f} ms p50", ok=g50 <= GOAL_GVISOR_START_P50_MS)
    r50 = median(rtts["crun"]) * 1000
    report.add("crun: exec round trip (echo)", r50, "ms", p99=percentile(rtts["crun"], 99) * 1000)
    report.add("gVisor: exec round trip (echo)", median(rtts["gvisor"]) * 1000, "ms",
               p99=percentile(rtts["gvisor"], 99) * 1000, baseline=r50, baseline_label="crun")
    report.add("crun: kill", median(kills["crun"]) * 1000, "ms", p99=percentile(kills["crun"], 99) * 1000)
    report.add("gVisor: kill", median(kills["gvisor"]) * 1000, "ms", p99=percentile(kills["gvisor"], 99) * 1000,
               note="sandbox and gofer killed and exited; runsc delete (it waits for PID 1 to reap) runs after")
    for name in locks:
        report.series[f"{name}_start_ms"] = [x * 1000 for x in starts[name]]
        report.series[f"{name}_exec_ms"] = [x * 1000 for x in rtts[name]]
        report.notes.append(_steps_note(name, steps[name]))
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
