"""Docker's ``POST /containers/create``: the body read (the fields weenv maps, the rest ignored
as Docker ignores what it does not know), the tenant's checks and quotas of ``/v1``'s create,
the image's config read from its registry, the env started, the container recorded
(weenv/api/_docker_containers.py)."""

from __future__ import annotations

import secrets
import shlex
import time
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ._common import HttpError, daemon_errors, key_of, log, read_body, state_of
from ._docker import not_supported
from ._docker_containers import _NAME, Container, _json, docker_state, emit
from ._docker_images import find_id, find_tag, normalized, remember
from ._store import ApiKey

MAX_CREATE_BODY_BYTES = 1 << 20


class HostConfigBody(msgspec.Struct):
    Memory: int = 0
    NanoCpus: int = 0
    CpuQuota: int = 0
    CpuPeriod: int = 0
    NetworkMode: str = ""
    Binds: list[str] | None = None
    Mounts: list[Any] | None = None
    AutoRemove: bool = False
    Privileged: bool = False


class CreateBody(msgspec.Struct):
    """The fields of Docker's ``ContainerCreateRequest`` weenv reads (the rest are ignored, as
    Docker ignores what it does not know)."""

    Image: str = ""
    Cmd: list[str] | str | None = None
    Entrypoint: list[str] | str | None = None
    Env: list[str] | None = None
    WorkingDir: str = ""
    User: str = ""
    Labels: dict[str, str] | None = None
    Tty: bool = False
    OpenStdin: bool = False
    AttachStdin: bool = False
    StdinOnce: bool = False
    StopSignal: str | None = None
    StopTimeout: int | None = None
    HostConfig: HostConfigBody | None = None


def _argv(value: list[str] | str | None) -> list[str] | None:
    return shlex.split(value) if isinstance(value, str) else value


_BIND_OPTIONS = frozenset({"ro", "rw", "z", "Z", "private", "rprivate", "slave", "rslave", "shared", "rshared",
                           "nocopy"})


def host_binds(hc: HostConfigBody) -> list[dict[str, str]]:
    """``HostConfig.Binds`` (``/host:/ctr[:ro]``) and ``Mounts`` (``Type: bind``) as the plan's
    ``[[mounts]]``: weenv's host binds are read-only (nodev, nosuid, noexec), so a bind must say
    ``ro`` (``ReadOnly: true``); a named volume, tmpfs or a writable bind is 501 naming it. The plan
    checks the paths (no source that exposes the host: /, /etc, /proc, ... ; docs/plans.md)."""
    out = []
    for i, bind in enumerate(hc.Binds or []):
        where = f"HostConfig.Binds[{i}] {bind[:200]!r}"
        parts = bind.split(":")
        if len(parts) not in (2, 3) or not all(parts[:2]):
            raise HttpError(400, "bad_request", f"{where}: expected /HOST/PATH:/CONTAINER/PATH[:ro]")
        opts = set(parts[2].split(",")) if len(parts) == 3 else set()
        if not parts[0].startswith("/"):
            raise not_supported(f"{where}: named volumes (a bind names an absolute host path)")
        if not parts[1].startswith("/"):
            raise HttpError(400, "bad_request", f"{where}: the container path must be absolute")
        if opts - _BIND_OPTIONS:
            raise HttpError(400, "bad_request", f"{where}: unknown option {sorted(opts - _BIND_OPTIONS)[0]!r}")
        if "ro" not in opts or "rw" in opts:
            raise not_supported(f"{where}: a writable host bind (weenv's host binds are read-only: add ':ro')")
        out.append({"source": parts[0], "target": parts[1]})
    for i, m in enumerate(hc.Mounts or []):
        where = f"HostConfig.Mounts[{i}]"
        if not isinstance(m, dict):
            raise HttpError(400, "bad_request", f"{where}: expected an object")
        if m.get("Type", "volume") != "bind":
            raise not_supported(f"{where}: Type {str(m.get('Type', 'volume'))[:50]!r} (bind is)")
        source, target = m.get("Source"), m.get("Target")
        if not isinstance(source, str) or not isinstance(target, str) or not source or not target:
            raise HttpError(400, "bad_request", f"{where}: Source and Target (absolute paths) are required")
        if m.get("ReadOnly") is not True:
            raise not_supported(f"{where}: a writable host bind (weenv's host binds are read-only: ReadOnly: true)")
        out.append({"source": source, "target": target})
    return out


