"""The cluster gateway: ``weenv serve``'s app (``/v1``, E2B, envd) over every node of a Ray cluster.

``weenv cluster serve --ray-address ADDR --listen HOST:PORT`` runs :func:`weenv.api.create_app`
with a :class:`ClusterBackend`: the app asks it for "the daemon of env X" or "the daemon for this
create", and it answers with a :class:`weenv.AsyncClient` on that node's daemon, reached over the
node agent's TCP listener (weenv/cluster/_nodeapi.py) with the cluster token. So the app runs
unchanged: one set of API keys (the gateway's ``$WEENV_HOME/api``), one routing table.

- Routing: an env's node comes from the node reports (``Cluster.for_env``; its id names its node,
  so a restarted gateway routes every env again from the first reports). An env on a lost node is
  a 410 ``env_lost`` naming the node and why.
- Creates and calls without an env id go to one client for the whole cluster (an httpx transport,
  :class:`_ClusterTransport`): ``POST /v1/envs`` is placed from its body (the plan's layers and
  minimums -> ranked nodes -> the first that admits; a node answering 503 ``not_admitted``, its
  state moved since its report, is skipped for the next); lists and metrics gather every node's;
  a snapshot's calls go to the node that holds it (its home in the node reports), and a create from
  a published snapshot placed off its home gets the snapshot's published lock instead of its id.
- Forks (``POST /v1/envs/{id}/fork``) go to the env's node; when it refuses them for its room (503
  ``not_admitted``), they are spread as :meth:`Cluster.fork` spreads them (``fork_group``: the
  home takes what it admits, the rest start on other nodes from the snapshot published to the
  store), answered in the node's shape; when the cluster cannot take them all, none is started.
- Env ports (E2B's ``get_host``, ``/proxy/{id}/{port}``): the app's port tunnel is opened on the
  env's node through the same per-node client (weenv/api/_proxy.py speaks to a daemon's TCP API
  with the client's ``Authorization``), so the node API's token gate applies to it too.
- The gateway's address is kept in Ray's KV store (``weenv.Client(cluster="HEAD:6379")`` finds it;
  ``ray://`` addresses go through Ray's client, :func:`weenv.cluster._cluster.join_ray`).
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
from ..registry import NotFoundError, RefError
from ._cluster import Cluster, join_ray
from ._errors import AgentError, ClusterError, EnvLostError, NodeLostError, PlacementError, UnknownEnvError
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


class _ClusterTransport(httpx.AsyncBaseTransport):
    """The whole cluster as one daemon, for the calls the app makes without an env id:
    ``POST /v1/envs`` is placed (then sent to the first node that admits), ``GET /v1/envs`` /
    ``/v1/snapshots`` gather every node's list, ``/v1/metrics`` every node's text, a snapshot's
    calls go to the node that holds it, the rest (``/v1/ping``…) to the first node."""

    def __init__(self, backend: "ClusterBackend"):
        self.backend = backend

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        method, path = request.method, request.url.path
        body = await request.aread()
        if method == "POST" and path == "/v1/envs":
            return await self._create(request, body)
        nodes = self.backend.node_clients()
        if not nodes:
            return _error(503, "daemon_unavailable", "no node of the cluster is reachable")
        if method == "GET" and path in ("/v1/envs", "/v1/snapshots", "/v1/metrics"):
            parts = []
            for name, client in nodes:
                try:
                    resp = await self._send(client, request, body)
                except httpx.TransportError as e:
                    log.warning("node %s: %s %s: %s", name, method, path, e)
                    continue
                if resp.status_code >= 400:
                    return _wrap(resp)
                parts.append(resp)
            if path == "/v1/metrics":
                return _answer(200, "text/plain; version=0.0.4; charset=utf-8", b"".join(p.content for p in parts))
            merged = [x for p in parts for x in p.json()]
            return _answer(200, "application/json", msgspec.json.encode(merged))
        target = nodes[0][1]
        parts_ = path.split("/")
        if len(parts_) > 3 and parts_[2] == "snapshots":
            import anyio.to_thread

            home = await anyio.to_thread.run_sync(self.backend.snapshot_home, parts_[3])  # may ask the nodes
            target = dict(nodes).get(home, target) if home else target
        elif len(parts_) > 3 and parts_[2] == "envs":
            target = self.backend.for_env(parts_[3])
        try:
            return _wrap(await self._send(target, request, body))
        except httpx.TransportError as e:
            return _error(503, "daemon_unavailable", f"the node's daemon API does not answer: {e}")

    @staticmethod
    async def _send(client: AsyncClient, request: httpx.Request, body: bytes) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        resp = await client._http.request(request.method, request.url.path, params=request.url.params,
                                          content=body or None, headers=headers, timeout=None)
        return resp  # read: wrap it with _wrap() to hand it back

    async def _create(self, request: httpx.Request, body: bytes) -> httpx.Response:
        try:
            parsed = msgspec.json.decode(body) if body else {}
        except msgspec.DecodeError as e:
            return _error(400, "bad_request", f"the create body is not JSON: {e}")
        try:
            nodes, req, ticket = await self.backend.placed(parsed if isinstance(parsed, dict) else {})
        except PlacementError as e:
            return _error(503, "not_admitted", str(e))
        except HttpError as e:  # a snapshot no node holds (any more)
            return _error(e.status, e.kind, e.message)
        import anyio.to_thread

        cluster = self.backend.cluster
        last: httpx.Response | None = None
        for k, name in enumerate(nodes):
            if k > 0:
                ticket = cluster.reserve(name, req)  # counted by concurrent creates until its node reports it
            env_id = None
            try:
                try:
                    client = self.backend.node_client(name)
                    moved = await anyio.to_thread.run_sync(self.backend.body_for, parsed, name) \
                        if isinstance(parsed, dict) and isinstance(parsed.get("snapshot"), str) else None
                    resp = await self._send(client, request, body if moved is None else msgspec.json.encode(moved))
                except HttpError:
                    continue
                except httpx.TransportError as e:
                    log.warning("node %s: its daemon API does not answer: %s", name, e)
                    continue
                if resp.status_code == 503 and _kind(resp) == "not_admitted":
                    last = resp
                    continue
                if resp.status_code < 300:
                    try:
                        env_id = str(resp.json()["id"])
                    except (KeyError, ValueError, TypeError):
                        pass
            finally:
                cluster.settle(ticket, env_id)
            if env_id is not None:
                await self.backend.created(name, env_id)
            return _wrap(resp)
        if last is not None:
            return _wrap(last)
        return _error(503, "not_admitted", f"no node of the cluster answered (tried {nodes})")


def _kind(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["kind"])
    except (ValueError, KeyError, TypeError):
        return ""


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}"


def _answer(status: int, content_type: str, body: bytes) -> httpx.Response:
    """A transport's answer: a stream (the app relays it raw), not pre-read content."""
    headers = {"content-type": content_type, "content-length": str(len(body))} if content_type else \
        {"content-length": str(len(body))}
    return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))


