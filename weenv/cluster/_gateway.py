"""The cluster gateway: ``weenv serve``'s app (``/v1``, E2B, envd) over every node of a Ray cluster.

``weenv cluster serve --ray-address ADDR --listen HOST:PORT`` runs :func:`weenv.api.create_app`
with a :class:`ClusterBackend`: the app asks it for "the daemon of env X" or "the daemon for this
create", and it answers with a :class:`weenv.AsyncClient` on that node's daemon, reached over the
node agent's TCP listener (weenv/cluster/_nodeapi.py) with the cluster token. So the app runs
unchanged: one set of API keys (the gateway's ``$WEENV_HOME/api``), one routing table.

- Routing: an env's node comes from the node reports (``Cluster.for_env``; its id names its node,
  so a restarted gateway routes every env again from the first reports). An env on a lost node is
  a 410 ``env_lost`` naming the node and why.
- Creates: the client :meth:`ClusterBackend.for_create` returns places ``POST /v1/envs`` itself
  (an httpx transport reads the body): the plan's layers and minimums -> ranked nodes -> the first
  that admits; a node answering 503 ``not_admitted`` (its state moved since its report) is skipped
  for the next.
- The gateway's address is kept in Ray's KV store (``weenv.Client(cluster="HEAD:6379")`` finds it).
"""

from __future__ import annotations

import json
import logging
import threading
import tomllib
from typing import Any

import httpx
import msgspec

from .._client import AsyncClient
from ..api._backend import Backend
from ..api._common import HttpError
from ._cluster import Cluster
from ._errors import ClusterError, EnvLostError, NodeLostError, PlacementError, UnknownEnvError
from ._placement import PlacementRequest, place_group, request_for

log = logging.getLogger("weenv.cluster")

KV_NAMESPACE = "weenv"
KV_GATEWAY = b"gateway"


def _plan_of(body: dict[str, Any]) -> Any:
    """The plan a create body carries: ``plan`` (a dict), or ``plan_text`` (JSON or TOML)."""
    if "plan" in body:
        return body["plan"]
    text = body.get("plan_text")
    if isinstance(text, str):
        try:
            return json.loads(text) if body.get("format") == "json" else tomllib.loads(text)
        except ValueError:
            return None
    return None


class _PlacingTransport(httpx.AsyncBaseTransport):
    """``POST /v1/envs``: place, then send to the first node that admits. Anything else: refused
    (the app sends only creates through :meth:`ClusterBackend.for_create`'s client)."""

    def __init__(self, backend: "ClusterBackend"):
        self.backend = backend

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or request.url.path != "/v1/envs":
            return _error(500, "internal", f"the cluster's create client got {request.method} {request.url.path}")
        body = await request.aread()
        try:
            parsed = msgspec.json.decode(body) if body else {}
        except msgspec.DecodeError as e:
            return _error(400, "bad_request", f"the create body is not JSON: {e}")
        try:
            nodes = await self.backend.candidates(parsed if isinstance(parsed, dict) else {})
        except PlacementError as e:
            return _error(503, "not_admitted", str(e))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        last: httpx.Response | None = None
        for name in nodes:
            try:
                client = self.backend.node_client(name)
            except HttpError:
                continue
            try:
                resp = await client._http.post("/v1/envs", content=body, headers=headers, timeout=None)
            except httpx.TransportError as e:
                log.warning("node %s: its daemon API does not answer: %s", name, e)
                continue
            if resp.status_code == 503 and _kind(resp) == "not_admitted":
                last = resp
                continue
            if resp.status_code < 300:
                try:
                    await self.backend.created(name, resp.json()["id"])
                except (KeyError, ValueError, TypeError):
                    pass
            return httpx.Response(resp.status_code, headers=resp.headers, content=resp.content)
        if last is not None:
            return httpx.Response(last.status_code, headers=last.headers, content=last.content)
        return _error(503, "not_admitted", f"no node of the cluster answered (tried {nodes})")


def _kind(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["kind"])
    except (ValueError, KeyError, TypeError):
        return ""


def _error(status: int, kind: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"kind": kind, "message": message, "status": status}})


