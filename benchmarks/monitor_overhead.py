"""CPU cost of the elastic monitor: 100 real cgroups (half empty, half holding a sleeping
process) ticked every 200 ms, against an idle trio loop in the same process; then the same with
10 of them holding a process that wakes every 50 ms (no tick is quiet).

    python -m benchmarks.monitor_overhead [--quick] [--envs N] [--active N] [--seconds S]

The figure is the process CPU time (all threads) while the monitor runs minus the CPU time of the
same trio loop without it, as a share of one core. Goal: <= 1 % of a core per 100 envs.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import trio

from weenv.provision.elastic._monitor import Monitor
from weenv.provision.elastic._policy import EnvLimits
from weenv.provision.cgroups import detect_backend

from ._util import Report, arg_parser

MIB = 1 << 20


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure(seconds: float, monitor: Monitor | None) -> tuple[float, int]:
    """CPU seconds spent by this process during ``seconds`` of a trio loop (with ``monitor``
    ticking in it, when given), and the number of ticks."""
    result = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ticks0 = monitor.statistics().ticks if monitor else 0
            if monitor is not None:
                await nursery.start(monitor.run)
            c0 = cpu_s()
            await trio.sleep(seconds)
            result["cpu"] = cpu_s() - c0
            result["ticks"] = (monitor.statistics().ticks - ticks0) if monitor else 0
            nursery.cancel_scope.cancel()

    trio.run(main)
    return result["cpu"], result["ticks"]


def measure_bare_loop(seconds: float) -> float:
    """CPU seconds of a trio loop that only wakes every 200 ms (what any 5 Hz task costs)."""
    result = {}

    async def main() -> None:
        c0 = cpu_s()
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            await trio.sleep(0.2)
        result["cpu"] = cpu_s() - c0

    trio.run(main)
    return result["cpu"]


def sample_cost_us(groups, rounds: int) -> float:
    t0 = time.thread_time()
    for _ in range(rounds):
        for g in groups:
            g.sample(memory_max_age_s=1.0)  # as the monitor samples
    return (time.thread_time() - t0) / (rounds * len(groups)) * 1e6


def enter_group(paths: list[str]):  # type: ignore[no-untyped-def]
    def enter() -> None:
        pid = str(os.getpid()).encode()
        for path in paths:
            fd = os.open(path, os.O_WRONLY)
            os.write(fd, pid)
            os.close(fd)

    return enter


# A process that wakes every 50 ms and does almost nothing: enough to move its group's CPU
# counter every tick (no quiet ticks), cheap enough not to load the host.
WAKER = "import time\nwhile True: time.sleep(0.05)"


def main() -> None:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=100)
    p.add_argument("--active", type=int, default=10, help="envs with a process waking every 50 ms (mixed run)")
    p.add_argument("--seconds", type=float, default=None, help="per measurement (default 20, quick 4)")
    args = p.parse_args()
    seconds = args.seconds or (4.0 if args.quick else 20.0)
    rounds = 1 if args.quick else 3
    report = Report("monitor_overhead", "Elastic monitor CPU cost", args.quick)

    backend = detect_backend(f"weenv-bench-{os.getpid()}")
    groups, sleepers, wakers = [], [], []
    try:
        limits = EnvLimits(cpu_min_cores=0.25, cpu_max_cores=2.0, memory_min_bytes=64 * MIB, memory_max_bytes=1 << 30)
        for i in range(args.envs):
            g = backend.create(f"env{i:04}")
            groups.append(g)
            if i % 2:
                sleepers.append(subprocess.Popen(["sleep", "3600"], preexec_fn=enter_group(g.procs_paths())))

        per_sample_us = sample_cost_us(groups, rounds=20)
        # Same groups, same limits; only what runs in a worker thread and the probe differ.
        variants = {
            "daemon": dict(offload="apply", usage_ns=backend.usage_ns),
            "apply": dict(offload="apply"),
            "all": dict(offload="all"),
            "every2": dict(offload="apply", usage_ns=backend.usage_ns, settled_read_every=2),
        }
        labels = {
            "daemon": 'as the daemon runs it: offload="apply" + quiet ticks (parent usage probe)',
            "every2": 'the same, settled envs read every 2nd tick (settled_read_every=2)',
            "apply": 'offload="apply", no probe (every group read every tick)',
            "all": 'offload="all", no probe (sampling in a worker thread too)',
        }
        monitors = {k: Monitor(backend.node_memory, interval_ms=200, **kw) for k, kw in variants.items()}
        for m in monitors.values():
            for i, g in enumerate(groups):
                m.add(f"env{i:04}", g, limits)
        empty_loop = Monitor(backend.node_memory, interval_ms=200, **variants["daemon"])
        cpu = {"idle": 0.0, "bare": 0.0, "empty": 0.0, **{k: 0.0 for k in monitors}}
        ticks = {k: 0 for k in monitors}
        for _ in range(rounds):  # interleaved, so host noise hits every variant alike
            cpu["idle"] += measure(seconds, None)[0]
            cpu["bare"] += measure_bare_loop(seconds)
            cpu["empty"] += measure(seconds, empty_loop)[0]
            for mode, m in monitors.items():
                c, t = measure(seconds, m)
                cpu[mode] += c
                ticks[mode] += t
        # Mixed: some envs wake every 50 ms, so no tick is quiet.
        for g in groups[: 2 * args.active : 2]:  # the empty ones
            wakers.append(subprocess.Popen([sys.executable, "-c", WAKER], preexec_fn=enter_group(g.procs_paths())))
        time.sleep(1)
        mixed = {"daemon": 0.0, "apply": 0.0, "every2": 0.0}
        for _ in range(rounds):
            for mode in mixed:
                mixed[mode] += measure(seconds, monitors[mode])[0]
            cpu["idle"] += measure(seconds, None)[0]
        idle_share = cpu["idle"] / (2 * seconds * rounds) * 100
        total_s = seconds * rounds
        share = {k: v / total_s * 100 for k, v in cpu.items() if k != "idle"}
        scale = 100 / args.envs
        for mode in monitors:
            per_100 = max(0.0, share[mode] - idle_share) * scale
            report.add(
                f"monitor CPU, all envs idle, {labels[mode]}", per_100, "% of a core per 100 envs",
                baseline=idle_share, baseline_label="idle trio loop, % of a core",
                goal="≤1 % of one core per 100 envs", ok=per_100 <= 1.0,
                note=f"{share[mode]:.2f} % with the monitor vs {idle_share:.3f} % idle; "
                     f"{(cpu[mode] - cpu['idle'] / 2) / max(ticks[mode], 1) * 1e3:.2f} ms CPU per tick",
            )  # fmt: skip
        for mode in mixed:
            per_100 = max(0.0, mixed[mode] / total_s * 100 - idle_share) * scale
            report.add(
                f"monitor CPU, {args.active} of {args.envs} envs active, {labels[mode]}", per_100,
                "% of a core per 100 envs", baseline=idle_share, baseline_label="idle trio loop, % of a core",
                goal="≤1 % of one core per 100 envs", ok=per_100 <= 1.0,
                note="no tick is quiet: every group is read every tick",
            )  # fmt: skip
        report.add("of which: a trio loop waking every 200 ms", max(0.0, share["bare"] - idle_share),
                   "% of a core", note="trio.sleep(0.2) in a loop, nothing else")  # fmt: skip
        report.add("of which: the monitor with no envs", max(0.0, share["empty"] - idle_share),
                   "% of a core", note="wake-up, the probe read and the node memory once a second")  # fmt: skip
        report.add("sample() per idle group", per_sample_us, "µs CPU (hot cache)",
                   note=f"{backend.version}, features {sorted(backend.features)}")  # fmt: skip
        quiet = monitors["daemon"].statistics()
        report.add("quiet ticks (daemon variant)", quiet.quiet_ticks / max(quiet.ticks, 1) * 100, "% of ticks",
                   note="ticks in which no group had used CPU: settled envs were not read")  # fmt: skip
        late = sum(m.statistics().late_ticks for m in monitors.values())
        report.add("late ticks", late, "ticks", goal="0", ok=late == 0)
        changes = sum(
            m.metrics(f"env{i:04}").cpu_down + m.metrics(f"env{i:04}").memory_down
            for m in monitors.values() for i in range(args.envs)
        )  # fmt: skip
        report.notes.append(
            f"{len(sleepers)} groups hold a sleeping process, {args.envs - len(sleepers)} are empty; in the mixed "
            f"run {len(wakers)} of the empty ones hold a process waking every 50 ms. {changes} quota changes "
            f"happened (idle envs sit at their mins). Host load average during the run: "
            f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs."
        )
        report.print()
        print("saved", report.save())
    finally:
        for proc in sleepers + wakers:
            proc.kill()
            proc.wait()
        for g in groups:
            g.kill_all()
            g.remove(timeout_s=5)
        backend.remove_parent()


if __name__ == "__main__":
    sys.exit(main())
