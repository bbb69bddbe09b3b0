"""A node's daemon on the cluster network: a TCP listener that needs the cluster token.

The node agent runs it (a thread with its own trio loop) bound to the Ray node's address, so the
gateway reaches every node's daemon API without a Ray hop: ``AsyncClient("http://ip:port",
token=cluster_token)``. Authentication is per connection: its first request must carry
``Authorization: Bearer <cluster token>`` (compared as a SHA-256 digest, in constant time);
then the connection is spliced, bytes both ways, onto the daemon's Unix socket, so streams
(exec output, file bodies, port tunnels) pass unchanged. Without the token a connection gets a
401 and is closed; the daemon never sees it. A node without a cluster token serves no TCP at all.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading

import trio

log = logging.getLogger("weenv.cluster")

MAX_HEAD_BYTES = 64 << 10
HEAD_TIMEOUT_S = 10.0


def _refusal(status: int, message: str) -> bytes:
    body = ('{"error":{"kind":"unauthorized","message":"%s"}}' % message).encode()
    reason = {401: "Unauthorized", 400: "Bad Request", 503: "Service Unavailable"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def bearer_of(head: bytes) -> str | None:
    """The ``Authorization: Bearer`` token of a request head (None when it has none)."""
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip().decode("latin-1")
    return None


class NodeApi:
    """``serve`` in a thread: TCP on ``host:port`` (0: any free port) -> the daemon's socket."""

    def __init__(self, socket_path: str, token_sha256: str, host: str, port: int = 0):
        if not token_sha256:
            raise ValueError("the node's TCP API needs a cluster token")
        self.socket_path, self._want, self.host = socket_path, token_sha256, host
        self.port = port
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._cancel: trio.CancelScope | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.refused = 0
        self._thread = threading.Thread(target=self._main, name="weenv-node-api", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> "NodeApi":
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the node's TCP API on {self.host}:{self.port} did not start: {self._error}")
        return self

    def stop(self) -> None:
        if self._token is not None and self._cancel is not None:
            try:
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(5)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._cancel = scope
            listeners = await trio.open_tcp_listeners(self.port, host=self.host)
            self.port = listeners[0].socket.getsockname()[1]
            self._ready.set()
            await trio.serve_listeners(self._connection, listeners)

    def _ok(self, token: str | None) -> bool:
        got = hashlib.sha256(token.encode()).hexdigest() if token else ""
        return hmac.compare_digest(got.encode(), self._want.encode())

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            head = bytearray()
            try:
                with trio.move_on_after(HEAD_TIMEOUT_S):
                    while b"\r\n\r\n" not in head and len(head) <= MAX_HEAD_BYTES:
                        data = await stream.receive_some(16384)
                        if not data:
                            return
                        head += data
                end = head.find(b"\r\n\r\n")
                if end < 0:
                    await stream.send_all(_refusal(400, "no request head within the limits"))
                    return
                if not self._ok(bearer_of(bytes(head[:end]))):
                    self.refused += 1
                    await stream.send_all(_refusal(401, "this node's API needs the cluster token"))
                    return
                try:
                    daemon = await trio.open_unix_socket(self.socket_path)
                except OSError:
                    await stream.send_all(_refusal(503, "the node's weenv daemon does not answer"))
                    return
                async with daemon:
                    await daemon.send_all(bytes(head))
                    await _splice(stream, daemon)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return


async def _splice(client: trio.SocketStream, daemon: trio.SocketStream) -> None:
    """Bytes both ways until the daemon closes (a client's EOF is passed on as a half-close)."""
    async with trio.open_nursery() as nursery:
        async def up() -> None:
            try:
                while data := await client.receive_some(65536):
                    await daemon.send_all(data)
                await daemon.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                nursery.cancel_scope.cancel()

        nursery.start_soon(up)
        try:
            while data := await daemon.receive_some(65536):
                await client.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        nursery.cancel_scope.cancel()
