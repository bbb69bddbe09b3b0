"""Requests for a sandbox port other than envd's: ``{port}-{id}.{domain}`` (E2B's ``get_host``),
``E2b-Sandbox-Port``, or ``/proxy/{id}/{port}/...``, relayed to that port on the env's own loopback.

The daemon makes the connection from inside the env's network namespace and hands back a byte
tunnel (``POST /v1/envs/{id}/ports/{port}``: the request body goes to the port, the port's bytes
are the answer, both chunked and at the same time). The env needs no network interface, and
nothing but this route reaches the port. Over the tunnel this module speaks HTTP/1.1 to the
env's server (h11) for an HTTP request, or the WebSocket protocol (wsproto) for a WebSocket one,
one tunnel per request.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import anyio
import h11
import msgspec
from anyio.abc import SocketStream

from .._aclient import AsyncClient
from ._common import log

MAX_HEAD_BYTES = 64 << 10
READ = 1 << 16
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"te", b"trailer",
        b"x-access-token", b"e2b-traffic-access-token", b"e2b-sandbox-id", b"e2b-sandbox-port"}


class TunnelError(Exception):
    """The port could not be reached: ``status`` and a message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Tunnel:
    """A byte stream to a port inside an env, through the daemon's Unix socket."""

    def __init__(self, sock: SocketStream):
        self.sock = sock
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.eof = False

    @classmethod
    async def open(cls, client: AsyncClient, env_id: str, port: int) -> "Tunnel":
        """The daemon's tunnel to ``port`` of ``env_id``: over its Unix socket, or over a node's daemon
        API on TCP (the cluster gateway: ``http://`` only, with the client's ``Authorization``)."""
        auth: list[tuple[str, str]] = []
        try:
            conn = client.connection
            if conn.remote:
                url = urllib.parse.urlsplit(conn.target)
                if url.scheme != "http" or not url.hostname:
                    raise TunnelError(501, f"env ports are proxied to a daemon's TCP API over plain http:// only, "
                                      f"not {conn.target!r}")
                sock: SocketStream = await anyio.connect_tcp(url.hostname, url.port or 80)
                if (value := conn.authorization) is not None:
                    auth = [("authorization", value)]  # the node API's cluster token, on its first request
            else:
                sock = await anyio.connect_unix(conn.target)
        except OSError as e:
            log.error("the daemon does not answer at %s: %s", client.target, e)
            raise TunnelError(503, "the node's weenv daemon does not answer") from None
        t = cls(sock)
        try:
            await t._send(h11.Request(method="POST", target=f"/v1/envs/{urllib.parse.quote(env_id)}/ports/{port}",
                                      headers=[("host", "weenv"), *auth, ("transfer-encoding", "chunked")]))
            while True:
                ev = await t._next()
                if isinstance(ev, h11.Response):
                    break
                if isinstance(ev, h11.InformationalResponse):
                    continue
                raise TunnelError(502, "the daemon closed the tunnel before answering")
            if ev.status_code != 200:
                body = bytearray()
                while isinstance(nxt := await t._next(), h11.Data) and len(body) < MAX_HEAD_BYTES:
                    body += nxt.data
                try:
                    err = msgspec.json.decode(bytes(body))["error"]
                    kind, message = err.get("kind", ""), err.get("message", "")
                except (msgspec.DecodeError, KeyError, TypeError):
                    kind, message = "", body.decode("utf-8", "replace")
                status = {"env_not_found": 502, "wrong_state": 502}.get(kind, 502 if ev.status_code >= 500 else
                                                                          ev.status_code)
                raise TunnelError(status, f"port {port} of sandbox {env_id}: {message}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await sock.aclose()
            raise
        return t

    async def _send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            await self.sock.send(data)

    async def _next(self) -> Any:
        while True:
            ev = self.conn.next_event()
            if ev is h11.NEED_DATA:
                try:
                    data = await self.sock.receive(READ)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    data = b""
                self.conn.receive_data(data)
                continue
            return ev

    async def send(self, data: bytes) -> None:
        if data:
            await self._send(h11.Data(data=data))

    async def send_eof(self) -> None:
        if self.conn.our_state is h11.SEND_BODY:
            await self._send(h11.EndOfMessage())

    async def receive(self) -> bytes:
        """The port's next bytes; ``b""`` once it closed."""
        while not self.eof:
            ev = await self._next()
            if isinstance(ev, h11.Data):
                if ev.data:
                    return bytes(ev.data)
                continue
            self.eof = True  # EndOfMessage, or the daemon's connection closed
        return b""

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.sock.aclose()


def _request_head(scope: dict[str, Any], path: str, host: str) -> tuple[str, list[tuple[bytes, bytes]]]:
    target = path + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP and k.lower() != b"host"]
    return target, [(b"host", host.encode("latin-1")), *headers]


