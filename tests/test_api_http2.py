"""HTTP/2 to ``weenv serve`` (cleartext with prior knowledge, and TLS with ALPN h2): no request stops
the server (security issue 25 item 8).

The request that used to: a POST answered before its body was read (401 without a key or token, 415
for a gzip upload) whose body goes on arriving. hypercorn 0.18 looked up the closed stream for each
late DATA frame and raised KeyError out of the connection, into the server's nursery. Each request is
sent twice: by httpx with a streamed body (the natural client), and by hand with the ``h2`` library
(HEADERS, the whole answer, then DATA: no race), after which the same connection must still answer.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from .fixtures_api import Served, start_serve, stop_serve, weenv_serve  # noqa: F401

CHUNK_BYTES = 64 * 1024
BODY_BYTES = 4 * 1024 * 1024
FRAME_BYTES = 16 * 1024
LATE_DATA_FRAMES = 64  # 1 MiB after the answer: many times the 64 KiB window, so the server must acknowledge
TIMEOUT_S = 30


def _streamed(chunk: bytes = b"\0" * CHUNK_BYTES) -> Iterator[bytes]:
    for _ in range(BODY_BYTES // len(chunk)):
        yield chunk


class _H2Client:
    """One HTTP/2 connection to 127.0.0.1 over a blocking socket, every wait bounded by TIMEOUT_S."""

    def __init__(self, port: int, ctx: ssl.SSLContext | None) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        if ctx is not None:
            sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
            assert sock.selected_alpn_protocol() == "h2"
        self.sock = sock
        self.head = [(":scheme", "https" if ctx else "http"), (":authority", f"127.0.0.1:{port}")]
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self._flush()
        self.answers: dict[int, int] = {}
        self.ended: set[int] = set()

    def close(self) -> None:
        self.sock.close()

    def _flush(self) -> None:
        if data := self.conn.data_to_send():
            self.sock.sendall(data)

    def _pump(self) -> None:
        """Read once and handle what came (ConnectionError when the server went)."""
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                self.answers[event.stream_id] = int(dict(event.headers)[":status"])
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.ConnectionTerminated):
                raise ConnectionError(f"the server ended the connection: {event.error_code!r}")
        self._flush()

    def request(self, method: str, path: str, headers: dict[str, str], *, end_stream: bool) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [(":method", method), (":path", path), *self.head,
                                           *((k.lower(), v) for k, v in headers.items())], end_stream=end_stream)
        self._flush()
        return stream_id

    def answer(self, stream_id: int) -> int:
        deadline = time.monotonic() + TIMEOUT_S
        while stream_id not in self.ended:
            assert time.monotonic() < deadline, f"no complete answer on stream {stream_id} in {TIMEOUT_S} s"
            self._pump()
        return self.answers[stream_id]

    def send_late_body(self, stream_id: int) -> None:
        """DATA frames for a stream the server has answered, then its END_STREAM."""
        deadline = time.monotonic() + TIMEOUT_S
        for _ in range(LATE_DATA_FRAMES):
            while self.conn.local_flow_control_window(stream_id) < FRAME_BYTES:
                assert time.monotonic() < deadline, "the server gave no flow-control credit back"
                self._pump()
            self.conn.send_data(stream_id, b"\0" * FRAME_BYTES)
            self._flush()
        self.conn.end_stream(stream_id)
        self._flush()


def late_body_then_next(port: int, ctx: ssl.SSLContext | None, path: str, headers: dict[str, str],
                        next_request: tuple[str, dict[str, str]]) -> tuple[int, int | None]:
    """On one connection: POST ``path`` (HEADERS only), read its whole answer, let the server close
    the stream, send 1 MiB of its body, then GET ``next_request``. Its answer is None when the server
    dropped the connection instead."""
    client = _H2Client(port, ctx)
    try:
        stream_id = client.request("POST", path, headers, end_stream=False)
        status = client.answer(stream_id)
        time.sleep(0.05)  # the server forgets a stream right after ending it; the DATA must come after that
        try:
            client.send_late_body(stream_id)
            return status, client.answer(client.request("GET", *next_request, end_stream=True))
        except (ConnectionError, ssl.SSLError, OSError):
            return status, None
    finally:
        client.close()


# -- hypercorn with the connection guard alone ---------------------------------------------------


async def _answers_401_unread(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that refuses every request without reading its body (what the Gate does)."""
    if scope["type"] == "lifespan":
        assert (await receive())["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.complete"})
        assert (await receive())["type"] == "lifespan.shutdown"
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def test_an_error_in_one_connection_drops_that_connection_only(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """hypercorn's own KeyError (the late-DATA filter left out) ends its connection; the server and a
    connection opened next live on, and the drop is logged with the peer and the exception's type."""
    import hypercorn.protocol
    import hypercorn.protocol.h2
    import hypercorn.trio.run
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from weenv.api._contain import ContainedTCPServer

    monkeypatch.setattr(hypercorn.trio.run, "TCPServer", ContainedTCPServer)
    monkeypatch.setattr(hypercorn.protocol, "H2Protocol", hypercorn.protocol.h2.H2Protocol)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None

    async def main() -> tuple[tuple[int, int | None], tuple[int, int | None]]:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve, _answers_401_unread, config,  # type: ignore[arg-type]
                                                shutdown_trigger=trio.sleep_forever))
            port = int(binds[0].rsplit(":", 1)[1])
            request = partial(late_body_then_next, port, None, "/v1/envs", {}, ("/v1/ping", {}))
            first = await trio.to_thread.run_sync(request)
            second = await trio.to_thread.run_sync(request)
            nursery.cancel_scope.cancel()
        return first, second

    with caplog.at_level(logging.WARNING, logger="weenv.api"):
        first, second = trio.run(main)
    assert first == (401, None) and second == (401, None)  # each connection dropped, the server still there
    drops = [r.getMessage() for r in caplog.records if "dropped the HTTP connection" in r.getMessage()]
    assert len(drops) == 2 and all(m.startswith("dropped the HTTP connection from 127.0.0.1:") for m in drops)
    assert all(m.endswith(": KeyError in hypercorn") for m in drops), drops


