"""Fuzzing ``weenv serve`` (hypothesis): Connect envelopes, Connect unary and stream requests
(bodies and headers), E2B REST bodies and multipart uploads, against the app in-process over httpx's
ASGI transport with a fake daemon client. The promise: every bad input is a typed answer (a Connect
code, a 4xx with a message), never a 500, a crash or a hang; the envelope reader holds no more than
one message past its limit.

Each target's examples and time go to ``$WEENV_FUZZ_STATS`` (JSON lines) when it is set, for
docs/reliability.md (``make soak``).
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures_common import FuzzStats
from weenv.api import KeyStore, NodeBackend, OwnerTable, create_app
from weenv.api._common import env_token
from weenv.api._connect import END_STREAM, Code, EnvelopeReader, FramingError, envelope
from weenv.testing import ScriptedDaemon

EXAMPLES = int(os.environ.get("WEENV_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                             HealthCheck.too_slow])
CODES = {c.value for c in Code}
_stats = FuzzStats("tests/test_fuzz_api.py")
_count = _stats.count


@pytest.fixture(scope="module", autouse=True)
def _fuzz_stats():  # type: ignore[no-untyped-def]
    """Each target's examples and time to ``$WEENV_FUZZ_STATS`` (docs/reliability.md, ``make soak``)."""
    yield
    _stats.write()


# ------------------------------------------------------------------ the app over a fake daemon


def _fake_daemon() -> ScriptedDaemon:
    """Knows one running env, ``e-1``; every other call is a 404."""
    return ScriptedDaemon({("GET", "/v1/envs/e-1"): {"id": "e-1", "status": "running", "created_s": 1.0},
                           ("PUT", "/v1/envs/e-1/files"): {"path": "/x", "size_bytes": 1}})


@pytest.fixture(scope="module")
def served(tmp_path_factory):  # type: ignore[no-untyped-def]
    home = str(tmp_path_factory.mktemp("fuzz-api"))
    key = KeyStore(home).create("alice")
    OwnerTable(home).put_env("e-1", {"owner": "alice", "timeout_s": 300})
    app = create_app(NodeBackend(client=_fake_daemon()), home=home)
    envd = {"E2b-Sandbox-Id": "e-1", "X-Access-Token": env_token(app.state, "e-1", app.state.owners.env("e-1"))}
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

    def call(method: str, url: str, **kw: Any) -> httpx.Response:
        return loop.run_until_complete(asyncio.wait_for(client.request(method, url, **kw), 10))

    yield call, {"X-API-Key": key}, envd
    loop.run_until_complete(client.aclose())
    loop.close()


def _typed(r: httpx.Response, where: str) -> None:
    """Not a 500, and a JSON error body (REST: code + message; Connect: a known code) when not a 2xx."""
    assert r.status_code < 500 or r.status_code in (501, 502, 503), f"{where}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400 and r.content:
        body = r.json()
        assert isinstance(body, dict) and body.get("message"), f"{where}: {r.text[:300]}"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=12), kids, max_size=6), max_leaves=20)


def _objects(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """JSON objects whose keys are mostly the fields the handler reads, with any values."""
    return st.dictionaries(st.sampled_from(fields) | st.text(max_size=8), json_values, max_size=6)


# ------------------------------------------------------------------ Connect envelopes


@FUZZ
@given(messages=st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=300)), max_size=6),
       cuts=st.lists(st.integers(0, 4000), max_size=8), limit=st.integers(0, 400))
def test_envelope_reader_splits_anywhere_and_refuses_only_with_framing_errors(messages, cuts, limit) -> None:
    _count("Connect envelopes (EnvelopeReader: split, oversized, compressed, truncated)",
           "test_envelope_reader_splits_anywhere_and_refuses_only_with_framing_errors")
    stream = b"".join(struct.pack(">BI", flags, len(data)) + data for flags, data in messages)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    reader = EnvelopeReader(limit)
    got: list[tuple[int, bytes]] = []
    try:
        for a, b in zip(points, points[1:]):
            got += list(reader.feed(stream[a:b]))
            assert len(reader._buf) <= 5 + limit + (b - a), "buffered past one message and one chunk"
        reader.close()
    except FramingError as e:
        assert str(e)
        expected_ok = all(len(d) <= limit and not f & 1 for f, d in messages)
        assert not expected_ok or len(stream) == 0, f"refused a good stream: {e}"
        return
    assert got == [(f, d) for f, d in messages], "the messages differ from what was framed"


