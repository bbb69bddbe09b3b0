"""Issue 25 on the real ``weenv serve``: what an ordinary (non-admin) API key could do, and now cannot.

Each test is one breach the attack found, tried again with raw HTTP against the real server in
front of the real daemon (docs/security.md, "API keys"): paths read twice, ``%3F``/``%23`` in a
path, a commit ref over an operator's tag, the daemon as an SSRF client, access tokens outliving
their key, multipart bodies spooled on the host, one server-wide watcher cap, public ports and an
existence oracle, the host's loopback through a host-network env's ports, tenant egress into the
node and link-local, and no per-key quota.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import weenv
from weenv.api import KeyStore

from .fixtures_api import Served, served, start_serve, stop_serve, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _raw(served: Served, method: str, raw_path: str, key: str, **kw: Any) -> httpx.Response:
    """A request whose path goes out exactly as written (percent-encodings and all)."""
    url = httpx.URL(served.url).copy_with(raw_path=raw_path.encode("ascii"))
    return httpx.request(method, url, headers={**_bearer(key), **kw.pop("headers", {})}, timeout=30, **kw)


@pytest.fixture
def keys(served: Served) -> Iterator[dict[str, str]]:
    """Keys a test makes (name -> key); revoked after it, their envs with them."""
    made: dict[str, str] = {}
    store = KeyStore(os.path.join(served.home, "api"))

    def make(name: str, **limits: Any) -> str:
        made[name] = store.create(name, limits=limits) if limits else store.create(name)
        return made[name]

    made["make"] = make  # type: ignore[assignment]
    yield made
    for name in [n for n in made if n != "make"]:
        if any(k.name == name for k in store.list()):
            store.revoke(name)


class Listener:
    """A TCP listener on 127.0.0.1 that counts the connections it gets (an "internal service")."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


# -- 1, 2: one parse ------------------------------------------------------------------------------


def test_a_path_is_read_once_and_encoded_separators_are_refused(served: Served) -> None:
    alice, bob = served.keys["alice"], served.keys["bob"]
    with weenv.Client(served.url, token=bob) as c, c.create(served.daemon.plan_lock) as theirs:
        for path in (f"/v1/envs%252F{theirs.id}%252Fexec", f"/v1/envs%2F{theirs.id}%2Fexec",
                     f"/v1/envs/{theirs.id}%252Fexec", f"/v1/envs%252F{theirs.id}%252Ffiles"):
            r = _raw(served, "POST", path, alice, json={"cmd": "echo pwned > /tmp/pwned"})
            assert r.status_code == 400 and r.json()["error"]["kind"] == "bad_path", (path, r.text)
        r = _raw(served, "DELETE", f"/v1/envs%252F{theirs.id}", alice)
        assert r.status_code == 400
        assert theirs.exec("cat /tmp/pwned").exit_code != 0  # nothing ran in bob's env
        assert theirs.exec("true").ok  # and it was not killed
        # admin routes with encoded letters or separators
        for method, path in (("POST", "/v1/%2567c"), ("GET", "/v1/%2574op"), ("GET", "/v1/%256detrics"),
                             ("POST", "/v1/daemon%252Fstop"), ("POST", "/v1/daemon%2Fstop"), ("GET", "/v1/%74op")):
            r = _raw(served, method, path, alice, json={})
            assert r.status_code in (400, 403, 404), (path, r.status_code, r.text)
            assert r.status_code != 200
        assert httpx.get(served.url + "/v1/ping", headers=_bearer(served.keys["root"])).status_code == 200
        # a host-network env with a host bind mount, through an encoded route name
        plan = 'network = "host"\n' + open(served.daemon.plan_toml).read()
        before = len(c.list())
        r = _raw(served, "POST", "/v1/%2565nvs", alice, json={"plan_text": plan})
        assert r.status_code in (400, 404), r.text
        r = _raw(served, "POST", "/v1/%65nvs", alice, json={"plan_text": plan})  # decoded once: the envs route
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
        assert len(c.list()) == before
        # '?' and '#' inside the path would end it early for the next reader
        for path in ("/v1/envs%3F", "/v1/envs%3Fx=1", "/v1/top%23", "/v1/snapshots%23x", "/v1/envs%253F"):
            r = _raw(served, "GET", path, alice)
            assert r.status_code == 400, (path, r.status_code, r.text[:300])
        # the owner filter still holds on the plain route
        r = _raw(served, "GET", "/v1/envs", alice)
        assert theirs.id not in [e["id"] for e in r.json()]


