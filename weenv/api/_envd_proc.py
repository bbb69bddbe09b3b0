"""envd's ``process.Process`` service on the daemon's process handles: Start and Connect
(server streams), List, SendInput, StreamInput, CloseStdin, SendSignal, Update; a call's
Connect deadline kills its process (a timer in the server's task group)."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
import httpx
import msgspec
from starlette.requests import Request

from .._aclient import AsyncClient, AsyncEnv, AsyncProcess
from .._connection import ApiError as DaemonError
from .._connection import DaemonUnavailableError, WeenvError
from .._wire import ProcessEnd
from ._common import ApiState, HttpError, log
from ._connect import (
    Code,
    ConnectError,
    EnvelopeReader,
)
from ._envd_fs import _has_bash
from ._envd_view import MAX_RPC_BODY_BYTES, EnvView, _decode_message, _Message, _rpc_error

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
    return view.env


def _process_error(e: DaemonError, pid: int | None = None) -> ConnectError:
    if e.kind == "process_not_found":
        return ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found" if pid is not None else e.detail)
    if e.kind == "process_exited":
        return ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found (it has exited)")
    if e.kind == "process_state":
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
        if not await _env_runs(proc.env):
            # as E2B's proxy: the SDK reads "was not found" as the sandbox killed (or timed out) mid-command
            raise ConnectError(Code.UNAVAILABLE, f"The sandbox {proc.env.id} was not found: it was killed or "
                               "stopped while the command ran") from None
        raise _process_error(e, proc.pid) from None
    finally:
        with anyio.CancelScope(shield=True):
            await proc.detach()


async def _env_runs(env: AsyncEnv) -> bool:
    """Whether the env still runs (a process stream that failed: was it killed under the stream?)."""
    try:
        with anyio.fail_after(10):
            return (await env.refresh()).status == "running"
    except DaemonError as e:
        return e.kind != "env_not_found"
    except (TimeoutError, DaemonUnavailableError):
        return True  # unknown: the error as it was


async def _kill_at(client: AsyncClient, env_id: str, pid: int, argv: list[str], deadline: float) -> None:
    """envd's Connect-Timeout-Ms: the process is killed when the call's deadline passes."""
    await anyio.sleep(max(0.0, deadline - time.monotonic()))
    proc = client.env(env_id).process(pid)
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
    ended = await _admit_process(view)
    try:
        async for ev in _start(view, req, argv, pty, deadline):
            yield ev
    finally:
        ended()


async def _admit_process(view: EnvView) -> Any:
    """One more running process for the env's key (its processes quota), or RESOURCE_EXHAUSTED."""
    from ._tenant import count_running

    owner = view.owner()
    if owner is None:
        return lambda: None
    try:
        return await view.state.quotas.start_process(owner, lambda: count_running(view.state, owner))
    except HttpError as e:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, e.message) from None


async def _start(view: EnvView, req: StartRequest, argv: list[str], pty: tuple[int, int] | None,
                 deadline: float | None) -> AsyncIterator[dict[str, Any]]:
    proc = req.process
    assert proc is not None
    try:
        cwd = await view.path(proc.cwd, "process.cwd") if proc.cwd else None  # relative: the user's home's
        handle = await _env(view).spawn(argv, env=dict(proc.envs) or None, cwd=cwd, user=view.user,
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
