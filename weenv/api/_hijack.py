"""Hijacked connections for the Docker API: ``101 Switching Protocols`` then raw bytes both ways.

Docker's ``POST /exec/{id}/start`` and ``/containers/{id}/attach`` answer a request carrying
``Connection: Upgrade`` / ``Upgrade: tcp`` with ``101 UPGRADED``; from then on the connection is a
raw pipe: the output goes on it as it is (docker-py reads the socket under its HTTP response, so a
chunked body would be read as garbage) and what the client writes is the command's stdin, its
``shutdown(SHUT_WR)`` the end of that stdin while the output still flows back. ASGI has no message
for that, and hypercorn's HTTP/1.1 protocol refuses body data once h11 has switched protocols.

Server side, :class:`HijackH11Protocol` (installed by :func:`allow_hijack`, as
weenv/api/_contain.py installs its guards) lets an app answer such a request with
``http.response.start`` status 101 and then ``http.response.body`` messages: each body goes on the
connection as it is, and the end of the body closes the connection. After the 101, what the
client sends reaches the app as ``http.request`` messages (``more_body`` true), the client's end
of writing as one ``http.request`` with ``more_body`` false; the connection's read side ending
that way is not a disconnect (the output goes on), a write that fails or the read side failing is.
Input is taken as the app takes it: hypercorn's queue to the app is bounded
(``max_app_queue_size`` messages of at most one read each), and while it is full the connection
is not read, so a client's input never piles up in the server. A request that did not offer an
upgrade cannot be answered with 101 (h11 refuses it), so nothing changes for any other route.

App side, :class:`HijackedResponse` runs one such exchange: an output iterator and an input
callback, and it keeps reading what the client sends until the connection is over (so the bounded
queue never stalls the server's reading of it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import h11
from hypercorn.events import Closed, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.utils import suppress_body as _hypercorn_suppress_body
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ._common import log
from ._peerread import until_peer_read

__all__ = ["HijackH11Protocol", "HijackedResponse", "allow_hijack"]

FIRST_OUTPUT_AFTER_S = 0.005
"""The least time between a 101's headers and the first output: docker-py reads the headers
through a buffered reader and the output from the socket under it, so output in the same read as
the headers would be lost to it."""
DISCONNECT_WAIT_S = 30.0
"""After the output's end, how long the app keeps reading for the server's disconnect (it comes at
once: the end of the output closes the connection) before it stops waiting."""


class _Switched:
    """What stands in for h11's connection after the 101: the bytes the client sends, as they
    come, then the end of them (``h11.Data`` and one ``h11.EndOfMessage``, which hypercorn's loop
    hands the app as ``http.request`` messages). Holds at most what one read brought."""

    our_state = None  # not h11.DONE: hypercorn never recycles the connection
    their_state = None
    they_are_waiting_for_100_continue = False

    def __init__(self, h11_connection: h11.Connection):
        data, closed = h11_connection.trailing_data  # what came after the request, before the switch
        self.h11_connection = h11_connection
        self.buffer, self.eof, self._eof_given = bytearray(data), closed, False

    def receive_data(self, data: bytes) -> None:
        if data:
            self.buffer.extend(data)
        else:
            self.eof = True

    def next_event(self) -> Any:
        if self.buffer:
            data, self.buffer = bytes(self.buffer), bytearray()
            return h11.Data(data=data)
        if self.eof and not self._eof_given:
            self._eof_given = True
            return h11.EndOfMessage()
        return h11.NEED_DATA

    def start_next_cycle(self) -> None:
        pass


class HijackH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol; after a 101 the connection is the app's, raw, both ways."""

    _read_side_done = False

    async def handle(self, event: Any) -> None:
        if isinstance(self.connection, _Switched) and isinstance(event, Closed) and self.connection.eof \
                and not self._read_side_done:
            # hypercorn's reader says Closed right after the client's end of writing: that is a
            # half-close (the end of stdin), not a disconnect. Taken once: the next Closed, from a
            # write that failed or from the app's end, is the connection's.
            self._read_side_done = True
            return
        await super().handle(event)

    _headers_read = False

    async def _send_h11_event(self, event: Any) -> None:
        if isinstance(self.connection, _Switched):
            if isinstance(event, h11.Data):
                if not self._headers_read:  # the 101's headers off the socket before any output
                    self._headers_read = True
                    await until_peer_read(self.send)
                await self.send(RawData(data=bytes(event.data)))
            elif isinstance(event, h11.EndOfMessage):
                await self.send(Closed())  # the stream is over: so is the connection
            return
        await super()._send_h11_event(event)
        if isinstance(self.connection, h11.Connection) and self.connection.our_state is h11.SWITCHED_PROTOCOL:
            self.connection = _Switched(self.connection)
            await self.can_read.set()  # hypercorn's reader waits on h11's PAUSED: the input is the app's now


