"""What a non-admin key may ask of a node, checked before the daemon sees the request.

An API key that is not an admin key is a tenant: it may run code in envs of its own and nothing
else of the node (docs/security.md, "API keys"):

- **creates**: no host bind mounts, not the node's network; every env it makes is *restricted*
  (``restricted: true`` on the daemon's create: its egress policy can never open the node,
  loopback, link-local or the node's addresses, weenv/net); a snapshot it names must be its own;
- **refs it reads** (a plan's or lock's group refs) resolve in the node's embedded store or in a
  registry the operator listed (``weenv serve --registry HOST[:PORT]``, ``$WEENV_REGISTRIES``),
  never another host: the daemon is root in the host's network and must not connect where a
  tenant points it; and not under another key's namespace;
- **refs it writes** (a commit's ``ref``) go under its own namespace, ``tenants/<key id>/``, in
  the embedded store only: an operator's tags are read-only to it;
- and quotas (_quota.py).

Plans are read with the plan codec (weenv/plan), as the daemon reads them.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from ._common import ApiState, HttpError, daemon_errors, owned_snapshot
from ._quota import Admission
from ._store import ApiKey, owns

TENANT_NAMESPACE = "tenants"
MAX_FORK = 64


def registries_from_env() -> frozenset[str]:
    """``$WEENV_REGISTRIES``: comma-separated ``host[:port]`` a tenant's refs may name."""
    return frozenset(h.strip() for h in os.environ.get("WEENV_REGISTRIES", "").split(",") if h.strip())


def namespace_of(key: ApiKey) -> str:
    return f"{TENANT_NAMESPACE}/{key.id.lower()}"


def _decode(body: bytes, where: str) -> dict[str, Any]:
    try:
        req = msgspec.json.decode(body or b"{}")
    except msgspec.DecodeError as e:
        raise HttpError(400, "bad_request", f"{where}: not JSON ({e})") from None
    if not isinstance(req, dict):
        raise HttpError(400, "bad_request", f"{where}: expected a JSON object")
    return req


def plan_of(req: dict[str, Any], *, lenient: bool = False) -> Any:
    """The plan or lock a create request carries, read by the plan codec (None for a snapshot);
    a 400 ``bad_plan`` naming the place when it is not one (``lenient``: None, and the daemon
    says what is wrong with it)."""
    try:
        return _plan_of(req)
    except HttpError:
        if lenient:
            return None
        raise


def _plan_of(req: dict[str, Any]) -> Any:
    from ..plan import Lock, Plan, PlanError, load_any, plan_from_builtins

    try:
        if isinstance(req.get("plan"), dict):
            cls = Lock if "lock_version" in req["plan"] else Plan
            return plan_from_builtins(req["plan"], cls, source="request body $.plan")
        if isinstance(req.get("plan_text"), str):
            fmt = req.get("format") if req.get("format") in ("toml", "json") else "toml"
            return load_any(req["plan_text"].encode("utf-8"), fmt=fmt,
                            source=str(req.get("source") or "request body $.plan_text"))
    except PlanError as e:
        raise HttpError(400, "bad_plan", str(e)) from None
    except RecursionError:
        raise HttpError(400, "bad_request", "request body: the plan is nested too deeply") from None
    return None


def check_refs(state: ApiState, key: ApiKey, plan: Any) -> None:
    """Every group ref of a tenant's plan names the embedded store or a listed registry, and no
    other key's namespace (a 403 naming the group)."""
    from ..registry import RefError, parse_ref

    if key.admin or plan is None:
        return
    mine = namespace_of(key)
    for i, g in enumerate(plan.groups):
        where = f"groups[{i}].ref {g.ref!r}"
        try:
            ref = parse_ref(g.ref)
        except RefError as e:
            raise HttpError(400, "bad_plan", f"{where}: {e}") from None
        for registry in {ref.registry, getattr(g, "registry", None)} - {None}:  # a lock's pinned registry too
            if registry not in state.registries:
                listed = ", ".join(sorted(state.registries)) or "none"
                raise HttpError(403, "forbidden", f"{where}: registry {registry} is not one this node reads for "
                                f"API keys (listed: {listed}; the operator adds one with `weenv serve --registry "
                                "HOST[:PORT]`); an admin key may name any")
        for repo in {ref.repo, getattr(g, "repo", None)} - {None}:
            if repo.startswith(TENANT_NAMESPACE + "/") and not (repo + "/").startswith(mine + "/"):
                raise HttpError(403, "forbidden", f"{where}: {TENANT_NAMESPACE}/... refs are their keys' own")


