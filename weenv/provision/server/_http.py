"""A small HTTP/1.1 server on a Unix socket (h11 over trio streams) and a regex router.

Enough HTTP for the daemon's API: keep-alive, JSON bodies decoded into typed Structs
(:mod:`weenv._wire`), streamed request bodies for file uploads, streamed (chunked) answers for
exec output.

Bodies are bounded before they are read: a route takes at most ``max_body_bytes`` (a JSON body
:data:`~weenv._wire.MAX_JSON_BODY_BYTES`), a larger ``Content-Length`` gets a 413 at once and the
connection is closed without reading the body. A route with ``stream_body`` reads its body itself,
piece by piece (:meth:`Request.receive_chunk`), so an upload goes to disk as it arrives.

While a handler runs (and while a streamed answer is sent) the server watches the connection:
when the client goes away the handler is cancelled, so an exec whose caller hung up is killed
instead of running on to its timeout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import h11
import msgspec
import trio

from ..._routes import PathError, RouteSpec, split_path
from ..._unixsock import bind_unix
from ..._wire import MAX_JSON_BODY_BYTES, ErrorBody, ErrorInfo, HttpError, NoQuery, decode, encode

log = logging.getLogger("weenv.daemon")
_READ = 65536
_MAX_MESSAGE_CHARS = 1000  # error messages quote input: never echo a large body back
_MAX_PIPELINED_BYTES = 1 << 20  # what the disconnect watcher buffers of a next request
_DRAIN_S = 2.0  # after an early answer (413), how long and how much of the rest of a body is read
_DRAIN_BYTES = 16 << 20
T = TypeVar("T")


HTTPError = HttpError
"""Raised by handlers to answer with an error: ``{"error": {"kind", "message"}}`` (weenv._wire.HttpError)."""


def _bad(where: str, e: BaseException, body: bytes = b"") -> HTTPError:
    if isinstance(e, RecursionError):
        return HTTPError(400, "bad_request", f"{where}: nested too deeply")
    if isinstance(e, msgspec.DecodeError):
        found = _locate_non_json(body)
        if found is not None:
            return HTTPError(400, "bad_request", f"{where}: {found[1]} - at `{found[0]}`")
    return HTTPError(400, "bad_request", f"{where}: {e}")


def _locate_non_json(body: bytes) -> tuple[str, str] | None:
    """Where a body that msgspec refuses holds what Python's lax parser lets through (NaN,
    Infinity, lone UTF-16 surrogates): msgspec only says which byte, this says which field."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None

    def walk(value: Any, path: str) -> tuple[str, str] | None:
        if isinstance(value, float) and not math.isfinite(value):
            return path, f"{value} is not a JSON number (numbers must be finite)"
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return path, f"lone UTF-16 surrogate {value[e.start]!r} at character {e.start} is not text"
        if isinstance(value, list):
            for i, item in enumerate(value):
                if (hit := walk(item, f"{path}[{i}]")) is not None:
                    return hit
        if isinstance(value, dict):
            for k, item in value.items():
                if (hit := walk(k, path)) is not None:
                    return hit[0], f"a key: {hit[1]}"
                if (hit := walk(item, f"{path}.{k}" if k.isidentifier() else f"{path}[{k!r}]")) is not None:
                    return hit
        return None

    try:
        return walk(doc, "$")
    except RecursionError:
        return None


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes = b""
    params: dict[str, str] = field(default_factory=dict)
    q: Any = None
    """The query parameters decoded as the route's ``query`` Struct (set before the handler runs)."""
    _reader: "_BodyReader | None" = None

    def decode(self, cls: type[T]) -> T:
        """The JSON body as ``cls`` (an empty body is ``{}``); a 400 naming the place otherwise."""
        try:
            return decode(self.body or b"{}", cls)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            raise _bad("request body", e, self.body) from None

    def query_as(self, cls: type[T]) -> T:
        """The query parameters as ``cls`` (a 400 naming the parameter otherwise)."""
        try:
            return msgspec.convert(self.query, cls)
        except msgspec.ValidationError as e:
            raise _bad("query string", e) from None

    async def receive_chunk(self, max_bytes: int = 1 << 20) -> bytes:
        """The next piece of a streamed body (``stream_body`` routes), at most about ``max_bytes``;
        ``b""`` at its end. Raises HTTPError 413 past the route's limit, 400 if the client breaks off."""
        if self._reader is None:
            raise RuntimeError("receive_chunk is for routes with stream_body=True")
        return await self._reader.receive(max_bytes)


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


Send = Callable[[bytes], Awaitable[None]]


@dataclass
class StreamResponse:
    """A chunked answer: ``produce(send)`` sends the body piece by piece (NDJSON for exec).

    ``produce`` runs in the connection's task: it is cancelled when the client goes away, and
    ``send`` raises trio.BrokenResourceError when the client can no longer be written to."""

    produce: Callable[[Send], Awaitable[None]]
    status: int = 200
    content_type: str = "application/x-ndjson"


def json_response(data: Any, status: int = 200) -> Response:
    """``data``: builtins or :mod:`weenv._wire` Structs."""
    return Response(status, encode(data))


