"""Bad request bodies and query strings: a 400 naming the place, never a 500.

Against the real daemon (integration): bodies are sent raw (httpx ``content=`` or a bare socket),
the way a buggy or hostile client would, not through weenv.Client, which only sends well-formed
requests. In process (unit): the HTTP server's body limits, keep-alive and disconnect handling.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio

from weenv import _wire as wire
from weenv.provision.server._http import HTTPError, Request, Response, Router, Server, StreamResponse, json_response

from .fixtures_daemon import DaemonHandle

integration = pytest.mark.integration


@pytest.fixture(scope="module")
def api(weenv_daemon: DaemonHandle) -> Iterator[httpx.Client]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=weenv_daemon.socket), base_url="http://weenv",
                      timeout=30.0) as http:
        yield http


@pytest.fixture(scope="module")
def env_id(weenv_daemon: DaemonHandle, api: httpx.Client) -> Iterator[str]:
    with weenv_daemon.client() as c:
        env = c.create(weenv_daemon.plan_lock)
        try:
            yield env.id
        finally:
            env.kill()


def _error(resp: httpx.Response, status: int = 400) -> str:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = msgspec.json.decode(resp.content, type=wire.ErrorBody)
    return body.error.message


DEEP = b"[" * 200_000 + b"]" * 200_000

EXEC_CASES = [
    # (raw body, what the message must name)
    (b'[1, 2]', "Expected `object`, got `array`"),
    (b'{"argv": ["cat"], "stdin_b64": "not base64!"}', "$.stdin_b64"),
    (b'{"argv": ["sleep", "1"], "timeout_s": "abc"}', "$.timeout_s"),
    (b'{"argv": ["sleep", "1"], "timeout_s": 1e999}', "$.timeout_s"),
    (b'{"argv": ["sleep", "1"], "timeout_s": NaN}', "$.timeout_s"),
    (b'{"argv": ["sleep", "1"], "timeout_s": -1}', "$.timeout_s"),
    (b'{"argv": ["echo", "\\ud800"]}', "surrogate"),
    (b'{"argv": ["echo", "x\\udc80"]}', "$.argv[1]"),
    (b'{"argv": ["echo"], "env": {"\\udc80": "x"}}', "$.env"),
    (b'{"argv": ["echo", "a\\u0000b"]}', "$.argv[1]"),
    (b'{"argv": []}', "$.argv"),
    (b'{"argv": "echo hi"}', "$.argv"),
    (b'{"argv": ["true"], "env": {"A=B": "c"}}', "$.env"),
    (b'{"argv": ["true"], "env": {"A": 1}}', "$.env"),
    (b'{"argv": ["true"], "cmd": "true"}', "exactly one of 'argv'"),
    (b'{"argv": ["true"], "timeout": 5}', "unknown field `timeout`"),
    (b'{"argv": ["true"]', "truncated"),
    (b'\xff\xfe', "malformed"),
    (b'{"argv": ' + DEEP + b'}', "$.argv"),
    (DEEP, "Expected `object`"),
]


@integration
@pytest.mark.parametrize("body,names", EXEC_CASES, ids=[f"exec{i}" for i in range(len(EXEC_CASES))])
def test_bad_exec_bodies_get_400_naming_the_field(api, env_id, body, names):
    t0 = time.monotonic()
    message = _error(api.post(f"/v1/envs/{env_id}/exec", content=body))
    assert names in message, message
    assert len(message) < 1200 and time.monotonic() - t0 < 5


@integration
def test_bad_create_bodies_get_400_naming_the_field(api, weenv_daemon):
    with open(weenv_daemon.plan_lock) as f:
        lock_text = f.read()
    plan = {"name": "x", "groups": [{"name": "os", "ref": "busybox:test", "class": "os"}],
            "resources": {"cpu": {"min": "abc"}}}
    cases = [
        (json.dumps({"plan": plan}).encode(), "resources.cpu.min"),
        (json.dumps({"plan": plan, "snapshot": "snap-1"}).encode(), "exactly one of"),
        (b'{"plan": {"name": ' + DEEP + b'}}', "nested too deeply"),
        (b'{"plan_text": "{\\"a\\": ' + b"[" * 100_000 + b"]" * 100_000 + b'}", "format": "json"}', "nested too deeply"),
        (json.dumps({"plan_text": lock_text, "format": "yaml"}).encode(), "$.format"),
        (json.dumps({"plan_text": lock_text, "overrides": {"ttl_s": -5}}).encode(), "$.overrides.ttl_s"),
        (json.dumps({"plan_text": lock_text, "overrides": {"cpus": 2}}).encode(), "unknown field `cpus`"),
        (json.dumps({"plan_text": lock_text, "overrides": {"memory": [1, 2]}}).encode(), "$.overrides.memory"),
        (b'{"snapshot": 7}', "$.snapshot"),
        # a plan_text is the document, never a path on the daemon's host
        (json.dumps({"plan_text": weenv_daemon.plan_lock}).encode(), "$.plan_text"),
        (b'{"plan_text": ""}', "$.plan_text"),
        (b'{"snapshot": "snap-1", "overrides": {"ttl_s": NaN}}', "$.overrides.ttl_s"),
    ]
    for body, names in cases:
        message = _error(api.post("/v1/envs", content=body))
        assert names in message, (names, message)


@integration
def test_ttl_nan_infinity_and_negative_are_refused_and_change_nothing(api, env_id):
    before = api.get(f"/v1/envs/{env_id}").json()["expires_s"]
    for body, names in [(b'{"ttl_s": NaN}', "$.ttl_s"), (b'{"ttl_s": Infinity}', "$.ttl_s"),
                        (b'{"ttl_s": 1e999}', "$.ttl_s"), (b'{"ttl_s": -1}', "$.ttl_s"),
                        (b'{"ttl_s": "10"}', "$.ttl_s"), (b'{"ttl": 10}', "unknown field `ttl`")]:
        assert names in _error(api.post(f"/v1/envs/{env_id}/ttl", content=body))
    assert api.get(f"/v1/envs/{env_id}").json()["expires_s"] == before


@integration
def test_fork_commit_and_other_bodies_are_typed(api, env_id):
    assert "$.n" in _error(api.post(f"/v1/envs/{env_id}/fork", content=b'{"n": 0}'))
    assert "$.n" in _error(api.post(f"/v1/envs/{env_id}/fork", content=b'{"n": true}'))
    assert "$.n" in _error(api.post(f"/v1/envs/{env_id}/fork", content=b'{"n": 1.5}'))
    assert "$.ref" in _error(api.post(f"/v1/envs/{env_id}/commit", content=b'{"ref": 5}'))
    assert "unknown field" in _error(api.post(f"/v1/envs/{env_id}/pause", content=b'{"now": true}'))
    assert "unknown field" in _error(api.post("/v1/gc", content=b'{"all": true}'))
    assert api.get(f"/v1/envs/{env_id}").json()["status"] == "running"


@integration
def test_bad_query_parameters_get_400_naming_the_parameter(api, env_id):
    url = f"/v1/envs/{env_id}/files"
    assert "$.mode" in _error(api.put(url, params={"path": "/tmp/x", "mode": "abc"}, content=b"x"))
    assert "$.mode" in _error(api.put(url, params={"path": "/tmp/x", "mode": "99999"}, content=b"x"))
    assert "$.mode" in _error(api.post(f"{url}/mkdir", params={"path": "/tmp/d", "mode": "rwx"}))
    assert "$.op" in _error(api.get(url, params={"path": "/tmp", "op": "delete"}))
    assert "`path`" in _error(api.get(url))
    assert "$.path" in _error(api.get(url, params={"path": ""}))
    assert "unknown field `paht`" in _error(api.get(url, params={"paht": "/tmp"}))
    assert "$.recursive" in _error(api.delete(url, params={"path": "/tmp/x", "recursive": "yes"}))
    assert "unknown field" in _error(api.get("/v1/envs", params={"all": "1"}))
    # nothing was written
    assert api.get(url, params={"path": "/tmp/x", "op": "stat"}).status_code == 404


def _raw(sock_path: str, data: bytes, *, read_timeout_s: float = 5.0) -> bytes:
    """Send raw bytes, read until the daemon closes or stays quiet."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(read_timeout_s)
    s.connect(sock_path)
    try:
        try:
            s.sendall(data)
        except BrokenPipeError:
            pass  # the daemon answered and closed before taking everything: read its answer
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


