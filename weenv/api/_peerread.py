"""Waiting until a Unix socket's peer has read what was sent to it (Linux ``SIOCOUTQ``).

docker-py reads the ``101`` of an exec start (or attach) through the buffered reader of its HTTP
response, and then the stream from the socket under it: output that reached the socket before the
client took the headers off lands in that buffer and is lost to it (docker/docker-py#3332; it
happens with dockerd too, when a command is quick and the client slow). A fixed pause after the
headers is not enough: a client with 16 threads on a loaded machine took longer than 5 ms and
``exec_run`` returned ``b''`` (benchmarks/docker_api.py saw it). On a Unix socket the kernel counts
what was sent and not read yet, so the first output waits until that is nothing. On TCP that
count only says what the peer's kernel has not acknowledged, not what it read: no wait there.
"""

from __future__ import annotations

import fcntl
import socket
import sys
import termios
from typing import Any

import anyio

__all__ = ["HEADERS_READ_WAIT_S", "unread_bytes", "until_peer_read"]

HEADERS_READ_WAIT_S = 2.0
"""The longest the first output waits for the client to read what came before it."""
_POLL_S = 0.0005


def unread_bytes(fd: int) -> int:
    """What was sent on the Unix stream socket ``fd`` and its peer has not read yet (``SIOCOUTQ``,
    which is ``TIOCOUTQ`` on Linux; for a Unix socket the memory its unread data holds)."""
    answer = fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0")
    return int.from_bytes(answer, sys.byteorder, signed=True)


def _unix_socket(send: Any) -> Any:
    """The connection's socket behind hypercorn's ``send`` (its TCPServer's stream), if a Unix one."""
    stream = getattr(getattr(send, "__self__", None), "stream", None)
    sock = getattr(stream, "socket", None)  # a TLS stream has none: not a Unix socket
    return sock if sock is not None and sock.family == socket.AF_UNIX else None


async def until_peer_read(send: Any, timeout_s: float = HEADERS_READ_WAIT_S) -> bool:
    """Wait until the peer of the Unix socket behind hypercorn's ``send`` read all that was sent
    (at most ``timeout_s``). False at once for other connections, and when the time ran out."""
    sock = _unix_socket(send)
    if sock is None:
        return False
    with anyio.move_on_after(timeout_s):
        try:
            while unread_bytes(sock.fileno()) > 0:
                await anyio.sleep(_POLL_S)
        except OSError:  # closed under us: nothing to wait for
            return False
        return True
    return False