def _overrides(key: ApiKey, body: CreateBody) -> dict[str, Any]:
    hc = body.HostConfig or HostConfigBody()
    out: dict[str, Any] = {}
    if hc.Binds or hc.Mounts:
        if not key.admin:
            raise HttpError(403, "forbidden", "HostConfig.Binds and HostConfig.Mounts (host paths) need an admin key")
        out["mounts"] = host_binds(hc)
    if hc.Privileged:
        raise not_supported("HostConfig.Privileged (weenv envs never get the host's devices or capabilities)")
    if hc.Memory < 0 or hc.NanoCpus < 0:
        raise HttpError(400, "bad_request", "HostConfig.Memory and HostConfig.NanoCpus cannot be negative")
    if hc.Memory:
        out["memory"] = hc.Memory
    if hc.NanoCpus:
        out["cpu"] = hc.NanoCpus / 1e9
    elif hc.CpuQuota > 0:
        out["cpu"] = hc.CpuQuota / (hc.CpuPeriod or 100_000)
    mode = hc.NetworkMode
    if mode in ("none", "host"):
        out["network"] = mode
    elif mode not in ("", "default", "bridge"):
        raise not_supported(f"HostConfig.NetworkMode {mode[:100]!r} (none, default and bridge are: the env's "
                            "network, docs/docker.md)")
    env = dict(e.split("=", 1) for e in body.Env or [] if "=" in e)
    if env:
        out["env"] = env
    if body.WorkingDir:
        out["workdir"] = body.WorkingDir
    if body.User:
        out["user"] = body.User
    return out


def read_image(ref: str) -> tuple[str, dict[str, Any], int]:
    """The image's config digest, its whole config document and its layers' (compressed) bytes, read
    from its registry as a pull reads it. Blocks: a worker thread's call."""
    import hashlib

    from ..registry._image import open_image_source

    src = open_image_source(ref)
    try:
        digest = src.config_digest or "sha256:" + hashlib.sha256(msgspec.json.encode(src.config)).hexdigest()
        return digest, dict(src.config), sum(layer.size for layer in src.layers)
    finally:
        src.close()


