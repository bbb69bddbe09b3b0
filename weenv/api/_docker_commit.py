"""Docker's ``POST /commit`` (``container.commit()``) and ``GET /containers/{id}/export``
(``container.export()``).

A commit is a weenv commit of the container's env (weenv/provision/envs/_commit.py: the env frozen
by its cgroup's freezer while its upper is sealed into a layer, then thawed), recorded as an image
of the key's (weenv/api/_docker_images.py) whose envs start from that snapshot. Its config is the
container's (Cmd, Entrypoint, Env, WorkingDir, User, Labels, ...), then the request body's, then
``changes``: Dockerfile lines read by weenv's Dockerfile reader (weenv/build/_dockerfile.py, on
dockerfile-parse), the instructions dockerd's commit takes that change a config.

An export is the tar of the env's rootfs ``/``, the daemon's archive route (every member
resolved inside the rootfs, streamed in pieces: nothing held whole), relayed as it comes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import posixpath
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ._common import HttpError, daemon_errors, key_of, relay, state_of
from ._docker_containers import _flag, _json, docker_state, find
from ._docker_images import find_id, remember, tag_ref

MAX_COMMIT_BODY_BYTES = 1 << 20
CHANGES = ("CMD", "ENTRYPOINT", "ENV", "WORKDIR", "USER", "LABEL", "EXPOSE", "STOPSIGNAL")
"""The ``changes`` instructions weenv applies (dockerd's also take ONBUILD and VOLUME: refused,
as weenv's builder refuses them)."""


class CommitConfig(msgspec.Struct):
    """The fields of the commit body (a container config) weenv applies over the container's."""

    Cmd: list[str] | None = None
    Entrypoint: list[str] | None = None
    Env: list[str] | None = None
    WorkingDir: str | None = None
    User: str | None = None
    Labels: dict[str, str] | None = None
    ExposedPorts: dict[str, Any] | None = None
    StopSignal: str | None = None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def apply_changes(config: dict[str, Any], changes: list[str]) -> dict[str, Any]:
    """``config`` (an image config: Cmd, Env, ...) with Dockerfile lines applied; a 400 naming
    the line for an instruction that is not a config change, or one that does not parse."""
    from ..build._dockerfile import DockerfileError, argv_of, exposed, key_values, parse, substitute

    text = "\n".join(c for c in changes if c.strip())
    if not text:
        return config
    out = dict(config)
    env = dict(e.split("=", 1) for e in out.get("Env") or [] if "=" in e)
    try:
        df = parse("FROM changes\n" + text, "changes")
        if len(df.stages) != 1:
            raise DockerfileError("changes: FROM is not a change")
        shell = ["/bin/sh", "-c"]
        for ins in df.stages[0].instructions:
            ins.line -= 1  # the line of the changes, not of the FROM put before them
            if ins.op not in CHANGES:
                raise DockerfileError(f"{ins.where('changes')}: not a change a commit applies (one of "
                                      f"{', '.join(CHANGES)})")
            if ins.op == "CMD":
                out["Cmd"] = argv_of(ins, shell)
            elif ins.op == "ENTRYPOINT":
                out["Entrypoint"] = argv_of(ins, shell)
            elif ins.op == "ENV":
                env.update(key_values(ins, {}, env, "changes"))
                out["Env"] = [f"{k}={v}" for k, v in env.items()]
            elif ins.op == "LABEL":
                out["Labels"] = {**(out.get("Labels") or {}), **dict(key_values(ins, {}, env, "changes"))}
            elif ins.op == "WORKDIR":
                out["WorkingDir"] = posixpath.normpath(posixpath.join(out.get("WorkingDir") or "/",
                                                                      substitute(ins.value, {}, env)))
            elif ins.op == "USER":
                out["User"] = substitute(ins.value, {}, env)
            elif ins.op == "EXPOSE":
                out["ExposedPorts"] = {**(out.get("ExposedPorts") or {}),
                                       **{p: {} for p in exposed(ins, {}, env, "changes")}}
            else:
                out["StopSignal"] = substitute(ins.value, {}, env)
    except DockerfileError as e:
        raise HttpError(400, "bad_request", str(e)[:500]) from None
    return out


_CONFIG_KEYS = ("User", "ExposedPorts", "Env", "Cmd", "WorkingDir", "Entrypoint", "Labels", "StopSignal")


async def commit(request: Request, params: dict[str, str]) -> Response:
    from ._docker import _arch
    from ._native import _record_snapshot

    state, key = state_of(request), key_of(request)
    q = request.query_params
    ref = tag_ref(q["repo"], q.get("tag", "")) if q.get("repo") else None
    if not q.get("container"):
        raise HttpError(400, "bad_request", "container: the container to commit is required")
    c = find(request, q["container"])
    _flag(request, "pause", True)  # checked: weenv's commit always freezes the env (docs/docker.md)
    body = await request.body()
    if len(body) > MAX_COMMIT_BODY_BYTES:
        raise HttpError(413, "too_large", f"commit body: more than {MAX_COMMIT_BODY_BYTES} bytes")
    try:
        given = msgspec.json.decode(body or b"{}", type=CommitConfig | None) or CommitConfig()
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"commit body (a container config): {e}") from None
    parent = find_id(request, c.image_id)
    parent_doc = parent.config if parent is not None else {}
    config = {k: c.config.get(k) for k in _CONFIG_KEYS if c.config.get(k) is not None}
    config.pop("StopSignal", None)  # the container's is SIGTERM unless it said otherwise: the image's is kept
    if (parent_doc.get("config") or {}).get("StopSignal"):
        config["StopSignal"] = parent_doc["config"]["StopSignal"]
    if (parent_doc.get("config") or {}).get("ExposedPorts"):
        config["ExposedPorts"] = parent_doc["config"]["ExposedPorts"]
    config.update({k: v for k, v in msgspec.structs.asdict(given).items() if v is not None})
    config = apply_changes(config, q.getlist("changes"))
    async with daemon_errors():
        answer = await state.backend.commit(c.env_id)
    _record_snapshot(state, key, answer.snapshot, c.env_id, [])
    created = _now()
    rootfs = parent_doc.get("rootfs") or {}
    diff_ids = [*(rootfs.get("diff_ids") or []), *[x["digest"] for x in answer.layers[-1:] if "digest" in x]]
    doc = {"architecture": parent_doc.get("architecture") or _arch(), "os": parent_doc.get("os") or "linux",
           "created": created, "author": q.get("author", ""), "comment": q.get("comment", ""), "config": config,
           "container": c.id, "parent": c.image_id, "rootfs": {"type": "layers", "diff_ids": diff_ids},
           "history": [*(parent_doc.get("history") or []),
                       {"created": created, "created_by": " ".join(c.argv), "comment": q.get("comment", "")}]}
    image_id = "sha256:" + hashlib.sha256(msgspec.json.encode([doc, answer.snapshot])).hexdigest()
    size = (parent.size_bytes if parent is not None else 0) + int(answer.diff_bytes)
    remember(docker_state(state), key, ref, image_id, doc, size, origin={"snapshot": answer.snapshot})
    return _json({"Id": image_id}, 201)


async def export(request: Request, params: dict[str, str]) -> Response:
    state = state_of(request)
    c = find(request, params["id"])
    async with daemon_errors():
        resp = await state.backend.for_env(c.env_id).send_route("archive_get", {"id": c.env_id},
                                                                query=[("path", "/")])
    if resp.status_code >= 400:
        detail = (await resp.aread())[:300].decode(errors="replace")
        await resp.aclose()
        raise HttpError(resp.status_code, "daemon_error", f"export of {c.id[:12]}: {detail}")
    return StreamingResponse(relay(resp), 200, media_type="application/octet-stream")


ROUTES = [
    ("POST", "commit", commit),
    ("GET", "containers/{id}/export", export),
]
