"""A neighbour's lookup storm against another env's cold reads, on a real envlet mount, from real
processes in two test cgroups (tests/test_envlet_fair.py and benchmarks/envlet_fair.py).

The cgroups are ``<hierarchy>/<root>/storm`` and ``<root>/reader`` in the v1 pids hierarchy (or the
cgroup2 mount), ``root`` unique per run: an envlet started with ``--env-cgroup <root>`` sees the
two as envs ``storm`` and ``reader``, as it sees ``weenv/<env id>`` for the daemon's envs. Every
process is started by PID and ended by PID; the storm is bounded in time, the groups removed.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field

from ._host import HostUnsupported

_STORM = r"""
import os, random, signal, sys, time
d, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
tag, n = random.getrandbits(40), 0
def done(*_):
    print(n, flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, done)
while time.monotonic() < end:
    for _ in range(256):
        try:
            os.stat(f"{d}/nx-{tag}-{n}")
        except FileNotFoundError:
            pass
        n += 1
print(n)
"""

_READER = r"""
import sys, time
paths = sys.stdin.read().split("\n")
t0 = time.perf_counter()
for p in paths:
    with open(p, "rb") as f:
        f.read()
print(time.perf_counter() - t0)
"""


def fair_layer_tar(sets: int, files_per_set: int = 100, file_bytes: int = 4096) -> bytes:
    """A tar: ``storm/`` (a few files; the storm looks up names that are not there) and
    ``cold/s<set>/f<i>``: one fresh set of never-read files per measurement."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name in ("storm/a", "storm/b"):
            data = b"s" * 10
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for s in range(sets):
            for i in range(files_per_set):
                data = os.urandom(file_bytes)
                info = tarfile.TarInfo(f"cold/s{s}/f{i:03d}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _hierarchy() -> str:
    for d in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(d, "cgroup.procs")):
            return d
    raise HostUnsupported("no cgroup hierarchy to make test groups in (/sys/fs/cgroup/pids, unified, cgroup2)")


@dataclass
class TwoCgroups:
    """``<root>/storm`` and ``<root>/reader``; ``close()`` ends what is left in them and removes them."""

    root: str = field(default_factory=lambda: f"weenv-fair-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    base: str = ""

    def __post_init__(self) -> None:
        self.base = os.path.join(_hierarchy(), self.root)
        for name in ("", "storm", "reader"):
            os.makedirs(os.path.join(self.base, name), exist_ok=True)

    def procs(self, name: str) -> str:
        return os.path.join(self.base, name, "cgroup.procs")

    def argv(self, name: str, *cmd: str) -> list[str]:
        """``cmd`` run as a process of group ``name`` (it moves itself in before exec)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', self.procs(name), *cmd]

    def close(self) -> None:
        for name in ("storm", "reader", ""):
            d = os.path.join(self.base, name)
            deadline = time.monotonic() + 5
            while os.path.isdir(d):
                try:
                    os.rmdir(d)
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def start_storm(groups: TwoCgroups, layer_dir: str, duration_s: float, procs: int = 2) -> list[subprocess.Popen]:
    """``procs`` processes of the storm group stat random missing names under ``layer_dir/storm``."""
    return [subprocess.Popen(groups.argv("storm", sys.executable, "-c", _STORM, os.path.join(layer_dir, "storm"),
                                         str(duration_s)), stdout=subprocess.PIPE, text=True)
            for _ in range(procs)]


def stop_storm(storm: list[subprocess.Popen]) -> int:
    """End the storm (by PID) and return how many lookups it made."""
    total = 0
    for p in storm:
        if p.poll() is None:
            p.terminate()
        try:
            out, _ = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate(timeout=10)
        total += int(out.strip() or 0) if p.returncode == 0 else 0
    return total


def cold_reads(groups: TwoCgroups, layer_dir: str, set_index: int, files_per_set: int = 100) -> float:
    """Seconds a process of the reader group takes to read set ``set_index``'s files (never read before)."""
    paths = [os.path.join(layer_dir, "cold", f"s{set_index}", f"f{i:03d}") for i in range(files_per_set)]
    r = subprocess.run(groups.argv("reader", sys.executable, "-c", _READER), input="\n".join(paths),
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"cold reader failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return float(r.stdout.strip())


@dataclass
class StormResult:
    alone_s: list[float] = field(default_factory=list)
    storm_s: list[float] = field(default_factory=list)
    lookups: int = 0
    storm_wall_s: float = 0.0

    @property
    def ratio(self) -> float:
        alone, storm = sorted(self.alone_s), sorted(self.storm_s)
        return storm[len(storm) // 2] / alone[len(alone) // 2]

    @property
    def lookups_per_s(self) -> float:
        return self.lookups / self.storm_wall_s if self.storm_wall_s else 0.0


def measure_storm(groups: TwoCgroups, layer_dir: str, trials: int, *, first_set: int = 0, storm_procs: int = 2,
                  ramp_s: float = 0.3, files_per_set: int = 100) -> StormResult:
    """``trials`` pairs (100 cold reads alone, then under the storm), each on a fresh set of files."""
    res = StormResult()
    s = first_set
    for _ in range(trials):
        res.alone_s.append(cold_reads(groups, layer_dir, s, files_per_set))
        s += 1
        t0 = time.monotonic()
        storm = start_storm(groups, layer_dir, 30.0, storm_procs)
        try:
            time.sleep(ramp_s)
            res.storm_s.append(cold_reads(groups, layer_dir, s, files_per_set))
        finally:
            res.lookups += stop_storm(storm)
            res.storm_wall_s += time.monotonic() - t0
        s += 1
    return res
