"""The cluster's volumes: node-local storage (an ext4 image per volume on one node,
weenv/provision/envs/_volumes.py), so each volume has a node, its home, as a node-local snapshot has.

- Where a volume is: the node reports (``NodeReport.volumes``: ids and names), else what this client
  made or found, else every HEALTHY node is asked (``GET /v1/volumes/{ref}``, 5 s bound each): a
  volume made on a node's own API, or by another client, since its node last reported.
- A create that mounts volumes (the plan's ``[[volumes]]``, ``overrides.volumes``) is pinned to
  their node (:func:`~weenv.cluster._placement.volume_home`); volumes of two nodes are a
  :class:`VolumeConflictError` (the gateway's 409), one no node holds a :class:`VolumeNotFoundError`.
- A new volume goes to the node :func:`~weenv.cluster._placement.place_volume` picks (or the one
  named); its name must be new to the whole cluster, so that a plan naming it names one node.

A part of :class:`~weenv.cluster.Cluster` (it uses the cluster's nodes, reports and lock).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import msgspec

from ._errors import AgentError, NodeLostError, PlacementError, VolumeConflictError
from ._placement import PlacementRequest, place_volume, volume_home
from ._reconcile import NodeState

log = logging.getLogger("weenv.cluster")
_VOLUME_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")  # what a daemon takes as a volume id or name
_VOLUME_ID = re.compile(r"vol-[0-9a-f]{12}")
_ASK_VOLUME_S = 5.0


class Volumes:
    """The volume half of :class:`~weenv.cluster.Cluster` (its ``_volume_home`` is the cluster's)."""

    _volume_home: dict[str, str]

    # ------------------------------------------------------------------ where

    def volume_where(self, refs: Iterable[str], *, ask: bool = True, noted: bool = True) -> dict[str, list[str]]:
        """Each volume ref (id or name) -> the nodes holding it: from the reports (lost nodes' too:
        their volumes are there, unreachable), else (``noted``) this client's own notes, else
        (``ask``) every HEALTHY node is asked."""
        with self._lock:  # type: ignore[attr-defined]
            entries = [(e.name, e.state, e.report) for e in self.reconciler.nodes.values()]  # type: ignore[attr-defined]
            notes = dict(self._volume_home) if noted else {}
        out: dict[str, list[str]] = {}
        for ref in dict.fromkeys(refs):
            by_id = sorted({n for n, _, r in entries if r is not None and any(v.id == ref for v in r.volumes)})
            by_name = sorted({n for n, _, r in entries if r is not None and any(v.name == ref for v in r.volumes)})
            out[ref] = by_id or by_name or ([notes[ref]] if ref in notes else [])
        if ask:
            for ref in [r for r, nodes in out.items() if not nodes and _VOLUME_REF.fullmatch(r)]:
                out[ref] = self._ask_volume(ref, [n for n, state, _ in entries if state is NodeState.HEALTHY])
        return out

    def _ask_volume(self, ref: str, nodes: list[str]) -> list[str]:
        found = []
        for name in nodes:
            try:
                status, _, body = self.node(name).request("GET", f"/v1/volumes/{ref}",  # type: ignore[attr-defined]
                                                          timeout_s=_ASK_VOLUME_S)
            except Exception as e:  # a lost node, or its daemon not answering: the others may hold it
                log.warning("asking node %s for volume %s: %s: %s", name, ref, type(e).__name__, e)
                continue
            if status == 200:
                found.append(name)
                try:
                    self._note_volume(msgspec.json.decode(body), name)
                except (msgspec.DecodeError, AttributeError, KeyError):
                    pass
                if _VOLUME_ID.fullmatch(ref):  # an id is one volume: no need to ask on
                    break
        return found

    def volume_node(self, ref: str) -> str:
        """The node holding volume ``ref`` (id, or its name). VolumeNotFoundError: no node holds it;
        VolumeConflictError: a name several nodes have."""
        return volume_home(self.volume_where([ref]))

    def pin_volumes(self, req: PlacementRequest, node: str | None = None) -> PlacementRequest:
        """``req`` with ``volume_home`` set: the one node holding every volume it mounts (Volume*Error
        otherwise, as :meth:`volume_node`). ``node``: the create's own choice, refused when the
        volumes are elsewhere."""
        if not req.volumes:
            return req
        home = volume_home(self.volume_where(req.volumes))
        if node is not None and node != home:
            raise VolumeConflictError(f"the env mounts volumes of node {home} ({', '.join(req.volumes)}), "
                                      f"not of node {node}: volumes are node-local")
        return msgspec.structs.replace(req, volume_home=home)

    def _note_volume(self, info: dict[str, Any], node: str) -> None:
        with self._lock:  # type: ignore[attr-defined]
            self._volume_home[info["id"]] = node
            if info.get("name"):
                self._volume_home[info["name"]] = node

    def _forget_volume(self, *refs: str) -> None:
        with self._lock:  # type: ignore[attr-defined]
            for ref in refs:
                self._volume_home.pop(ref, None)

    # ------------------------------------------------------------------ new volumes

    def node_for_volume(self, name: str | None = None, node: str | None = None) -> str:
        """Where a new volume goes: ``node``, else the node placement picks for volumes. A name the
        cluster has already (on any node) is a VolumeConflictError."""
        if name is not None:
            held = self.volume_where([name], ask=False, noted=False)[name]  # the reports (a note may be stale)
            if held:
                raise VolumeConflictError(f"a volume named {name!r} exists already (on node {', '.join(held)}); "
                                          f"volume names are the cluster's, so that a plan naming one names its node")
        if node is not None:
            return node
        picked = place_volume(self.current_view())  # type: ignore[attr-defined]
        if not picked:
            raise PlacementError(f"no node takes a volume: none is healthy and accepting ({self.nodes()})")  # type: ignore[attr-defined]
        return picked[0]

    def volume_made(self, info: dict[str, Any], node: str) -> None:
        """A volume was made on ``node`` (here or through the gateway): route it there at once."""
        self._note_volume(info, node)
        self._refresh_one(node, fresh=True)  # type: ignore[attr-defined]

    def volume_deleted(self, ref: str, node: str, info: dict[str, Any] | None = None) -> None:
        self._forget_volume(ref, *((info or {}).get(k) or ref for k in ("id", "name")))
        self._refresh_one(node, fresh=True)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ the Python client's calls

    def create_volume(self, name: str | None = None, *, size_bytes: int | None = None,
                      node: str | None = None) -> dict[str, Any]:
        """A new volume (``size_bytes``, default 1 GiB) on ``node``, else the node placement picks:
        the daemon's answer, with ``node``."""
        where = self.node_for_volume(name, node)
        body = {k: v for k, v in (("name", name), ("size_bytes", size_bytes)) if v is not None}
        info = self.node(where).call("POST", "/v1/volumes", json=body)  # type: ignore[attr-defined]
        self.volume_made(info, where)
        return {**info, "node": where}

    def volumes(self) -> list[dict[str, Any]]:
        """Every node's volumes, each with its ``node`` (a node that does not answer is left out)."""
        out = []
        for client in self.all():  # type: ignore[attr-defined]
            try:
                out += [{**v, "node": client.name} for v in client.call("GET", "/v1/volumes")]
            except (AgentError, NodeLostError) as e:
                log.warning("node %s: its volumes are left out of the list: %s", client.name, e)
        return out

    def _volume_call(self, method: str, ref: str, suffix: str = "", **kw: Any) -> Any:
        return self.node(self.volume_node(ref)).call(method, f"/v1/volumes/{ref}{suffix}", **kw)  # type: ignore[attr-defined]

    def volume(self, ref: str) -> dict[str, Any]:
        """One volume (id or name) as its node tells it, with ``node``."""
        home = self.volume_node(ref)
        return {**self.node(home).call("GET", f"/v1/volumes/{ref}"), "node": home}  # type: ignore[attr-defined]

    def delete_volume(self, ref: str) -> None:
        """Remove a volume and its files on its node (AgentError ``volume_in_use`` while envs mount it)."""
        home = self.volume_node(ref)
        info = self.node(home).call("DELETE", f"/v1/volumes/{ref}", json={})  # type: ignore[attr-defined]
        self.volume_deleted(ref, home, info if isinstance(info, dict) else None)

    def read_volume_file(self, ref: str, path: str) -> bytes:
        return self._volume_call("GET", ref, "/files", params={"op": "read", "path": path})  # type: ignore[no-any-return]

    def list_volume_dir(self, ref: str, path: str = "/") -> list[dict[str, Any]]:
        return self._volume_call("GET", ref, "/files", params={"op": "list", "path": path})  # type: ignore[no-any-return]

    def write_volume_file(self, ref: str, path: str, data: bytes | str, *, mode: int | None = None) -> dict[str, Any]:
        params = {"path": path, **({"mode": f"{mode:o}"} if mode is not None else {})}
        return self._volume_call("PUT", ref, "/files", content=data.encode() if isinstance(data, str) else data,  # type: ignore[no-any-return]
                                 params=params)
