"""E2B's data plane (what ``envd`` serves inside an E2B sandbox), on top of the daemon's files and exec.

- REST: ``GET /health``, ``GET /files?path=&username=`` (the file, streamed) and ``POST /files``
  (octet-stream, streamed to the env's disk; or multipart, one part per file, spooled).
- Connect RPC, JSON codec: ``filesystem.Filesystem/*`` and ``process.Process/Start`` for
  foreground commands (on the daemon's streamed exec).

Watching is by polling through the daemon (a listing compared with the last one, every
:data:`WATCH_POLL_S` for ``WatchDir``, on each call for ``GetWatcherEvents``): a file created
and removed between two looks is not seen, and a write that keeps size and mtime is not either.

The Gate has already checked the env's access token and put the env id into the scope.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime as dt
import posixpath
import secrets
import stat as stat_mod
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import anyio
import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .._client import ApiError as DaemonError
from .._client import AsyncClient, AsyncEnv, AsyncProcess, DaemonUnavailableError, WeenvError
from .._wire import ProcessEnd
from ._common import ApiState, HttpError, daemon_errors, log, read_body, relay, state_of
from ._connect import (STREAM_CONTENT_TYPE, UNARY_CONTENT_TYPE, Code, ConnectError, EnvelopeReader, FramingError,
                       code_for_http_status, end_stream, envelope, error_body)

MAX_RPC_BODY_BYTES = 1 << 20
MAX_LIST_ENTRIES = 10_000
MAX_WATCH_ENTRIES = 10_000
MAX_WATCHERS = 4096
MAX_WATCHERS_PER_ENV = 64
MAX_WATCH_DIRS = 256
WATCHER_IDLE_S = 600.0
WATCH_POLL_S = 0.25
KEEPALIVE_S = 50.0

_FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}


# -- request messages (proto JSON: camelCase names; unknown fields ignored, as proto JSON readers do) --


class _Message(msgspec.Struct, rename="camel", kw_only=True):
    pass


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


# -- the env, through the daemon ----------------------------------------------------------------


@dataclass
class EnvView:
    """One request's env: its id, its daemon, and the user the request acts as."""

    state: ApiState
    env_id: str
    user: str | None

    @property
    def client(self) -> AsyncClient:
        return self.state.backend.for_env(self.env_id)

    async def files(self, method: str, path: str, op: str | None = None, **kw: Any) -> httpx.Response:
        params: dict[str, str] = {"path": path}
        if op:
            params["op"] = op
        if self.user and method != "DELETE":
            params["user"] = self.user
        params.update(kw.pop("params", {}))
        suffix = "/mkdir" if op == "mkdir" else ""
        if op == "mkdir":
            del params["op"]
        return await self.client._request(method, f"/v1/envs/{self.env_id}/files{suffix}", params=params, **kw)

    async def stat(self, path: str) -> dict[str, Any]:
        return (await self.files("GET", path, "stat")).json()  # type: ignore[no-any-return]

    async def listdir(self, path: str) -> list[dict[str, Any]]:
        return (await self.files("GET", path, "list")).json()  # type: ignore[no-any-return]


_names_cache: dict[tuple[str, str], tuple[float, dict[int, str]]] = {}


async def _names(view: EnvView, which: str) -> dict[int, str]:
    """uid/gid -> name from the env's /etc/passwd or /etc/group (cached a few seconds)."""
    key = (view.env_id, which)
    hit = _names_cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < 10.0:
        return hit[1]
    names: dict[int, str] = {}
    try:
        text = (await view.client._request("GET", f"/v1/envs/{view.env_id}/files",
                                           params={"path": f"/etc/{which}"})).content.decode("utf-8", "replace")
        for line in text.splitlines()[:10_000]:
            parts = line.split(":")
            if len(parts) >= 3 and parts[2].isdigit():
                names.setdefault(int(parts[2]), parts[0])
    except DaemonError:
        pass
    if len(_names_cache) > 4096:
        _names_cache.clear()
    _names_cache[key] = (time.monotonic(), names)
    return names