def create_body(state: ApiState, key: ApiKey, body: bytes) -> tuple[dict[str, Any], bool, Any]:
    """A ``POST /v1/envs`` body as the daemon gets it, whether the env's ports are public (the
    API's own ``public_traffic``, default false), and its plan (None for a snapshot). A tenant's
    request is checked (module docstring) and marked ``restricted``."""
    req = _decode(body, "request body")
    public = req.pop("public_traffic", False)
    if not isinstance(public, bool):
        raise HttpError(400, "bad_request", "request body $.public_traffic: expected true or false")
    if "env_id" in req:  # the gateway's own, when it moves a parked env: never a client's, admin or not
        raise HttpError(400, "bad_request", "request body $.env_id: an env's id is the node's to give (the "
                                            "cluster gateway keeps an env's id when it moves it); leave it out")
    if not key.admin:
        _refuse_node_access(req)  # first: a tenant learns nothing more of a plan it may not run
    plan = plan_of(req)
    if not key.admin:
        check_tenant_create(state, key, req, plan)
    return req, public, plan


def _refuse_node_access(req: dict[str, Any]) -> None:
    """Host bind mounts and the node's network, asked for anywhere in the request (read leniently:
    the plan codec reads it strictly next)."""
    import json
    import tomllib

    doc: Any = req.get("plan")
    if doc is None and isinstance(req.get("plan_text"), str):
        try:
            doc = json.loads(req["plan_text"]) if req.get("format") == "json" else tomllib.loads(req["plan_text"])
        except ValueError:
            doc = None
    doc = doc if isinstance(doc, dict) else {}
    overrides = req.get("overrides") if isinstance(req.get("overrides"), dict) else {}
    net = doc.get("network")
    if overrides.get("network") == "host" or (net.get("mode") if isinstance(net, dict) else net) == "host":
        raise HttpError(403, "forbidden", "network \"host\" (the node's own network) needs an admin key")
    if doc.get("mounts") or overrides.get("mounts"):
        raise HttpError(403, "forbidden", "host bind mounts ($.mounts, $.overrides.mounts) need an admin key")


def check_tenant_create(state: ApiState, key: ApiKey, req: dict[str, Any], plan: Any) -> None:
    """A tenant's create request (``req``, ``plan`` as :func:`plan_of` read it), marked restricted."""
    if isinstance(req.get("snapshot"), str) and owned_snapshot(state, key, req["snapshot"]) is None:
        raise HttpError(404, "snapshot_not_found", f"snapshot {req['snapshot']!r} not found")
    overrides = req.get("overrides") if isinstance(req.get("overrides"), dict) else {}
    from ..plan._model import network_policy

    if overrides.get("network") == "host" or (plan is not None and network_policy(plan).mode == "host"):
        raise HttpError(403, "forbidden", "network \"host\" (the node's own network) needs an admin key")
    if plan is not None and plan.mounts:
        raise HttpError(403, "forbidden", "host bind mounts ($.mounts) need an admin key")
    check_refs(state, key, plan)
    check_volumes(state, key, plan, overrides)
    if isinstance(req.get("image"), str):
        check_image(state, key, req["image"])
    req["restricted"] = True


def check_volumes(state: ApiState, key: ApiKey, plan: Any, overrides: dict[str, Any]) -> None:
    """Every volume a tenant's plan (or its overrides) mounts is one of its own, named by its id or
    its name on the node (another key's is a 404, as if it did not exist)."""
    refs = [v.name for v in (plan.volumes if plan is not None else [])]
    extra = overrides.get("volumes")
    refs += [v.get("name") for v in extra if isinstance(v, dict)] if isinstance(extra, list) else []
    mine = {n for i, r in state.owners.volumes().items() if owns(key, r) for n in (i, r.get("daemon_name") or i)}
    for ref in refs:
        if ref not in mine:
            raise HttpError(404, "volume_not_found", f"volume {ref!r} not found")


def check_image(state: ApiState, key: ApiKey, image: str) -> None:
    """A tenant's image is a registry REF in a listed registry: never a path on the node
    (``oci:DIR``, ``docker-archive:FILE``), never another host (the daemon would fetch it)."""
    from ..registry import RefError, parse_ref

    if key.admin:
        return
    if image.startswith(("oci:", "docker-archive:")):
        raise HttpError(403, "forbidden", f"request body $.image {image!r}: an image on the node's disk needs an "
                        "admin key (name a registry REF)")
    try:
        ref = parse_ref(image[len("docker://"):] if image.startswith("docker://") else image)
    except RefError as e:
        raise HttpError(400, "bad_request", f"request body $.image: {e}") from None
    if ref.registry is None or ref.registry not in state.registries:
        listed = ", ".join(sorted(state.registries)) or "none"
        raise HttpError(403, "forbidden", f"request body $.image {image!r}: registry {ref.registry or '(none)'} is "
                        f"not one this node reads for API keys (listed: {listed}; the operator adds one with "
                        "`weenv serve --registry HOST[:PORT]`)")


