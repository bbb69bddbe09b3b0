"""The cluster's snapshots: where each is (its home, from the node reports or by asking the nodes),
published to the cluster's store so any node can start from it, and deleted from both. A part of
:class:`~weenv.cluster.Cluster` (it uses the cluster's nodes, routes and store)."""

from __future__ import annotations

import logging
import re
from typing import Any

from ._agent import load_published
from ._errors import ClusterError

log = logging.getLogger("weenv.cluster")
_SNAPSHOT_ID = re.compile(r"snap-[A-Za-z0-9._-]{1,59}")  # the ids daemons make (new_snapshot_id)
_ASK_SNAPSHOT_S = 5.0  # how long a node may take to say whether it holds a snapshot no report names



class Snapshots:
    """The snapshot half of :class:`~weenv.cluster.Cluster` (its ``_snapshot_home``, ``_published``,
    ``store`` and nodes are the cluster's)."""

    def find_snapshot(self, snap: str) -> str | None:
        """The node holding snapshot id ``snap``: from the reports, else by asking every node (a
        snapshot made since its home last reported, or by a client outside the cluster)."""
        reports = self.reconciler.reports()
        for r in reports:
            if any(s.id == snap for s in r.snapshots):
                return r.node
        if not _SNAPSHOT_ID.fullmatch(snap):  # not an id a daemon makes: nothing to ask for
            return None
        for r in reports:
            try:
                status, _, _ = self.node(r.node).request("GET", f"/v1/snapshots/{snap}",
                                                             timeout_s=_ASK_SNAPSHOT_S)
            except Exception as e:  # a lost node, or its daemon not answering: the others may hold it
                log.warning("asking node %s for snapshot %s: %s: %s", r.node, snap, type(e).__name__, e)
                continue
            if status == 200:
                self._note_snapshot(snap, r.node)
                return r.node
        return None

    def published_record(self, snapshot: str) -> dict[str, Any] | None:
        with self._lock:
            rec = self._published.get(snapshot)
            reports = self.reconciler.reports(usable_only=False)
        if rec is None and "/" not in snapshot:  # an id: published if its home's report names a ref
            held = [(r.node, s) for r in reports for s in r.snapshots if s.id == snapshot and s.ref]
            if not held:
                return None
            home, snap = held[0]
            rec = {"id": snapshot, "ref": snap.ref, "lock": load_published(snap.ref or ""), "home": home,
                   "layers": list(snap.layers)}
            with self._lock:
                self._published[snapshot] = rec
            return rec
        if rec is not None:
            return rec
        lock = load_published(snapshot)  # a ref: read from the cluster's store (any client, any restart)
        rec = {"id": snapshot.rsplit(":", 1)[-1], "ref": snapshot, "lock": lock, "home": None, "layers": []}
        with self._lock:
            self._published[snapshot] = rec
        return rec

    def publish(self, snapshot: str) -> dict[str, Any]:
        """Push a snapshot held on one node to the cluster's store: then any node starts from it."""
        if self.store is None:
            raise ClusterError("this cluster has no store (connect(..., store='host:port/repo')): snapshots stay "
                               "on the node that made them")
        home = self.snapshot_home(snapshot)
        if home is None:
            raise ClusterError(f"no node holds snapshot {snapshot!r}")
        rec = self.node(home).publish_snapshot(snapshot, self.store)
        self._refresh_one(home)  # its report names the ref now
        with self._lock:
            self._published[snapshot] = rec
            self._published[rec["ref"]] = rec
        return rec

    def delete_snapshot(self, snapshot: str) -> None:
        """Remove a snapshot from the node that holds it, and its published copy from the store."""
        home = self.snapshot_home(snapshot)
        if home is None:
            raise ClusterError(f"no node holds snapshot {snapshot!r}")
        ref = self.published_ref(snapshot)  # before the node's copy goes: its report names the ref
        self.node(home).call("DELETE", f"/v1/snapshots/{snapshot}")
        self.snapshot_deleted(snapshot, ref)

    def snapshot_deleted(self, snapshot: str, ref: str | None) -> None:
        """The home's copy of ``snapshot`` is gone (deleted here or through the gateway's node API):
        forget its home, and remove its published copy ``ref`` (from :meth:`published_ref`, read
        before the delete) from the store."""
        with self._lock:
            self._snapshot_home.pop(snapshot, None)
        if ref is not None:
            self.unpublish(ref)

    def published_ref(self, snapshot: str) -> str | None:
        """The ref snapshot id ``snapshot`` is published under (None: not published, as far as this
        client or the nodes' reports know)."""
        with self._lock:
            rec = self._published.get(snapshot)
        if rec is not None and rec.get("ref"):
            return str(rec["ref"])
        for r in self.reconciler.reports(usable_only=False):
            for s in r.snapshots:
                if s.id == snapshot and s.ref:
                    return s.ref
        return None

    def unpublish(self, ref: str) -> bool:
        """Remove a published snapshot (``host[:port]/repo:snap-…``) from the store: creates from it
        fail from then on; envs started from it read on (its blobs stay). False: it was not there."""
        from ..registry import open_store, parse_ref

        r = parse_ref(ref)
        if r.registry is None or r.tag is None:
            raise ClusterError(f"{ref!r} is not a published snapshot ref (host[:port]/repo:snap-…)")
        snap_id = r.tag
        with open_store(r.registry) as store:
            gone = store.delete_manifest(r.repo, snap_id)  # the lock's tag first: no create starts from it
            for tag in store.list_tags(r.repo):  # then its layers' and memory packs' (<id>-<i>, <id>-m<i>)
                rest = tag[len(snap_id) + 1:] if tag.startswith(snap_id + "-") else ""
                if rest.isdigit() or (rest[:1] == "m" and rest[1:].isdigit()):
                    store.delete_manifest(r.repo, tag)
        with self._lock:
            for key in [k for k, v in self._published.items() if v.get("ref") == ref] + [ref]:
                self._published.pop(key, None)
        log.info("unpublished %s (%s)", ref, "removed" if gone else "was not in the store")
        return gone

    def snapshot_home(self, snap: str) -> str | None:
        """The node holding snapshot ``snap``: from the reports, else asking each healthy node."""
        return self._snapshot_home.get(snap) or self.find_snapshot(snap)

    def _note_snapshot(self, snap: str, node: str) -> None:
        with self._lock:
            self._snapshot_home[snap] = node