def _entrypoint_and_cmd(body: CreateBody, img: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Docker's rule: the create's Entrypoint and Cmd, else the image's; a create's Entrypoint
    drops the image's Cmd."""
    entrypoint, cmd = _argv(body.Entrypoint), _argv(body.Cmd)
    entrypoint = list(img.get("Entrypoint") or []) if entrypoint is None else entrypoint
    cmd = (list(img.get("Cmd") or []) if body.Entrypoint is None else []) if cmd is None else cmd
    return entrypoint, cmd


def _command(body: CreateBody, img: dict[str, Any]) -> list[str]:
    entrypoint, cmd = _entrypoint_and_cmd(body, img)
    return [*entrypoint, *cmd]


async def _kill_quietly(state: Any, env_id: str) -> None:
    try:
        async with daemon_errors():
            await state.backend.kill(env_id)
    except HttpError as e:
        log.warning("docker: killing env %s of a refused create: %s", env_id, e.message)


async def _start_env(state: Any, req: dict[str, Any], image: str) -> tuple[dict[str, Any], tuple[str, Any, int]]:
    """The env started and the image (:func:`read_image`), read side by side; an image
    whose config cannot be read is ``404 No such image`` (and its env, if one started, killed)."""
    got: dict[str, Any] = {}

    async def read_config() -> None:
        try:
            got["config"] = await anyio.to_thread.run_sync(read_image, image)
        except Exception as e:  # not there, not an image, a registry that does not answer
            got["error"] = e

    info: dict[str, Any] | None = None
    failed: HttpError | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(read_config)
        try:
            async with daemon_errors():
                info = msgspec.to_builtins(await state.backend.create(req))
        except HttpError as e:
            failed = e
    if "error" in got:
        if info is not None:
            await _kill_quietly(state, info["id"])
        e = got["error"]
        raise HttpError(404, "not_found", f"No such image: {image} ({type(e).__name__}: {e})"[:500])
    if failed is not None:
        raise failed
    assert info is not None
    return info, got["config"]


async def create(request: Request, params: dict[str, str]) -> Response:
    from . import _tenant
    from ._native import _record_env

    state, key = state_of(request), key_of(request)
    ds = docker_state(state)
    name = request.query_params.get("name", "")
    if name and not _NAME.match(name):
        raise HttpError(400, "bad_request", f"Invalid container name ({name[:130]}), only [a-zA-Z0-9][a-zA-Z0-9_.-] "
                        "are allowed")
    try:
        body = msgspec.json.decode(await read_body(request, MAX_CREATE_BODY_BYTES) or b"{}", type=CreateBody)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"container create body: {e}") from None
    if not body.Image:
        raise HttpError(400, "bad_request", "config.Image: an image reference is required")
    cid = secrets.token_hex(32)
    name = name.lstrip("/") or f"weenv_{cid[:12]}"
    taken = next((c for c in ds.containers.values() if c.name == name), None)
    if taken is not None:
        raise HttpError(409, "conflict", f'Conflict. The container name "/{name}" is already in use by container '
                        f'"{taken.id}". You have to remove (or rename) that container to be able to reuse that name.')
    overrides = _overrides(key, body)
    rec = find_tag(request, body.Image) or find_id(request, body.Image)  # the key's own names first
    if rec is None:
        from ..registry import is_image_ref

        if not is_image_ref(body.Image):  # not the key's, and no registry REF: as dockerd, no such image
            raise HttpError(404, "not_found", f"No such image: {body.Image[:500]}")
    source = rec.origin if rec is not None else {"image": body.Image}
    if rec is not None and rec.local:  # a commit or a build: its config is the record's, the env's too
        img_config = dict(rec.config.get("config") or {})
        env = dict(e.split("=", 1) for e in img_config.get("Env") or [] if "=" in e)
        overrides = {**overrides, "env": {**env, **overrides.get("env", {})}}
        for field_name, given in (("workdir", "WorkingDir"), ("user", "User")):
            if img_config.get(given) and field_name not in overrides:
                overrides[field_name] = img_config[given]
    req, _public, plan = _tenant.create_body(state, key, msgspec.json.encode({**source, "overrides": overrides}))
    admission = await _tenant.admit_create(state, key, req, plan)
    try:  # the image's config is read (after the tenant's checks) while the env starts: both ask the registry
        if rec is not None and rec.local:
            async with daemon_errors():
                info = msgspec.to_builtins(await state.backend.create(req))
            read: tuple[str, Any, int] = (rec.id, rec.config, rec.size_bytes)
        else:
            info, read = await _start_env(state, req, source["image"])
        image_id, img = read[0], dict(read[1].get("config") or {})
        argv = _command(body, img)
        if not argv:
            await _kill_quietly(state, info["id"])
            raise HttpError(400, "bad_request", "no command specified (neither the create nor the image has Cmd "
                            "or Entrypoint)")
        _record_env(state, key, info, public_traffic=False, docker_container=cid, **admission.record())
    finally:
        admission.release()
    entrypoint, cmd = _entrypoint_and_cmd(body, img)
    env_list = [*(img.get("Env") or []), *(body.Env or [])]
    config = {"Hostname": cid[:12], "Domainname": "", "User": body.User or img.get("User", ""),
              "AttachStdin": body.AttachStdin, "AttachStdout": True, "AttachStderr": True, "Tty": body.Tty,
              "OpenStdin": body.OpenStdin, "StdinOnce": body.StdinOnce, "Env": env_list, "Cmd": cmd or None,
              "Image": body.Image, "Volumes": None, "WorkingDir": body.WorkingDir or img.get("WorkingDir", ""),
              "Entrypoint": entrypoint or None, "OnBuild": None, "Labels": {**(img.get("Labels") or {}),
                                                                             **(body.Labels or {})},
              "StopSignal": body.StopSignal or img.get("StopSignal") or "SIGTERM"}
    if body.StopTimeout is not None:
        config["StopTimeout"] = body.StopTimeout
    hc = body.HostConfig or HostConfigBody()
    host_config = {"NetworkMode": hc.NetworkMode or "default", "Memory": hc.Memory, "NanoCpus": hc.NanoCpus,
                   "CpuQuota": hc.CpuQuota, "CpuPeriod": hc.CpuPeriod, "AutoRemove": hc.AutoRemove,
                   "Binds": list(hc.Binds) if hc.Binds else None,
                   "Privileged": False, "RestartPolicy": {"Name": "no", "MaximumRetryCount": 0},
                   "LogConfig": {"Type": "json-file", "Config": {}}}  # what docker-py's run() reads logs from
    if rec is None or not rec.local:
        as_named = body.Image if rec is None or body.Image in rec.refs or normalized(body.Image) in rec.refs else None
        remember(ds, key, as_named, *read, origin=source)
    else:
        rec.used_s = time.time()
    if hc.Mounts:
        host_config["Mounts"] = list(hc.Mounts)
    ds.containers[cid] = Container(cid, name, info["id"], key.owner_fields(), body.Image, image_id, argv, config,
                                   host_config, binds=list(overrides.get("mounts", [])))
    emit(state, ds.containers[cid], "create")
    log.info("docker: container %s (%s) is env %s", cid[:12], name, info["id"])
    return _json({"Id": cid, "Warnings": []}, 201)


ROUTES = [("POST", "containers/create", create)]
