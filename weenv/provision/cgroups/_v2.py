"""cgroup v2 (unified hierarchy): one directory per group.

Interface files used: ``cpu.max``, ``cpu.stat``, ``memory.max``/``memory.high``/``memory.current``,
``memory.events``, ``pids.max``/``pids.current``, ``cgroup.freeze`` + ``cgroup.events``,
``cgroup.kill`` and ``*.pressure``. Controllers are enabled in weenv's parent's
``cgroup.subtree_control``; they must already be delegated to the daemon's own cgroup (the
parent of weenv's parent is never written).
"""

from __future__ import annotations

import errno
import os
import signal
import time

import msgspec

from .._errors import CgroupBusyError, CgroupError, CgroupExistsError, CgroupNotFoundError
from .._errors import CgroupUnavailableError
from ._base import Cgroup, CgroupBackend, CgroupSample, check_name, page_align_up, parse_flat_keyed
from ._base import burst_us, parse_pressure, quota_us, read_meminfo, translate_oserror
from ._fs import CgroupFs, FileCache
from ._warm import SCRATCH_PREFIX, MoveWarmer, remove_scratch

#: Controllers weenv enables for its groups when the daemon's cgroup delegates them.
V2_CONTROLLERS = ("cpu", "memory", "pids")


def _max_or_int(raw: bytes) -> int | None:
    raw = raw.strip()
    return None if raw == b"max" else int(raw)


