"""Fuzzing the paths of ``weenv serve`` (hypothesis): authorization and routing agree.

The app runs in-process over httpx's ASGI transport; behind it, the daemon is the daemon's own
router (``DaemonApi.router``, the code that routes requests on the node) answering plausible bodies
and recording every call it routed. Paths are built from the pieces attacks are made of (encoded
``/`` once and twice, ``?``, ``#``, ``%``, dot segments, encoded letters, unicode, NUL) around
route names and two keys' env and snapshot ids. For every request, as ``alice`` (not an admin):

- every daemon call names only alice's env or snapshot, never bob's, and never a node-wide route
  (gc, top, metrics, daemon stop);
- a create the daemon gets is marked ``restricted`` and carries no mounts and no host network;
- a ``/v1`` request the API served is routed to the daemon route its path names, read once
  (``weenv._routes``), with the same parameters;
- and nothing answers 500.
"""

from __future__ import annotations

import asyncio
import json
import os
import types
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weenv
from tests.fixtures_common import FuzzStats
from weenv._connection import AsyncConnection
from weenv._routes import PathError, split_path
from weenv.api import KeyStore, NodeBackend, OwnerTable, create_app
from weenv.api._native import route_of
from weenv.provision.server import DaemonApi, Response

EXAMPLES = int(os.environ.get("WEENV_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                             HealthCheck.too_slow])
ADMIN_ONLY = {"/v1/daemon/stop", "/v1/gc", "/v1/top", "/v1/metrics"}
_stats = FuzzStats("tests/test_fuzz_routes.py")
_count = _stats.count


@pytest.fixture(scope="module", autouse=True)
def _fuzz_stats():  # type: ignore[no-untyped-def]
    """Each target's examples and time to ``$WEENV_FUZZ_STATS`` (docs/reliability.md, ``make soak``)."""
    yield
    _stats.write()


ROUTER = DaemonApi(manager=types.SimpleNamespace(envs_dir="/nonexistent"), monitor=None,
                   request_stop=lambda **kw: None, started_s=0.0).router


def _answer(template: str, method: str) -> Any:
    env = {"id": "mine-1", "name": "x", "status": "running", "created_s": 1.0}
    return {
        ("POST", "/v1/envs"): {**env, "id": "new-1"},
        ("GET", "/v1/envs"): [env, {**env, "id": "theirs-1"}],
        ("GET", "/v1/snapshots"): [{"id": "snap-mine"}, {"id": "snap-theirs"}],
        ("POST", "/v1/envs/{id}/commit"): {"snapshot": "snap-new", "id": "snap-new"},
        ("POST", "/v1/envs/{id}/fork"): {"snapshot": "snap-fork", "envs": [{**env, "id": "child-1"}]},
        ("GET", "/v1/snapshots/{id}"): {"id": "snap-mine", "lock": {}},
        ("GET", "/v1/envs/{id}/processes"): [],
    }.get((method, template), env)


class RecordingDaemon(httpx.AsyncBaseTransport):
    """The daemon's router over the wire: what it routes is recorded (template, method, params, body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, str], bytes]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        found = ROUTER.match(request.method, request.url.raw_path.decode("ascii").split("?", 1)[0])
        if isinstance(found, Response):
            return httpx.Response(found.status, content=found.body, headers={"content-type": "application/json"})
        route, params = found
        self.calls.append((route.spec.template, route.spec.method, params, body))
        return httpx.Response(201 if request.method == "POST" and route.spec.template == "/v1/envs" else 200,
                              json=_answer(route.spec.template, route.spec.method))



@pytest.fixture(scope="module")
def app_and_daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    home = str(tmp_path_factory.mktemp("fuzz-routes"))
    keys = KeyStore(home)
    alice, _bob = keys.create("alice"), keys.create("bob")
    a, b = keys.get("alice"), keys.get("bob")
    owners = OwnerTable(home)
    for env_id, key in (("mine-1", a), ("theirs-1", b)):
        owners.put_env(env_id, {**key.owner_fields(), "started_s": 1e10})
    for snap_id, key in (("snap-mine", a), ("snap-theirs", b)):
        owners.put_snapshot(snap_id, {**key.owner_fields(), "created_s": 1e10, "names": []})
    daemon = RecordingDaemon()
    conn = AsyncConnection("http://daemon", autostart=False, transport=daemon)
    conn.mark_started()
    client = weenv.AsyncClient(connection=conn)
    app = create_app(NodeBackend(client=client), home=home, registries=frozenset())
    loop = asyncio.new_event_loop()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    yield loop, http, daemon, alice
    loop.run_until_complete(http.aclose())
    loop.close()


PIECES = ["v1", "envs", "mine-1", "theirs-1", "snapshots", "snap-mine", "snap-theirs", "exec", "gc", "top",
          "metrics", "daemon", "stop", "processes", "1", "files", "ports", "8000", "commit", "fork", "network",
          "ttl", "pause", "sandboxes", "v2", "connect", "templates", "quota", "keys", "%2F", "%252F", "%3F",
          "%253F", "%23", "%2523", "%25", "%2e", "%2E%2E", ".", "..", "%65nvs", "%2565nvs", "%2567c", "%2574op",
          "%256detrics", "%C3%A9", "%E9", "%00", "%0a", "?", "#", "%5C", "\\", "%2f", "%252f"]
SEPARATORS = ["/", "", "/", "/"]


@st.composite
def paths(draw: Any) -> str:
    pieces = draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=6))
    out = draw(st.sampled_from(["/v1/", "/", "/v1/envs/", "/sandboxes/"]))
    for i, p in enumerate(pieces):
        out += (draw(st.sampled_from(SEPARATORS)) if i else "") + p
    return out


BODIES = [b"", b"{}", b'{"n": 2}', b'{"ref": "os:v1"}', b'{"cmd": "true"}',
          b'{"plan": {"name": "x", "network": "host", "mounts": [{"source": "/etc", "target": "/mnt"}]}}',
          b'{"snapshot": "snap-theirs"}', b'{"templateID": "bb"}']


def _send(loop: Any, http: httpx.AsyncClient, method: str, path: str, key: str,
          body: bytes) -> tuple[httpx.Response, str]:
    """The answer, and the path as it went (httpx drops dot segments and fragments on the way)."""
    target, _, query = path.partition("#")[0].partition("?")  # a client never sends what follows '#'
    url = httpx.URL("http://t").copy_with(raw_path=(target + ("?" + query if query else "")).encode("ascii"))
    headers = {"Authorization": f"Bearer {key}", "X-API-Key": key, "content-type": "application/json"}
    req = http.build_request(method, url, content=body, headers=headers)
    return loop.run_until_complete(asyncio.wait_for(http.send(req), 10)), req.url.raw_path.decode("ascii")


@FUZZ
@given(path=paths(), method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]), body=st.sampled_from(BODIES))
def test_every_daemon_call_is_what_the_key_may_do_and_what_its_path_names(app_and_daemon, path, method,  # type: ignore[no-untyped-def]
                                                                          body) -> None:
    _count("API paths (/v1, E2B, envd: encodings, separators, dot segments): authorization = routing",
           "test_every_daemon_call_is_what_the_key_may_do_and_what_its_path_names")
    loop, http, daemon, alice = app_and_daemon
    daemon.calls.clear()
    r, path = _send(loop, http, method, path, alice, body)
    # 501: a Docker Engine API route weenv does not serve (docs/docker.md), said in Docker's shape
    assert r.status_code < 500 or r.status_code in (502, 503) or (
        r.status_code == 501 and "Docker API does not support" in r.text), (method, path, r.status_code, r.text[:300])
    for template, call_method, params, sent in daemon.calls:
        where = f"{method} {path!r} -> daemon {call_method} {template} {params}"
        assert template not in ADMIN_ONLY, where
        assert params.get("id") not in ("theirs-1", "snap-theirs"), where
        if template == "/v1/envs" and call_method == "POST":
            doc = json.loads(sent)
            assert doc.get("restricted") is True, where
            assert "mounts" not in json.dumps(doc) and '"host"' not in json.dumps(doc), where
    raw = path.partition("?")[0]
    if raw.startswith("/v1/") and r.status_code < 400 and raw not in ("/v1/quota", "/v1/keys"):
        spec, params = route_of(method, raw)  # the API served it: the daemon got that route, those params
        assert [(c[0], c[1], c[2]) for c in daemon.calls if c[0] == spec.template] == \
            [(spec.template, spec.method, params)], (method, path, daemon.calls)


@FUZZ
@given(path=paths())
def test_a_path_is_read_one_way_or_refused(path: str) -> None:
    """What split_path accepts, a server reading it once more finds nothing more to decode."""
    _count("API paths: split_path reads once or refuses", "test_a_path_is_read_one_way_or_refused")
    raw = path.partition("?")[0].partition("#")[0]
    try:
        segments = split_path(raw)
    except PathError as e:
        assert e.message
        return
    for s in segments:
        assert "/" not in s and "%" not in s and "?" not in s and "#" not in s and s not in ("", ".", "..")


def test_every_daemon_route_has_an_access_rule_and_the_daemon_serves_exactly_the_table() -> None:
    from weenv._routes import DAEMON_ROUTES
    from weenv.api._native import ACCESS

    assert set(ACCESS) == {r.name for r in DAEMON_ROUTES}
    assert sorted((r.method, r.template) for r in DAEMON_ROUTES) == \
        sorted((s.method, s.template) for s in ROUTER.specs)


@pytest.mark.parametrize("path", [
    "/v1/envs%252Ftheirs-1%252Fexec", "/v1/envs%2Ftheirs-1%2Fexec", "/v1/%2567c", "/v1/%2574op", "/v1/%256detrics",
    "/v1/daemon%252Fstop", "/v1/%2565nvs", "/v1/envs%3F", "/v1/envs%23", "/v1/top%23", "/v1/envs/mine-1/%2e%2e/theirs-1",
    "/v1/envs/mine-1%2F..%2Ftheirs-1/exec", "/sandboxes/theirs-1%2Fpause", "/v1/envs/theirs-1%00"])
def test_the_attacks_found_are_refused_in_process(app_and_daemon, path: str) -> None:  # type: ignore[no-untyped-def]
    loop, http, daemon, alice = app_and_daemon
    daemon.calls.clear()
    r, _ = _send(loop, http, "POST", path, alice, b'{"cmd": "id"}')
    assert r.status_code in (400, 404, 405), (path, r.status_code, r.text)
    assert daemon.calls == [] or all(c[2].get("id") != "theirs-1" for c in daemon.calls)
    assert msgspec.json.decode(r.content)