@FUZZ
@given(data=st.binary(max_size=600), cut=st.integers(0, 600))
def test_envelope_reader_on_any_bytes(data, cut) -> None:
    _count("Connect envelopes (EnvelopeReader: arbitrary bytes)", "test_envelope_reader_on_any_bytes")
    reader = EnvelopeReader(256)
    try:
        for m in [*reader.feed(data[:cut]), *reader.feed(data[cut:])]:
            assert len(m[1]) <= 256
        reader.close()
    except FramingError:
        pass


# ------------------------------------------------------------------ Connect requests to envd

UNARY = {"filesystem.Filesystem/Stat": ["path"], "filesystem.Filesystem/MakeDir": ["path"],
         "filesystem.Filesystem/Move": ["source", "destination"], "filesystem.Filesystem/ListDir": ["path", "depth"],
         "filesystem.Filesystem/Remove": ["path"], "filesystem.Filesystem/CreateWatcher": ["path", "recursive"],
         "filesystem.Filesystem/GetWatcherEvents": ["watcherId"], "filesystem.Filesystem/RemoveWatcher": ["watcherId"]}
STREAMS = {"process.Process/Start": ["process", "pty", "tag", "stdin"], "filesystem.Filesystem/WatchDir": ["path"]}


@FUZZ
@given(method=st.sampled_from(sorted(UNARY)), data=st.data(), raw=st.none() | st.binary(max_size=200),
       auth=st.none() | st.text(max_size=20))
