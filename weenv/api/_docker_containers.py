"""Docker's container routes on weenv envs: start, wait, logs, inspect, list, stop, kill, remove
(create is weenv/api/_docker_create.py, the archives weenv/api/_docker_archive.py).

A container is an env plus what Docker says of it. ``create`` starts the env from the image (its
init idles: the files are there for ``put_archive`` at once); ``start`` runs the container's
command (Entrypoint + Cmd, the image's unless the create gave them) as a process handle in the
env, whose output a task of the server keeps as the container's log (per line, with the time
it came, up to :data:`MAX_LOG_BYTES`, the oldest dropped). When that command ends the container
has *exited*: its exit code is kept, the env's other processes are killed (as Docker's do) and
the env stays, with its files, until ``remove`` kills it; ``start`` runs the command again.
The records live in the server (a restart of ``weenv serve`` forgets them; their envs stay, under
``/v1`` and their owner's key).
"""

from __future__ import annotations

import datetime as dt
import re
import shlex
import signal as signals
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .._connection import WeenvError
from ._common import ApiState, HttpError, daemon_errors, key_of, log, state_of
from ._docker import STDERR, STDOUT, frame
from ._store import may_use

MAX_LOG_BYTES = 16 << 20
STOP_TIMEOUT_S = 10
_NAME = re.compile(r"^/?[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")
_ZERO_TIME = "0001-01-01T00:00:00Z"


def docker_time(t: float | None) -> str:
    """RFC 3339 with nanoseconds, as Docker writes times (Go's zero time when there is none)."""
    if not t:
        return _ZERO_TIME
    d = dt.datetime.fromtimestamp(t, dt.timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond:06d}000Z"


def _set(e: anyio.Event) -> anyio.Event:
    e.set()
    return e


@dataclass
class Container:
    id: str
    name: str
    env_id: str
    owner: dict[str, Any]
    image: str
    image_id: str
    argv: list[str]
    config: dict[str, Any]
    host_config: dict[str, Any]
    created_s: float = field(default_factory=time.time)
    status: str = "created"
    exit_code: int = 0
    pid: int = 0
    started_s: float = 0.0
    finished_s: float = 0.0
    logs: list[tuple[int, float, bytes]] = field(default_factory=list)
    log_bytes: int = 0
    logs_dropped: int = 0  # records dropped from the front of ``logs``: a record's position is this + its index
    changed: anyio.Event = field(default_factory=anyio.Event)
    ended: anyio.Event = field(default_factory=anyio.Event)
    execs: list[str] = field(default_factory=list)
    settled: anyio.Event = field(default_factory=lambda: _set(anyio.Event()))  # its last run's ending done
    paused: bool = False  # frozen (weenv's pause): status stays running, as Docker's State.Running
    binds: list[dict[str, str]] = field(default_factory=list)  # the plan's [[mounts]] its Binds/Mounts made

    def mounts_doc(self) -> list[dict[str, Any]]:
        """Docker's ``Mounts`` of inspect and list: each host bind, read-only."""
        return [{"Type": "bind", "Source": m["source"], "Destination": m["target"], "Mode": "ro", "RW": False,
                 "Propagation": "rprivate"} for m in self.binds]

    @property
    def running(self) -> bool:
        return self.status == "running"

    @property
    def tty(self) -> bool:
        return bool(self.config.get("Tty"))

    def append(self, stream: int, data: bytes) -> None:
        """Output of the command, kept per line (a line cut by the stream stays in two records)."""
        now = time.time()
        for line in data.splitlines(keepends=True):
            self.logs.append((stream, now, line))
            self.log_bytes += len(line)
        while self.log_bytes > MAX_LOG_BYTES and self.logs:
            self.log_bytes -= len(self.logs.pop(0)[2])
            self.logs_dropped += 1
        self._wake()

    @property
    def log_end(self) -> int:
        """The position after the last record (positions do not move when old records are dropped)."""
        return self.logs_dropped + len(self.logs)

    def records(self, start: int, end: int | None = None) -> list[tuple[int, float, bytes]]:
        """The records at positions ``start`` up to ``end`` (those still kept)."""
        lo = max(0, start - self.logs_dropped)
        return self.logs[lo:None if end is None else max(lo, end - self.logs_dropped)]

    def finish(self, exit_code: int) -> None:
        self.status, self.exit_code, self.pid, self.finished_s = "exited", exit_code, 0, time.time()
        self.paused = False
        self.ended.set()
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