# -- 3, 4: refs ------------------------------------------------------------------------------------


def _tag_digest(home: str, repo: str, tag: str) -> str:
    from weenv.registry._layout import LayoutStore

    data, _ = LayoutStore(os.path.join(home, "store")).get_manifest(repo, tag)
    return hashlib.sha256(data).hexdigest()


def test_a_tenants_commit_ref_goes_under_its_own_namespace(served: Served) -> None:
    before = _tag_digest(served.home, "busybox", "test")  # the operator's os group
    with weenv.Client(served.url, token=served.keys["alice"]) as c, c.create(served.daemon.plan_lock) as env:
        env.write_file("/marker", b"alice was here")
        snap = env.commit(ref="busybox:test")
        alice_id = c.connection.http.get("/v1/quota").json()["key"]["id"]
        assert c.snapshot(snap)["ref"] == f"tenants/{alice_id}/busybox:test"
        assert _tag_digest(served.home, "busybox", "test") == before  # the operator's tag is untouched
    # a plan of bob's naming alice's namespace is refused; alice's own is hers to read
    plan = f'name = "x"\n[[groups]]\nname = "os"\nref = "tenants/{alice_id}/busybox:test"\nclass = "os"\n'
    r = httpx.post(served.url + "/v1/envs", headers=_bearer(served.keys["bob"]), json={"plan_text": plan},
                   timeout=60)
    assert r.status_code == 403 and "their keys' own" in r.json()["error"]["message"]


def test_a_tenants_commit_ref_never_names_a_registry(served: Served) -> None:
    probe = Listener()
    try:
        with weenv.Client(served.url, token=served.keys["alice"]) as c, c.create(served.daemon.plan_lock) as env:
            with pytest.raises(weenv.ApiError) as err:
                env.commit(ref=f"127.0.0.1:{probe.port}/loot:v1")
            assert err.value.status == 403 and "embedded store only" in err.value.detail
            snap = env.commit(ref="tenants/kother/x:v1")
            alice_id = c.connection.http.get("/v1/quota").json()["key"]["id"]
            assert c.snapshot(snap)["ref"] == f"tenants/{alice_id}/tenants/kother/x:v1"
        time.sleep(0.3)
        assert probe.accepted == 0
    finally:
        probe.close()


def test_a_tenants_plan_reads_only_listed_registries(served: Served) -> None:
    probe = Listener()
    try:
        plan = ('name = "ssrf"\n[[groups]]\nname = "os"\nref = "127.0.0.1:%d/loot:v1"\nclass = "os"\n' % probe.port)
        r = httpx.post(served.url + "/v1/envs", headers=_bearer(served.keys["alice"]), json={"plan_text": plan},
                       timeout=30)
        assert r.status_code == 403, r.text
        msg = r.json()["error"]["message"]
        assert f"groups[0].ref '127.0.0.1:{probe.port}/loot:v1'" in msg and "--registry" in msg
        for port in (probe.port, 1):  # an open and a closed port answer the same, before any connect
            plan_p = plan.replace(f"127.0.0.1:{probe.port}", f"127.0.0.1:{port}")
            r2 = httpx.post(served.url + "/v1/envs", headers=_bearer(served.keys["alice"]),
                            json={"plan_text": plan_p}, timeout=30)
            assert r2.status_code == 403 and r2.json()["error"]["message"].replace(f"127.0.0.1:{port}", "H") == \
                msg.replace(f"127.0.0.1:{probe.port}", "H")
        time.sleep(0.3)
        assert probe.accepted == 0  # the daemon never connected
    finally:
        probe.close()