async def proxy_http(scope: dict[str, Any], receive: Any, send: Any, tunnel: Tunnel, path: str, host: str) -> None:
    """One HTTP request to the env's server and its answer, both streamed."""
    inner = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    target, headers = _request_head(scope, path, host)
    chunked = not any(k.lower() == b"content-length" for k, _ in headers)
    if chunked and scope["method"] not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        headers.append((b"transfer-encoding", b"chunked"))
    elif chunked:
        headers.append((b"content-length", b"0"))
    headers.append((b"connection", b"close"))

    async def put(event: Any) -> None:
        data = inner.send(event)
        if data:
            await tunnel.send(data)

    async def next_event() -> Any:
        while True:
            ev = inner.next_event()
            if ev is h11.NEED_DATA:
                inner.receive_data(await tunnel.receive())
                continue
            return ev

    await put(h11.Request(method=scope["method"], target=target, headers=headers))
    started = False
    async with anyio.create_task_group() as tg:

        async def upload() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return
                if inner.our_state is h11.SEND_BODY:
                    if msg.get("body"):
                        await put(h11.Data(data=msg["body"]))
                    if not msg.get("more_body"):
                        await put(h11.EndOfMessage())
                if not msg.get("more_body"):
                    break
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(upload)
        try:
            while True:
                ev = await next_event()
                if isinstance(ev, h11.InformationalResponse):
                    continue
                if isinstance(ev, h11.Response):
                    out = [(k, v) for k, v in ev.headers if k.lower() not in _HOP]
                    await send({"type": "http.response.start", "status": ev.status_code, "headers": out})
                    started = True
                elif isinstance(ev, h11.Data):
                    await send({"type": "http.response.body", "body": bytes(ev.data), "more_body": True})
                elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
        except h11.ProtocolError as e:
            if not started:
                await _error(send, 502, f"the server on the port answered no HTTP: {e}")
                started = True
        if not started:
            await _error(send, 502, "the server on the port closed the connection without answering")
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        tg.cancel_scope.cancel()


async def _error(send: Any, status: int, message: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": msgspec.json.encode({"code": status, "message": message})})


async def proxy_websocket(scope: dict[str, Any], receive: Any, send: Any, tunnel: Tunnel, path: str,
                          host: str) -> None:
    """A WebSocket to the env's server: its handshake first (the client is accepted only once the
    server accepted), then messages both ways until either side closes."""
    from wsproto import ConnectionType, WSConnection
    from wsproto import events as ws

    first = await receive()
    if first["type"] != "websocket.connect":
        return
    conn = WSConnection(ConnectionType.CLIENT)
    target, headers = _request_head(scope, path, host)
    keep = [(k, v) for k, v in headers if not k.lower().startswith(b"sec-websocket") and k.lower() != b"host"]
    protocols = [p.strip() for k, v in scope["headers"] if k.lower() == b"sec-websocket-protocol"
                 for p in v.decode("latin-1").split(",") if p.strip()]
    await tunnel.send(conn.send(ws.Request(host=host, target=target, extra_headers=keep, subprotocols=protocols)))
    accepted: ws.AcceptConnection | None = None
    early: list[Any] = []  # what came with the handshake's answer
    while accepted is None:
        data = await tunnel.receive()
        conn.receive_data(data or None)
        for ev in conn.events():
            if accepted is not None:
                early.append(ev)
            elif isinstance(ev, ws.AcceptConnection):
                accepted = ev
            elif isinstance(ev, ws.RejectConnection):
                await send({"type": "websocket.close", "code": 1011, "reason": f"refused: {ev.status_code}"})
                return
        if not data and accepted is None:
            await send({"type": "websocket.close", "code": 1011, "reason": "the port closed during the handshake"})
            return
    await send({"type": "websocket.accept", "subprotocol": accepted.subprotocol})
    async with anyio.create_task_group() as tg:

        async def from_client() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "websocket.receive":
                    if msg.get("text") is not None:
                        await tunnel.send(conn.send(ws.TextMessage(data=msg["text"])))
                    else:
                        await tunnel.send(conn.send(ws.BytesMessage(data=msg.get("bytes") or b"")))
                elif msg["type"] == "websocket.disconnect":
                    try:
                        await tunnel.send(conn.send(ws.CloseConnection(code=msg.get("code", 1000))))
                    except Exception:  # the server side closed first
                        pass
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(from_client)
        closed = False
        data = b"-"
        while not closed:
            if early:
                events, early = early, []
            else:
                data = await tunnel.receive()
                conn.receive_data(data or None)
                events = list(conn.events())
            for ev in events:
                if isinstance(ev, ws.TextMessage):
                    await send({"type": "websocket.send", "text": ev.data})
                elif isinstance(ev, ws.BytesMessage):
                    await send({"type": "websocket.send", "bytes": bytes(ev.data)})
                elif isinstance(ev, ws.Ping):
                    await tunnel.send(conn.send(ev.response()))
                elif isinstance(ev, ws.CloseConnection):
                    closed = True
                    await send({"type": "websocket.close", "code": ev.code, "reason": ev.reason or ""})
            if not data and not closed:
                closed = True
                await send({"type": "websocket.close", "code": 1011, "reason": "the port closed"})
        tg.cancel_scope.cancel()