@dataclass
class DockerState:
    containers: dict[str, Container] = field(default_factory=dict)
    execs: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)  # weenv/api/_docker_images.py's records
    events: Any = None  # weenv/api/_docker_events.py's log
    build_slots: Any = None  # weenv/api/_docker_build.py's limiter, made in the event loop


def docker_state(state: ApiState) -> DockerState:
    if state.docker is None:
        state.docker = DockerState()
    return state.docker  # type: ignore[no-any-return]


def visible(request: Request) -> list[Container]:
    key = key_of(request)
    return [c for c in docker_state(state_of(request)).containers.values() if may_use(key, c.owner)]


def find(request: Request, ref: str) -> Container:
    """The container ``ref`` names (its id, a unique prefix of it, or its name) among the key's own."""
    mine = visible(request)
    for c in mine:
        if c.id == ref or c.name == ref.lstrip("/"):
            return c
    hits = [c for c in mine if c.id.startswith(ref)] if re.fullmatch(r"[0-9a-f]{1,64}", ref) else []
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise HttpError(400, "bad_request", f"multiple IDs found with provided prefix: {ref}")
    raise HttpError(404, "not_found", f"No such container: {ref}")


def _flag(request: Request, name: str, default: bool = False) -> bool:
    v = request.query_params.get(name)
    if v is None or v == "":
        return default
    if v.lower() in ("1", "true", "yes"):
        return True
    if v.lower() in ("0", "false", "no"):
        return False
    raise HttpError(400, "bad_request", f"invalid value for {name}: {v[:50]!r} (expected 1/0 or true/false)")


