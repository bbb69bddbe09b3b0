"""The cgroup seam: :class:`CgroupBackend` makes groups, :class:`Cgroup` controls one.

Three implementations share these contracts: cgroup v1 (:mod:`._v1`), cgroup v2 (:mod:`._v2`) and
an in-memory fake (:mod:`._fake`). weenv only ever writes below its own parent group, which sits
under the daemon's own cgroup in every hierarchy.
"""

from __future__ import annotations

import abc
import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

from .._errors import CgroupBusyError, CgroupError, CgroupNameError, CgroupNotFoundError, CgroupUnavailableError

# Names become directory names in every hierarchy; refusing "/" and ".." keeps every write
# inside weenv's parent.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: The kernel rounds memory limits to pages; limits we compute are page-aligned so that what we
#: write is what we read back.
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

#: Features a backend may offer; tests and the daemon branch on :attr:`CgroupBackend.features`.
ALL_FEATURES = frozenset({"cpu", "memory", "pids", "freeze", "kill", "pressure"})


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid weenv group name, else raise :class:`CgroupNameError`."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise CgroupNameError(
            "a group name must match [A-Za-z0-9][A-Za-z0-9._-]{0,127}", group=repr(name)
        )
    return name


def quota_us(quota_cores: float, period_us: int) -> int:
    """CFS quota in microseconds for ``quota_cores`` cores; the kernel refuses less than 1 ms."""
    if quota_cores <= 0:
        raise ValueError(f"quota_cores must be > 0 or None, got {quota_cores}")
    return max(1000, round(quota_cores * period_us))


def burst_us(quota: int) -> int | None:
    """CFS burst for a quota of ``quota`` µs per period (-1: no quota, burst left alone).

    A group may bank the quota it left unused, up to one period's worth, and spend it in a
    later period. An environment idling at its minimum then runs a short command (an exec, a
    test's import phase) at twice its quota before it is throttled, while its long-run average
    stays at the quota the node was sized for. The kernel caps the burst at the quota.
    """
    return None if quota < 0 else quota


