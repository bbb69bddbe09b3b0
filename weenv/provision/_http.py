"""A small HTTP/1.1 server on a Unix socket (h11 over trio streams) and a regex router.

Enough HTTP for the daemon's API: keep-alive, request bodies with Content-Length, JSON answers,
and streamed (chunked) answers for exec output.
"""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from .._unixsock import bind_unix
log = logging.getLogger("weenv.daemon")
MAX_BODY_BYTES = 256 << 20
_READ = 65536


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    params: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        if not self.body:
            return {}
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise HTTPError(400, "bad_request", f"request body is not JSON: {e}") from None


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


@dataclass
class StreamResponse:
    """A chunked answer; ``chunks`` yields the body piece by piece (NDJSON for exec)."""

    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "application/x-ndjson"


class HTTPError(Exception):
    """Raised by handlers to answer with an error: ``{"error": {"kind", "message"}}``."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def json_response(data: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(data).encode())


def error_response(status: int, kind: str, message: str) -> Response:
    return json_response({"error": {"kind": kind, "message": message}}, status)


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]


class Router:
    def __init__(self) -> None:
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = []

    def route(self, method: str, pattern: str) -> Callable[[Handler], Handler]:
        rx = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern) + "$")

        def deco(fn: Handler) -> Handler:
            self._routes.append((method, rx, fn))
            return fn

        return deco

    async def dispatch(self, req: Request) -> Response | StreamResponse:
        allowed = False
        for method, rx, fn in self._routes:
            m = rx.match(req.path)
            if m is None:
                continue
            if method != req.method:
                allowed = True
                continue
            req.params = {k: urllib.parse.unquote(v) for k, v in m.groupdict().items()}
            return await fn(req)
        if allowed:
            return error_response(405, "method_not_allowed", f"{req.method} is not allowed on {req.path}")
        return error_response(404, "no_route", f"no API route {req.method} {req.path}")


class Server:
    def __init__(self, handler: Callable[[Request], Awaitable[Response | StreamResponse]]):
        self.handler = handler

    async def _next_event(self, conn: h11.Connection, stream: trio.SocketStream) -> Any:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(_READ)
                conn.receive_data(data)
                continue
            return event

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, event: Any) -> None:
        data = conn.send(event)
        if data:
            await stream.send_all(data)

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 << 10)
        async with stream:
            try:
                while True:
                    event = await self._next_event(conn, stream)
                    if isinstance(event, (h11.ConnectionClosed,)) or event is h11.PAUSED:
                        return
                    if not isinstance(event, h11.Request):
                        return
                    body = bytearray()
                    too_big = False
                    while True:
                        ev = await self._next_event(conn, stream)
                        if isinstance(ev, h11.Data):
                            if len(body) + len(ev.data) > MAX_BODY_BYTES:
                                too_big = True
                            else:
                                body += ev.data
                        elif isinstance(ev, h11.EndOfMessage):
                            break
                        else:
                            return
                    target = event.target.decode("latin-1")
                    path, _, qs = target.partition("?")
                    req = Request(event.method.decode(), urllib.parse.unquote(path),
                                  dict(urllib.parse.parse_qsl(qs, keep_blank_values=True)),
                                  {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}, bytes(body))
                    if too_big:
                        resp: Response | StreamResponse = error_response(413, "too_large",
                                                                         f"request body above {MAX_BODY_BYTES} bytes")
                    else:
                        resp = await self._handle(req)
                    await self._respond(conn, stream, resp)
                    if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                        return
                    conn.start_next_cycle()
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
                return

    async def _handle(self, req: Request) -> Response | StreamResponse:
        try:
            return await self.handler(req)
        except HTTPError as e:
            return error_response(e.status, e.kind, e.message)
        except Exception as e:  # one bad request must not take the daemon down
            log.exception("%s %s failed", req.method, req.path)
            return error_response(500, "internal", f"{type(e).__name__}: {e}")

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, resp: Response | StreamResponse) -> None:
        if isinstance(resp, Response):
            headers = [("content-type", resp.content_type), ("content-length", str(len(resp.body)))]
            await self._send(conn, stream, h11.Response(status_code=resp.status, headers=headers))
            if resp.body:
                await self._send(conn, stream, h11.Data(data=resp.body))
            await self._send(conn, stream, h11.EndOfMessage())
            return
        headers = [("content-type", resp.content_type), ("transfer-encoding", "chunked")]
        await self._send(conn, stream, h11.Response(status_code=resp.status, headers=headers))
        try:
            async for chunk in resp.chunks:
                if chunk:
                    await self._send(conn, stream, h11.Data(data=chunk))
        finally:
            aclose = getattr(resp.chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        await self._send(conn, stream, h11.EndOfMessage())

    async def serve_unix(self, path: str, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        # The socket is 0600 (the API is root's) from the start, without touching the process-wide
        # umask (weenv/_unixsock.py).
        sock = trio.socket.from_stdlib_socket(
            await trio.to_thread.run_sync(lambda: bind_unix(path, 0o600, backlog=512)))
        task_status.started()
        await trio.serve_listeners(self.serve_connection, [trio.SocketListener(sock)])