def _ts(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat().replace("+00:00", "Z")


async def _entry(view: EnvView, info: dict[str, Any], path: str) -> dict[str, Any]:
    """weenv's FileInfo as envd's EntryInfo (proto JSON: camelCase, int64 as a string, enum names)."""
    users, groups = await _names(view, "passwd"), await _names(view, "group")
    kind = info.get("kind", "file")
    mode = int(info.get("mode", 0))
    type_bits = {"dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK}.get(kind, stat_mod.S_IFREG)
    out: dict[str, Any] = {
        "name": info.get("name") or posixpath.basename(path.rstrip("/")) or "/",
        "type": _FILE_TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
        "path": path, "size": str(int(info.get("size_bytes", 0))), "mode": mode,
        "permissions": stat_mod.filemode(type_bits | mode),
        "owner": users.get(int(info.get("uid", 0)), str(info.get("uid", 0))),
        "group": groups.get(int(info.get("gid", 0)), str(info.get("gid", 0))),
        "modifiedTime": _ts(float(info.get("mtime_s", 0.0))),
    }
    if kind == "symlink":
        out["isSymlink"] = True
        out["symlinkTarget"] = info.get("link_target") or ""
    return out


def _abs(path: str, what: str = "path") -> str:
    if not path:
        raise ConnectError(Code.INVALID_ARGUMENT, f"{what} is required")
    if "\x00" in path:
        raise ConnectError(Code.INVALID_ARGUMENT, f"{what} holds a NUL byte")
    return posixpath.normpath(path if path.startswith("/") else "/" + path)


def _rpc_error(e: DaemonError | HttpError, path: str | None = None) -> ConnectError:
    status = e.status
    message = e.detail if isinstance(e, DaemonError) else e.message
    kind = e.kind
    if kind == "env_not_found":
        return ConnectError(Code.UNAVAILABLE, f"sandbox was not found: {message}")
    if kind == "wrong_state":
        return ConnectError(Code.UNAVAILABLE, f"sandbox is not running: {message}")
    if kind == "file_not_found":
        return ConnectError(Code.NOT_FOUND, message)
    if kind == "file_error":
        return ConnectError(Code.INVALID_ARGUMENT, message)
    return ConnectError(code_for_http_status(status), message)


# -- filesystem.Filesystem ----------------------------------------------------------------------


async def fs_stat(view: EnvView, req: PathRequest) -> dict[str, Any]:
    path = _abs(req.path)
    return {"entry": await _entry(view, await view.stat(path), path)}


async def fs_make_dir(view: EnvView, req: PathRequest) -> dict[str, Any]:
    path = _abs(req.path)
    try:
        info = await view.stat(path)
    except DaemonError as e:
        if e.kind != "file_not_found":
            raise
    else:
        if info.get("kind") == "dir":
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {path} already exists")
        raise ConnectError(Code.INVALID_ARGUMENT, f"{path} exists and is not a directory")
    await view.files("POST", path, "mkdir")
    return {"entry": await _entry(view, await view.stat(path), path)}


async def fs_move(view: EnvView, req: MoveRequest) -> dict[str, Any]:
    src, dst = _abs(req.source, "source"), _abs(req.destination, "destination")
    await view.stat(src)  # NOT_FOUND for a missing source, before anything runs
    body: dict[str, Any] = {"argv": ["mv", "-f", "--", src, dst], "timeout_s": 60.0}
    if view.user:
        body["user"] = view.user
    result = (await view.client._request("POST", f"/v1/envs/{view.env_id}/exec", json=body)).json()
    if result.get("exit_code") != 0:
        err = base64.b64decode(result.get("stderr") or b"").decode("utf-8", "replace").strip()
        raise ConnectError(Code.NOT_FOUND if "No such file" in err else Code.INVALID_ARGUMENT,
                           f"move {src} to {dst}: {err or 'mv exited ' + str(result.get('exit_code'))}")
    return {"entry": await _entry(view, await view.stat(dst), dst)}


async def _walk(view: EnvView, root: str, depth: int, limit: int,
                max_dirs: int = 1 << 30) -> list[tuple[str, dict[str, Any]]]:
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
            for info in await view.listdir(directory):
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
    path = _abs(req.path)
    depth = req.depth or 1
    info = await view.stat(path)
    if info.get("kind") != "dir":
        raise ConnectError(Code.INVALID_ARGUMENT, f"{path} is not a directory")
    return {"entries": [await _entry(view, i, p) for p, i in await _walk(view, path, depth, MAX_LIST_ENTRIES)]}


async def fs_remove(view: EnvView, req: PathRequest) -> dict[str, Any]:
    path = _abs(req.path)
    await view.stat(path)
    await view.files("DELETE", path, params={"recursive": "1"})
    return {}


@dataclass
class Watcher:
    env_id: str
    path: str
    recursive: bool
    seen: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    used_s: float = field(default_factory=time.monotonic)


async def _look(view: EnvView, w: Watcher) -> dict[str, tuple[str, int, float]]:
    w.used_s = time.monotonic()
    found = await _walk(view, w.path, 16 if w.recursive else 1, MAX_WATCH_ENTRIES, MAX_WATCH_DIRS)
    return {posixpath.relpath(p, w.path): (i.get("kind", ""), int(i.get("size_bytes", 0)), float(i.get("mtime_s", 0)))
            for p, i in found}


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
    path = _abs(req.path)
    info = await view.stat(path)
    if info.get("kind") != "dir":
        raise ConnectError(Code.INVALID_ARGUMENT, f"{path} is not a directory")
    w = Watcher(view.env_id, path, req.recursive)
    w.seen = await _look(view, w)
    return w


async def fs_create_watcher(view: EnvView, req: WatchRequest) -> dict[str, Any]:
    watchers = view.state.watchers
    now = time.monotonic()
    for wid in [wid for wid, w in watchers.items() if now - w.used_s > WATCHER_IDLE_S]:
        del watchers[wid]  # nobody asked for its events for a long time: the client forgot it
    if sum(1 for w in watchers.values() if w.env_id == view.env_id) >= MAX_WATCHERS_PER_ENV:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"sandbox {view.env_id} has {MAX_WATCHERS_PER_ENV} watchers "
                           "already: remove some")
    if len(watchers) >= MAX_WATCHERS:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"{MAX_WATCHERS} watchers exist already: remove some")
    w = await _new_watcher(view, req)
    watcher_id = secrets.token_hex(8)
    watchers[watcher_id] = w
    return {"watcherId": watcher_id}


