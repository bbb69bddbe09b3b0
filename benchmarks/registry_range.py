"""Registry store: Range-read latency vs raw httpx, unchanged republish time, publish throughput vs oras.

    python -m benchmarks.registry_range [--quick]

Runs a real docker-registry on 127.0.0.1 (started and stopped here, by PID). Baselines are
measured in the same run: a bare httpx.Client GET with the same Range header on a keep-alive
connection, and oras-py's own ``push`` of the same layer file.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
import uuid

import httpx

import weenv.registry as R
from weenv.registry._oci import sha256_digest
from weenv.testing import start_registry, stop_registry

from ._util import Report, arg_parser, percentile


def bench_ranges(report: Report, host: str, tmp: str, blob_bytes: int, n_small: int, n_large: int) -> None:
    data = os.urandom(blob_bytes)
    path = os.path.join(tmp, "blob")
    with open(path, "wb") as f:
        f.write(data)
    digest = sha256_digest(data)
    repo = "bench/ranges"
    store = R.RemoteStore(host, insecure=True, credentials=None)
    raw = httpx.Client(http1=True, limits=httpx.Limits(max_connections=4, max_keepalive_connections=4))
    url = f"http://{host}/v2/{repo}/blobs/{digest}"
    try:
        store.put_blob(repo, digest, path, len(data))
        rng = random.Random(1)
        for size, n in ((4 << 10, n_small), (1 << 20, n_large)):
            ours: list[float] = []
            base: list[float] = []
            for i in range(n + 5):
                off = rng.randrange(0, blob_bytes - size)
                # interleave the two so machine noise hits both alike; first 5 warm the pools
                t0 = time.perf_counter()
                got = store.read_blob(repo, digest, off, size)
                t1 = time.perf_counter()
                r = raw.get(url, headers={"Range": f"bytes={off}-{off + size - 1}"})
                t2 = time.perf_counter()
                assert got == r.content == data[off : off + size]
                if i >= 5:
                    ours.append(t1 - t0)
                    base.append(t2 - t1)
            label = "4 KiB" if size == 4 << 10 else "1 MiB"
            p50, p50b = percentile(ours, 50) * 1e3, percentile(base, 50) * 1e3
            p99, p99b = percentile(ours, 99) * 1e3, percentile(base, 99) * 1e3
            report.add(f"{label} Range read p50 (store vs raw httpx)", p50, "ms", p99=p99, baseline=p50b,
                       baseline_label="httpx GET", goal="<=1.3x raw", ok=p50 <= 1.3 * p50b)
            report.add(f"{label} Range read p99 (store vs raw httpx)", p99, "ms", baseline=p99b,
                       baseline_label="httpx GET", goal="<=1.3x raw", ok=p99 <= 1.3 * p99b)
    finally:
        raw.close()
        store.close()


def _make_tree(root: str, total_bytes: int) -> None:
    os.makedirs(root)
    chunk = 8 << 20
    rng = random.Random(2)
    i = 0
    left = total_bytes
    while left > 0:
        n = min(chunk, left)
        # half random, half repetitive: a realistic mix for zstd
        body = rng.randbytes(n // 2) + bytes(n - n // 2)
        with open(os.path.join(root, f"f{i:04d}.bin"), "wb") as f:
            f.write(body)
        left -= n
        i += 1


def bench_publish(report: Report, host: str, tmp: str, tree_bytes: int, repeat: int) -> None:
    src = os.path.join(tmp, "tree")
    _make_tree(src, tree_bytes)
    ref = f"{host}/bench/group:v1"
    t0 = time.perf_counter()
    first = R.publish(src, ref)
    new_s = time.perf_counter() - t0
    mb = tree_bytes / 1e6
    report.add(f"publish new {mb:.0f} MB group (build + upload)", mb / new_s, "MB/s",
               note=f"blob {first.size / 1e6:.0f} MB in {new_s:.2f}s")
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        again = R.publish(src, ref)
        times.append(time.perf_counter() - t0)
        assert again.uploaded_bytes == 0 and again.digest == first.digest
    best = min(times)
    report.add(f"republish unchanged {mb:.0f} MB group", best, "s", p99=max(times), goal="<0.5 s", ok=best < 0.5)
    times_nocache = []
    for _ in range(max(1, repeat // 2)):
        t0 = time.perf_counter()
        R.publish(src, ref, use_cache=False)
        times_nocache.append(time.perf_counter() - t0)
    report.add(f"republish unchanged {mb:.0f} MB group, fingerprint cache off (rebuild)", min(times_nocache), "s",
               note="deterministic rebuild, HEAD finds the blob, 0 bytes uploaded")

    # upload throughput of the same layer file: our store vs oras-py's push, each to a fresh repository
    import oras.provider

    layer = os.path.join(tmp, "layer.blob")
    from weenv import layerfmt

    with open(layer, "wb") as f:
        built = layerfmt.build_layer(src, f)
    ours, theirs = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = R.publish_layer_file(layer, f"{host}/bench/u{uuid.uuid4().hex[:8]}:v1", digest=built.digest)
        ours.append(time.perf_counter() - t0)
        assert res.uploaded_bytes == built.size
        client = oras.provider.Registry(hostname=host, insecure=True)
        t0 = time.perf_counter()
        client.push(target=f"{host}/bench/o{uuid.uuid4().hex[:8]}:v1", files=[layer], disable_path_validation=True)
        theirs.append(time.perf_counter() - t0)
        client.session.close()
    size_mb = built.size / 1e6
    report.add(f"upload {size_mb:.0f} MB new group", size_mb / min(ours), "MB/s", baseline=size_mb / min(theirs),
               baseline_label="oras push", higher_is_better=True)


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    report = Report("registry_range", "Registry store: Range reads, republish, upload", args.quick)
    tmp = tempfile.mkdtemp(prefix="weenv-bench-registry-")
    old_home = os.environ.get("WEENV_HOME")
    os.environ["WEENV_HOME"] = os.path.join(tmp, "home")
    os.makedirs(os.path.join(tmp, "registry"))
    reg = start_registry(os.path.join(tmp, "registry"))
    try:
        if args.quick:
            bench_ranges(report, reg.host, tmp, 8 << 20, 60, 10)
            bench_publish(report, reg.host, tmp, 20 << 20, 2)
        else:
            bench_ranges(report, reg.host, tmp, 64 << 20, 400, 60)
            bench_publish(report, reg.host, tmp, 200 << 20, 3)
    finally:
        stop_registry(reg)
        shutil.rmtree(tmp, ignore_errors=True)
        if old_home is None:
            os.environ.pop("WEENV_HOME", None)
        else:
            os.environ["WEENV_HOME"] = old_home
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
