"""The nodes behind the API, in the API's own terms: the one seam between weenv/api and the nodes.

A :class:`Backend` answers for env ids, create bodies, snapshot and volume ids: which daemon holds
an env (:meth:`~Backend.for_env`), where a create starts (:meth:`~Backend.create`), a fork that may
spread, a snapshot's home, a volume's node (:meth:`~Backend.for_volume`), every daemon (lists and metrics gather from them). On one node every answer is
the node's own daemon, reached through its Unix socket (:class:`NodeBackend`); the cluster gateway
runs the same app over a :class:`weenv.cluster.ClusterBackend`. Nothing else in weenv/api knows
how many nodes there are, and no route builds a URL for another: they call the daemons through
the typed client (weenv/_aclient.py).
"""

from __future__ import annotations

import abc

from .. import _home
from .. import _wire as wire
from .. import _wire_volumes as vw
from .._aclient import AsyncClient
from .._wire import HttpError

__all__ = ["Backend", "NodeBackend"]


class Backend(abc.ABC):
    """What the API asks of the nodes. Errors: an env, snapshot or node that is not there is an
    :class:`~weenv._wire.HttpError` (404, 410, 503); what a daemon answers is the client's
    :class:`weenv.ApiError`."""

    @abc.abstractmethod
    def for_env(self, env_id: str) -> AsyncClient:
        """The daemon that runs ``env_id``."""

    @abc.abstractmethod
    def daemons(self) -> list[AsyncClient]:
        """Every daemon that answers (lists and metrics gather from them)."""

    @abc.abstractmethod
    async def create(self, body: dict) -> wire.EnvInfo:  # type: ignore[type-arg]
        """Start an env from a ``POST /v1/envs`` body (:class:`weenv._wire.CreateRequest`), where it fits."""

    @abc.abstractmethod
    async def for_snapshot(self, snap_id: str) -> AsyncClient:
        """The daemon that holds snapshot ``snap_id`` (its home)."""

    def any(self) -> AsyncClient:
        """A daemon for node-wide calls (ping, gc, top): the node's own; the cluster's first."""
        daemons = self.daemons()
        if not daemons:
            raise HttpError(503, "daemon_unavailable", "no daemon answers")
        return daemons[0]

    async def fork(self, env_id: str, n: int, *, memory: bool = False) -> wire.ForkResponse:
        """``n`` children of env ``env_id`` at the state it has now (all or none); ``memory``: with
        its running processes (409 ``memory_unavailable`` where the runtime cannot checkpoint)."""
        return await self.for_env(env_id).fork(env_id, n, memory=memory)

    async def commit(self, env_id: str, *, ref: str | None = None) -> wire.CommitResponse:
        return await self.for_env(env_id).commit(env_id, ref=ref)

    async def kill(self, env_id: str) -> wire.EnvStatus:
        return await self.for_env(env_id).kill(env_id)

    async def resume(self, env_id: str) -> wire.EnvStatus:
        """Resume paused env ``env_id`` where it is (the cluster may move a parked env that its node
        has no room for to a node that has: :meth:`weenv.cluster.ClusterBackend.resume`)."""
        await self.for_env(env_id).env(env_id).resume()
        return wire.EnvStatus(id=env_id, status="running")

    async def delete_snapshot(self, snap_id: str) -> None:
        await (await self.for_snapshot(snap_id)).delete_snapshot(snap_id)

    async def for_volume(self, ref: str) -> AsyncClient:
        """The daemon that holds volume ``ref`` (id or name; volumes are node-local)."""
        return self.any()

    async def create_volume(self, name: str | None = None, *, size_bytes: int | None = None) -> vw.VolumeInfo:
        """A new volume, on the node that takes it (one node: its own)."""
        return await self.any().create_volume(name, size_bytes=size_bytes)

    async def delete_volume(self, ref: str) -> None:
        await (await self.for_volume(ref)).delete_volume(ref)

    async def list_volumes(self) -> list[vw.VolumeInfo]:
        return [v for d in self.daemons() for v in await d.volumes()]

    async def list_envs(self) -> list[wire.EnvInfo]:
        return [e for d in self.daemons() for e in await d.list()]

    async def list_snapshots(self) -> list[wire.SnapshotInfo]:
        return [s for d in self.daemons() for s in await d.snapshots()]

    async def aclose(self) -> None:
        for client in self.daemons():
            await client.aclose()


class NodeBackend(Backend):
    """The node's own daemon, through its Unix socket (``client``: that client instead, a fake
    daemon's in unit tests)."""

    def __init__(self, socket_path: str | None = None, *, client: AsyncClient | None = None):
        # no client-side timeout: an exec answers when its command ends, and the daemon bounds it
        self.client = client or AsyncClient(socket_path or _home.daemon_socket(), timeout_s=None, autostart=False)

    def for_env(self, env_id: str) -> AsyncClient:
        return self.client

    def daemons(self) -> list[AsyncClient]:
        return [self.client]

    async def create(self, body: dict) -> wire.EnvInfo:  # type: ignore[type-arg]
        return await self.client.create_from(body)

    async def for_snapshot(self, snap_id: str) -> AsyncClient:
        return self.client