def _watcher(view: EnvView, req: WatcherRequest) -> tuple[str, Watcher]:
    wid = req.watcher_id
    w = view.state.watchers.get(wid)
    if w is None or w.env_id != view.env_id:
        raise ConnectError(Code.NOT_FOUND, f"watcher {wid!r} not found")
    return wid, w


async def fs_get_watcher_events(view: EnvView, req: WatcherRequest) -> dict[str, Any]:
    _, w = _watcher(view, req)
    new = await _look(view, w)
    events, w.seen = _diff(w.seen, new), new
    return {"events": events}


async def fs_remove_watcher(view: EnvView, req: WatcherRequest) -> dict[str, Any]:
    wid, _ = _watcher(view, req)
    view.state.watchers.pop(wid, None)
    return {}


async def fs_watch_dir(view: EnvView, req: WatchRequest, keepalive_s: float) -> AsyncIterator[dict[str, Any]]:
    w = await _new_watcher(view, req)
    yield {"start": {}}
    last_sent = time.monotonic()
    look_s = 0.0
    while True:
        await anyio.sleep(max(WATCH_POLL_S, 2 * look_s))  # a big tree is looked at less often
        t0 = time.monotonic()
        new = await _look(view, w)
        look_s = time.monotonic() - t0
        events, w.seen = _diff(w.seen, new), new
        for ev in events:
            yield {"filesystem": ev}
            last_sent = time.monotonic()
        if time.monotonic() - last_sent >= keepalive_s:
            yield {"keepalive": {}}
            last_sent = time.monotonic()


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


# -- process.Process (on the daemon's process handles) --------------------------------------------
#
# As envd: every Start is a process of its own (a daemon process handle), which runs on when its
# stream closes (the SDK's disconnect(), a client that goes away) and is killed (with its session)
# when the call's Connect-Timeout-Ms passes, stream or no stream. ``connect`` reattaches; a
# finished process is no longer listed, and signals or input for it are NOT_FOUND.


class ProcessSelector(_Message):
    pid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)] | None = None
    tag: str | None = None


class ProcessInput(_Message):
    stdin: bytes | None = None
    pty: bytes | None = None


class PtySizeMessage(_Message):
    cols: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    rows: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0


class PtyMessage(_Message):
    size: PtySizeMessage | None = None


class ProcessConfig(_Message):
    cmd: str = ""
    args: Annotated[list[str], msgspec.Meta(max_length=4096)] = []
    envs: dict[str, str] = {}
    cwd: str | None = None


class StartRequest(_Message):
    process: ProcessConfig | None = None
    pty: PtyMessage | None = None
    tag: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    stdin: bool | None = None


class SelectRequest(_Message):
    """Connect, CloseStdin."""

    process: ProcessSelector | None = None


class ListRequest(_Message):
    pass


class SendInputRequest(_Message):
    process: ProcessSelector | None = None
    input: ProcessInput | None = None


class SendSignalRequest(_Message):
    process: ProcessSelector | None = None
    signal: int | str = 0


class UpdateRequest(_Message):
    process: ProcessSelector | None = None
    pty: PtyMessage | None = None


class StreamInputStart(_Message):
    process: ProcessSelector | None = None


class StreamInputData(_Message):
    input: ProcessInput | None = None


class StreamInputRequest(_Message):
    start: StreamInputStart | None = None
    data: StreamInputData | None = None
    keepalive: dict[str, Any] | None = None


_SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15}
MAX_KILL_TIMERS = 4096


def _env(view: EnvView) -> AsyncEnv:
    return AsyncEnv(view.client, {"id": view.env_id})


def _process_error(e: DaemonError, pid: int | None = None) -> ConnectError:
    if e.kind == "process_not_found":
        return ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found" if pid is not None else e.detail)
    if e.kind == "wrong_state" and e.detail.startswith("process "):
        if "has exited" in e.detail:
            return ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found (it has exited)")
        return ConnectError(Code.FAILED_PRECONDITION, e.detail)
    if e.kind in ("command_not_found", "cannot_start"):
        return ConnectError(Code.INVALID_ARGUMENT, e.detail)
    return _rpc_error(e)


