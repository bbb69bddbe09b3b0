"""An asyncio face of a :class:`~weenv.cluster.Cluster`, shaped like :class:`weenv.AsyncClient`.

slime's rollout code (slime_plugin) holds one client per event loop and calls ``create``, then the
env's ``exec`` / ``read_file`` / ``write_file`` / ``commit`` / ``fork`` / ``kill``. This adapter
offers the same calls over the cluster: Ray actor calls block, so each runs in a worker thread
(``asyncio.to_thread``), and cluster errors become the client's own (:class:`weenv.ApiError`
with the daemon's status and kind; a lost env is a 410 ``env_lost``), so callers that handle a
single node's errors handle the cluster's too.

With a cluster store, ``commit`` publishes the snapshot, so the envs of one group (slime's
fork-per-group) start from it on whichever nodes placement picks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

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

T = TypeVar("T")


@contextlib.contextmanager
def _as_client_errors() -> Iterator[None]:
    import weenv

    try:
        yield
    except EnvLostError as e:
        raise weenv.ApiError(410, "env_lost", str(e)) from e
    except AgentError as e:
        cls = weenv.EnvNotFoundError if e.kind == "env_not_found" else weenv.ApiError
        raise cls(e.status, e.kind, e.message) from e
    except VolumeConflictError as e:  # volumes of two nodes (volumes are node-local), a name taken
        raise weenv.ApiError(409, "volume_conflict", str(e)) from e
    except VolumeNotFoundError as e:
        raise weenv.ApiError(404, "volume_not_found", str(e)) from e
    except PlacementError as e:
        raise weenv.ApiError(503, "not_admitted", str(e)) from e
    except UnknownEnvError as e:
        raise weenv.EnvNotFoundError(404, "env_not_found", str(e)) from e
    except (NodeLostError, ClusterError) as e:
        raise weenv.WeenvError(str(e)) from e


async def _run(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    with _as_client_errors():
        return await asyncio.to_thread(fn, *args, **kw)


class AsyncClusterEnv:
    def __init__(self, client: "AsyncClusterClient", env: ClusterEnv):
        self.client, self._env = client, env
        self.id = env.id
        self.node = env.node
        self.info = env.info

    def __repr__(self) -> str:
        return f"AsyncClusterEnv({self.id!r}, node={self.node!r})"

    async def exec(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                   user: str | None = None, stdin: bytes | str | None = None, timeout_s: float | None = None) -> Any:
        return await _run(self._env.exec, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s)

    async def read_file(self, path: str, *, user: str | None = None) -> bytes:
        return await _run(self._env.read_file, path)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, user: str | None = None) -> None:
        await _run(self._env.write_file, path, data, mode=mode)

    async def commit(self) -> str:
        """A snapshot id; published to the cluster's store when it has one (any node starts from it)."""
        snap = await _run(self._env.commit)
        if self.client.cluster.store is not None:
            await _run(self.client.cluster.publish, snap)
        return snap

    async def fork(self, n: int) -> list["AsyncClusterEnv"]:
        children = await _run(self._env.fork, n)
        return [AsyncClusterEnv(self.client, c) for c in children]

    async def kill(self) -> None:
        await _run(self._env.kill)


class AsyncClusterClient:
    """``create`` places the env (plan lock, lock file, or snapshot id / published ref)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    async def create(self, plan_or_snapshot: Any, *, name: str | None = None, ttl_s: float | None = None,
                     cpu: str | float | None = None, memory: str | int | None = None,
                     env: dict[str, str] | None = None, workdir: str | None = None,
                     user: str | None = None, volumes: list[dict[str, Any]] | None = None) -> AsyncClusterEnv:
        """``volumes``: ``[[volumes]]`` tables mounted beside the plan's (the env starts on their node)."""
        overrides = {k: v for k, v in dict(name=name, ttl_s=ttl_s, cpu=None if cpu is None else str(cpu),
                                           memory=None if memory is None else str(memory), env=env,
                                           workdir=workdir, user=user, volumes=volumes).items() if v is not None}
        src = str(plan_or_snapshot) if not isinstance(plan_or_snapshot, dict) else None
        if src is not None and (src.startswith("snap-") or (":snap-" in src and "/" in src)):
            made = await _run(self.cluster.create, snapshot=src, overrides=overrides or None)
        else:
            made = await _run(self.cluster.create, plan_or_snapshot, overrides=overrides or None)
        return AsyncClusterEnv(self, made)

    async def delete_snapshot(self, snapshot: str) -> None:
        await _run(self.cluster.delete_snapshot, snapshot)

    # volumes: node-local; each call goes to the volume's node (weenv/cluster/_volumes.py)

    async def create_volume(self, name: str | None = None, *, size_bytes: int | None = None,
                            node: str | None = None) -> dict[str, Any]:
        return await _run(self.cluster.create_volume, name, size_bytes=size_bytes, node=node)

    async def volumes(self) -> list[dict[str, Any]]:
        return await _run(self.cluster.volumes)

    async def volume(self, ref: str) -> dict[str, Any]:
        return await _run(self.cluster.volume, ref)

    async def delete_volume(self, ref: str) -> None:
        await _run(self.cluster.delete_volume, ref)

    async def read_volume_file(self, ref: str, path: str) -> bytes:
        return await _run(self.cluster.read_volume_file, ref, path)

    async def write_volume_file(self, ref: str, path: str, data: bytes | str, *, mode: int | None = None) -> Any:
        return await _run(self.cluster.write_volume_file, ref, path, data, mode=mode)

    async def aclose(self) -> None:
        pass  # the cluster is the caller's (it outlives one event loop's client)