@integration
def test_a_large_json_body_is_refused_with_413_before_it_is_read(weenv_daemon, env_id):
    t0 = time.monotonic()
    # 100 MiB announced, only a few bytes sent: the answer comes at once and the connection closes
    head = (f"POST /v1/envs/{env_id}/exec HTTP/1.1\r\nhost: weenv\r\ncontent-type: application/json\r\n"
            f"content-length: {100 << 20}\r\n\r\n").encode()
    out = _raw(weenv_daemon.socket, head + b'{"argv": ["true"], "cmd": "')
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    assert b"too_large" in out and len(out) < 2000 and time.monotonic() - t0 < 5
    # chunked, no length: refused once it passes the limit (1 MiB), without echoing it back
    doc = b'{"cmd": "' + b"x" * (3 << 19)
    head = f"POST /v1/envs/{env_id}/exec HTTP/1.1\r\nhost: weenv\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    body = b"".join(b"%x\r\n%s\r\n" % (len(doc[i:i + 65536]), doc[i:i + 65536]) for i in range(0, len(doc), 65536))
    out = _raw(weenv_daemon.socket, head + body)
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    assert len(out) < 2000
    # an upload may be larger than a JSON body, but not larger than its own limit
    head = (f"PUT /v1/envs/{env_id}/files?path=/tmp/big HTTP/1.1\r\nhost: weenv\r\n"
            f"content-length: {wire.MAX_UPLOAD_BYTES + 1}\r\n\r\n").encode()
    out = _raw(weenv_daemon.socket, head + b"abc")
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]