def _wrap(resp: httpx.Response) -> httpx.Response:
    return _answer(resp.status_code, resp.headers.get("content-type", ""), resp.content)


def _error(status: int, kind: str, message: str) -> httpx.Response:
    return _answer(status, "application/json",
                   msgspec.json.encode({"error": {"kind": kind, "message": message, "status": status}}))


class _NodeTransport(httpx.AsyncHTTPTransport):
    """A node's daemon API; after a call that changes what placement reads (a kill, a fork, a
    commit), the node's agent takes a fresh report, so the next create sees the room it freed."""

    def __init__(self, backend: "ClusterBackend", node: str):
        super().__init__()
        self.backend, self.node = backend, node

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        parts = path.split("/")
        if method == "POST" and len(parts) == 5 and parts[2] == "envs" and parts[4] == "fork":
            return await self._fork(request, parts[3])
        if method == "DELETE" and len(parts) == 4 and parts[2] == "snapshots":
            return await self._delete_snapshot(request, parts[3])
        resp = await super().handle_async_request(request)
        if resp.status_code < 300 and ((method == "DELETE" and path.startswith("/v1/envs/") and path.count("/") == 3)
                                       or (method == "POST" and path.endswith("/commit"))):
            import anyio.to_thread

            await anyio.to_thread.run_sync(self.backend.cluster.refresh_node, self.node)
        return resp

    async def _delete_snapshot(self, request: httpx.Request, snap: str) -> httpx.Response:
        """A snapshot's DELETE at its home; once the node's copy is gone, its published copy leaves
        the store too (read before: the home's report names the ref only while it holds it)."""
        import anyio.to_thread

        cluster = self.backend.cluster
        ref = await anyio.to_thread.run_sync(cluster.published_ref, snap)
        resp = await super().handle_async_request(request)
        if resp.status_code >= 300:
            return resp
        try:
            await anyio.to_thread.run_sync(cluster.snapshot_deleted, snap, ref)
        except Exception as e:  # the node's copy is gone; say what stays
            await resp.aread()
            await resp.aclose()
            log.warning("snapshot %s: deleted on node %s, but its published copy %s stays: %s",
                        snap, self.node, ref, e)
            return _error(502, "store_error", f"snapshot {snap} was deleted on node {self.node}, but its "
                          f"published copy {ref} could not be removed from the store: {e}")
        await anyio.to_thread.run_sync(cluster.refresh_node, self.node)
        return resp

    async def _fork(self, request: httpx.Request, env_id: str) -> httpx.Response:
        """A fork: the env's node forks it when it admits every child (the node's answer as it is);
        when it refuses (503 ``not_admitted``), :meth:`Cluster.fork_group` places the children, those
        the node admits there, the rest on other nodes from the snapshot published to the store."""
        import anyio.to_thread

        body = await request.aread()  # kept: the node's call below sends it
        resp = await super().handle_async_request(request)
        if resp.status_code < 300:
            await anyio.to_thread.run_sync(self.backend.cluster.refresh_node, self.node)
        if resp.status_code != 503:
            return resp
        await resp.aread()
        await resp.aclose()
        if _kind(resp) != "not_admitted":
            return _wrap(resp)
        try:
            n = msgspec.json.decode(body).get("n", 1) if body else 1
        except (msgspec.DecodeError, AttributeError):
            return _wrap(resp)  # the node read it: not a body it refused for its room
        return await self.backend.fork(env_id, self.node, n, resp)