class CgroupSample(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of a group's counters. Counters are cumulative since the group was created;
    the policy works on differences between two samples."""

    timestamp_s: float
    """``time.monotonic()`` (the backend's clock for the fake) when the reading started."""
    cpu_usage_ns: int
    """CPU time used by every process in the group (cpuacct.usage / cpu.stat usage_usec)."""
    nr_periods: int
    """CFS enforcement periods in which the group was runnable (0 without a quota)."""
    nr_throttled: int
    """Periods in which the group ran out of quota."""
    throttled_ns: int
    """Total time the group spent throttled."""
    cpu_quota_cores: float | None
    """The CPU quota in force, in cores; None when unlimited."""
    memory_usage_bytes: int
    """Memory charged to the group (usage_in_bytes / memory.current), page cache included."""
    memory_limit_bytes: int | None
    """The elastic limit in force: where the group is throttled (or OOM-killed, if equal to the
    hard limit). None when unlimited."""
    memory_hard_limit_bytes: int | None
    """Where the group is OOM-killed. None when unlimited (and on v1 after ``open()`` when the OOM
    killer is disabled: v1 keeps one limit, the hard one lives in the plan)."""
    memory_limit_hits: int
    """Times an allocation hit the limit: v1 memory.failcnt, v2 memory.events ``max``."""
    memory_high_events: int
    """v2 memory.events ``high`` (allocations throttled above memory.high); 0 on v1."""
    memory_stalled: bool
    """v1 only: a task sleeps at the limit because the OOM killer is disabled below the hard limit."""
    oom_events: int
    """Times the group went out of memory (v2 memory.events ``oom``; v1 counts kills only)."""
    oom_kills: int
    """Processes the kernel OOM-killed inside this group."""
    pids_current: int
    """Tasks in the group (0 when the pids controller is missing)."""
    pids_max: int | None
    """The task limit in force; None when unlimited."""
    cpu_pressure_some_avg10: float | None = None
    """PSI: share (percent) of the last 10 s in which some task waited for CPU; None without PSI."""
    memory_pressure_some_avg10: float | None = None
    memory_pressure_full_avg10: float | None = None
    memory_pressure_some_total_us: int | None = None
    """PSI: cumulative time some task stalled on memory; its growth per tick is the policy's
    pressure signal (avg10 lags by seconds)."""
    memory_pressure_full_total_us: int | None = None


class Cgroup(abc.ABC):
    """One weenv group, present in every hierarchy the backend uses."""

    name: str

    @abc.abstractmethod
    def procs_paths(self) -> list[str]:
        """Every ``cgroup.procs`` file a process must be written into to be fully inside the group.
        A runtime's ``preexec_fn`` writes its own pid into each before exec'ing the OCI runtime."""

    @abc.abstractmethod
    def attach(self, pid: int) -> None:
        """Move process ``pid`` into the group in every hierarchy."""

    @abc.abstractmethod
    def set_cpu(self, quota_cores: float | None, period_us: int = 100_000) -> None:
        """Limit the group to ``quota_cores`` cores per ``period_us``; None removes the limit."""

    @abc.abstractmethod
    def set_memory(
        self, limit_bytes: int | None, *, hard_limit_bytes: int | None = None
    ) -> int | None:
        """Set the memory limit and return the limit now in force.

        ``limit_bytes`` is the elastic limit. When ``hard_limit_bytes`` is larger, reaching the
        elastic limit throttles the group instead of killing it (v2: ``memory.high`` = limit,
        ``memory.max`` = hard; v1: ``memory.limit_in_bytes`` = limit with the OOM killer disabled,
        so tasks sleep until the limit is raised). At the hard limit the kernel OOM-kills inside
        the group. If the kernel refuses a lower limit because usage cannot be reclaimed (v1
        EBUSY), the old limit stays and is returned: this is reported, not raised.
        """

    @abc.abstractmethod
    def set_pids(self, max_pids: int | None) -> None:
        """Limit the number of tasks; None removes the limit."""

    @abc.abstractmethod
    def sample(self, *, memory_max_age_s: float = 0.0) -> CgroupSample:
        """Read the group's counters. Cheap enough to call every 200 ms for hundreds of groups.

        A group that used no CPU since the last full reading is answered from that reading (its
        counters cannot have moved). ``memory_max_age_s`` > 0 lets such an idle group's memory
        usage be that old too (it can only fall, by global reclaim): one read per idle group.
        """

    def memory_event_fd(self) -> int | None:
        """A descriptor that turns readable each time a task of the group stalls at its memory
        limit, so the monitor can raise the limit at once instead of on its next tick; None when
        the backend has no such notification (the monitor then relies on its ticks). Read 8
        bytes to re-arm it (an eventfd counter). The group owns it and :meth:`remove` closes it:
        stop waiting on it first."""
        return None

    @abc.abstractmethod
    def freeze(self, timeout_s: float = 2.0) -> None:
        """Stop every process in the group; returns once the kernel reports the group frozen."""

    @abc.abstractmethod
    def thaw(self) -> None:
        """Let the processes of a frozen group run again."""

    @abc.abstractmethod
    def is_frozen(self) -> bool:
        """True when the kernel reports the group frozen."""

    @abc.abstractmethod
    def pids(self) -> list[int]:
        """The processes in the group (in any of its hierarchies), sorted."""

    @abc.abstractmethod
    def kill_all(self) -> int:
        """SIGKILL every process in the group without racing forks (v2 ``cgroup.kill``, else
        freeze, kill, thaw). Returns how many processes were in the group. Does not wait for them
        to exit; :meth:`remove` does."""

    @abc.abstractmethod
    def remove(self, timeout_s: float = 2.0) -> None:
        """Remove the group from every hierarchy. Idempotent. Waits up to ``timeout_s`` for exiting
        processes to leave, then raises :class:`CgroupBusyError` naming the pids still inside."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class CgroupBackend(abc.ABC):
    """Makes and finds weenv groups under one parent per hierarchy."""

    #: "v1", "v2" or "fake".
    version: str
    #: Subset of :data:`ALL_FEATURES` this host provides.
    features: frozenset[str]

    @abc.abstractmethod
    def create(self, name: str) -> Cgroup:
        """Create group ``name``; :class:`CgroupExistsError` if it exists."""

    @abc.abstractmethod
    def open(self, name: str) -> Cgroup:
        """Re-adopt existing group ``name`` (after a daemon restart), reading its limits from the
        kernel; :class:`CgroupNotFoundError` if it is not there."""

    @abc.abstractmethod
    def list(self) -> list[str]:
        """Names of the groups under weenv's parent (in any hierarchy), sorted."""

    @abc.abstractmethod
    def node_memory(self) -> tuple[int, int]:
        """``(total_bytes, available_bytes)`` for the node, capped by the limits of the cgroups
        weenv's parent sits in."""

    def usage_ns(self) -> int | None:
        """CPU time used by all of weenv's groups together (the parent's hierarchical counter),
        or None when the backend cannot tell. Unchanged between two readings means no group
        ran, so none of their counters moved: the monitor then skips reading them one by one."""
        return None

    def remove_parent(self) -> bool:
        """Remove weenv's (then empty) parent group; False if groups remain. For tests and
        ``weenv gc``; the daemon keeps its parent."""
        return False

    def warm_moves(self) -> None:
        """Ask now for the wait the next move of a process into a group may have (:mod:`._warm`):
        blocking, for a worker thread, at the start of a create. A no-op where there is none."""

    def stop_warming(self) -> None:
        """End what :meth:`warm_moves` keeps (its parked process and scratch groups)."""


# -- helpers shared by the kernel backends -----------------------------------------------------


@contextmanager
def translate_oserror(group: str | None, path: str) -> Iterator[None]:
    """Map an OSError from cgroupfs to the provision exception tree (the one boundary)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENODEV):
            raise CgroupNotFoundError(f"cgroup file is gone: {exc.strerror}", group=group, path=path) from exc
        if exc.errno == errno.EBUSY:
            raise CgroupBusyError(f"cgroup is busy: {exc.strerror}", group=group, path=path) from exc
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise CgroupUnavailableError(f"no permission: {exc.strerror}", group=group, path=path) from exc
        raise CgroupError(f"{exc.strerror or exc}", group=group, path=path) from exc


def parse_pressure(data: bytes) -> tuple[float, float | None, int, int | None]:
    """Parse a PSI file into ``(some_avg10, full_avg10, some_total_us, full_total_us)``.

    ``some avg10=0.00 avg60=0.00 avg300=0.00 total=0`` / ``full ...`` (cpu.pressure on old kernels
    has no ``full`` line).
    """
    some_avg10 = 0.0
    some_total = 0
    full_avg10: float | None = None
    full_total: int | None = None
    for line in data.split(b"\n"):
        if not line:
            continue
        kind, avg10, _avg60, _avg300, total = line.split(b" ")
        a = float(avg10[6:])
        t = int(total[6:])
        if kind == b"some":
            some_avg10, some_total = a, t
        else:
            full_avg10, full_total = a, t
    return some_avg10, full_avg10, some_total, full_total


def parse_flat_keyed(data: bytes) -> dict[bytes, int]:
    """Parse ``key value`` lines (cpu.stat, memory.events, memory.oom_control)."""
    out = {}
    for line in data.split(b"\n"):
        if line:
            key, _, value = line.partition(b" ")
            out[key] = int(value)
    return out


def read_meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """``(MemTotal, MemAvailable)`` in bytes."""
    total = available = None
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"MemTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith(b"MemAvailable:"):
                available = int(line.split()[1]) * 1024
            if total is not None and available is not None:
                break
    if total is None or available is None:
        raise CgroupUnavailableError("MemTotal/MemAvailable missing", path=path)
    return total, available


def page_align_up(n: int) -> int:
    return -(-n // PAGE_BYTES) * PAGE_BYTES