def test_a_tenants_image_is_a_ref_in_a_listed_registry_never_a_node_path(served: Served) -> None:
    probe = Listener()
    try:
        for image, status, words in ((f"127.0.0.1:{probe.port}/loot:v1", 403, "is not one this node reads"),
                                     (f"docker://127.0.0.1:{probe.port}/loot:v1", 403, "--registry"),
                                     ("oci:/var/lib/secret-images:t", 403, "on the node's disk needs an admin key"),
                                     ("docker-archive:/root/img.tar", 403, "on the node's disk needs an admin key")):
            r = httpx.post(served.url + "/v1/envs", headers=_bearer(served.keys["alice"]), json={"image": image},
                           timeout=30)
            assert r.status_code == status and words in r.json()["error"]["message"], (image, r.text)
        time.sleep(0.3)
        assert probe.accepted == 0  # refused before the daemon was asked
    finally:
        probe.close()


# -- 5: revocation ----------------------------------------------------------------------------------


def _envd(served: Served, sandbox_id: str, token: str) -> httpx.Response:
    return httpx.get(served.url + "/files", params={"path": "/etc/passwd"}, timeout=10,
                     headers={"E2b-Sandbox-Id": sandbox_id, "X-Access-Token": token})


def _wait(cond: Any, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def test_revoking_a_key_revokes_its_envs_tokens_and_kills_its_envs(served: Served, keys: dict[str, Any]) -> None:
    carol = keys["make"]("carol")
    sbx = e2b.Sandbox.create("bb", timeout=120, api_key=carol)
    token, sid = sbx._envd_access_token, sbx.sandbox_id
    assert _envd(served, sid, token).status_code == 200
    subprocess.run([sys.executable, "-m", "weenv", "token", "revoke", "carol"], check=True, capture_output=True,
                   env=served.daemon.env_vars())
    assert _envd(served, sid, token).status_code == 401  # at once, before the env is gone
    r = httpx.post(served.url + "/process.Process/List", json={}, timeout=10,
                   headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token, "Connect-Protocol-Version": "1"})
    assert r.status_code == 401
    with served.daemon.client() as node:
        assert _wait(lambda: sid not in [e["id"] for e in node.list()]), "the revoked key's env still runs"
    # a new key with the same name is another key: nothing of the old one's
    carol2 = keys["make"]("carol")
    assert e2b.Sandbox.list(api_key=carol2).next_items() == []
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.get_info(sid, api_key=carol2)


def test_revoking_a_key_with_keep_envs_hands_them_to_admins(served: Served, keys: dict[str, Any]) -> None:
    dave = keys["make"]("dave")
    sbx = e2b.Sandbox.create("bb", timeout=120, api_key=dave)
    sid, token = sbx.sandbox_id, sbx._envd_access_token
    try:
        subprocess.run([sys.executable, "-m", "weenv", "token", "revoke", "dave", "--keep-envs"], check=True,
                       capture_output=True, env=served.daemon.env_vars())
        assert _envd(served, sid, token).status_code == 401
        time.sleep(2.5)  # past a housekeeping pass
        info = e2b.Sandbox.get_info(sid, api_key=served.keys["root"])  # the env runs on, for admin keys
        assert info.sandbox_id == sid
        dave2 = keys["make"]("dave")
        with pytest.raises(e2b.NotFoundException):
            e2b.Sandbox.get_info(sid, api_key=dave2)
        admin_token = e2b.Sandbox.connect(sid, api_key=served.keys["root"])._envd_access_token
        assert admin_token != token and _envd(served, sid, admin_token).status_code == 200
    finally:
        e2b.Sandbox.kill(sid, api_key=served.keys["root"])


# -- 6: uploads ----------------------------------------------------------------------------------------


