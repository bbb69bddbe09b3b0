"""E2B's control plane (the REST API the ``e2b`` SDK calls at ``E2B_API_URL``), mapped onto weenv.

Paths, bodies and answers are those of E2B's OpenAPI as the SDK (2.63.0) sends and parses them;
errors are ``{"code": status, "message": ...}`` with the status the SDK turns into its own
exception (401 Authentication, 404 NotFound, 429 RateLimit, 400 InvalidArgument, 5xx Sandbox).
What maps to what is in docs/e2b.md.
"""

from __future__ import annotations

import datetime as dt
import math
import time
import tomllib
import urllib.parse
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ._common import (ENVD_VERSION, ApiState, HttpError, daemon_errors, key_of, log, owned, owned_snapshot,
                      read_body, state_of)
from ._store import ApiKey

DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 366 * 86400
MAX_FORK = 64
MAX_BODY_BYTES = 1 << 20


class _Body(msgspec.Struct, omit_defaults=True):
    """Requests are lenient (the SDK sends fields weenv has no use for); types are still checked."""


class NetworkConfig(_Body):
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    allowPublicTraffic: bool | None = None
    allow_internet_access: bool | None = None


class NewSandbox(_Body):
    templateID: str
    timeout: int | None = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    autoPause: bool | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    secure: bool | None = None


class TimeoutBody(_Body):
    timeout: int


class RefreshBody(_Body):
    duration: int | None = None


class ConnectBody(_Body):
    timeout: int | None = None


class ForkBody(_Body):
    timeout: int | None = None
    count: int | None = None


class SnapshotBody(_Body):
    name: str | None = None


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


def _state(info: dict[str, Any]) -> str:
    return "paused" if info.get("status") == "paused" else "running"


def _sandbox(state: ApiState, env_id: str, rec: dict[str, Any]) -> dict[str, Any]:
    """E2B's ``Sandbox`` (the answer of create, connect and fork)."""
    return {"templateID": rec.get("template") or "", "sandboxID": env_id, "clientID": "weenv",
            "envdVersion": ENVD_VERSION, "envdAccessToken": state.tokens.mint(env_id),
            "trafficAccessToken": state.tokens.mint_traffic(env_id) if rec.get("public_traffic") is False else None,
            "domain": state.domain, "alias": rec.get("template")}