def test_contain_connections_installs_both_into_hypercorn(monkeypatch: pytest.MonkeyPatch) -> None:
    import hypercorn.protocol
    import hypercorn.trio.run

    from weenv.api._contain import ContainedTCPServer, LateDataH2Protocol, contain_connections

    for module, name in ((hypercorn.trio.run, "TCPServer"), (hypercorn.protocol, "H2Protocol")):
        monkeypatch.setattr(module, name, getattr(module, name))  # put back after the test
    contain_connections()
    contain_connections()  # idempotent
    assert hypercorn.trio.run.TCPServer is ContainedTCPServer
    assert hypercorn.protocol.H2Protocol is LateDataH2Protocol
    monkeypatch.setattr(hypercorn.trio.run, "TCPServer", object)
    with pytest.raises(RuntimeError, match="not hypercorn's own"):
        contain_connections()


# -- a real weenv serve ------------------------------------------------------------------------


def _tls_files(tmp_path: Any) -> tuple[str, str, str]:
    """A CA, and a certificate it signed for 127.0.0.1 (test_api_auth.py's test_tls uses them too)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test's CA and certificate)")
    ca, ca_key = str(tmp_path / "ca.pem"), str(tmp_path / "ca.key")
    cert, key, csr = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), str(tmp_path / "cert.csr")
    ext = tmp_path / "ext.cnf"
    ext.write_text("basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    for argv in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1",
                  "-subj", "/CN=weenv test CA"],
                 ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                  "-days", "1", "-extfile", str(ext)]):
        subprocess.run(["openssl", *argv], check=True, capture_output=True)
    return ca, cert, key


def _still_serving(served: Served, verify: ssl.SSLContext | bool, after: str) -> None:
    """The server process is there and answers GET /v1/ping, over HTTP/1.1 and HTTP/2."""
    ping = {"Authorization": f"Bearer {served.keys['root']}"}
    answers = []
    try:
        for http2 in (False, True):
            with httpx.Client(http1=not http2, http2=http2, verify=verify, timeout=TIMEOUT_S) as c:
                r = c.get(served.url + "/v1/ping", headers=ping)
                answers.append((r.status_code, r.http_version))
    except httpx.TransportError as e:
        with contextlib.suppress(subprocess.TimeoutExpired):
            served.proc.wait(5)  # a server whose nursery failed is on its way out
        pytest.fail(f"weenv serve stopped answering ({e!r}, exit code {served.proc.returncode}) after {after}:\n"
                    f"{served.log()[-3000:]}")
    assert served.proc.poll() is None, f"weenv serve exited after {after}"
    assert answers == [(200, "HTTP/1.1"), (200, "HTTP/2")], after


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["h2c", "h2-tls"])
def test_a_body_going_on_after_the_answer_does_not_stop_the_server(
        transport: str, weenv_serve: Served, daemon: Any, tmp_path: Any) -> None:  # noqa: F811
    tls = ctx = ca = None
    if transport == "h2-tls":
        ca, cert, key = _tls_files(tmp_path)
        tls, ctx = (cert, key), ssl.create_default_context(cafile=ca)
        ctx.set_alpn_protocols(["h2"])
    served = start_serve(weenv_serve.daemon, weenv_serve.keys, tls=tls, ca=ca)
    verify: ssl.SSLContext | bool = ctx or True
    port = int(served.url.rsplit(":", 1)[1])
    alice = {"X-API-Key": served.keys["alice"]}
    sandbox_id = None
    try:
        with httpx.Client(timeout=TIMEOUT_S, verify=verify) as c:  # a sandbox, for a token /files accepts
            r = c.post(served.url + "/sandboxes", json={"templateID": "bb", "timeout": 120}, headers=alice)
            assert r.status_code == 201, r.text
            sandbox_id, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        envd = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983", "Content-Type": "application/octet-stream"}
        cases = [
            ("POST /v1/envs without a key", "/v1/envs", {"Content-Type": "application/json"}, 401),
            ("POST /files without a token", "/files?path=/tmp/late", envd, 401),
            ("a brotli upload to /files (gzip body)", "/files?path=/tmp/late",
             {**envd, "X-Access-Token": token, "Content-Encoding": "br"}, 415),
            ("POST /sandboxes without a key", "/sandboxes", {"Content-Type": "application/json"}, 401),
        ]
        ping = ("/v1/ping", {"Authorization": f"Bearer {served.keys['root']}"})
        gzipped = gzip.compress(b"\0" * CHUNK_BYTES * 4)
        drops_before = served.log().count("dropped the HTTP connection")
        for what, path, headers, status in cases:
            body = _streamed(gzipped) if "gzip" in what else _streamed()
            try:
                with httpx.Client(http1=False, http2=True, verify=verify, timeout=TIMEOUT_S) as c:
                    r = c.post(served.url + path, headers=headers, content=body)
                    got: object = (r.status_code, r.http_version)
            except httpx.TransportError as e:
                got = repr(e)
            _still_serving(served, verify, f"{what} over {transport} (httpx)")
            assert got == (status, "HTTP/2"), what

            got = late_body_then_next(port, ctx, path, headers, ping)
            _still_serving(served, verify, f"{what} over {transport} (h2, DATA after the answer)")
            assert got == (status, 200), f"{what}: (its answer, the next request's on the same connection)"
        # the late DATA was dropped, not the connection
        assert served.log().count("dropped the HTTP connection") == drops_before
    finally:
        if sandbox_id is not None:  # a server that died leaves it to the daemon fixture's cleanup
            with contextlib.suppress(httpx.TransportError):
                httpx.delete(f"{served.url}/sandboxes/{sandbox_id}", headers=alice, verify=verify, timeout=TIMEOUT_S)
        stop_serve(served)
