"""Which daemon serves an env: the one seam between the API and the nodes.

On one node every env is on the node's own daemon, reached through its Unix socket
(:class:`NodeBackend`). The cluster gateway will run the same app with a backend that picks a
node's client from its routing table; nothing else in weenv/api knows how many nodes there are.
"""

from __future__ import annotations

import abc
from typing import Any

from .. import _home
from .._client import AsyncClient

__all__ = ["Backend", "NodeBackend"]


class Backend(abc.ABC):
    """Hands out the :class:`weenv.AsyncClient` of the daemon that holds (or will hold) an env."""

    @abc.abstractmethod
    def for_env(self, env_id: str) -> AsyncClient:
        """The daemon that runs ``env_id`` (and its snapshots' commits and forks)."""

    @abc.abstractmethod
    def for_create(self, request: dict[str, Any]) -> AsyncClient:
        """The daemon a new env from ``request`` (a ``POST /v1/envs`` body) should start on."""

    @abc.abstractmethod
    def all(self) -> list[AsyncClient]:
        """Every daemon (lists, snapshots, metrics gather from all of them)."""

    async def aclose(self) -> None:
        for client in self.all():
            await client.aclose()


class NodeBackend(Backend):
    """The node's own daemon, through its Unix socket."""

    def __init__(self, socket_path: str | None = None):
        # no client-side timeout: an exec answers when its command ends, and the daemon bounds it
        self.client = AsyncClient(socket_path or _home.daemon_socket(), timeout_s=None,  # type: ignore[arg-type]
                                  autostart=False)

    def for_env(self, env_id: str) -> AsyncClient:
        return self.client

    def for_create(self, request: dict[str, Any]) -> AsyncClient:
        return self.client

    def all(self) -> list[AsyncClient]:
        return [self.client]