class ClusterBackend(Backend):
    """:class:`weenv.api.Backend` over a :class:`~weenv.cluster.Cluster` (see the module docstring)."""

    def __init__(self, cluster: Cluster, token: str):
        if not token:
            raise ClusterError("the gateway needs the cluster token (node daemons accept nothing else)")
        self.cluster, self.token = cluster, token
        self._clients: dict[str, tuple[str, AsyncClient]] = {}
        self._lock = threading.Lock()
        self._placer = AsyncClient("http://cluster", timeout_s=None, autostart=False)  # type: ignore[arg-type]
        self._placer._http = httpx.AsyncClient(transport=_ClusterTransport(self), base_url="http://cluster",
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
            client._http = httpx.AsyncClient(transport=_NodeTransport(self, name), base_url=url, timeout=None,
                                             headers={"Authorization": f"Bearer {self.token}"})
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

    def node_clients(self) -> list[tuple[str, AsyncClient]]:
        """Every node that is not lost and serves its daemon API, by name."""
        out = []
        for node in self.cluster.all():
            try:
                out.append((node.name, self.node_client(node.name)))
            except HttpError:
                continue
        return out

    def all(self) -> list[AsyncClient]:
        """One client for the whole cluster (lists gathered from every node, snapshots at their home)."""
        return [self._placer]

    def snapshot_home(self, snap_id: str) -> str | None:
        return self.cluster._snapshot_home.get(snap_id) or self.cluster._find_snapshot(snap_id)

    async def aclose(self) -> None:
        with self._lock:
            clients = [c for _, c in self._clients.values()]
        for client in clients:
            await client.aclose()
        await self._placer._http.aclose()

    # ------------------------------------------------------------------ placement

    def request_for_body(self, body: dict[str, Any]) -> PlacementRequest:
        """What placement needs of a create body: the lock's (or snapshot's) layers and minimums, with
        the body's ``cpu`` / ``memory`` overrides (they are what the node admits). A snapshot no node
        holds, one its home's daemon no longer has (deleted since the home's last report), or a ref
        the store does not have, is an HttpError 404 ``snapshot_not_found`` naming it."""
        plan, snapshot = _plan_of(body), body.get("snapshot")
        if snapshot is None and not (isinstance(plan, dict) and "lock_version" in plan):
            # a plan (not a lock): its tags resolve on the node; place by its minimums and load only
            res = plan.get("resources") if isinstance(plan, dict) else None
            req = request_for({"groups": [], "resources": res or {}})
        else:
            try:
                req = self.cluster._request(plan, snapshot)[0]
            except AgentError as e:  # its home's report still lists it; the home's daemon answered
                raise HttpError(e.status, e.kind, f"snapshot {snapshot!r} on node {e.node}: {e.message}") from None
            except PlacementError as e:
                if snapshot is None:
                    raise
                raise HttpError(404, "snapshot_not_found", str(e)) from None
            except NotFoundError as e:  # a ref the cluster's store does not have
                raise HttpError(404, "snapshot_not_found", f"published snapshot {snapshot!r}: {e}") from None
            except (ClusterError, RefError) as e:  # not a snapshot ref, or not a weenv snapshot's manifest
                raise HttpError(400, "bad_request", f"snapshot {snapshot!r}: {e}") from None
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

    def body_for(self, body: dict[str, Any], node: str) -> dict[str, Any] | None:
        """The create body ``node`` gets when it is not the client's: a published snapshot placed off
        its home, or named by its ref (a daemon starts only from its own snapshot ids), starts from
        its published lock, its layers through the store, as :meth:`Cluster.create` starts it.
        None: the client's body as it came."""
        snapshot = body.get("snapshot")
        if not isinstance(snapshot, str):
            return None
        rec = self.cluster._published_record(snapshot)  # held since request_for_body read it
        if rec is None or ("/" not in snapshot and rec.get("home") == node):
            return None
        moved = {k: v for k, v in body.items() if k != "snapshot"}
        moved["plan"] = rec["lock"]
        return moved

    async def placed(self, body: dict[str, Any]) -> tuple[list[str], PlacementRequest, int]:
        """The nodes to try for a create body, best first, its placement request, and the ticket
        reserving the first node (:meth:`Cluster.place`; settle it). PlacementError: none admits;
        HttpError 404: a snapshot no node holds."""
        import anyio.to_thread

        req = await anyio.to_thread.run_sync(self.request_for_body, body)  # a snapshot's detail: an agent call
        if log.isEnabledFor(logging.INFO):  # what the decision sees (concurrent creates may slip in between)
            log.info("create: best nodes %s", ", ".join(f"{c.node} (cached {c.cached_bytes >> 20} MiB, load "
                                                        f"{c.load:.3f}, {c.envs} envs)" for c in self.cluster.rank(req, limit=3)))
        nodes, ticket = self.cluster.place(req, limit=3)
        if ticket is None:
            await anyio.to_thread.run_sync(lambda: place_group(self.cluster._current_view(), req, 1))
            raise PlacementError("no node admits the env")  # place_group raised already, unless the view moved
        return nodes, req, ticket

    async def fork(self, env_id: str, node: str, n: int, refused: httpx.Response) -> httpx.Response:
        """The fork of ``env_id`` (on ``node``, which ``refused`` it for its room) spread over the
        cluster as :meth:`Cluster.fork_group` spreads it; answered as a node answers a fork (201
        ``{snapshot, envs}``), or as a 503 ``not_admitted`` saying how many children the nodes take
        and why not the rest (none is left: all or none, as on one node)."""
        import anyio.to_thread

        from ._cluster import ClusterEnv

        cluster = self.cluster
        env = ClusterEnv(cluster, {"id": env_id}, node)
        try:
            snap, children = await anyio.to_thread.run_sync(cluster.fork_group, env, n)
        except PlacementError as e:
            why = "" if cluster.store is not None else \
                " (the gateway has no --store: the children cannot start off the env's node)"
            log.info("fork of %s x%d: %s%s", env_id, n, e, why)
            return _error(503, "not_admitted", f"fork of {n} from env {env_id}: node {node} refused "
                          f"({_message(refused)}); over the cluster: {e}{why}")
        except AgentError as e:
            return _error(e.status, e.kind, f"fork of {n} from env {env_id}: node {e.node}: {e.message}")
        except (NodeLostError, EnvLostError) as e:
            return _error(503, "node_lost", f"fork of {n} from env {env_id}: {e}")
        except ClusterError as e:
            return _error(400, "bad_request", f"fork of {n} from env {env_id}: {e}")
        log.info("fork of %s x%d spread: %s", env_id, n, ", ".join(f"{c.id}@{c.node}" for c in children))
        return _answer(201, "application/json",
                       msgspec.json.encode({"snapshot": snap, "envs": [c.info for c in children]}))

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
        join_ray(ray_address, namespace=KV_NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
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