def minimums(plan: Any, overrides: dict[str, Any] | None) -> tuple[float, int]:
    """The minimum cores and bytes an env of ``plan`` (with the create's overrides) is admitted with."""
    from ..plan import PlanError, apply_overrides

    if plan is None:
        return 0.0, 0
    if overrides:
        try:
            plan = apply_overrides(plan, **{k: v for k, v in overrides.items() if k in ("cpu", "memory")})
        except (PlanError, ValueError, TypeError) as e:
            raise HttpError(400, "bad_plan", f"request body $.overrides: {e}") from None
    return float(plan.resources.cpu.min), int(plan.resources.memory.min)


def image_minimums(overrides: dict[str, Any] | None) -> tuple[float, int]:
    """The minimums of an env of an image: the plan defaults, or the create's cpu / memory overrides."""
    from ..plan import DEFAULT_CPU_MIN_CORES, DEFAULT_MEMORY_MIN_BYTES
    from ..plan._units import parse_cpu_range, parse_memory_range

    cores, memory = DEFAULT_CPU_MIN_CORES, DEFAULT_MEMORY_MIN_BYTES
    try:
        if overrides and overrides.get("cpu") is not None:
            cores = parse_cpu_range(overrides["cpu"])[0]
        if overrides and overrides.get("memory") is not None:
            memory = parse_memory_range(overrides["memory"])[0]
    except (ValueError, TypeError) as e:
        raise HttpError(400, "bad_plan", f"request body $.overrides: {e}") from None
    return float(cores), int(memory)


async def _snapshot_plan(state: ApiState, snap_id: str) -> Any:
    """The lock envs from snapshot ``snap_id`` start on (asked of the daemon that holds it)."""
    from ..plan import Lock, PlanError, plan_from_builtins

    try:
        async with daemon_errors():
            lock = (await (await state.backend.for_snapshot(snap_id)).snapshot(snap_id)).lock
    except HttpError:
        return None  # the daemon says what is wrong on the create itself
    try:
        return plan_from_builtins(lock, Lock, source=f"snapshot {snap_id}")
    except PlanError:
        return None


async def refresh_owned(state: ApiState) -> None:
    """Forget the API records of envs no daemon knows (before a quota refusal: they may be stale)."""
    async with daemon_errors():
        known = {e.id for e in await state.backend.list_envs()}
    gone = [env_id for env_id in state.owners.envs() if env_id not in known]
    if gone:
        state.envs_gone(gone)


async def admit_create(state: ApiState, key: ApiKey, req: dict[str, Any], plan: Any) -> Admission:
    from .._routes import SEGMENT

    snap = req.get("snapshot")
    if plan is None and isinstance(snap, str) and SEGMENT.match(snap):
        # a snapshot id (a published ref, which only admin keys may name, counts no minimums)
        plan = await _snapshot_plan(state, snap)
    overrides = req.get("overrides") if isinstance(req.get("overrides"), dict) else None
    if plan is None and isinstance(req.get("image"), str):
        cores, memory = image_minimums(overrides)  # an image's plan has the default resources
    else:
        cores, memory = minimums(plan, overrides)
    return await state.quotas.admit(key, 1, cores, memory, lambda: refresh_owned(state))


async def admit_fork(state: ApiState, key: ApiKey, rec: dict[str, Any], body: dict[str, Any]) -> Admission:
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
        raise HttpError(400, "bad_request", "request body $.n: a whole number of children, 1..1024")
    return await state.quotas.admit(key, n, float(rec.get("min_cores") or 0.0), int(rec.get("min_memory_bytes") or 0),
                                    lambda: refresh_owned(state))


def commit_body(key: ApiKey, body: dict[str, Any]) -> dict[str, Any]:
    """A tenant's commit ``ref`` goes under its namespace in the embedded store (``foo:v1`` ->
    ``tenants/<key id>/foo:v1``); one naming a registry or another namespace is refused."""
    from ..registry import RefError, parse_ref

    ref = body.get("ref")
    if key.admin or ref is None:
        return body
    if not isinstance(ref, str):
        raise HttpError(400, "bad_request", "request body $.ref: expected a string")
    try:
        parsed = parse_ref(ref)
    except RefError as e:
        raise HttpError(400, "bad_request", f"request body $.ref: {e}") from None
    if parsed.registry is not None:
        raise HttpError(403, "forbidden", f"request body $.ref {ref!r}: a non-admin key's commit ref names the "
                        "node's embedded store only, not a registry")
    mine = namespace_of(key)
    repo = parsed.repo if (parsed.repo + "/").startswith(mine + "/") else f"{mine}/{parsed.repo}"
    tail = f"@{parsed.digest}" if parsed.digest else f":{parsed.tag}"
    return {**body, "ref": repo + tail}


async def count_running(state: ApiState, key: ApiKey) -> int:
    """How many processes the daemons run in ``key``'s envs (the processes quota's true count)."""
    running = 0
    for env_id, rec in state.owners.envs().items():
        if not owns(key, rec):
            continue
        try:
            async with daemon_errors():
                running += sum(1 for p in await state.backend.for_env(env_id).env(env_id).processes() if p.running)
        except HttpError:
            continue
    return running
