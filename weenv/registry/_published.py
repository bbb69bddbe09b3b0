"""The published form of a weenv snapshot (docs/snapshots.md), shared by the node (``weenv commit
--ref``) and the cluster (``weenv cluster publish``), neither of which owns it.

A published snapshot is tagged ``REF`` (``host[:port]/repo:tag``): each of its layers is a
``task`` group ``REF-<i>``, and ``REF`` itself names its top layer with the plan lock that
starts it on any node (:data:`ANN_SNAPSHOT_LOCK`: the source's groups plus those layers). A
memory snapshot's packs (weenv layers of deduplicated chunks, weenv/provision/envs/_memimages.py)
are pushed the same way, as ``task`` groups ``REF-m<i>``, blob for blob (their digests do not
change), and :data:`ANN_SNAPSHOT_MEMORY` on ``REF`` holds its memory image (the snapshot's
``memory`` as JSON). Pushes skip blobs the repository has: a pack shared by several published
images goes up once. Reading it back onto a node is weenv/provision/envs/_published.py's.
"""

from __future__ import annotations

import json
from typing import Any

from ._errors import IntegrityError, RegistryError
from ._layout import LayoutStore
from ._publish import publish_layer_file
from ._ref import parse_ref

ANN_SNAPSHOT_LOCK = "dev.weenv.snapshot.lock"  # on a published snapshot's top manifest: the lock to start it
ANN_SNAPSHOT_MEMORY = "dev.weenv.snapshot.memory"  # and, for a memory snapshot, its image (as JSON)


class SnapshotNotPublishable(RegistryError):
    """A snapshot cannot be published as asked (its plan's groups are local, no registry named, …)."""


def publish_snapshot(snap_id: str, lock: dict[str, Any], layers: list[dict[str, Any]], memory: dict[str, Any] | None,
                     ref: str, *, store: LayoutStore, source: str) -> dict[str, Any]:
    """Publish a snapshot held in ``store`` (see the module docstring) at ``ref``; ``lock`` is
    the plan lock as the plan codec writes it, ``memory`` the snapshot's memory image as builtins.
    Returns ``{"ref", "lock", "memory"}``."""
    from ..plan import Lock, plan_from_builtins

    local = [g["name"] for g in lock["groups"] if not g.get("registry")]
    if local:
        raise SnapshotNotPublishable(f"snapshot {snap_id}: its plan's groups {local} live in the node's embedded "
                                     "store; publish the plan's groups to a registry so other nodes can read them")
    r = parse_ref(ref)
    if r.registry is None or r.tag is None:
        raise SnapshotNotPublishable(f"{ref!r}: name a registry and a tag (host[:port]/repo:tag) to publish to")
    if not layers:
        raise SnapshotNotPublishable(f"snapshot {snap_id} has no layers")
    groups = list(lock.get("groups", []))
    for i, layer in enumerate(layers):
        res = publish_layer_file(store.blob_path(layer["digest"]), f"{ref}-{i}", group=f"snapshot{i}",
                                 group_class="task", digest=layer["digest"], source=source)
        groups.append({"name": f"{r.tag}-{i}", "ref": f"{ref}-{i}", "class": "task", "digest": res.digest,
                       "layer_digest": res.layer_digest, "layer_size": res.size, "toc_digest": res.toc_digest,
                       "registry": r.registry, "repo": r.repo})
    lock = {**lock, "groups": groups}
    plan_from_builtins(lock, Lock, source=f"published snapshot {snap_id}")  # refuse what no node would start
    annotations = {ANN_SNAPSHOT_LOCK: json.dumps(lock, sort_keys=True, separators=(",", ":"))}
    if memory is not None:
        if not memory.get("chunked"):
            raise SnapshotNotPublishable(f"snapshot {snap_id}: its memory image was made before images were "
                                         "chunked; commit the env with memory again to publish it")
        blobs = [memory["digest"], *(p["digest"] for p in memory.get("packs", []))]
        for i, digest in enumerate(blobs):
            res = publish_layer_file(store.blob_path(digest), f"{ref}-m{i}", group=f"memory{i}",
                                     group_class="task", digest=digest, source=source)
            if res.layer_digest != digest:  # a pack is pushed as it is, or its image names nothing
                raise IntegrityError(f"snapshot {snap_id}: pack {digest} was published as {res.layer_digest}")
        annotations[ANN_SNAPSHOT_MEMORY] = json.dumps(memory, sort_keys=True, separators=(",", ":"))
    top = layers[-1]
    publish_layer_file(store.blob_path(top["digest"]), ref, group="snapshot", group_class="task",
                       digest=top["digest"], source=source, annotations=annotations)
    return {"ref": ref, "lock": lock, "memory": memory}
