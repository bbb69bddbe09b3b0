"""Each env's usage over time: one point every :data:`STEP_S` seconds from the monitor's view, the
last :data:`POINTS` of them (an hour), kept in the daemon's memory (``GET /v1/envs/{id}/metrics``,
E2B's ``get_metrics(start, end)``).

A point is five numbers in a flat ``array('d')`` ring (40 bytes; 28 KiB an env for the hour), so a
node of a thousand envs holds 28 MiB of history. A restarted daemon starts each env's history anew.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from typing import Any

import trio

STEP_S = 5.0
"""E2B's rate: one point every five seconds."""
POINTS = 720
FIELDS = ("t", "cpu_used_cores", "cpu_quota_cores", "memory_used_bytes", "memory_limit_bytes")


def usage(view: dict[str, Any], t: float) -> tuple[float, ...]:
    """A point (:data:`FIELDS`) from an env's monitor view (:func:`._envstate.env_view`) at ``t``."""
    cpu, mem = view.get("cpu") or {}, view.get("memory") or {}
    return (t, float(cpu.get("used_cores") or 0.0), float(cpu.get("quota_cores") or 0.0),
            float(mem.get("used_bytes") or 0), float(mem.get("limit_bytes") or 0))


def as_point(values: tuple[float, ...]) -> dict[str, float]:
    """A point as its JSON object (bytes as whole numbers)."""
    return {k: (int(v) if k.startswith("memory") else v) for k, v in zip(FIELDS, values)}


class _Ring:
    __slots__ = ("data", "count", "next")

    def __init__(self) -> None:
        self.data = array("d", bytes(8 * len(FIELDS) * POINTS))
        self.count = 0
        self.next = 0

    def append(self, values: tuple[float, ...]) -> None:
        at = self.next * len(FIELDS)
        self.data[at:at + len(FIELDS)] = array("d", values)
        self.next = (self.next + 1) % POINTS
        self.count = min(self.count + 1, POINTS)

    def points(self) -> list[tuple[float, ...]]:
        """Oldest first."""
        first = (self.next - self.count) % POINTS
        n = len(FIELDS)
        return [tuple(self.data[((first + i) % POINTS) * n:((first + i) % POINTS) * n + n]) for i in range(self.count)]


class History:
    """Usage points per env, fed by :meth:`record` (every :data:`STEP_S` by :meth:`run`)."""

    def __init__(self) -> None:
        self._rings: dict[str, _Ring] = {}

    def record(self, envs: dict[str, dict[str, Any]], now: float | None = None) -> None:
        """One point for each env of a monitor snapshot's ``envs``; envs no longer there are dropped."""
        t = time.time() if now is None else now
        for env_id in [e for e in self._rings if e not in envs]:
            del self._rings[env_id]
        for env_id, view in envs.items():
            ring = self._rings.get(env_id)
            if ring is None:
                ring = self._rings[env_id] = _Ring()
            ring.append(usage(view, t))

    def between(self, env_id: str, start: float | None = None, end: float | None = None) -> list[dict[str, float]]:
        """The env's points with ``start <= t <= end`` (either open), oldest first."""
        ring = self._rings.get(env_id)
        if ring is None:
            return []
        return [as_point(p) for p in ring.points()
                if (start is None or p[0] >= start) and (end is None or p[0] <= end)]

    async def run(self, snapshot: Callable[[], dict[str, Any]], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Record the monitor's ``snapshot()["envs"]`` every :data:`STEP_S` (runs for ever)."""
        task_status.started()
        while True:
            self.record(snapshot().get("envs", {}))
            await trio.sleep(STEP_S)