def _listed(info: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    res = info.get("resources") or {}
    cpu = (res.get("cpu") or {}).get("max_cores") or (res.get("cpu") or {}).get("quota_cores") or 1
    mem = (res.get("memory") or {}).get("max_bytes") or (res.get("memory") or {}).get("limit_bytes") or 0
    started = float(rec.get("started_s") or info.get("created_s") or time.time())
    end = rec.get("pause_at_s") or info.get("expires_s") or started + float(rec.get("timeout_s") or MAX_TIMEOUT_S)
    return {"templateID": rec.get("template") or info.get("name", ""), "sandboxID": info["id"],
            "alias": rec.get("template"), "clientID": "weenv", "startedAt": _iso(started), "endAt": _iso(end),
            "cpuCount": max(1, math.ceil(float(cpu))), "memoryMB": int(mem) // (1 << 20), "diskSizeMB": 0,
            "metadata": rec.get("metadata") or {}, "state": _state(info), "envdVersion": ENVD_VERSION}


def _detail(state: ApiState, info: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    return {**_listed(info, rec), "envdAccessToken": state.tokens.mint(info["id"]), "domain": state.domain,
            "lifecycle": {"autoResume": False, "onTimeout": rec.get("on_timeout") or "kill"}}


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json", headers=headers)


def _no_content() -> Response:
    return Response(b"", 204)


# -- templates ----------------------------------------------------------------------------------


def _resolve_template(state: ApiState, key: ApiKey, template: str) -> dict[str, str]:
    """``{"lock": path}`` or ``{"snapshot": id}``: a snapshot of the key's (by id or name), else an alias."""
    if owned_snapshot(state, key, template) is not None:
        return {"snapshot": template}
    for snap_id, rec in state.owners.snapshots().items():
        if template in (rec.get("names") or []) and (key.admin or rec.get("owner") == key.name):
            return {"snapshot": snap_id}
    entry = state.templates.get(template)
    if entry is None:
        raise HttpError(404, "template_not_found", f"template '{template}' not found")
    return entry


ALL_TRAFFIC = "0.0.0.0/0"


def egress_policy(allow_out: list[str] | None, deny_out: list[str] | None,
                  internet: bool | None) -> dict[str, Any] | None:
    """E2B's egress options as weenv's ``[network]`` table; None when none is given.

    E2B opens everything by default, ``denyOut`` closes ranges and ``allowOut`` makes exceptions
    to them (allow wins); ``allow_internet_access=False`` is ``denyOut = [0.0.0.0/0]``. weenv
    closes everything by default and deny wins over allow, so: all traffic denied -> allow only
    ``allowOut``; otherwise allow all (``0.0.0.0/0``: never the implicit denies, docs/network.md)
    and ``allowOut``, deny ``denyOut`` (an ``allowOut`` exception inside a ``denyOut`` range is
    then still denied)."""
    if allow_out is None and deny_out is None and internet is None:
        return None
    allow, deny = list(allow_out or []), list(deny_out or [])
    if internet is False and ALL_TRAFFIC not in deny:
        deny.append(ALL_TRAFFIC)
    if ALL_TRAFFIC in deny:
        return {"mode": "egress", "allow": allow, "deny": [d for d in deny if d != ALL_TRAFFIC]}
    return {"mode": "egress", "allow": [ALL_TRAFFIC, *[a for a in allow if a != ALL_TRAFFIC]], "deny": deny}


def _network_table(body: NewSandbox) -> dict[str, Any] | None:
    net = body.network or NetworkConfig()
    internet = body.allow_internet_access if body.allow_internet_access is not None else net.allow_internet_access
    policy = egress_policy(net.allowOut, net.denyOut, internet)
    if policy is not None and not policy["allow"]:
        return {"mode": "none"}  # nothing may go out: no interface at all
    return policy


_network_cache: dict[str, str] = {}


def _plan_network(text: str) -> str:
    """The network mode a lock's text asks for (``none`` when it names none), cached by its text."""
    import hashlib

    key = hashlib.sha256(text.encode()).hexdigest()
    hit = _network_cache.get(key)
    if hit is None:
        try:
            doc = msgspec.json.decode(text) if text.lstrip().startswith("{") else tomllib.loads(text)
        except (ValueError, msgspec.DecodeError):
            return "?"  # the daemon says what is wrong with it
        net = doc.get("network") if isinstance(doc, dict) else None
        hit = net if isinstance(net, str) else (net.get("mode", "none") if isinstance(net, dict) else "none")
        if len(_network_cache) > 256:
            _network_cache.clear()
        _network_cache[key] = hit
    return hit


def _create_request(entry: dict[str, str], body: NewSandbox, timeout_s: int | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if timeout_s is not None:
        overrides["ttl_s"] = timeout_s
    if body.envVars:
        overrides["env"] = body.envVars
    network = _network_table(body)
    if "snapshot" in entry:
        if network is not None and network.get("mode") == "none":
            overrides["network"] = "none"
        elif network is not None:
            raise HttpError(400, "bad_request", "network options on a sandbox from a snapshot: weenv keeps the "
                            "snapshot's network; change it after create with PUT /sandboxes/{id}/network")
        req: dict[str, Any] = {"snapshot": entry["snapshot"]}
    else:
        path = entry["lock"]
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise HttpError(500, "template_unreadable", f"template lock {path}: {e.strerror}") from None
        if network is None:
            req = {"plan_text": text, "format": "json" if text.lstrip().startswith("{") else "toml", "source": path}
            if _plan_network(text) == "none":
                overrides["network"] = "loopback"  # an E2B sandbox has lo up (servers on localhost, get_host)
        else:
            try:
                doc = msgspec.json.decode(text) if text.lstrip().startswith("{") else tomllib.loads(text)
            except (ValueError, msgspec.DecodeError) as e:
                raise HttpError(500, "template_unreadable", f"template lock {path}: {e}") from None
            doc["network"] = network
            req = {"plan": doc}
    if overrides:
        req["overrides"] = overrides
    return req


# -- handlers -----------------------------------------------------------------------------------


async def create(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    body: NewSandbox = await _decode(request, NewSandbox)
    timeout_s = _timeout(body.timeout)
    entry = _resolve_template(state, key, body.templateID)
    on_timeout = "pause" if body.autoPause else "kill"
    # a pausing timeout is the API's own timer (the daemon's TTL kills): see pause_reaper
    req = _create_request(entry, body, timeout_s if on_timeout == "kill" else None)
    client = state.backend.for_create(req)
    async with daemon_errors():
        info = (await client._request("POST", "/v1/envs", json=req)).json()
    rec = {"owner": key.name, "template": body.templateID, "metadata": body.metadata or {},
           "started_s": info.get("created_s") or time.time(), "timeout_s": timeout_s, "on_timeout": on_timeout}
    if on_timeout == "pause":
        rec["pause_at_s"] = time.time() + (timeout_s or DEFAULT_TIMEOUT_S)
    if body.network is not None and body.network.allowPublicTraffic is False:
        rec["public_traffic"] = False  # its ports need the traffic token
    state.owners.put_env(info["id"], rec)
    return _json(_sandbox(state, info["id"], rec), 201)


async def _info(state: ApiState, env_id: str) -> dict[str, Any]:
    async with daemon_errors():
        resp = await state.backend.for_env(env_id)._request("GET", f"/v1/envs/{env_id}")
    return resp.json()  # type: ignore[no-any-return]


async def _owned_info(request: Request) -> tuple[ApiState, str, dict[str, Any], dict[str, Any]]:
    state, key = state_of(request), key_of(request)
    env_id = request.path_params["id"]
    rec = owned(state, key, env_id)
    try:
        info = await _info(state, env_id)
    except HttpError as e:
        if e.status == 404:
            state.owners.forget_envs([env_id])
            raise HttpError(404, "env_not_found", f"sandbox {env_id!r} not found") from None
        raise
    if info.get("status") not in ("running", "paused", "starting"):
        raise HttpError(404, "env_not_found", f"sandbox {env_id!r} is {info.get('status')}")
    return state, env_id, rec, info


async def get_info(request: Request) -> Response:
    state, env_id, rec, info = await _owned_info(request)
    return _json(_detail(state, info, rec))


async def kill(request: Request) -> Response:
    state, env_id, _, _ = await _owned_info(request)
    async with daemon_errors():
        await state.backend.for_env(env_id)._request("DELETE", f"/v1/envs/{env_id}")
    state.owners.forget_envs([env_id])
    return _no_content()


async def pause(request: Request) -> Response:
    state, env_id, _, info = await _owned_info(request)
    if info.get("status") == "paused":
        raise HttpError(409, "wrong_state", f"sandbox {env_id} is already paused")
    async with daemon_errors():
        await state.backend.for_env(env_id)._request("POST", f"/v1/envs/{env_id}/pause")
    return _no_content()


async def _set_ttl(state: ApiState, env_id: str, timeout_s: int) -> None:
    """The sandbox times out ``timeout_s`` from now: killed by the daemon's TTL, or paused by the API."""
    rec = state.owners.env(env_id) or {}
    if rec.get("on_timeout") == "pause":
        state.owners.update_env(env_id, timeout_s=timeout_s, pause_at_s=time.time() + timeout_s)
        return
    async with daemon_errors():
        await state.backend.for_env(env_id)._request("POST", f"/v1/envs/{env_id}/ttl", json={"ttl_s": timeout_s})
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
                    await state.backend.for_env(env_id)._request("POST", f"/v1/envs/{env_id}/pause")
            except HttpError as e:
                if e.status not in (404, 409):  # gone, or paused already: either way nothing to wait for
                    log.warning("pausing timed-out sandbox %s: %s", env_id, e.message)
                    continue
            state.owners.update_env(env_id, pause_at_s=None)


async def connect(request: Request) -> Response:
    """Connect (and the older resume): resumes a paused sandbox; 201 when it did, 200 when it was running."""
    state, env_id, rec, info = await _owned_info(request)
    body: ConnectBody = await _decode(request, ConnectBody)
    timeout_s = _timeout(body.timeout, None)
    resumed = info.get("status") == "paused"
    if resumed:
        async with daemon_errors():
            await state.backend.for_env(env_id)._request("POST", f"/v1/envs/{env_id}/resume")
    if timeout_s is not None:
        await _set_ttl(state, env_id, timeout_s)
    elif resumed and rec.get("on_timeout") == "pause":  # a resumed sandbox gets its timeout again
        await _set_ttl(state, env_id, int(rec.get("timeout_s") or DEFAULT_TIMEOUT_S))
    return _json(_sandbox(state, env_id, rec), 201 if resumed else 200)


async def set_timeout(request: Request) -> Response:
    state, env_id, _, _ = await _owned_info(request)
    body: TimeoutBody = await _decode(request, TimeoutBody)
    await _set_ttl(state, env_id, _timeout(body.timeout) or DEFAULT_TIMEOUT_S)
    return _no_content()


async def refresh(request: Request) -> Response:
    state, env_id, rec, _ = await _owned_info(request)
    body: RefreshBody = await _decode(request, RefreshBody)
    await _set_ttl(state, env_id, _timeout(body.duration, rec.get("timeout_s") or DEFAULT_TIMEOUT_S) or 1)
    return _no_content()


def _metric(info: dict[str, Any]) -> dict[str, Any]:
    res = info.get("resources") or {}
    cpu, mem = res.get("cpu") or {}, res.get("memory") or {}
    cores = float(cpu.get("quota_cores") or cpu.get("max_cores") or 1)
    used = float(cpu.get("used_cores") or 0.0)
    now = time.time()
    return {"timestamp": _iso(now), "timestampUnix": int(now), "cpuCount": max(1, math.ceil(cores)),
            "cpuUsedPct": round(100.0 * used / cores, 2) if cores else 0.0,
            "memUsed": int(mem.get("used_bytes") or 0), "memTotal": int(mem.get("limit_bytes") or mem.get("max_bytes") or 0),
            "memCache": 0, "diskUsed": 0, "diskTotal": 0}


async def metrics(request: Request) -> Response:
    """The sandbox's usage now (weenv keeps no history: one point, whatever start/end ask)."""
    _, _, _, info = await _owned_info(request)
    return _json([_metric(info)])


async def fork(request: Request) -> Response:
    state, env_id, rec, _ = await _owned_info(request)
    key = key_of(request)
    body: ForkBody = await _decode(request, ForkBody)
    count = 1 if body.count is None else body.count
    if not 1 <= count <= MAX_FORK:
        raise HttpError(400, "bad_request", f"count must be 1..{MAX_FORK}, not {count}")
    timeout_s = _timeout(body.timeout, rec.get("timeout_s") or DEFAULT_TIMEOUT_S)
    client = state.backend.for_env(env_id)
    async with daemon_errors():
        answer = (await client._request("POST", f"/v1/envs/{env_id}/fork", json={"n": count})).json()
    state.owners.put_snapshot(answer["snapshot"], {"owner": key.name, "source_env": env_id, "names": [],
                                                   "created_s": time.time(), "fork": True})
    results = []
    for child in answer["envs"]:
        child_rec = {"owner": key.name, "template": rec.get("template"), "metadata": dict(rec.get("metadata") or {}),
                     "started_s": child.get("created_s") or time.time(), "timeout_s": timeout_s}
        state.owners.put_env(child["id"], child_rec)
        try:
            if timeout_s is not None:
                await _set_ttl(state, child["id"], timeout_s)
            results.append({"sandbox": _sandbox(state, child["id"], child_rec)})
        except HttpError as e:
            results.append({"error": {"code": e.status, "message": e.message}})
    return _json(results, 201)


async def snapshot(request: Request) -> Response:
    state, env_id, _, _ = await _owned_info(request)
    key = key_of(request)
    body: SnapshotBody = await _decode(request, SnapshotBody)
    if body.name is not None and not body.name.strip():
        raise HttpError(400, "bad_request", "snapshot name must not be empty")
    async with daemon_errors():
        answer = (await state.backend.for_env(env_id)._request("POST", f"/v1/envs/{env_id}/commit", json={})).json()
    names = [body.name] if body.name else []
    state.owners.put_snapshot(answer["snapshot"], {"owner": key.name, "source_env": env_id, "names": names,
                                                   "created_s": time.time()})
    return _json({"snapshotID": answer["snapshot"], "names": names}, 201)


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
    existing: set[str] = set()
    for client in state.backend.all():
        async with daemon_errors():
            existing.update(snap["id"] for snap in (await client._request("GET", "/v1/snapshots")).json())
    for sid in [sid for sid in state.owners.snapshots() if sid not in existing]:
        state.owners.forget_snapshot(sid)  # deleted on the node (or collected by gc)
    snaps = [(sid, rec) for sid, rec in sorted(state.owners.snapshots().items(), key=lambda kv: kv[1].get("created_s", 0))
             if (key.admin or rec.get("owner") == key.name) and not rec.get("fork")
             and (not q.get("sandboxID") or rec.get("source_env") == q["sandboxID"])
             and (not q.get("name") or q["name"] in (rec.get("names") or []))]
    page, headers = _page(request, [{"snapshotID": sid, "names": rec.get("names") or []} for sid, rec in snaps])
    return _json(page, 200, headers)


async def delete_template(request: Request) -> Response:
    """``DELETE /templates/{id}``: what the SDK's ``delete_snapshot`` calls (weenv templates are the operator's)."""
    state, key = state_of(request), key_of(request)
    name = urllib.parse.unquote(request.path_params["id"])
    snap_id = None
    if owned_snapshot(state, key, name) is not None:
        snap_id = name
    else:
        for sid, rec in state.owners.snapshots().items():
            if name in (rec.get("names") or []) and (key.admin or rec.get("owner") == key.name):
                snap_id = sid
    if snap_id is None:
        raise HttpError(404, "snapshot_not_found", f"snapshot '{name}' not found")
    async with daemon_errors():
        await state.backend.all()[0]._request("DELETE", f"/v1/snapshots/{snap_id}")
    state.owners.forget_snapshot(snap_id)
    return _no_content()


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDK sends ``metadata=urlencode({quote(k): quote(v)})``: one parameter, decoded twice."""
    if not raw:
        return {}
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in urllib.parse.parse_qsl(raw)}


async def list_sandboxes(request: Request) -> Response:
    state, key = state_of(request), key_of(request)
    q = request.query_params
    want_meta = _metadata_filter(q.get("metadata"))
    v2 = request.url.path.startswith("/v2/")
    states = set((q.get("state") or "running,paused").split(",")) if v2 else {"running", "paused"}
    if not states <= {"running", "paused"}:
        raise HttpError(400, "bad_request", f"state: {q.get('state')!r} (running, paused)")
    owners = state.owners.envs()
    out = []
    known: set[str] = set()
    for client in state.backend.all():
        async with daemon_errors():
            infos = (await client._request("GET", "/v1/envs")).json()
        known.update(info["id"] for info in infos)
        for info in infos:
            rec = owners.get(info["id"])
            if rec is None and not key.admin or rec is not None and not key.admin and rec.get("owner") != key.name:
                continue
            rec = rec or {}
            if info.get("status") not in ("running", "paused") or _state(info) not in states:
                continue
            meta = rec.get("metadata") or {}
            if any(meta.get(k) != v for k, v in want_meta.items()):
                continue
            if q.get("template") and rec.get("template") != q["template"]:
                continue
            out.append(_listed(info, rec))
    gone = [env_id for env_id in owners if env_id not in known]
    if gone:  # killed by their TTL or on the node: the table keeps only envs that exist
        state.owners.forget_envs(gone)
    out.sort(key=lambda s: s["startedAt"], reverse=q.get("order") == "desc")
    if not v2:
        return _json(out)
    page, headers = _page(request, out)
    return _json(page, 200, headers)


async def update_network(request: Request) -> Response:
    """``PUT /sandboxes/{id}/network`` replaces the egress policy: weenv's change adds the new lists
    and removes what the old ones had and the new ones do not."""
    state, env_id, _, info = await _owned_info(request)
    body: NetworkConfig = await _decode(request, NetworkConfig)
    net = info.get("network")
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
        await state.backend.for_env(env_id)._request("POST", f"/v1/envs/{env_id}/network", json=change)
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