@integration
def test_error_messages_never_echo_large_input(api, env_id):
    big = "A" * 600_000
    for url, body in [
        ("/v1/envs", {"plan": {"name": big, "groups": []}}),
        ("/v1/envs", {"plan_text": big}),
        ("/v1/envs", {"snapshot": big}),
        ("/v1/envs", {"plan": {"name": "x", "groups": [{"name": "os", "ref": big, "class": "os"}]}}),
        (f"/v1/envs/{env_id}/exec", {"argv": ["true"], "user": big}),
        (f"/v1/envs/{env_id}/exec", {"argv": ["true"], big: 1}),
    ]:
        resp = api.post(url, content=json.dumps(body).encode())
        assert 400 <= resp.status_code < 500, resp.text[:300]
        assert len(resp.content) < 2000, (url, resp.content[:300])


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@integration
def test_an_upload_is_streamed_to_the_env_not_held_in_memory(weenv_daemon, api, env_id):
    pid = api.get("/v1/ping").json()["pid"]
    size = 40 << 20
    data = os.urandom(1 << 20) * 40
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    base = _peak_rss_bytes(pid)
    resp = api.put(f"/v1/envs/{env_id}/files", params={"path": "/tmp/upload.bin", "mode": "600"}, content=data)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"path": "/tmp/upload.bin", "size_bytes": size}
    grew = _peak_rss_bytes(pid) - base
    assert grew < 16 << 20, f"the daemon's peak RSS grew by {grew >> 20} MiB for a {size >> 20} MiB upload"
    st_ = api.get(f"/v1/envs/{env_id}/files", params={"path": "/tmp/upload.bin", "op": "stat"}).json()
    assert (st_["size_bytes"], st_["mode"]) == (size, 0o600)
    r = api.post(f"/v1/envs/{env_id}/exec", json={"argv": ["sha256sum", "/tmp/upload.bin"]}).json()
    assert base64.b64decode(r["stdout"]).split()[0].decode() == hashlib.sha256(data).hexdigest()
    api.delete(f"/v1/envs/{env_id}/files", params={"path": "/tmp/upload.bin"})


