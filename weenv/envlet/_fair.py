"""Fair file serving: FUSE requests are attributed to envs, and one env's storm cannot starve the others.

Attribution: a FUSE request carries the calling process's pid (``RequestContext.pid``; a read's
pid is the opener's, remembered with the file handle). The env is the cgroup below weenv's parent
group in ``/proc/PID/cgroup`` (``…/weenv/<env id>``, any hierarchy, v1 or v2); anything else
(the host, the daemon, kernel-made requests with pid 0) is the env ``-``. Answers are cached per
pid for ``PID_CACHE_S`` (a pid reused by another env within that time is charged to the first).

Fairness: the envlet's loop is one thread; what one env costs it, every other env waits for (and
its worker threads wait for the GIL). Each request is charged an estimate of the loop time it
takes (the handler's own time plus ``REQUEST_OVERHEAD_S`` for pyfuse3 and the /dev/fuse round
trip; a read also its bytes at ``LOOP_COPY_BYTES_PER_S``). While two or more envs are active
(a request in the last ``active_window_s``), each env's requests draw on a bucket refilled at
``share_cores / active envs`` loop-seconds per second, holding at most ``burst_s`` (a burst such
as 100 cold file reads, ~15 ms, passes undelayed); a request that finds its env's bucket empty
waits (``trio.sleep``, at most ``max_wait_s``) before it is served. So a sustained storm from one
env is slowed to its share and the envlet and the host's CPUs keep room for the others; an env
alone is never delayed, and its debt is capped at ``burst_s`` so what it used alone is not held
against it when another env comes. Not work-conserving on purpose: the cost of a storm to a
neighbour is mostly CPU outside the envlet's loop (the storm's own processes, the kernel's FUSE
round trips, the envlet's threads waiting for the GIL), which only slowing the storm gives back.
With the default 0.2 cores and two envs active, an env gets ~2,700 first-time lookups/s (the
kernel caches entries, positive and negative, for a day, so only first-time lookups reach here).
The host (``-``) is never delayed and does not count as an active env. A waiting request holds
one pyfuse3 worker task (the envlet runs up to ``MAX_FUSE_TASKS``), so other envs' requests are
still read from /dev/fuse and served — unless one env has more requests in flight than that
(threads × 1 each), when the kernel's FIFO queue holds the others' behind its own.

Per env: requests by kind, loop-seconds charged, bytes read, requests delayed and the time they
waited (``stats()["envs"]``, ``weenv_envlet_env_*{env="…"}``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

log = logging.getLogger("weenv.envlet")

HOST_ENV = "-"
PID_CACHE_S = 2.0
REQUEST_OVERHEAD_S = 30e-6  # pyfuse3 dispatch, the /dev/fuse read and reply, trio: ~35 µs a lookup in all, measured
LOOP_COPY_BYTES_PER_S = 4e9  # replying a read's bytes from the loop (a copy into the kernel)
MAX_FUSE_TASKS = 256
MAX_ENVS = 4096  # counters kept; beyond it, the least recently active are dropped
OPS = ("lookup", "getattr", "readdir", "open", "read", "xattr", "other")


def env_of_cgroup_text(text: str, root_name: str = "weenv") -> str:
    """The env id in a ``/proc/PID/cgroup`` text: the path component after ``root_name``; else ``-``."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        parts = path.split("/")
        for i, part in enumerate(parts[:-1]):
            if part == root_name and parts[i + 1]:
                return parts[i + 1]
    return HOST_ENV


