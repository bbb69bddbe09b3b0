"""E2B's volumes: the control plane (``/volumes``, with the API key) and the volume content API
(``/volumecontent/{id}/...``, with the volume's own token), onto the daemon's ``/v1/volumes``.

- A volume belongs to the key that created it (its record in ``envs.json``, ``volumes``): another
  key gets 404 for it everywhere (get, delete, content, ``volume_mounts`` on create) and does not
  list it; admin keys see and use every volume. Names are the key's own (E2B's are per team): two
  keys may both have a volume ``data``; the daemon knows it by its id.
- The content token (``token`` in create and get_info) is ``HMAC(secret, "volume", id, owner key
  id)``: nothing stored, it opens that volume's files only, and stops working with its key. The
  SDK sends content calls to ``E2B_VOLUME_API_URL`` (else ``https://api.{domain}``): point it at
  ``weenv serve``. :class:`ContentGate` takes those requests before the API-key gate.
- ``volume_mounts`` on create (``{"name", "path"}``) become ``[[volumes]]`` tables in the create's
  overrides (:func:`add_mounts`), by id: the daemon binds them read-write.
- Paths in the content API are the volume's own (``/`` is its root; a relative path is from it);
  the daemon resolves them inside the volume, so a symlink there never leads out of it.
"""

from __future__ import annotations

import datetime as dt
import posixpath
import re
import time
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ._common import ApiState, HttpError, daemon_errors, key_of, read_body, state_of
from ._store import ApiKey, may_use, owns