@integration
def test_an_upload_broken_off_leaves_the_old_file_and_no_temp_file(weenv_daemon, api, env_id):
    url = f"/v1/envs/{env_id}/files"
    assert api.put(url, params={"path": "/tmp/keep.txt"}, content=b"old\n").status_code == 200
    head = (f"PUT {url}?path=/tmp/keep.txt HTTP/1.1\r\nhost: weenv\r\ncontent-length: {4 << 20}\r\n\r\n").encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(weenv_daemon.socket)
    s.sendall(head + b"n" * (1 << 20))
    time.sleep(0.3)
    s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        names = [e["name"] for e in api.get(url, params={"path": "/tmp", "op": "list"}).json()]
        if not any(".weenv-" in n for n in names):
            break
        time.sleep(0.05)
    assert [n for n in names if "keep" in n] == ["keep.txt"], names
    assert api.get(url, params={"path": "/tmp/keep.txt"}).content == b"old\n"
    assert api.get("/v1/ping").status_code == 200


# -- fuzz -------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_exec_fields = {
    "argv": st.lists(st.text(max_size=12), max_size=4) | _json,
    "cmd": st.text(max_size=30) | _json,
    "env": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3) | _json,
    "cwd": st.text(max_size=12) | _json,
    "user": st.text(max_size=8) | _json,
    "stdin_b64": st.binary(max_size=16).map(lambda b: base64.b64encode(b).decode()) | st.text(max_size=8) | _json,
    "timeout_s": st.floats() | st.integers() | _json,
    "stream": st.booleans() | _json,
    "extra": _json,
}
_create_fields = {
    "plan": st.fixed_dictionaries({}, optional={
        "name": st.text(max_size=8) | _json, "groups": st.lists(_json, max_size=2) | _json,
        "resources": st.fixed_dictionaries({}, optional={"cpu": _json, "memory": _json, "pids": _json}) | _json,
        "env": _json, "network": _json, "lock_version": _json}) | _json,
    "plan_text": st.text(max_size=40) | _json,
    "format": st.sampled_from(["toml", "json", "yaml"]) | _json,
    "source": st.text(max_size=8) | _json,
    "snapshot": st.text(max_size=12) | _json,
    "overrides": st.fixed_dictionaries({}, optional={
        "cpu": st.floats() | st.text(max_size=8) | _json, "memory": st.integers() | st.text(max_size=8) | _json,
        "ttl_s": st.floats() | _json, "env": _json, "name": _json, "bogus": _json}) | _json,
}


def _bodies(fields: dict) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.fixed_dictionaries({}, optional=fields).map(lambda d: json.dumps(d).encode()),  # NaN and inf included
        _json.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    )


_fuzz = settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@integration
@_fuzz
@given(body=_bodies(_exec_fields))
def test_fuzzed_exec_bodies_get_4xx_never_500(api, body):
    # an env id that does not exist: a well-formed body ends as a 404, nothing ever runs
    t0 = time.monotonic()
    resp = api.post("/v1/envs/no-such-env-fuzz/exec", content=body)
    assert resp.status_code in (400, 404), (body[:200], resp.status_code, resp.text[:300])
    msgspec.json.decode(resp.content, type=wire.ErrorBody)
    assert time.monotonic() - t0 < 5


@integration
@_fuzz
@given(body=_bodies(_create_fields))
def test_fuzzed_create_bodies_get_4xx_never_500(api, body):
    t0 = time.monotonic()
    resp = api.post("/v1/envs", content=body)
    assert 400 <= resp.status_code < 500, (body[:200], resp.status_code, resp.text[:300])
    assert len(resp.content) < 2000
    msgspec.json.decode(resp.content, type=wire.ErrorBody)
    assert time.monotonic() - t0 < 5


# -- the HTTP server in process (unit) ----------------------------------------------------------


class _Probe(wire.RequestBody):
    x: int = 0


def _app(events: list[str]) -> Router:
    r = Router()

    @r.route("POST", "/echo")
    async def echo(req: Request) -> Response:
        return json_response({"x": req.decode(_Probe).x})

    @r.route("POST", "/hang")
    async def hang(req: Request) -> Response:
        events.append("hang started")
        try:
            await trio.sleep_forever()
        finally:
            events.append("hang cancelled")
        raise AssertionError("unreachable")

    @r.route("POST", "/hang-stream")
    async def hang_stream(req: Request) -> StreamResponse:
        async def produce(send) -> None:  # type: ignore[no-untyped-def]
            await send(b"first\n")
            events.append("stream started")
            try:
                await trio.sleep_forever()
            finally:
                events.append("stream cancelled")

        return StreamResponse(produce)

    @r.route("POST", "/broken-stream")
    async def broken_stream(req: Request) -> StreamResponse:
        async def produce(send) -> None:  # type: ignore[no-untyped-def]
            await send(b"partial\n")
            raise RuntimeError("a bug after the answer started")

        return StreamResponse(produce)

    @r.route("PUT", "/upload", stream_body=True, max_body_bytes=100_000)
    async def upload(req: Request) -> Response:
        total = 0
        while chunk := await req.receive_chunk(4096):
            assert len(chunk) <= 4096 + 65536
            total += len(chunk)
        events.append(f"uploaded {total}")
        return json_response({"size_bytes": total})

    return r


