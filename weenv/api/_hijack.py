"""Hijacked connections for the Docker API: ``101 Switching Protocols`` then raw bytes.

Docker's ``POST /exec/{id}/start`` and ``/containers/{id}/attach`` answer a request carrying
``Connection: Upgrade`` / ``Upgrade: tcp`` with ``101 UPGRADED`` and then write the output straight
on the connection (docker-py reads the socket under its HTTP response, so a chunked body would be
read as garbage). ASGI has no message for that, and hypercorn's HTTP/1.1 protocol refuses body
data once h11 has switched protocols. :class:`HijackH11Protocol` (installed by
:func:`allow_hijack`, as weenv/api/_contain.py installs its guards) lets an app answer such a
request with ``http.response.start`` status 101 and then ``http.response.body`` messages: each body
goes on the connection as it is, and the end of the body closes the connection. A request that
did not offer an upgrade cannot be answered with 101 (h11 refuses it), so nothing changes for
any other route.
"""

from __future__ import annotations

from typing import Any

import h11
from hypercorn.events import Closed, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.utils import suppress_body as _hypercorn_suppress_body

from ._peerread import until_peer_read

__all__ = ["HijackH11Protocol", "allow_hijack"]


class HijackH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol; after a 101 the app's body is the raw connection."""

    _headers_read = False

    async def _send_h11_event(self, event: Any) -> None:
        if self.connection.our_state is h11.SWITCHED_PROTOCOL:
            if isinstance(event, h11.Data):
                if not self._headers_read:  # the 101's headers off the socket before any output
                    self._headers_read = True
                    await until_peer_read(self.send)
                await self.send(RawData(data=bytes(event.data)))
            elif isinstance(event, h11.EndOfMessage):
                await self.send(Closed())  # the stream is over: so is the connection
            return
        await super()._send_h11_event(event)


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