class ClusterBackend(Backend):
    """:class:`weenv.api.Backend` over a :class:`~weenv.cluster.Cluster` (see the module docstring)."""

    def __init__(self, cluster: Cluster, token: str):
        if not token:
            raise ClusterError("the gateway needs the cluster token (node daemons accept nothing else)")
        self.cluster, self.token = cluster, token
        self._clients: dict[str, tuple[str, AsyncClient]] = {}
        self._lock = threading.Lock()
        self._placer = AsyncClient("http://cluster", timeout_s=None, autostart=False)  # type: ignore[arg-type]
        self._placer._http = httpx.AsyncClient(transport=_PlacingTransport(self), base_url="http://cluster",
                                               timeout=None)
        self._placer._started = True

    # ------------------------------------------------------------------ nodes

    def node_client(self, name: str) -> AsyncClient:
        """The AsyncClient of node ``name``'s daemon (its TCP API, the cluster token)."""
        try:
            self.cluster._client(name)  # NodeLostError for a lost node
        except NodeLostError as e:
            raise HttpError(503, "node_lost", str(e)) from None
        except ClusterError as e:
            raise HttpError(404, "env_not_found", str(e)) from None
        rep = self.cluster.report(name)
        url = rep.node_api if rep is not None else ""
        if not url:
            raise HttpError(503, "daemon_unavailable", f"node {name} serves no daemon API to the gateway (its agent "
                            f"has no cluster token, or has not reported yet)")
        with self._lock:
            held = self._clients.get(name)
            if held is not None and held[0] == url:
                return held[1]
            client = AsyncClient(url, token=self.token, timeout_s=None, autostart=False)  # type: ignore[arg-type]
            client._started = True  # the reports say it answers; a refused connection is a 503
            self._clients[name] = (url, client)
        return client

    def for_env(self, env_id: str) -> AsyncClient:
        try:
            node = self.cluster.for_env(env_id)
        except EnvLostError as e:
            raise HttpError(410, "env_lost", str(e)) from None
        except NodeLostError as e:
            raise HttpError(410, "env_lost", f"env {env_id}: {e}") from None
        except UnknownEnvError as e:
            raise HttpError(404, "env_not_found", str(e)) from None
        return self.node_client(node.name)

    def for_create(self, request: dict[str, Any]) -> AsyncClient:
        return self._placer

    def all(self) -> list[AsyncClient]:
        out = []
        for node in self.cluster.all():
            try:
                out.append(self.node_client(node.name))
            except HttpError:
                continue
        return out or [self._placer]

    async def aclose(self) -> None:
        with self._lock:
            clients = [c for _, c in self._clients.values()]
        for client in clients:
            await client.aclose()
        await self._placer._http.aclose()

    # ------------------------------------------------------------------ placement

    def request_for_body(self, body: dict[str, Any]) -> PlacementRequest:
        """What placement needs of a create body: the lock's (or snapshot's) layers and minimums, with
        the body's ``cpu`` / ``memory`` overrides (they are what the node admits)."""
        plan, snapshot = _plan_of(body), body.get("snapshot")
        if snapshot is None and not (isinstance(plan, dict) and "lock_version" in plan):
            # a plan (not a lock): its tags resolve on the node; place by its minimums and load only
            res = plan.get("resources") if isinstance(plan, dict) else None
            req = request_for({"groups": [], "resources": res or {}})
        else:
            req = self.cluster._request(plan, snapshot)[0]
        overrides = body.get("overrides") or {}
        if not isinstance(overrides, dict):
            return req
        from ..plan._units import parse_cpu_range, parse_memory_range

        try:
            if overrides.get("cpu") is not None:
                req = msgspec.structs.replace(req, cpu_min_cores=parse_cpu_range(overrides["cpu"])[0])
            if overrides.get("memory") is not None:
                low, high = parse_memory_range(overrides["memory"])
                req = msgspec.structs.replace(req, memory_min_bytes=low, memory_max_bytes=high)
        except (ValueError, TypeError) as e:
            raise PlacementError(f"the create's overrides: {e}") from None
        return req

    async def candidates(self, body: dict[str, Any]) -> list[str]:
        """The nodes to try for a create body, best first (PlacementError: none admits, and why)."""
        import anyio.to_thread

        req = await anyio.to_thread.run_sync(self.request_for_body, body)  # a snapshot's detail: an agent call
        ranked = self.cluster.rank(req, limit=3)
        if not ranked:
            await anyio.to_thread.run_sync(lambda: place_group(self.cluster._current_view(), req, 1))
        return [c.node for c in ranked]

    async def created(self, node: str, env_id: str) -> None:
        """Route the new env at once, and let the next placement see it (a fresh report of its node)."""
        import anyio.to_thread

        with self.cluster._lock:
            self.cluster._routes[env_id] = node
        await anyio.to_thread.run_sync(self.cluster.refresh_node, node)


def register(url: str) -> None:
    """Put the gateway's URL in Ray's KV store (the Ray cluster's own lookup: no extra service)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_GATEWAY, url.encode(), overwrite=True, namespace=KV_NAMESPACE)


def lookup(ray_address: str | None = None) -> str:
    """The gateway URL registered in the Ray cluster at ``ray_address`` (joins it if not yet joined)."""
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        ray.init(address=ray_address, namespace=KV_NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=False)
    raw = internal_kv._internal_kv_get(KV_GATEWAY, namespace=KV_NAMESPACE)
    if not raw:
        raise ClusterError(f"no weenv gateway is registered in the Ray cluster at {ray_address or 'this job'}: "
                           f"start one with `weenv cluster serve --ray-address ...`")
    return bytes(raw).decode()


async def serve_gateway(cluster: Cluster, token: str, listen: str, *, home: str | None = None,
                        domain: str | None = None, public_url: str | None = None,
                        task_status: Any = None) -> None:
    """Serve the API for the whole cluster on ``listen`` (runs until cancelled)."""
    from ..api import create_app, serve

    app = create_app(ClusterBackend(cluster, token), home=home, domain=domain)
    register(public_url or f"http://{listen}")
    await serve(app, listen, task_status=task_status)