MAX_BODY_BYTES = 64 << 10
MAX_FILE_BYTES = 256 << 20  # the daemon's upload bound
MAX_LIST_DEPTH = 16
MAX_LISTED = 100_000
_VOLUME_ID = re.compile(r"^vol-[0-9a-f]{12}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_KIND_TYPE = {"file": "file", "dir": "directory", "symlink": "symlink"}


class _NewVolume(msgspec.Struct):
    name: str


class _Attrs(msgspec.Struct, omit_defaults=True):
    uid: int | None = None
    gid: int | None = None
    mode: int | None = None


def _json(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")


def _not_found(ref: str) -> HttpError:
    return HttpError(404, "volume_not_found", f"volume {ref!r} not found")


def _find(state: ApiState, key: ApiKey, ref: str) -> tuple[str, dict[str, Any]]:
    """The id and API record of the volume ``ref`` (an id, or one of the key's names) that ``key``
    may use; a 404 otherwise (another key's volume does not exist)."""
    vols = state.owners.volumes()
    rec = vols.get(ref)
    if rec is not None and may_use(key, rec):
        return ref, rec
    mine = [(i, r) for i, r in vols.items() if r.get("name") == ref and owns(key, r)]
    if not mine and key.admin:
        mine = [(i, r) for i, r in vols.items() if r.get("name") == ref]
    if len(mine) == 1:
        return mine[0]
    raise _not_found(ref)


def _token(state: ApiState, vol_id: str, rec: dict[str, Any]) -> str:
    return state.tokens.mint_volume(vol_id, str(rec.get("owner_id") or ""))


def _with_token(state: ApiState, vol_id: str, rec: dict[str, Any]) -> dict[str, Any]:
    return {"volumeID": vol_id, "name": rec.get("name") or vol_id, "token": _token(state, vol_id, rec)}


# -- the control plane (the API key was checked by the gate) ------------------------------------


async def create(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    try:
        body = msgspec.json.decode(await read_body(request, MAX_BODY_BYTES) or b"{}", type=_NewVolume)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"request body: {e}") from None
    if not _NAME.match(body.name):
        raise HttpError(400, "bad_request", f"volume name {body.name[:100]!r}: letters, digits, '_', '.' and '-' "
                        "(at most 63, starting with a letter or digit)")
    if any(r.get("name") == body.name and owns(key, r) for r in state.owners.volumes().values()):
        raise HttpError(409, "conflict", f"a volume named {body.name!r} exists already")
    async with daemon_errors():
        info = await state.backend.create_volume()  # in a cluster: on the node placement picks
    rec = {**key.owner_fields(), "name": body.name, "created_s": time.time()}
    state.owners.put_volume(info.id, rec)
    return _json(_with_token(state, info.id, rec), 201)


async def list_volumes(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    async with daemon_errors():
        live = {v.id for v in await state.backend.list_volumes()}  # every node's
    out = [{"volumeID": i, "name": r.get("name") or i} for i, r in sorted(
        state.owners.volumes().items(), key=lambda kv: kv[1].get("created_s", 0)) if i in live and may_use(key, r)]
    return _json(out)


async def get_volume(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    vol_id, rec = _find(state, key, request.path_params["volume_id"])
    async with daemon_errors():
        await (await state.backend.for_volume(vol_id)).volume(vol_id)  # still on its node
    return _json(_with_token(state, vol_id, rec))


async def delete_volume(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    vol_id, _ = _find(state, key, request.path_params["volume_id"])
    async with daemon_errors():
        await state.backend.delete_volume(vol_id)  # 409 volume_in_use while a sandbox mounts it
    state.owners.forget_volume(vol_id)
    return Response(b"", 204)


def routes() -> list[Route]:
    return [Route("/volumes", create, methods=["POST"]), Route("/volumes", list_volumes, methods=["GET"]),
            Route("/volumes/{volume_id}", get_volume, methods=["GET"]),
            Route("/volumes/{volume_id}", delete_volume, methods=["DELETE"])]


def add_mounts(state: ApiState, key: ApiKey, mounts: list[Any] | None, req: dict[str, Any]) -> None:
    """E2B's ``volume_mounts`` (each ``name`` and ``path``) as ``[[volumes]]`` tables of the create
    ``req``'s overrides, by volume id; a volume the key may not use is a 404 before anything starts."""
    if not mounts:
        return
    tables = []
    for m in mounts:
        name, path = getattr(m, "name", None), getattr(m, "path", None)
        if not isinstance(name, str) or not isinstance(path, str):
            raise HttpError(400, "bad_request", "request body $.volumeMounts: each needs a name and a path")
        vol_id, _ = _find(state, key, name)
        tables.append({"name": vol_id, "path": path})
    req.setdefault("overrides", {})["volumes"] = tables


# -- the content API (the volume's token) -------------------------------------------------------


def _owner_live(state: ApiState, rec: dict[str, Any]) -> bool:
    return state.keys.live(str(rec.get("owner_id") or "")) is not None


def _content_volume(request: Request) -> str:
    """The volume the request's path names, if its bearer token is that volume's; else a 401 or 404."""
    state: ApiState = request.app.state.api
    vol_id = request.path_params["volume_id"]
    auth = request.headers.get("authorization", "")
    presented = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    rec = state.owners.volume(vol_id) if _VOLUME_ID.match(vol_id) else None
    if rec is None or not _owner_live(state, rec) or not state.tokens.verify_volume(vol_id, rec["owner_id"],
                                                                                      presented):
        state.metrics.auth_failures.labels("volume", "missing_token" if not presented else "wrong_token").inc()
        raise HttpError(401, "unauthorized", f"missing or wrong volume token for volume {vol_id}")
    return vol_id


def _path(request: Request) -> str:
    path = request.query_params.get("path")
    if not path or "\0" in path:
        raise HttpError(400, "bad_request", "query string $.path: a path is needed")
    return posixpath.normpath("/" + path).replace("//", "/")


def _int(request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit() or int(value) > 0xFFFFFFFF:
        raise HttpError(400, "bad_request", f"query string $.{name}: {value[:20]!r} is not a whole number")
    return value


def _mode(value: int | str | None) -> str | None:
    return None if value is None else f"{int(value) & 0o7777:o}"


async def _daemon(state: ApiState, route: str, vol_id: str, query: dict[str, Any], content: Any = None) -> bytes:
    """The daemon's volume route's answer, or its error as an HttpError (its status and kind)."""
    async with daemon_errors():
        client = await state.backend.for_volume(vol_id)  # the volume's node
        resp = await client.send_route(route, {"id": vol_id}, query={k: v for k, v in query.items() if v is not None},
                                       content=content)
    try:
        data = await resp.aread()
    finally:
        await resp.aclose()
    if resp.status_code >= 400:
        try:
            err = msgspec.json.decode(data).get("error", {})
        except (msgspec.DecodeError, AttributeError):
            err = {}
        kind = err.get("kind") or "daemon_error"
        status = 404 if kind in ("file_not_found", "volume_not_found") else resp.status_code
        raise HttpError(status, kind, str(err.get("message") or f"HTTP {resp.status_code}"))
    return data


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _entry(info: dict[str, Any], path: str) -> dict[str, Any]:
    when = _iso(float(info.get("mtime_s") or 0))
    out = {"name": info.get("name") or posixpath.basename(path) or "/", "type": _KIND_TYPE.get(info.get("kind"), "unknown"),
           "path": path, "size": int(info.get("size_bytes") or 0), "mode": int(info.get("mode") or 0),
           "uid": int(info.get("uid") or 0), "gid": int(info.get("gid") or 0), "atime": when, "mtime": when,
           "ctime": when}
    if info.get("link_target") is not None:
        out["target"] = info["link_target"]
    return out


async def _stat(state: ApiState, vol_id: str, path: str) -> dict[str, Any]:
    return _entry(msgspec.json.decode(await _daemon(state, "volume_files_get", vol_id, {"path": path, "op": "stat"})),
                  path)


async def content_dir(request: Request) -> Response:
    state, vol_id, path = request.app.state.api, _content_volume(request), _path(request)
    if request.method == "POST":
        query = {"path": path, "uid": _int(request, "uid"), "gid": _int(request, "gid"),
                 "mode": _mode(_int(request, "mode"))}
        return _json(_entry(msgspec.json.decode(await _daemon(state, "volume_files_mkdir", vol_id, query)), path), 201)
    depth = int(_int(request, "depth") or 1)
    if not 1 <= depth <= MAX_LIST_DEPTH:
        raise HttpError(400, "bad_request", f"query string $.depth: 1 to {MAX_LIST_DEPTH}, not {depth}")
    out: list[dict[str, Any]] = []
    level = [path]
    for _ in range(depth):
        below = []
        for d in level:
            entries = msgspec.json.decode(await _daemon(state, "volume_files_get", vol_id, {"path": d, "op": "list"}))
            for info in entries:
                e = _entry(info, posixpath.join(d, info["name"]))
                out.append(e)
                if e["type"] == "directory":
                    below.append(e["path"])
            if len(out) > MAX_LISTED:
                raise HttpError(400, "bad_request", f"over {MAX_LISTED} entries: list a smaller depth")
        level = below
    return _json(out)


async def content_path(request: Request) -> Response:
    state, vol_id, path = request.app.state.api, _content_volume(request), _path(request)
    if request.method == "GET":
        return _json(await _stat(state, vol_id, path))
    if request.method == "DELETE":
        await _stat(state, vol_id, path)  # a missing path is E2B's 404
        await _daemon(state, "volume_files_delete", vol_id, {"path": path, "recursive": "1"})
        return Response(b"", 204)
    try:
        attrs = msgspec.json.decode(await read_body(request, MAX_BODY_BYTES) or b"{}", type=_Attrs)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"request body: {e}") from None
    for name in ("uid", "gid", "mode"):
        value = getattr(attrs, name)
        if value is not None and not 0 <= value <= 0xFFFFFFFF:
            raise HttpError(400, "bad_request", f"request body $.{name}: {value} is out of range")
    query = {"path": path, "uid": None if attrs.uid is None else str(attrs.uid),
             "gid": None if attrs.gid is None else str(attrs.gid), "mode": _mode(attrs.mode)}
    return _json(_entry(msgspec.json.decode(await _daemon(state, "volume_files_chattr", vol_id, query)), path))


async def content_file(request: Request) -> Response:
    state, vol_id, path = request.app.state.api, _content_volume(request), _path(request)
    if request.method == "GET":
        return Response(await _daemon(state, "volume_files_get", vol_id, {"path": path}), 200,
                        media_type="application/octet-stream")
    data = await read_body(request, MAX_FILE_BYTES)
    query = {"path": path, "uid": _int(request, "uid"), "gid": _int(request, "gid"),
             "mode": _mode(_int(request, "mode"))}
    return _json(_entry(msgspec.json.decode(await _daemon(state, "volume_files_put", vol_id, query, data)), path), 201)


async def _content_error(request: Request, exc: Exception) -> Response:
    e = exc if isinstance(exc, HttpError) else HttpError(getattr(exc, "status_code", 500), "internal", str(exc))
    return _json({"code": e.status, "message": e.message}, e.status)


class ContentGate:
    """``/volumecontent/...`` (the volume content API, each request with its volume's token) before
    ``app`` (the API's gate, which wants an API key): the one place the content API is served."""

    def __init__(self, app: ASGIApp, state: ApiState, control: Starlette | None = None):
        """``control``: the control plane app, which gets the ``/volumes`` routes (:func:`routes`)."""
        from starlette.exceptions import HTTPException

        if control is not None:
            control.router.routes.extend(routes())
        self.app = app
        self.content = Starlette(routes=[
            Route("/volumecontent/{volume_id}/dir", content_dir, methods=["GET", "POST"]),
            Route("/volumecontent/{volume_id}/path", content_path, methods=["GET", "PATCH", "DELETE"]),
            Route("/volumecontent/{volume_id}/file", content_file, methods=["GET", "PUT"]),
        ], exception_handlers={HttpError: _content_error, HTTPException: _content_error})
        self.content.state.api = state
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/volumecontent/"):
            await self.content(scope, receive, send)
            return
        await self.app(scope, receive, send)
