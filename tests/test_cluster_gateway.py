"""The gateway's parts that need no Ray: the node API's token gate (a real TCP listener in front of a
real Unix socket) and how a create body becomes a placement request. The gateway itself, through a
real 3-node Ray cluster, is in tests/test_cluster_ray.py."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from weenv.cluster import PlacementError, PlacementRequest
from weenv.cluster._agent import token_digest
from weenv._wire import HttpError
from weenv.cluster._backend import ClusterBackend
from weenv.cluster._nodeapi import NodeApi, bearer_of

MiB = 1 << 20


def _fake_daemon(path: str, stop: threading.Event) -> threading.Thread:
    """A Unix socket answering every request with the request line it got (keep-alive)."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(8)
    srv.settimeout(0.2)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                buf = b""
                while not stop.is_set():
                    data = conn.recv(65536)
                    if not data:
                        break
                    buf += data
                    while b"\r\n\r\n" in buf:
                        head, buf = buf.split(b"\r\n\r\n", 1)
                        body = head.split(b"\r\n", 1)[0]
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_the_node_api_needs_the_cluster_token_then_splices_to_the_daemon(tmp_path):
    path = str(tmp_path / "weenv.sock")
    stop = threading.Event()
    thread = _fake_daemon(path, stop)
    api = NodeApi(path, token_digest("s3cret") or "", "127.0.0.1").start()
    try:
        assert api.url.startswith("http://127.0.0.1:")
        none = httpx.get(api.url + "/v1/envs", timeout=5)
        assert none.status_code == 401 and "cluster token" in none.json()["error"]["message"]
        assert httpx.get(api.url + "/v1/envs", headers={"Authorization": "Bearer nope"}, timeout=5).status_code == 401
        assert api.refused == 2
        with httpx.Client(base_url=api.url, headers={"Authorization": "Bearer s3cret"}, timeout=5) as c:
            assert c.get("/v1/envs").text == "GET /v1/envs HTTP/1.1"
            assert c.post("/v1/envs/x/exec", content=b"{}").text == "POST /v1/envs/x/exec HTTP/1.1"  # same connection
    finally:
        api.stop()
        stop.set()
        thread.join(5)
    with pytest.raises(httpx.TransportError):
        httpx.get(api.url + "/v1/envs", timeout=2)


def test_a_node_api_without_a_token_is_refused():
    with pytest.raises(ValueError, match="cluster token"):
        NodeApi("/nonexistent", "", "127.0.0.1")


