"""User namespaces: what running every env in its own user namespace adds to a start (issue 16).

    python -m benchmarks.isolation [--quick]

Two daemons run side by side on this machine, one with ``--userns`` and one without (each its own
$WEENV_HOME, envlet and cgroup root, the same busybox plan); starts alternate between them so both
see the same machine state. Measures create → first exec output (p50/p99 of each), the daemon's
own per-step breakdown (the user namespace is made by crun, in ``crun_create``), and the exec round
trip inside a running env of each.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec

from weenv.plan import load_lock
from weenv.testing import DaemonHandle, busybox_plan, teardown_private_daemon

from ._util import Report, arg_parser, median, percentile


@dataclass
class _Daemon(DaemonHandle):
    userns: bool = False

    def env_vars(self) -> dict[str, str]:
        return {**super().env_vars(), "WEENV_USERNS": "1" if self.userns else "0", "WEENV_LAYER_TREES_AFTER": "0"}


@contextmanager
def _daemon(name: str, userns: bool) -> Iterator[_Daemon]:
    home = tempfile.mkdtemp(prefix=f"weenv-bench-{name}-")
    plan, lock = busybox_plan(home, name)
    d = _Daemon(home, os.path.join(home, "run", "weenv.sock"), f"weenv-bench-{name}-{os.getpid()}", lock, plan,
                os.path.join(home, "daemon.log"), None, userns)  # type: ignore[arg-type]
    d.start()
    try:
        yield d
    finally:
        left = teardown_private_daemon(d)
        if left:
            print(f"LEAKS ({name}): {left}")


def _lock(path: str):  # type: ignore[no-untyped-def]
    lock = load_lock(path)  # a low CPU min: admission never stalls the loop on this 2-core machine
    res = msgspec.structs.replace(lock.resources, cpu=msgspec.structs.replace(lock.resources.cpu, min=0.02))
    return msgspec.structs.replace(lock, resources=res)


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    n = 20 if args.quick else 200
    execs = 50 if args.quick else 500
    report = Report("isolation", "User namespaces: start latency and exec round trip, with vs without", args.quick)
    with _daemon("plain", False) as plain, _daemon("userns", True) as userns, \
            plain.client() as cp, userns.client() as cu:
        sides = {"without": (cp, _lock(plain.plan_lock)), "userns": (cu, _lock(userns.plan_lock))}
        for _ in range(3):  # warm both: layers registered, page cache, crun and the agent loaded
            for c, lock in sides.values():
                with c.create(lock) as env:
                    env.exec(["echo", "hi"])
        with sides["userns"][0].create(sides["userns"][1]) as env:
            uid_map = env.exec(["cat", "/proc/self/uid_map"]).stdout.split()
            assert uid_map[1] != b"0", f"the userns daemon's env has no user namespace: {uid_map}"
        times: dict[str, list[float]] = {k: [] for k in sides}
        steps: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
        for i in range(n):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for name in order:
                c, lock = sides[name]
                t0 = time.perf_counter()
                env = c.create(lock)
                r = env.exec(["echo", "hi"])
                times[name].append(time.perf_counter() - t0)
                assert r.stdout == b"hi\n", r
                steps[name].append(env.info.get("timings_ms", {}))
                env.kill()
        w50, u50 = median(times["without"]) * 1000, median(times["userns"]) * 1000
        report.add("create → first exec output, no user namespace", w50, "ms",
                   p99=percentile(times["without"], 99) * 1000)
        report.add("create → first exec output, user namespace", u50, "ms",
                   p99=percentile(times["userns"], 99) * 1000, baseline=w50,
                   baseline_label="no user namespace, same run", goal="≤ +5 ms p50", ok=u50 - w50 <= 5,
                   note=f"{u50 - w50:+.1f} ms p50 ({n} starts each, interleaved)")
        report.series["start_without_ms"] = [x * 1000 for x in times["without"]]
        report.series["start_userns_ms"] = [x * 1000 for x in times["userns"]]
        for name, runs in steps.items():
            keys = sorted({k for s in runs for k in s})
            report.notes.append(f"daemon-side create steps ({name}), median ms: " + ", ".join(
                f"{k} {statistics.median([s.get(k, 0.0) for s in runs]):.1f}" for k in keys))

        rtt: dict[str, list[float]] = {k: [] for k in sides}
        envs = {name: c.create(lock) for name, (c, lock) in sides.items()}
        try:
            for i in range(execs):
                for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                    t0 = time.perf_counter()
                    envs[name].exec(["true"])
                    rtt[name].append(time.perf_counter() - t0)
        finally:
            for env in envs.values():
                env.kill()
        r50w, r50u = median(rtt["without"]) * 1000, median(rtt["userns"]) * 1000
        report.add("exec round trip, no user namespace", r50w, "ms", p99=percentile(rtt["without"], 99) * 1000)
        report.add("exec round trip, user namespace", r50u, "ms", p99=percentile(rtt["userns"], 99) * 1000,
                   baseline=r50w, baseline_label="no user namespace, same run", note=f"{execs} execs each")
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
