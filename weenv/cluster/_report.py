"""What a node agent reports every few seconds, and how it is read out of the daemon's answers.

Everything here is data and pure functions: the agent fills a :class:`NodeReport` from its
daemon's ``/v1/top``, ``/v1/envs``, ``/v1/snapshots`` and ``/v1/volumes`` answers, its envlet's layer list and the
layer trees on disk; placement (:mod:`weenv.cluster._placement`) and routing read it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ._errors import ClusterError

LayerWhere = Literal["envlet", "tree", "snapshot", "seen"]


class LayerHeld(msgspec.Struct, frozen=True, kw_only=True):
    """A layer whose bytes this node has: registered in its envlet (its chunks cached as read),
    kept as a local tree, sealed here as a snapshot layer, or seen here earlier ("seen": started
    envs used it; its chunks stay in the node's disk cache until evicted)."""

    digest: str
    size_bytes: int
    where: LayerWhere


class SnapshotHeld(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    layers: list[tuple[str, int]] = []  # (digest, size) bottom first
    ref: str | None = None  # published to the cluster's store: any node can start from it
    plan: str | None = None


class VolumeHeld(msgspec.Struct, frozen=True, kw_only=True):
    """A volume of this node (``GET /v1/volumes``): volumes are node-local, so an env that mounts it
    starts only here (placement pins it), and its calls are routed here."""

    id: str
    name: str = ""


class EnvHeld(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    status: str
    snapshot: str | None = None


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """Guaranteed (sum of env mins) against what admission lets the node guarantee, and what is free."""

    cpu_cores: float  # admission's CPU bound: cores x cpu_min_overcommit
    cpu_committed_cores: float = 0.0  # sum of the envs' cpu mins
    cpu_used_cores: float = 0.0
    memory_total_bytes: int
    memory_guaranteed_bytes: int  # RAM minus the node reserve: the bound of the sum of mins, and of one max
    memory_committed_bytes: int = 0  # sum of the envs' memory mins
    memory_headroom_bytes: int  # what a new env's min must fit in now
    memory_available_bytes: int = 0
    envs: int = 0
    admitted: int = 0  # admission counters of the daemon since it started
    refused: int = 0


class NodeReport(msgspec.Struct, frozen=True, kw_only=True):
    node: str  # the node's short name: env ids start with "<node>-"
    ray_node_id: str = ""
    seq: int = 0
    taken_s: float = 0.0  # wall clock on the node
    healthy: bool = True
    accepting: bool = True  # admission state: False while the daemon or envlet is down, or draining
    problem: str = ""
    home: str = ""
    daemon_address: str = ""  # unix:///…/weenv.sock, or the TCP API when the node serves one
    daemon_pid: int = 0
    node_api: str = ""  # http://ip:port: the daemon on the cluster network (cluster token required), or ""
    store_bytes_fetched: int = 0  # bytes its envlet read from stores (registries) since it started
    peer_address: str = ""  # HOST:PORT its envlet serves cached chunks to peers on (the peer tier), or ""
    down: str = ""  # why the node was taken down (weenv cluster stop-node): its last report; it is lost
    capacity: Capacity
    layers: list[LayerHeld] = []
    snapshots: list[SnapshotHeld] = []
    envs: list[EnvHeld] = []
    volumes: list[VolumeHeld] = []


def peer_tables(reports: "list[NodeReport]", usable: "set[str] | None" = None) -> dict[str, dict[str, list[str]]]:
    """For every node with a peer address: its envlet's peer table {other node's peer address: the
    layer digests that node reports}, over the nodes in ``usable`` (None: all) whose report is
    healthy and names a peer address. A node never lists itself; a lost, unhealthy or drained node
    (left out of ``usable``) is in nobody's table."""
    holders = {r.node: r for r in reports if r.peer_address and r.healthy and (usable is None or r.node in usable)}
    return {r.node: {o.peer_address: sorted({x.digest for x in o.layers})
                     for o in holders.values() if o.node != r.node and o.peer_address != r.peer_address}
            for r in reports if r.peer_address}


def capacity_from_top(top: dict[str, Any], *, envs: int | None = None, live: set[str] | None = None) -> Capacity:
    """The node's capacity from its daemon's ``GET /v1/top`` answer (mirrors the daemon's admission:
    weenv/provision/elastic/_policy.py ``admit``). ``live``: the ids ``GET /v1/envs`` lists; the monitor
    drops a killed env at its next tick, so only those count."""
    try:
        node = top["node"]
        policy = top["policy"]
        reserve = int(policy["node_memory_reserve_bytes"])
        overcommit = float(policy.get("cpu_min_overcommit", 1.0))
        if node is None:
            raise ClusterError("/v1/top: the monitor has not read the node yet (node is null)")
        cpu_committed = 0.0
        mem_committed = 0
        used = 0.0
        for env_id, info in top.get("envs", {}).items():
            if live is not None and env_id not in live:
                continue
            cpu_committed += float(info["cpu"]["min_cores"] or 0.0)
            mem_committed += int(info["memory"]["min_bytes"] or 0)
            used += float(info["cpu"]["used_cores"] or 0.0)
        total = int(node["memory_total_bytes"])
        admission = top.get("admission", {})
        return Capacity(
            cpu_cores=float(node["cpu_cores"]) * overcommit, cpu_committed_cores=cpu_committed, cpu_used_cores=used,
            memory_total_bytes=total, memory_guaranteed_bytes=total - reserve, memory_committed_bytes=mem_committed,
            memory_headroom_bytes=int(node["memory_headroom_bytes"]),
            memory_available_bytes=int(node["memory_available_bytes"]),
            envs=len(top.get("envs", {})) if envs is None else envs,
            admitted=int(admission.get("admitted", 0)), refused=int(admission.get("refused", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ClusterError(f"/v1/top answer lacks {e} (not a weenv daemon of this version?)") from None


def snapshots_from(answer: list[dict[str, Any]]) -> list[SnapshotHeld]:
    """``GET /v1/snapshots`` as held snapshots (layers as (digest, size))."""
    return [SnapshotHeld(id=s["id"], layers=[(x["digest"], int(x["size"])) for x in s.get("layers", [])],
                         ref=s.get("ref"), plan=s.get("plan")) for s in answer]


def volumes_from(answer: list[dict[str, Any]]) -> list[VolumeHeld]:
    """``GET /v1/volumes`` as held volumes (id and name on the node)."""
    return [VolumeHeld(id=v["id"], name=str(v.get("name") or v["id"])) for v in answer]


def envs_from(answer: list[dict[str, Any]]) -> list[EnvHeld]:
    return [EnvHeld(id=e["id"], status=e["status"], snapshot=e.get("snapshot")) for e in answer]


def node_of(env_id: str) -> str | None:
    """The node name an id starts with (``<node>-<plan>-<hex>``), or None when it cannot name one.
    Only a hint: routing trusts the reports, and an id's head is looked up among known nodes."""
    head, sep, rest = env_id.partition("-")
    if not sep or not rest or not 1 <= len(head) <= 12 or not (head.isascii() and head.isalnum() and head.islower()
                                                                 or head.isdigit()):
        return None
    return head