def _serve(tmp_path, client) -> list[str]:  # type: ignore[no-untyped-def]
    """Run the server on a Unix socket under tmp_path while ``client(path, events)`` runs (bounded)."""
    events: list[str] = []
    path = str(tmp_path / "api.sock")

    async def main() -> None:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(Server(_app(events)).serve_unix, path)
                await client(path, events)
                nursery.cancel_scope.cancel()

    trio.run(main)
    return events


async def _exchange(path: str, data: bytes, *, close_after_s: float | None = None) -> bytes:
    """Send ``data``; read until the server closes (or, with close_after_s, hang up after that long)."""
    stream = await trio.open_unix_socket(path)
    out = b""
    async with stream:
        await stream.send_all(data)
        with trio.move_on_after(close_after_s if close_after_s is not None else 10):
            while chunk := await stream.receive_some(65536):
                out += chunk
    return out


def _post(path: str, body: bytes, *, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_pipelined_requests_on_one_connection_are_answered_in_order(tmp_path):
    async def client(path: str, events: list[str]) -> None:
        data = _post("/echo", b'{"x": 1}') + _post("/echo", b'{"x": "two"}') + _post("/echo", b'{"x": 3}',
                                                                                   extra="connection: close\r\n")
        out = await _exchange(path, data)
        assert out.count(b"HTTP/1.1 ") == 3
        first, second, third = out.split(b"HTTP/1.1 ")[1:]
        assert first.startswith(b"200 ") and first.endswith(b'{"x":1}')
        assert second.startswith(b"400 ") and b"$.x" in second
        assert third.startswith(b"200 ") and third.endswith(b'{"x":3}')

    _serve(tmp_path, client)


@pytest.mark.parametrize("route", ["/hang", "/hang-stream"])
def test_a_client_going_away_cancels_its_handler(tmp_path, route):
    async def client(path: str, events: list[str]) -> None:
        out = await _exchange(path, _post(route, b"{}"), close_after_s=0.3)
        assert events and events[0].endswith("started"), events
        assert (out == b"") == (route == "/hang")  # the stream had sent its head and first line
        with trio.fail_after(2):
            while not events[-1].endswith("cancelled"):
                await trio.sleep(0.01)

    _serve(tmp_path, client)


def test_a_streamed_body_past_its_limit_is_413_and_the_server_goes_on(tmp_path):
    async def client(path: str, events: list[str]) -> None:
        piece = b"y" * 30_000
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(5)) + b"0\r\n\r\n"
        head = b"PUT /upload HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        out = await _exchange(path, head + chunked)
        assert out.startswith(b"HTTP/1.1 413 ") and b"100000-byte limit" in out, out[:300]
        assert not any(e.startswith("uploaded") for e in events)
        ok = b"z" * 90_000
        out = await _exchange(path, b"PUT /upload HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                                    b"content-length: %d\r\n\r\n%s" % (len(ok), ok))
        assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b'{"size_bytes":90000}')
        out = await _exchange(path, b"PUT /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 100001\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 413 ")

    _serve(tmp_path, client)


def test_a_bug_after_a_stream_started_ends_that_connection_only(tmp_path):
    async def client(path: str, events: list[str]) -> None:
        out = await _exchange(path, _post("/broken-stream", b""))
        assert out.startswith(b"HTTP/1.1 200 ") and b"partial" in out
        assert not out.endswith(b"0\r\n\r\n")  # no clean end: the client sees the answer broke off
        out = await _exchange(path, _post("/echo", b"", extra="connection: close\r\n"))
        assert out.startswith(b"HTTP/1.1 200 ")

    _serve(tmp_path, client)


