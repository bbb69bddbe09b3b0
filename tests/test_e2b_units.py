"""weenv serve's logic without a daemon: the app over httpx's ASGI transport with a fake daemon
client, the key store, the Gate's routing, the watcher's diff and a stream's deadline."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from typing import Any

import httpx
import pytest
from starlette.datastructures import Headers

import weenv
from weenv.api._common import env_token
from weenv.api import NodeBackend, KeyStore, StoreError, TemplateStore, create_app
from weenv.api._app import sandbox_target
from weenv.api._connect import END_STREAM, EnvelopeReader
from weenv.testing import ScriptedDaemon

e2b = pytest.importorskip("e2b")


@pytest.fixture
def home(tmp_path: Any) -> str:
    return str(tmp_path / "api")


def _call(app: Any, method: str, url: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, url, **kw)
    return asyncio.run(go())


def test_full_node_is_a_rate_limit(home: str, tmp_path: Any) -> None:
    from e2b.api import handle_api_exception

    lock = tmp_path / "x.lock.toml"
    lock.write_text('name = "x"\n')
    TemplateStore(home).set("base", str(lock))
    key = KeyStore(home).create("ci")
    daemon = ScriptedDaemon({("POST", "/v1/envs"): weenv.ApiError(503, "not_admitted", "the node is full")})
    app = create_app(NodeBackend(client=daemon), home=home)
    r = _call(app, "POST", "/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": key})
    assert r.status_code == 429 and r.json() == {"code": 429, "message": "the node is full"}
    assert isinstance(handle_api_exception(r), e2b.RateLimitException)


def test_unknown_template_and_foreign_env_are_404(home: str) -> None:
    from weenv.api import OwnerTable

    alice, bob = KeyStore(home).create("alice"), KeyStore(home).create("bob")
    OwnerTable(home).put_env("e-1", {"owner": "alice"})
    daemon = ScriptedDaemon({("GET", "/v1/envs/e-1"): {"id": "e-1", "status": "running", "created_s": 1.0}})
    app = create_app(NodeBackend(client=daemon), home=home)
    r = _call(app, "POST", "/sandboxes", json={"templateID": "nope"}, headers={"X-API-Key": alice})
    assert r.status_code == 404 and "template 'nope' not found" in r.json()["message"]
    assert _call(app, "GET", "/sandboxes/e-1", headers={"X-API-Key": bob}).status_code == 404
    assert daemon.calls == []  # refused before the daemon was asked
    r = _call(app, "GET", "/sandboxes/e-1", headers={"X-API-Key": alice})
    assert r.status_code == 200 and r.json()["sandboxID"] == "e-1" and r.json()["envdAccessToken"].startswith("wea_")
    r = _call(app, "POST", "/sandboxes", content=b"{not json", headers={"X-API-Key": alice})
    assert r.status_code == 400 and "request body" in r.json()["message"]


def test_gate_routes_and_refuses(home: str) -> None:
    app = create_app(NodeBackend(client=ScriptedDaemon({})), home=home)
    token = env_token(app.state, "e-1", app.state.owners.env("e-1"))
    base = {"E2b-Sandbox-Id": "e-1", "X-Access-Token": token}
    r = _call(app, "GET", "/health", headers={**base, "E2b-Sandbox-Port": "8080"})
    assert r.status_code == 503  # its token opens its ports; its daemon does not answer
    r = _call(app, "GET", "/proxy/e-1/8080/x")  # no credential: the one answer for every refusal
    assert r.status_code == 502 and "e-1" in r.json()["message"] and "no open port 8080" in r.json()["message"]
    assert _call(app, "GET", "/proxy/e-9/8080/x").json() == {"code": 502, "message": r.json()["message"].replace(
        "e-1", "e-9")}
    r = _call(app, "GET", "/health", headers={"E2b-Sandbox-Id": "e-1", "X-Access-Token": env_token(app.state, "e-2", app.state.owners.env("e-2"))})
    assert r.status_code == 401
    assert app.state.metrics.auth_failures.labels("envd", "wrong_token")._value.get() == 1
    assert _call(app, "GET", "/health", headers={**base}).status_code == 502  # the daemon knows no e-1
    r = _call(app, "POST", "/process.Process/SendSignal", json={}, headers=base)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument" and "pid or a tag" in r.json()["message"]
    r = _call(app, "POST", "/process.Process/NoSuch", json={}, headers=base)
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"


def test_sandbox_target() -> None:
    assert sandbox_target(Headers({"e2b-sandbox-id": "a-1", "e2b-sandbox-port": "49983"}), None) == ("a-1", 49983)
    assert sandbox_target(Headers({"host": "49983-a-1.sbx.test:443"}), "sbx.test") == ("a-1", 49983)
    assert sandbox_target(Headers({"host": "8000-bb-12ab.SBX.test"}), "sbx.test") == ("bb-12ab", 8000)
    assert sandbox_target(Headers({"host": "api.sbx.test"}), "sbx.test") is None
    assert sandbox_target(Headers({"host": "49983-a-1.other.test"}), "sbx.test") is None
    assert sandbox_target(Headers({"host": "49983-a-1.sbx.test"}), None) is None


def test_key_store(home: str) -> None:
    store = KeyStore(home)
    key = store.create("ci", admin=True)
    assert store.verify(key).name == "ci" and store.verify(key).admin
    assert store.verify(key + "x") is None and store.verify("") is None and store.verify(None) is None
    assert stat.S_IMODE(os.stat(os.path.join(home, "keys.json")).st_mode) == 0o600
    assert key not in open(os.path.join(home, "keys.json")).read()
    with pytest.raises(StoreError, match="exists already"):
        store.create("ci")
    with pytest.raises(StoreError, match="key name 'a b'"):
        store.create("a b")
    KeyStore(home).revoke("ci")  # another instance (another process): seen on the next verify
    assert store.verify(key) is None
    with pytest.raises(StoreError, match="no key named 'ci'"):
        store.revoke("ci")


def test_template_store(home: str, tmp_path: Any) -> None:
    t = TemplateStore(home)
    assert t.set("s", "snap-0123") == {"snapshot": "snap-0123"}
    with pytest.raises(StoreError, match="neither a lock/plan file nor a snapshot id"):
        t.set("x", str(tmp_path / "missing.lock"))
    t.remove("s")
    assert t.list() == {}


def test_watch_diff() -> None:
    from weenv.api._envd_fs import _diff

    old = {"a": ("file", 1, 1.0), "d": ("dir", 0, 1.0), "gone": ("file", 1, 1.0)}
    new = {"a": ("file", 2, 2.0), "d": ("dir", 0, 5.0), "new": ("file", 3, 2.0)}
    assert _diff(old, new) == [{"name": "new", "type": "EVENT_TYPE_CREATE"}, {"name": "new", "type": "EVENT_TYPE_WRITE"},
                               {"name": "a", "type": "EVENT_TYPE_WRITE"}, {"name": "gone", "type": "EVENT_TYPE_REMOVE"}]


def test_stream_deadline_ends_with_deadline_exceeded() -> None:
    import time

    from weenv.api._envd import _stream

    async def forever() -> Any:
        yield {"start": {}}
        while True:
            await asyncio.sleep(1)
            yield {"keepalive": {}}

    async def go() -> list[tuple[int, bytes]]:
        frames = [f async for f in _stream(forever(), time.monotonic() + 0.1)]
        reader = EnvelopeReader()
        return [m for f in frames for m in reader.feed(f)]

    msgs = asyncio.run(go())
    assert msgs[0] == (0, b'{"start":{}}')
    assert msgs[-1][0] == END_STREAM and json.loads(msgs[-1][1])["error"]["code"] == "deadline_exceeded"


def test_a_process_stream_writes_what_is_ready_together() -> None:
    """The headers go with the first event (not before the spawn), events already read share a
    write, and the end event shares one with the end of the stream (each write to the SDK's TCP
    connection is a wakeup of the client)."""
    from weenv.api._envd import PROCESS_KEEPALIVE, EventStream

    async def events() -> Any:
        yield {"event": {"start": {"pid": 7}}}
        yield {"event": {"data": {"stdout": "aGk="}}}
        await asyncio.sleep(0.05)
        yield {"event": {"end": {"exitCode": 0}}}

    async def go() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(60)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await EventStream(events(), None, 30.0, PROCESS_KEEPALIVE)({}, receive, send)
        return sent

    sent = asyncio.run(go())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    first, last = (list(EnvelopeReader().feed(m["body"])) for m in sent[1:])
    assert [json.loads(d) for _, d in first] == [{"event": {"start": {"pid": 7}}},
                                                 {"event": {"data": {"stdout": "aGk="}}}]
    assert sent[1]["more_body"] and not sent[2]["more_body"]
    assert [f for f, _ in last] == [0, END_STREAM] and json.loads(last[0][1]) == {"event": {"end": {"exitCode": 0}}}


def test_egress_policy_keeps_e2bs_meaning() -> None:
    from weenv.api._e2b import egress_policy

    assert egress_policy(None, None, None) is None
    assert egress_policy(["1.2.3.4"], ["0.0.0.0/0"], None) == {"mode": "egress", "allow": ["1.2.3.4"], "deny": []}
    assert egress_policy(None, None, False) == {"mode": "egress", "allow": [], "deny": []}
    assert egress_policy(None, ["10.0.0.0/8"], None) == {"mode": "egress", "allow": ["0.0.0.0/0"],
                                                         "deny": ["10.0.0.0/8"]}
    assert egress_policy(["x.example"], None, True) == {"mode": "egress", "allow": ["0.0.0.0/0", "x.example"],
                                                        "deny": []}


def test_refresh_sets_the_ttl(home: str) -> None:
    from weenv.api import OwnerTable

    alice = KeyStore(home).create("alice")
    OwnerTable(home).put_env("e-1", {"owner": "alice", "timeout_s": 300})
    daemon = ScriptedDaemon({("GET", "/v1/envs/e-1"): {"id": "e-1", "status": "running", "created_s": 1.0},
                         ("POST", "/v1/envs/e-1/ttl"): {"id": "e-1"}})
    app = create_app(NodeBackend(client=daemon), home=home)
    r = _call(app, "POST", "/sandboxes/e-1/refreshes", json={"duration": 60}, headers={"X-API-Key": alice})
    assert r.status_code == 204 and daemon.calls[-1] == ("POST", "/v1/envs/e-1/ttl")
    assert OwnerTable(home).env("e-1")["timeout_s"] == 60


def test_cli_token_and_template(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from weenv.cli import main

    monkeypatch.setenv("WEENV_HOME", str(tmp_path))
    lock = tmp_path / "a.lock.toml"
    lock.write_text('name = "a"\n')
    run = CliRunner()
    r = run.invoke(main, ["token", "create", "--name", "ci", "--admin"])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[0]
    assert KeyStore(str(tmp_path / "api")).verify(key).admin
    r = run.invoke(main, ["token", "ls", "--json"])
    assert json.loads(r.stdout)[0]["name"] == "ci" and key not in r.stdout
    r = run.invoke(main, ["token", "revoke", "nope"])
    assert r.exit_code == 1 and "no key named 'nope'" in r.output
    assert run.invoke(main, ["template", "set", "base", str(lock)]).exit_code == 0
    assert run.invoke(main, ["template", "set", "snap", "snap-00ff"]).exit_code == 0
    r = run.invoke(main, ["template", "ls", "--json"])
    assert json.loads(r.stdout) == {"base": {"lock": str(lock)}, "snap": {"snapshot": "snap-00ff"}}
    r = run.invoke(main, ["template", "set", "bad", str(tmp_path / "missing")])
    assert r.exit_code == 1 and "neither a lock/plan file nor a snapshot id" in r.output
    assert run.invoke(main, ["template", "rm", "base"]).exit_code == 0
    for bad in ("127.0.0.1", "127.0.0.1:99999", ":3000"):
        r = run.invoke(main, ["serve", "--listen", bad])
        assert r.exit_code == 2 and "is not host:port" in r.output, r.output
    r = run.invoke(main, ["--host", "ftp://x", "ps"])
    assert r.exit_code == 2 and "not an http:// or https:// URL" in r.output


def test_watchers_are_bounded_per_env(home: str) -> None:
    from weenv.api._envd_view import MAX_WATCHERS_PER_ENV

    files = "/v1/envs/e-1/files"

    class Dirs(ScriptedDaemon):
        def answer(self, request: httpx.Request) -> Any:
            op = request.url.params.get("op")
            if request.url.path == files and op == "stat":
                return {"name": "d", "kind": "dir", "size_bytes": 0, "mode": 0o755, "uid": 0, "gid": 0,
                        "mtime_s": 1.0}
            if request.url.path == files and op == "list":
                return []
            return super().answer(request)

    app = create_app(NodeBackend(client=Dirs({})), home=home)
    headers = {"E2b-Sandbox-Id": "e-1", "X-Access-Token": env_token(app.state, "e-1", app.state.owners.env("e-1"))}

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post("/filesystem.Filesystem/CreateWatcher", json={"path": "/d"}, headers=headers)
                    for _ in range(MAX_WATCHERS_PER_ENV + 1)]

    answers = asyncio.run(go())
    assert all(r.status_code == 200 and r.json()["watcherId"] for r in answers[:-1])
    assert answers[-1].status_code == 429 and answers[-1].json()["code"] == "resource_exhausted"


def test_unknown_routes_answer_in_each_surfaces_shape(home: str) -> None:
    key = KeyStore(home).create("ci")
    app = create_app(NodeBackend(client=ScriptedDaemon({})), home=home)
    r = _call(app, "GET", "/sandboxes/x/nope", headers={"X-API-Key": key})
    assert r.status_code == 404 and r.json() == {"code": 404, "message": "GET /sandboxes/x/nope: not a route "
                                                 "weenv serve has"}
    r = _call(app, "PATCH", "/sandboxes", headers={"X-API-Key": key})
    assert r.status_code == 405 and r.json()["code"] == 405
    r = _call(app, "PATCH", "/v1/envs", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 405 and r.json()["error"]["kind"] == "bad_request"


def test_dot_segments_cannot_reach_another_env(home: str) -> None:
    from weenv.api import OwnerTable

    alice = KeyStore(home).create("alice")
    OwnerTable(home).put_env("mine-1", {"owner": "alice"})
    OwnerTable(home).put_env("theirs-1", {"owner": "bob"})
    daemon = ScriptedDaemon({})
    app = create_app(NodeBackend(client=daemon), home=home)
    for path in ("/v1/envs/mine-1/%2e%2e/theirs-1", "/v1/envs/mine-1//x"):
        r = _call(app, "DELETE", path, headers={"Authorization": f"Bearer {alice}"})
        assert r.status_code == 400, (path, r.text)

    async def raw(path: str) -> int:  # as `curl --path-as-is` sends it: httpx would normalise it first
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "DELETE",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"t"), (b"authorization", f"Bearer {alice}".encode())],
                 "client": ("127.0.0.1", 1), "server": ("t", 80)}
        await app(scope, receive, send)
        return int(sent[0]["status"])

    assert asyncio.run(raw("/v1/envs/mine-1/../theirs-1")) == 400
    r = _call(app, "GET", "/sandboxes/..", headers={"X-API-Key": alice})
    assert r.status_code == 404
    assert daemon.calls == []


def test_daemon_gone_is_unavailable_everywhere(home: str) -> None:
    key = KeyStore(home).create("ci")
    app = create_app(home=home, backend=NodeBackend(client=ScriptedDaemon({})))
    app.state.backend.client = weenv.AsyncClient(os.path.join(home, "no-daemon.sock"), autostart=False)
    token = env_token(app.state, "e-1", app.state.owners.env("e-1"))
    sbx = {"E2b-Sandbox-Id": "e-1", "X-Access-Token": token}
    r = _call(app, "GET", "/v2/sandboxes", headers={"X-API-Key": key})
    assert r.status_code == 503 and r.json()["message"] == "the node's weenv daemon does not answer"
    assert _call(app, "GET", "/v1/envs", headers={"Authorization": f"Bearer {key}"}).status_code == 503
    assert _call(app, "GET", "/files", params={"path": "/x"}, headers=sbx).status_code == 503
    assert _call(app, "POST", "/files", params={"path": "/x"}, content=b"x",
                 headers={**sbx, "Content-Type": "application/octet-stream"}).status_code == 503
    r = _call(app, "POST", "/filesystem.Filesystem/Stat", json={"path": "/"}, headers=sbx)
    assert r.status_code == 503 and r.json()["code"] == "unavailable"


def test_a_gone_sandbox_is_not_running_to_the_sdk(home: str) -> None:
    from e2b.exceptions import SandboxNotRunningException, format_sandbox_unavailable_exception

    app = create_app(NodeBackend(client=ScriptedDaemon({})), home=home)  # the daemon knows no env
    sbx = {"E2b-Sandbox-Id": "e-1", "X-Access-Token": env_token(app.state, "e-1", app.state.owners.env("e-1"))}
    answers = [_call(app, "GET", "/files", params={"path": "/x"}, headers=sbx),
               _call(app, "POST", "/files", params={"path": "/x"}, content=b"x",
                     headers={**sbx, "Content-Type": "application/octet-stream"}),
               _call(app, "GET", "/health", headers=sbx)]
    assert [r.status_code for r in answers] == [502, 502, 502]
    r = _call(app, "POST", "/filesystem.Filesystem/Stat", json={"path": "/"}, headers=sbx)
    assert r.status_code == 503 and r.json()["code"] == "unavailable"
    for message in [a.json()["message"] for a in answers] + [r.json()["message"]]:
        assert isinstance(format_sandbox_unavailable_exception(message), SandboxNotRunningException), message


def test_bad_rpc_messages_name_the_place(home: str) -> None:
    from weenv.api._connect import envelope

    app = create_app(NodeBackend(client=ScriptedDaemon({})), home=home)
    sbx = {"E2b-Sandbox-Id": "e-1", "X-Access-Token": env_token(app.state, "e-1", app.state.owners.env("e-1"))}
    r = _call(app, "POST", "/filesystem.Filesystem/Stat", json={"path": 7}, headers=sbx)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument" and "$.path" in r.json()["message"]
    r = _call(app, "POST", "/filesystem.Filesystem/ListDir", json={"path": "/", "depth": -1}, headers=sbx)
    assert r.status_code == 400 and "$.depth" in r.json()["message"]
    r = _call(app, "POST", "/filesystem.Filesystem/Stat", content=b"{nope", headers={**sbx, "Content-Type": "application/json"})
    assert r.status_code == 400
    r = _call(app, "POST", "/filesystem.Filesystem/Stat", content=b"{}", headers={**sbx, "Content-Type": "text/plain"})
    assert r.status_code == 415
    r = _call(app, "POST", "/process.Process/Start", content=envelope(b'{"process": {"args": [1]}}'),
              headers={**sbx, "Content-Type": "application/connect+json"})
    reader = EnvelopeReader()
    (flags, last), = list(reader.feed(r.content))
    assert r.status_code == 200 and flags == END_STREAM
    assert json.loads(last)["error"]["code"] == "invalid_argument" and "$.process.args[0]" in last.decode()


def test_image_routing_parses_sizes_and_routes_only_the_sdk_default_template() -> None:
    from weenv.api import ImageRouting
    from weenv.api._common import HttpError

    assert ImageRouting.parse_size("sm=1:1GiB") == ("sm", {"cpu": "1", "memory": "1GiB"})
    assert ImageRouting.parse_size("lg=0.5-2:512MiB-2GiB") == ("lg", {"cpu": "0.5-2", "memory": "512MiB-2GiB"})
    for bad, msg in (("sm", "NAME=CPU:MEMORY"), ("=1:1GiB", "NAME=CPU:MEMORY"), ("sm=1:", "NAME=CPU:MEMORY"),
                     ("sm=zero:1GiB", "cores"), ("sm=1:big", "not a size")):
        with pytest.raises(ValueError, match=msg):
            ImageRouting.parse_size(bad)
    r = ImageRouting("image", "size", {"sm": {"cpu": "1", "memory": "1GiB"}})
    assert r.route("base", {"image": "reg/x:1"}) == ("reg/x:1", {})
    assert r.route("", {"image": "reg/x:1", "size": "sm"}) == ("reg/x:1", {"cpu": "1", "memory": "1GiB"})
    assert r.route("my-template", {"image": "reg/x:1"}) is None
    assert r.route("base", {"other": "reg/x:1"}) is None and r.route("base", None) is None
    with pytest.raises(HttpError, match=r"metadata.size: 'xl' is not a size this server knows \(sm\)"):
        r.route("base", {"image": "reg/x:1", "size": "xl"})
    assert ImageRouting("image").route("base", {"image": "reg/x:1", "size": "xl"}) == ("reg/x:1", {})


def test_owner_table_writes_are_in_place_at_once_and_synced_by_another_thread(home: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The server writes the owner table from its event loop on every create and remove: the new
    file is there for other readers when put_env returns, its fsync (and its directory's) happens
    on the syncer's thread, and flush waits for it."""
    import threading

    from weenv.api import OwnerTable
    from weenv.api import _store

    synced: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(_store.os, "fsync", fsync)
    table = OwnerTable(home)
    table.put_env("e-1", {"owner": "alice"})
    assert OwnerTable(home).env("e-1") == {"owner": "alice"}  # another reader (the CLI, a test) sees it now
    assert table.flush(10)
    path = os.path.join(home, "envs.json")
    assert ("weenv-api-fsync", path) in synced and ("weenv-api-fsync", home) in synced
    assert not [who for who, _ in synced if who == threading.current_thread().name]  # never on the writer's
    table.forget_envs(["e-1"])
    assert OwnerTable(home).env("e-1") is None and table.flush(10)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
