"""An in-memory cgroup backend (:class:`~weenv.provision.cgroups.CgroupBackend`) for unit tests of
logic (the monitor, the daemon's bookkeeping); the cgroup conformance tests run against it too.

Each fake group runs a tiny workload model driven by the backend's clock: tests set
``cpu_demand_cores`` and ``memory_demand_bytes`` and the counters move as a kernel's would
(usage capped by the quota, throttled periods when demand exceeds it, limit hits, a stall below
the hard limit and an OOM kill at it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from weenv.provision._errors import CgroupBusyError, CgroupExistsError, CgroupNotFoundError
from weenv.provision.cgroups._base import ALL_FEATURES, Cgroup, CgroupBackend, CgroupSample, check_name, page_align_up


class FakeCgroup(Cgroup):
    def __init__(self, name: str, backend: FakeBackend):
        self.name = name
        self._backend = backend
        self._lock = threading.Lock()
        self.removed = False
        self.procs: set[int] = set()
        self.frozen = False
        #: Every limit change, in order: ("cpu", cores) / ("memory", (limit, hard)) / ("pids", n).
        self.history: list[tuple[str, object]] = []
        # The workload model.
        self.cpu_demand_cores = 0.0
        self.memory_demand_bytes = 0
        # Limits.
        self.quota_cores: float | None = None
        self.period_us = 100_000
        self.limit_bytes: int | None = None
        self.hard_limit_bytes: int | None = None
        self.pids_max: int | None = None
        # Counters.
        self._last_s = backend.clock()
        self._usage_ns = 0.0
        self._periods = 0.0
        self._throttled = 0.0
        self._throttled_ns = 0.0
        self.memory_usage_bytes = 0
        self.limit_hits = 0
        self.high_events = 0
        self.stalled = False
        self.oom_kills = 0
        self._stall_us = 0.0

    def _check(self) -> None:
        if self.removed:
            raise CgroupNotFoundError("group was removed", group=self.name, path=f"fake:{self.name}")

    def _advance(self) -> float:
        now = self._backend.clock()
        dt = now - self._last_s
        if dt <= 0:
            return now  # no time passed, nothing happened
        self._last_s = now
        demand = 0.0 if self.frozen else self.cpu_demand_cores
        if demand > 0:
            periods = dt * 1e6 / self.period_us
            quota = self.quota_cores
            used = demand if quota is None else min(demand, quota)
            self._usage_ns += used * dt * 1e9
            if quota is not None:
                self._periods += periods
                if demand > quota:
                    self._throttled += periods
                    self._throttled_ns += (1 - quota / demand) * dt * 1e9
        if self.stalled:
            # A task stalled at the limit since the last reading counts as memory pressure.
            self._stall_us += dt * 1e6
        want = self.memory_demand_bytes
        limit = self.limit_bytes
        self.stalled = False
        if limit is not None and want > limit:
            self.limit_hits += 1
            if self.hard_limit_bytes is not None and self.hard_limit_bytes <= limit:
                # At the hard limit the kernel kills the allocating process: its demand is gone.
                self.oom_kills += 1
                self.memory_demand_bytes = 0
                self.cpu_demand_cores = 0.0
                self.procs.clear()
                want = 0
            else:
                self.high_events += 1
                self.stalled = True
                want = limit
        self.memory_usage_bytes = want
        return now

    def set_demand(self, *, cpu_cores: float | None = None, memory_bytes: int | None = None) -> None:
        """Change the workload from now on. Assigning ``cpu_demand_cores`` directly applies the
        new demand back to the last reading; this charges the time until now at the old one."""
        with self._lock:
            self._advance()
            if cpu_cores is not None:
                self.cpu_demand_cores = cpu_cores
            if memory_bytes is not None:
                self.memory_demand_bytes = memory_bytes

    def procs_paths(self) -> list[str]:
        return [f"fake:{self.name}/cgroup.procs"]

    def attach(self, pid: int) -> None:
        with self._lock:
            self._check()
            self.procs.add(pid)

    def set_cpu(self, quota_cores: float | None, period_us: int = 100_000) -> None:
        with self._lock:
            self._check()
            self._advance()
            if quota_cores is not None:
                quota_cores = max(1000, round(quota_cores * period_us)) / period_us
            self.quota_cores, self.period_us = quota_cores, period_us
            self.history.append(("cpu", quota_cores))

    def set_memory(self, limit_bytes: int | None, *, hard_limit_bytes: int | None = None) -> int | None:
        with self._lock:
            self._check()
            self._advance()
            limit = None if limit_bytes is None else page_align_up(limit_bytes)
            hard = limit if hard_limit_bytes is None else page_align_up(hard_limit_bytes)
            if limit is not None and self.memory_usage_bytes > limit and self._backend.refuse_shrink:
                # What v1 does when it cannot reclaim: EBUSY, old limit stays.
                return self.limit_bytes
            self.limit_bytes, self.hard_limit_bytes = limit, hard
            if limit is None or self.memory_demand_bytes <= limit:
                self.stalled = False  # a raised limit wakes the waiting task at once
            self.history.append(("memory", (limit, hard)))
            return limit

    def set_pids(self, max_pids: int | None) -> None:
        with self._lock:
            self._check()
            self.pids_max = max_pids
            self.history.append(("pids", max_pids))

    def sample(self, *, memory_max_age_s: float = 0.0) -> CgroupSample:
        with self._lock:
            self._check()
            now = self._advance()
            return CgroupSample(
                timestamp_s=now,
                cpu_usage_ns=int(self._usage_ns),
                nr_periods=int(self._periods),
                nr_throttled=int(self._throttled),
                throttled_ns=int(self._throttled_ns),
                cpu_quota_cores=self.quota_cores,
                memory_usage_bytes=self.memory_usage_bytes,
                memory_limit_bytes=self.limit_bytes,
                memory_hard_limit_bytes=self.hard_limit_bytes,
                memory_limit_hits=self.limit_hits,
                memory_high_events=self.high_events,
                memory_stalled=self.stalled,
                oom_events=self.oom_kills,
                oom_kills=self.oom_kills,
                pids_current=len(self.procs),
                pids_max=self.pids_max,
                cpu_pressure_some_avg10=0.0,
                memory_pressure_some_avg10=0.0,
                memory_pressure_full_avg10=0.0,
                memory_pressure_some_total_us=int(self._stall_us),
                memory_pressure_full_total_us=int(self._stall_us),
            )

    def freeze(self, timeout_s: float = 2.0) -> None:
        with self._lock:
            self._check()
            self._advance()
            self.frozen = True

    def thaw(self) -> None:
        with self._lock:
            self._check()
            self._advance()
            self.frozen = False

    def is_frozen(self) -> bool:
        self._check()
        return self.frozen

    def pids(self) -> list[int]:
        self._check()
        return sorted(self.procs)

    def kill_all(self) -> int:
        with self._lock:
            self._check()
            n = len(self.procs)
            self.procs.clear()
            self.cpu_demand_cores = 0.0
            self.memory_demand_bytes = 0
            return n

    def remove(self, timeout_s: float = 2.0) -> None:
        with self._lock:
            if self.removed:
                return
            if self.procs:
                raise CgroupBusyError(f"processes {sorted(self.procs)} still inside", group=self.name)
            self.removed = True
            self._backend._groups.pop(self.name, None)


class FakeBackend(CgroupBackend):
    """``clock`` drives the workload model (pass a trio MockClock's ``current_time`` in tests)."""

    version = "fake"

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        memory_total_bytes: int = 16 << 30,
        features: frozenset[str] = ALL_FEATURES,
    ):
        self.clock = clock
        self.features = frozenset(features)
        self.memory_total_bytes = memory_total_bytes
        #: Memory used on the "node" outside weenv's groups.
        self.other_used_bytes = 0
        #: Make set_memory refuse to go below usage, as v1 does with EBUSY.
        self.refuse_shrink = True
        self._groups: dict[str, FakeCgroup] = {}

    def create(self, name: str) -> FakeCgroup:
        check_name(name)
        if name in self._groups:
            raise CgroupExistsError("group already exists", group=name)
        group = self._groups[name] = FakeCgroup(name, self)
        return group

    def open(self, name: str) -> FakeCgroup:
        check_name(name)
        try:
            return self._groups[name]
        except KeyError:
            raise CgroupNotFoundError("no such group", group=name) from None

    def list(self) -> list[str]:
        return sorted(self._groups)

    def node_memory(self) -> tuple[int, int]:
        used = self.other_used_bytes + sum(g.memory_usage_bytes for g in self._groups.values())
        return self.memory_total_bytes, max(0, self.memory_total_bytes - used)

    def usage_ns(self) -> int | None:
        total = 0
        for g in list(self._groups.values()):
            with g._lock:
                g._advance()
                total += int(g._usage_ns)
        return total

    def remove_parent(self) -> bool:
        return not self._groups