def _clip(message: str) -> str:
    if len(message) <= _MAX_MESSAGE_CHARS:
        return message
    return f"{message[:_MAX_MESSAGE_CHARS]}... ({len(message) - _MAX_MESSAGE_CHARS} more characters)"


def error_info(status: int, kind: str, message: str, *, in_stream: bool = False) -> ErrorInfo:
    return ErrorInfo(kind=kind, message=_clip(message), status=status if in_stream else None)


def error_response(status: int, kind: str, message: str) -> Response:
    return json_response(ErrorBody(error=error_info(status, kind, message)), status)


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]


@dataclass(frozen=True)
class Route:
    spec: RouteSpec
    handler: Handler
    max_body_bytes: int = MAX_JSON_BODY_BYTES
    stream_body: bool = False
    query: type = NoQuery


class Router:
    """Routes as data: each a :class:`weenv._routes.RouteSpec`, a handler and its body and query
    options. ``errors`` maps what a handler raises (other than :class:`HTTPError`) to its answer,
    once for every route (re-raising what it does not know: a 500)."""

    def __init__(self, errors: Callable[[BaseException], HTTPError] | None = None) -> None:
        self.routes: list[Route] = []
        self.errors = errors

    def add(self, spec: RouteSpec, handler: Handler, *, query: type = NoQuery,
            max_body_bytes: int = MAX_JSON_BODY_BYTES, stream_body: bool = False) -> None:
        self.routes.append(Route(spec, handler, max_body_bytes, stream_body, query))

    def route(self, method: str, template: str, *, query: type = NoQuery, max_body_bytes: int = MAX_JSON_BODY_BYTES,
              stream_body: bool = False) -> Callable[[Handler], Handler]:
        """``template``: ``/v1/envs/{id}/exec``; ``query``: the Struct the query string must decode to
        (``req.q``); none by default."""
        spec = RouteSpec(f"{method} {template}", method, template)

        def deco(fn: Handler) -> Handler:
            self.routes.append(Route(spec, fn, max_body_bytes, stream_body, query))
            return fn

        return deco

    @property
    def specs(self) -> list[RouteSpec]:
        return [r.spec for r in self.routes]

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]] | Response:
        """The route and its path parameters (each segment decoded once: weenv/_routes.py), or the
        400/404/405 answer. ``path``: the request target's path as it came, still percent-encoded."""
        try:
            segments = split_path(path)
        except PathError as e:
            return error_response(400, "bad_path", e.message)
        allowed = False
        for route in self.routes:
            params = route.spec.match(segments)
            if params is None:
                continue
            if route.spec.method != method:
                allowed = True
                continue
            return route, params
        if allowed:
            return error_response(405, "method_not_allowed", f"{method} is not allowed on {_clip(path)}")
        return error_response(404, "no_route", f"no API route {method} {_clip(path)}")

    async def dispatch(self, req: Request) -> Response | StreamResponse:
        """Route ``req`` (its body already read) and run the handler; for in-process callers."""
        found = self.match(req.method, req.path)
        if isinstance(found, Response):
            return found
        route, req.params = found
        req.q = req.query_as(route.query)
        return await self.run(route, req)

    async def run(self, route: Route, req: Request) -> Response | StreamResponse:
        """The handler's answer; what it raises other than :class:`HTTPError` mapped by ``errors``."""
        try:
            return await route.handler(req)
        except HTTPError:
            raise
        except Exception as e:
            if self.errors is None:
                raise
            raise self.errors(e) from e


class _ClientGone(Exception):
    pass


class _BodyReader:
    """Reads one request body from h11, bounded by ``limit`` bytes."""

    def __init__(self, server: "Server", conn: h11.Connection, stream: trio.SocketStream, limit: int):
        self.server, self.conn, self.stream, self.limit = server, conn, stream, limit
        self.received = 0
        self.done = False

    async def receive(self, max_bytes: int) -> bytes:
        out = bytearray()
        while not self.done and len(out) < max_bytes:
            try:
                ev = await self.server._next_event(self.conn, self.stream)
            except h11.RemoteProtocolError as e:
                raise HTTPError(400, "bad_request", f"request body: {e}") from None
            if isinstance(ev, h11.Data):
                self.received += len(ev.data)
                if self.received > self.limit:
                    raise HTTPError(413, "too_large", f"request body above the {self.limit}-byte limit of this route")
                out += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                self.done = True
            else:  # ConnectionClosed before the end of the body
                raise HTTPError(400, "bad_request", "the client closed the connection before the end of the body")
        return bytes(out)