async def _pid_of(view: EnvView, selector: ProcessSelector | None) -> int:
    """The pid a selector names: a pid as it is, a tag as the running process carrying it."""
    if selector is None or (selector.pid is None and selector.tag is None):
        raise ConnectError(Code.INVALID_ARGUMENT, "process: give a pid or a tag")
    if selector.pid is not None:
        return selector.pid
    for p in await _env(view).processes():
        if p.running and p.tag == selector.tag:
            return p.pid
    raise ConnectError(Code.NOT_FOUND, f"no running process with tag {selector.tag!r}")


def _end(end: ProcessEnd) -> dict[str, Any]:
    """weenv's end as envd's EndEvent (Go's ProcessState: a signal's exit code is -1, exited false)."""
    if end.signal:
        return {"exitCode": -1, "exited": False, "status": end.status or f"signal: {end.signal}"}
    return {"exitCode": end.exit_code, "exited": True, "status": end.status or f"exit status {end.exit_code}"}


async def _events(proc: AsyncProcess, state: ApiState) -> AsyncIterator[dict[str, Any]]:
    yield {"event": {"start": {"pid": proc.pid}}}
    try:
        # closed here, not left to the garbage collector (trio's finalizer: a thread wakeup per command)
        async with contextlib.aclosing(proc.events()) as events:
            async for ev in events:
                if ev.data_b64 is not None and ev.stream is not None:
                    yield {"event": {"data": {ev.stream: base64.b64encode(ev.data_b64).decode()}}}
                elif ev.end is not None:
                    _ended(state, proc.env.id, proc.pid)  # its deadline has nothing left to kill
                    yield {"event": {"end": _end(ev.end)}}
                    return
    except DaemonError as e:
        if e.kind == "stream":  # cut: the process may run on (connect again)
            raise ConnectError(Code.UNAVAILABLE, str(e.detail)) from None
        raise _process_error(e, proc.pid) from None
    finally:
        with anyio.CancelScope(shield=True):
            await proc.detach()


async def _kill_at(client: AsyncClient, env_id: str, pid: int, argv: list[str], deadline: float) -> None:
    """envd's Connect-Timeout-Ms: the process is killed when the call's deadline passes."""
    await anyio.sleep(max(0.0, deadline - time.monotonic()))
    proc = AsyncEnv(client, {"id": env_id}).process(pid)
    try:
        info = await proc.info()
        if info.running and info.argv == argv:  # the same process, not a later one with its pid
            await proc.kill()
    except (DaemonError, DaemonUnavailableError, httpx.TransportError):
        pass


def _schedule_kill(view: EnvView, pid: int, argv: list[str], deadline: float | None) -> None:
    """Kill the process at ``deadline`` (unless its end is seen first: :func:`_ended`)."""
    tasks, timers = view.state.tasks, view.state.kill_timers
    if deadline is None or tasks is None:
        return
    if len(timers) >= MAX_KILL_TIMERS:
        log.warning("%d command deadlines pending: process %d in %s runs without one", MAX_KILL_TIMERS, pid,
                    view.env_id)
        return
    key = (view.env_id, pid)
    scope = anyio.CancelScope()
    old = timers.pop(key, None)
    if old is not None:
        old.cancel()
    timers[key] = scope

    async def timer() -> None:
        try:
            with scope:
                await _kill_at(view.client, view.env_id, pid, argv, deadline)
        finally:
            if timers.get(key) is scope:
                del timers[key]

    tasks.start_soon(timer)


def _ended(state: ApiState, env_id: str, pid: int) -> None:
    scope = state.kill_timers.pop((env_id, pid), None)
    if scope is not None:
        scope.cancel()


async def proc_start(view: EnvView, req: StartRequest, deadline: float | None) -> AsyncIterator[dict[str, Any]]:
    proc = req.process
    if proc is None or not proc.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
    pty = None
    if req.pty is not None:
        size = req.pty.size or PtySizeMessage()
        pty = (size.rows or 24, size.cols or 80)
    argv = [proc.cmd, *proc.args]
    if argv[0] == "/bin/bash" and not await _has_bash(view):
        argv[0] = "/bin/sh"  # the SDK runs every command with `/bin/bash -l -c`; small images have only sh
    try:
        handle = await _env(view).spawn(argv, env=dict(proc.envs) or None, cwd=proc.cwd or None, user=view.user,
                                        stdin=pty is not None or bool(req.stdin), pty=pty, tag=req.tag)
    except DaemonError as e:
        raise _process_error(e) from None
    except DaemonUnavailableError:
        raise
    except WeenvError as e:
        raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None
    _schedule_kill(view, handle.pid, argv, deadline)
    async for ev in _events(handle, view.state):
        yield ev


