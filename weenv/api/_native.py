"""``/v1``: the daemon's own API over TCP, for ``weenv.Client(URL, token=...)`` and ``weenv --host``.

Every route the Unix socket serves is passed through as it is (bodies streamed both ways, so an
exec's NDJSON output and a file upload flow as they come), with two things added: the caller's
key must own the env or snapshot a route names (another key's is a 404, as if it did not
exist; admin keys see everything), and node-wide routes (gc, top, metrics, daemon stop) need an
admin key.
"""

from __future__ import annotations

import json
import time
import tomllib
from typing import Any

import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ._common import ApiState, HttpError, daemon_errors, key_of, owned, owned_snapshot, read_body, relay, state_of
from ._store import ApiKey

_ADMIN_ONLY = {("POST", "gc"), ("GET", "top"), ("GET", "metrics"), ("POST", "daemon/stop")}
_PASS_HEADERS = ("content-type", "content-length")
MAX_CREATE_BODY_BYTES = 1 << 20


def routes() -> list[Route]:
    return [Route("/v1/{rest:path}", proxy, methods=["GET", "POST", "PUT", "DELETE"])]


def _forget(state: ApiState, env_id: str) -> None:
    state.owners.forget_envs([env_id])


def _record_env(state: ApiState, key: ApiKey, info: dict[str, Any], **extra: Any) -> None:
    state.owners.put_env(info["id"], {"owner": key.name, "started_s": info.get("created_s") or time.time(),
                                      **extra})


def _record_snapshot(state: ApiState, key: ApiKey, snap_id: str, source_env: str | None, names: list[str]) -> None:
    state.owners.put_snapshot(snap_id, {"owner": key.name, "source_env": source_env, "names": names,
                                        "created_s": time.time()})


def _plan_doc(req: dict[str, Any]) -> dict[str, Any]:
    """The plan a create request carries, as builtins (the daemon validates it; this only reads it)."""
    if isinstance(req.get("plan"), dict):
        return req["plan"]  # type: ignore[no-any-return]
    text = req.get("plan_text")
    if not isinstance(text, str):
        return {}
    try:
        doc = json.loads(text) if req.get("format") == "json" else tomllib.loads(text)
    except ValueError as e:
        raise HttpError(400, "bad_plan", f"request body $.plan_text: not a {req.get('format', 'toml')} "
                        f"document: {e}") from None
    return doc if isinstance(doc, dict) else {}


async def _check_create(state: ApiState, key: ApiKey, body: bytes) -> None:
    """A create must name a snapshot the key owns; and without an admin key, a plan may reach
    nothing of the node: no host bind mounts, not the node's network."""
    try:
        req = msgspec.json.decode(body or b"{}")
    except msgspec.DecodeError:
        return  # the daemon says what is wrong with it
    if not isinstance(req, dict) or key.admin:
        return
    if isinstance(req.get("snapshot"), str) and owned_snapshot(state, key, req["snapshot"]) is None:
        raise HttpError(404, "snapshot_not_found", f"snapshot {req['snapshot']!r} not found")
    overrides = req.get("overrides") if isinstance(req.get("overrides"), dict) else {}
    doc = _plan_doc(req)
    net = doc.get("network")
    mode = net.get("mode") if isinstance(net, dict) else net
    if overrides.get("network") == "host" or mode == "host":
        raise HttpError(403, "forbidden", "network \"host\" (the node's own network) needs an admin key")
    if doc.get("mounts"):
        raise HttpError(403, "forbidden", "host bind mounts ($.mounts) need an admin key")


async def proxy(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    rest = request.path_params["rest"].strip("/")
    parts = rest.split("/")
    if any(p in ("", ".", "..") for p in parts):
        # the URL is normalised on the way to the daemon: envs/mine/../theirs would be theirs
        raise HttpError(400, "bad_request", f"/v1/{rest}: empty, '.' and '..' path segments are not allowed")
    method = request.method
    if (method, rest) in _ADMIN_ONLY and not key.admin:
        raise HttpError(403, "forbidden", f"{method} /v1/{rest} needs an admin key")
    env_id = parts[1] if parts[0] == "envs" and len(parts) > 1 else None
    snap_id = parts[1] if parts[0] == "snapshots" and len(parts) > 1 else None
    if env_id is not None:
        owned(state, key, env_id)
    if snap_id is not None and not key.admin and owned_snapshot(state, key, snap_id) is None:
        raise HttpError(404, "snapshot_not_found", f"snapshot {snap_id!r} not found")
    client = state.backend.for_env(env_id) if env_id else state.backend.all()[0]

    inspect = (rest in ("envs", "snapshots") or (env_id is not None and len(parts) == 3
                                                  and parts[2] in ("fork", "commit")))
    headers = {h: request.headers[h] for h in _PASS_HEADERS if h in request.headers}
    if method == "POST" and rest == "envs":
        body = await read_body(request, MAX_CREATE_BODY_BYTES)
        await _check_create(state, key, body)
        client = state.backend.for_create({})
        content: Any = body
    elif method in ("PUT", "POST"):
        content = request.stream()
    else:
        content = None
    async with daemon_errors():
        await client._ensure()
        upstream = client._http.build_request(method, "/v1/" + rest, params=request.query_params.multi_items(),
                                              headers=headers, content=content, timeout=None)
        try:
            resp = await client._http.send(upstream, stream=True)
        except httpx.TransportError:
            raise HttpError(503, "daemon_unavailable", "the node's weenv daemon does not answer") from None
    if not inspect or resp.status_code >= 400:
        if method == "DELETE" and env_id is not None and len(parts) == 2 and resp.status_code < 300:
            _forget(state, env_id)
        return StreamingResponse(relay(resp), resp.status_code,
                                 headers={h: resp.headers[h] for h in ("content-type",) if h in resp.headers})
    data = await resp.aread()
    await resp.aclose()
    answer = msgspec.json.decode(data)
    if method == "GET" and rest == "envs" and not key.admin:
        mine = state.owners.envs()
        answer = [e for e in answer if mine.get(e["id"], {}).get("owner") == key.name]
    elif method == "GET" and rest == "snapshots" and not key.admin:
        mine = state.owners.snapshots()
        answer = [s for s in answer if mine.get(s["id"], {}).get("owner") == key.name]
    elif method == "POST" and rest == "envs":
        _record_env(state, key, answer)
    elif env_id is not None and parts[2] == "commit":
        _record_snapshot(state, key, answer["snapshot"], env_id, [])
    elif env_id is not None and parts[2] == "fork":
        _record_snapshot(state, key, answer["snapshot"], env_id, [])
        parent = state.owners.env(env_id) or {}
        for child in answer["envs"]:
            _record_env(state, key, child, template=parent.get("template"), metadata=parent.get("metadata", {}))
    return Response(msgspec.json.encode(answer), resp.status_code, media_type="application/json")
