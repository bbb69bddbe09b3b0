"""envd's ``filesystem.Filesystem`` service on the daemon's file calls: Stat, MakeDir, Move,
ListDir, Remove, and watching (CreateWatcher / GetWatcherEvents / RemoveWatcher, WatchDir).

Watching is by polling through the daemon (a listing compared with the last one, every
:data:`WATCH_POLL_S` for ``WatchDir``, on each call for ``GetWatcherEvents``): a file created
and removed between two looks is not seen, and a write that keeps size and mtime is not either.
A watcher counts against its env's owner key's ``watchers`` quota and goes with its env."""

from __future__ import annotations

import posixpath
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import anyio
import msgspec

from .._connection import ApiError as DaemonError
from ._common import HttpError
from ._connect import (
    Code,
    ConnectError,
)
from ._envd_view import (
    MAX_LIST_ENTRIES,
    MAX_WATCH_DIRS,
    MAX_WATCH_ENTRIES,
    MAX_WATCHERS,
    MAX_WATCHERS_PER_ENV,
    WATCH_POLL_S,
    WATCHER_IDLE_S,
    EnvView,
    _entry,
    _Message,
)


class PathRequest(_Message):
    """Stat, MakeDir, Remove."""

    path: str = ""


class MoveRequest(_Message):
    source: str = ""
    destination: str = ""


class ListDirRequest(_Message):
    path: str = ""
    depth: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0


class WatchRequest(_Message):
    """WatchDir, CreateWatcher."""

    path: str = ""
    recursive: bool = False
    include_entry: bool = False
    allow_network_mounts: bool = False


class WatcherRequest(_Message):
    """GetWatcherEvents, RemoveWatcher."""

    watcher_id: str = ""


# -- filesystem.Filesystem ----------------------------------------------------------------------


async def fs_stat(view: EnvView, req: PathRequest) -> dict[str, Any]:
    path = await view.path(req.path)
    return {"entry": await _entry(view, await view.stat(path), path)}


async def fs_make_dir(view: EnvView, req: PathRequest) -> dict[str, Any]:
    path = await view.path(req.path)
    try:
        info = await view.stat(path)
    except DaemonError as e:
        if e.kind != "file_not_found":
            raise
    else:
        if info.get("kind") == "dir":
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {path} already exists")
        raise ConnectError(Code.INVALID_ARGUMENT, f"{path} exists and is not a directory")
    await view.env.mkdir(path, user=await view.acting_user())
    return {"entry": await _entry(view, await view.stat(path), path)}


async def fs_move(view: EnvView, req: MoveRequest) -> dict[str, Any]:
    src, dst = await view.path(req.source, "source"), await view.path(req.destination, "destination")
    await view.stat(src)  # NOT_FOUND for a missing source, before anything runs
    await view.env.move(src, dst)  # NOT_FOUND, INVALID_ARGUMENT by the daemon's error kinds
    return {"entry": await _entry(view, await view.stat(dst), dst)}


async def _walk(view: EnvView, root: str, depth: int, limit: int,
                max_dirs: int = 1 << 30, *, xattrs: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """``(path, info)`` under ``root`` down to ``depth`` levels, at most ``limit`` of them, from at
    most ``max_dirs`` directories (each one is a daemon round trip)."""
    out: list[tuple[str, dict[str, Any]]] = []
    level = [root]
    listed = 0
    for _ in range(max(1, depth)):
        nxt = []
        for directory in level:
            listed += 1
            if listed > max_dirs:
                return out
            for info in await view.listdir(directory, xattrs=xattrs):
                path = posixpath.join(directory, info["name"])
                out.append((path, info))
                if len(out) >= limit:
                    return out
                if info.get("kind") == "dir":
                    nxt.append(path)
        if not nxt:
            break
        level = nxt
    return out


async def fs_list_dir(view: EnvView, req: ListDirRequest) -> dict[str, Any]:
    path = await view.path(req.path)
    depth = req.depth or 1
    info = await view.stat(path)
    if info.get("kind") != "dir":
        raise ConnectError(Code.INVALID_ARGUMENT, f"{path} is not a directory")
    return {"entries": [await _entry(view, i, p) for p, i in await _walk(view, path, depth, MAX_LIST_ENTRIES)]}


async def fs_remove(view: EnvView, req: PathRequest) -> dict[str, Any]:
    path = await view.path(req.path)
    if not await _exists(view, path):  # as envd (RemoveAll): a missing path is no error
        return {}
    try:
        await view.env.remove(path, recursive=True)
    except DaemonError as e:
        if e.kind != "file_not_found":  # removed meanwhile
            raise
    return {}


@dataclass
class Watcher:
    env_id: str
    path: str
    recursive: bool
    owner_id: str = ""
    """The key that owns the env: the watcher counts against its quota."""
    seen: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    used_s: float = field(default_factory=time.monotonic)
    include_entry: bool = False
    """Events carry the entry's info (envd 0.6.3): the last look's, kept here."""
    infos: dict[str, Any] = field(default_factory=dict)


async def _look(view: EnvView, w: Watcher) -> dict[str, tuple[str, int, float]]:
    w.used_s = time.monotonic()
    found = await _walk(view, w.path, 16 if w.recursive else 1, MAX_WATCH_ENTRIES, MAX_WATCH_DIRS,
                        xattrs=w.include_entry)
    if w.include_entry:
        w.infos = {posixpath.relpath(p, w.path): i for p, i in found}
    return {posixpath.relpath(p, w.path): (i.get("kind", ""), int(i.get("size_bytes", 0)), float(i.get("mtime_s", 0)))
            for p, i in found}


async def _changes(view: EnvView, w: Watcher, new: dict[str, tuple[str, int, float]]) -> list[dict[str, Any]]:
    """The events from the last look to ``new`` (and the look becomes the last), with entries if asked."""
    events, w.seen = _diff(w.seen, new), new
    if w.include_entry:
        for ev in events:  # a removed entry has none (as envd)
            info = w.infos.get(ev["name"]) if ev["type"] != "EVENT_TYPE_REMOVE" else None
            if info is not None:
                ev["entry"] = await _entry(view, info, posixpath.join(w.path, ev["name"]))
    return events


def _diff(old: dict[str, tuple[str, int, float]], new: dict[str, tuple[str, int, float]]) -> list[dict[str, Any]]:
    events = []
    for name in sorted(new.keys() - old.keys()):
        events.append({"name": name, "type": "EVENT_TYPE_CREATE"})
        if new[name][0] == "file" and new[name][1] > 0:
            events.append({"name": name, "type": "EVENT_TYPE_WRITE"})
    for name in sorted(old.keys() & new.keys()):
        if old[name] != new[name] and new[name][0] != "dir":
            events.append({"name": name, "type": "EVENT_TYPE_WRITE"})
    for name in sorted(old.keys() - new.keys()):
        events.append({"name": name, "type": "EVENT_TYPE_REMOVE"})
    return events


async def _new_watcher(view: EnvView, req: WatchRequest) -> Watcher:
    path = await view.path(req.path)
    info = await view.stat(path)
    if info.get("kind") != "dir":
        raise ConnectError(Code.INVALID_ARGUMENT, f"{path} is not a directory")
    w = Watcher(view.env_id, path, req.recursive, owner_id=view.owner_id(), include_entry=req.include_entry)
    w.seen = await _look(view, w)  # (allow_network_mounts: weenv envs have no network mounts to leave out)
    return w


def _admit_watcher(view: EnvView) -> None:
    """Room for one more watcher of the env's key (its quota), of the env, and of the server."""
    watchers = view.state.watchers
    now = time.monotonic()
    for wid in [wid for wid, w in watchers.items() if now - w.used_s > WATCHER_IDLE_S]:
        del watchers[wid]  # nobody asked for its events for a long time: the client forgot it
    if sum(1 for w in watchers.values() if w.env_id == view.env_id) >= MAX_WATCHERS_PER_ENV:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"sandbox {view.env_id} has {MAX_WATCHERS_PER_ENV} watchers "
                           "already: remove some")
    owner = view.owner()
    if owner is not None:
        try:
            view.state.quotas.check_watchers(owner, sum(1 for w in watchers.values() if w.owner_id == owner.id))
        except HttpError as e:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, e.message) from None
    if len(watchers) >= MAX_WATCHERS:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"{MAX_WATCHERS} watchers exist already: remove some")