def test_connect_unary_bodies_get_connect_errors(served, method, data, raw, auth) -> None:  # type: ignore[no-untyped-def]
    _count("Connect unary requests (filesystem.*: JSON bodies, raw bytes, Basic auth)",
           "test_connect_unary_bodies_get_connect_errors")
    call, _, envd = served
    body = raw if raw is not None else json.dumps(data.draw(_objects(UNARY[method]))).encode()
    headers = {**envd, "Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    if auth is not None:
        headers["Authorization"] = "Basic " + "".join(c for c in auth if c.isascii() and c.isprintable())
    r = call("POST", f"/{method}", content=body, headers=headers)
    _typed(r, method)
    if r.status_code != 200:
        assert r.json()["code"] in CODES, r.text


@FUZZ
@given(method=st.sampled_from(sorted(STREAMS)), data=st.data(), framing=st.sampled_from(["one", "raw", "two", "cut"]),
       timeout_ms=st.none() | st.text(alphabet="0123456789²٣x-.", max_size=400)
       | st.integers(0, 10**400).map(str) | st.sampled_from(["\xb2", "1" * 400]),
       keepalive=st.none() | st.sampled_from(["nan", "inf", "-1", "0", "x", "1e400", "30"]))
def test_connect_stream_requests_end_with_a_coded_error(served, method, data, framing, timeout_ms,  # type: ignore[no-untyped-def]
                                                        keepalive) -> None:
    _count("Connect server-stream requests (Process/Start, WatchDir: envelopes, headers)",
           "test_connect_stream_requests_end_with_a_coded_error")
    call, _, envd = served
    msg = json.dumps(data.draw(_objects(STREAMS[method]))).encode()
    body = {"one": envelope(msg), "raw": msg, "two": envelope(msg) * 2, "cut": envelope(msg)[:-1]}[framing]
    headers = {**envd, "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    if timeout_ms is not None:
        headers["Connect-Timeout-Ms"] = timeout_ms.encode("latin-1", "replace")  # type: ignore[assignment]
    if keepalive is not None:
        headers["Keepalive-Ping-Interval"] = keepalive
    r = call("POST", f"/{method}", content=body, headers=headers)
    _typed(r, method)
    if r.status_code == 200:
        reader = EnvelopeReader(8 << 20)
        frames = list(reader.feed(r.content))
        reader.close()
        assert frames and frames[-1][0] == END_STREAM, r.content[:300]
        end = json.loads(frames[-1][1] or b"{}")
        if "error" in end:
            assert end["error"]["code"] in CODES, end


# ------------------------------------------------------------------ E2B REST bodies

REST = [("POST", "/sandboxes", ["templateID", "timeout", "metadata", "envVars", "autoPause", "secure",
                                "allow_internet_access", "network"]),
        ("POST", "/v2/sandboxes", ["templateID", "timeout", "metadata"]),
        ("POST", "/sandboxes/e-1/timeout", ["timeout"]),
        ("POST", "/sandboxes/e-1/refreshes", ["duration"]),
        ("POST", "/sandboxes/e-1/connect", ["timeout"]),
        ("POST", "/sandboxes/e-1/resume", ["timeout", "autoPause"]),
        ("POST", "/sandboxes/e-1/snapshots", ["name"]),
        ("POST", "/sandboxes/e-1/fork", ["count", "timeout"]),
        ("PUT", "/sandboxes/e-1/network", ["allowOut", "denyOut", "allowInternetAccess"])]


@FUZZ
@given(route=st.sampled_from(REST), data=st.data(), raw=st.none() | st.binary(max_size=120))
def test_e2b_rest_bodies_are_4xx_with_a_message(served, route, data, raw) -> None:  # type: ignore[no-untyped-def]
    _count("E2B REST bodies (sandboxes, timeout, refreshes, connect, snapshots, fork, network)",
           "test_e2b_rest_bodies_are_4xx_with_a_message")
    call, key, _ = served
    method, url, fields = route
    body = raw if raw is not None else json.dumps(data.draw(_objects(fields) | json_values)).encode()
    r = call(method, url, content=body, headers={**key, "Content-Type": "application/json"})
    _typed(r, f"{method} {url}")


# ------------------------------------------------------------------ multipart uploads


def _part(name: str, filename: str | None, data: bytes, extra: str) -> bytes:
    disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
    return (f"Content-Disposition: {disp}\r\n{extra}\r\n").encode("utf-8", "surrogateescape") + data


@FUZZ
@given(boundary=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789'()+_,-./:=?", min_size=1, max_size=70),
       parts=st.lists(st.tuples(st.text(max_size=10), st.none() | st.text(max_size=30), st.binary(max_size=200),
                                st.sampled_from(["", "Content-Type: application/octet-stream\r\n",
                                                 "Content-Type: text/plain; charset=utf-8\r\n", "X: y\r\n"])),
                      max_size=4),
       path=st.none() | st.text(max_size=30), cut=st.none() | st.integers(0, 2000),
       ctype_boundary=st.sampled_from(["same", "none", "other", "quoted"]))
def test_multipart_uploads_are_written_or_refused_clearly(served, boundary, parts, path, cut,  # type: ignore[no-untyped-def]
                                                          ctype_boundary) -> None:
    _count("multipart uploads (envd POST /files: boundaries, parts, filenames, truncation)",
           "test_multipart_uploads_are_written_or_refused_clearly")
    call, _, envd = served
    sep = b"--" + boundary.encode()
    body = b"".join(sep + b"\r\n" + _part(*p) + b"\r\n" for p in parts) + sep + b"--\r\n"
    if cut is not None:
        body = body[:cut]
    b = {"same": boundary, "none": None, "other": boundary + "x", "quoted": f'"{boundary}"'}[ctype_boundary]
    ctype = "multipart/form-data" + (f"; boundary={b}" if b is not None else "")
    params = {"path": path} if path is not None else {}
    r = call("POST", "/files", content=body, params=params, headers={**envd, "Content-Type": ctype})
    _typed(r, "POST /files multipart")


@pytest.mark.parametrize("value", [b"\xb2", b"1" * 400, b"99999999999"])
def test_a_connect_timeout_that_is_not_10_ascii_digits_is_ignored_not_a_500(served, value) -> None:  # type: ignore[no-untyped-def]
    """Found by the stream target: a latin-1 '²' passed isdigit() and failed int() (ValueError), 400
    digits overflowed the float division (OverflowError): both escaped the handler as 500s."""
    call, _, envd = served
    r = call("POST", "/filesystem.Filesystem/WatchDir", content=envelope(b'{"path": "/tmp"}'),
             headers={**envd, "Content-Type": "application/connect+json", "Connect-Timeout-Ms": value})
    assert r.status_code == 200, r.text
    frames = list(EnvelopeReader().feed(r.content))
    assert frames[-1][0] == END_STREAM
