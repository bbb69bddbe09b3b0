"""``/v1/quota`` (any key: its own limits and usage) and ``/v1/keys`` (admin keys: the API keys).

- ``GET /v1/quota``: ``{"key": {name, id, admin}, "limits": {...}, "usage": {...}}``.
- ``GET /v1/keys``: every key (never the keys themselves), with its limits.
- ``POST /v1/keys`` ``{"name", "admin"?, "limits"?}``: a new key, shown this once (``{"key": ...}``).
- ``POST /v1/keys/{name}/limits`` ``{"envs": 8, "cores": null, ...}``: replace those limits
  (null: back to the default).
- ``DELETE /v1/keys/{name}?envs=kill|keep``: revoke it (weenv/api/_reaper.py does the rest).

The same as ``weenv token create|ls|limits|revoke`` on the node itself.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ._common import HttpError, key_of, read_body, state_of
from ._quota import check_limits
from ._store import ApiKey, StoreError

MAX_BODY_BYTES = 64 << 10


def _json(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")


def _admin(request: Request) -> ApiKey:
    key = key_of(request)
    if not key.admin:
        raise HttpError(403, "forbidden", f"{request.method} {request.url.path} needs an admin key")
    return key


async def _body(request: Request) -> dict[str, Any]:
    raw = await read_body(request, MAX_BODY_BYTES)
    try:
        doc = msgspec.json.decode(raw or b"{}")
    except msgspec.DecodeError as e:
        raise HttpError(400, "bad_request", f"request body: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise HttpError(400, "bad_request", "request body: expected a JSON object")
    return doc


def _limits(doc: Any, where: str) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise HttpError(400, "bad_request", f"{where}: expected an object of limits")
    try:
        return check_limits(doc, where)
    except ValueError as e:
        raise HttpError(400, "bad_request", str(e)) from None


def _shown(request: Request, key: ApiKey) -> dict[str, Any]:
    state = state_of(request)
    return {"name": key.name, "id": key.id, "admin": key.admin, "created_s": key.created_s,
            "limits": state.quotas.limits(key)}


async def quota(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    usage = state.quotas.usage(key)
    usage["watchers"] = sum(1 for w in state.watchers.values() if getattr(w, "owner_id", None) == key.id)
    return _json({"key": {"name": key.name, "id": key.id, "admin": key.admin}, "limits": state.quotas.limits(key),
                  "usage": usage})


async def keys_list(request: Request) -> Response:
    _admin(request)
    return _json([_shown(request, k) for k in sorted(state_of(request).keys.list(), key=lambda k: k.created_s)])


async def keys_create(request: Request) -> Response:
    _admin(request)
    doc = await _body(request)
    name, admin = doc.get("name"), doc.get("admin", False)
    if not isinstance(name, str) or not isinstance(admin, bool):
        raise HttpError(400, "bad_request", "request body: {\"name\": str, \"admin\": bool, \"limits\": {...}}")
    limits = {k: v for k, v in _limits(doc.get("limits"), "request body $.limits").items() if v is not None}
    state = state_of(request)
    try:
        secret = state.keys.create(name, admin=admin, limits=limits or None)
    except StoreError as e:
        raise HttpError.of(e.kind, str(e)) from None
    return _json({**_shown(request, state.keys.get(name)), "key": secret}, 201)


async def keys_limits(request: Request) -> Response:
    _admin(request)
    limits = _limits(await _body(request), "request body")
    try:
        key = state_of(request).keys.set_limits(request.path_params["name"], limits)
    except StoreError as e:
        raise HttpError.of(e.kind, str(e)) from None
    return _json(_shown(request, key))


async def keys_revoke(request: Request) -> Response:
    _admin(request)
    envs = request.query_params.get("envs", "kill")
    try:
        gone = state_of(request).keys.revoke(request.path_params["name"], envs=envs)
    except StoreError as e:
        raise HttpError.of(e.kind, str(e)) from None
    return _json({"name": gone.name, "id": gone.id, "revoked": True, "envs": envs})


def routes() -> list[Route]:
    return [
        Route("/v1/quota", quota, methods=["GET"]),
        Route("/v1/keys", keys_list, methods=["GET"]),
        Route("/v1/keys", keys_create, methods=["POST"]),
        Route("/v1/keys/{name}/limits", keys_limits, methods=["POST"]),
        Route("/v1/keys/{name}", keys_revoke, methods=["DELETE"]),
    ]