def _suppress_body(method: str, status_code: int) -> bool:
    """hypercorn's rule (no body for HEAD, 1xx, 204, 304) but for a 101, whose body is the hijacked stream."""
    return status_code != 101 and _hypercorn_suppress_body(method, status_code)


def allow_hijack() -> None:
    """Make hypercorn's connections use :class:`HijackH11Protocol`, and let a 101 have a body (the
    raw stream). A hypercorn that moved either raises here, so the change is never silently lost."""
    import hypercorn.protocol
    import hypercorn.protocol.http_stream as http_stream

    current = hypercorn.protocol.H11Protocol
    if current is not HijackH11Protocol and current is not H11Protocol:
        raise RuntimeError(f"hypercorn.protocol.H11Protocol is not hypercorn's own any more: {current!r}")
    if http_stream.suppress_body not in (_suppress_body, _hypercorn_suppress_body):
        raise RuntimeError("hypercorn's http_stream.suppress_body is not its own any more: "
                           f"{http_stream.suppress_body!r}")
    hypercorn.protocol.H11Protocol = HijackH11Protocol  # type: ignore[misc]
    http_stream.suppress_body = _suppress_body  # type: ignore[assignment]


InputCallback = Callable[[bytes | None], Awaitable[None]]


class HijackedResponse(Response):
    """One hijacked exchange (status 101 when the client offered the upgrade, else a plain
    streaming 200): ``output`` goes out as it comes, and the client's input is read all along.

    With ``on_input``, each piece of input is given to it in order; the input's end (the client's
    end of writing, or its going away) is either given as ``None`` while the output goes on, or,
    with ``input_end_stops``, it ends the exchange (the output stops, the connection closes):
    Docker's two ways (a non-TTY exec's stdin is closed at its client's end of writing; a TTY's
    attach ends there instead, its command's stdin left open). ``on_input`` is awaited before the
    next piece is read, so a command that does not read its stdin holds the client back instead of
    filling the server; when it raises, the rest of the input is dropped. Without ``on_input`` the
    input is read and dropped and its end changes nothing (as Docker does for a command without
    stdin). When the output stops early ``output`` is closed (its ``finally`` runs: whether the
    command goes on is for its owner to say)."""

    def __init__(self, output: AsyncIterator[bytes], *, on_input: InputCallback | None = None,
                 input_end_stops: bool = False, status_code: int = 101, media_type: str,
                 headers: Mapping[str, str] | None = None, first_output_after_s: float = FIRST_OUTPUT_AFTER_S):
        self.status_code, self.media_type, self.background = status_code, media_type, None
        self.init_headers(dict(headers or {}))  # no body: no Content-Length (the 200's is chunked)
        self.output, self.on_input, self.input_end_stops = output, on_input, input_end_stops
        self.first_output_after_s = first_output_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone, stop = anyio.Event(), anyio.Event()  # the server's disconnect; the output is to stop
        feeding = [self.on_input]

        async def input_ended() -> None:
            if self.on_input is None:
                return
            if self.input_end_stops:
                stop.set()
            else:
                await self._give(feeding, None)

        async def read_input() -> None:
            ended = False
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    stop.set()
                    if not ended:
                        await input_ended()
                    return
                if ended:
                    continue
                if message.get("body"):
                    await self._give(feeding, bytes(message["body"]))
                if not message.get("more_body", False):
                    ended = True
                    await input_ended()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_input)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            sent_at, first = time.monotonic(), self.status_code == 101
            with anyio.CancelScope() as out_scope:
                tg.start_soon(_cancel_when, stop, out_scope)
                try:
                    async for chunk in self.output:
                        if chunk:
                            if first:
                                first = False
                                await anyio.sleep(max(0.0, self.first_output_after_s - (time.monotonic() - sent_at)))
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                finally:
                    aclose = getattr(self.output, "aclose", None)
                    if aclose is not None:
                        with anyio.CancelScope(shield=True):
                            await aclose()
            if not gone.is_set():
                feeding[0] = None  # the output is over: what still comes in is dropped
                await send({"type": "http.response.body", "body": b"", "more_body": False})  # closes the connection
            with anyio.move_on_after(DISCONNECT_WAIT_S) as waited:
                await gone.wait()  # then the reader gives the input's end (if it went away first) and returns
            if waited.cancelled_caught:
                log.warning("hijacked %s: no disconnect %.0f s after the output's end", scope.get("path", "")[:100],
                            DISCONNECT_WAIT_S)
                tg.cancel_scope.cancel()
            stop.set()  # _cancel_when returns

    @staticmethod
    async def _give(feeding: list[InputCallback | None], data: bytes | None) -> None:
        on_input = feeding[0]
        if on_input is None:
            return
        try:
            await on_input(data)
        except Exception as e:  # the command is gone or closed its stdin: the rest has nowhere to go
            log.info("hijacked input dropped from here: %s", e)
            feeding[0] = None


async def _cancel_when(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
