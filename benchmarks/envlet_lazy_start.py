"""Cold start of a Debian bookworm + python3 image: lazy (envlet) vs full pull + extract.

    python -m benchmarks.envlet_lazy_start [--quick]

For each network profile (loopback; 100 MB/s + 1 ms; 12.5 MB/s + 5 ms through a throttling proxy),
with empty caches on both sides:
- lazy: register the layer with a fresh envlet (TOC fetch), then run
  ``python3 -c 'import json, asyncio, sqlite3'`` chrooted on the lazily mounted layer;
- full: download the whole blob, ``zstd -dc | tar -x`` it, run the same command chrooted.
Reports time to the command's output and the bytes each side pulled through the proxy.
--quick uses a busybox image and a shell command instead (a smoke run, not a measurement).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from weenv import layerfmt
from weenv.envlet import EnvletProcess, StoreSpec
from weenv.testing import BadEntry, busybox_tree, cache_root, cached, check_file, debian_tar, start_registry
from weenv.testing import stop_registry

from ._throttle import ThrottleProxy
from ._util import Report, arg_parser, median

PY_CMD = ["/usr/bin/python3", "-c", "import json, asyncio, sqlite3; print('ready')"]
SH_CMD = ["/bin/sh", "-c", "cat /etc/passwd >/dev/null; echo ready"]
PROFILES_FULL = [("loopback", None, 0.0), ("100 MB/s + 1 ms", 100e6, 0.001), ("12.5 MB/s + 5 ms", 12.5e6, 0.005)]
PROFILES_QUICK = [("loopback", None, 0.0), ("100 MB/s + 1 ms", 100e6, 0.001)]


def _check_layer(path: Path) -> None:
    check_file(path)
    try:
        with layerfmt.FileReader.open(path) as reader:
            layerfmt.Layer.open(reader)
    except layerfmt.LayerError as e:
        raise BadEntry(f"{path}: not a readable layer ({e})") from None


def layer_file(tar: Path, prefetch: list[str] | None = None) -> Path:
    key = hashlib.sha256("\n".join(prefetch or []).encode()).hexdigest()[:12] if prefetch else "plain"

    def build(out: Path) -> None:
        with open(out, "wb") as f:
            layerfmt.build_layer(str(tar), f, spool_dir=str(out.parent), prefetch=prefetch or ())

    name = tar.with_suffix(f".weenv-v{layerfmt.FORMAT_VERSION}-{key}").name
    return cached(name, build, _check_layer, root=tar.parent)


def record_trace(tmp: Path, reg_host: str, g, cmd: list[str]) -> list[str]:
    """Run the command once on a lazily mounted layer and return its files in first-read order."""
    base = Path(tempfile.mkdtemp(dir=tmp, prefix="trace-"))
    env = EnvletProcess(str(base / "mnt"), str(base / "cache"), str(base / "ctl.sock"))
    env.start()
    try:
        info = env.client.register(StoreSpec("registry", registry=reg_host, insecure=True), g.layer_digest,
                                   g.layer_size, g.toc_digest, repo=g.repo)
        run_until_output(info.path, cmd)
        return env.client.trace(info.name)
    finally:
        env.stop()
        shutil.rmtree(base, ignore_errors=True)


def run_until_output(root: str, cmd: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(["chroot", root, *cmd], capture_output=True, text=True, timeout=300)
    if p.returncode != 0 or "ready" not in p.stdout:
        raise RuntimeError(f"command failed in {root}: {p.returncode} {p.stderr[-500:]}")
    return time.perf_counter() - t0


def lazy_start(tmp: Path, proxy: ThrottleProxy, g, cmd: list[str]) -> tuple[float, int, dict]:
    base = Path(tempfile.mkdtemp(dir=tmp, prefix="lazy-"))
    env = EnvletProcess(str(base / "mnt"), str(base / "cache"), str(base / "ctl.sock"))
    env.start()
    try:
        proxy.reset_counters()
        t0 = time.perf_counter()
        timeline: list[tuple[float, int]] = []
        done = threading.Event()

        def sample() -> None:  # bytes through the proxy over time, for the plot
            while not done.is_set():
                timeline.append((time.perf_counter() - t0, proxy.bytes_down))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        info = env.client.register(StoreSpec("registry", registry=proxy.host, insecure=True), g.layer_digest,
                                   g.layer_size, g.toc_digest, repo=g.repo)
        run_until_output(info.path, cmd)
        elapsed = time.perf_counter() - t0
        done.set()
        sampler.join()
        timeline.append((elapsed, proxy.bytes_down))
        stats = env.client.stats()
        stats["timeline"] = timeline
        return elapsed, proxy.bytes_down, stats
    finally:
        env.stop()
        shutil.rmtree(base, ignore_errors=True)


def full_start(tmp: Path, proxy: ThrottleProxy, g, cmd: list[str]) -> tuple[float, int]:
    base = Path(tempfile.mkdtemp(dir=tmp, prefix="full-"))
    try:
        proxy.reset_counters()
        t0 = time.perf_counter()
        blob = base / "blob"
        with httpx.Client(timeout=300) as client, open(blob, "wb") as f:
            with client.stream("GET", f"http://{proxy.host}/v2/{g.repo}/blobs/{g.layer_digest}") as r:
                r.raise_for_status()
                for part in r.iter_bytes(1 << 20):
                    f.write(part)
        root = base / "root"
        root.mkdir()
        subprocess.run(f"zstd -dc {blob} | tar --numeric-owner -xpf - -C {root}", shell=True, check=True)
        run_until_output(str(root), cmd)
        return time.perf_counter() - t0, proxy.bytes_down
    finally:
        shutil.rmtree(base, ignore_errors=True)


def source_image(tmp: Path, quick: bool) -> tuple[Path, str]:
    """The image tar cold starts are measured on, and its label: a busybox tree made in ``tmp``
    (quick), or the cached Debian bookworm minbase + python3 tar."""
    if quick:
        root = busybox_tree(tmp / "bb")
        source_tar = tmp / "bb.tar"
        subprocess.run(["tar", "--numeric-owner", "-cf", str(source_tar), "-C", str(root), "."], check=True)
        return source_tar, "busybox"
    return debian_tar(include=("python3",)), "Debian bookworm minbase + python3"


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    report = Report("envlet_lazy_start", "Cold start: lazy envlet vs full pull + extract", args.quick)
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as t:
        tmp = Path(t)
        source_tar, label = source_image(tmp, args.quick)
        if args.quick:
            cmd, repeat, profiles = SH_CMD, 1, PROFILES_QUICK
        else:
            cmd, repeat, profiles = PY_CMD, 3, PROFILES_FULL
        lf = layer_file(source_tar)
        reg = start_registry(str(tmp / "registry"))
        try:
            from weenv.registry import publish_layer_file, resolve_group

            ref = f"{reg.host}/bench/lazy:v1"
            publish_layer_file(str(lf), ref, group="os", group_class="os")
            g = resolve_group(ref)
            # the same image published with a prefetch list recorded from one run of the command
            trace = record_trace(tmp, reg.host, g, cmd)
            pref = f"{reg.host}/bench/lazy:prefetch"
            publish_layer_file(str(layer_file(source_tar, trace)), pref, group="os", group_class="os")
            gp = resolve_group(pref)
            report.notes.append(f"{label}: layer {g.layer_size / 1e6:.1f} MB compressed; command {' '.join(cmd)!r}; "
                                f"prefetch list: {len(trace)} files recorded by `weenv envlet trace`")
            for name, rate, latency in profiles:
                with ThrottleProxy(reg.host, rate_bytes_s=rate, latency_s=latency) as proxy:
                    runs: dict[str, list[tuple[float, int]]] = {"lazy": [], "prefetch": [], "full": []}
                    stats: dict[str, dict] = {}
                    for _ in range(repeat):  # interleaved, so noise hits all alike
                        t_, b_, stats["lazy"] = lazy_start(tmp, proxy, g, cmd)
                        runs["lazy"].append((t_, b_))
                        t_, b_, stats["prefetch"] = lazy_start(tmp, proxy, gp, cmd)
                        runs["prefetch"].append((t_, b_))
                        runs["full"].append(full_start(tmp, proxy, g, cmd))
                    report.series[f"{name}|full pull|seconds"] = [t for t, _ in runs["full"]]
                    ft = median([t for t, _ in runs["full"]])
                    fb = median([b for _, b in runs["full"]])
                    for kind, title in (("lazy", "lazy"), ("prefetch", "lazy + recorded prefetch list")):
                        lt = median([t for t, _ in runs[kind]])
                        lb = median([b for _, b in runs[kind]])
                        report.add(f"{name}: {title}: time to first output", lt, "s", baseline=ft,
                                   baseline_label="pull+extract+run", goal="≥5x faster", ok=ft / lt >= 5)
                        share = lb / g.layer_size
                        report.add(f"{name}: {title}: bytes fetched", lb / 1e6, "MB", baseline=fb / 1e6,
                                   baseline_label="full blob", goal="≤15% of the image", ok=share <= 0.15)
                        st = stats[kind]
                        report.series[f"{name}|{title}|bytes_over_time"] = st.get("timeline", [])
                        report.notes.append(f"{name}, {title}: {st['remote_fetches']} range reads, "
                                            f"{st['remote_chunks']} chunks, {share:.1%} of the image")
        finally:
            stop_registry(reg)
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
