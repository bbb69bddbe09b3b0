"""Env TTLs: each env's deadline, and the loop that kills the envs past theirs.

A TTL is kept twice: as a wall-clock deadline in the env's record (``expires_s``: it survives a
daemon restart and is what users see) and as a monotonic deadline here, which is what expiry
counts, so that a jump of the wall clock neither expires envs early nor keeps them past their time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from .._errors import ProvisionError
from ._state import EnvRecord

log = logging.getLogger("weenv.daemon")


class Ttls:
    """The TTLs of the envs in ``envs``; :meth:`run` kills the expired ones with ``kill``."""

    def __init__(self, *, envs: dict[str, EnvRecord], kill: Callable[[str], Awaitable[None]]):
        self._envs = envs
        self._kill = kill
        self._deadlines: dict[str, tuple[float, float]] = {}  # env id -> (its expires_s, monotonic deadline)

    def expire_in(self, rec: EnvRecord, ttl_s: float | None) -> None:
        """Set (None: clear) the env's TTL, counted from now."""
        rec.expires_s = None if ttl_s is None else time.time() + ttl_s
        if ttl_s is None:
            self._deadlines.pop(rec.id, None)
        else:
            self._deadlines[rec.id] = (rec.expires_s, time.monotonic() + ttl_s)  # type: ignore[assignment]

    async def run(self, interval_s: float = 0.25) -> None:
        """Kill expired running or paused envs until cancelled. A record's wall-clock deadline that was
        not set here (a re-adopted env) is turned monotonic when first seen."""
        deadlines = self._deadlines
        while True:
            now = time.monotonic()
            for gone in deadlines.keys() - self._envs.keys():
                del deadlines[gone]
            for rec in list(self._envs.values()):
                if rec.expires_s is None:
                    deadlines.pop(rec.id, None)
                    continue
                seen = deadlines.get(rec.id)
                if seen is None or seen[0] != rec.expires_s:
                    seen = deadlines[rec.id] = (rec.expires_s, now + rec.expires_s - time.time())
                if seen[1] <= now and rec.status in ("running", "paused"):
                    log.info("env %s: TTL expired, killing it", rec.id)
                    try:
                        await self._kill(rec.id)
                    except ProvisionError as e:
                        log.error("env %s: TTL kill: %s", rec.id, e)
            await trio.sleep(interval_s)