class V2Cgroup(Cgroup):
    __slots__ = (
        "name", "_fs", "_files", "_dir", "_features", "_quota_cores", "_period_us", "_limit",
        "_hard", "_pids_max", "_last", "_memory_read_s", "_burst_us",
    )  # fmt: skip

    def __init__(self, name: str, directory: str, features: frozenset[str], fs: CgroupFs):
        self.name = name
        self._fs = fs
        self._files = FileCache(fs)
        self._dir = directory
        self._features = features
        self._quota_cores: float | None = None
        self._period_us = 100_000
        # cpu.max.burst as last written; None when the kernel has no burst (before 5.14).
        self._burst_us: int | None = None
        self._limit: int | None = None
        self._hard: int | None = None
        self._pids_max: int | None = None
        # The last full reading; anything written since invalidates it.
        self._last: CgroupSample | None = None
        self._memory_read_s = float("-inf")

    def _path(self, file: str) -> str:
        return f"{self._dir}/{file}"

    def _read(self, file: str) -> bytes:
        path = self._path(file)
        with translate_oserror(self.name, path):
            return self._fs.read(path)

    def _write(self, file: str, value: str) -> None:
        path = self._path(file)
        self._last = None
        with translate_oserror(self.name, path):
            self._fs.write(path, value)

    def _need(self, feature: str) -> None:
        if feature not in self._features:
            raise CgroupUnavailableError(
                f"the {feature} controller is not delegated to weenv's parent", group=self.name
            )

    def _load_limits(self) -> None:
        if "cpu" in self._features:
            quota, period = self._read("cpu.max").split()
            self._period_us = int(period)
            self._quota_cores = None if quota == b"max" else int(quota) / self._period_us
            has_burst = self._fs.exists(self._path("cpu.max.burst"))
            self._burst_us = int(self._read("cpu.max.burst")) if has_burst else None
        if "memory" in self._features:
            high = _max_or_int(self._read("memory.high"))
            hard = _max_or_int(self._read("memory.max"))
            self._hard = hard
            self._limit = high if high is not None else hard
        if "pids" in self._features:
            self._pids_max = _max_or_int(self._read("pids.max"))

    def procs_paths(self) -> list[str]:
        return [self._path("cgroup.procs")]

    def attach(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def set_cpu(self, quota_cores: float | None, period_us: int = 100_000) -> None:
        self._need("cpu")
        q = -1 if quota_cores is None else quota_us(quota_cores, period_us)
        burst = burst_us(q)
        # The kernel refuses a burst above the quota: lower the burst before the quota, raise
        # it after.
        if burst is not None and self._burst_us is not None and burst < self._burst_us:
            self._write_burst(burst)
        self._write("cpu.max", f"{'max' if q < 0 else q} {period_us}")
        if burst is not None and self._burst_us is not None and burst > self._burst_us:
            self._write_burst(burst)
        self._quota_cores = None if q < 0 else q / period_us
        self._period_us = period_us

    def _write_burst(self, burst: int) -> None:
        self._write("cpu.max.burst", str(burst))
        self._burst_us = burst

    def set_memory(self, limit_bytes: int | None, *, hard_limit_bytes: int | None = None) -> int | None:
        self._need("memory")
        limit = None if limit_bytes is None else page_align_up(limit_bytes)
        hard = limit if hard_limit_bytes is None else page_align_up(hard_limit_bytes)
        if limit is not None and (hard is None or hard > limit):
            high, new_max = limit, hard
        else:
            high, new_max = None, limit
        # memory.max first, raising or lowering: when an elastic limit becomes hard (the env waited
        # its bounded time, weenv/provision/elastic/_policy.py) memory.high goes to "max" and memory.max
        # comes down to the limit; lifting memory.high first would let the throttled tasks run free
        # up to the old max in between. (memory.high above memory.max for a moment is harmless.)
        # Lowering memory.max below usage makes the kernel reclaim and then OOM-kill inside the
        # group; the elastic policy otherwise only moves memory.high, whose excess is throttled.
        self._write("memory.max", "max" if new_max is None else str(new_max))
        self._write("memory.high", "max" if high is None else str(high))
        self._limit = limit
        self._hard = new_max
        return self._limit

    def set_pids(self, max_pids: int | None) -> None:
        self._need("pids")
        self._write("pids.max", "max" if max_pids is None else str(int(max_pids)))
        self._pids_max = None if max_pids is None else int(max_pids)

    def sample(self, *, memory_max_age_s: float = 0.0) -> CgroupSample:
        read = self._files.read
        d = self._dir
        f = self._features
        ts = time.monotonic()
        path = ""
        mem_usage = 0
        try:
            path = d + "/cpu.stat"
            st = parse_flat_keyed(read(path))
            usage_ns = st[b"usage_usec"] * 1000
            last = self._last
            # Nothing ran since the last full reading: see V1Cgroup.sample.
            if last is not None and usage_ns == last.cpu_usage_ns and ts - self._memory_read_s < memory_max_age_s:
                return msgspec.structs.replace(last, timestamp_s=ts)
            if "memory" in f:
                path = d + "/memory.current"
                mem_usage = int(read(path))
                self._memory_read_s = ts
            if last is not None and usage_ns == last.cpu_usage_ns and mem_usage == last.memory_usage_bytes:
                return msgspec.structs.replace(last, timestamp_s=ts)
            pids_current = 0
            ev: dict[bytes, int] = {}
            cpu_some = mem_some = mem_full = None
            mem_some_total = mem_full_total = None
            if "memory" in f:
                path = d + "/memory.events"
                ev = parse_flat_keyed(read(path))
            if "pids" in f:
                path = d + "/pids.current"
                pids_current = int(read(path))
            if "pressure" in f:
                path = d + "/memory.pressure"
                mem_some, mem_full, mem_some_total, mem_full_total = parse_pressure(read(path))
                path = d + "/cpu.pressure"
                cpu_some = parse_pressure(read(path))[0]
        except OSError as exc:
            with translate_oserror(self.name, path):
                raise exc from None
        except (ValueError, KeyError, IndexError) as exc:
            raise CgroupError(f"unexpected cgroupfs content: {exc!r}", group=self.name, path=path) from exc
        sample = self._last = CgroupSample(
            timestamp_s=ts,
            cpu_usage_ns=usage_ns,
            nr_periods=st.get(b"nr_periods", 0),
            nr_throttled=st.get(b"nr_throttled", 0),
            throttled_ns=st.get(b"throttled_usec", 0) * 1000,
            cpu_quota_cores=self._quota_cores,
            memory_usage_bytes=mem_usage,
            memory_limit_bytes=self._limit,
            memory_hard_limit_bytes=self._hard,
            memory_limit_hits=ev.get(b"max", 0),
            memory_high_events=ev.get(b"high", 0),
            memory_stalled=False,
            oom_events=ev.get(b"oom", 0),
            oom_kills=ev.get(b"oom_kill", 0),
            pids_current=pids_current,
            pids_max=self._pids_max,
            cpu_pressure_some_avg10=cpu_some,
            memory_pressure_some_avg10=mem_some,
            memory_pressure_full_avg10=mem_full,
            memory_pressure_some_total_us=mem_some_total,
            memory_pressure_full_total_us=mem_full_total,
        )
        return sample

    def freeze(self, timeout_s: float = 2.0) -> None:
        self._need("freeze")
        self._write("cgroup.freeze", "1")
        deadline = time.monotonic() + timeout_s
        delay_s = 0.0002
        while not self.is_frozen():
            if time.monotonic() > deadline:
                self.thaw()  # never leave a half-frozen group behind an env said to be running
                raise CgroupBusyError(
                    f"not frozen after {timeout_s} s", group=self.name, path=self._path("cgroup.events")
                )
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.01)

    def thaw(self) -> None:
        self._need("freeze")
        self._write("cgroup.freeze", "0")

    def is_frozen(self) -> bool:
        return parse_flat_keyed(self._read("cgroup.events")).get(b"frozen", 0) == 1

    def pids(self) -> list[int]:
        return sorted(int(x) for x in self._read("cgroup.procs").split())

    def kill_all(self) -> int:
        pids = self.pids()
        if not pids:
            return 0
        if self._fs.exists(self._path("cgroup.kill")):
            # One write kills the whole group, forks in flight included (kernel >= 5.14).
            self._write("cgroup.kill", "1")
            return len(pids)
        frozen = "freeze" in self._features
        if frozen:
            try:
                self.freeze(timeout_s=0.5)
            except CgroupBusyError:
                pass
        try:
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            if frozen:
                self.thaw()
        return len(pids)

    def remove(self, timeout_s: float = 2.0) -> None:
        self._files.close()
        deadline = time.monotonic() + timeout_s
        delay_s = 0.001
        while True:
            try:
                self._fs.rmdir(self._dir)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    with translate_oserror(self.name, self._dir):
                        raise exc from None
                if time.monotonic() > deadline:
                    raise CgroupBusyError(
                        f"processes {self.pids()} still inside after {timeout_s} s",
                        group=self.name, path=self._dir,
                    ) from exc
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 0.05)


