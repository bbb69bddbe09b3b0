"""Env ports through ``weenv serve``: E2B's ``get_host(port)`` host names and ``/proxy/{id}/{port}``,
reaching servers started in a real crun env (busybox httpd, a shell WebSocket server) over the
daemon's tunnel into the env's network namespace; public traffic off needs the traffic token."""

from __future__ import annotations

import socket
import time
import urllib.parse

import httpx
import pytest

from .fixtures_api import Served, served, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


def _wait_http(url: str, host: str, headers: dict[str, str] | None = None) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(url, headers={"Host": host, **(headers or {})}, timeout=5)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)  # the server in the env is not listening yet


def _httpd(sbx, port: int) -> None:  # type: ignore[no-untyped-def]
    sbx.files.write("/tmp/www/index.html", "hello from the env\n")
    sbx.commands.run(f"busybox httpd -f -p 127.0.0.1:{port} -h /tmp/www", background=True).disconnect()


def test_get_host_reaches_an_http_server_in_the_env(served: Served) -> None:
    sbx = e2b.Sandbox.create("bb", timeout=120)
    try:
        _httpd(sbx, 8000)
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.weenv.test"
        r = _wait_http(served.url + "/index.html", host)
        assert r.status_code == 200 and r.text == "hello from the env\n"
        r = httpx.get(served.url + "/nope.html", headers={"Host": host}, timeout=5)
        assert r.status_code == 404  # the env's server answered
        r = httpx.get(f"{served.url}/proxy/{sbx.sandbox_id}/8000/index.html", timeout=5)
        assert r.status_code == 200 and r.text == "hello from the env\n"
        closed = httpx.get(served.url + "/", headers={"Host": sbx.get_host(8001)}, timeout=5)
        assert closed.status_code == 502 and "no open port 8001" in closed.json()["message"]
        unknown = httpx.get(served.url + "/", headers={"Host": f"8001-{sbx.sandbox_id[:-1]}x.weenv.test"}, timeout=5)
        assert (unknown.status_code, unknown.json()["message"].replace(sbx.sandbox_id[:-1] + "x", sbx.sandbox_id)) \
            == (502, closed.json()["message"])  # a closed port and an unknown sandbox answer the same
    finally:
        sbx.kill()


def test_private_traffic_needs_the_traffic_token(served: Served) -> None:
    sbx = e2b.Sandbox.create("bb", timeout=120, network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token and token != sbx._envd_access_token
        _httpd(sbx, 8000)
        host = sbx.get_host(8000)
        r = _wait_http(served.url + "/index.html", host, {"e2b-traffic-access-token": token})
        assert r.status_code == 200 and r.text == "hello from the env\n"
        r = httpx.get(served.url + "/index.html", headers={"Host": host}, timeout=5)
        assert r.status_code == 502 and "no open port 8000" in r.json()["message"]  # as if nothing listened
        r = httpx.get(served.url + "/index.html", headers={"Host": host, "e2b-traffic-access-token": "wet_x"},
                      timeout=5)
        assert r.status_code == 502
        r = httpx.get(served.url + "/index.html", headers={"Host": host, "X-Access-Token": sbx._envd_access_token},
                      timeout=5)
        assert r.status_code == 200  # the env's access token opens its ports too
    finally:
        sbx.kill()


_WS_SERVER = r"""
while true; do nc -l -p 9000 -e /bin/sh -c '
read -r line
key=
while read -r h; do
  h=$(printf %s "$h" | tr -d "\r")
  [ -z "$h" ] && break
  case "$h" in Sec-WebSocket-Key:*|sec-websocket-key:*) key=${h#*: };; esac
done
acc=$(printf %s "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -c1-40 | sed "s/../\\\\x&/g")
acc=$(printf "$acc" | base64)
printf "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n" "$acc"
printf "\201\005hello"
sleep 5
'; done
"""


def test_websocket_through_get_host(served: Served) -> None:
    from wsproto import ConnectionType, WSConnection
    from wsproto import events as ws

    sbx = e2b.Sandbox.create("bb", timeout=120)
    try:
        sbx.files.write("/tmp/ws.sh", _WS_SERVER)
        sbx.commands.run("sh /tmp/ws.sh", background=True).disconnect()
        u = urllib.parse.urlsplit(served.url)
        deadline = time.monotonic() + 10
        while True:
            conn = WSConnection(ConnectionType.CLIENT)
            with socket.create_connection((u.hostname, u.port), timeout=5) as s:
                s.sendall(conn.send(ws.Request(host=sbx.get_host(9000), target="/echo")))
                got: list[object] = []
                while not any(isinstance(e, (ws.TextMessage, ws.RejectConnection, ws.CloseConnection)) for e in got):
                    data = s.recv(65536)
                    conn.receive_data(data or None)
                    got += list(conn.events())
                    if not data:
                        break
            if any(isinstance(e, ws.TextMessage) for e in got) or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # nc was not listening yet
        assert any(isinstance(e, ws.AcceptConnection) for e in got), got
        assert [e.data for e in got if isinstance(e, ws.TextMessage)] == ["hello"]
    finally:
        sbx.kill()


_ECHO_HOST = r"""
host=
while read -r h; do
  h=$(printf %s "$h" | tr -d "\r")
  [ -z "$h" ] && break
  case "$h" in [Hh]ost:*) host=${h#*: };; esac
done
printf 'HTTP/1.0 200 OK\r\nContent-Length: %s\r\n\r\n%s' "${#host}" "$host"
"""


def test_mask_request_host_is_the_host_the_env_sees(served: Served) -> None:
    """Issue 29 item 13: ``network.mask_request_host`` (``${PORT}`` replaced) is the Host header the
    env's server gets on proxied requests; a mask that is not a host name is a 400 naming it."""
    sbx = e2b.Sandbox.create("bb", timeout=120, network={"mask_request_host": "${PORT}-masked.example.test"})
    try:
        # a server that answers with the Host header it got (it reads the request before it answers)
        sbx.files.write("/tmp/echo-host.sh", _ECHO_HOST)
        sbx.commands.run("while true; do nc -l -p 8002 -e /bin/sh /tmp/echo-host.sh; done", background=True).disconnect()
        r = _wait_http(served.url + "/seen", sbx.get_host(8002))
        assert (r.status_code, r.text) == (200, "8002-masked.example.test"), r.text
    finally:
        sbx.kill()
    with pytest.raises(e2b.SandboxException, match="maskRequestHost"):
        e2b.Sandbox.create("bb", timeout=60, network={"mask_request_host": "evil\r\nX-Injected: 1"})