async def fs_create_watcher(view: EnvView, req: WatchRequest) -> dict[str, Any]:
    _admit_watcher(view)
    w = await _new_watcher(view, req)
    watcher_id = secrets.token_hex(8)
    view.state.watchers[watcher_id] = w
    return {"watcherId": watcher_id}


def _watcher(view: EnvView, req: WatcherRequest) -> tuple[str, Watcher]:
    wid = req.watcher_id
    w = view.state.watchers.get(wid)
    if w is None or w.env_id != view.env_id:
        raise ConnectError(Code.NOT_FOUND, f"watcher {wid!r} not found")
    return wid, w


async def fs_get_watcher_events(view: EnvView, req: WatcherRequest) -> dict[str, Any]:
    _, w = _watcher(view, req)
    return {"events": await _changes(view, w, await _look(view, w))}


async def fs_remove_watcher(view: EnvView, req: WatcherRequest) -> dict[str, Any]:
    wid, _ = _watcher(view, req)
    view.state.watchers.pop(wid, None)
    return {}


async def fs_watch_dir(view: EnvView, req: WatchRequest, keepalive_s: float) -> AsyncIterator[dict[str, Any]]:
    _admit_watcher(view)
    w = await _new_watcher(view, req)
    watcher_id = "stream-" + secrets.token_hex(8)  # counted as a watcher while the stream lasts
    view.state.watchers[watcher_id] = w
    try:
        yield {"start": {}}
        last_sent = time.monotonic()
        look_s = 0.0
        while watcher_id in view.state.watchers:  # dropped when its env goes (weenv/api/_reaper.py)
            await anyio.sleep(max(WATCH_POLL_S, 2 * look_s))  # a big tree is looked at less often
            t0 = time.monotonic()
            new = await _look(view, w)
            look_s = time.monotonic() - t0
            events = await _changes(view, w, new)
            for ev in events:
                yield {"filesystem": ev}
                last_sent = time.monotonic()
            if time.monotonic() - last_sent >= keepalive_s:
                yield {"keepalive": {}}
                last_sent = time.monotonic()
        raise ConnectError(Code.NOT_FOUND, f"sandbox {view.env_id} is gone")
    finally:
        view.state.watchers.pop(watcher_id, None)


async def _exists(view: EnvView, path: str) -> bool:
    try:
        await view.stat(path)
    except DaemonError as e:
        if e.kind == "file_not_found":
            return False
        raise
    return True


_bash_cache: dict[str, tuple[float, bool]] = {}
BASH_CACHE_S = 30.0


async def _has_bash(view: EnvView) -> bool:
    """Whether the env has /bin/bash, looked at once per :data:`BASH_CACHE_S` (a daemon round trip
    on every command would be a third of a command's round trip)."""
    hit = _bash_cache.get(view.env_id)
    if hit is not None and time.monotonic() - hit[0] < BASH_CACHE_S:
        return hit[1]
    found = await _exists(view, "/bin/bash")
    if len(_bash_cache) > 4096:
        _bash_cache.clear()
    _bash_cache[view.env_id] = (time.monotonic(), found)
    return found