async def proc_connect(view: EnvView, req: SelectRequest, deadline: float | None) -> AsyncIterator[dict[str, Any]]:
    pid = await _pid_of(view, req.process)
    try:
        # as envd, which forgets a process when it ends: NOT_FOUND, not the replay of its kept output
        # the daemon would give (docs/e2b.md); one that ends while we attach still gives its end
        if not (await _env(view).process(pid).info()).running:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found (it has exited)")
        handle = await _env(view).connect(pid)
    except DaemonError as e:
        raise _process_error(e, pid) from None
    async for ev in _events(handle, view.state):
        yield ev


async def proc_list(view: EnvView, req: ListRequest) -> dict[str, Any]:
    out = []
    for p in await _env(view).processes():
        if not p.running:
            continue  # as envd: a finished process is gone
        config: dict[str, Any] = {"cmd": p.argv[0] if p.argv else "", "args": p.argv[1:], "envs": p.env}
        if p.cwd:
            config["cwd"] = p.cwd
        info: dict[str, Any] = {"config": config, "pid": p.pid}
        if p.tag is not None:
            info["tag"] = p.tag
        out.append(info)
    return {"processes": out}


async def _send(view: EnvView, pid: int, data: bytes, close: bool = False) -> None:
    try:
        await _env(view).process(pid).send_stdin(data, close=close)
    except DaemonError as e:
        raise _process_error(e, pid) from None


def _input_bytes(inp: ProcessInput | None) -> bytes:
    if inp is None or (inp.stdin is None and inp.pty is None):
        raise ConnectError(Code.INVALID_ARGUMENT, "input: give stdin or pty bytes")
    return inp.stdin if inp.stdin is not None else inp.pty  # type: ignore[return-value]


async def proc_send_input(view: EnvView, req: SendInputRequest) -> dict[str, Any]:
    pid = await _pid_of(view, req.process)
    await _send(view, pid, _input_bytes(req.input))
    return {}


async def proc_close_stdin(view: EnvView, req: SelectRequest) -> dict[str, Any]:
    pid = await _pid_of(view, req.process)
    await _send(view, pid, b"", close=True)
    return {}


async def proc_send_signal(view: EnvView, req: SendSignalRequest) -> dict[str, Any]:
    pid = await _pid_of(view, req.process)
    sig = _SIGNALS.get(req.signal, req.signal) if isinstance(req.signal, str) else req.signal
    if sig not in (9, 15):
        raise ConnectError(Code.INVALID_ARGUMENT, f"signal: {req.signal!r} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM")
    try:
        await _env(view).process(pid).signal(int(sig))
    except DaemonError as e:
        raise _process_error(e, pid) from None
    return {}


async def proc_update(view: EnvView, req: UpdateRequest) -> dict[str, Any]:
    pid = await _pid_of(view, req.process)
    if req.pty is None or req.pty.size is None:
        return {}
    size = req.pty.size
    if not (1 <= size.rows and 1 <= size.cols):
        raise ConnectError(Code.INVALID_ARGUMENT, f"pty.size: rows {size.rows} and cols {size.cols} must be at least 1")
    try:
        await _env(view).process(pid).resize(size.rows, size.cols)
    except DaemonError as e:
        raise _process_error(e, pid) from None
    return {}


async def proc_stream_input(view: EnvView, request: Request) -> dict[str, Any]:
    """A client stream: a start naming the process, then data, fed to it as they come."""
    reader = EnvelopeReader(MAX_RPC_BODY_BYTES)
    pid: int | None = None
    async for chunk in request.stream():
        for flags, data in reader.feed(chunk):
            if flags & 0x02:
                continue  # the client's end-of-stream
            msg = _decode_message(data, StreamInputRequest)
            if msg.start is not None:
                pid = await _pid_of(view, msg.start.process)
            elif msg.data is not None:
                if pid is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "StreamInput: data before the start naming the process")
                await _send(view, pid, _input_bytes(msg.data.input))
    reader.close()
    if pid is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "StreamInput: no start message naming the process")
    return {}


# -- Connect glue -------------------------------------------------------------------------------

Unary = Callable[[EnvView, Any], Awaitable[dict[str, Any]]]
Stream = Callable[[EnvView, Any, float], AsyncIterator[dict[str, Any]]]
ProcessStream = Callable[[EnvView, Any, "float | None"], AsyncIterator[dict[str, Any]]]

