"""E2B's control plane (the REST API the ``e2b`` SDK calls at ``E2B_API_URL``), mapped onto weenv.

Paths, bodies and answers are those of E2B's OpenAPI as the SDK (2.63.0) sends and parses them;
errors are ``{"code": status, "message": ...}`` with the status the SDK turns into its own
exception (401 Authentication, 404 NotFound, 429 RateLimit, 400 InvalidArgument, 5xx Sandbox).
What maps to what is in docs/e2b.md.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
import urllib.parse
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .._aclient import AsyncEnv
from .._connection import ApiError as DaemonError
from .._wire import EnvInfo, ForkResponse
from . import _e2b_templates, _e2b_volumes, _tenant
from ._common import (
    ENVD_VERSION,
    ApiState,
    HttpError,
    daemon_errors,
    env_token,
    key_of,
    log,
    owned,
    owned_snapshot,
    read_body,
    state_of,
    traffic_token,
)
from ._e2b_requests import (
    ALL_TRAFFIC,
    ConnectBody,
    ForkBody,
    NetworkConfig,
    NewSandbox,
    PauseBody,
    RefreshBody,
    SnapshotBody,
    TimeoutBody,
    _create_request,
    egress_policy,
    host_mask,
    lifecycle_of,
    resolve_create,
)
from ._store import ApiKey, may_use

DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 366 * 86400
MAX_FORK = 64
MAX_BODY_BYTES = 1 << 20


async def _decode(request: Request, cls: type[Any]) -> Any:
    body = await read_body(request, MAX_BODY_BYTES)
    try:
        return msgspec.json.decode(body or b"{}", type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HttpError(400, "bad_request", f"request body: {e}") from None


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _timeout(value: int | None, default: int | None = DEFAULT_TIMEOUT_S) -> int | None:
    if value is None:
        return default
    if not 0 < value <= MAX_TIMEOUT_S:
        raise HttpError(400, "bad_request", f"timeout must be 1..{MAX_TIMEOUT_S} seconds, not {value}")
    return value


# -- answers ------------------------------------------------------------------------------------


def _state(info: EnvInfo) -> str:
    return "paused" if info.status == "paused" else "running"


def _sandbox(state: ApiState, env_id: str, rec: dict[str, Any]) -> dict[str, Any]:
    """E2B's ``Sandbox`` (the answer of create, connect and fork)."""
    return {"templateID": rec.get("template") or "", "sandboxID": env_id, "clientID": "weenv",
            "envdVersion": ENVD_VERSION, "envdAccessToken": env_token(state, env_id, rec),
            "trafficAccessToken": traffic_token(state, env_id, rec) if rec.get("public_traffic") is False else None,
            "domain": state.domain, "alias": rec.get("template")}


def _listed(info: EnvInfo, rec: dict[str, Any]) -> dict[str, Any]:
    res = info.resources or {}
    cpu = (res.get("cpu") or {}).get("max_cores") or (res.get("cpu") or {}).get("quota_cores") or 1
    mem = (res.get("memory") or {}).get("max_bytes") or (res.get("memory") or {}).get("limit_bytes") or 0
    started = float(rec.get("started_s") or info.created_s or time.time())
    end = rec.get("pause_at_s") or info.expires_s or started + float(rec.get("timeout_s") or MAX_TIMEOUT_S)
    return {"templateID": rec.get("template") or info.name, "sandboxID": info.id,
            "alias": rec.get("template"), "clientID": "weenv", "startedAt": _iso(started), "endAt": _iso(end),
            "cpuCount": max(1, math.ceil(float(cpu))), "memoryMB": int(mem) // (1 << 20), "diskSizeMB": 0,
            "metadata": rec.get("metadata") or {}, "state": _state(info), "envdVersion": ENVD_VERSION}


def _detail(state: ApiState, info: EnvInfo, rec: dict[str, Any]) -> dict[str, Any]:
    return {**_listed(info, rec), "envdAccessToken": env_token(state, info.id, rec), "domain": state.domain,
            "lifecycle": {"autoResume": bool(rec.get("auto_resume")), "onTimeout": rec.get("on_timeout") or "kill"}}


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json", headers=headers)


def _no_content() -> Response:
    return Response(b"", 204)


# -- handlers -----------------------------------------------------------------------------------


