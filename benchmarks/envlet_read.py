"""Envlet read throughput vs native ext4: warm (page cache) and cold page cache with a warm L2.

    python -m benchmarks.envlet_read [--quick]

Both sides read the same bytes with the same loop (1 MiB reads) in the same run.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

from weenv import layerfmt
from weenv.envlet import EnvletProcess, StoreSpec
from weenv.testing import cache_root

from ._util import Report, arg_parser, drop_caches, median


def read_all(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                return n
            n += len(b)


def timed_read(path: str) -> float:
    t0 = time.perf_counter()
    read_all(path)
    return time.perf_counter() - t0


def make_file(path: Path, size: int) -> None:
    """Compressible, realistic-ish data: shared-library-like bytes (random words with repetition)."""
    rnd = os.urandom(1 << 20)
    with open(path, "wb") as f:
        written = 0
        i = 0
        while written < size:
            block = rnd[(i * 7919) % (1 << 19) :][: 1 << 19] + bytes(1 << 18) + rnd[: 1 << 18]
            f.write(block[: size - written])
            written += min(len(block), size - written)
            i += 1


def _verify_ms_per_mib(rounds: int = 64) -> float:
    data = os.urandom(1 << 20)
    digest = hashlib.sha256(data).digest()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        layerfmt.verify_chunk(data, digest)
        times.append(time.perf_counter() - t0)
    return median(times) * 1000


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    size = (32 if args.quick else 256) << 20
    repeat = 2 if args.quick else 5
    report = Report("envlet_read", "Envlet read throughput", args.quick)
    base = cache_root() if cache_root().exists() else None
    with tempfile.TemporaryDirectory(dir=base) as t:
        tmp = Path(t)
        src = tmp / "src"
        src.mkdir()
        make_file(src / "data.bin", size)
        blob = tmp / "layer.weenv"
        with open(blob, "wb") as f:
            res = layerfmt.build_layer(str(src), f)
        digest = "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()
        env = EnvletProcess(str(tmp / "mnt"), str(tmp / "cache"), str(tmp / "ctl.sock"),
                            cache_size_bytes=4 * size, memory_cache_size_bytes=64 << 20)
        env.start()
        try:
            info = env.client.register(StoreSpec("file", path=str(blob)), digest, res.size, res.toc_digest)
            native = str(src / "data.bin")
            lazy = os.path.join(info.path, "data.bin")
            read_all(lazy)  # fills L2 (and the page cache)
            read_all(native)
            # warm: both served from the kernel page cache
            w_native = median([timed_read(native) for _ in range(repeat)])
            w_env = median([timed_read(lazy) for _ in range(repeat)])
            mb = size / 1e6
            report.add("warm sequential read (page cache)", mb / w_env, "MB/s", baseline=mb / w_native,
                       baseline_label="ext4 page cache", higher_is_better=True, goal="≥0.80x native",
                       ok=w_native / w_env >= 0.8)
            # cold page cache, L2 warm on disk, L1 emptied: disk read + verify + FUSE vs a cold ext4 read
            if drop_caches():
                c_native, c_env = [], []
                for _ in range(repeat):
                    drop_caches()
                    c_native.append(timed_read(native))
                    env.client.prune(4 * size)  # keeps L2, clears L1
                    drop_caches()
                    c_env.append(timed_read(lazy))
                cn, ce = median(c_native), median(c_env)
                report.add("cold page cache, L2 warm", mb / ce, "MB/s", baseline=mb / cn,
                           baseline_label="ext4 cold read", higher_is_better=True, goal="≥0.40x native",
                           ok=cn / ce >= 0.4)
                # every L2 hit is verified against its sha256 (layerfmt.verify_chunk) before use:
                # its cost per MiB next to that of the cold L2 read it is part of
                verify_ms = _verify_ms_per_mib()
                report.add("L2 verify (sha256 of a 1 MiB chunk)", verify_ms, "ms/MiB",
                           baseline=ce / (size / (1 << 20)) * 1000, baseline_label="cold L2 read of 1 MiB",
                           note=f"share of the cold L2 read: {verify_ms / (ce / (size / (1 << 20)) * 1000):.0%}")
            else:
                report.notes.append("cannot drop caches (not root): cold read skipped")
            s = env.client.stats()
            report.notes.append(f"L2 hits {s['l2_hits']}, remote chunks {s['remote_chunks']}, "
                                f"fuse reads {s['fuse_reads']}")
            report.notes.append("tiers: " + ", ".join(f"{name} {t['hits']} hits ({t['hit_bytes'] >> 20} MiB)"
                                                      for name, t in s.get("tiers", {}).items()))
        finally:
            env.stop()
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