def test_bearer_of_reads_only_the_authorization_header():
    assert bearer_of(b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer abc") == "abc"
    assert bearer_of(b"GET / HTTP/1.1\r\nauthorization: bearer  abc ") == "abc"
    assert bearer_of(b"GET / HTTP/1.1\r\nX-Authorization: Bearer abc") is None
    assert bearer_of(b"GET / HTTP/1.1\r\nAuthorization: Basic abc") is None


class _FakeCluster:
    """Only what request_for_body reads (a unit test of how a body becomes a request)."""

    def placement_request(self, plan, snapshot):
        return PlacementRequest(layers=(("sha256:" + "a" * 64, 5 * MiB),), cpu_min_cores=0.05,
                                memory_min_bytes=32 * MiB, memory_max_bytes=256 * MiB), {}


def test_a_create_body_becomes_a_placement_request_with_its_overrides():
    backend = ClusterBackend(_FakeCluster(), "tok")  # type: ignore[arg-type]
    lock = {"lock_version": 1, "name": "p", "groups": [{
        "name": "os", "ref": "127.0.0.1:5000/ct/os:t", "class": "os", "digest": "sha256:" + "b" * 64,
        "layer_digest": "sha256:" + "a" * 64, "layer_size": 5 * MiB, "toc_digest": "sha256:" + "c" * 64,
        "registry": "127.0.0.1:5000", "repo": "ct/os"}]}  # read by the plan codec: a lock it accepts
    req = backend.request_for_body({"plan": lock, "overrides": {"cpu": "0.9-1", "memory": "64MiB-1GiB"}})
    assert req.cpu_min_cores == 0.9 and req.memory_min_bytes == 64 * MiB and req.memory_max_bytes == 1 << 30
    assert req.layers  # the lock's layers: what cache affinity counts
    text = backend.request_for_body({"plan_text": __import__("json").dumps(lock), "format": "json"})
    assert text.cpu_min_cores == 0.05 and text.layers
    plain = backend.request_for_body({"plan": {"name": "p", "groups": [{"name": "os", "ref": "debian:12", "class": "os"}],
                                               "resources": {"cpu": {"min": 0.5}}}})
    assert plain.cpu_min_cores == 0.5 and plain.layers == ()  # not a lock: minimums and load only
    with pytest.raises(HttpError, match="overrides") as bad:
        backend.request_for_body({"plan": lock, "overrides": {"cpu": "lots"}})
    assert (bad.value.status, bad.value.kind) == (400, "bad_request")  # the caller's mistake: not a full node


def test_the_gateway_backend_needs_the_cluster_token():
    from weenv.cluster import ClusterError

    with pytest.raises(ClusterError, match="cluster token"):
        ClusterBackend(_FakeCluster(), "")  # type: ignore[arg-type]



def test_a_ray_client_address_without_rays_client_installed_says_what_to_install(monkeypatch):
    import sys

    import weenv
    from weenv.cluster import ClusterError
    from weenv.cluster._cluster import join_ray

    monkeypatch.setitem(sys.modules, "grpc", None)  # as without ray[client]: `import grpc` raises ImportError
    with pytest.raises(ClusterError, match=r"ray://127\.0\.0\.1:1: a ray:// address needs Ray's client.*"
                                           r"pip install 'ray\[client\]'"):
        join_ray("ray://127.0.0.1:1", namespace="weenv")
    from weenv.cluster import client

    with pytest.raises(ClusterError, match="needs Ray's client"):
        client("ray://127.0.0.1:1")  # the lookup of the gateway goes the same way
    with pytest.raises(weenv.WeenvError, match=r"weenv\.cluster\.client"):
        weenv.Client("ray://127.0.0.1:1")  # the client itself knows no cluster: it says where to look


def test_an_env_port_tunnel_reaches_the_daemon_through_its_node_api_with_the_cluster_token(tmp_path):
    # what the gateway does for get_host(port) traffic: the daemon's port tunnel, over the node's TCP API
    import trio

    from weenv import AsyncClient
    from weenv.api._proxy import Tunnel, TunnelError

    path = str(tmp_path / "weenv.sock")
    stop = threading.Event()
    thread = _fake_daemon(path, stop)
    api = NodeApi(path, token_digest("s3cret") or "", "127.0.0.1").start()

    async def main() -> None:
        clients = [AsyncClient(api.url, token=t, autostart=False) for t in ("s3cret", "wrong")]
        try:
            tunnel = await Tunnel.open(clients[0], "n1-bb-0a", 8000)
            try:
                assert await tunnel.receive() == b"POST /v1/envs/n1-bb-0a/ports/8000 HTTP/1.1"
            finally:
                await tunnel.aclose()
            with pytest.raises(TunnelError, match="cluster token") as refused:
                await Tunnel.open(clients[1], "n1-bb-0a", 8000)
            assert refused.value.status == 401
            with pytest.raises(TunnelError, match="plain http:// only") as tls:
                await Tunnel.open(AsyncClient("https://127.0.0.1:1", token="x", autostart=False), "n1-bb-0a", 8000)
            assert tls.value.status == 501
        finally:
            for c in clients:
                await c.aclose()

    try:
        trio.run(main)
        assert api.refused == 1
    finally:
        api.stop()
        stop.set()
        thread.join(5)