UNARY: dict[str, tuple[type[_Message], Unary]] = {
    "filesystem.Filesystem/Stat": (PathRequest, fs_stat),
    "filesystem.Filesystem/MakeDir": (PathRequest, fs_make_dir),
    "filesystem.Filesystem/Move": (MoveRequest, fs_move),
    "filesystem.Filesystem/ListDir": (ListDirRequest, fs_list_dir),
    "filesystem.Filesystem/Remove": (PathRequest, fs_remove),
    "filesystem.Filesystem/CreateWatcher": (WatchRequest, fs_create_watcher),
    "filesystem.Filesystem/GetWatcherEvents": (WatcherRequest, fs_get_watcher_events),
    "filesystem.Filesystem/RemoveWatcher": (WatcherRequest, fs_remove_watcher),
    "process.Process/List": (ListRequest, proc_list),
    "process.Process/SendInput": (SendInputRequest, proc_send_input),
    "process.Process/SendSignal": (SendSignalRequest, proc_send_signal),
    "process.Process/CloseStdin": (SelectRequest, proc_close_stdin),
    "process.Process/Update": (UpdateRequest, proc_update),
}
STREAMS: dict[str, tuple[type[_Message], Stream]] = {
    "filesystem.Filesystem/WatchDir": (WatchRequest, fs_watch_dir),
}
PROCESS_STREAMS: dict[str, tuple[type[_Message], ProcessStream]] = {
    "process.Process/Start": (StartRequest, proc_start),
    "process.Process/Connect": (SelectRequest, proc_connect),
}
PROCESS_KEEPALIVE = {"event": {"keepalive": {}}}


class EventStream(Response):
    """A server stream whose events come from their own task, with a keepalive message whenever
    none came for ``keepalive_s`` (proxies with an idle timeout would cut a silent command), and the
    end-of-stream message (an error, or the deadline passing) last. A client that goes away cancels
    the producer (its ``finally`` runs)."""

    media_type = STREAM_CONTENT_TYPE

    def __init__(self, events: AsyncIterator[dict[str, Any]], deadline: float | None, keepalive_s: float,
                 keepalive: dict[str, Any]):
        super().__init__(None, 200, media_type=STREAM_CONTENT_TYPE)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self.events, self.deadline, self.keepalive_s = events, deadline, keepalive_s
        self.keepalive = envelope(msgspec.json.encode(keepalive))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        tx, rx = anyio.create_memory_object_stream[bytes](16)

        async def produce() -> None:
            async with tx:
                await _offer(tx, await _drain(self.events, self.deadline, tx))
                tx.close()  # before a checkpoint: the consumer sees the end with the last chunk

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            tg.start_soon(watch_disconnect)
            async with rx:
                more, started = True, False
                while more:
                    chunks: list[bytes] = []
                    with anyio.move_on_after(self.keepalive_s):
                        try:
                            chunks.append(await rx.receive())
                        except anyio.EndOfStream:
                            more = False
                    while more:  # what else is ready goes in the same write
                        try:
                            chunks.append(rx.receive_nowait())
                        except anyio.WouldBlock:
                            break
                        except anyio.EndOfStream:
                            more = False
                    if not started:  # with the first message, not before the spawn: one wakeup of the client less
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                        started = True
                    body = b"".join(chunks) if chunks or not more else self.keepalive
                    await send({"type": "http.response.body", "body": body, "more_body": more})
            tg.cancel_scope.cancel()


async def _offer(tx: Any, msg: bytes) -> None:
    """Into ``tx`` without a checkpoint while there is room: the events already read (a short
    command's start and end come in one read from the daemon) reach the client in one write."""
    try:
        tx.send_nowait(msg)
    except anyio.WouldBlock:
        await tx.send(msg)


async def _drain(events: AsyncIterator[dict[str, Any]], deadline: float | None, tx: Any) -> bytes:
    """Send every event of ``events`` into ``tx``; answer the end-of-stream message (a process's end
    event kept for it: one write to the client for both, each write to a TCP peer costs ~0.15 ms)."""
    last = b""
    try:
        with anyio.fail_after(None if deadline is None else max(0.0, deadline - time.monotonic())):
            async for ev in _guarded_iter(events):
                if last:
                    await _offer(tx, last)
                    last = b""
                msg = envelope(msgspec.json.encode(ev))
                if "end" in ev.get("event", ()):
                    last = msg  # the last event: _events returns after it
                else:
                    await _offer(tx, msg)
    except ConnectError as e:
        return last + end_stream(e)
    except TimeoutError:
        return last + end_stream(ConnectError(Code.DEADLINE_EXCEEDED,
                                              "the call's deadline (Connect-Timeout-Ms) passed"))
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()  # type: ignore[attr-defined]
    return last + end_stream()


