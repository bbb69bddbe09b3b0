"""Docker's exec routes: create, start (detached, or the hijacked stream docker-py's ``exec_run``
reads and writes), inspect, resize.

An exec instance is a command to run in a running container; ``start`` runs it as a process
handle in the container's env. Not detached, the answer to a request offering ``Upgrade: tcp``
is ``101 UPGRADED`` and then the connection is the command's (weenv/api/_hijack.py): its output
on it, Docker's multiplexed frames (weenv/api/_docker.py :func:`frame`) or the raw bytes with a
TTY; with ``AttachStdin`` what the client writes is the command's stdin (the process handle's
``send_stdin``, the same the E2B and ``/v1`` process APIs use) and its end of writing, or its going
away, closes that stdin (on a TTY: ^D, as the pty handles of those APIs do). The connection closes
when the command ends, its exit code recorded first (``exec_run`` inspects it next). Without the
upgrade (a plain streaming 200) the command's stdin is closed at once: there is no connection to
read it from. A client that goes away leaves the command running, as Docker's does. ``resize``
sets the size of a TTY command's pty (the handle's ``resize``, as E2B's ``Update``).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .._connection import WeenvError
from ._common import HttpError, daemon_errors, key_of, log, read_body, state_of
from ._docker import STDERR, STDOUT, frame, not_supported
from ._docker_containers import Container, _env, docker_state, find
from ._hijack import HijackedResponse
from ._store import may_use

MAX_BODY_BYTES = 1 << 20
EXEC_READY_TIMEOUT_S = 10.0
"""How long ``resize`` waits for an exec being started to have its process (dockerd's 10 s)."""
MAX_TTY_SIDE = 65535


@dataclass
class Exec:
    id: str
    container: Container
    argv: list[str]
    env: dict[str, str]
    workdir: str
    user: str
    tty: bool
    stdout: bool
    stderr: bool
    stdin: bool = False
    running: bool = False
    started: bool = False
    exit_code: int | None = None
    pid: int = 0
    ended: anyio.Event = field(default_factory=anyio.Event)
    spawned: anyio.Event = field(default_factory=anyio.Event)  # set once its start has a process, or failed


class ExecBody(msgspec.Struct):
    Cmd: list[str] | None = None
    Env: list[str] | None = None
    WorkingDir: str = ""
    User: str = ""
    Tty: bool = False
    AttachStdin: bool = False
    AttachStdout: bool = True
    AttachStderr: bool = True
    Privileged: bool = False


class StartBody(msgspec.Struct):
    Detach: bool = False
    Tty: bool | None = None


async def _body(request: Request, cls: type) -> Any:
    try:
        return msgspec.json.decode(await read_body(request, MAX_BODY_BYTES) or b"{}", type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"request body: {e}") from None


def _not_running(c: Container) -> HttpError:
    return HttpError(409, "conflict", f"Container {c.id} is not running")


def find_exec(request: Request, exec_id: str) -> Exec:
    x = docker_state(state_of(request)).execs.get(exec_id)
    if x is None or not may_use(key_of(request), x.container.owner):
        raise HttpError(404, "not_found", f"No such exec instance: {exec_id}")
    return x  # type: ignore[no-any-return]


async def exec_create(request: Request, params: dict[str, str]) -> Response:
    c = find(request, params["id"])
    body = await _body(request, ExecBody)
    if not body.Cmd:
        raise HttpError(400, "bad_request", "No exec command specified")
    if body.Privileged:
        raise not_supported("Privileged exec")
    if not c.running:
        raise _not_running(c)
    if c.paused:
        raise HttpError(409, "conflict", f"Container {c.id} is paused, unpause the container before exec")
    x = Exec(secrets.token_hex(32), c, list(body.Cmd), dict(e.split("=", 1) for e in body.Env or [] if "=" in e),
             body.WorkingDir, body.User, body.Tty, body.AttachStdout, body.AttachStderr, body.AttachStdin)
    docker_state(state_of(request)).execs[x.id] = x
    c.execs.append(x.id)
    return Response(msgspec.json.encode({"Id": x.id}), 201, media_type="application/json")


async def _spawn(request: Request, x: Exec, *, stdin: bool = False) -> Any:
    try:
        async with daemon_errors():
            proc = await _env(state_of(request), x.container).spawn(
                x.argv, env=x.env or None, cwd=x.workdir or None, user=x.user or None, stdin=stdin,
                pty=(24, 80) if x.tty else None)
        x.running, x.pid = True, proc.pid
        return proc
    finally:
        x.spawned.set()


def _finish(x: Exec, code: int) -> None:
    x.running, x.exit_code = False, code
    x.ended.set()


async def _drain(x: Exec, proc: Any) -> None:
    """A command nobody reads (detached, or its client went away or ended the exchange), to its end:
    the stream that was read is let go (a cancelled read leaves it unusable) and the end asked of
    the daemon, which keeps the command's output in its bounded buffer meanwhile."""
    code = 255
    try:
        with anyio.CancelScope(shield=True):
            await proc.detach()
        end = await proc.wait()
        code = end.exit_code if end is not None else 255
    except (WeenvError, OSError) as e:
        log.info("docker: exec %s: %s", x.id[:12], e)
    finally:
        _finish(x, code)


def _upgrade_offered(request: Request) -> bool:
    connection = {t.strip().lower() for t in request.headers.get("connection", "").split(",")}
    return "upgrade" in connection and request.headers.get("upgrade", "").lower() == "tcp" and \
        request.scope.get("http_version") == "1.1"


async def exec_start(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    x = find_exec(request, params["id"])
    body = await _body(request, StartBody)
    if x.started:
        raise HttpError(409, "conflict", f"Exec {x.id} has already been started")
    if not x.container.running:
        raise _not_running(x.container)
    if state.tasks is None:
        raise HttpError(503, "daemon_unavailable", "the server is shutting down")
    x.started = True
    if body.Detach:
        proc = await _spawn(request, x)
        state.tasks.start_soon(_drain, x, proc)
        return Response(b"", 200)
    tty = x.tty if body.Tty is None else body.Tty
    upgraded = _upgrade_offered(request)
    spawned: list[Any] = []

    async def output() -> AsyncIterator[bytes]:
        try:
            proc = await _spawn(request, x, stdin=x.stdin)
        except HttpError as e:
            _finish(x, 126)
            yield (e.message + "\n").encode() if tty else frame(STDERR, (e.message + "\n").encode())
            return
        spawned.append(proc)
        ended = False
        try:
            if x.stdin and not upgraded:
                await proc.close_stdin()  # no hijacked connection: nothing to read its stdin from
            async for ev in proc.events():
                if not ev.data_b64:
                    continue
                stream = STDERR if ev.stream == "stderr" else STDOUT
                if not (x.stderr if stream == STDERR else x.stdout):
                    continue
                yield ev.data_b64 if tty else frame(stream, ev.data_b64)
            ended = True
            _finish(x, proc.end.exit_code if proc.end is not None else 255)
        except WeenvError as e:  # the env's agent cuts off a reader too far behind: the exchange ends here
            log.info("docker: exec %s: its output stream ended early: %s", x.id[:12], e)
        finally:
            if not ended and state.tasks is not None:  # the client went away: the command runs on
                state.tasks.start_soon(_drain, x, proc)

    async def to_stdin(data: bytes | None) -> None:
        """The client's input, to the command's stdin in order; None: its end (closes the stdin)."""
        await x.spawned.wait()
        if not spawned:
            return  # it could not start: the input has nowhere to go
        if data is None:
            await spawned[0].close_stdin()
        else:
            await spawned[0].send_stdin(data)

    media = "application/vnd.docker.raw-stream" if tty else "application/vnd.docker.multiplexed-stream"
    on_input = to_stdin if x.stdin and upgraded else None
    if upgraded:
        # as dockerd: the end of a TTY command's input ends the exchange (its stdin stays open; ^D
        # is how a terminal ends its input), the end of any other's closes its stdin
        return HijackedResponse(output(), on_input=on_input, input_end_stops=x.tty, status_code=101,
                                media_type=media, headers={"Connection": "Upgrade", "Upgrade": "tcp"})
    return HijackedResponse(output(), status_code=200, media_type=media)


def tty_size(request: Request) -> tuple[int, int]:
    """``(rows, cols)`` from a resize's ``h`` and ``w``: whole numbers, 400 otherwise (as dockerd)."""
    out = []
    for name in ("h", "w"):
        text = request.query_params.get(name, "")
        if not text.isascii() or not text.isdigit():
            raise HttpError(400, "bad_request", f"invalid value for {name}: {text[:50]!r} (a whole number of "
                            f"{'rows' if name == 'h' else 'columns'})")
        if int(text) > MAX_TTY_SIDE:
            raise HttpError(400, "bad_request", f"invalid value for {name}: {text[:50]} (at most {MAX_TTY_SIDE})")
        out.append(int(text))
    return out[0], out[1]


async def exec_resize(request: Request, params: dict[str, str]) -> Response:
    x = find_exec(request, params["id"])
    rows, cols = tty_size(request)
    with anyio.move_on_after(EXEC_READY_TIMEOUT_S):
        await x.spawned.wait()
    if not x.spawned.is_set():
        raise HttpError(500, "internal", "timeout waiting for exec session ready")
    if not x.running:
        raise HttpError(409, "conflict", f"cannot resize exec {x.id}: its command has exited")
    if x.container.paused:
        raise HttpError(409, "conflict", f"Container {x.container.id} is paused, unpause the container before "
                        "resizing")
    if not x.tty or rows == 0 or cols == 0:
        return Response(b"", 200)  # as dockerd: no pty to size is no error
    async with daemon_errors():
        await _env(state_of(request), x.container).process(x.pid).resize(rows, cols)
    return Response(b"", 200)


async def exec_inspect(request: Request, params: dict[str, str]) -> Response:
    x = find_exec(request, params["id"])
    doc = {"ID": x.id, "Running": x.running, "ExitCode": x.exit_code, "ProcessConfig": {
        "tty": x.tty, "entrypoint": x.argv[0], "arguments": x.argv[1:], "privileged": False, "user": x.user},
        "OpenStdin": x.stdin, "OpenStderr": x.stderr, "OpenStdout": x.stdout, "CanRemove": False,
        "ContainerID": x.container.id, "DetachKeys": "", "Pid": x.pid}
    return Response(msgspec.json.encode(doc), 200, media_type="application/json")


ROUTES = [
    ("POST", "containers/{id}/exec", exec_create),
    ("POST", "exec/{id}/start", exec_start),
    ("GET", "exec/{id}/json", exec_inspect),
    ("POST", "exec/{id}/resize", exec_resize),
]
