"""The exec-hijack probe of issue 16 at full size: how many of N execs env root can forge.

    python -m benchmarks.exec_hijack [--execs 1000]

A private daemon starts one busybox env; weenv/testing/escape_probe.c runs in it as root in the
background, tries to steal the agent's listening socket (pidfd_getfd, /proc/1/fd, /proc/1/mem,
ptrace, binding the socket's path) and answers every connection it gets with a forged
``rc=0 "HIJACKED: 42 passed"``. Then ``sh -c 'echo REAL; exit 3'`` runs N times through the
daemon; every result that is not ``(3, "REAL\\n")`` counts as forged. The suite runs the same
with 100 execs (tests/test_escape.py). Prints the count, the probe's attempts and the exec p50.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

from weenv.testing import PROBE_SOURCE, attempts, wait_for

from ._daemon import bench_daemon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--execs", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe")
        subprocess.run(["gcc", "-static", "-O1", "-o", probe, PROBE_SOURCE], check=True)
        with bench_daemon("hijack") as d, d.client() as c, c.create(d.plan_lock) as env:
            with open(probe, "rb") as f:
                env.write_file("/tmp/probe", f.read(), mode=0o755)
            host_socket = os.path.join(os.path.dirname(env.info["rootfs"]), "agent.sock")
            serve_s = max(60, args.execs // 10)
            env.exec(["sh", "-c", f"/tmp/probe hijack 1 {serve_s} {host_socket} >/tmp/probe.log 2>&1 &"])
            assert wait_for(lambda: b"serving" in env.read_file("/tmp/probe.log"), timeout_s=10)
            forged, errors, times = 0, 0, []
            for _ in range(args.execs):
                t0 = time.perf_counter()
                try:
                    r = env.exec(["sh", "-c", "echo REAL; exit 3"])
                except Exception:  # an exec the daemon refused to trust is not forged, but is counted
                    errors += 1
                    continue
                times.append(time.perf_counter() - t0)
                forged += (r.exit_code, r.stdout) != (3, b"REAL\n")
            log = env.read_file("/tmp/probe.log").decode()
    print(f"forged: {forged} of {args.execs} execs; refused as untrusted: {errors}; "
          f"connections the probe answered: {log.count('answered a connection')}")
    print(f"exec round trip p50: {statistics.median(times) * 1000:.2f} ms")
    for name, result in attempts(log).items():
        print(f"  {name}: {result}")


if __name__ == "__main__":
    main()
