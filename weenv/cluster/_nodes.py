"""A node of the cluster as the cluster client holds it: its daemon API through its agent (Ray
actor calls, :class:`NodeClient`), the reconciler's handle on the agent, and an env on a node
(:class:`ClusterEnv`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from ._errors import (
    AgentError,
    EnvLostError,
    NodeLostError,
)
from ._reconcile import AgentHandle, PendingCall
from ._report import NodeReport

if TYPE_CHECKING:
    from ._cluster import Cluster

log = logging.getLogger("weenv.cluster")




# ================================================================================ node clients


class NodeClient:
    """One node's daemon API, through its agent (Ray actor calls)."""

    def __init__(self, name: str, actor: Any, token: str | None, *, timeout_s: float = 300.0):
        self.name, self.actor, self._token, self.timeout_s = name, actor, token, timeout_s

    def __repr__(self) -> str:
        return f"NodeClient({self.name!r})"

    def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout_s or self.timeout_s)
        except ray.exceptions.RayActorError as e:
            raise NodeLostError(f"node {self.name}: its agent is gone ({type(e).__name__})") from None
        except ray.exceptions.GetTimeoutError:
            raise NodeLostError(f"node {self.name}: its agent did not answer within "
                                f"{timeout_s or self.timeout_s:g} s") from None
        except ray.exceptions.RayTaskError as e:  # the agent raised: re-raise its own error
            cause = e.as_instanceof_cause()
            raise cause from None

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
                params: dict[str, str] | None = None, timeout_s: float | None = None) -> tuple[int, str, bytes]:
        """Any ``/v1`` call on the node's daemon: ``(status, content type, body)``."""
        ref = self.actor.request.remote(self._token, method, path, json_body=json, content=content, params=params,
                                        timeout_s=timeout_s)
        return self._get(ref, (timeout_s or self.timeout_s) + 10)  # type: ignore[no-any-return]

    def call(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
             params: dict[str, str] | None = None, timeout_s: float | None = None) -> Any:
        """:meth:`request` with the answer decoded; AgentError for an error answer."""
        status, ctype, body = self.request(method, path, json=json, content=content, params=params,
                                           timeout_s=timeout_s)
        if status >= 400:
            try:
                err = msgspec.json.decode(body)["error"]
                kind, message = err.get("kind", "error"), err.get("message", "")
            except (msgspec.DecodeError, KeyError, TypeError):
                kind, message = "error", body.decode(errors="replace")[:500]
            raise AgentError(self.name, status, kind, message)
        if ctype.startswith("application/json") and body:
            return msgspec.json.decode(body)
        return body

    def report(self, timeout_s: float = 10.0) -> NodeReport:
        return self._get(self.actor.report.remote(self._token), timeout_s)  # type: ignore[no-any-return]

    def hello(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return self._get(self.actor.hello.remote(), timeout_s)  # type: ignore[no-any-return]

    def publish_snapshot(self, snapshot_id: str, repo: str) -> dict[str, Any]:
        return self._get(self.actor.publish_snapshot.remote(self._token, snapshot_id, repo))  # type: ignore[no-any-return]

    def stop(self, *, stop_daemon: bool = False, kill_envs: bool = False, timeout_s: float = 60.0,
             reason: str = "") -> dict[str, Any]:
        """Take the node down (:meth:`NodeAgent.stop`): with ``stop_daemon`` its daemon too, with
        ``kill_envs`` its envs first. The agent may start the daemon to kill envs a stopped one left,
        then waits for it to exit: up to twice ``timeout_s``."""
        ref = self.actor.stop.remote(self._token, stop_daemon=stop_daemon, kill_envs=kill_envs, timeout_s=timeout_s,
                                     reason=reason)
        return self._get(ref, 2 * timeout_s + 30)  # type: ignore[no-any-return]


# ================================================================================ reconciler glue


class _RayPending(PendingCall):
    def __init__(self, ref: Any):
        self.ref = ref

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def result(self) -> NodeReport:
        import ray

        return ray.get(self.ref, timeout=0)  # type: ignore[no-any-return]


class _RayAgent(AgentHandle):
    def __init__(self, client: NodeClient):
        self.name = client.name
        self.client = client

    def start_report(self) -> PendingCall:
        return _RayPending(self.client.actor.report.remote(self.client._token))


# ================================================================================ envs


class ClusterEnv:
    """An env somewhere in the cluster: every call goes to its node (an EnvLostError once it is lost)."""

    def __init__(self, cluster: "Cluster", info: dict[str, Any], node: str):
        self.cluster, self.info, self.node = cluster, info, node
        self.id: str = info["id"]

    def __repr__(self) -> str:
        return f"ClusterEnv({self.id!r}, node={self.node!r})"

    def _node(self) -> NodeClient:
        return self.cluster.for_env(self.id)

    def exec(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | str | None = None, timeout_s: float | None = None) -> Any:
        from .._calls import ExecResult, exec_body

        body = exec_body(cmd, env, cwd, user, stdin, timeout_s, False)
        out = self._call("POST", f"/v1/envs/{self.id}/exec", json=body,
                         timeout_s=(timeout_s or 300.0) + 30)
        return msgspec.convert(out, ExecResult)

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return self._node().call(method, path, **kw)
        except NodeLostError:
            lost = self.cluster.lost_env(self.id)
            if lost is not None:
                raise lost from None
            raise

    def read_file(self, path: str) -> bytes:
        return self._call("GET", f"/v1/envs/{self.id}/files", params={"op": "read", "path": path})  # type: ignore[no-any-return]

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        self._call("PUT", f"/v1/envs/{self.id}/files", content=data.encode() if isinstance(data, str) else data,
                   params={"path": path, "mode": oct(mode)[2:]})

    def refresh(self) -> dict[str, Any]:
        self.info = self._call("GET", f"/v1/envs/{self.id}")
        return self.info

    def commit(self, *, publish: bool = False) -> str:
        """Seal the env into a snapshot on its node; with ``publish``, also push it to the cluster's
        store (then any node can start from it). Returns the snapshot id (published: its ref)."""
        snap = self._call("POST", f"/v1/envs/{self.id}/commit", json={})["snapshot"]
        self.cluster._note_snapshot(snap, self.node)
        if publish:
            return self.cluster.publish(snap)["ref"]  # type: ignore[no-any-return]
        return snap  # type: ignore[no-any-return]

    def fork(self, n: int) -> list["ClusterEnv"]:
        """``n`` children of this env's current state: on its node while it admits them, the rest spread
        over other nodes through the cluster's store (when the cluster has one)."""
        return self.cluster.fork(self, n)

    def kill(self) -> None:
        try:
            self._call("DELETE", f"/v1/envs/{self.id}", json={})
            self.cluster._refresh_one(self.node)  # its room is free for the next placement
        finally:
            self.cluster._forget(self.id)

    def __enter__(self) -> "ClusterEnv":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        except (EnvLostError, AgentError):
            pass


# ================================================================================ the cluster
