"""Docker's archive routes: ``GET``/``HEAD``/``PUT /containers/{id}/archive`` (docker-py's
``get_archive`` / ``put_archive``), on the daemon's own tar routes (weenv/provision/envs/_archive.py:
every member resolved inside the env's rootfs, owners mapped onto its user namespace).

As Docker: the path must exist (404 ``Could not find the file PATH in container ID``), a put's
path must be a directory, and the answer carries ``X-Docker-Container-Path-Stat`` (base64 JSON:
name, size, mode with Go's ``os.FileMode`` type bits, mtime, linkTarget).
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .._connection import ApiError as DaemonError
from ._common import ApiState, HttpError, daemon_errors, relay, state_of
from ._docker_containers import Container, _env, docker_time, find

MODE_DIR, MODE_SYMLINK = 1 << 31, 1 << 27  # Go's os.FileMode bits, as Docker's path stat carries them


def _archive_path(request: Request) -> str:
    path = request.query_params.get("path")
    if not path:
        raise HttpError(400, "bad_request", "Bad parameters: path is required (the path in the container)")
    return path if path.startswith("/") else "/" + path


async def _stat(state: ApiState, c: Container, path: str) -> Any:
    try:
        return await _env(state, c).stat(path)
    except DaemonError as e:
        if e.status == 404:
            raise HttpError(404, "not_found", f"Could not find the file {path} in container {c.id[:12]}") from None
        async with daemon_errors():
            raise


async def archive_head_or_get(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    c = find(request, params["id"])
    path = _archive_path(request)
    st = await _stat(state, c, path)
    mode = st.mode | (MODE_DIR if st.kind == "dir" else MODE_SYMLINK if st.kind == "symlink" else 0)
    stat_doc = {"name": path.rstrip("/").rsplit("/", 1)[-1] or "/", "size": st.size_bytes, "mode": mode,
                "mtime": docker_time(st.mtime_s).replace("000Z", "Z"), "linkTarget": st.link_target or ""}
    headers = {"X-Docker-Container-Path-Stat": base64.b64encode(msgspec.json.encode(stat_doc)).decode()}
    if request.method == "HEAD":
        return Response(b"", 200, headers=headers)
    async with daemon_errors():
        resp = await state.backend.for_env(c.env_id).send_route("archive_get", {"id": c.env_id},
                                                                query=[("path", path)])
    if resp.status_code >= 400:
        detail = (await resp.aread())[:300].decode(errors="replace")
        await resp.aclose()
        raise HttpError(resp.status_code, "daemon_error", f"get archive {path}: {detail}")
    return StreamingResponse(relay(resp), 200, media_type="application/x-tar", headers=headers)


async def archive_put(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    c = find(request, params["id"])
    path = _archive_path(request)
    st = await _stat(state, c, path)
    if st.kind != "dir":
        raise HttpError(400, "bad_request", f"extraction point is not a directory: {path}")
    async with daemon_errors():
        resp = await state.backend.for_env(c.env_id).send_route(
            "archive_put", {"id": c.env_id}, query=[("path", path)], content=request.stream(),
            headers={"content-type": "application/x-tar"})
    answer = await resp.aread()
    await resp.aclose()
    if resp.status_code >= 400:
        try:
            message = msgspec.json.decode(answer).get("error", {}).get("message") or answer.decode(errors="replace")
        except (msgspec.DecodeError, AttributeError):
            message = answer[:300].decode(errors="replace")
        raise HttpError(resp.status_code, "bad_request", f"put archive into {path}: {message}"[:500])
    return Response(b"", 200)


ROUTES = [
    ("GET", "containers/{id}/archive", archive_head_or_get),
    ("PUT", "containers/{id}/archive", archive_put),
]
