"""Park after N seconds paused: a frozen env whose pause asked for it (``pause(park_after_s=N)``,
or the daemon's ``--park-after N`` for every freezer pause) is parked by :meth:`Parking.run` once
it has stayed paused N s (:meth:`~._memory.MemorySnapshotter.park`: its memory checkpointed to
disk and freed); a resume before then just thaws it.

The deadline is kept as the TTL's is (:mod:`._ttl`): a wall-clock ``park_at_s`` in the env's
record (it survives a daemon restart and is what users see) turned into a monotonic deadline
here when first seen, which is what counts. An env whose runtime cannot park (crun) gets no
deadline: it stays frozen and its record says why (``not_parked_because``). A park that fails
leaves the env frozen as it was (:meth:`~._memory.MemorySnapshotter._checkpoint`), its deadline
cleared and the error recorded: it is not tried again until the next pause.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable

import trio

from .._errors import EnvStateError, MemorySnapshotUnavailableError
from ._state import EnvRecord

log = logging.getLogger("weenv.daemon")


def park_after(requested_s: float | None, default_s: float | None) -> float | None:
    """How long a freezer pause stays frozen before it is parked: the pause's own ``park_after_s``
    (``inf``: never), else the daemon's; None: never."""
    after = requested_s if requested_s is not None else default_s
    if after is None or math.isinf(after):
        return None
    if after < 0 or math.isnan(after):
        raise ValueError(f"park_after_s={after!r}: a number of seconds >= 0 (inf: never)")
    return after


def check_park_after(env_id: str, memory: bool | str, park_after_s: float | None) -> None:
    """``park_after_s`` is for a freeze only (a pause with ``memory=True``)."""
    if park_after_s is not None and memory is not True:
        raise EnvStateError(f"park_after_s is for a freezer pause (memory=true), not memory={memory}", env_id=env_id)


def still_due(rec: EnvRecord, park_at_s: float) -> bool:
    """Whether the env is still what the deadline ``park_at_s`` was found due for: frozen (paused
    with its memory in RAM), not parked, that deadline unchanged (no resume and pause meanwhile);
    checked again under the env's lock."""
    return rec.status == "paused" and not rec.cold and rec.park_at_s == park_at_s


class Parking:
    """The park-after deadlines of the envs in ``envs``; :meth:`run` parks the due ones with
    ``park(env_id, only_if=...)`` (:meth:`~._memory.MemorySnapshotter.park`: ``only_if`` is checked
    under the env's lock) and records a park's failure with ``save``."""

    def __init__(self, *, envs: dict[str, EnvRecord], park: Callable[..., Awaitable[None]],
                 save: Callable[[EnvRecord], None], default_s: float | None = None):
        self._envs = envs
        self._park = park
        self._save = save
        self.default_s = default_s  # the daemon's --park-after (None: off)
        self._deadlines: dict[str, tuple[float, float]] = {}  # env id -> (its park_at_s, monotonic deadline)

    async def arm(self, rec: EnvRecord, requested_s: float | None,
                  capability: Callable[[EnvRecord], Awaitable[object]]) -> None:
        """A freeze of ``rec`` (the caller freezes it and saves the record): its deadline set from
        the pause's ``park_after_s`` or the daemon's; a runtime that cannot park (``capability``
        raises :class:`MemorySnapshotUnavailableError`) gets none: it stays frozen, and says why."""
        after = park_after(requested_s, self.default_s)
        rec.not_parked_because = ""
        if after is not None:
            try:
                await capability(rec)
            except MemorySnapshotUnavailableError as e:
                rec.not_parked_because, after = f"stays frozen while paused: {e}", None
        self.park_in(rec, after)

    def disarm(self, rec: EnvRecord) -> None:
        """The env resumed or paused otherwise: no deadline, nothing to say."""
        self.park_in(rec, None)
        rec.not_parked_because = ""

    def park_in(self, rec: EnvRecord, after_s: float | None) -> None:
        """Set (None: clear) the env's deadline, counted from now."""
        rec.park_at_s = None if after_s is None else time.time() + after_s
        if after_s is None:
            self._deadlines.pop(rec.id, None)
        else:
            self._deadlines[rec.id] = (rec.park_at_s, time.monotonic() + after_s)  # type: ignore[assignment]

    def due_now(self, now: float | None = None) -> list[tuple[str, float]]:
        """The envs whose monotonic deadline has passed (a re-adopted env's wall-clock one is
        turned monotonic when first seen)."""
        now = time.monotonic() if now is None else now
        deadlines = self._deadlines
        for gone in deadlines.keys() - self._envs.keys():
            del deadlines[gone]
        out = []
        for rec in list(self._envs.values()):
            if rec.park_at_s is None or rec.status != "paused" or rec.cold:
                deadlines.pop(rec.id, None)
                continue
            seen = deadlines.get(rec.id)
            if seen is None or seen[0] != rec.park_at_s:
                seen = deadlines[rec.id] = (rec.park_at_s, now + rec.park_at_s - time.time())
            if seen[1] <= now:
                out.append((rec.id, rec.park_at_s))
        return out

    async def run(self, interval_s: float = 0.25) -> None:
        """Park the due envs, one at a time (a park is ~0.5 s of the node's CPU), until cancelled."""
        while True:
            for env_id, park_at_s in self.due_now():
                await self._park_due(env_id, park_at_s)
            await trio.sleep(interval_s)

    async def _park_due(self, env_id: str, park_at_s: float) -> None:
        """Park the env unless it was resumed, paused again or killed meanwhile. A park that fails
        leaves it frozen (:meth:`~._memory.MemorySnapshotter.park`): the error is logged and
        recorded, and it is not tried again until the next pause."""
        try:
            await self._park(env_id, only_if=lambda rec: still_due(rec, park_at_s))  # (it logs the park)
        except Exception as e:
            rec = self._envs.get(env_id)
            if rec is None or rec.park_at_s != park_at_s:  # killed (or paused again) meanwhile
                return
            log.error("env %s: park after its pause failed, it stays frozen: %s", env_id, e)
            rec.park_at_s, rec.not_parked_because = None, f"its park failed (it stays frozen): {e}"
            self._deadlines.pop(env_id, None)
            self._save(rec)


def _dir_bytes(path: str) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    except OSError:
        pass
    return total


def prometheus_text(envs: Iterable[EnvRecord]) -> str:
    """The node's paused envs in the prometheus text format (``GET /v1/metrics``): how many are
    frozen (their memory in RAM), how many of those have a park-after deadline, how many are
    parked and the disk their images take instead of RAM. Blocking (stats the images)."""
    frozen = pending = parked = image_bytes = 0
    for rec in envs:
        if rec.status != "paused":
            continue
        if rec.memory_image:
            parked += 1
            image_bytes += _dir_bytes(rec.memory_image)
        elif not rec.cold:
            frozen += 1
            pending += rec.park_at_s is not None
    gauges = (("weenv_envs_frozen", "Paused envs whose memory stays in RAM (the freezer)", frozen),
              ("weenv_envs_park_pending", "Frozen envs the daemon parks when their park-after deadline comes", pending),
              ("weenv_envs_parked", "Paused envs whose memory is checkpointed to disk (parked)", parked),
              ("weenv_envs_parked_image_bytes", "Disk the parked envs' checkpoint images take (their memory freed)",
               image_bytes))
    lines = []
    for metric, help_text, value in gauges:
        lines += [f"# HELP {metric} {help_text}.", f"# TYPE {metric} gauge", f"{metric} {value}"]
    return "\n".join(lines) + "\n"