def _spooled_bytes(pid: int, path: str) -> int:
    """Bytes in files under ``path`` that process ``pid`` has open (a temporary file made with
    O_TMPFILE, or unlinked at once, has no name to look for: its descriptor is what shows it)."""
    total = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return 0
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(path):
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_size
        except (FileNotFoundError, PermissionError):
            pass
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def test_a_multipart_upload_is_streamed_never_spooled_on_the_host(weenv_serve: Served) -> None:
    """201 MiB of multipart to an env whose disk is 64 MiB: refused by the env's disk, and not one
    byte in the server's temporary directory meanwhile (it spooled the whole body before)."""
    spool = tempfile.mkdtemp(prefix="weenv-spool-")
    served2 = start_serve(weenv_serve.daemon, weenv_serve.keys, env={"TMPDIR": spool})
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _spooled_bytes(served2.proc.pid, spool))
            time.sleep(0.05)

    try:
        sbx = e2b.Sandbox.create("bb", timeout=120, api_key=served2.keys["alice"], api_url=served2.url,
                                 sandbox_url=served2.url)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        boundary = "weenvboundary"

        def body() -> Iterator[bytes]:
            yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/big\"\r\n"
                   "Content-Type: application/octet-stream\r\n\r\n").encode()
            chunk = b"\0" * (1 << 20)
            for _ in range(201):
                yield chunk
            yield f"\r\n--{boundary}--\r\n".encode()

        try:
            r = httpx.post(served2.url + "/files", content=body(), timeout=120,
                           headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
                                    "Content-Type": f"multipart/form-data; boundary={boundary}"})
            status, text = r.status_code, r.text
        except httpx.TransportError as e:  # the server may close once the env's disk refused
            status, text = 0, str(e)
        stop.set()
        watcher.join(2)
        assert peak[0] == 0, f"{peak[0]} bytes spooled in the server's TMPDIR"
        assert status != 200 or "error" in text, text[:300]
        if status:
            assert 400 <= status < 600 and ("space" in text.lower() or "too large" in text.lower()), text[:300]
        # a small multipart upload still works, streamed
        sbx.files.write("/tmp/small.txt", "hello")
        assert sbx.files.read("/tmp/small.txt") == "hello"
        sbx.kill()
    finally:
        stop.set()
        stop_serve(served2)
        os.rmdir(spool) if not os.listdir(spool) else None


# -- 7: watchers --------------------------------------------------------------------------------------


def _quota(served: Served, key: str) -> dict[str, Any]:
    return httpx.get(served.url + "/v1/quota", headers=_bearer(key), timeout=10).json()  # type: ignore[no-any-return]


def test_watchers_are_a_per_key_quota_and_go_with_their_env(served: Served, keys: dict[str, Any]) -> None:
    wally = keys["make"]("wally", watchers=3)
    sbx = e2b.Sandbox.create("bb", timeout=120, api_key=wally)
    other = e2b.Sandbox.create("bb", timeout=120, api_key=served.keys["bob"])
    try:
        handles = [sbx.files.watch_dir("/tmp") for _ in range(3)]
        with pytest.raises(e2b.SandboxException) as err:
            sbx.files.watch_dir("/tmp")
        assert "watchers limit" in str(err.value) and "wally" in str(err.value)
        assert _quota(served, wally)["usage"]["watchers"] == 3
        extra = other.files.watch_dir("/tmp")  # bob is not held up by wally
        extra.stop()
        handles[0].stop()
        sbx.files.watch_dir("/tmp")  # room again
        sbx.kill()  # the env goes: its watchers with it
        assert _quota(served, wally)["usage"]["watchers"] == 0
        # an env that goes without the API seeing it (killed on the node): swept within seconds
        sbx2 = e2b.Sandbox.create("bb", timeout=120, api_key=wally)
        sbx2.files.watch_dir("/tmp")
        with served.daemon.client() as node:
            node.get(sbx2.sandbox_id).kill()
        assert _wait(lambda: _quota(served, wally)["usage"]["watchers"] == 0, 12)
    finally:
        other.kill()


