"""Group reuse bookkeeping: which sample of a group prepares the task env, and who waits for it.

The first sample to arrive with a given key (group index + what its task env is made of) becomes
the *leader*: it creates the env, runs the setup commands, commits a snapshot and publishes the
snapshot id (or ``None`` when snapshots are unavailable) on the entry's future. Siblings wait on
that future and start from the snapshot. Each claimer calls :meth:`release` when it no longer
needs the snapshot (its episode and grading are over); the last one learns that the snapshot can
be deleted. An entry leaves the table once ``expected`` samples have claimed it, when its last
user releases it, when its leader fails (so later samples can try again), or when the table is
full (oldest first). No I/O here.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable


@dataclass
class GroupEntry:
    """One group's template: the leader's published snapshot id and how many samples remain."""

    future: asyncio.Future
    remaining: int | None
    claims: int = 0
    active: int = 0


class GroupTemplates:
    """The table of group entries of one event loop."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, GroupEntry] = OrderedDict()
        self.leaders = 0  # statistics, for tests and logs
        self.followers = 0

    def __len__(self) -> int:
        return len(self._entries)

    def claim(self, key: Hashable, expected: int | None) -> tuple[GroupEntry, bool]:
        """The entry for ``key`` and whether the caller is its leader (it must then call
        :meth:`publish` or :meth:`fail`). ``expected``: the group size, if known."""
        entry = self._entries.get(key)
        if entry is not None and entry.future.done() and entry.future.exception() is not None:
            del self._entries[key]
            entry = None
        leader = entry is None
        if entry is None:
            entry = GroupEntry(future=asyncio.get_running_loop().create_future(), remaining=expected)
            self._entries[key] = entry
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            self.leaders += 1
        else:
            self._entries.move_to_end(key)
            self.followers += 1
        entry.claims += 1
        entry.active += 1
        if entry.remaining is not None:
            entry.remaining -= 1
            if entry.remaining <= 0:
                self._entries.pop(key, None)
        return entry, leader

    @staticmethod
    def publish(entry: GroupEntry, snapshot_id: str | None) -> None:
        if not entry.future.done():
            entry.future.set_result(snapshot_id)

    def fail(self, key: Hashable, entry: GroupEntry, error: BaseException) -> None:
        """The leader could not prepare the template: waiting siblings get ``error``; the next
        sample to arrive starts over as a new leader."""
        if not entry.future.done():
            entry.future.set_exception(error)
            entry.future.exception()  # marks it retrieved: no "never retrieved" warning without siblings
        if self._entries.get(key) is entry:
            del self._entries[key]

    def release(self, key: Hashable, entry: GroupEntry) -> bool:
        """The caller is done with the entry's snapshot. True when it was the last one using it:
        the entry leaves the table (a late sibling would lead anew) and the snapshot may be
        deleted. slime starts a group's samples together, so all of them claim before any ends."""
        entry.active -= 1
        if entry.active > 0:
            return False
        if self._entries.get(key) is entry:
            del self._entries[key]
        return True
