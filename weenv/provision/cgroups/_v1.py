"""cgroup v1 (legacy and hybrid hosts): one directory per group in each controller's hierarchy.

Controllers used: cpu (CFS quota, throttling), cpuacct (usage), memory (limit, failcnt,
oom_control), freezer, pids. cpu and cpuacct may be separate hierarchies (this host) or
co-mounted as ``cpu,cpuacct``; co-mounted controllers share one directory. On a hybrid host the
group also gets a directory in the unified (v2) hierarchy, with no controllers, only so that the
kernel keeps per-group PSI (``memory.pressure``, ``cpu.pressure``) for it.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Mapping

import msgspec

from .._errors import CgroupBusyError, CgroupError, CgroupExistsError, CgroupNotFoundError
from .._errors import CgroupUnavailableError
from ._base import Cgroup, CgroupBackend, CgroupSample, check_name, page_align_up, parse_flat_keyed
from ._base import burst_us, parse_pressure, quota_us, read_meminfo, translate_oserror
from ._fs import CgroupFs, FileCache
from ._warm import SCRATCH_PREFIX, MoveWarmer, remove_scratch

#: Controllers weenv uses on v1, in the order their directories are created (memory first: it is
#: the hierarchy that decides whether a group exists).
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "freezer", "pids")

# The kernel reports "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on 4 KiB pages).
_UNLIMITED_BYTES = 1 << 62


def _limit_or_none(value: int) -> int | None:
    return None if value >= _UNLIMITED_BYTES else value


def _unique(paths: list[str | None]) -> list[str]:
    out: list[str] = []
    for p in paths:
        if p is not None and p not in out:
            out.append(p)
    return out


_REKICK_S = 0.05  # a v1 group FREEZING this long is thawed and frozen again (see freeze)

class V1Cgroup(Cgroup):
    __slots__ = (
        "name", "_fs", "_files", "_dirs", "_mem", "_cpu", "_acct", "_frz", "_pids", "_unified",
        "_quota_cores", "_period_us", "_limit", "_hard", "_kill_disabled", "_pids_max",
        "_last", "_memory_read_s", "_event_fds", "_burst_us",
    )  # fmt: skip

    def __init__(self, name: str, dirs: Mapping[str, str], unified_dir: str | None, fs: CgroupFs):
        self.name = name
        self._fs = fs
        self._files = FileCache(fs)
        self._mem = dirs.get("memory")
        self._cpu = dirs.get("cpu")
        self._acct = dirs.get("cpuacct")
        self._frz = dirs.get("freezer")
        self._pids = dirs.get("pids")
        self._unified = unified_dir
        self._dirs = _unique([*(dirs[c] for c in V1_CONTROLLERS if c in dirs), unified_dir])
        # What we last wrote; the kernel is only re-read on open() and after a refused write,
        # which keeps a tick to the counters that move.
        self._quota_cores: float | None = None
        self._period_us = 100_000
        # cpu.cfs_burst_us as last written; None when the kernel has no burst (before 5.14).
        self._burst_us: int | None = None
        self._limit: int | None = None
        self._hard: int | None = None
        self._kill_disabled = False
        self._pids_max: int | None = None
        # The last full reading; limits written since invalidate it.
        self._last: CgroupSample | None = None
        self._memory_read_s = float("-inf")
        self._event_fds: tuple[int, int] | None = None

    # -- reading limits back (open) ------------------------------------------------------------

    def _read_int(self, path: str) -> int:
        with translate_oserror(self.name, path):
            return int(self._fs.read(path).split()[0])

    def _load_limits(self) -> None:
        if self._cpu is not None:
            q = self._read_int(f"{self._cpu}/cpu.cfs_quota_us")
            self._period_us = self._read_int(f"{self._cpu}/cpu.cfs_period_us")
            self._quota_cores = None if q < 0 else q / self._period_us
            path = f"{self._cpu}/cpu.cfs_burst_us"
            self._burst_us = self._read_int(path) if self._fs.exists(path) else None
        if self._mem is not None:
            self._limit = _limit_or_none(self._read_int(f"{self._mem}/memory.limit_in_bytes"))
            path = f"{self._mem}/memory.oom_control"
            with translate_oserror(self.name, path):
                oom = parse_flat_keyed(self._fs.read(path))
            self._kill_disabled = bool(oom.get(b"oom_kill_disable", 0))
            # v1 has one limit; a disabled OOM killer is how we mark "throttle here, the hard
            # limit is higher". The hard value itself lives in the plan, not the kernel.
            self._hard = None if self._kill_disabled else self._limit
        if self._pids is not None:
            path = f"{self._pids}/pids.max"
            with translate_oserror(self.name, path):
                raw = self._fs.read(path).strip()
            self._pids_max = None if raw == b"max" else int(raw)

    # -- Cgroup ----------------------------------------------------------------------------------

    def procs_paths(self) -> list[str]:
        return [f"{d}/cgroup.procs" for d in self._dirs]

    def attach(self, pid: int) -> None:
        for path in self.procs_paths():
            with translate_oserror(self.name, path):
                self._fs.write(path, str(pid))
        self._last = None

    def _need(self, directory: str | None, controller: str) -> str:
        if directory is None:
            raise CgroupUnavailableError(f"the {controller} controller is not mounted", group=self.name)
        return directory

    def set_cpu(self, quota_cores: float | None, period_us: int = 100_000) -> None:
        d = self._need(self._cpu, "cpu")
        if period_us != self._period_us:
            path = f"{d}/cpu.cfs_period_us"
            with translate_oserror(self.name, path):
                self._fs.write(path, str(period_us))
            self._period_us = period_us
        value = -1 if quota_cores is None else quota_us(quota_cores, period_us)
        burst = burst_us(value)
        # The kernel refuses a burst above the quota: lower the burst before the quota, raise
        # it after.
        if burst is not None and self._burst_us is not None and burst < self._burst_us:
            self._write_burst(d, burst)
        path = f"{d}/cpu.cfs_quota_us"
        with translate_oserror(self.name, path):
            self._fs.write(path, str(value))
        if burst is not None and self._burst_us is not None and burst > self._burst_us:
            self._write_burst(d, burst)
        self._quota_cores = None if quota_cores is None else value / period_us
        self._last = None

    def _write_burst(self, d: str, burst: int) -> None:
        path = f"{d}/cpu.cfs_burst_us"
        with translate_oserror(self.name, path):
            self._fs.write(path, str(burst))
        self._burst_us = burst

    def set_memory(self, limit_bytes: int | None, *, hard_limit_bytes: int | None = None) -> int | None:
        d = self._need(self._mem, "memory")
        limit = None if limit_bytes is None else page_align_up(limit_bytes)
        hard = limit if hard_limit_bytes is None else page_align_up(hard_limit_bytes)
        kill_disabled = limit is not None and (hard is None or hard > limit)
        path = f"{d}/memory.limit_in_bytes"
        try:
            self._fs.write(path, str(-1 if limit is None else limit))
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                with translate_oserror(self.name, path):
                    raise
            # The kernel could not reclaim down to the new limit: the old one stays in force.
            self._limit = _limit_or_none(self._read_int(path))
            self._last = None
            return self._limit
        self._limit = limit
        self._hard = hard
        self._last = None
        if kill_disabled != self._kill_disabled:
            # Enabling the OOM killer after the limit moved wakes tasks sleeping at the old limit:
            # they retry against the new one and are killed only if they still do not fit.
            path = f"{d}/memory.oom_control"
            with translate_oserror(self.name, path):
                self._fs.write(path, "1" if kill_disabled else "0")
            self._kill_disabled = kill_disabled
        return self._limit

    def set_pids(self, max_pids: int | None) -> None:
        d = self._need(self._pids, "pids")
        path = f"{d}/pids.max"
        with translate_oserror(self.name, path):
            self._fs.write(path, "max" if max_pids is None else str(int(max_pids)))
        self._pids_max = None if max_pids is None else int(max_pids)
        self._last = None

    def sample(self, *, memory_max_age_s: float = 0.0) -> CgroupSample:
        read = self._files.read
        ts = time.monotonic()
        path = ""
        usage_ns = mem_usage = 0
        try:
            last = self._last
            if self._acct is not None:
                path = self._acct + "/cpuacct.usage"
                usage_ns = int(read(path))
                # No task ran since the last full reading (no CPU time was charged): no CFS
                # period ran, nothing allocated, forked, stalled or hit a limit, so every counter
                # is where it was. Only the memory charge can still move without the group
                # running (global reclaim takes pages away), hence its own refresh age. Idle envs
                # are the norm; this answers them from one or two reads instead of eight.
                if last is not None and usage_ns == last.cpu_usage_ns and ts - self._memory_read_s < memory_max_age_s:
                    return msgspec.structs.replace(last, timestamp_s=ts)
            if self._mem is not None:
                path = self._mem + "/memory.usage_in_bytes"
                mem_usage = int(read(path))
                self._memory_read_s = ts
            if (
                last is not None
                and self._acct is not None
                and usage_ns == last.cpu_usage_ns
                and mem_usage == last.memory_usage_bytes
            ):
                return msgspec.structs.replace(last, timestamp_s=ts)
            nr_periods = nr_throttled = throttled_ns = 0
            failcnt = oom_kills = pids_current = 0
            under_oom = False
            cpu_some = mem_some = mem_full = None
            mem_some_total = mem_full_total = None
            if self._cpu is not None:
                path = self._cpu + "/cpu.stat"
                st = parse_flat_keyed(read(path))
                nr_periods, nr_throttled, throttled_ns = st[b"nr_periods"], st[b"nr_throttled"], st[b"throttled_time"]
            if self._mem is not None:
                path = self._mem + "/memory.failcnt"
                failcnt = int(read(path))
                path = self._mem + "/memory.oom_control"
                oom = parse_flat_keyed(read(path))
                under_oom = bool(oom[b"under_oom"])
                oom_kills = oom.get(b"oom_kill", 0)
            if self._pids is not None:
                path = self._pids + "/pids.current"
                pids_current = int(read(path))
            if self._unified is not None:
                path = self._unified + "/memory.pressure"
                mem_some, mem_full, mem_some_total, mem_full_total = parse_pressure(read(path))
                path = self._unified + "/cpu.pressure"
                cpu_some = parse_pressure(read(path))[0]
        except OSError as exc:
            with translate_oserror(self.name, path):
                raise exc from None
        except (ValueError, KeyError, IndexError) as exc:
            raise CgroupError(f"unexpected cgroupfs content: {exc!r}", group=self.name, path=path) from exc
        sample = self._last = CgroupSample(
            timestamp_s=ts,
            cpu_usage_ns=usage_ns,
            nr_periods=nr_periods,
            nr_throttled=nr_throttled,
            throttled_ns=throttled_ns,
            cpu_quota_cores=self._quota_cores,
            memory_usage_bytes=mem_usage,
            memory_limit_bytes=self._limit,
            memory_hard_limit_bytes=self._hard,
            memory_limit_hits=failcnt,
            memory_high_events=0,
            # under_oom stays set until the woken tasks run again: right after the limit was
            # raised it describes the old limit. A task waits at *this* limit only if usage is there.
            memory_stalled=under_oom and self._limit is not None and mem_usage * 16 >= self._limit * 15,
            oom_events=oom_kills,
            oom_kills=oom_kills,
            pids_current=pids_current,
            pids_max=self._pids_max,
            cpu_pressure_some_avg10=cpu_some,
            memory_pressure_some_avg10=mem_some,
            memory_pressure_full_avg10=mem_full,
            memory_pressure_some_total_us=mem_some_total,
            memory_pressure_full_total_us=mem_full_total,
        )
        return sample

    def memory_event_fd(self) -> int | None:
        # memory.oom_control notifies through cgroup.event_control whenever the group enters
        # OOM; with the OOM killer disabled below the hard limit that is a task going to sleep
        # at the elastic limit (a user-space page fault that could not be charged).
        if self._event_fds is None:
            if self._mem is None:
                return None
            path = f"{self._mem}/memory.oom_control"
            efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            ofd = -1
            try:
                with translate_oserror(self.name, path):
                    ofd = self._fs.open_fd(path)
                path = f"{self._mem}/cgroup.event_control"
                with translate_oserror(self.name, path):
                    self._fs.write(path, f"{efd} {ofd}")
            except BaseException:
                for fd in (efd, ofd):
                    if fd >= 0:
                        os.close(fd)
                raise
            self._event_fds = (efd, ofd)
        return self._event_fds[0]

    def _close_event_fds(self) -> None:
        fds, self._event_fds = self._event_fds, None
        for fd in fds or ():
            try:
                os.close(fd)
            except OSError:
                pass

    def _freezer_state(self) -> bytes:
        path = f"{self._need(self._frz, 'freezer')}/freezer.state"
        with translate_oserror(self.name, path):
            return self._fs.read(path).strip()

    def freeze(self, timeout_s: float = 2.0) -> None:
        """Freeze every task, or raise :class:`CgroupBusyError` with the group thawed again.

        The v1 freezer can stay FREEZING when a task was forking or ptrace-stopped (gVisor's ptrace
        platform) as the state was written; only a new write retries those tasks, so a group still
        FREEZING after ``_REKICK_S`` is thawed and frozen again (runc's workaround too)."""
        path = f"{self._need(self._frz, 'freezer')}/freezer.state"
        with translate_oserror(self.name, path):
            self._fs.write(path, "FROZEN")
        start = kicked = time.monotonic()
        delay_s = 0.0002  # FREEZING until every task has stopped; typically well under a millisecond
        while self._freezer_state() != b"FROZEN":
            now = time.monotonic()
            if now - start > timeout_s:
                self.thaw()  # never leave a half-frozen group behind an env said to be running
                raise CgroupBusyError(f"still FREEZING after {timeout_s} s", group=self.name, path=path)
            if now - kicked > _REKICK_S:
                with translate_oserror(self.name, path):
                    self._fs.write(path, "THAWED")
                    self._fs.write(path, "FROZEN")
                kicked, delay_s = now, 0.0002
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.01)

    def thaw(self) -> None:
        path = f"{self._need(self._frz, 'freezer')}/freezer.state"
        with translate_oserror(self.name, path):
            self._fs.write(path, "THAWED")

    def is_frozen(self) -> bool:
        return self._freezer_state() == b"FROZEN"

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.procs_paths():
            try:
                data = self._fs.read(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                with translate_oserror(self.name, path):
                    raise exc from None
            found.update(int(x) for x in data.split())
        return sorted(found)

    def kill_all(self) -> int:
        self._last = None
        pids = self.pids()
        if not pids:
            return 0
        # Frozen tasks cannot fork, so the pid list read while frozen is complete.
        if self._frz is not None:
            try:
                self.freeze(timeout_s=0.5)
            except CgroupBusyError:
                pass  # a task in uninterruptible sleep; SIGKILL still lands when it wakes
        try:
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            if self._frz is not None:
                self.thaw()
        return len(pids)

    def remove(self, timeout_s: float = 2.0) -> None:
        self._files.close()
        self._close_event_fds()
        deadline = time.monotonic() + timeout_s
        removed: list[str] = []  # named when a later hierarchy fails: the group is then half gone
        for d in self._dirs:
            delay_s = 0.001
            while True:
                try:
                    self._fs.rmdir(d)
                    removed.append(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        with translate_oserror(self.name, d):
                            raise exc from None
                    if time.monotonic() > deadline:
                        raise CgroupBusyError(
                            f"processes {self.pids()} still inside after {timeout_s} s"
                            + (f" (already removed: {', '.join(removed)})" if removed else ""),
                            group=self.name, path=d,
                        ) from exc
                    time.sleep(delay_s)
                    delay_s = min(delay_s * 2, 0.05)
        # Every rmdir answered; a directory still there was made again meanwhile (a stale open()
        # repairing the later hierarchies, another process): say so, never report it removed.
        left = [d for d in self._dirs if self._fs.isdir(d)]
        if left:
            raise CgroupError(f"still present after removal in {len(left)} of {len(self._dirs)} hierarchies: "
                              f"{', '.join(left)}", group=self.name, path=left[0])


class V1Backend(CgroupBackend):
    """Groups under ``parents[controller]/<name>`` for each v1 controller (see :func:`detect_backend`)."""

    version = "v1"

    def __init__(
        self,
        parents: Mapping[str, str],
        *,
        unified_parent: str | None = None,
        memory_mount: str | None = None,
        fs: CgroupFs | None = None,
    ):
        if "memory" not in parents:
            raise CgroupUnavailableError("cgroup v1 without a memory hierarchy")
        self._fs = fs or CgroupFs()
        self._parents = {c: parents[c].rstrip("/") for c in V1_CONTROLLERS if c in parents}
        self._unified = unified_parent.rstrip("/") if unified_parent else None
        self._memory_mount = (memory_mount or "").rstrip("/")
        for d in _unique([*self._parents.values(), self._unified]):
            try:
                self._fs.mkdir(d)
            except FileExistsError:
                pass
            except OSError as exc:
                with translate_oserror(None, d):
                    raise exc from None
        self.features = self._probe_features()
        self._files = FileCache(self._fs)
        self._warmer: MoveWarmer | None = None

    def _new_warmer(self) -> MoveWarmer:  # one hierarchy is enough: the semaphore is the kernel's, global
        return MoveWarmer(self._fs, self._parents.get("pids") or self._parents["memory"])

    def warm_moves(self) -> None:
        if self._warmer is None:
            self._warmer = self._new_warmer()
        self._warmer.kick()

    def stop_warming(self) -> None:
        if self._warmer is not None:
            self._warmer.close()
            self._warmer = None

    def _probe_features(self) -> frozenset[str]:
        fs = self._fs
        p = self._parents
        features = {"memory", "kill"}
        if "cpu" in p and fs.exists(f"{p['cpu']}/cpu.cfs_quota_us"):
            features.add("cpu")
        if "pids" in p:
            features.add("pids")
        if "freezer" in p:
            features.add("freeze")
        if self._unified is not None and fs.exists(f"{self._unified}/memory.pressure"):
            features.add("pressure")
        return frozenset(features)

    @property
    def parent_dirs(self) -> list[str]:
        """weenv's parent directory in every hierarchy (what tests check is left clean)."""
        return _unique([*self._parents.values(), self._unified])

    def _group(self, name: str) -> V1Cgroup:
        dirs = {c: f"{d}/{name}" for c, d in self._parents.items()}
        unified = f"{self._unified}/{name}" if "pressure" in self.features else None
        return V1Cgroup(name, dirs, unified, self._fs)

    def create(self, name: str) -> V1Cgroup:
        check_name(name)
        group = self._group(name)
        created: list[str] = []
        try:
            for d in group._dirs:
                try:
                    self._fs.mkdir(d)
                except FileExistsError:
                    raise CgroupExistsError("group already exists", group=name, path=d) from None
                except OSError as exc:
                    with translate_oserror(name, d):
                        raise exc from None
                created.append(d)
        except BaseException:
            for d in reversed(created):
                try:
                    self._fs.rmdir(d)
                except OSError:
                    pass
            raise
        if group._cpu is not None and self._fs.exists(f"{group._cpu}/cpu.cfs_burst_us"):
            group._burst_us = 0  # a new group starts without burst
        return group

    def open(self, name: str) -> V1Cgroup:
        check_name(name)
        group = self._group(name)
        if not self._fs.isdir(group._dirs[0]):
            raise CgroupNotFoundError("no such group", group=name, path=group._dirs[0])
        # A daemon that died between mkdirs leaves the group missing from later hierarchies.
        for d in group._dirs[1:]:
            try:
                self._fs.mkdir(d)
            except FileExistsError:
                pass
            except OSError as exc:
                with translate_oserror(name, d):
                    raise exc from None
        group._load_limits()
        return group

    def list(self) -> list[str]:
        names: set[str] = set()
        for d in self.parent_dirs:
            try:
                entries = self._fs.listdir(d)
            except FileNotFoundError:
                continue
            names.update(e for e in entries if not e.startswith(SCRATCH_PREFIX) and self._fs.isdir(f"{d}/{e}"))
        return sorted(names)

    def node_memory(self) -> tuple[int, int]:
        total, available = read_meminfo()
        # Walk from weenv's parent up to (not including) the hierarchy root: a memory limit on the
        # daemon's own cgroup, or above it, is the node as far as weenv is concerned.
        d = os.path.dirname(self._parents["memory"])
        while self._memory_mount and d.startswith(self._memory_mount + "/"):
            try:
                limit = _limit_or_none(int(self._fs.read(f"{d}/memory.limit_in_bytes")))
                if limit is not None and limit < total:
                    usage = int(self._fs.read(f"{d}/memory.usage_in_bytes"))
                    # Inactive page cache is reclaimed before anything else at the limit: count
                    # it as available (the working set, as MemAvailable does for the node).
                    stat = parse_flat_keyed(self._fs.read(f"{d}/memory.stat"))
                    usage -= min(usage, stat.get(b"total_inactive_file", 0))
                    total = limit
                    available = min(available, max(0, limit - usage))
            except OSError as exc:
                with translate_oserror(None, d):
                    raise exc from None
            d = os.path.dirname(d)
        return total, min(available, total)

    def usage_ns(self) -> int | None:
        d = self._parents.get("cpuacct")
        if d is None:
            return None
        path = f"{d}/cpuacct.usage"
        with translate_oserror(None, path):
            return int(self._files.read(path))

    def remove_parent(self) -> bool:
        if self.list():
            return False
        self.stop_warming()
        remove_scratch(self._fs, self._new_warmer().dirs)
        self._files.close()
        removed: list[str] = []
        for d in self.parent_dirs:
            try:
                self._fs.rmdir(d)
                removed.append(d)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno == errno.EBUSY and not removed:
                    return False
                with translate_oserror(None, d):
                    if not removed:
                        raise exc from None
                    # Gone from the earlier hierarchies, not from this one (a group made meanwhile,
                    # or a process in the parent itself): half a parent, which a False would hide.
                    raise OSError(exc.errno, f"{exc.strerror}; the parent is already gone from "
                                  f"{', '.join(removed)}") from exc
        left = [d for d in self.parent_dirs if self._fs.isdir(d)]
        if left:
            raise CgroupError(f"parent still present after removal: {', '.join(left)}", path=left[0])
        return True