def _json(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")


# -- start, the main process, wait ----------------------------------------------------------------


def emit(state: ApiState, c: Container, action: str, **extra: str) -> None:
    from ._docker_events import emit as emit_event

    emit_event(state, c, action, **extra)


def _env(state: ApiState, c: Container) -> Any:
    return state.backend.for_env(c.env_id).env(c.env_id)


async def start(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    c = find(request, params["id"])
    if c.running:
        return Response(b"", 304)
    if state.tasks is None:
        raise HttpError(503, "daemon_unavailable", "the server is shutting down")
    with anyio.move_on_after(STOP_TIMEOUT_S):  # the last run's other processes killed first, not the new one
        await c.settled.wait()
    async with daemon_errors():
        proc = await _env(state, c).spawn(c.argv, pty=(24, 80) if c.tty else None, buffer_bytes=1 << 20,
                                          stdin=bool(c.config.get("OpenStdin")), tag=f"docker:{c.id[:12]}")
    c.status, c.pid, c.started_s, c.finished_s, c.exit_code = "running", proc.pid, time.time(), 0.0, 0
    c.ended, c.settled = anyio.Event(), anyio.Event()
    c._wake()  # an attach waiting for the run
    emit(state, c, "start")
    state.tasks.start_soon(_collect, state, c, proc)
    return Response(b"", 204)


async def _collect(state: ApiState, c: Container, proc: Any) -> None:
    """The container's command, to its end: its output kept as the log, then the container exits."""
    code = 255
    try:
        async for ev in proc.events():
            if ev.data_b64:
                c.append(STDERR if ev.stream == "stderr" else STDOUT, ev.data_b64)
        if proc.end is not None:
            code = proc.end.exit_code
    except (WeenvError, OSError) as e:
        removed = c.id not in docker_state(state).containers  # its env was killed under it: no surprise
        (log.info if removed else log.warning)("docker: container %s: its command's stream failed: %s", c.id[:12], e)
    finally:
        with anyio.CancelScope(shield=True):
            c.finish(code)
            emit(state, c, "die", exitCode=str(code))
            if c.id in docker_state(state).containers:  # removed: its env is being killed, nothing to end
                await _kill_the_rest(state, c)
            c.settled.set()
            if c.host_config.get("AutoRemove") and c.id in docker_state(state).containers:
                await _remove(state, c)


async def _kill_the_rest(state: ApiState, c: Container) -> None:
    """The env's other processes end with its main one, as a Docker container's do."""
    try:
        env = _env(state, c)
        for p in await env.processes():
            if p.running:
                await env.process(p.pid).signal(9)
    except (WeenvError, OSError) as e:
        log.info("docker: container %s: ending its other processes: %s", c.id[:12], e)


async def wait(request: Request, params: dict[str, str]) -> Response:
    c = find(request, params["id"])
    condition = request.query_params.get("condition", "not-running")
    if condition not in ("not-running", "next-exit", "removed"):
        raise HttpError(400, "bad_request", f"invalid condition: {condition[:50]!r}")
    if condition == "next-exit" or c.running:
        await c.ended.wait()
    if condition == "removed":
        while c.id in docker_state(state_of(request)).containers:
            await c.changed.wait()
    return _json({"StatusCode": c.exit_code, "Error": None})


# -- logs -----------------------------------------------------------------------------------


def _since(request: Request, name: str) -> float | None:
    v = request.query_params.get(name)
    if not v or v == "0":
        return None
    try:
        return float(v)
    except ValueError:
        raise HttpError(400, "bad_request", f"invalid value for {name}: {v[:50]!r} (unix seconds)") from None


async def logs(request: Request, params: dict[str, str]) -> Response:
    c = find(request, params["id"])
    want = {STDOUT: _flag(request, "stdout"), STDERR: _flag(request, "stderr")}
    if not any(want.values()):
        raise HttpError(400, "bad_request", "Bad parameters: you must choose at least one stream")
    follow, stamps = _flag(request, "follow"), _flag(request, "timestamps")
    since, until = _since(request, "since"), _since(request, "until")
    tail = request.query_params.get("tail", "all")
    if tail != "all" and not tail.isdigit():
        raise HttpError(400, "bad_request", f"invalid value for tail: {tail[:50]!r} (a number or all)")

    def render(rec: tuple[int, float, bytes]) -> bytes | None:
        stream, t, data = rec
        if not want[stream] or (since is not None and t < since) or (until is not None and t > until):
            return None
        if stamps:
            data = docker_time(t).encode() + b" " + data
        return data if c.tty else frame(stream, data)

    async def body() -> AsyncIterator[bytes]:
        seen = len(c.logs)
        last = c.logs[-int(tail):] if tail != "all" and int(tail) > 0 else ([] if tail == "0" else c.logs[:seen])
        for rec in last:  # as dockerd's: the last lines of the log, then the streams asked for among them
            if (out := render(rec)) is not None:
                yield out
        while follow and c.running:
            changed = c.changed
            if len(c.logs) == seen:
                await changed.wait()
            fresh, seen = c.logs[seen:] if len(c.logs) >= seen else c.logs, len(c.logs)
            for rec in fresh:
                if (out := render(rec)) is not None:
                    yield out

    media = "application/vnd.docker.raw-stream" if c.tty else "application/vnd.docker.multiplexed-stream"
    return StreamingResponse(body(), 200, media_type=media)


# -- inspect, list ----------------------------------------------------------------------------


def _state(c: Container) -> dict[str, Any]:
    return {"Status": "paused" if c.paused else c.status, "Running": c.running, "Paused": c.paused,
            "Restarting": False, "OOMKilled": False,
            "Dead": False, "Pid": c.pid, "ExitCode": c.exit_code, "Error": "",
            "StartedAt": docker_time(c.started_s), "FinishedAt": docker_time(c.finished_s)}


def inspect_doc(c: Container) -> dict[str, Any]:
    return {"Id": c.id, "Created": docker_time(c.created_s), "Path": c.argv[0], "Args": c.argv[1:],
            "State": _state(c), "Image": c.image_id, "ResolvConfPath": "", "HostnamePath": "", "HostsPath": "",
            "LogPath": "", "Name": "/" + c.name, "RestartCount": 0, "Driver": "weenv", "Platform": "linux",
            "MountLabel": "", "ProcessLabel": "", "AppArmorProfile": "", "ExecIDs": list(c.execs) or None,
            "HostConfig": c.host_config, "Mounts": c.mounts_doc(), "Config": c.config,
            "NetworkSettings": {"Bridge": "", "Ports": {}, "IPAddress": "", "Networks": {}},
            "GraphDriver": {"Name": "weenv", "Data": {"EnvId": c.env_id}}}


async def inspect(request: Request, params: dict[str, str]) -> Response:
    return _json(inspect_doc(find(request, params["id"])))


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    if s < 1:
        return "Less than a second"
    if s < 60:
        return f"{int(s)} seconds"
    if s < 3600:
        return f"{int(s // 60)} minutes"
    return f"{int(s // 3600)} hours"


def _filters(request: Request) -> dict[str, list[str]]:
    return _filters_doc(request, ("label", "id", "name", "status"))


def _filters_doc(request: Request, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The ``filters`` query parameter (``{"k": ["v", ...]}``, or the older ``{"k": {"v": true}}``)."""
    raw = request.query_params.get("filters")
    if not raw:
        return {}
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise HttpError(400, "bad_request", "invalid filter: filters is not JSON") from None
    if not isinstance(doc, dict):
        raise HttpError(400, "bad_request", "invalid filter: filters is not a JSON object")
    out: dict[str, list[str]] = {}
    for k, v in doc.items():
        if k not in allowed:
            raise HttpError(400, "bad_request", f"invalid filter '{k[:50]}' (weenv filters by "
                            f"{', '.join(allowed[:-1])} and {allowed[-1]})")
        values = list(v) if isinstance(v, (list, dict)) else None  # {"k=v": true}: the older map form
        if values is None or not all(isinstance(x, str) for x in values):
            raise HttpError(400, "bad_request", f"invalid filter '{k[:50]}': expected a list of strings")
        out[k] = values
    return out


def _passes(c: Container, filters: dict[str, list[str]]) -> bool:
    labels = c.config.get("Labels") or {}
    for want in filters.get("label", []):
        k, eq, v = want.partition("=")
        if k not in labels or (eq and labels[k] != v):
            return False
    if "id" in filters and not any(c.id.startswith(x) for x in filters["id"]):
        return False
    if "name" in filters and not any(re.search(x, c.name) for x in filters["name"]):
        return False
    return "status" not in filters or ("paused" if c.paused else c.status) in filters["status"]


async def list_containers(request: Request, params: dict[str, str]) -> Response:
    show_all, filters = _flag(request, "all"), _filters(request)
    limit = request.query_params.get("limit", "")
    out = []
    for c in sorted(visible(request), key=lambda c: -c.created_s):
        if not (show_all or c.running or "status" in filters) or not _passes(c, filters):
            continue
        status = f"Up {_ago(c.started_s)}{' (Paused)' if c.paused else ''}" if c.running else \
            (f"Exited ({c.exit_code}) {_ago(c.finished_s)} ago" if c.finished_s else "Created")
        out.append({"Id": c.id, "Names": ["/" + c.name], "Image": c.image, "ImageID": c.image_id,
                    "Command": shlex.join(c.argv), "Created": int(c.created_s), "Ports": [],
                    "Labels": c.config.get("Labels") or {}, "State": "paused" if c.paused else c.status,
                    "Status": status,
                    "HostConfig": {"NetworkMode": c.host_config["NetworkMode"]},
                    "NetworkSettings": {"Networks": {}}, "Mounts": c.mounts_doc()})
    if limit.lstrip("-").isdigit() and int(limit) > 0:
        out = out[:int(limit)]
    return _json(out)


# -- stop, kill, remove -----------------------------------------------------------------------


def signal_number(text: str) -> int:
    """A signal as Docker takes it: ``9``, ``KILL`` or ``SIGKILL``."""
    if text.isdigit() and 0 < int(text) < 65:
        return int(text)
    name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
    try:
        return int(signals.Signals[name])
    except KeyError:
        raise HttpError(400, "bad_request", f"Invalid signal: {text[:50]}") from None


async def thaw(state: ApiState, c: Container) -> None:
    """A paused container thawed (weenv's resume) before what needs its processes to run."""
    if c.paused:
        async with daemon_errors():
            await _env(state, c).resume()
        c.paused = False


async def _signal(state: ApiState, c: Container, sig: int) -> None:
    await thaw(state, c)
    try:
        async with daemon_errors():
            await _env(state, c).process(c.pid).signal(sig)
    except HttpError as e:
        if e.status != 404:  # it ended meanwhile
            raise


async def stop(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    c = find(request, params["id"])
    if not c.running:
        return Response(b"", 304)
    t = request.query_params.get("t")
    timeout = int(t) if t and t.lstrip("-").isdigit() else int(c.config.get("StopTimeout", STOP_TIMEOUT_S))
    await _signal(state, c, signal_number(request.query_params.get("signal") or c.config["StopSignal"]))
    with anyio.move_on_after(max(timeout, 0)):
        await c.ended.wait()
    if c.running:
        await _signal(state, c, 9)
        with anyio.move_on_after(STOP_TIMEOUT_S):
            await c.ended.wait()
    return Response(b"", 204)


async def kill(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    c = find(request, params["id"])
    sig = signal_number(request.query_params.get("signal") or "SIGKILL")
    if not c.running:
        raise HttpError(409, "conflict", f"Cannot kill container: {params['id']}: Container {c.id} is not running")
    await _signal(state, c, sig)
    if sig == signals.SIGKILL:  # as dockerd: a SIGKILL answers once the container is gone (remove may follow)
        with anyio.move_on_after(STOP_TIMEOUT_S):
            await c.ended.wait()
    return Response(b"", 204)


async def _remove(state: ApiState, c: Container) -> None:
    ds = docker_state(state)
    ds.containers.pop(c.id, None)
    for exec_id in c.execs:
        ds.execs.pop(exec_id, None)
    try:
        async with daemon_errors():
            await state.backend.kill(c.env_id)
    except HttpError as e:
        if e.status not in (404, 410):  # its env is gone already (killed under /v1, a lost node)
            raise
    state.envs_gone([c.env_id])
    emit(state, c, "destroy")
    c.ended.set()
    c._wake()


async def remove(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    c = find(request, params["id"])
    if c.running and not _flag(request, "force"):
        raise HttpError(409, "conflict", f"You cannot remove a running container {c.id}. Stop the container before "
                        "attempting removal or force remove")
    await _remove(state, c)
    return Response(b"", 204)


ROUTES = [
    ("GET", "containers/json", list_containers),
    ("GET", "containers/{id}/json", inspect),
    ("POST", "containers/{id}/start", start),
    ("POST", "containers/{id}/wait", wait),
    ("GET", "containers/{id}/logs", logs),
    ("POST", "containers/{id}/stop", stop),
    ("POST", "containers/{id}/kill", kill),
    ("DELETE", "containers/{id}", remove),
]
