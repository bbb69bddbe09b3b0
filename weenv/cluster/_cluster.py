"""The cluster client: node agents on every Ray node, placement, routing by env id, lost nodes.

``weenv.cluster.connect(ray_address)`` joins a Ray cluster, makes sure every alive Ray node has
its agent (get-or-create, detached, hard node affinity, no Ray restarts), and runs the
reconciler's tick in a thread of its own. What it offers is also what the gateway (``weenv
cluster serve``) routes with, the :class:`Backend` interface:

- :meth:`Cluster.for_env` — the :class:`NodeClient` of the node an env lives on (from the
  routing table rebuilt out of node reports, else the node its id names); raises EnvLostError for
  an env whose node was lost;
- :meth:`Cluster.for_create` — the best node for a plan (placement over the latest reports).

A :class:`NodeClient` forwards any ``/v1`` call to its node's daemon through the agent
(``request(method, path, json=…) -> (status, content type, body)``), so a gateway proxies the
daemon's whole API without knowing it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..plan import DEFAULT_CPU_MIN_CORES, DEFAULT_MEMORY_MAX_BYTES, DEFAULT_MEMORY_MIN_BYTES
from ..registry import is_image_ref
from ._agent import AGENT_NAMESPACE, agent_class, agent_name, token_digest
from ._errors import (
    AgentError,
    ClusterError,
    EnvLostError,
    NodeLostError,
    PlacementError,
    UnknownEnvError,
)
from ._placement import ClusterView, PlacementRequest, place_group, rank, request_for, with_overrides, with_pending
from ._reconcile import NodeEntry, NodeState, Reconciler
from ._report import NodeReport, node_of, peer_tables

log = logging.getLogger("weenv.cluster")

PENDING_TTL_S = 60.0  # an env placed but never seen in its node's report stops counting after this
from ._nodes import ClusterEnv, NodeClient, _RayAgent
from ._ray import join_ray, node_agents, require_ray_client  # noqa: F401 (re-exported)
from ._snapshots import Snapshots
from ._volumes import Volumes


class Backend(Protocol):
    """What a gateway needs to route: the node of an env, the node for a create."""

    def for_env(self, env_id: str) -> NodeClient: ...

    def rank(self, req: PlacementRequest, *, limit: int | None = None) -> list[Any]:
        """The nodes placement would pick for ``req`` now, best first."""
        return rank(self.current_view(), req, limit=limit)

    def for_create(self, request: dict[str, Any]) -> NodeClient: ...

    def all(self) -> list[NodeClient]: ...


class Cluster(Snapshots, Volumes):
    """Node agents + reconciler + placement + routing (see the module docstring)."""

    def __init__(self, *, token: str | None = None, store: str | None = None, report_interval_s: float = 2.0,
                 call_timeout_s: float = 10.0, failure_threshold: int = 3, start_timeout_s: float = 120.0,
                 tick_s: float = 0.1, node_sync_s: float = 2.0, agent_options: dict[str, Any] | None = None):
        self.token = token
        self.store = store  # host[:port]/repo of the cluster's OCI registry (published snapshots)
        self.report_interval_s = report_interval_s
        self.tick_s = tick_s
        self.node_sync_s = node_sync_s
        self.agent_options = dict(agent_options or {})
        self.clients: dict[str, NodeClient] = {}
        self._by_ray_id: dict[str, str] = {}
        self._lock = threading.RLock()
        self._routes: dict[str, str] = {}  # env id -> node: what this client created, before the next report
        self._lost: dict[str, EnvLostError] = {}
        self._snapshot_home: dict[str, str] = {}
        self._volume_home: dict[str, str] = {}  # volume id / name -> node: what this client made or found
        self._published: dict[str, dict[str, Any]] = {}  # snapshot id / ref -> published record
        self._lost_listeners: list[Callable[[list[EnvLostError]], None]] = []
        self.reconciler = Reconciler(interval_s=report_interval_s, call_timeout_s=call_timeout_s,
                                     failure_threshold=failure_threshold, start_timeout_s=start_timeout_s,
                                     on_lost=self._on_lost)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sync_thread: threading.Thread | None = None
        self._view: tuple[Any, ClusterView] | None = None
        # creates placed but not in their node's report yet: ticket -> (node, request, env id once
        # known, since); the view counts them (with_pending), so concurrent creates see each other
        self._pending: dict[int, tuple[str, PlacementRequest, str | None, float]] = {}
        self._tickets = itertools.count(1)
        self._pending_version = 0
        self._peers_sent: dict[str, tuple[float, dict[str, list[str]]]] = {}  # node -> (when, peer table)
        self.peer_resend_s = 15.0  # a table is sent again this often (an envlet restarted since forgets it)

    # ------------------------------------------------------------------ agents

    def sync_nodes(self) -> None:
        """Give every alive Ray node its agent (get-or-create); a node Ray reports dead is lost."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for node in ray.nodes():
            ray_id = node["NodeID"]
            known = self._by_ray_id.get(ray_id)
            if not node.get("Alive"):
                if known is not None:
                    with self._lock:
                        self.reconciler.mark_lost(known, "Ray reports its node dead")
                continue
            if known is not None:
                continue
            opts = dict(name=agent_name(ray_id), namespace=AGENT_NAMESPACE, lifetime="detached", get_if_exists=True,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_id, soft=False))
            extra = {"peer_token": self.token} if self.agent_options.get("peer_listen") else {}
            actor = agent_class().options(**opts).remote(token_sha256=token_digest(self.token), **extra,
                                                         report_interval_s=self.report_interval_s,
                                                         **self.agent_options)
            client = NodeClient("?", actor, self.token)
            try:
                hello = client.hello(timeout_s=120.0)
            except Exception as e:
                log.warning("Ray node %s: its agent did not start: %s", ray_id, e)
                continue
            client.name = hello["node"]
            with self._lock:
                self.clients[client.name] = client
                self._by_ray_id[ray_id] = client.name
                self.reconciler.add(_RayAgent(client))

    def start(self) -> "Cluster":
        self.sync_nodes()
        self._thread = threading.Thread(target=self._run, name="weenv-cluster-reconciler", daemon=True)
        self._thread.start()
        # joining nodes waits for their agents (and daemons) to start: never inside the tick
        self._sync_thread = threading.Thread(target=self._sync, name="weenv-cluster-nodes", daemon=True)
        self._sync_thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                with self._lock:
                    self.reconciler.tick()
                self._push_peers()
            except Exception:
                log.exception("cluster reconcile tick failed")

    def _push_peers(self) -> None:
        """Give every node's envlet its peer table out of the latest reports (issue 20: no discovery
        protocol of its own): the other healthy, accepting nodes' peer addresses -> their layers.
        Sent when it changed (or every ``peer_resend_s``), without waiting for the answer."""
        now = time.monotonic()
        with self._lock:
            entries = [e for e in self.reconciler.nodes.values() if e.report is not None]
            usable = {e.name for e in entries if e.state is NodeState.HEALTHY and e.report.accepting}  # type: ignore[union-attr]
            tables = peer_tables([e.report for e in entries if e.state is not NodeState.LOST], usable)  # type: ignore[misc]
            clients = {n: self.clients.get(n) for n in tables}
        for node, table in tables.items():
            sent = self._peers_sent.get(node)
            client = clients[node]
            if client is None or (sent is not None and sent[1] == table and now - sent[0] < self.peer_resend_s):
                continue
            try:
                client.actor.set_peers.remote(client._token, table)
            except Exception as e:  # the actor handle is gone: the reconciler finds out
                log.warning("node %s: peer table not sent: %s", node, e)
                continue
            self._peers_sent[node] = (now, table)

    def _sync(self) -> None:
        while not self._stop.wait(self.node_sync_s):
            try:
                self.sync_nodes()
            except Exception:
                log.exception("cluster node sync failed")

    def wait_ready(self, timeout_s: float = 60.0, *, nodes: int | None = None) -> None:
        """Wait until every known node reported once (or was lost), and at least ``nodes`` are healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                states = [e.state for e in self.reconciler.nodes.values()]
            healthy = sum(s is NodeState.HEALTHY for s in states)
            if states and NodeState.STARTING not in states and (nodes is None or healthy >= nodes):
                return
            time.sleep(0.05)
        raise ClusterError(f"the cluster was not ready within {timeout_s:g} s: {self.nodes()}")

    def close(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._sync_thread):
            if thread is not None:
                thread.join(10)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def nodes(self) -> list[dict[str, Any]]:
        """Every node: name, state, why lost, its latest report."""
        with self._lock:
            return [{"node": e.name, "state": e.state.value, "lost_reason": e.lost_reason,
                     "failures": e.failures, "last_error": e.last_error, "report": e.report}
                    for e in self.reconciler.nodes.values()]

    def report(self, node: str) -> NodeReport | None:
        with self._lock:
            entry = self.reconciler.nodes.get(node)
            return entry.report if entry is not None else None

    def refresh(self) -> None:
        """Fetch every healthy node's report now (instead of waiting for the next tick)."""
        for name in list(self.clients):
            self._refresh_one(name)

    def refresh_node(self, name: str) -> None:
        """Have node ``name`` take a report now and use it (after a change made past its agent)."""
        self._refresh_one(name, fresh=True)

    def take_down(self, name: str, *, kill_envs: bool, timeout_s: float = 60.0) -> dict[str, Any]:
        """Take node ``name`` out of the cluster and stop its daemon (``weenv cluster stop-node``):
        its envs killed first with ``kill_envs``, else left running (a daemon started later on the
        node re-adopts them). The node is lost from then on, for this client at once and for every
        other (a gateway) at its next poll; its envs are lost envs. Returns the agent's answer."""
        client = self.node(name)
        answer = client.stop(stop_daemon=True, kill_envs=kill_envs, timeout_s=timeout_s,
                             reason="Cluster.take_down")
        with self._lock:
            entry = self.reconciler.nodes.get(name)
        if entry is not None:
            self._refresh_one(name)  # its down report: lost now, its envs handed to on_envs_lost
            with self._lock:
                self.reconciler.mark_lost(name, "taken down (Cluster.take_down)")
        return answer

    def _refresh_one(self, name: str, *, fresh: bool = False) -> None:
        try:
            client = self.node(name)
            rep = client._get(client.actor.refresh.remote(client._token), 10.0) if fresh else client.report(10.0)
        except Exception:
            return  # the reconciler's next poll deals with it
        with self._lock:
            entry = self.reconciler.nodes.get(name)
            if entry is not None and entry.state is NodeState.HEALTHY and (
                    entry.report is None or rep.seq > entry.report.seq):
                entry.report = rep
                if rep.down:  # taken down: lost now, not at the next poll
                    self.reconciler.mark_lost(name, f"taken down: {rep.down}")
                elif self._pending:  # at once: an env killed before the next placement would never be listed
                    self._drop_seen_pending([rep])

    def routes(self) -> dict[str, str]:
        """env id -> node, rebuilt from the node reports (what a restarted gateway starts from)."""
        with self._lock:
            table = dict(self._routes)
            for e in self.reconciler.nodes.values():
                if e.state is not NodeState.LOST and e.report is not None:
                    for env in e.report.envs:
                        table[env.id] = e.name
            return table

    def lost_env(self, env_id: str) -> EnvLostError | None:
        with self._lock:
            return self._lost.get(env_id)

    def lost_envs(self) -> dict[str, EnvLostError]:
        with self._lock:
            return dict(self._lost)

    def on_envs_lost(self, callback: Callable[[list[EnvLostError]], None]) -> None:
        """Call ``callback`` with the envs of every node lost from now on (in the reconciler's thread)."""
        self._lost_listeners.append(callback)

    def _on_lost(self, entry: NodeEntry) -> None:
        client = self.clients.get(entry.name)
        if client is not None and entry.report is not None and entry.report.peer_address:
            try:  # if its envlet still runs, it stops serving peers (the others drop it from their tables)
                client.actor.set_peer_serving.remote(client._token, False)
            except Exception:
                pass
        ids = {env_id for env_id, node in self._routes.items() if node == entry.name}
        if entry.report is not None:
            ids.update(env.id for env in entry.report.envs)
        errors = [EnvLostError(env_id, entry.name, entry.lost_reason) for env_id in sorted(ids)]
        for err in errors:
            self._lost[err.env_id] = err
            self._routes.pop(err.env_id, None)
        for cb in self._lost_listeners:
            try:
                cb(errors)
            except Exception:
                log.exception("an envs-lost listener failed")

    def _forget(self, env_id: str) -> None:
        with self._lock:
            self._routes.pop(env_id, None)
            for ticket in [t for t, p in self._pending.items() if p[2] == env_id]:
                del self._pending[ticket]  # killed before a report listed it
                self._pending_version += 1

    # ------------------------------------------------------------------ Backend

    def node(self, node: str) -> NodeClient:
        with self._lock:
            entry = self.reconciler.nodes.get(node)
            if entry is not None and entry.state is NodeState.LOST:
                raise NodeLostError(f"node {node} is lost: {entry.lost_reason}")
            client = self.clients.get(node)
        if client is None:
            raise ClusterError(f"no node {node!r} in the cluster (nodes: {sorted(self.clients)})")
        return client

    def route(self, env_id: str, node: str) -> None:
        """Route ``env_id`` to ``node`` at once (a create's answer; the node's next report agrees)."""
        with self._lock:
            self._routes[env_id] = node

    def for_env(self, env_id: str) -> NodeClient:
        lost = self.lost_env(env_id)
        if lost is not None:
            raise lost
        node = self.routes().get(env_id)
        if node is None:
            hint = node_of(env_id)
            if hint is None or hint not in self.clients:
                raise UnknownEnvError(f"no node reports env {env_id!r} and its id names no node of the cluster")
            node = hint
        return self.node(node)

    def all(self) -> list[NodeClient]:
        """Every node that is not lost (lists and metrics gather from all of them)."""
        with self._lock:
            lost = {n for n, e in self.reconciler.nodes.items() if e.state is NodeState.LOST}
            return [c for n, c in self.clients.items() if n not in lost]

    def async_client(self) -> Any:
        """This cluster as an asyncio client shaped like :class:`weenv.AsyncClient` (slime_plugin)."""
        from ._aio import AsyncClusterClient

        return AsyncClusterClient(self)

    def current_view(self) -> ClusterView:
        with self._lock:
            reports = self.reconciler.reports()
            if self._pending:
                self._drop_seen_pending(reports)
            key = (tuple((r.node, r.seq, r.taken_s) for r in reports), self._pending_version)
            if self._view is not None and self._view[0] == key:
                return self._view[1]
            by_node: dict[str, list[PlacementRequest]] = {}
            for node, req, _, _ in self._pending.values():
                by_node.setdefault(node, []).append(req)
            view = ClusterView([with_pending(r, by_node.get(r.node, ())) for r in reports])
            self._view = (key, view)
            return view

    def _drop_seen_pending(self, reports: list[NodeReport]) -> None:
        """Forget pending creates whose env one of ``reports`` lists (or that are too old to wait for)."""
        now = time.monotonic()
        listed: dict[str, set[str]] = {}
        for ticket, (node, _, env_id, since) in list(self._pending.items()):
            if env_id is not None and node not in listed:
                listed[node] = {e.id for r in reports if r.node == node for e in r.envs}
            if now - since > PENDING_TTL_S or (env_id is not None and env_id in listed.get(node, ())):
                del self._pending[ticket]
                self._pending_version += 1

    def reserve(self, node: str, req: PlacementRequest) -> int:
        """Count a create about to be sent to ``node`` in every placement until its node reports
        the env (:meth:`settle` it with the env's id, or None when the create failed)."""
        with self._lock:
            ticket = next(self._tickets)
            self._pending[ticket] = (node, req, None, time.monotonic())
            self._pending_version += 1
            return ticket

    def settle(self, ticket: int, env_id: str | None) -> None:
        with self._lock:
            entry = self._pending.pop(ticket, None)
            if entry is not None and env_id is not None:
                self._pending[ticket] = (entry[0], entry[1], env_id, time.monotonic())
            self._pending_version += 1

    def place(self, req: PlacementRequest, *, limit: int = 3) -> tuple[list[str], int | None]:
        """The nodes to try for ``req``, best first, with the first one already reserved (its
        ticket, None when no node admits it): ranking and reserving are one step, so that a burst
        of concurrent creates spreads as the same creates one after the other would."""
        with self._lock:
            ranked = [c.node for c in rank(self.current_view(), req, limit=limit)]
            return ranked, (self.reserve(ranked[0], req) if ranked else None)

    def lock_for_image(self, image: str) -> Any:
        """The lock envs of ``image`` start from, its layers converted where the cluster's store lacks
        them (once for the whole cluster: every node reads the groups there, and placement sees
        their layers); None without a store (each node then converts into its own)."""
        if self.store is None:
            return None
        from ..registry import lock_for_image

        return lock_for_image(image, base=self.store.rstrip("/") + "/")

    def placement_request(self, plan: Any, snapshot: str | None) -> tuple[PlacementRequest, dict[str, Any]]:
        """The placement request and the create body for a plan lock (a :class:`weenv.plan.Lock`,
        or its builtins, read by the plan codec: PlanError naming the field when it refuses them)
        or a snapshot (id or published ref). The body carries the lock as the codec read it."""
        from ..plan import Lock, Plan, plan_from_builtins, plan_to_builtins

        if snapshot is None:
            if isinstance(plan, dict) and "lock_version" in plan:
                plan = plan_from_builtins(plan, Lock, source="the create's plan lock")
            if not isinstance(plan, Lock):
                kind = "a plan" if isinstance(plan, (dict, Plan)) else "nothing to start"
                raise PlacementError(f"the cluster places plan locks (run `weenv plan lock`), got {kind}: a plan's "
                                     f"tags would resolve differently on every node")
            return request_for(plan), {"plan": plan_to_builtins(plan)}
        published = self.published_record(snapshot)
        if published is not None:
            lock = published["lock"]
            layers = tuple((x[0], int(x[1])) for x in published.get("layers", ()))
            return request_for(lock, snapshot_layers=layers, snapshot=published["id"],
                               snapshot_home=published.get("home"),
                               source=f"published snapshot {snapshot}"), {"plan": lock}
        home = self.snapshot_home(snapshot)
        if home is None:
            raise PlacementError(f"no node holds snapshot {snapshot!r} and it is not published to the cluster")
        detail = self.node(home).call("GET", f"/v1/snapshots/{snapshot}")
        layers = tuple((x["digest"], int(x["size"])) for x in detail.get("layers", ()))
        return request_for(detail["lock"], snapshot_layers=layers, snapshot=snapshot, snapshot_home=home,
                           snapshot_local=True, source=f"snapshot {snapshot} on node {home}"), {"snapshot": snapshot}

    def rank(self, req: PlacementRequest, *, limit: int | None = None) -> list[Any]:
        """The nodes placement would pick for ``req`` now, best first."""
        return rank(self.current_view(), req, limit=limit)

    def for_create(self, request: dict[str, Any]) -> NodeClient:
        """The node for a ``POST /v1/envs`` body (``plan``: a lock, or ``snapshot``: an id or published ref)."""
        req, _ = self.placement_request(request.get("plan"), request.get("snapshot"))
        req = self.pin_volumes(with_overrides(req, request.get("overrides")))  # pinned to its volumes' node
        ranked = rank(self.current_view(), req, limit=1)
        if not ranked:
            place_group(self.current_view(), req, 1)  # raises with the reasons
        return self.node(ranked[0].node)

    # ------------------------------------------------------------------ envs

    def create(self, plan: Any = None, *, snapshot: str | None = None,
               node: str | None = None, overrides: dict[str, Any] | None = None,
               restricted: bool = False, volumes: list[dict[str, Any]] | None = None) -> ClusterEnv:
        """Start an env from a plan lock (a file, a :class:`weenv.plan.Lock` or its builtins) or a
        snapshot (id, or a published ref) on the node placement picks (or on ``node``). A node that
        refuses (its state moved since its last report) is skipped for the next best.
        ``restricted``: a tenant's env (docs/network.md). ``volumes``: ``[[volumes]]`` tables mounted
        beside the plan's; an env that mounts volumes starts on their node only."""
        if volumes:
            overrides = {**(overrides or {}), "volumes": [*(overrides or {}).get("volumes", []), *volumes]}
        image = None
        if isinstance(plan, str) and not os.path.exists(plan) and is_image_ref(plan):
            image, plan = plan, self.lock_for_image(plan)
        elif isinstance(plan, (str, os.PathLike)):
            from ..plan import load_any

            plan = load_any(plan)
        if plan is None and image is not None:  # no cluster store: the node converts it into its own
            req, body = PlacementRequest(cpu_min_cores=DEFAULT_CPU_MIN_CORES, memory_min_bytes=DEFAULT_MEMORY_MIN_BYTES,
                                         memory_max_bytes=DEFAULT_MEMORY_MAX_BYTES), {"image": image}
        else:
            req, body = self.placement_request(plan, snapshot)
        if overrides:
            try:
                req = with_overrides(req, overrides)  # placed by the minimums the node will admit it with
            except ValueError as e:
                raise PlacementError(f"create: {e}") from None
            body["overrides"] = overrides
        req = self.pin_volumes(req, node)  # Volume*Error: volumes no node holds, or of two nodes
        if restricted:
            body["restricted"] = True
        if node is not None:
            candidates, ticket = [node], self.reserve(node, req)
        else:
            candidates, ticket = self.place(req)
            if not candidates:
                place_group(self.current_view(), req, 1)  # raises, saying why
        last: Exception | None = None
        for k, name in enumerate(candidates):
            if k > 0:
                ticket = self.reserve(name, req)
            info = None
            try:
                info = self.node(name).call("POST", "/v1/envs", json=body)
            except AgentError as e:
                if e.kind != "not_admitted":
                    raise
                last = e
                continue
            except NodeLostError as e:
                last = e
                continue
            finally:
                self.settle(ticket, info["id"] if isinstance(info, dict) and "id" in info else None)
            with self._lock:
                self._routes[info["id"]] = name
            self._refresh_one(name)  # the next placement sees this env's mins and layers
            return ClusterEnv(self, info, name)
        raise PlacementError(f"every node tried refused the env: {last}")

    def get(self, env_id: str) -> ClusterEnv:
        client = self.for_env(env_id)
        return ClusterEnv(self, client.call("GET", f"/v1/envs/{env_id}"), client.name)

    def envs(self) -> dict[str, str]:
        return self.routes()

    def fork(self, env: ClusterEnv, n: int) -> list[ClusterEnv]:
        return self.fork_group(env, n)[1]

    def fork_group(self, env: ClusterEnv, n: int) -> tuple[str, list[ClusterEnv]]:
        """:meth:`fork`, with the snapshot the children start from (the gateway answers both, as a
        node's ``POST /v1/envs/{id}/fork`` does). All or none: a failure kills the started children."""
        if not 1 <= n <= 1024:
            raise ClusterError(f"fork needs 1 <= n <= 1024, got {n}")
        # a tenant's env forks into tenant envs wherever they start (its home's fork would keep it)
        restricted = bool(env._call("GET", f"/v1/envs/{env.id}").get("restricted"))
        snap = env._call("POST", f"/v1/envs/{env.id}/commit", json={})["snapshot"]
        self._note_snapshot(snap, env.node)
        children: list[ClusterEnv] = []
        try:
            local_req, _ = self.placement_request(None, snap)
            view = self.current_view()
            try:
                nodes = place_group(view, local_req, n)  # all on the home node
            except PlacementError:
                if self.store is None:
                    raise
                rec = self.publish(snap)
                layers = tuple((x[0], int(x[1])) for x in rec["layers"])
                spread = request_for(rec["lock"], snapshot_layers=layers, snapshot=snap, snapshot_home=env.node,
                                     source=f"published snapshot {snap}")
                nodes = place_group(view, spread, n)
            for name in nodes:
                if name == env.node:
                    children.append(self.create(snapshot=snap, node=name, restricted=restricted))
                else:
                    children.append(self.create(snapshot=self._published[snap]["ref"], node=name,
                                                restricted=restricted))
        except BaseException:
            for child in children:
                try:
                    child.kill()
                except Exception:
                    pass
            try:  # a refused fork leaves no snapshot, on the home or in the store
                self.delete_snapshot(snap)
            except Exception as e:
                log.warning("fork of %s refused; its snapshot %s stays on node %s: %s", env.id, snap, env.node, e)
            raise
        return snap, children


def connect(ray_address: str | None = None, *, token: str | None = None, store: str | None = None,
            namespace: str = AGENT_NAMESPACE, wait_s: float = 120.0, ray_init: dict[str, Any] | None = None,
            **options: Any) -> Cluster:
    """Join the Ray cluster at ``ray_address`` (``None``: the one this process is already in), start
    or find an agent on every node, and wait for their first reports.

    ``token``: the cluster token every agent call carries; ``store``: ``host[:port]/repo`` of the
    cluster's OCI registry, where published snapshots go. Pin a loopback-only cluster with
    ``ray_init={"_node_ip_address": "127.0.0.1"}`` (docs/cluster.md)."""
    import ray

    if not ray.is_initialized():
        join_ray(ray_address, namespace=namespace, **(ray_init or {}))
    cluster = Cluster(token=token, store=store, **options).start()
    cluster.wait_ready(wait_s)
    return cluster
