"""Per-key limits: how much of a node (or cluster) one API key may hold at once.

A key's limits are its own (``weenv token create --envs 8``, ``weenv token limits NAME``, or
``POST /v1/keys/{name}/limits``), else the operator's defaults (``weenv token defaults``), else
:data:`BUILTIN_DEFAULTS`. Admin keys are limited only by limits set on them.

- ``envs``: envs at once; ``cores`` / ``memory``: the sum of their minimums (what admission
  reserves on a node: the share that, taken by one key, makes every other key's create a 429);
- ``watchers``: E2B file watchers; ``processes``: commands and processes started through the
  API that still run; ``creates_per_min``: env creates (a fork of N counts N).

What a key holds is counted from the API's own records (envs.json) plus what is being created
right now (:class:`Admission`); records of envs that went without the API seeing it (a TTL) are
dropped by a look at the daemons before a create is refused, so a stale record never costs a
429. Refusals are 429 ``quota_exceeded`` naming the limit and how to raise it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ._common import HttpError
from ._store import ApiKey, KeyStore, OwnerTable, owns

GIB = 1 << 30
BUILTIN_DEFAULTS: dict[str, float | int] = {"envs": 128, "cores": 32.0, "memory": 64 * GIB, "watchers": 256,
                                            "processes": 1024, "creates_per_min": 600}
LIMITS = tuple(BUILTIN_DEFAULTS)
_FLAG = {"envs": "--envs", "cores": "--cores", "memory": "--memory", "watchers": "--watchers",
         "processes": "--processes", "creates_per_min": "--creates-per-min"}


def check_limits(limits: dict[str, Any], where: str = "limits") -> dict[str, Any]:
    """``limits`` with known names and whole (or, for cores, positive) values; ValueError otherwise."""
    out: dict[str, Any] = {}
    for name, value in limits.items():
        if name not in BUILTIN_DEFAULTS:
            raise ValueError(f"{where}: unknown limit {name!r} (known: {', '.join(LIMITS)})")
        if value is None:
            out[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
                (name != "cores" and not float(value).is_integer()):
            raise ValueError(f"{where}.{name}: {value!r} is not a {'number' if name == 'cores' else 'whole number'} "
                             "≥ 0")
        out[name] = float(value) if name == "cores" else int(value)
    return out


def limits_of(keys: KeyStore, key: ApiKey) -> dict[str, float | int | None]:
    """Every limit of ``key`` (None: unlimited)."""
    own = dict(key.get("limits") or {})
    if key.admin:
        return {name: own.get(name) for name in LIMITS}
    defaults = {**BUILTIN_DEFAULTS, **keys.defaults()}
    return {name: own.get(name, defaults.get(name)) for name in LIMITS}


def _refusal(key: ApiKey, name: str, limit: float | int, have: float | int, asked: float | int) -> HttpError:
    unit = {"memory": " bytes", "cores": " cores"}.get(name, "")
    return HttpError(429, "quota_exceeded",
                     f"key {key.name!r} is at its {name} limit: it holds {have:g}{unit}, this asks for "
                     f"{asked:g}{unit} more, and its limit is {limit:g}{unit} (the operator raises it with "
                     f"`weenv token limits {key.name} {_FLAG[name]} N`)")


@dataclass
class _Held:
    envs: int = 0
    cores: float = 0.0
    memory: int = 0


@dataclass
class Admission:
    """What one create (or fork) holds of its key's quota until its envs are recorded."""

    quotas: "Quotas"
    key_id: str
    envs: int
    cores_each: float
    memory_each: int
    _released: bool = False

    def record(self) -> dict[str, Any]:
        """What each new env's API record keeps, so the key's usage counts it from then on."""
        return {"min_cores": self.cores_each, "min_memory_bytes": self.memory_each}

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.quotas._release(self)


@dataclass
class _Bucket:
    tokens: float
    at_s: float


