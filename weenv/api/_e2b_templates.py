"""E2B's template API (what the SDK's ``Template.build``, ``build_in_background``, ``exists`` and
tags call), built on weenv's own builder (weenv/build/_templatebuild.py): docs/e2b.md, "Templates
through the SDK".

A template belongs to the key that built it: another key gets 404 for it and its builds, and
cannot build over, tag or delete it. Its tags are ordinary template aliases (``NAME`` for the
``default`` tag, ``NAME:TAG`` for the others) in ``templates.json``, naming the lock the build
wrote and their owner; ``Sandbox.create(NAME)`` starts that lock, then the template's start
command, and answers once its ready command succeeded.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
import urllib.parse
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ._common import ApiState, HttpError, key_of, log, read_body, state_of
from ._e2b_template_builds import (
    ACTIVE_BUILDS_PER_KEY,
    BuildJob,
    alias_of,
    builds_of,
    check_aliases_free,
    iso,
    new_build_id,
    publish_tags,
    run_build,
)
from ._store import ApiKey

MAX_BODY_BYTES = 1 << 20
MAX_UPLOAD_BYTES = int(os.environ.get("WEENV_TEMPLATE_UPLOAD_MAX_BYTES", str(512 << 20)))
MAX_STEPS = 256
MAX_ARG_BYTES = 64 << 10
MAX_TAGS = 16
MAX_TEMPLATES_PER_KEY = 256
UPLOAD_URL_TTL_S = 3600
STATUS_PAGE = 100
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")
_USER = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_.-]{0,31}|[0-9]{1,10})(?::(?:[A-Za-z_][A-Za-z0-9_.-]{0,31}|[0-9]{1,10}))?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_UPLOAD_PATH = re.compile(r"^/templates/([A-Za-z0-9]{1,64})/files/([0-9a-f]{64})$")


class _Body(msgspec.Struct, omit_defaults=True):
    """Lenient as the other E2B bodies (fields weenv has no use for are ignored); types checked."""


class NewTemplate(_Body):
    name: str | None = None
    alias: str | None = None
    tags: list[str] | None = None
    cpuCount: int | None = None
    memoryMB: int | None = None
    minFreeDiskMb: int | None = None


class Step(_Body):
    type: str
    args: list[str] = []
    filesHash: str | None = None
    force: bool | None = None
    forceUpload: bool | None = None


class BuildStart(_Body):
    fromImage: str | None = None
    fromTemplate: str | None = None
    fromImageRegistry: dict[str, Any] | None = None
    force: bool | None = None
    steps: list[Step] = []
    startCmd: str | None = None
    readyCmd: str | None = None


class TagsBody(_Body):
    tags: list[str]
    target: str | None = None
    name: str | None = None


def _json(data: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json")


def _bad(field: str, why: str) -> HttpError:
    return HttpError(400, "bad_request", f"request body $.{field}: {why}")


async def _decode(request: Request, cls: type[Any]) -> Any:
    body = await read_body(request, MAX_BODY_BYTES)
    try:
        return msgspec.json.decode(body or b"{}", type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"request body: {e}") from None


def _split_name(text: str, field: str) -> tuple[str, str | None]:
    name, colon, tag = text.partition(":")
    if "/" in name:  # E2B's team namespaces: weenv's names are the node's, one level
        name = name.rsplit("/", 1)[1]
    if not _NAME.match(name):
        raise _bad(field, f"{text[:100]!r}: a name is 1-64 letters, digits, '_', '.' or '-' (then ':TAG')")
    if colon and not _NAME.match(tag):
        raise _bad(field, f"{text[:100]!r}: a tag is 1-64 letters, digits, '_', '.' or '-'")
    return name, tag if colon else None


def _check_tags(tags: list[str], field: str) -> list[str]:
    if len(tags) > MAX_TAGS:
        raise _bad(field, f"at most {MAX_TAGS} tags")
    for i, t in enumerate(tags):
        if not _NAME.match(t):
            raise _bad(f"{field}[{i}]", f"{t[:100]!r}: a tag is 1-64 letters, digits, '_', '.' or '-'")
    return list(dict.fromkeys(tags))


# -- POST /v3/templates ------------------------------------------------------------------------


async def request_build(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    body: NewTemplate = await _decode(request, NewTemplate)
    text = body.name or body.alias
    if not text:
        raise _bad("name", "a template name is needed ('name' or 'name:tag')")
    name, tag = _split_name(text, "name")
    tags = _check_tags([*([tag] if tag else []), *(body.tags or [])] or ["default"], "tags")
    if body.cpuCount is not None and not 1 <= body.cpuCount <= 64:
        raise _bad("cpuCount", f"{body.cpuCount}: 1..64 cores")
    if body.memoryMB is not None and not 64 <= body.memoryMB <= 1 << 20:
        raise _bad("memoryMB", f"{body.memoryMB}: 64..1048576 MiB")
    builds = builds_of(state)
    found = builds.by_name(name)
    if found is not None and found[1].get("owner_id") != key.id:
        raise HttpError(409, "conflict", f"template name '{name}' is taken (another key's template): choose another")
    check_aliases_free(state, key, name, tags)
    if builds.active(key) >= ACTIVE_BUILDS_PER_KEY:
        raise HttpError(429, "quota_exceeded", f"this key has {ACTIVE_BUILDS_PER_KEY} builds running: wait for one")
    now = time.time()
    if found is None:
        if sum(1 for r in builds.templates().values() if r.get("owner_id") == key.id) >= MAX_TEMPLATES_PER_KEY:
            raise HttpError(429, "quota_exceeded", f"this key has {MAX_TEMPLATES_PER_KEY} templates: delete one")
        tid = "tpl" + secrets.token_hex(8)
        tpl = {**key.owner_fields(), "name": name, "created_s": now, "tags": {}}
    else:
        tid, tpl = found
    bid = new_build_id()
    builds.put(templates={tid: tpl}, builds={bid: {"template_id": tid, "owner_id": key.id, "status": "waiting",
                                                    "tags": tags, "created_s": now, "cpu": body.cpuCount,
                                                    "memory_mb": body.memoryMB}})
    return _json({"templateID": tid, "buildID": bid, "public": False, "names": [alias_of(name, t) for t in tags],
                  "tags": tags, "aliases": [name]}, 202)


# -- files: GET the upload link, PUT the tar ---------------------------------------------------


def _upload_signature(state: ApiState, owner_id: str, tid: str, files_hash: str, expires: int) -> str:
    return state.tokens.sign("template-upload", f"{tid}/{files_hash}/{expires}", owner_id)


def upload_signer(state: ApiState, scope: Any) -> ApiKey | None:
    """The key a signed upload URL (``PUT /templates/{id}/files/{hash}?expires=&signature=``, what
    :func:`file_link` hands out) was signed for, while it is valid; None for anything else."""
    m = _UPLOAD_PATH.match(scope.get("path") or "")
    if m is None or scope.get("method") != "PUT":
        return None
    q = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")))
    expires, signature = q.get("expires", ""), q.get("signature", "")
    if not expires.isdigit() or int(expires) < time.time() or not signature:
        return None
    tpl = builds_of(state).template(m.group(1))
    owner_id = str((tpl or {}).get("owner_id") or "")
    key = state.keys.live(owner_id) if owner_id else None
    if key is None:
        return None
    expected = _upload_signature(state, owner_id, m.group(1), m.group(2), int(expires))
    return key if hmac.compare_digest(expected, signature) else None


def _hash_param(request: Request) -> str:
    files_hash = request.path_params["hash"]
    if not _HASH.match(files_hash):
        raise HttpError(400, "bad_request", f"files hash {files_hash[:80]!r}: 64 lowercase hex digits (sha256)")
    return files_hash


async def file_link(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    tid, tpl = builds_of(state).owned(key, request.path_params["id"])
    files_hash = _hash_param(request)
    owner = builds_of(state).uploaded(ApiKey({"id": tpl["owner_id"], "name": ""}), files_hash)
    expires = int(time.time()) + UPLOAD_URL_TTL_S
    sig = _upload_signature(state, str(tpl["owner_id"]), tid, files_hash, expires)
    url = f"{str(request.base_url).rstrip('/')}/templates/{tid}/files/{files_hash}?" + \
        urllib.parse.urlencode({"expires": expires, "signature": sig})
    return _json({"present": owner is not None, "url": url}, 201)


async def upload_file(request: Request) -> Response:
    """The tar of a COPY's files (what the SDK PUTs to the link), kept as it came (never unpacked
    on the host: the build reads it member by member, weenv/build/_templatebuild.py)."""
    state, key = state_of(request), key_of(request)
    _, tpl = builds_of(state).owned(key, request.path_params["id"])
    files_hash = _hash_param(request)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_UPLOAD_BYTES):
        raise HttpError(413, "too_large", f"upload Content-Length {length[:20]}: at most {MAX_UPLOAD_BYTES} bytes")
    owner = ApiKey({"id": tpl["owner_id"], "name": ""})
    path = builds_of(state).upload_path(owner, files_hash)
    await anyio.to_thread.run_sync(lambda: os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True))
    tmp = f"{path}.{secrets.token_hex(6)}.part"
    digest, size = hashlib.sha256(), 0
    try:
        async with await anyio.open_file(tmp, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_UPLOAD_BYTES:
                    raise HttpError(413, "too_large", f"upload over {MAX_UPLOAD_BYTES} bytes")
                digest.update(chunk)
                await f.write(chunk)
        await anyio.to_thread.run_sync(_keep_upload, tmp, path, digest.hexdigest())
    finally:
        await anyio.to_thread.run_sync(_unlink, tmp)
    return Response(b"", 200)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _keep_upload(tmp: str, path: str, digest: str) -> None:
    import tarfile

    if not tarfile.is_tarfile(tmp):
        raise HttpError(400, "bad_request", "upload: not a tar (plain or gzip)")
    os.replace(tmp, path)
    with open(path + ".sha256.part", "w", encoding="ascii") as f:
        f.write(digest)
    os.replace(path + ".sha256.part", path + ".sha256")


# -- POST /v2/templates/{id}/builds/{buildID} --------------------------------------------------


def _base(state: ApiState, key: ApiKey, body: BuildStart) -> dict[str, str]:
    from ..registry import is_image_ref
    from ._e2b_requests import _resolve_template
    from ._tenant import check_image

    if body.fromImageRegistry is not None:
        raise _bad("fromImageRegistry", "registry credentials are not taken: weenv reads the registries its node "
                   "reaches (for API keys, those `weenv serve --registry` lists)")
    if (body.fromImage is None) == (body.fromTemplate is None):
        raise _bad("fromImage", "give one of fromImage (an image REF) or fromTemplate (a template name)")
    if body.fromImage is not None:
        image = body.fromImage
        if not is_image_ref(image):
            raise _bad("fromImage", f"{image[:200]!r} names no registry host (weenv pulls from no default registry: "
                       "name HOST[:PORT]/repo:tag)")
        if not key.admin:
            try:
                check_image(state, key, image)
            except HttpError as e:
                raise HttpError(e.status, e.kind, e.message.replace("$.image", "$.fromImage")) from None
        return {"image": image}
    assert body.fromTemplate is not None
    try:
        entry = _resolve_template(state, key, body.fromTemplate)
    except HttpError as e:
        raise _bad("fromTemplate", e.message) from None
    return {k: entry[k] for k in ("lock", "snapshot", "image") if k in entry}


def _steps(state: ApiState, key: ApiKey, owner: ApiKey, body: BuildStart) -> list[Any]:
    from ..build._templatebuild import STEP_KINDS, TemplateStep

    if len(body.steps) > MAX_STEPS:
        raise _bad("steps", f"{len(body.steps)} steps: at most {MAX_STEPS}")
    out = []
    for i, s in enumerate(body.steps):
        where = f"steps[{i}]"
        kind = s.type.upper()
        if kind not in STEP_KINDS:
            raise _bad(f"{where}.type", f"{s.type[:40]!r} is not one of {', '.join(STEP_KINDS)}")
        for j, a in enumerate(s.args):
            if len(a.encode()) > MAX_ARG_BYTES or "\0" in a:
                raise _bad(f"{where}.args[{j}]", f"at most {MAX_ARG_BYTES} bytes, no NUL")
        n = len(s.args)
        want = {"RUN": (1, 2), "COPY": (2, 4), "ENV": (2, 2 * 256), "WORKDIR": (1, 1), "USER": (1, 2)}[kind]
        if not want[0] <= n <= want[1] or (kind == "ENV" and n % 2) or not s.args[0].strip():
            raise _bad(f"{where}.args", f"{kind} takes {want[0]}..{want[1]} arguments{' (pairs)' if kind == 'ENV' else ''}"
                       f", the first not empty; got {n}")
        files = digest = None
        if kind == "ENV":
            for j in range(0, n, 2):
                if not _ENV_NAME.match(s.args[j]):
                    raise _bad(f"{where}.args[{j}]", f"{s.args[j][:80]!r} is not an environment variable name")
        elif kind == "USER" and not _USER.match(s.args[0]):
            raise _bad(f"{where}.args[0]", f"{s.args[0][:80]!r} is not a user name or uid[:gid]")
        elif kind == "RUN" and n > 1 and s.args[1] and not _USER.match(s.args[1]):
            raise _bad(f"{where}.args[1]", f"{s.args[1][:80]!r} is not a user name or uid[:gid]")
        elif kind == "COPY":
            if n > 2 and s.args[2] and not _USER.match(s.args[2]):
                raise _bad(f"{where}.args[2]", f"{s.args[2][:80]!r} is not user[:group]")
            if n > 3 and s.args[3] and not re.fullmatch(r"0?[0-7]{3,4}", s.args[3]):
                raise _bad(f"{where}.args[3]", f"{s.args[3][:20]!r} is not an octal mode")
            if not s.filesHash or not _HASH.match(s.filesHash):
                raise _bad(f"{where}.filesHash", "COPY needs the files hash its upload was made under")
            got = builds_of(state).uploaded(owner, s.filesHash)
            if got is None:
                raise _bad(f"{where}.filesHash", f"no upload for {s.filesHash}: GET /templates/{{id}}/files/{{hash}} "
                           "and PUT the tar to its url first")
            files, digest = got
        out.append(TemplateStep(kind=kind, args=list(s.args), force=bool(s.force), files=files, files_digest=digest))
    return out


async def start_build(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    builds = builds_of(state)
    tid, bid = request.path_params["id"], request.path_params["build"]
    build = builds.owned_build(key, tid, bid)
    tpl = builds.template(tid) or {}
    body: BuildStart = await _decode(request, BuildStart)
    for field in ("startCmd", "readyCmd"):
        value = getattr(body, field)
        if value is not None and (len(value.encode()) > MAX_ARG_BYTES or "\0" in value):
            raise _bad(field, f"at most {MAX_ARG_BYTES} bytes, no NUL")
    base = _base(state, key, body)
    owner = ApiKey({"id": tpl["owner_id"], "name": tpl.get("owner") or ""})
    steps = _steps(state, key, owner, body)
    if build.get("status") != "waiting" or bid in builds.live:
        raise HttpError(409, "wrong_state", f"build {bid} was started already ({build.get('status')})")
    if state.tasks is None:
        raise HttpError(503, "daemon_unavailable", "the server is stopping")
    job = BuildJob(key=owner if not key.admin else key, template_id=tid, build_id=bid, name=tpl["name"],
                   tags=list(build.get("tags") or ["default"]), base=base, steps=steps, start_cmd=body.startCmd,
                   ready_cmd=body.readyCmd, force=bool(body.force), cpu=build.get("cpu"),
                   memory_mb=build.get("memory_mb"))
    from ._e2b_template_builds import LiveBuild

    builds.live[bid] = LiveBuild()
    builds.put(builds={bid: {**build, "status": "building", "start_cmd": body.startCmd, "ready_cmd": body.readyCmd,
                             "steps": len(steps), "base": base}})
    state.tasks.start_soon(run_build, state, job)
    return Response(b"", 202)


# -- status, logs ------------------------------------------------------------------------------


def _int_param(request: Request, name: str, default: int, top: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or int(raw) > top:
        raise HttpError(400, "bad_request", f"{name}: {raw[:20]!r} is not a whole number 0..{top}")
    return int(raw)


def _levels(request: Request) -> set[str] | None:
    level = request.query_params.get("level")
    order = ["debug", "info", "warn", "error"]
    if level is None:
        return None
    if level not in order:
        raise HttpError(400, "bad_request", f"level: {level[:20]!r} is not one of {', '.join(order)}")
    return set(order[order.index(level):])


async def build_status(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    builds = builds_of(state)
    tid, bid = request.path_params["id"], request.path_params["build"]
    rec = builds.owned_build(key, tid, bid)
    offset = _int_param(request, "logsOffset", 0, 1 << 30)
    limit = _int_param(request, "limit", STATUS_PAGE, STATUS_PAGE) or STATUS_PAGE
    levels = _levels(request)
    entries = [e for e in builds.entries(bid, rec) if levels is None or e["level"] in levels]
    page = entries[offset:offset + limit]
    status = rec.get("status", "waiting")
    answer: dict[str, Any] = {"templateID": tid, "buildID": bid, "status": status, "logEntries": page,
                              "logs": [f"[{e['timestamp']}] {e['message']}" for e in page]}
    if status == "error" and rec.get("reason"):
        answer["reason"] = rec["reason"]
    return _json(answer)


async def build_logs(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    builds = builds_of(state)
    tid, bid = request.path_params["id"], request.path_params["build"]
    rec = builds.owned_build(key, tid, bid)
    cursor = _int_param(request, "cursor", 0, 1 << 62)
    limit = _int_param(request, "limit", STATUS_PAGE, 1000) or STATUS_PAGE
    direction = request.query_params.get("direction") or "forward"
    if direction not in ("forward", "backward"):
        raise HttpError(400, "bad_request", f"direction: {direction[:20]!r} (forward, backward)")
    levels = _levels(request)
    import datetime as dt

    def ms(e: dict[str, Any]) -> int:
        return int(dt.datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp() * 1000)

    entries = [e for e in builds.entries(bid, rec) if (levels is None or e["level"] in levels)]
    if direction == "forward":
        picked = [e for e in entries if ms(e) >= cursor][:limit]
    else:
        picked = [e for e in entries if not cursor or ms(e) <= cursor][-limit:][::-1]
    return _json({"logs": picked})


# -- aliases, tags, delete ---------------------------------------------------------------------


async def alias(request: Request) -> Response:
    """``Template.exists``: 200 for the caller's own template (and an operator's alias), else 404."""
    state, key = state_of(request), key_of(request)
    text = request.path_params["alias"]
    name = text.rsplit("/", 1)[-1]
    entry = state.templates.get(name.removesuffix(":default"))
    if entry is not None and entry.get("owner_id") is None:
        return _json({"templateID": name, "public": True})
    try:
        tid, _ = builds_of(state).owned(key, name)
    except HttpError:
        raise HttpError(404, "template_not_found", f"template '{text[:200]}' not found") from None
    return _json({"templateID": tid, "public": False})


async def assign_tags(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    body: TagsBody = await _decode(request, TagsBody)
    if not body.target:
        raise _bad("target", "the build to tag, as 'name:tag'")
    name, tag = _split_name(body.target, "target")
    tags = _check_tags(body.tags, "tags")
    if not tags:
        raise _bad("tags", "at least one tag")
    builds = builds_of(state)
    tid, tpl = builds.owned(key, name)
    ref = (tpl.get("tags") or {}).get(tag or "default")
    if ref is None:
        raise HttpError(404, "template_not_found", f"template '{name}' has no tag '{tag or 'default'}'")
    check_aliases_free(state, key, name, tags)
    build = builds.build(ref["build_id"]) or {}
    publish_tags(state, key, tid, tpl, ref["build_id"], tags, build)
    return _json({"tags": tags, "buildID": ref["build_id"]}, 201)


async def remove_tags(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    body: TagsBody = await _decode(request, TagsBody)
    if not body.name:
        raise _bad("name", "the template whose tags go")
    name, _ = _split_name(body.name, "name")
    tags = _check_tags(body.tags, "tags")
    builds = builds_of(state)
    tid, tpl = builds.owned(key, name)
    have = dict(tpl.get("tags") or {})
    missing = [t for t in tags if t not in have]
    if missing:
        raise HttpError(404, "template_not_found", f"template '{name}' has no tag '{missing[0]}'")
    state.templates.put({}, drop=[alias_of(tpl["name"], t) for t in tags])
    builds.put(templates={tid: {**tpl, "tags": {t: v for t, v in have.items() if t not in tags}}})
    return Response(b"", 204)


async def list_tags(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    _, tpl = builds_of(state).owned(key, request.path_params["id"])
    return _json([{"tag": t, "buildID": v["build_id"], "createdAt": iso(float(v["created_s"]))}
                  for t, v in sorted((tpl.get("tags") or {}).items())])


async def delete_template(request: Request) -> Response:
    """``DELETE /templates/{id}``: a template this key built (every tag, build and lock), else what
    the E2B module deletes there (the SDK's ``delete_snapshot``)."""
    from . import _e2b

    state, key = state_of(request), key_of(request)
    builds = builds_of(state)
    name = request.path_params["id"]
    try:
        tid, tpl = builds.owned(key, name)
    except HttpError:
        return await _e2b.delete_template(request)
    if any(rec.get("template_id") == tid for bid, rec in builds._data().get("builds", {}).items()
           if bid in builds.live):
        raise HttpError(409, "wrong_state", f"template '{name}' has a build running: delete it when it ends")
    mine = [bid for bid, rec in builds._data().get("builds", {}).items() if rec.get("template_id") == tid]
    state.templates.put({}, drop=[alias_of(tpl["name"], t) for t in (tpl.get("tags") or {})])
    builds.put(drop_templates=(tid,), drop_builds=tuple(mine))

    def remove_locks() -> None:
        import shutil

        shutil.rmtree(os.path.dirname(builds.lock_path(tid, "x")), ignore_errors=True)

    await anyio.to_thread.run_sync(remove_locks)
    return Response(b"", 204)


# -- Sandbox.create of a built template: its start command -------------------------------------

READY_AT_CREATE_S = 60.0


async def start_command(state: ApiState, entry: dict[str, Any], env_id: str) -> None:
    """After ``Sandbox.create`` of a template with a start command: start it (a process of the env's
    own, as the template's user, in its workdir, with its env) and wait for the ready command, as
    E2B's sandboxes are ready when created. A sandbox whose command never gets ready is killed (500)."""
    start, ready = entry.get("start_cmd"), entry.get("ready_cmd")
    if not start and not ready:
        return
    from ._common import daemon_errors

    env = state.backend.for_env(env_id).env(env_id)
    try:
        async with daemon_errors():
            if start:
                proc = await env.spawn(["/bin/sh", "-c", start], tag="e2b-start-cmd")
                await proc.detach()
            if ready:
                end = time.monotonic() + READY_AT_CREATE_S
                while True:
                    r = await env.exec(["/bin/sh", "-c", ready], timeout_s=max(1.0, min(30.0, end - time.monotonic())))
                    if r.exit_code == 0:
                        break
                    if time.monotonic() >= end:
                        raise HttpError(500, "start_failed", f"template start command {start!r}: the ready command "
                                        f"{ready!r} did not succeed within {READY_AT_CREATE_S:.0f} s")
                    await anyio.sleep(0.2)
    except HttpError:
        log.warning("sandbox %s of a template did not get ready: killed", env_id)
        with anyio.CancelScope(shield=True):
            try:
                await state.backend.kill(env_id)
            except Exception:  # noqa: BLE001 - it is being refused either way
                pass
            state.envs_gone([env_id])
        raise


def routes() -> list[Route]:
    return [
        Route("/v3/templates", request_build, methods=["POST"]),
        Route("/templates/tags", assign_tags, methods=["POST"]),
        Route("/templates/tags", remove_tags, methods=["DELETE"]),
        Route("/templates/aliases/{alias:path}", alias, methods=["GET"]),
        Route("/templates/{id}/files/{hash}", file_link, methods=["GET"]),
        Route("/templates/{id}/files/{hash}", upload_file, methods=["PUT"]),
        Route("/v2/templates/{id}/builds/{build}", start_build, methods=["POST"]),
        Route("/templates/{id}/builds/{build}/status", build_status, methods=["GET"]),
        Route("/templates/{id}/builds/{build}/logs", build_logs, methods=["GET"]),
        Route("/templates/{id:path}/tags", list_tags, methods=["GET"]),
        Route("/templates/{id:path}", delete_template, methods=["DELETE"]),
    ]
