"""Egress envs: what a network namespace + veth + nft rules add to a start, and what the NAT costs.

    python -m benchmarks.network [--quick]

Everything stays on this machine: the "outside" is a network namespace this benchmark makes
(weenv.testing.Outside), the daemon's only egress interface is its veth. Measures, in one run:
- create → first exec output with ``network = "none"`` and with ``mode = "egress"`` (an allow
  entry), interleaved so both see the same machine state: p50/p99 of each, and the daemon's own
  per-step breakdown for egress (the wiring runs while the layers register);
- download throughput of a file through the env's NAT (busybox wget in the env from an HTTP server
  in the outside namespace) vs the same client and server over the host's own loopback.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec

from weenv.testing import OUTSIDE_A as OUT_A
from weenv.testing import OUTSIDE_PORT as PORT
from weenv.testing import Outside, egress_daemon
from weenv.plan import load_lock
from weenv.plan._model import NetworkPolicy

from ._util import Report, arg_parser, median, percentile

HUGE_BYTES = 256 << 20


def _locks(path: str):  # type: ignore[no-untyped-def]
    lock = load_lock(path)
    res = msgspec.structs.replace(lock.resources, cpu=msgspec.structs.replace(lock.resources.cpu, min=0.02))
    base = msgspec.structs.replace(lock, resources=res)
    egress = msgspec.structs.replace(base, network=NetworkPolicy(mode="egress", allow=[f"{OUT_A}:{PORT}"]))
    return base, egress


def _wget_seconds(run, url: str) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    code = run(url)
    took = time.perf_counter() - t0
    assert code == 0, f"download of {url} failed"
    return took


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    n = 20 if args.quick else 150
    downloads = 2 if args.quick else 5
    size = (32 << 20) if args.quick else HUGE_BYTES
    report = Report("network", "Egress envs: start latency and NAT throughput", args.quick)
    world = Outside()
    try:
        world.open()
        served = world.dirs[0]  # OUT_A:8000
        with open(os.path.join(served, "huge"), "wb") as f:
            f.write(os.urandom(size))
        with egress_daemon(world, "net") as d, d.client() as c:
            none_lock, egress_lock = _locks(d.plan_lock)
            for lock in (none_lock, egress_lock, none_lock, egress_lock):  # warm both paths
                with c.create(lock) as env:
                    env.exec(["echo", "hi"])
            times: dict[str, list[float]] = {"none": [], "egress": []}
            steps: dict[str, list[dict[str, float]]] = {"none": [], "egress": []}
            for i in range(n):
                order = (("none", none_lock), ("egress", egress_lock))
                for name, lock in (order if i % 2 == 0 else order[::-1]):
                    t0 = time.perf_counter()
                    env = c.create(lock)
                    r = env.exec(["echo", "hi"])
                    times[name].append(time.perf_counter() - t0)
                    assert r.stdout == b"hi\n"
                    steps[name].append(env.info.get("timings_ms", {}))
                    env.kill()
            n50, e50 = median(times["none"]) * 1000, median(times["egress"]) * 1000
            report.add('create → first exec output, network = "none"', n50, "ms",
                       p99=percentile(times["none"], 99) * 1000)
            report.add('create → first exec output, mode = "egress"', e50, "ms",
                       p99=percentile(times["egress"], 99) * 1000, baseline=n50, baseline_label='"none", same run',
                       goal="≤ +10 ms p50", ok=e50 - n50 <= 10,
                       note=f"+{e50 - n50:.1f} ms p50")
            report.series["start_none_ms"] = [x * 1000 for x in times["none"]]
            report.series["start_egress_ms"] = [x * 1000 for x in times["egress"]]
            for name, runs in steps.items():
                keys = sorted({k for s in runs for k in s})
                report.notes.append(f"daemon-side create steps ({name}), median ms: " + ", ".join(
                    f"{k} {statistics.median([s.get(k, 0.0) for s in runs]):.1f}" for k in keys))

            # throughput: the same client (busybox wget) and server (python http.server), NAT vs loopback
            # one full core for the client in the env (the host's client is not limited either)
            cpu = msgspec.structs.replace(egress_lock.resources.cpu, min=1.0, max=1.0)
            fast = msgspec.structs.replace(egress_lock, resources=msgspec.structs.replace(egress_lock.resources, cpu=cpu))
            with c.create(fast) as env:
                def in_env(url: str) -> int:
                    r = env.exec(["busybox", "wget", "-q", "-O", "/dev/null", url], timeout_s=600)
                    if r.exit_code:
                        print("env wget:", r.exit_code, r.stderr.decode(errors="replace")[-500:])
                        print(env.network())
                        print(subprocess.run(["ip", "netns", "exec", world.netns, "ss", "-ltn"], capture_output=True, text=True).stdout)
                    return r.exit_code

                nat = [_wget_seconds(in_env, f"http://{OUT_A}:{PORT}/huge") for _ in range(downloads)]
            local_dir = tempfile.mkdtemp(prefix="wbench-lo-")
            os.link(os.path.join(served, "huge"), os.path.join(local_dir, "huge"))
            server = subprocess.Popen([sys.executable, "-m", "http.server", "18765", "--bind", "127.0.0.1",
                                       "--directory", local_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 10
                while subprocess.run(["busybox", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:18765/"],
                                     capture_output=True).returncode != 0:
                    assert time.monotonic() < deadline, "loopback server did not start"
                    time.sleep(0.1)

                def on_host(url: str) -> int:
                    return subprocess.run(["busybox", "wget", "-q", "-O", "/dev/null", url]).returncode

                loop = [_wget_seconds(on_host, "http://127.0.0.1:18765/huge") for _ in range(downloads)]
            finally:
                server.terminate()
                server.wait(10)
                os.unlink(os.path.join(local_dir, "huge"))
                os.rmdir(local_dir)
            mib = size / (1 << 20)
            nat_rate, loop_rate = mib / median(nat), mib / median(loop)
            report.add("download through the env's NAT", nat_rate, "MiB/s", baseline=loop_rate,
                       baseline_label="host loopback, same client and server", higher_is_better=True,
                       note=f"{mib:.0f} MiB, median of {downloads}")
        if d.left:
            report.notes.append(f"LEAKS: {d.left}")
    finally:
        world.close()
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
