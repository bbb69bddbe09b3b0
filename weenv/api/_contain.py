"""No request can stop ``weenv serve``: what goes wrong in one connection ends that connection only.

hypercorn's trio worker runs each connection as ``TCPServer(...).run()`` in the server's nursery, so
an exception escaping it ends the nursery, and the process with it. hypercorn 0.18 has one such
exception any client can raise: over HTTP/2, a DATA frame of a request the app has already answered
(a 401 before the body was read) finds its stream gone, and ``H2Protocol._handle_events`` raises
``KeyError`` (pgjones/hypercorn PRs #312, #334, #365, unmerged). Two layers, installed into
hypercorn by :func:`contain_connections`:

- :class:`ContainedTCPServer` drops the one connection whose handling raised an ``Exception`` and
  logs a warning (peer, exception type); ``Cancelled``, ``KeyboardInterrupt`` and every other
  ``BaseException`` pass through untouched.
- :class:`LateDataH2Protocol` drops such late DATA, giving its flow-control credit back, so the client
  reads its 401 and the connection serves its next request.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import h2.events
import trio
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger("weenv.api")


def _peer(stream: Any) -> str:
    """``host:port`` of the client on ``stream`` (a socket stream, or TLS over one)."""
    try:
        name = getattr(stream, "transport_stream", stream).socket.getpeername()
    except (AttributeError, OSError):
        return "an unknown peer"
    if isinstance(name, (str, bytes)) or len(name) < 2:  # a Unix socket's peer has no address (--docker)
        return "a Unix socket peer"
    host, port = name[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _leaf_types(error: BaseException) -> list[str]:
    """The type names of ``error``, or of every exception in it when it is a group."""
    if isinstance(error, BaseExceptionGroup):
        return [name for inner in error.exceptions for name in _leaf_types(inner)]
    return [type(error).__name__]


class ContainedTCPServer(TCPServer):
    """hypercorn's connection handler; an ``Exception`` in it closes this connection, nothing more."""

    async def run(self) -> None:
        peer = _peer(self.stream)  # before the connection goes: a closed socket has no peer
        try:
            await super().run()
        except* Exception as group:
            log.warning("dropped the HTTP connection from %s: %s in hypercorn", peer,
                        ", ".join(_leaf_types(group)))
            log.debug("what ended the connection from %s", peer, exc_info=group)
            with contextlib.suppress(Exception):  # best effort: the stream may be half torn down already
                await trio.aclose_forcefully(self.stream)


class LateDataH2Protocol(H2Protocol):
    """hypercorn's HTTP/2 protocol, minus the ``KeyError`` on DATA for a stream already answered.

    Events are handed to hypercorn one at a time because handling one (a body chunk waiting for room in
    the app's queue) may let the app answer and close a stream that a later event in the same batch names.
    """

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                # RFC 9113 8.1 lets the client go on sending after the answer; acknowledge and drop it
                self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                await super()._handle_events([event])
        await self._flush()


def contain_connections() -> None:
    """Make hypercorn's trio worker use :class:`ContainedTCPServer` and :class:`LateDataH2Protocol`.

    Both are module globals hypercorn reads when it starts a worker and a connection; a hypercorn that
    moved or replaced them raises here (AttributeError, RuntimeError), so the guard is never silently lost.
    """
    import hypercorn.protocol
    import hypercorn.trio.run

    for module, name, replacement in ((hypercorn.trio.run, "TCPServer", ContainedTCPServer),
                                      (hypercorn.protocol, "H2Protocol", LateDataH2Protocol)):
        current = getattr(module, name)
        if current is not replacement and current not in replacement.__bases__:
            raise RuntimeError(f"{module.__name__}.{name} is not hypercorn's own any more: {current!r}")
        setattr(module, name, replacement)