async def create(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    body: NewSandbox = await _decode(request, NewSandbox)
    timeout_s = _timeout(body.timeout)
    host_mask(body.network)  # refused before anything starts
    entry, size = resolve_create(state, key, body)
    lifecycle = lifecycle_of(body)
    on_timeout = lifecycle["on_timeout"]
    # a pausing timeout is the API's own timer (the daemon's TTL kills): see pause_reaper
    req = _create_request(entry, body, timeout_s if on_timeout == "kill" else None, size)
    _e2b_volumes.add_mounts(state, key, body.volumeMounts, req)  # volume_mounts: [[volumes]] by id
    if not key.admin:
        req["restricted"] = True  # its egress policy never opens the node (weenv/api/_tenant.py)
    admission = await _tenant.admit_create(state, key, req, _tenant.plan_of(req, lenient=True))
    try:
        async with daemon_errors():
            info = await state.backend.create(req)
        _record_created(state, key, body, info, timeout_s, lifecycle, admission.record(), entry.get("image"))
    finally:
        admission.release()
    await _e2b_templates.start_command(state, entry, info.id)  # a built template's start and ready commands
    return _json(_sandbox(state, info.id, state.owners.env(info.id) or {}), 201)


def _record_created(state: ApiState, key: ApiKey, body: NewSandbox, info: EnvInfo, timeout_s: int | None,
                    lifecycle: dict[str, Any], held: dict[str, Any], image: str | None = None) -> None:
    on_timeout = lifecycle["on_timeout"]
    rec = {**key.owner_fields(), **held, "template": image or body.templateID, "metadata": body.metadata or {},
           "started_s": info.created_s or time.time(), "timeout_s": timeout_s, **lifecycle,
           # E2B's ports are public unless asked otherwise; then they need the traffic (or access) token
           "public_traffic": not (body.network is not None and body.network.allowPublicTraffic is False),
           "mask_request_host": host_mask(body.network)}
    if on_timeout == "pause":
        rec["pause_at_s"] = time.time() + (timeout_s or DEFAULT_TIMEOUT_S)
    state.owners.put_env(info.id, rec)


async def _info(state: ApiState, env_id: str) -> EnvInfo:
    async with daemon_errors():
        return await _env(state, env_id).refresh()


def _env(state: ApiState, env_id: str) -> AsyncEnv:
    """The env on its daemon (a handle: the daemon says whether it exists)."""
    return state.backend.for_env(env_id).env(env_id)


async def _owned_info(request: Request) -> tuple[ApiState, str, dict[str, Any], EnvInfo]:
    state, key = state_of(request), key_of(request)
    env_id = request.path_params["id"]
    rec = owned(state, key, env_id)
    try:
        info = await _info(state, env_id)
    except HttpError as e:
        if e.status == 404:
            state.envs_gone([env_id])
            raise HttpError(404, "env_not_found", f"sandbox {env_id!r} not found") from None
        raise
    if info.status not in ("running", "paused", "starting"):
        raise HttpError(404, "env_not_found", f"sandbox {env_id!r} is {info.status}")
    return state, env_id, rec, info


async def get_info(request: Request) -> Response:
    state, env_id, rec, info = await _owned_info(request)
    return _json(_detail(state, info, rec))


async def kill(request: Request) -> Response:
    state, env_id, _, _ = await _owned_info(request)
    async with daemon_errors():
        await state.backend.kill(env_id)
    state.envs_gone([env_id])
    return _no_content()


async def pause_env(env: AsyncEnv, *, keep_memory: bool = True) -> None:
    """E2B's pause. Keeping memory: parked (its processes checkpointed to disk and their memory
    freed, resumed as they were) where the env's runtime can (gVisor), else frozen (the cgroup
    freezer: crun envs keep their memory in RAM while paused). Not keeping it: its processes
    end, its files stay."""
    if not keep_memory:
        return await env.pause(memory=False)
    try:
        await env.pause(memory="park")
    except DaemonError as e:
        if e.kind != "memory_unavailable":
            raise
        await env.pause()


async def pause(request: Request) -> Response:
    """Pause: with its memory (parked where the runtime can, else frozen: :func:`pause_env`),
    or (``memory: false``, E2B's ``mode="filesystem"``) its processes ended and its files kept, so it
    holds no memory (resume boots it again)."""
    state, env_id, _, info = await _owned_info(request)
    body: PauseBody = await _decode(request, PauseBody)
    if info.status == "paused":
        raise HttpError(409, "wrong_state", f"sandbox {env_id} is already paused")
    async with daemon_errors():
        await pause_env(_env(state, env_id), keep_memory=body.memory is not False)
    state.owners.update_env(env_id, paused=True)
    return _no_content()


async def wake(state: ApiState, env_id: str) -> None:
    """Resume a sandbox created with ``auto_resume`` that its timeout paused, on its first request
    (envd or a port): as E2B, traffic wakes it, and its timeout starts again."""
    rec = state.owners.env(env_id) or {}
    if not (rec.get("auto_resume") and rec.get("paused")):
        return
    try:
        async with daemon_errors():
            await state.backend.resume(env_id)
    except HttpError as e:
        if e.status != 409:  # 409: resumed meanwhile (another request woke it)
            raise
    state.owners.update_env(env_id, paused=False)
    await _set_ttl(state, env_id, int(rec.get("timeout_s") or DEFAULT_TIMEOUT_S))


async def _set_ttl(state: ApiState, env_id: str, timeout_s: int) -> None:
    """The sandbox times out ``timeout_s`` from now: killed by the daemon's TTL, or paused by the API."""
    rec = state.owners.env(env_id) or {}
    if rec.get("on_timeout") == "pause":
        state.owners.update_env(env_id, timeout_s=timeout_s, pause_at_s=time.time() + timeout_s)
        return
    async with daemon_errors():
        await _env(state, env_id).set_timeout(timeout_s)
    state.owners.update_env(env_id, timeout_s=timeout_s)


async def pause_reaper(state: ApiState, interval_s: float = 0.5) -> None:
    """Pause the sandboxes created with ``on_timeout: pause`` whose time is up (runs for ever)."""
    import anyio

    while True:
        await anyio.sleep(interval_s)
        now = time.time()
        for env_id, rec in state.owners.envs().items():
            if rec.get("on_timeout") != "pause" or not rec.get("pause_at_s") or rec["pause_at_s"] > now:
                continue
            try:
                async with daemon_errors():
                    await pause_env(_env(state, env_id), keep_memory=rec.get("pause_memory", True) is not False)
            except HttpError as e:
                if e.status not in (404, 409):  # gone, or paused already: either way nothing to wait for
                    log.warning("pausing timed-out sandbox %s: %s", env_id, e.message)
                    continue
            state.owners.update_env(env_id, pause_at_s=None, paused=True)


async def connect(request: Request) -> Response:
    """Connect (and the older resume): resumes a paused sandbox; 201 when it did, 200 when it was running."""
    state, env_id, rec, info = await _owned_info(request)
    body: ConnectBody = await _decode(request, ConnectBody)
    timeout_s = _timeout(body.timeout, None)
    resumed = info.status == "paused"
    if resumed:
        async with daemon_errors():
            if body.memory is False:  # E2B's on_resume="reboot": a new boot from its files
                await _env(state, env_id).pause(memory=False)
            await state.backend.resume(env_id)
        state.owners.update_env(env_id, paused=False)
    if timeout_s is not None and (resumed or _ends_before(rec, info, timeout_s)):
        await _set_ttl(state, env_id, timeout_s)  # as E2B: connect extends a sandbox's time, never shortens it
    elif resumed and rec.get("on_timeout") == "pause":  # a resumed sandbox gets its timeout again
        await _set_ttl(state, env_id, int(rec.get("timeout_s") or DEFAULT_TIMEOUT_S))
    return _json(_sandbox(state, env_id, rec), 201 if resumed else 200)


def _ends_before(rec: dict[str, Any], info: EnvInfo, timeout_s: int) -> bool:
    """Whether the sandbox's time is up sooner than ``timeout_s`` from now (no end: never)."""
    end = rec.get("pause_at_s") if rec.get("on_timeout") == "pause" else info.expires_s
    return end is not None and float(end) < time.time() + timeout_s


async def set_timeout(request: Request) -> Response:
    """Sets the end to ``timeout`` seconds from now, sooner or later than it was; 0 ends it now (as E2B:
    killed, or paused when it was created to pause on its timeout)."""
    state, env_id, rec, info = await _owned_info(request)
    body: TimeoutBody = await _decode(request, TimeoutBody)
    if body.timeout == 0:
        if rec.get("on_timeout") == "pause":
            if info.status != "paused":
                async with daemon_errors():
                    await pause_env(_env(state, env_id), keep_memory=rec.get("pause_memory", True) is not False)
            state.owners.update_env(env_id, pause_at_s=None, paused=True)
        else:
            async with daemon_errors():
                await state.backend.kill(env_id)
            state.envs_gone([env_id])
        return _no_content()
    await _set_ttl(state, env_id, _timeout(body.timeout) or DEFAULT_TIMEOUT_S)
    return _no_content()


async def refresh(request: Request) -> Response:
    state, env_id, rec, _ = await _owned_info(request)
    body: RefreshBody = await _decode(request, RefreshBody)
    await _set_ttl(state, env_id, _timeout(body.duration, rec.get("timeout_s") or DEFAULT_TIMEOUT_S) or 1)
    return _no_content()


def _metric(point: dict[str, float], max_cores: float) -> dict[str, Any]:
    """A daemon usage point as E2B's ``SandboxMetric`` (CPU as a share of the cores the env may use)."""
    cores = float(point.get("cpu_quota_cores") or max_cores or 1)
    used = float(point.get("cpu_used_cores") or 0.0)
    t = float(point["t"])
    return {"timestamp": _iso(t), "timestampUnix": int(t), "cpuCount": max(1, math.ceil(max_cores or cores)),
            "cpuUsedPct": round(100.0 * used / cores, 2) if cores else 0.0,
            "memUsed": int(point.get("memory_used_bytes") or 0), "memTotal": int(point.get("memory_limit_bytes") or 0),
            "memCache": 0, "diskUsed": 0, "diskTotal": 0}


async def metrics(request: Request) -> Response:
    """The sandbox's usage from ``start`` to ``end`` (Unix seconds, as the SDK sends them): the
    daemon's history (a point every 5 s, the last hour), then now."""
    state, env_id, _, info = await _owned_info(request)
    start, end = (_unix_param(request.query_params, k) for k in ("start", "end"))
    if start is not None and end is not None and end < start:
        raise HttpError(400, "bad_request", f"end ({end:.0f}) is before start ({start:.0f})")
    async with daemon_errors():  # E2B's times are whole seconds: a point at 24.4 s is in second 24
        points = await _env(state, env_id).metrics(start, None if end is None else math.floor(end) + 0.999999)
    cpu = (info.resources or {}).get("cpu") or {}
    max_cores = float(cpu.get("max_cores") or cpu.get("quota_cores") or 1)
    return _json([_metric(p, max_cores) for p in points])


def _unix_param(q: Any, name: str) -> float | None:
    raw = q.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1e11:
        raise HttpError(400, "bad_request", f"{name}: {raw[:40]!r} is not a time in Unix seconds")
    return value


async def fork(request: Request) -> Response:
    state, env_id, rec, _ = await _owned_info(request)
    key = key_of(request)
    body: ForkBody = await _decode(request, ForkBody)
    count = 1 if body.count is None else body.count
    if not 1 <= count <= MAX_FORK:
        raise HttpError(400, "bad_request", f"count must be 1..{MAX_FORK}, not {count}")
    timeout_s = _timeout(body.timeout, rec.get("timeout_s") or DEFAULT_TIMEOUT_S)
    admission = await _tenant.admit_fork(state, key, rec, {"n": count})
    try:
        async with daemon_errors():
            answer = await fork_env(state, env_id, count)
        results = _record_forked(state, key, env_id, rec, answer, timeout_s, admission.record())
    finally:
        admission.release()
    for child, result in zip(answer.envs, results):
        try:
            if timeout_s is not None:
                await _set_ttl(state, child.id, timeout_s)
        except HttpError as e:
            result.clear()
            result["error"] = {"code": e.status, "message": e.message}
    return _json(results, 201)


async def fork_env(state: ApiState, env_id: str, n: int) -> ForkResponse:
    """E2B's fork copies a running sandbox: with its processes and their memory where the runtime
    can checkpoint (gVisor) and the env's node has room for the copies, else its files (crun envs
    start their copies fresh from them; a cluster may spread those over nodes)."""
    try:
        return await state.backend.fork(env_id, n, memory=True)
    except DaemonError as e:
        if e.kind not in ("memory_unavailable", "not_admitted"):
            raise
    return await state.backend.fork(env_id, n)


def _record_forked(state: ApiState, key: ApiKey, env_id: str, rec: dict[str, Any], answer: ForkResponse,
                   timeout_s: int | None, held: dict[str, Any]) -> list[dict[str, Any]]:
    state.owners.put_snapshot(answer.snapshot, {**key.owner_fields(), "source_env": env_id, "names": [],
                                                   "created_s": time.time(), "fork": True})
    results = []
    for child in answer.envs:
        child_rec = {**key.owner_fields(), **held, "template": rec.get("template"),
                     "metadata": dict(rec.get("metadata") or {}), "started_s": child.created_s or time.time(),
                     "timeout_s": timeout_s, "public_traffic": rec.get("public_traffic", "on_timeout" in rec),
                     "mask_request_host": rec.get("mask_request_host")}
        state.owners.put_env(child.id, child_rec)
        results.append({"sandbox": _sandbox(state, child.id, child_rec)})
    return results


async def snapshot(request: Request) -> Response:
    state, env_id, _, _ = await _owned_info(request)
    key = key_of(request)
    body: SnapshotBody = await _decode(request, SnapshotBody)
    if body.name is not None and not body.name.strip():
        raise HttpError(400, "bad_request", "snapshot name must not be empty")
    async with daemon_errors():
        answer = await state.backend.commit(env_id)
    names = [body.name] if body.name else []
    state.owners.put_snapshot(answer.snapshot, {**key.owner_fields(), "source_env": env_id, "names": names,
                                                   "created_s": time.time()})
    return _json({"snapshotID": answer.snapshot, "names": names}, 201)


def _page(request: Request, items: list[Any]) -> tuple[list[Any], dict[str, str]]:
    q = request.query_params
    try:
        limit = int(q.get("limit") or 100)
        start = int(q.get("nextToken") or 0)
    except ValueError:
        raise HttpError(400, "bad_request", "limit and nextToken must be whole numbers") from None
    if not 1 <= limit <= 1000 or start < 0:
        raise HttpError(400, "bad_request", "limit must be 1..1000 and nextToken not negative")
    page = items[start:start + limit]
    headers = {"x-next-token": str(start + limit)} if start + limit < len(items) else {}
    return page, headers


async def list_snapshots(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    q = request.query_params
    async with daemon_errors():
        existing = {snap.id for snap in await state.backend.list_snapshots()}
    for sid in [sid for sid in state.owners.snapshots() if sid not in existing]:
        state.owners.forget_snapshot(sid)  # deleted on the node (or collected by gc)
    snaps = [(sid, rec) for sid, rec in sorted(state.owners.snapshots().items(), key=lambda kv: kv[1].get("created_s", 0))
             if may_use(key, rec) and not rec.get("fork")
             and (not q.get("sandboxID") or rec.get("source_env") == q["sandboxID"])
             and (not q.get("name") or q["name"] in (rec.get("names") or []))]
    page, headers = _page(request, [{"snapshotID": sid, "names": rec.get("names") or []} for sid, rec in snaps])
    return _json(page, 200, headers)


async def delete_template(request: Request) -> Response:
    """``DELETE /templates/{id}``: what the SDK's ``delete_snapshot`` calls (weenv templates are the operator's)."""
    state, key = state_of(request), key_of(request)
    name = request.path_params["id"]  # decoded once (the SDK quotes namespace/name:tag as one segment)
    snap_id = None
    if owned_snapshot(state, key, name) is not None:
        snap_id = name
    else:
        for sid, rec in state.owners.snapshots().items():
            if name in (rec.get("names") or []) and may_use(key, rec):
                snap_id = sid
    if snap_id is None:
        raise HttpError(404, "snapshot_not_found", f"snapshot '{name}' not found")
    async with daemon_errors():
        await state.backend.delete_snapshot(snap_id)
    state.owners.forget_snapshot(snap_id)
    return _no_content()


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDK sends ``metadata=urlencode({quote(k): quote(v)})``: one parameter, decoded twice."""
    if not raw:
        return {}
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in urllib.parse.parse_qsl(raw)}


def _time_param(q: Any, name: str) -> float | None:
    """An RFC 3339 time in the query (``startedAfter``), as epoch seconds; naive: UTC."""
    raw = q.get(name)
    if not raw:
        return None
    try:  # a "+" the client left unquoted arrives as a space
        when = dt.datetime.fromisoformat(re.sub(r" (\d\d:?\d\d)$", r"+\1", raw.strip()).replace("Z", "+00:00"))
    except ValueError:
        raise HttpError(400, "bad_request", f"{name}: {raw!r} is not an RFC 3339 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


async def list_sandboxes(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    q = request.query_params
    want_meta = _metadata_filter(q.get("metadata"))
    v2 = request.url.path.startswith("/v2/")
    states = set((q.get("state") or "running,paused").split(",")) if v2 else {"running", "paused"}
    if not states <= {"running", "paused"}:
        raise HttpError(400, "bad_request", f"state: {q.get('state')!r} (running, paused)")
    order = q.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise HttpError(400, "bad_request", f"order: {order!r} (asc, desc)")
    after, before = _time_param(q, "startedAfter"), _time_param(q, "startedBefore")
    owners = state.owners.envs()
    out = []
    async with daemon_errors():
        infos = await state.backend.list_envs()
    known = {info.id for info in infos}
    for info in infos:
        rec = owners.get(info.id)
        if not key.admin and not may_use(key, rec):
            continue
        rec = rec or {}
        if info.status not in ("running", "paused") or _state(info) not in states:
            continue
        meta = rec.get("metadata") or {}
        if any(meta.get(k) != v for k, v in want_meta.items()):
            continue
        if q.get("template") and rec.get("template") != q["template"]:
            continue
        started = float(rec.get("started_s") or info.created_s or 0.0)
        shown = dt.datetime.fromtimestamp(started, dt.timezone.utc).timestamp()  # as startedAt says it (to 1 µs)
        if (after is not None and shown < after) or (before is not None and shown > before):
            continue
        out.append((started, _listed(info, rec)))
    gone = [env_id for env_id in owners if env_id not in known]
    if gone:  # killed by their TTL or on the node: the table keeps only envs that exist
        state.envs_gone(gone)
    out.sort(key=lambda x: x[0], reverse=order == "desc")  # as E2B: newest first unless asked otherwise
    listed = [x[1] for x in out]
    if not v2:
        return _json(listed)
    page, headers = _page(request, listed)
    return _json(page, 200, headers)


async def update_network(request: Request) -> Response:
    """``PUT /sandboxes/{id}/network`` replaces the egress policy: weenv's change adds the new lists
    and removes what the old ones had and the new ones do not."""
    state, env_id, _, info = await _owned_info(request)
    body: NetworkConfig = await _decode(request, NetworkConfig)
    net = info.network
    if not net:
        raise HttpError(409, "wrong_state", f"sandbox {env_id} has no egress network (create it with network "
                        "options, or from a template whose plan has network.mode = \"egress\")")
    policy = net.get("policy") or {}
    old = set(policy.get("allow") or []) | set(policy.get("deny") or [])
    # fields left out are cleared (E2B's default: everything open)
    wanted = egress_policy(body.allowOut, body.denyOut, body.allow_internet_access) or \
        {"allow": [ALL_TRAFFIC], "deny": []}
    change = {"allow": wanted["allow"], "deny": wanted["deny"],
              "remove": sorted(old - set(wanted["allow"]) - set(wanted["deny"]))}
    async with daemon_errors():
        await _env(state, env_id).set_network(**change)
    return _no_content()


async def not_found(request: Request) -> Response:
    raise HttpError(404, "not_found", f"{request.method} {request.url.path}: not an API route weenv serves")


def routes() -> list[Route]:
    return [
        Route("/sandboxes", create, methods=["POST"]),
        Route("/v2/sandboxes", create, methods=["POST"]),
        Route("/sandboxes", list_sandboxes, methods=["GET"]),
        Route("/v2/sandboxes", list_sandboxes, methods=["GET"]),
        Route("/sandboxes/{id}", get_info, methods=["GET"]),
        Route("/sandboxes/{id}", kill, methods=["DELETE"]),
        Route("/sandboxes/{id}/pause", pause, methods=["POST"]),
        Route("/sandboxes/{id}/resume", connect, methods=["POST"]),
        Route("/sandboxes/{id}/connect", connect, methods=["POST"]),
        Route("/v2/sandboxes/{id}/connect", connect, methods=["POST"]),
        Route("/sandboxes/{id}/timeout", set_timeout, methods=["POST"]),
        Route("/sandboxes/{id}/refreshes", refresh, methods=["POST"]),
        Route("/sandboxes/{id}/metrics", metrics, methods=["GET"]),
        Route("/sandboxes/{id}/fork", fork, methods=["POST"]),
        Route("/sandboxes/{id}/snapshots", snapshot, methods=["POST"]),
        Route("/sandboxes/{id}/network", update_network, methods=["PUT"]),
        Route("/snapshots", list_snapshots, methods=["GET"]),
        Route("/templates/{id:path}", delete_template, methods=["DELETE"]),
    ]
