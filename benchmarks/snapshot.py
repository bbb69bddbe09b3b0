"""Pause, resume, commit and fork latencies through the daemon, vs copying the same upper with `cp -a`.

    python -m benchmarks.snapshot [--quick]

Goals: pause ≤100 ms, resume ≤50 ms, commit of a 10 MB diff ≤150 ms, fork ×8 ≤500 ms (call to
8 running children).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time


from ._daemon import bench_daemon
from ._util import Report, arg_parser, median, percentile


def cp_upper(home: str, env_id: str) -> float:
    src = os.path.join(home, "envs", env_id, "rw", "upper")
    dst = tempfile.mkdtemp(dir=home)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-a", src, os.path.join(dst, "copy")], check=True)
    dt = time.perf_counter() - t0
    shutil.rmtree(dst)
    return dt


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    repeat = 5 if args.quick else 20
    diffs_mb = [0, 10] if args.quick else [0, 10, 200]
    report = Report("snapshot", "Pause, resume, commit, fork", args.quick)
    snaps: list[str] = []
    with bench_daemon("snap", replace={'disk = "64MiB"': 'disk = "512MiB"', 'max = "512MiB"': 'max = "1GiB"'}) as d:
        lock, home = d.plan_lock, d.home
        with d.client() as c:
            env = c.create(lock)
            env.exec(["sh", "-c", "sleep 1000 & echo started"])
            pauses, resumes = [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                env.pause()
                pauses.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                env.resume()
                resumes.append(time.perf_counter() - t0)
            report.add("pause", median(pauses) * 1000, "ms", p99=percentile(pauses, 99) * 1000, goal="≤100 ms",
                       ok=median(pauses) <= 0.1)
            report.add("resume", median(resumes) * 1000, "ms", p99=percentile(resumes, 99) * 1000, goal="≤50 ms",
                       ok=median(resumes) <= 0.05)
            env.kill()
            for mb in diffs_mb:
                commits, copies = [], []
                for i in range(max(3, repeat // 4)):
                    e = c.create(lock)
                    if mb:
                        # compressible-ish data, like build outputs: half random, half zeros
                        e.exec(["sh", "-c", f"mkdir -p /data && dd if=/dev/urandom of=/data/r bs=1M count={mb // 2} "
                                            f"2>/dev/null; dd if=/dev/zero of=/data/z bs=1M count={mb - mb // 2} 2>/dev/null"],
                               timeout_s=120)
                    copies.append(cp_upper(home, e.id))
                    t0 = time.perf_counter()
                    snaps.append(e.commit())
                    commits.append(time.perf_counter() - t0)
                    e.kill()
                goal = {10: ("≤150 ms", median(commits) <= 0.15)}.get(mb, (None, None))
                report.add(f"commit, {mb} MB diff", median(commits) * 1000, "ms", p99=percentile(commits, 99) * 1000,
                           baseline=median(copies) * 1000, baseline_label="cp -a of the upper", goal=goal[0], ok=goal[1])
            parent = c.create(lock)
            parent.exec(["sh", "-c", "echo state > /state"])
            forks = []
            for _ in range(max(2, repeat // 5)):
                t0 = time.perf_counter()
                kids = parent.fork(8)
                forks.append(time.perf_counter() - t0)
                snaps.append(kids[0].info["snapshot"])
                for k in kids:
                    k.kill()
            report.add("fork ×8 (call → 8 running children)", median(forks) * 1000, "ms",
                       p99=percentile(forks, 99) * 1000, goal="≤500 ms", ok=median(forks) <= 0.5)
            parent.kill()
            for s in set(snaps):
                c.delete_snapshot(s)
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