# -- 9, 10: ports ---------------------------------------------------------------------------------


def _httpd(env: weenv.Env, port: int) -> None:
    env.write_file("/tmp/www/index.html", b"hello from the env\n")
    env.spawn(f"busybox httpd -f -p 127.0.0.1:{port} -h /tmp/www").detach()


def _port_get(served: Served, env_id: str, port: int, **headers: str) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{served.url}/proxy/{env_id}/{port}/index.html", headers=headers, timeout=10)
        if r.status_code != 502 or not headers or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_v1_env_ports_need_a_token_and_refusals_all_look_the_same(served: Served) -> None:
    with weenv.Client(served.url, token=served.keys["alice"]) as c, \
            c.create(served.daemon.plan_lock, network="loopback") as env:
        token = env.info["access_token"]
        _httpd(env, 8000)
        r = _port_get(served, env.id, 8000, **{"X-Access-Token": token})
        assert r.status_code == 200 and r.text == "hello from the env\n"
        r = _port_get(served, env.id, 8000, **{"e2b-traffic-access-token": env.info["traffic_token"]})
        assert r.status_code == 200
        refused = [
            _port_get(served, env.id, 8000),  # no credential
            _port_get(served, env.id, 8000, **{"X-Access-Token": "wea_forged"}),
            httpx.get(f"{served.url}/proxy/{env.id[:-1]}x/8000/index.html", timeout=10),  # no such env
            httpx.get(f"{served.url}/proxy/{env.id}/8001/index.html", headers={"X-Access-Token": token}, timeout=10),
        ]
        bodies = {(x.status_code, x.json()["message"].replace(env.id[:-1] + "x", env.id).replace("8001", "8000"))
                  for x in refused}
        assert len(bodies) == 1, bodies  # an unknown env, a closed port and a refusal answer the same
        with weenv.Client(served.url, token=served.keys["alice"]) as c2:
            r = httpx.post(served.url + "/v1/envs", headers=_bearer(served.keys["alice"]), timeout=60,
                           json={"plan_text": open(served.daemon.plan_lock).read(), "public_traffic": True,
                                 "overrides": {"network": "loopback"}})
            public = weenv.Env(c2, r.json())
            try:
                _httpd(public, 8000)
                assert _port_get(served, public.id, 8000, **{"X-Access-Token": r.json()["access_token"]}) \
                    .status_code == 200
                assert _port_get(served, public.id, 8000).status_code == 200  # its owner made it public
            finally:
                public.kill()


class _HostService(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:  # noqa: N802
        type(self).hits += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"the node's own service\n")

    def log_message(self, *a: Any) -> None:
        pass


def test_a_host_network_envs_ports_never_reach_the_nodes_loopback(served: Served) -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostService)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        with weenv.Client(served.url, token=served.keys["root"]) as c, \
                c.create(served.daemon.plan_lock, network="host") as env:
            token = e2b.Sandbox.connect(env.id, api_key=served.keys["root"])._envd_access_token
            r = httpx.get(f"{served.url}/proxy/{env.id}/{port}/", headers={"X-Access-Token": token}, timeout=10)
            assert r.status_code == 502 and "no open port" in r.json()["message"], r.text
            r = httpx.post(f"{served.url}/v1/envs/{env.id}/ports/{port}", headers=_bearer(served.keys["root"]),
                           content=b"GET / HTTP/1.0\r\n\r\n", timeout=10)
            assert r.status_code == 409 and "node's network" in r.json()["error"]["message"]
        assert _HostService.hits == 0
    finally:
        httpd.shutdown()
        httpd.server_close()


# -- 11: tenant egress -------------------------------------------------------------------------------