def test_wrong_method_is_405_unknown_path_404_and_errors_are_clipped(tmp_path):
    async def client(path: str, events: list[str]) -> None:
        out = await _exchange(path, b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 405 ")
        out = await _exchange(path, _post("/nope", b"", extra="connection: close\r\n"))
        assert out.startswith(b"HTTP/1.1 404 ")
        out = await _exchange(path, _post("/echo", b'{"' + b"k" * 200_000 + b'": 1}', extra="connection: close\r\n"))
        assert out.startswith(b"HTTP/1.1 400 ") and len(out) < 1500, out[:300]

    _serve(tmp_path, client)


def test_http_errors_and_answers_are_the_wire_types():
    err = HTTPError(409, "wrong_state", "is paused")
    assert (err.status, err.kind) == (409, "wrong_state")
    from weenv.provision.server._http import error_response

    body = msgspec.json.decode(error_response(400, "bad_request", "x" * 5000).body, type=wire.ErrorBody)
    assert body.error.kind == "bad_request" and len(body.error.message) < 1100 and body.error.status is None


def test_answer_structs_cover_what_the_daemon_records_hold(tmp_path):
    """A field added to an env or snapshot record must be added to its wire answer (or it is dropped)."""
    from weenv.provision.envs._snapshots import SnapshotRecord
    from weenv.provision.envs._state import EnvRecord

    rec = EnvRecord(id="e-1", name="e", status="running", lock={"groups": [{"name": "os"}]})
    public = rec.public(str(tmp_path))
    # the daemon adds the env's live resources and its egress network view to the record's own fields;
    # weenv serve adds the env's tokens for its owner
    assert set(public) | {"resources", "network", "access_token", "traffic_token"} == \
        set(wire.EnvInfo.__struct_fields__)
    msgspec.convert({**public, "resources": None, "network": None}, wire.EnvInfo)
    snap = SnapshotRecord(id="snap-1", source_env="e-1", lock={"name": "p"})
    assert set(snap.public()) == set(wire.SnapshotInfo.__struct_fields__)
    msgspec.convert({**snap.public(), "lock": snap.lock}, wire.SnapshotDetail)
    from weenv.provision.envs._files import FileInfo
    from weenv.provision.runtime._runtime import ExecResult

    assert FileInfo.__struct_fields__ == wire.FileInfo.__struct_fields__
    assert ExecResult.__struct_fields__ == wire.ExecResult.__struct_fields__


def test_clients_build_bodies_checked_as_the_daemon_checks_them():
    body = wire.encode_request(wire.ExecRequest, argv=["cat"], stdin_b64=b"hi", timeout_s=None, stream=True)
    assert json.loads(body) == {"argv": ["cat"], "stdin_b64": "aGk=", "stream": True}
    assert wire.decode(body, wire.ExecRequest).stdin_b64 == b"hi"
    for cls, fields, where in [(wire.TtlRequest, {"ttl_s": float("nan")}, "$.ttl_s"),
                               (wire.TtlRequest, {"ttl_s": float("inf")}, "$.ttl_s"),
                               (wire.ExecRequest, {"argv": ["a\0b"]}, "$.argv[0]"),
                               (wire.CreateRequest, {"snapshot": "snap-1", "overrides": {"cpu": -1}}, "$.overrides.cpu")]:
        with pytest.raises(msgspec.ValidationError, match=re.escape(where)):
            wire.encode_request(cls, **fields)
    # NaN would otherwise be written as null: no TTL instead of an error
    assert wire.encode(wire.TtlRequest(ttl_s=float("nan"))) == b'{"ttl_s":null}'


def test_one_exec_result_from_runtime_to_client():
    import weenv
    from weenv.provision.runtime._runtime import ExecResult

    assert ExecResult is wire.ExecResult
    assert issubclass(weenv.ExecResult, wire.ExecResult)
    assert weenv.ExecResult.__struct_fields__ == wire.ExecResult.__struct_fields__


def test_one_file_info_from_the_env_file_api_to_the_wire():
    from weenv.provision.envs._files import FileInfo

    assert FileInfo is wire.FileInfo