class V2Backend(CgroupBackend):
    """Groups under ``<root><own_path>/<root_name>/<name>``; ``root`` is the cgroup2 mount point
    (or a directory tree mimicking one, with a matching :class:`CgroupFs`)."""

    version = "v2"

    def __init__(self, root: str, *, own_path: str = "/", root_name: str = "weenv", fs: CgroupFs | None = None):
        check_name(root_name)
        self._fs = fs or CgroupFs()
        self._root = root.rstrip("/")
        own = "/" + own_path.strip("/") if own_path.strip("/") else ""
        self.parent_dir = f"{self._root}{own}/{root_name}"
        try:
            self._fs.mkdir(self.parent_dir)
        except FileExistsError:
            pass
        except OSError as exc:
            with translate_oserror(None, self.parent_dir):
                raise exc from None
        self.features = self._enable_controllers()
        self._files = FileCache(self._fs)
        self._warmer: MoveWarmer | None = None

    def _enable_controllers(self) -> frozenset[str]:
        fs = self._fs
        p = self.parent_dir
        with translate_oserror(None, p):
            available = set(fs.read(f"{p}/cgroup.controllers").decode().split())
            enabled = set(fs.read(f"{p}/cgroup.subtree_control").decode().split())
        wanted = [c for c in V2_CONTROLLERS if c in available and c not in enabled]
        if wanted:
            path = f"{p}/cgroup.subtree_control"
            with translate_oserror(None, path):
                fs.write(path, " ".join(f"+{c}" for c in wanted))
            enabled.update(wanted)
        features = {c for c in V2_CONTROLLERS if c in enabled}
        # Core interface files (not controllers): present in every non-root group.
        if fs.exists(f"{p}/cgroup.freeze"):
            features.add("freeze")
        if "freeze" in features or fs.exists(f"{p}/cgroup.kill"):
            features.add("kill")
        if fs.exists(f"{p}/memory.pressure"):
            features.add("pressure")
        return frozenset(features)

    @property
    def parent_dirs(self) -> list[str]:
        return [self.parent_dir]

    def _group(self, name: str) -> V2Cgroup:
        return V2Cgroup(name, f"{self.parent_dir}/{name}", self.features, self._fs)

    def create(self, name: str) -> V2Cgroup:
        check_name(name)
        group = self._group(name)
        try:
            self._fs.mkdir(group._dir)
        except FileExistsError:
            raise CgroupExistsError("group already exists", group=name, path=group._dir) from None
        except OSError as exc:
            with translate_oserror(name, group._dir):
                raise exc from None
        if "cpu" in self.features and self._fs.exists(group._path("cpu.max.burst")):
            group._burst_us = 0  # a new group starts without burst
        return group

    def open(self, name: str) -> V2Cgroup:
        check_name(name)
        group = self._group(name)
        if not self._fs.isdir(group._dir):
            raise CgroupNotFoundError("no such group", group=name, path=group._dir)
        group._load_limits()
        return group

    def list(self) -> list[str]:
        try:
            entries = self._fs.listdir(self.parent_dir)
        except FileNotFoundError:
            return []
        return sorted(e for e in entries if not e.startswith(SCRATCH_PREFIX) and self._fs.isdir(f"{self.parent_dir}/{e}"))

    def warm_moves(self) -> None:
        if self._warmer is None:
            self._warmer = MoveWarmer(self._fs, self.parent_dir)
        self._warmer.kick()

    def stop_warming(self) -> None:
        if self._warmer is not None:
            self._warmer.close()
            self._warmer = None

    def node_memory(self) -> tuple[int, int]:
        total, available = read_meminfo()
        d = os.path.dirname(self.parent_dir)
        while d.startswith(self._root + "/"):
            try:
                if self._fs.exists(f"{d}/memory.max"):
                    limit = _max_or_int(self._fs.read(f"{d}/memory.max"))
                    if limit is not None and limit < total:
                        usage = int(self._fs.read(f"{d}/memory.current"))
                        # Inactive page cache goes first at the limit: count it as available.
                        if self._fs.exists(f"{d}/memory.stat"):
                            stat = parse_flat_keyed(self._fs.read(f"{d}/memory.stat"))
                            usage -= min(usage, stat.get(b"inactive_file", 0))
                        total = limit
                        available = min(available, max(0, limit - usage))
            except OSError as exc:
                with translate_oserror(None, d):
                    raise exc from None
            d = os.path.dirname(d)
        return total, min(available, total)

    def usage_ns(self) -> int | None:
        path = f"{self.parent_dir}/cpu.stat"  # usage_usec is there with or without the cpu controller
        with translate_oserror(None, path):
            stat = parse_flat_keyed(self._files.read(path))
        usage = stat.get(b"usage_usec")
        return None if usage is None else usage * 1000

    def remove_parent(self) -> bool:
        if self.list():
            return False
        self.stop_warming()
        remove_scratch(self._fs, MoveWarmer(self._fs, self.parent_dir).dirs)
        self._files.close()
        try:
            self._fs.rmdir(self.parent_dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            with translate_oserror(None, self.parent_dir):
                raise exc from None
        return True
