"""The warm pool: envs started ahead of time and handed out by the next create of their lock.

After a create for a lock, the pool keeps ``size`` more envs of that lock started and idle (status
``pooled``, not listed), refilled one at a time in the background, starting
:data:`REFILL_DELAY_S` after the create: an env start is ~20 ms of CPU, and run at once it
competed with the create's own answer and the caller's first command (2 cores, 40 interleaved
pooled creates → first output: p50 14.8 ms refilling at once, 9.6 ms with the delay). Pools of locks nobody asked for
within ``idle_s`` are dropped by :meth:`WarmPool.janitor`, and pooled envs make way for real ones
when admission is short (:meth:`WarmPool.evict_one`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

import trio

from ...envlet import EnvletError
from ...plan import Lock, plan_to_builtins
from .._errors import ProvisionError
from ._state import EnvRecord

log = logging.getLogger("weenv.daemon")

#: How long after a create the pool of its lock starts refilling (see the module doc).
REFILL_DELAY_S = 0.05


def pool_key(lock: Lock) -> str:
    """Envs are interchangeable when their locks are equal but for the TTL (it starts at hand-out)."""
    data = plan_to_builtins(lock)
    data.pop("ttl_s", None)
    return json.dumps(data, sort_keys=True)


class WarmPool:
    """The node's pools, one per lock. ``start`` starts a pooled env of a lock, ``kill`` kills one,
    ``spawn`` runs a refill in the background (False: no background work runs, no refill);
    ``clock`` tells the monotonic time idleness is measured on."""

    def __init__(self, *, size: int, idle_s: float, envs: dict[str, EnvRecord],
                 start: Callable[[Lock], Awaitable[EnvRecord]], kill: Callable[[str], Awaitable[None]],
                 spawn: Callable[..., bool], clock: Callable[[], float] = time.monotonic,
                 refill_delay_s: float = REFILL_DELAY_S):
        self.size = size  # envs kept started per lock (0: no warm pool)
        self.idle_s = idle_s
        self.refill_delay_s = refill_delay_s
        self.starting: set[str] = set()  # envs being started for a pool (not listed)
        self._envs = envs
        self._start = start
        self._kill = kill
        self._spawn = spawn
        self._clock = clock
        self._pools: dict[str, list[str]] = {}  # pool key -> ids of its pooled envs
        self._used: dict[str, float] = {}  # pool key -> monotonic time of the last create of its lock
        self._refilling: set[str] = set()

    def take(self, lock: Lock) -> EnvRecord | None:
        """A pooled env of ``lock``, now running (None: the pool is empty); either way the lock's
        pool refills in the background."""
        key = pool_key(lock)
        self._used[key] = self._clock()
        taken = self._take(key)
        self._refill_later(key, lock)
        return taken

    def _take(self, key: str) -> EnvRecord | None:
        ids = self._pools.get(key)
        while ids:
            rec = self._envs.get(ids.pop())
            if rec is not None and rec.status == "pooled":
                rec.status = "running"
                rec.created_s = time.time()
                return rec
        return None

    def forget(self, env_id: str) -> None:
        """``env_id`` is going away: no pool hands it out."""
        for ids in self._pools.values():
            if env_id in ids:
                ids.remove(env_id)

    def _refill_later(self, key: str, lock: Lock) -> None:
        if key in self._refilling:
            return
        if self._spawn(self._refill, key, lock):
            self._refilling.add(key)

    async def _refill(self, key: str, lock: Lock) -> None:
        """Keep ``size`` envs of this lock started and idle, one at a time, in the background."""
        try:
            await trio.sleep(self.refill_delay_s)  # the create that asked is answered and used first
            while len(self._pools.get(key, ())) < self.size and key in self._used:
                rec = await self._start(lock)
                if key not in self._used:  # dropped (idle, gc, the daemon stopping) while this one was starting
                    await self._kill_shielded(rec.id)
                    break
                self._pools.setdefault(key, []).append(rec.id)
        except (ProvisionError, EnvletError) as e:
            log.info("warm pool: no refill for %s: %s", lock.name, e)
        finally:
            self._refilling.discard(key)

    async def _kill_shielded(self, env_id: str) -> None:
        """Kill a pooled env to the end: a kill cut short by a cancel (a gc's client gone, the daemon
        stopping) would leave its mounts and cgroups behind, and nobody knows a pooled env's id."""
        with trio.CancelScope(shield=True):
            await self._kill(env_id)

    async def settle(self, timeout_s: float = 60.0) -> bool:
        """Wait until no refill is under way (after :meth:`drain`, each ends with the start it was
        in, whose env it kills); False if some were still going after ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while self._refilling:
                await trio.sleep(0.05)
        return not self._refilling

    def _pooled(self, env_id: str) -> bool:
        return env_id in self._envs and self._envs[env_id].status == "pooled"

    async def evict_one(self) -> bool:
        """Kill one pooled env (the oldest of the first pool that has one); False: none was left."""
        for ids in self._pools.values():
            while ids:
                env_id = ids.pop(0)
                if self._pooled(env_id):
                    await self._kill_shielded(env_id)
                    return True
        return False

    async def drain(self) -> list[str]:
        """Kill every pooled env and forget the pools (gc, shutdown of the pool)."""
        self._used.clear()
        killed = []
        for key in list(self._pools):
            for env_id in self._pools.pop(key, []):
                if self._pooled(env_id):
                    await self._kill_shielded(env_id)
                    killed.append(env_id)
        return killed

    async def janitor(self, idle_s: float, interval_s: float = 5.0) -> None:
        """Drop the pools of locks nobody asked for lately."""
        while True:
            await trio.sleep(interval_s)
            now = self._clock()
            for key, last in list(self._used.items()):
                if now - last > idle_s:
                    del self._used[key]
                    for env_id in self._pools.pop(key, []):
                        if self._pooled(env_id):
                            await self._kill_shielded(env_id)