class EnvResolver:
    """pid → env id, cached; reads procfs (in memory, no disk: fine on the loop)."""

    def __init__(self, root_name: str = "weenv", *, proc_dir: str = "/proc", cache_s: float = PID_CACHE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.root_name, self.proc_dir, self.cache_s, self.clock = root_name, proc_dir, cache_s, clock
        self._cache: dict[int, tuple[float, str]] = {}

    def __call__(self, pid: int) -> str:
        if pid <= 0:
            return HOST_ENV
        now = self.clock()
        hit = self._cache.get(pid)
        if hit is not None and now - hit[0] < self.cache_s:
            return hit[1]
        try:
            with open(f"{self.proc_dir}/{pid}/cgroup") as f:
                env = env_of_cgroup_text(f.read(), self.root_name)
        except OSError:  # gone already (a short-lived process): charge the host
            env = HOST_ENV
        if len(self._cache) > 65536:
            self._cache = {p: v for p, v in self._cache.items() if now - v[0] < self.cache_s}
        self._cache[pid] = (now, env)
        return env


@dataclass
class EnvUsage:
    """What one env asked of the envlet (counters only grow)."""

    env: str
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    busy_s: float = 0.0  # loop-seconds charged (estimated)
    read_bytes: int = 0
    delayed: int = 0  # requests that waited for their env's share
    delayed_s: float = 0.0
    # bucket state
    avg_cost_s: float = REQUEST_OVERHEAD_S  # moving average of a request's charge: reserved at admission
    tokens_s: float = 0.0
    refilled_at: float = 0.0
    last_seen: float = float("-inf")

    def snapshot(self) -> dict:
        return {"requests": dict(self.requests), "busy_s": self.busy_s, "read_bytes": self.read_bytes,
                "delayed": self.delayed, "delayed_s": self.delayed_s}


class FairShare:
    """Per-env accounting and the share that keeps one env's storm from starving the others."""

    def __init__(self, *, enabled: bool = True, share_cores: float = 0.2, burst_s: float = 0.05,
                 active_window_s: float = 0.2, max_wait_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, resolver: Callable[[int], str] | None = None):
        if not 0 < share_cores <= 64:
            raise ValueError(f"fair share: share_cores {share_cores!r} must be in (0, 64]")
        if burst_s < 0 or active_window_s <= 0 or max_wait_s < 0:
            raise ValueError("fair share: burst_s and max_wait_s must be >= 0, active_window_s > 0")
        self.enabled = enabled
        self.share_cores, self.burst_s = share_cores, burst_s
        self.active_window_s, self.max_wait_s = active_window_s, max_wait_s
        self.clock = clock
        self.env_of = resolver or EnvResolver()
        self.envs: dict[str, EnvUsage] = {}
        self._lock = threading.Lock()  # snapshot() is called from the prometheus thread
        self._active = 1
        self._active_at = -1.0

    def usage(self, env: str) -> EnvUsage:
        u = self.envs.get(env)
        if u is None:
            if len(self.envs) >= MAX_ENVS:
                with self._lock:
                    for old in sorted(self.envs, key=lambda e: self.envs[e].last_seen)[: MAX_ENVS // 8]:
                        del self.envs[old]
            u = self.envs[env] = EnvUsage(env, tokens_s=self.burst_s, refilled_at=self.clock())
        return u

    def active_envs(self, now: float) -> int:
        if now - self._active_at > 0.01:  # recounted at most every 10 ms: O(envs)
            cutoff = now - self.active_window_s
            # the host (the daemon, tools) is never delayed, so it does not make the envs share either
            self._active = max(1, sum(1 for e, u in self.envs.items() if u.last_seen >= cutoff and e != HOST_ENV))
            self._active_at = now
        return self._active

    async def admit(self, env: str, op: str) -> EnvUsage:
        """Count a request of ``env`` and, when it is over its share while others are active, wait."""
        return await self.admit_usage(self.usage(env), op)

    async def admit_usage(self, u: EnvUsage, op: str) -> EnvUsage:
        """:meth:`admit` for a request whose env is known (a read on a handle its env opened)."""
        env = u.env
        now = self.clock()
        was_idle = now - u.last_seen > self.active_window_s
        u.last_seen = now
        u.requests[op] += 1
        u.tokens_s -= u.avg_cost_s  # reserved now: concurrent requests of one env queue one behind the other
        if was_idle:
            self._active_at = -1.0  # a newly active env changes everyone's share now
        if not self.enabled or env == HOST_ENV:
            return u
        n = self.active_envs(now)
        rate = self.share_cores / n
        u.tokens_s = min(self.burst_s, u.tokens_s + (now - u.refilled_at) * rate)
        u.refilled_at = now
        if n < 2:
            # alone: never delayed, and what it uses now is not held against it once others come
            u.tokens_s = max(u.tokens_s, -self.burst_s)
            return u
        if u.tokens_s >= 0:
            return u
        wait = min(self.max_wait_s, -u.tokens_s / rate)
        u.delayed += 1
        u.delayed_s += wait
        await trio.sleep(wait)
        return u

    def charge(self, u: EnvUsage, busy_s: float, read_bytes: int = 0) -> None:
        cost = busy_s + REQUEST_OVERHEAD_S + read_bytes / LOOP_COPY_BYTES_PER_S
        u.busy_s += cost
        u.read_bytes += read_bytes
        u.tokens_s -= cost - u.avg_cost_s  # the average was reserved at admission
        u.avg_cost_s += (cost - u.avg_cost_s) * 0.1

    def snapshot(self) -> dict:
        with self._lock:
            return {env: u.snapshot() for env, u in list(self.envs.items())}