def _rpc_user(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:6].lower() != "basic ":
        return None
    try:
        user = base64.b64decode(auth[6:].strip(), validate=True).decode("utf-8").split(":", 1)[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError(Code.INVALID_ARGUMENT, "Authorization: Basic is not base64 of 'user:'") from None
    return user or None


def _decode_message(data: bytes, cls: type[_Message]) -> Any:
    """The request message as ``cls``; a wrong one is INVALID_ARGUMENT naming the place (``at `$.path```)."""
    try:
        return msgspec.json.decode(data or b"{}", type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ConnectError(Code.INVALID_ARGUMENT, f"request message: {e}") from None


async def _guarded(coro: Awaitable[Any]) -> Any:
    try:
        return await coro
    except (DaemonError, HttpError) as e:
        raise _rpc_error(e) from None
    except (DaemonUnavailableError, httpx.TransportError):
        raise ConnectError(Code.UNAVAILABLE, "the node's weenv daemon does not answer") from None


def _unary_error(e: ConnectError) -> Response:
    return Response(error_body(e.code, e.message), e.http_status, media_type=UNARY_CONTENT_TYPE)


async def rpc(request: Request) -> Response:
    name = f"{request.path_params['service']}/{request.path_params['method']}"
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    view = EnvView(state_of(request), request.scope["weenv.env"], None)
    if name in UNARY:
        if ctype != UNARY_CONTENT_TYPE:
            return Response(b"", 415, headers={"Accept-Post": UNARY_CONTENT_TYPE})
        try:
            view.user = _rpc_user(request)
            body = await _bounded_body(request)
            cls, handler = UNARY[name]
            answer = await _guarded(handler(view, _decode_message(body, cls)))
        except ConnectError as e:
            return _unary_error(e)
        return Response(msgspec.json.encode(answer), 200, media_type=UNARY_CONTENT_TYPE)
    if name == "process.Process/StreamInput":
        if ctype != STREAM_CONTENT_TYPE:
            return Response(b"", 415, headers={"Accept-Post": STREAM_CONTENT_TYPE})
        try:
            view.user = _rpc_user(request)
            await _guarded(proc_stream_input(view, request))
        except FramingError as e:
            return _stream_error_response(ConnectError(Code.INVALID_ARGUMENT, str(e)))
        except ConnectError as e:
            return _stream_error_response(e)
        return Response(envelope(b"{}") + end_stream(), 200, media_type=STREAM_CONTENT_TYPE)
    if name in STREAMS or name in PROCESS_STREAMS:
        if ctype != STREAM_CONTENT_TYPE:
            return Response(b"", 415, headers={"Accept-Post": STREAM_CONTENT_TYPE})
        try:
            view.user = _rpc_user(request)
            reader = EnvelopeReader(MAX_RPC_BODY_BYTES)
            messages = list(reader.feed(await _bounded_body(request)))
            reader.close()
            if len(messages) != 1:
                raise ConnectError(Code.INVALID_ARGUMENT, f"a server stream takes one request message, not "
                                   f"{len(messages)}")
            cls, stream = STREAMS[name] if name in STREAMS else PROCESS_STREAMS[name]  # type: ignore[assignment]
            req = _decode_message(messages[0][1], cls)
            keepalive = float(request.headers.get("keepalive-ping-interval") or KEEPALIVE_S)
        except FramingError as e:
            return _stream_error_response(ConnectError(Code.INVALID_ARGUMENT, str(e)))
        except (ConnectError, ValueError) as e:
            err = e if isinstance(e, ConnectError) else ConnectError(Code.INVALID_ARGUMENT, str(e))
            return _stream_error_response(err)
        timeout_ms = request.headers.get("connect-timeout-ms") or ""
        # Connect: at most 10 ASCII digits (isdigit() alone takes a latin-1 '²'; 400 digits overflow a float)
        deadline = (time.monotonic() + int(timeout_ms) / 1000
                    if timeout_ms.isascii() and timeout_ms.isdigit() and len(timeout_ms) <= 10 else None)
        if name in PROCESS_STREAMS:
            return EventStream(stream(view, req, deadline), deadline, max(1.0, keepalive), PROCESS_KEEPALIVE)
        return StreamingResponse(_stream(stream(view, req, max(1.0, keepalive)), deadline), 200,
                                 media_type=STREAM_CONTENT_TYPE)
    return _unary_error(ConnectError(Code.UNIMPLEMENTED, f"{name}: no such method"))


def _stream_error_response(e: ConnectError) -> Response:
    return Response(end_stream(e), 200, media_type=STREAM_CONTENT_TYPE)


async def _stream(events: AsyncIterator[dict[str, Any]], deadline: float | None) -> AsyncIterator[bytes]:
    try:
        with anyio.fail_after(None if deadline is None else max(0.0, deadline - time.monotonic())):
            async for ev in _guarded_iter(events):
                yield envelope(msgspec.json.encode(ev))
    except ConnectError as e:
        yield end_stream(e)
        return
    except TimeoutError:
        yield end_stream(ConnectError(Code.DEADLINE_EXCEEDED, "the call's deadline (Connect-Timeout-Ms) passed"))
        return
    yield end_stream()


async def _guarded_iter(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    try:
        async for ev in events:
            yield ev
    except (DaemonError, HttpError) as e:
        raise _rpc_error(e) from None
    except (DaemonUnavailableError, httpx.TransportError):
        raise ConnectError(Code.UNAVAILABLE, "the node's weenv daemon does not answer") from None


async def _bounded_body(request: Request) -> bytes:
    try:
        return await read_body(request, MAX_RPC_BODY_BYTES)
    except HttpError as e:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, e.message) from None


# -- REST ---------------------------------------------------------------------------------------


def _rest_user(request: Request) -> str | None:
    return request.query_params.get("username") or None


def _rest_error(e: DaemonError) -> HttpError:
    if e.kind in ("env_not_found", "wrong_state"):
        return HttpError(502, e.kind, f"The sandbox was not found or is not running: {e.detail}")
    if e.kind == "file_not_found":
        return HttpError(404, e.kind, e.detail)
    if e.kind in ("file_error", "bad_request"):
        return HttpError(400, e.kind, e.detail)
    if e.kind == "too_large":
        return HttpError(413, e.kind, e.detail)
    return HttpError(e.status, e.kind, e.detail)


async def health(request: Request) -> Response:
    state, env_id = state_of(request), request.scope["weenv.env"]
    try:
        async with daemon_errors():
            info = (await state.backend.for_env(env_id)._request("GET", f"/v1/envs/{env_id}")).json()
    except HttpError as e:
        if e.status == 404:
            raise HttpError(502, "env_not_found", f"The sandbox {env_id} was not found") from None
        raise
    if info.get("status") != "running":
        raise HttpError(502, "env_not_found", f"The sandbox {env_id} was not found (it is {info.get('status')})")
    return Response(b"", 204)


async def files_get(request: Request) -> Response:
    path = request.query_params.get("path")
    if not path:
        raise HttpError(400, "bad_request", "path is required")
    view = EnvView(state_of(request), request.scope["weenv.env"], _rest_user(request))
    client = view.client
    params = {"path": path, **({"user": view.user} if view.user else {})}
    req = client._http.build_request("GET", f"/v1/envs/{view.env_id}/files", params=params, timeout=None)
    try:
        await client._ensure()
        resp = await client._http.send(req, stream=True)
    except (httpx.TransportError, DaemonUnavailableError):
        raise HttpError(503, "daemon_unavailable", "the node's weenv daemon does not answer") from None
    if resp.status_code >= 400:
        await resp.aread()
        await resp.aclose()
        try:
            err = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = {"kind": "error", "message": resp.text}
        raise _rest_error(DaemonError(resp.status_code, err.get("kind", "error"), err.get("message", "")))
    name = posixpath.basename(path)
    return StreamingResponse(relay(resp), 200, media_type="application/octet-stream",
                             headers={"Content-Disposition": f'attachment; filename="{name}"'})


async def _put(view: EnvView, path: str, content: Any) -> dict[str, Any]:
    params = {"path": path, **({"user": view.user} if view.user else {})}
    try:
        await view.client._request("PUT", f"/v1/envs/{view.env_id}/files", params=params, content=content,
                                   timeout=None)
    except DaemonError as e:
        raise _rest_error(e) from None
    except DaemonUnavailableError:
        raise HttpError(503, "daemon_unavailable", "the node's weenv daemon does not answer") from None
    return {"name": posixpath.basename(path), "type": "file", "path": path}


async def files_post(request: Request) -> Response:
    view = EnvView(state_of(request), request.scope["weenv.env"], _rest_user(request))
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    path = request.query_params.get("path")
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise HttpError(415, "bad_request", "Content-Encoding: weenv serve takes uploads uncompressed (no gzip)")
    if ctype == "multipart/form-data":
        written = []
        async with request.form(max_files=1000, max_fields=1000) as form:
            parts = [v for _, v in form.multi_items() if not isinstance(v, str)]
            if not parts:
                raise HttpError(400, "bad_request", "multipart upload without a file part")
            for part in parts:
                target = path if (path and len(parts) == 1) else part.filename
                if not target:
                    raise HttpError(400, "bad_request", "a file part without a filename (its path) and no ?path=")

                async def chunks(p: Any = part) -> AsyncIterator[bytes]:
                    while chunk := await p.read(1 << 16):
                        yield chunk

                written.append(await _put(view, target, chunks()))
        return Response(msgspec.json.encode(written), 200, media_type="application/json")
    if not path:
        raise HttpError(400, "bad_request", "path is required for an octet-stream upload")
    return Response(msgspec.json.encode([await _put(view, path, request.stream())]), 200,
                    media_type="application/json")


def routes() -> list[Route]:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/files", files_get, methods=["GET"]),
        Route("/files", files_post, methods=["POST"]),
        Route("/{service:str}/{method:str}", rpc, methods=["POST"]),
    ]
