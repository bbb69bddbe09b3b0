"""The cost of E2B compatibility: the unmodified ``e2b`` SDK through ``weenv serve`` next to weenv's
native client, on one node, in the same run (issue 17).

    python -m benchmarks.e2b_api [--quick]

One daemon with a warm pool (``WEENV_POOL_SIZE``), one ``weenv serve`` in front of it (127.0.0.1),
the busybox plan as template ``bb`` (network ``loopback``, as an E2B sandbox: the pool serves the SDK's
creates and the native ones alike). Measures create → first ``commands.run`` output (p50/p99), the
command round trip (the SDK runs ``/bin/bash -l -c CMD``, sh here: the native side runs the same
argv), a 1 MiB file write and read, and N sandboxes created at once (64; quick: 8).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from weenv.testing import DaemonHandle, busybox_plan, teardown_private_daemon

from ._util import Report, arg_parser, median, percentile


class _Daemon(DaemonHandle):
    def env_vars(self) -> dict[str, str]:
        return {**super().env_vars(), "WEENV_POOL_SIZE": "4"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bench_lock(src: str, dst: str) -> str:
    """The busybox lock with lo up and small minimums (64 at once must be admitted on 2 cores)."""
    text = open(src).read()
    doc = json.loads(text) if text.lstrip().startswith("{") else tomllib.loads(text)
    doc["network"] = "loopback"
    res = doc.get("resources") or {}
    if isinstance(res.get("cpu"), dict):
        res["cpu"]["min"] = 0.02
    if isinstance(res.get("memory"), dict) and "min" in res["memory"]:
        res["memory"]["min"] = "16MiB" if isinstance(res["memory"]["min"], str) else 16 << 20
    with open(dst, "w") as f:
        json.dump(doc, f)
    return dst


def _serve(d: DaemonHandle, key: str) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    port = _free_port()
    log = open(os.path.join(d.home, "serve.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "weenv", "serve", "--listen", f"127.0.0.1:{port}",
                             "--socket", d.socket], env=d.env_vars(), stdin=subprocess.DEVNULL, stdout=log,
                            stderr=log, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/v1/ping", headers={"Authorization": f"Bearer {key}"}, timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("weenv serve did not start")
        time.sleep(0.05)


@contextlib.contextmanager
def e2b_front(d: DaemonHandle, lock: str, template: str = "bb") -> Iterator[Any]:
    """``weenv serve`` in front of ``d`` with an admin key and ``lock`` as template ``template``, the
    E2B SDK's environment pointed at it: yields the ``e2b`` module; serve stopped and the
    environment put back at the end."""
    import e2b

    from weenv.api import KeyStore, TemplateStore

    api_dir = os.path.join(d.home, "api")
    key = KeyStore(api_dir).create(f"bench-{os.getpid()}", admin=True)
    TemplateStore(api_dir).set(template, lock)
    serve, url = _serve(d, key)
    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key})
    try:
        yield e2b
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(10)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    starts, cmds, files, concurrent = (10, 50, 5, 8) if args.quick else (100, 300, 20, 64)
    report = Report("e2b_api", "E2B SDK through weenv serve vs the native client", args.quick)
    home = tempfile.mkdtemp(prefix="weenv-bench-e2b-")
    plan, lock = busybox_plan(home, "e2b")
    d = _Daemon(home, os.path.join(home, "run", "weenv.sock"), f"weenv-bench-e2b-{os.getpid()}", lock, plan,
                os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    try:
        bench_lock = _bench_lock(lock, os.path.join(home, "bench.lock.json"))
        with e2b_front(d, bench_lock) as e2b, d.client() as c:
            for _ in range(5):  # warm: layers, page cache, the pool filled for this lock, SDK connections
                s = e2b.Sandbox.create("bb", timeout=120)
                s.commands.run("echo hi")
                s.kill()
                with c.create(bench_lock) as env:
                    env.exec(["echo", "hi"])
            sdk_start, nat_start = [], []
            for i in range(starts):
                for side in (("sdk", "native") if i % 2 == 0 else ("native", "sdk")):
                    time.sleep(0.05)  # the pool refills in the background
                    t0 = time.perf_counter()
                    if side == "sdk":
                        s = e2b.Sandbox.create("bb", timeout=120)
                        out = s.commands.run("echo hi").stdout
                        sdk_start.append(time.perf_counter() - t0)
                        s.kill()
                    else:
                        env = c.create(bench_lock)
                        out = env.exec(["/bin/sh", "-l", "-c", "echo hi"]).stdout.decode()
                        nat_start.append(time.perf_counter() - t0)
                        env.kill()
                    assert out == "hi\n", out
            s50, n50 = median(sdk_start) * 1000, median(nat_start) * 1000
            report.add("create → first output, native client", n50, "ms", p99=percentile(nat_start, 99) * 1000)
            report.add("create → first output, E2B SDK", s50, "ms", p99=percentile(sdk_start, 99) * 1000,
                       baseline=n50, baseline_label="native, same run", goal="≤ 60 ms p50 (warm pool)",
                       ok=s50 <= 60, note=f"{starts} each, interleaved")
            report.series["start_sdk_ms"] = [x * 1000 for x in sdk_start]
            report.series["start_native_ms"] = [x * 1000 for x in nat_start]

            s = e2b.Sandbox.create("bb", timeout=600)
            env = c.create(bench_lock)
            try:
                sdk_rtt, nat_rtt = [], []
                for i in range(cmds):
                    t0 = time.perf_counter()
                    s.commands.run("true")
                    sdk_rtt.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    env.exec(["/bin/sh", "-l", "-c", "true"])
                    nat_rtt.append(time.perf_counter() - t0)
                r_s, r_n = median(sdk_rtt) * 1000, median(nat_rtt) * 1000
                report.add("command round trip, native client", r_n, "ms", p99=percentile(nat_rtt, 99) * 1000)
                report.add("command round trip, E2B SDK", r_s, "ms", p99=percentile(sdk_rtt, 99) * 1000,
                           baseline=r_n, baseline_label="native, same run", goal="≤ 2x native",
                           ok=r_s <= 2 * r_n, note=f"{cmds} each")
                data = os.urandom(1 << 20)
                times: dict[str, list[float]] = {k: [] for k in ("sw", "sr", "nw", "nr")}
                for _ in range(files):
                    t0 = time.perf_counter()
                    s.files.write("/tmp/big.bin", data)
                    times["sw"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = s.files.read("/tmp/big.bin", format="bytes")
                    times["sr"].append(time.perf_counter() - t0)
                    assert bytes(got) == data
                    t0 = time.perf_counter()
                    env.write_file("/tmp/big.bin", data)
                    times["nw"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    assert env.read_file("/tmp/big.bin") == data
                    times["nr"].append(time.perf_counter() - t0)
                for op, sk, nk in (("write", "sw", "nw"), ("read", "sr", "nr")):
                    nv = median(times[nk]) * 1000
                    report.add(f"1 MiB file {op}, native client", nv, "ms")
                    report.add(f"1 MiB file {op}, E2B SDK", median(times[sk]) * 1000, "ms", baseline=nv,
                               baseline_label="native, same run", note=f"{files} each")
            finally:
                s.kill()
                env.kill()

            def sdk_one(_: int) -> float:
                t0 = time.perf_counter()
                sb = e2b.Sandbox.create("bb", timeout=120)
                sb.commands.run("true")
                took = time.perf_counter() - t0
                sb.kill()
                return took

            def nat_one(_: int) -> float:
                t0 = time.perf_counter()
                e = c.create(bench_lock)
                e.exec(["true"])
                took = time.perf_counter() - t0
                e.kill()
                return took

            walls = {}
            for name, fn in (("native", nat_one), ("sdk", sdk_one)):
                time.sleep(1.0)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(concurrent) as pool:
                    each = list(pool.map(fn, range(concurrent)))
                walls[name] = (time.perf_counter() - t0, each)
            nw_, ne = walls["native"]
            sw_, se = walls["sdk"]
            report.add(f"{concurrent} created at once, native client (all ready)", nw_ * 1000, "ms",
                       note=f"each create → first output p50 {median(ne) * 1000:.0f} ms")
            report.add(f"{concurrent} created at once, E2B SDK (all ready)", sw_ * 1000, "ms", baseline=nw_ * 1000,
                       baseline_label="native, same run", note=f"each p50 {median(se) * 1000:.0f} ms")
    finally:
        left = teardown_private_daemon(d)
        if left:
            print(f"LEAKS: {left}")
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
