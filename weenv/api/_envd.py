"""E2B's data plane (what ``envd`` serves inside an E2B sandbox), on top of the daemon's files and
processes: the Connect dispatch (JSON codec; unary and server-stream calls) and the routes.

- filesystem.Filesystem/*: weenv/api/_envd_fs.py; process.Process/*: weenv/api/_envd_proc.py;
- REST ``/health`` and ``/files``: weenv/api/_envd_rest.py;
- the env a request is for, and what they share: weenv/api/_envd_view.py.

The Gate has already checked the env's access token and put the env id into the scope.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .._connection import ApiError as DaemonError
from .._connection import DaemonUnavailableError
from ._common import HttpError, read_body, state_of
from ._connect import (
    STREAM_CONTENT_TYPE,
    UNARY_CONTENT_TYPE,
    Code,
    ConnectError,
    EnvelopeReader,
    FramingError,
    end_stream,
    envelope,
    error_body,
)
from ._envd_fs import (
    ListDirRequest,
    MoveRequest,
    PathRequest,
    WatcherRequest,
    WatchRequest,
    fs_create_watcher,
    fs_get_watcher_events,
    fs_list_dir,
    fs_make_dir,
    fs_move,
    fs_remove,
    fs_remove_watcher,
    fs_stat,
    fs_watch_dir,
)
from ._envd_proc import (
    ListRequest,
    SelectRequest,
    SendInputRequest,
    SendSignalRequest,
    StartRequest,
    UpdateRequest,
    proc_close_stdin,
    proc_connect,
    proc_list,
    proc_send_input,
    proc_send_signal,
    proc_start,
    proc_stream_input,
    proc_update,
)
from ._envd_rest import files_get, files_post, health
from ._envd_view import KEEPALIVE_S, MAX_RPC_BODY_BYTES, EnvView, _decode_message, _Message, _rpc_error

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



def routes() -> list[Route]:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/files", files_get, methods=["GET"]),
        Route("/files", files_post, methods=["POST"]),
        Route("/{service:str}/{method:str}", rpc, methods=["POST"]),
    ]
