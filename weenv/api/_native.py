"""``/v1``: the daemon's own API over TCP, for ``weenv.Client(URL, token=...)`` and ``weenv --host``.

Every route the daemon serves (:data:`weenv._routes.DAEMON_ROUTES`) is served here, bodies
streamed both ways (an exec's NDJSON output and a file upload flow as they come), each under the
access rule :data:`ACCESS` gives it; a route without a rule is not served (a test pins that every
daemon route has one). The request path is read once (:func:`weenv._routes.split_path`, from the
path as it came): the same decoded segments pick the route, name the env or snapshot that is
authorized, and are the parameters of the daemon call, which is built from the route's template
(:meth:`~weenv.AsyncClient.send_route`), never from the request's text.

- ``any``: every key (``/v1/ping``);
- ``admin``: node-wide routes (gc, top, metrics, daemon stop) need an admin key;
- ``env``: the caller's key must own the env (another key's is a 404, as if it did not exist;
  admin keys may use every env);
- ``snapshot``: likewise for the snapshot;
- ``list``: the answer is filtered to the key's own;
- ``create``: what a non-admin plan may ask for is checked first (_tenant.py), and quotas;
- ``volume``: the caller's key must own the volume (as ``env``); ``volume_create`` records the
  caller as the new volume's owner.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .. import _wire as wire
from .._routes import DAEMON_ROUTES, PathError, RouteSpec, match, split_path
from ._common import (
    ApiState,
    HttpError,
    daemon_errors,
    env_token,
    key_of,
    owned,
    owned_snapshot,
    read_body,
    relay,
    state_of,
    traffic_token,
)
from ._store import ApiKey, may_use

ACCESS: dict[str, str] = {
    "ping": "any",
    "daemon_stop": "admin", "gc": "admin", "top": "admin", "metrics": "admin",
    "snapshot_pull": "admin",  # the node reaches the registry REF names, and the snapshot is no key's
    "env_create": "create", "env_list": "list", "snapshot_list": "list",
    "snapshot_show": "snapshot", "snapshot_delete": "snapshot",
    "volume_create": "volume_create", "volume_list": "list",
    **{name: "volume" for name in ("volume_show", "volume_delete", "volume_files_get", "volume_files_put",
                                   "volume_files_mkdir", "volume_files_chattr", "volume_files_delete")},
    **{name: "env" for name in (
        "env_show", "env_kill", "env_commit", "env_fork", "env_pause", "env_resume", "env_ttl", "env_metrics", "env_exec",
        "process_start", "process_list", "process_show", "process_stream", "process_stdin", "process_signal",
        "process_resize", "process_wait", "port_tunnel", "files_get", "files_put", "files_mkdir", "files_move",
        "files_delete", "archive_get", "archive_put",
        "network_show", "network_change")},
}
"""The access rule of every daemon route served under ``/v1`` (see the module docstring)."""

_PASS_HEADERS = ("content-type", "content-length")
MAX_CREATE_BODY_BYTES = 1 << 20
MAX_SMALL_BODY_BYTES = 1 << 20
_STREAMED_BODIES = {"files_put", "archive_put", "port_tunnel", "volume_files_put"}


def routes() -> list[Route]:
    return [Route("/v1/{rest:path}", proxy, methods=["GET", "POST", "PUT", "DELETE"])]


def _raw_path(request: Request) -> str:
    raw = request.scope.get("raw_path")
    if isinstance(raw, (bytes, bytearray)):
        return raw.decode("latin-1").split("?", 1)[0]
    import urllib.parse

    return urllib.parse.quote(request.scope["path"], safe="/")


def route_of(method: str, raw_path: str) -> tuple[RouteSpec, dict[str, str]]:
    """The daemon route a ``/v1`` request names and its parameters (an HttpError 400/404/405 otherwise)."""
    try:
        segments = split_path(raw_path)
    except PathError as e:
        raise HttpError(400, "bad_path", e.message) from None
    spec, found = match(DAEMON_ROUTES, method, segments)
    if spec is None:
        if found:
            raise HttpError(405, "method_not_allowed", f"{method} is not allowed on {raw_path[:200]}")
        raise HttpError(404, "no_route", f"no API route {method} {raw_path[:200]}")
    assert isinstance(found, dict)
    return spec, found


def _record_env(state: ApiState, key: ApiKey, info: dict[str, Any], **extra: Any) -> None:
    state.owners.put_env(info["id"], {**key.owner_fields(), "started_s": info.get("created_s") or time.time(),
                                      **extra})


def _record_snapshot(state: ApiState, key: ApiKey, snap_id: str, source_env: str | None, names: list[str]) -> None:
    state.owners.put_snapshot(snap_id, {**key.owner_fields(), "source_env": source_env, "names": names,
                                        "created_s": time.time()})


def _authorize(state: ApiState, key: ApiKey, spec: RouteSpec, params: dict[str, str]) -> dict[str, Any] | None:
    """Apply the route's access rule; the env's API record for ``env`` routes."""
    rule = ACCESS.get(spec.name)
    if rule is None:  # a daemon route nobody gave a rule: not served
        raise HttpError(404, "no_route", f"{spec.method} {spec.template} is not served over TCP")
    if rule == "admin" and not key.admin:
        raise HttpError(403, "forbidden", f"{spec.method} {spec.template} needs an admin key")
    if rule == "env":
        return owned(state, key, params["id"])
    if rule == "snapshot" and not key.admin and owned_snapshot(state, key, params["id"]) is None:
        raise HttpError(404, "snapshot_not_found", f"snapshot {params['id']!r} not found")
    if rule == "volume" and not may_use(key, state.owners.volume(params["id"])) and not (
            key.admin and state.owners.volume(params["id"]) is None):
        raise HttpError(404, "volume_not_found", f"volume {params['id']!r} not found")
    return None


async def _relay_then(resp: Any, then: Any) -> Any:
    try:
        async for chunk in relay(resp):
            yield chunk
    finally:
        then()


_TYPED = {"env_create": 201, "env_list": 200, "env_show": 200, "snapshot_list": 200, "env_commit": 201,
          "env_fork": 201, "env_kill": 200, "env_resume": 200, "snapshot_delete": 200, "volume_create": 201, "volume_list": 200,
          "volume_delete": 200}
"""Routes the API calls through the backend's typed calls (it reads their answers to record or
filter them, and the backend places, spreads or refreshes); the rest are relayed as they stream."""


def _request_body(cls: type, body: bytes) -> Any:
    """A body the daemon would refuse is refused here the same way (a 400 naming the place)."""
    try:
        return wire.decode(body or b"{}", cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"request body: {e}") from None


async def _typed(state: ApiState, key: ApiKey, name: str, params: dict[str, str], body: bytes,
                 rec: dict[str, Any] | None) -> Response:
    from . import _tenant

    backend = state.backend
    admission = None
    public_traffic = False
    try:
        async with daemon_errors():
            if name == "env_create":
                req, public_traffic, plan = _tenant.create_body(state, key, body)
                admission = await _tenant.admit_create(state, key, req, plan)
                answer: Any = await backend.create(req)
            elif name == "env_list":
                answer = await backend.list_envs()
            elif name == "snapshot_list":
                answer = await backend.list_snapshots()
            elif name == "env_show":
                answer = await backend.for_env(params["id"]).env(params["id"]).refresh()
            elif name == "env_commit":
                commit = _request_body(wire.CommitRequest, body)
                answer = await backend.commit(params["id"], ref=_tenant.commit_body(key, {"ref": commit.ref})["ref"])
            elif name == "env_fork":
                fork = _request_body(wire.ForkRequest, body)
                admission = await _tenant.admit_fork(state, key, rec or {}, {"n": fork.n})
                answer = await backend.fork(params["id"], fork.n)
            elif name == "env_kill":
                _request_body(wire.Empty, body)
                answer = await backend.kill(params["id"])
            elif name == "env_resume":
                _request_body(wire.Empty, body)
                answer = await backend.resume(params["id"])
            elif name == "volume_create":
                from .. import _wire_volumes as vw

                vol = _request_body(vw.VolumeCreateRequest, body)
                answer = await backend.create_volume(vol.name, size_bytes=vol.size_bytes)
            elif name == "volume_list":
                answer = await backend.list_volumes()
            elif name == "volume_delete":
                _request_body(wire.Empty, body)
                await backend.delete_volume(params["id"])
                answer = {"id": params["id"]}
            else:
                assert name == "snapshot_delete"
                await backend.delete_snapshot(params["id"])
                answer = wire.SnapshotRemoved(id=params["id"])
        return _answer(state, key, name, params, msgspec.to_builtins(answer), _TYPED[name], public_traffic,
                       admission)
    finally:
        if admission is not None:
            admission.release()


async def proxy(request: Request) -> Response:
    from . import _tenant

    state, key = state_of(request), key_of(request)
    spec, params = route_of(request.method, _raw_path(request))
    rec = _authorize(state, key, spec, params)
    name = spec.name
    if name in _TYPED:
        limit = MAX_CREATE_BODY_BYTES if name == "env_create" else MAX_SMALL_BODY_BYTES
        body = await read_body(request, limit) if request.method in ("POST", "PUT", "DELETE") else b""
        return await _typed(state, key, name, params, body, rec)
    headers = {h: request.headers[h] for h in _PASS_HEADERS if h in request.headers}
    ended = None
    if name in _STREAMED_BODIES:
        content: Any = request.stream()
    else:
        content = (await read_body(request, MAX_SMALL_BODY_BYTES) if request.method in ("POST", "PUT") else b"") or None
        if name in ("env_exec", "process_start"):
            ended = await state.quotas.start_process(key, lambda: _tenant.count_running(state, key))
    if isinstance(content, bytes):
        headers["content-length"] = str(len(content))
    try:
        async with daemon_errors():
            if ACCESS[name] == "env":
                client = state.backend.for_env(params["id"])
            elif ACCESS[name] == "volume":  # the volume's node (a cluster's volumes are node-local)
                client = await state.backend.for_volume(params["id"])
            elif ACCESS[name] == "snapshot":
                client = await state.backend.for_snapshot(params["id"])
            else:
                client = state.backend.any()
            if name == "metrics":
                return await _metrics(state)
            resp = await client.send_route(name, params, query=request.query_params.multi_items(), content=content,
                                           headers=headers)
        after = ended if name == "env_exec" and resp.status_code < 400 else None  # ends with its answer
        if resp.status_code < 400 and name in ("process_start", "env_exec"):
            ended = None  # a process runs on after its stream: counted until a look at the daemon finds it ended
        stream = relay(resp) if after is None else _relay_then(resp, after)
        return StreamingResponse(stream, resp.status_code,
                                 headers={h: resp.headers[h] for h in ("content-type",) if h in resp.headers})
    finally:
        if ended is not None:
            ended()


async def _metrics(state: ApiState) -> Response:
    return Response(await daemon_metrics(state), 200, media_type="text/plain; version=0.0.4; charset=utf-8")


async def daemon_metrics(state: ApiState) -> bytes:
    """Every daemon's prometheus text, one after the other (each node's series carry its labels)."""
    parts = []
    for client in state.backend.daemons():
        resp = await client.send_route("metrics")
        data = await resp.aread()
        await resp.aclose()
        if resp.status_code >= 400:
            raise HttpError(resp.status_code, "daemon_error", f"a daemon's /v1/metrics: HTTP {resp.status_code}")
        parts.append(data)
    return b"".join(parts)


def _with_tokens(state: ApiState, info: dict[str, Any]) -> dict[str, Any]:
    """An env's answer with its access token (envd, and its ports) and, when its ports are not
    public, its traffic token (its ports only): what the owner hands to whoever may reach it."""
    rec = state.owners.env(info["id"])
    out = {**info, "access_token": env_token(state, info["id"], rec)}
    if not (rec or {}).get("public_traffic", False):
        out["traffic_token"] = traffic_token(state, info["id"], rec)
    return out


def _answer(state: ApiState, key: ApiKey, name: str, params: dict[str, str], answer: Any, status: int,
            public_traffic: bool, admission: Any) -> Response:
    """An inspected answer: filtered to the key's own, or recorded as its own."""
    held = admission.record() if admission is not None else {}
    if name == "env_list" and not key.admin:
        mine = state.owners.envs()
        answer = [e for e in answer if may_use(key, mine.get(e["id"]))]
    elif name == "snapshot_list" and not key.admin:
        mine = state.owners.snapshots()
        answer = [s for s in answer if may_use(key, mine.get(s["id"]))]
    elif name == "env_create":
        _record_env(state, key, answer, public_traffic=public_traffic, **held)
        answer = _with_tokens(state, answer)
    elif name == "env_show":
        answer = _with_tokens(state, answer)
    elif name == "env_commit":
        _record_snapshot(state, key, answer["snapshot"], params["id"], [])
    elif name == "env_fork":
        _record_snapshot(state, key, answer["snapshot"], params["id"], [])
        parent = state.owners.env(params["id"]) or {}
        for child in answer["envs"]:
            _record_env(state, key, child, template=parent.get("template"), metadata=parent.get("metadata", {}),
                        public_traffic=parent.get("public_traffic", False), **held)
        answer = {**answer, "envs": [_with_tokens(state, child) for child in answer["envs"]]}
    elif name == "env_kill":
        state.envs_gone([params["id"]])
    elif name == "snapshot_delete":
        state.owners.forget_snapshot(params["id"])
    elif name == "volume_create":
        state.owners.put_volume(answer["id"], {**key.owner_fields(), "name": answer["name"],
                                               "daemon_name": answer["name"], "created_s": time.time()})
    elif name == "volume_list" and not key.admin:
        mine = state.owners.volumes()
        answer = [v for v in answer if may_use(key, mine.get(v["id"]))]
    elif name == "volume_delete":
        state.owners.forget_volume(params["id"])
    return Response(msgspec.json.encode(answer), status, media_type="application/json")
