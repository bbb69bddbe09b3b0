"""Docker's ``POST /containers/{id}/attach`` and ``/containers/{id}/resize`` on a container's command.

A container's command is a process handle in its env (weenv/api/_docker_containers.py ``start``)
whose output a task keeps as the container's log. An attach reads that: with ``logs`` the log so
far, then with ``stream`` the output of the command's run as it comes, to its end (a container
not running is waited for: its next run is the one followed, as dockerd's attach before
``start``). Multiplexed frames, raw bytes with a TTY; on the hijacked connection of
weenv/api/_hijack.py when the client offers the upgrade.

With ``stdin`` on a container created with ``OpenStdin`` (its command then starts with an open
stdin), what the client writes is the command's stdin (the handle's ``send_stdin``, as for an
exec). The end of the client's input closes that stdin when the container has ``StdinOnce`` and
no TTY; otherwise it ends the attach and the stdin stays open for the next one, as dockerd does.
Without ``OpenStdin`` the input is dropped. ``resize`` sets the size of a TTY command's pty.
Detach keys (``detachKeys``, ctrl-p ctrl-q) are not read: those bytes are input like any other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from ._common import ApiState, HttpError, daemon_errors, state_of
from ._docker import STDERR, STDOUT, frame
from ._docker_containers import Container, _env, _flag, emit, find
from ._docker_exec import _upgrade_offered, tty_size
from ._hijack import FIRST_OUTPUT_AFTER_S, HijackedResponse

LOGS_AFTER_S = 0.05
"""An attach's log comes at once after the 101, which a loaded client may still be reading: a
longer wait than an exec's first output (weenv/api/_hijack.py) before it."""


def _refuse_paused(c: Container, what: str) -> None:
    if c.paused:
        raise HttpError(409, "conflict", f"container {c.id} is paused, unpause the container before {what}")


async def attach(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    c = find(request, params["id"])
    logs, stream, use_stdin = _flag(request, "logs"), _flag(request, "stream"), _flag(request, "stdin")
    want = {STDOUT: _flag(request, "stdout"), STDERR: _flag(request, "stderr")}
    _refuse_paused(c, "attach")
    await request.body()  # the request is all read before the 101 (h11 switches only then)
    tty, mark = c.tty, c.log_end

    def render(rec: tuple[int, float, bytes]) -> bytes:
        return rec[2] if tty else frame(rec[0], rec[2])

    async def output() -> AsyncIterator[bytes]:
        if logs:
            for rec in c.records(0, mark):
                if want[rec[0]]:
                    yield render(rec)
        if not stream or not (use_stdin or any(want.values())):
            return
        while not c.running:  # created or exited: its next run
            await c.changed.wait()
        ended, pos = c.ended, mark  # a run that starts after the attach logs nothing before it starts
        while True:
            changed, fresh = c.changed, c.records(pos)
            pos += len(fresh)
            for rec in fresh:
                if want[rec[0]]:
                    yield render(rec)
            if ended.is_set() and pos >= c.log_end:
                return  # the run is over and all its output was given (it is logged before the end)
            if not fresh:
                await changed.wait()

    async def to_stdin(data: bytes | None) -> None:
        while not c.running:  # input written before the start is the next run's
            await c.changed.wait()
        proc = _env(state, c).process(c.pid)
        async with daemon_errors():
            if data is None:
                await proc.close_stdin()
            else:
                await proc.send_stdin(data)

    feeds = use_stdin and bool(c.config.get("OpenStdin"))
    media = "application/vnd.docker.raw-stream" if tty else "application/vnd.docker.multiplexed-stream"
    closes_stdin = bool(c.config.get("StdinOnce")) and not tty
    if _upgrade_offered(request):
        return HijackedResponse(output(), on_input=to_stdin if feeds else None, input_end_stops=not closes_stdin,
                                status_code=101, media_type=media, headers={"Connection": "Upgrade", "Upgrade": "tcp"},
                                first_output_after_s=LOGS_AFTER_S if logs else FIRST_OUTPUT_AFTER_S)
    return HijackedResponse(output(), status_code=200, media_type=media)


async def resize(request: Request, params: dict[str, str]) -> Response:
    state: ApiState = state_of(request)
    c = find(request, params["id"])
    rows, cols = tty_size(request)
    if not c.running:
        raise HttpError(409, "conflict", f"Container {c.id} is not running")
    _refuse_paused(c, "resizing it")  # weenv's pause freezes the env's agent too, which holds the pty
    if c.tty and rows and cols:
        async with daemon_errors():
            await _env(state, c).process(c.pid).resize(rows, cols)
    emit(state, c, "resize", height=str(rows), width=str(cols))
    return Response(b"", 200)


ROUTES = [
    ("POST", "containers/{id}/attach", attach),
    ("POST", "containers/{id}/resize", resize),
]