class Server:
    def __init__(self, router: Router):
        self.router = router

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
                while (after := await self._one_exchange(conn, stream)) == "next":
                    conn.start_next_cycle()
                if after == "drain":
                    await self._drain(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, _ClientGone):
                return
            except Exception:  # a bug in one exchange must not take the listener (and daemon) down
                log.exception("HTTP connection failed")

    async def _one_exchange(self, conn: h11.Connection, stream: trio.SocketStream) -> str:
        """Read one request, answer it. Then "next": the connection can carry another; "close";
        "drain": close, but the client may still be sending a body we did not read."""
        event = await self._next_event(conn, stream)
        if not isinstance(event, h11.Request):
            return "close"  # ConnectionClosed, or PAUSED after a protocol slip
        target = event.target.decode("latin-1")
        path, _, qs = target.partition("?")
        req = Request(event.method.decode("latin-1"), path,
                      dict(urllib.parse.parse_qsl(qs, keep_blank_values=True)),
                      {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers})
        found = self.router.match(req.method, req.path)
        route = found[0] if isinstance(found, tuple) else None
        limit = route.max_body_bytes if route is not None else MAX_JSON_BODY_BYTES
        declared = req.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            # refused before reading: the body is never read, so the connection cannot go on
            await self._respond(conn, stream, error_response(
                413, "too_large", f"request body of {declared} bytes is above the {limit}-byte limit"), close=True)
            return "drain"
        reader = _BodyReader(self, conn, stream, limit)
        resp: Response | StreamResponse
        if route is not None and route.stream_body:
            req.params = found[1]  # type: ignore[index]
            req._reader = reader
            resp = await self._handle(route, req)
            complete = reader.done
            await self._respond(conn, stream, resp, close=not complete)
            return "next" if complete else "drain"
        try:
            req.body = await reader.receive(limit + 1)
        except HTTPError as e:
            await self._respond(conn, stream, error_response(e.status, e.kind, e.message), close=True)
            return "drain"
        if route is None:
            assert isinstance(found, Response)
            await self._respond(conn, stream, found)
            return "next"
        req.params = found[1]  # type: ignore[index]
        # The client's going away cancels the handler (and a streamed answer): see _watch.
        failed: Exception | None = None  # raised after the nursery, so never inside an ExceptionGroup
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, conn, stream, scope, req)
                try:
                    resp = await self._handle(route, req)
                    await self._respond(conn, stream, resp)
                except Exception as e:
                    failed = e
                nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed
        if scope.cancelled_caught:
            raise _ClientGone()
        return "close" if h11.MUST_CLOSE in (conn.our_state, conn.their_state) else "next"

    async def _drain(self, stream: trio.SocketStream) -> None:
        """Close politely after answering before the end of a body: a Unix socket closed with
        unread data resets, and the client would lose the answer. So stop sending, then read and
        drop what still comes, for a bounded time and number of bytes."""
        with trio.move_on_after(_DRAIN_S):
            try:
                await stream.send_eof()
                drained = 0
                while drained < _DRAIN_BYTES:
                    data = await stream.receive_some(_READ)
                    if not data:
                        return
                    drained += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _watch(self, conn: h11.Connection, stream: trio.SocketStream, scope: trio.CancelScope,
                     req: Request) -> None:
        """Cancel ``scope`` when the client closes (or resets) the connection. A client that only
        half-closes (``shutdown(SHUT_WR)``) after its request looks the same and is taken as gone.

        Bytes of a pipelined next request are handed to h11, which keeps them for the next cycle;
        past a bound the watcher stops reading (and so stops noticing a disconnect) rather than
        buffering without limit."""
        while len(conn.trailing_data[0]) < _MAX_PIPELINED_BYTES:
            try:
                data = await stream.receive_some(_READ)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                log.info("client went away during %s %s: cancelling it", req.method, req.path)
                scope.cancel()
                return
            conn.receive_data(data)
        await trio.sleep_forever()

    async def _handle(self, route: Route, req: Request) -> Response | StreamResponse:
        try:
            req.q = req.query_as(route.query)
            return await self.router.run(route, req)  # the parts' errors, mapped once for every route
        except HTTPError as e:
            return error_response(e.status, e.kind, e.message)
        except Exception as e:  # one bad request must not take the daemon down
            log.exception("%s %s failed", req.method, req.path)
            return error_response(500, "internal", f"{type(e).__name__}: {e}")

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, resp: Response | StreamResponse,
                       *, close: bool = False) -> None:
        extra = [("connection", "close")] if close else []
        if isinstance(resp, Response):
            headers = [("content-type", resp.content_type), ("content-length", str(len(resp.body))), *extra]
            await self._send(conn, stream, h11.Response(status_code=resp.status, headers=headers))
            if resp.body:
                await self._send(conn, stream, h11.Data(data=resp.body))
            await self._send(conn, stream, h11.EndOfMessage())
            return
        headers = [("content-type", resp.content_type), ("transfer-encoding", "chunked"), *extra]
        await self._send(conn, stream, h11.Response(status_code=resp.status, headers=headers))

        async def send(chunk: bytes) -> None:
            if chunk:
                await self._send(conn, stream, h11.Data(data=chunk))

        await resp.produce(send)
        await self._send(conn, stream, h11.EndOfMessage())

    async def serve_unix(self, path: str, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        # The socket is 0600 (the API is root's) from the start, without touching the process-wide
        # umask (weenv/_unixsock.py).
        sock = trio.socket.from_stdlib_socket(
            await trio.to_thread.run_sync(lambda: bind_unix(path, 0o600, backlog=512)))
        task_status.started()
        await trio.serve_listeners(self.serve_connection, [trio.SocketListener(sock)])