@dataclass
class Quotas:
    keys: KeyStore
    owners: OwnerTable
    clock: Callable[[], float] = time.monotonic
    _pending: dict[str, _Held] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _processes: dict[str, int] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def limits(self, key: ApiKey) -> dict[str, float | int | None]:
        return limits_of(self.keys, key)

    def held(self, key: ApiKey) -> _Held:
        """Envs, minimum cores and bytes the key's recorded envs hold (without creates in flight)."""
        out = _Held()
        for rec in self.owners.envs().values():
            if owns(key, rec):
                out.envs += 1
                out.cores += float(rec.get("min_cores") or 0.0)
                out.memory += int(rec.get("min_memory_bytes") or 0)
        return out

    def usage(self, key: ApiKey) -> dict[str, Any]:
        held = self.held(key)
        with self._lock:
            pending = self._pending.get(key.id, _Held())
        return {"envs": held.envs + pending.envs, "cores": held.cores + pending.cores,
                "memory": held.memory + pending.memory, "processes": self._processes.get(key.id, 0)}

    def _take_rate(self, key: ApiKey, n: int, per_min: float | int | None) -> None:
        if per_min is None:
            return
        now = self.clock()
        with self._lock:
            b = self._buckets.get(key.id) or _Bucket(float(per_min), now)
            b.tokens = min(float(per_min), b.tokens + (now - b.at_s) * float(per_min) / 60.0)
            b.at_s = now
            if b.tokens < n:
                self._buckets[key.id] = b
                raise HttpError(429, "quota_exceeded",
                                f"key {key.name!r} creates at most {per_min:g} envs a minute (creates_per_min); "
                                f"wait {max(0.1, (n - b.tokens) * 60.0 / float(per_min)):.1f} s (the operator "
                                f"raises it with `weenv token limits {key.name} --creates-per-min N`)")
            b.tokens -= n
            self._buckets[key.id] = b

    async def admit(self, key: ApiKey, envs: int, cores_each: float, memory_each: int,
                    refresh: Callable[[], Awaitable[None]]) -> Admission:
        """Hold ``envs`` new envs of ``cores_each`` / ``memory_each`` minimums for ``key``, or raise
        the 429 naming the limit. ``refresh`` drops records of envs that are gone (a look at the
        daemons), and is called only before a refusal."""
        lim = self.limits(key)
        for attempt in (0, 1):
            problem = self._over(key, lim, envs, cores_each, memory_each)
            if problem is None:
                break
            if attempt == 0:
                await refresh()
                continue
            raise problem
        self._take_rate(key, envs, lim["creates_per_min"])
        with self._lock:
            problem = self._over(key, lim, envs, cores_each, memory_each)  # a concurrent create got in between
            if problem is not None:
                raise problem
            p = self._pending.setdefault(key.id, _Held())
            p.envs += envs
            p.cores += envs * cores_each
            p.memory += envs * memory_each
        return Admission(self, key.id, envs, cores_each, memory_each)

    def _over(self, key: ApiKey, lim: dict[str, float | int | None], envs: int, cores_each: float,
              memory_each: int) -> HttpError | None:
        use = self.usage(key)
        for name, asked in (("envs", envs), ("cores", envs * cores_each), ("memory", envs * memory_each)):
            limit = lim[name]
            if limit is not None and use[name] + asked > limit + 1e-9:
                return _refusal(key, name, limit, use[name], asked)
        return None

    def _release(self, adm: Admission) -> None:
        with self._lock:
            p = self._pending.get(adm.key_id)
            if p is None:
                return
            p.envs -= adm.envs
            p.cores -= adm.envs * adm.cores_each
            p.memory -= adm.envs * adm.memory_each
            if p.envs <= 0:
                del self._pending[adm.key_id]

    # -- processes ----------------------------------------------------------------------------

    async def start_process(self, key: ApiKey, count_running: Callable[[], Awaitable[int]]) -> Callable[[], None]:
        """Count one more running process for ``key`` (or raise the 429); returns what to call when
        the API sees it end. ``count_running`` asks the daemons how many of the key's processes
        still run (processes started in the background end without the API seeing it), and is
        called only when the count reached the limit."""
        limit = self.limits(key)["processes"]
        if limit is not None and self._processes.get(key.id, 0) + 1 > limit:
            running = await count_running()
            with self._lock:
                self._processes[key.id] = running
            if running + 1 > limit:
                raise _refusal(key, "processes", limit, running, 1)
        with self._lock:
            self._processes[key.id] = self._processes.get(key.id, 0) + 1
        done = [False]

        def ended() -> None:
            if not done[0]:
                done[0] = True
                with self._lock:
                    self._processes[key.id] = max(0, self._processes.get(key.id, 0) - 1)

        return ended

    def check_watchers(self, key: ApiKey, have: int) -> None:
        limit = self.limits(key)["watchers"]
        if limit is not None and have + 1 > limit:
            raise _refusal(key, "watchers", limit, have, 1)