def test_a_tenants_egress_cannot_name_the_node_or_link_local(served: Served) -> None:
    plan = open(served.daemon.plan_toml).read()
    for entry in ("node:8000", "169.254.169.254", "169.254.0.0/16", "127.0.0.1:22"):
        doc = plan + f'\n[network]\nmode = "egress"\nallow = ["{entry}"]\n'
        r = httpx.post(served.url + "/v1/envs", headers=_bearer(served.keys["alice"]), json={"plan_text": doc},
                       timeout=60)
        assert r.status_code == 400 and entry in r.json()["error"]["message"], (entry, r.text)
    with pytest.raises(e2b.SandboxException) as err:
        e2b.Sandbox.create("bb", timeout=60, network={"allow_out": ["169.254.169.254"], "deny_out": ["0.0.0.0/0"]})
    assert "169.254.169.254" in str(err.value)


# -- 12: quotas -------------------------------------------------------------------------------------


def test_a_keys_envs_cores_and_creates_are_bounded_and_the_answer_names_the_limit(
        served: Served, keys: dict[str, Any]) -> None:
    quinn = keys["make"]("quinn", envs=2)
    lock = served.daemon.plan_lock
    with weenv.Client(served.url, token=quinn) as c, c.create(lock), c.create(lock):
        with pytest.raises(weenv.ApiError) as err:
            c.create(lock)
        assert err.value.status == 429 and err.value.kind == "quota_exceeded"
        assert "envs limit" in err.value.detail and "weenv token limits quinn --envs" in err.value.detail
        with pytest.raises(e2b.RateLimitException):
            e2b.Sandbox.create("bb", timeout=60, api_key=quinn)
        with weenv.Client(served.url, token=served.keys["bob"]) as b, b.create(lock) as mine:
            assert mine.exec("true").ok  # another key is not held up
        q = _quota(served, quinn)
        assert q["limits"]["envs"] == 2 and q["usage"]["envs"] == 2
    carl = keys["make"]("carl", cores=0.1)  # the busybox plan's minimum is 0.05 cores
    with weenv.Client(served.url, token=carl) as c, c.create(lock), c.create(lock):
        with pytest.raises(weenv.ApiError) as err:
            c.create(lock)
        assert err.value.status == 429 and "cores limit" in err.value.detail
    rita = keys["make"]("rita", creates_per_min=2)
    with weenv.Client(served.url, token=rita) as c:
        for _ in range(2):
            c.create(lock).kill()
        with pytest.raises(weenv.ApiError) as err:
            c.create(lock)
        assert err.value.status == 429 and "a minute" in err.value.detail


def test_a_keys_running_processes_are_bounded(served: Served, keys: dict[str, Any]) -> None:
    paul = keys["make"]("paul", processes=2)
    with weenv.Client(served.url, token=paul) as c, c.create(served.daemon.plan_lock) as env:
        first = env.spawn("sleep 30")
        env.spawn("sleep 30").detach()
        with pytest.raises(weenv.ApiError) as err:
            env.spawn("sleep 30")
        assert err.value.status == 429 and "processes limit" in err.value.detail
        first.kill()
        first.wait()
        env.exec("true")  # one ended: room for one again (the API counts what still runs)


def test_token_create_limits_and_defaults_on_the_command_line(served: Served) -> None:
    env = served.daemon.env_vars()

    def weenv_cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "weenv", "token", *args], check=True, capture_output=True,
                              text=True, env=env).stdout

    weenv_cli("create", "--name", "lim", "--envs", "3", "--memory", "1GiB")
    try:
        out = weenv_cli("limits", "lim")
        assert "envs=3" in out and f"memory={1 << 30}" in out and "watchers=256" in out
        assert "envs=5" in weenv_cli("limits", "lim", "--envs", "5")
        bad = subprocess.run([sys.executable, "-m", "weenv", "token", "limits", "lim", "--memory", "lots"],
                             capture_output=True, text=True, env=env)
        assert bad.returncode != 0 and "--memory" in bad.stderr
    finally:
        weenv_cli("revoke", "lim")
    assert json.loads(subprocess.run([sys.executable, "-m", "weenv", "token", "ls", "--json"], check=True,
                                     capture_output=True, text=True, env=env).stdout)
