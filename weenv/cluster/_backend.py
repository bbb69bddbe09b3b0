"""The API's :class:`~weenv.api.Backend` over a :class:`~weenv.cluster.Cluster`: what the gateway
(``weenv cluster serve``) answers the app's questions with.

Each node's daemon is reached over its agent's TCP listener (weenv/cluster/_nodeapi.py) with the
cluster token, as an ordinary :class:`weenv.AsyncClient`:

- an env's node comes from the node reports (``Cluster.for_env``; its id names its node, so a
  restarted gateway routes every env again from the first reports); an env on a lost node is a
  410 ``env_lost`` naming the node and why;
- a create is placed from its body (the plan's layers and minimums -> ranked nodes -> the first
  that admits; a node answering 503 ``not_admitted``, its state moved since its report, is
  skipped for the next); a create from a published snapshot placed off its home gets the
  snapshot's published lock instead of its id;
- a fork goes to the env's node; when it refuses for its room, the children are spread as
  :meth:`Cluster.fork_group` spreads them, all or none;
- a resume goes to the env's node; a parked env its node has no room for any more moves to a node
  that admits it, keeping its id (:meth:`ClusterBackend.resume`; docs/snapshots.md);
- a snapshot's calls go to its home; its delete also removes its published copy from the store;
- a volume's calls go to its node (volumes are node-local: weenv/cluster/_volumes.py), a new volume
  to the node placement picks for volumes, and a create that mounts volumes to their node only
  (404 ``volume_not_found`` when no node holds one, 409 ``volume_conflict`` for volumes of two nodes);
- lists gather every node's (a node that does not answer is left out, and logged);
- after a kill, commit, fork or create, the node's agent takes a fresh report, so the next
  placement sees the room it freed or took.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio.to_thread
import msgspec

from .. import _wire as wire
from .. import _wire_volumes as vw
from .._aclient import AsyncClient
from .._connection import ApiError, AsyncConnection, DaemonUnavailableError
from .._wire import HttpError
from ..api._backend import Backend
from ..registry import NotFoundError, RefError
from ._cluster import Cluster, ClusterEnv
from ._errors import (
    AgentError,
    ClusterError,
    EnvLostError,
    NodeLostError,
    PlacementError,
    UnknownEnvError,
    VolumeConflictError,
    VolumeNotFoundError,
)
from ._placement import PlacementRequest, place_group, request_for, with_overrides

log = logging.getLogger("weenv.cluster")


@contextlib.contextmanager
def _volume_errors() -> Iterator[None]:
    """A volume no node holds: 404; volumes (or a name) of two nodes: 409."""
    try:
        yield
    except VolumeNotFoundError as e:
        raise HttpError(404, "volume_not_found", str(e)) from None
    except VolumeConflictError as e:
        raise HttpError(409, "volume_conflict", str(e)) from None

__all__ = ["ClusterBackend"]


class ClusterBackend(Backend):
    """See the module docstring."""

    def __init__(self, cluster: Cluster, token: str):
        if not token:
            raise ClusterError("the gateway needs the cluster token (node daemons accept nothing else)")
        self.cluster, self.token = cluster, token
        self._clients: dict[str, tuple[str, AsyncClient]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ nodes

    def node_client(self, name: str) -> AsyncClient:
        """The AsyncClient of node ``name``'s daemon (its TCP API, the cluster token)."""
        try:
            self.cluster.node(name)  # NodeLostError for a lost node
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
            conn = AsyncConnection(url, token=self.token, timeout_s=None, autostart=False)
            conn.mark_started()  # the reports say it answers; a refused connection is a 503
            client = AsyncClient(connection=conn)
            self._clients[name] = (url, client)
        return client

    def node_clients(self) -> list[tuple[str, AsyncClient]]:
        """Every node that is not lost and serves its daemon API, by name."""
        out = []
        for node in self.cluster.all():
            try:
                out.append((node.name, self.node_client(node.name)))
            except HttpError:
                continue
        return out

    def _node_of(self, env_id: str) -> str:
        try:
            return self.cluster.for_env(env_id).name
        except EnvLostError as e:
            raise HttpError(410, "env_lost", str(e)) from None
        except NodeLostError as e:
            raise HttpError(410, "env_lost", f"env {env_id}: {e}") from None
        except UnknownEnvError as e:
            raise HttpError(404, "env_not_found", str(e)) from None

    def for_env(self, env_id: str) -> AsyncClient:
        return self.node_client(self._node_of(env_id))

    def daemons(self) -> list[AsyncClient]:
        return [c for _, c in self.node_clients()]

    async def _refresh(self, node: str) -> None:
        await anyio.to_thread.run_sync(self.cluster.refresh_node, node)

    async def aclose(self) -> None:
        with self._lock:
            clients = [c for _, c in self._clients.values()]
        for client in clients:
            await client.aclose()

    # ------------------------------------------------------------------ lists

    async def _gather(self, what: str) -> list[Any]:
        out: list[Any] = []
        for name, client in self.node_clients():
            try:
                out += await (client.list() if what == "envs" else client.snapshots() if what == "snapshots"
                              else client.volumes())
            except DaemonUnavailableError as e:
                log.warning("node %s: its %s are left out of the list: %s", name, what, e)
        return out

    async def list_envs(self) -> list[wire.EnvInfo]:
        return await self._gather("envs")

    async def list_snapshots(self) -> list[wire.SnapshotInfo]:
        return await self._gather("snapshots")

    # ------------------------------------------------------------------ volumes

    async def _volume_node(self, ref: str) -> str:
        """The node of volume ``ref`` (may ask the nodes): 404 none holds it, 409 a name two nodes have."""
        with _volume_errors():
            return await anyio.to_thread.run_sync(self.cluster.volume_node, ref)

    def _volume_client(self, ref: str, node: str) -> AsyncClient:
        try:
            self.cluster.node(node)
        except NodeLostError as e:
            raise HttpError(503, "node_lost", f"volume {ref!r} is on node {node}, which is lost: {e}") from None
        return self.node_client(node)

    async def for_volume(self, ref: str) -> AsyncClient:
        return self._volume_client(ref, await self._volume_node(ref))

    async def create_volume(self, name: str | None = None, *, size_bytes: int | None = None) -> vw.VolumeInfo:
        try:
            node = await anyio.to_thread.run_sync(self.cluster.node_for_volume, name)
        except VolumeConflictError as e:
            raise HttpError(409, "conflict", str(e)) from None
        except PlacementError as e:
            raise HttpError(503, "not_admitted", str(e)) from None
        info = await self.node_client(node).create_volume(name, size_bytes=size_bytes)
        await anyio.to_thread.run_sync(self.cluster.volume_made, msgspec.to_builtins(info), node)
        return info

    async def delete_volume(self, ref: str) -> None:
        node = await self._volume_node(ref)
        await self._volume_client(ref, node).delete_volume(ref)
        await anyio.to_thread.run_sync(self.cluster.volume_deleted, ref, node)

    async def list_volumes(self) -> list[vw.VolumeInfo]:
        return await self._gather("volumes")

    # ------------------------------------------------------------------ snapshots

    async def for_snapshot(self, snap_id: str) -> AsyncClient:
        home = await anyio.to_thread.run_sync(self.cluster.snapshot_home, snap_id)  # may ask the nodes
        if home is None:
            raise HttpError(404, "snapshot_not_found", f"no node holds snapshot {snap_id!r}")
        return self.node_client(home)

    async def delete_snapshot(self, snap_id: str) -> None:
        """The snapshot's DELETE at its home; once the node's copy is gone, its published copy leaves
        the store too (read before: the home's report names the ref only while it holds it)."""
        cluster = self.cluster
        home = await anyio.to_thread.run_sync(cluster.snapshot_home, snap_id)
        if home is None:
            raise HttpError(404, "snapshot_not_found", f"no node holds snapshot {snap_id!r}")
        ref = await anyio.to_thread.run_sync(cluster.published_ref, snap_id)
        await self.node_client(home).delete_snapshot(snap_id)
        try:
            await anyio.to_thread.run_sync(cluster.snapshot_deleted, snap_id, ref)
        except Exception as e:  # the node's copy is gone; say what stays
            log.warning("snapshot %s: deleted on node %s, but its published copy %s stays: %s", snap_id, home, ref, e)
            raise HttpError(502, "store_error", f"snapshot {snap_id} was deleted on node {home}, but its published "
                            f"copy {ref} could not be removed from the store: {e}") from None
        await self._refresh(home)

    # ------------------------------------------------------------------ env calls that move the room

    async def kill(self, env_id: str) -> wire.EnvStatus:
        node = self._node_of(env_id)
        answer = await self.node_client(node).kill(env_id)
        await self._refresh(node)
        return answer

    async def commit(self, env_id: str, *, ref: str | None = None) -> wire.CommitResponse:
        node = self._node_of(env_id)
        answer = await self.node_client(node).commit(env_id, ref=ref)
        await self._refresh(node)
        return answer

    async def resume(self, env_id: str) -> wire.EnvStatus:
        """Resume the env on its node; a parked (or cold) env its node refuses for room (503
        ``not_admitted``: what it freed when it parked is taken) moves to a node that admits it
        (:meth:`_move`), keeping its id."""
        node = self._node_of(env_id)
        try:
            await self.node_client(node).env(env_id).resume()
        except ApiError as e:
            if e.kind != "not_admitted":
                raise
            return await self._move(env_id, node, e)
        await self._refresh(node)
        return wire.EnvStatus(id=env_id, status="running")

    async def _move(self, env_id: str, source: str, refused: ApiError) -> wire.EnvStatus:
        """Resume paused env ``env_id`` of node ``source`` on another node: a memory commit of its
        parked image (a filesystem commit of a cold env) on ``source``, published to the store,
        pulled by a node placement picks, restored there under the same id (processes, memory and
        files as they were parked; owners, tokens and ports follow the id; its TTL carries over;
        its addresses are the new node's). Only once it runs there is it killed on ``source``;
        any failure before leaves it parked on ``source`` and removes what the move made."""
        cluster, t0 = self.cluster, time.monotonic()
        src = self.node_client(source)
        info = await src.env(env_id).refresh()
        why = f"resume of env {env_id}: node {source} has no room ({refused.detail})"
        if cluster.store is None:
            raise HttpError(503, "not_admitted", f"{why}; the gateway has no --store, so the env cannot move "
                            f"to another node") from None
        if info.status != "paused" or not info.cold:  # a frozen env holds its room: its resume is never refused
            raise refused
        if info.volumes:
            raise HttpError(503, "not_admitted", f"{why}; it mounts volumes {info.volumes} of that node "
                            f"(volumes are node-local), so it cannot move") from None
        snap = (await src.commit(env_id, memory=info.parked)).snapshot
        cluster._note_snapshot(snap, source)
        steps = {"commit": time.monotonic()}
        ref: str | None = None
        try:
            rec = await anyio.to_thread.run_sync(cluster.publish, snap)
            ref = str(rec["ref"])
            steps["publish"] = time.monotonic()
            moved = await self._restore_elsewhere(env_id, source, info, rec, why, steps)
        finally:
            await self._drop_move_snapshot(env_id, source, snap, ref)
        steps["cleanup"] = time.monotonic()
        spent = ", ".join(f"{k} {(t - p) * 1000:.0f}" for (k, t), p in zip(steps.items(), [t0, *steps.values()]))
        log.info("env %s moved from node %s to node %s to resume (%s): %.0f ms (%s)", env_id, source, moved,
                 "memory restored" if info.parked else "booted from its files", (time.monotonic() - t0) * 1000, spent)
        return wire.EnvStatus(id=env_id, status="running")

    async def _restore_elsewhere(self, env_id: str, source: str, info: wire.EnvInfo, rec: dict[str, Any],
                                 why: str, steps: dict[str, float]) -> str:
        """Start env ``env_id`` from published snapshot ``rec`` on the best node but ``source``; then
        end it on ``source``. Returns the node it runs on."""
        cluster = self.cluster
        layers = tuple((x[0], int(x[1])) for x in rec["layers"])
        req = request_for(rec["lock"], snapshot_layers=layers, snapshot=rec["id"], snapshot_home=source,
                          source=f"published snapshot {rec['ref']}")
        nodes = [c.node for c in cluster.rank(req) if c.node != source][:3]
        if not nodes:  # the reports may be older than what freed room since: ask the nodes again
            for name in [n.name for n in cluster.all() if n.name != source]:
                await self._refresh(name)
            nodes = [c.node for c in cluster.rank(req) if c.node != source][:3]
        if not nodes:
            raise HttpError(503, "not_admitted", f"{why}; no other node admits it either")
        tried: list[str] = []
        for name in nodes:
            ticket = cluster.reserve(name, req)
            started: str | None = None
            try:
                try:
                    client = self.node_client(name)
                    pulled = await client.pull_snapshot(str(rec["ref"]))
                    steps[f"pull@{name}"] = time.monotonic()
                except (HttpError, DaemonUnavailableError, ApiError) as e:
                    tried.append(f"{name}: {e}")
                    continue
                try:
                    body = {"snapshot": pulled.id, "env_id": env_id, "restricted": info.restricted}
                    started = (await client.create_from(body)).id
                    steps[f"restore@{name}"] = time.monotonic()
                except (DaemonUnavailableError, ApiError) as e:
                    tried.append(f"{name}: {e}")
                    kind = e.kind if isinstance(e, ApiError) else "unavailable"
                    if kind in ("start_failed", "failed", "unavailable"):  # a record it may have left
                        await self._quietly(f"ending the failed copy of env {env_id} on node {name}",
                                            client.kill(env_id))
                    if kind not in ("not_admitted", "start_failed", "failed", "unavailable"):
                        raise
                    continue
                finally:
                    await self._quietly(f"deleting snapshot {pulled.id} on node {name}", client.delete_snapshot(pulled.id))
            finally:
                cluster.settle(ticket, started)
            await self._hand_over(env_id, source, name, info)
            steps["hand-over"] = time.monotonic()
            return name
        raise HttpError(503, "not_admitted", f"{why}; the other nodes refused it too: {'; '.join(tried)}")

    async def _hand_over(self, env_id: str, source: str, target: str, info: wire.EnvInfo) -> None:
        """The env runs on ``target`` now: end its parked copy on ``source`` and route it to
        ``target``. If ``source`` does not let it go, the new copy goes instead (one env, one node)."""
        client = self.node_client(target)
        try:
            if info.expires_s is not None:  # its TTL runs on where it is
                await client.env(env_id).set_timeout(max(1.0, info.expires_s - time.time()))
            await self.node_client(source).kill(env_id)
        except BaseException as e:
            log.warning("env %s: moving it to node %s failed at the hand-over (%s): it stays parked on node %s",
                        env_id, target, e, source)
            with anyio.CancelScope(shield=True):
                await self._quietly(f"ending the copy of env {env_id} on node {target}", client.kill(env_id))
            raise
        self.cluster.route(env_id, target)
        await self._refresh(source)
        await self._refresh(target)

    async def _drop_move_snapshot(self, env_id: str, source: str, snap: str, ref: str | None) -> None:
        """The move's snapshot goes from ``source`` and the store (a restored env reads its blobs on)."""
        with anyio.CancelScope(shield=True):
            await self._quietly(f"deleting snapshot {snap} of env {env_id} on node {source}",
                                self.node_client(source).delete_snapshot(snap))
            await anyio.to_thread.run_sync(self.cluster.snapshot_deleted, snap, ref)

    @staticmethod
    async def _quietly(what: str, call: Any) -> None:
        try:
            await call
        except Exception as e:  # cleanup: logged, never in the way of the answer
            log.warning("%s: %s", what, e)

    async def fork(self, env_id: str, n: int, *, memory: bool = False) -> wire.ForkResponse:
        """The env's node forks it when it admits every child; when it refuses for its room (503
        ``not_admitted``), :meth:`Cluster.fork_group` places the children: those the node admits
        there, the rest on other nodes from the snapshot published to the store. A fork with
        ``memory`` stays on the env's node (its refusal is the answer)."""
        node = self._node_of(env_id)
        try:
            answer = await self.node_client(node).fork(env_id, n, memory=memory)
        except ApiError as e:
            if e.kind != "not_admitted" or memory:
                raise
            return await self._spread_fork(env_id, node, n, e)
        await self._refresh(node)
        return answer

    async def _spread_fork(self, env_id: str, node: str, n: int, refused: ApiError) -> wire.ForkResponse:
        cluster = self.cluster
        env = ClusterEnv(cluster, {"id": env_id}, node)
        try:
            snap, children = await anyio.to_thread.run_sync(cluster.fork_group, env, n)
        except PlacementError as e:
            why = "" if cluster.store is not None else \
                " (the gateway has no --store: the children cannot start off the env's node)"
            log.info("fork of %s x%d: %s%s", env_id, n, e, why)
            raise HttpError(503, "not_admitted", f"fork of {n} from env {env_id}: node {node} refused "
                            f"({refused.detail}); over the cluster: {e}{why}") from None
        except AgentError as e:
            raise HttpError(e.status, e.kind, f"fork of {n} from env {env_id}: node {e.node}: {e.message}") from None
        except (NodeLostError, EnvLostError) as e:
            raise HttpError(503, "node_lost", f"fork of {n} from env {env_id}: {e}") from None
        except ClusterError as e:
            raise HttpError(400, "bad_request", f"fork of {n} from env {env_id}: {e}") from None
        log.info("fork of %s x%d spread: %s", env_id, n, ", ".join(f"{c.id}@{c.node}" for c in children))
        return wire.ForkResponse(snapshot=snap, envs=[msgspec.convert(c.info, wire.EnvInfo) for c in children])

    # ------------------------------------------------------------------ creates

    async def create(self, body: dict[str, Any]) -> wire.EnvInfo:
        if isinstance(body.get("image"), str) and self.cluster.store is not None:
            body = await anyio.to_thread.run_sync(self.body_for_image, body)
        try:
            nodes, req, ticket = await self.placed(body)
        except PlacementError as e:
            raise HttpError(503, "not_admitted", str(e)) from None
        cluster = self.cluster
        refused: ApiError | None = None
        for k, name in enumerate(nodes):
            if k > 0:
                ticket = cluster.reserve(name, req)  # counted by concurrent creates until its node reports it
            info: wire.EnvInfo | None = None
            try:
                try:
                    client = self.node_client(name)
                except HttpError:
                    continue
                moved = await anyio.to_thread.run_sync(self.body_for, body, name) \
                    if isinstance(body.get("snapshot"), str) else None
                try:
                    info = await client.create_from(body if moved is None else moved)
                except DaemonUnavailableError as e:
                    log.warning("node %s: its daemon API does not answer: %s", name, e)
                    continue
                except ApiError as e:
                    if e.kind != "not_admitted":
                        raise
                    refused = e
                    continue
            finally:
                cluster.settle(ticket, info.id if info is not None else None)
            cluster.route(info.id, name)  # routed at once; the next placement sees it
            await self._refresh(name)
            return info
        if refused is not None:
            raise refused
        raise HttpError(503, "not_admitted", f"no node of the cluster answered (tried {nodes})")

    def body_for_image(self, body: dict[str, Any]) -> dict[str, Any]:
        """A create of an image as a create of its lock: converted once, into the cluster's store,
        so placement sees its layers and every node reads the same groups."""
        from ..plan import PlanError, plan_to_builtins
        from ..registry import RegistryError

        try:
            lock = self.cluster.lock_for_image(body["image"])
        except RegistryError as e:
            raise HttpError(502, "registry", f"request body $.image: {e}") from None
        except PlanError as e:  # the image config holds what a plan refuses
            raise HttpError(400, "bad_plan", f"request body $.image: {e}") from None
        return {**{k: v for k, v in body.items() if k != "image"}, "plan": plan_to_builtins(lock)}

    def request_for_body(self, body: dict[str, Any]) -> PlacementRequest:
        """What placement needs of a create body: the lock's (or snapshot's) layers and minimums, with
        the body's ``cpu`` / ``memory`` overrides (they are what the node admits). A snapshot no node
        holds, one its home's daemon no longer has (deleted since the home's last report), or a ref
        the store does not have, is an HttpError 404 ``snapshot_not_found`` naming it."""
        from ..api._tenant import plan_of
        from ..plan import DEFAULT_CPU_MIN_CORES, DEFAULT_MEMORY_MAX_BYTES, DEFAULT_MEMORY_MIN_BYTES, Lock, PlanError

        snapshot = body.get("snapshot")
        # read by the plan codec, as the daemon will read it: TOML or JSON, sizes as bytes or "256MiB";
        # one it refuses is an HttpError 400 bad_plan naming the place
        plan = plan_of(body) if snapshot is None else None
        if snapshot is None and not isinstance(plan, Lock):
            # a plan (not a lock): its tags resolve on the node; place by its minimums and load only
            req = request_for(plan) if plan is not None else PlacementRequest(
                cpu_min_cores=DEFAULT_CPU_MIN_CORES, memory_min_bytes=DEFAULT_MEMORY_MIN_BYTES,
                memory_max_bytes=DEFAULT_MEMORY_MAX_BYTES)
        else:
            try:
                req = self.cluster.placement_request(plan, snapshot)[0]
            except AgentError as e:  # its home's report still lists it; the home's daemon answered
                raise HttpError(e.status, e.kind, f"snapshot {snapshot!r} on node {e.node}: {e.message}") from None
            except PlacementError as e:
                if snapshot is None:
                    raise
                raise HttpError(404, "snapshot_not_found", str(e)) from None
            except NotFoundError as e:  # a ref the cluster's store does not have
                raise HttpError(404, "snapshot_not_found", f"published snapshot {snapshot!r}: {e}") from None
            except PlanError as e:  # the lock a snapshot starts from, as its home or the store holds it
                raise HttpError(400, "bad_plan", str(e)) from None
            except (ClusterError, RefError) as e:  # not a snapshot ref, or not a weenv snapshot's manifest
                raise HttpError(400, "bad_request", f"snapshot {snapshot!r}: {e}") from None
        overrides = body.get("overrides")
        try:
            req = with_overrides(req, overrides if isinstance(overrides, dict) else None)
        except ValueError as e:
            raise HttpError(400, "bad_request", f"request body $.{e}") from None
        if not req.volumes:
            return req
        with _volume_errors():  # volumes are node-local: the env starts on their node only
            return self.cluster.pin_volumes(req)

    def body_for(self, body: dict[str, Any], node: str) -> dict[str, Any] | None:
        """The create body ``node`` gets when it is not the client's: a published snapshot placed off
        its home, or named by its ref (a daemon starts only from its own snapshot ids), starts from
        its published lock, its layers through the store, as :meth:`Cluster.create` starts it.
        None: the client's body as it came."""
        snapshot = body.get("snapshot")
        if not isinstance(snapshot, str):
            return None
        rec = self.cluster.published_record(snapshot)  # held since request_for_body read it
        if rec is None or ("/" not in snapshot and rec.get("home") == node):
            return None
        moved = {k: v for k, v in body.items() if k != "snapshot"}
        moved["plan"] = rec["lock"]
        return moved

    async def placed(self, body: dict[str, Any]) -> tuple[list[str], PlacementRequest, int]:
        """The nodes to try for a create body, best first, its placement request, and the ticket
        reserving the first node (:meth:`Cluster.place`; settle it). PlacementError: none admits;
        HttpError 404: a snapshot no node holds."""
        req = await anyio.to_thread.run_sync(self.request_for_body, body)  # a snapshot's detail: an agent call
        if log.isEnabledFor(logging.INFO):  # what the decision sees (concurrent creates may slip in between)
            log.info("create: best nodes %s", ", ".join(f"{c.node} (cached {c.cached_bytes >> 20} MiB, load "
                                                        f"{c.load:.3f}, {c.envs} envs)" for c in self.cluster.rank(req, limit=3)))
        nodes, ticket = self.cluster.place(req, limit=3)
        if ticket is None:
            await anyio.to_thread.run_sync(lambda: place_group(self.cluster.current_view(), req, 1))
            raise PlacementError("no node admits the env")  # place_group raised already, unless the view moved
        return nodes, req, ticket
