"""Snapshots published to a registry, and pulled from one onto another node (docs/snapshots.md).

A published snapshot is tagged ``REF`` (``host[:port]/repo:tag``): each of its layers is a
``task`` group ``REF-<i>``, and ``REF`` itself names its top layer with the plan lock that
starts it on any node (:data:`ANN_SNAPSHOT_LOCK`: the source's groups plus those layers). A
memory snapshot's packs (:mod:`._memory`: weenv layers of deduplicated chunks) are pushed the
same way, as ``task`` groups ``REF-m<i>``, blob for blob (their digests do not change), and
:data:`ANN_SNAPSHOT_MEMORY` on ``REF`` holds its :class:`~._snapshots.MemoryImage`. Pushes
skip blobs the repository has: a pack shared by several published images goes up once.

:func:`pull_snapshot` reads ``REF`` back: the lock, and the memory packs, downloaded into this
node's embedded store (each blob checked against its digest) unless they are there already.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

import msgspec

from ...registry import LayoutStore, open_store, parse_ref, publish_layer_file
from ...registry._group import parse_manifest
from .._errors import EnvError, EnvStateError
from ._snapshots import MemoryImage

ANN_SNAPSHOT_LOCK = "dev.weenv.snapshot.lock"  # on a published snapshot's top manifest: the lock to start it
ANN_SNAPSHOT_MEMORY = "dev.weenv.snapshot.memory"  # and, for a memory snapshot, its image (MemoryImage as JSON)


class SnapshotPublishError(EnvStateError):
    """A snapshot cannot be published as asked (its plan's groups are local, no registry named, …)."""


def publish_snapshot(snap_id: str, lock: dict[str, Any], layers: list[dict[str, Any]], memory: dict[str, Any] | None,
                     ref: str, *, store: LayoutStore, source: str) -> dict[str, Any]:
    """Publish a snapshot held in ``store`` (see the module docstring) at ``ref``; ``lock`` is
    the plan lock as the plan codec writes it. Returns ``{"ref", "lock", "memory"}``."""
    from ...plan import Lock, plan_from_builtins

    local = [g["name"] for g in lock["groups"] if not g.get("registry")]
    if local:
        raise SnapshotPublishError(f"snapshot {snap_id}: its plan's groups {local} live in the node's embedded "
                                   "store; publish the plan's groups to a registry so other nodes can read them")
    r = parse_ref(ref)
    if r.registry is None or r.tag is None:
        raise SnapshotPublishError(f"{ref!r}: name a registry and a tag (host[:port]/repo:tag) to publish to")
    if not layers:
        raise SnapshotPublishError(f"snapshot {snap_id} has no layers")
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
        image = msgspec.convert(memory, MemoryImage)
        if not image.chunked:
            raise SnapshotPublishError(f"snapshot {snap_id}: its memory image was made before images were chunked; "
                                       "commit the env with memory again to publish it")
        for i, blob in enumerate(image.blobs()):
            res = publish_layer_file(store.blob_path(blob.digest), f"{ref}-m{i}", group=f"memory{i}",
                                     group_class="task", digest=blob.digest, source=source)
            if res.layer_digest != blob.digest:  # a pack is pushed as it is, or its image names nothing
                raise EnvError(f"snapshot {snap_id}: pack {blob.digest} was published as {res.layer_digest}")
        annotations[ANN_SNAPSHOT_MEMORY] = msgspec.json.encode(image).decode()
    top = layers[-1]
    publish_layer_file(store.blob_path(top["digest"]), ref, group="snapshot", group_class="task",
                       digest=top["digest"], source=source, annotations=annotations)
    return {"ref": ref, "lock": lock, "memory": memory}


def read_published(ref: str) -> tuple[dict[str, Any], MemoryImage | None]:
    """The lock and the memory image (None: files only) of the snapshot published at ``ref``."""
    r = parse_ref(ref)
    if r.registry is None or r.tag is None:
        raise EnvStateError(f"{ref!r} is not a published snapshot ref (host[:port]/repo:tag)")
    with open_store(r.registry) as store:
        data, media_type = store.get_manifest(r.repo, r.tag)
    annotations = parse_manifest(data, media_type, ref).get("annotations") or {}
    if ANN_SNAPSHOT_LOCK not in annotations:
        raise EnvStateError(f"{ref}: not a published weenv snapshot (no {ANN_SNAPSHOT_LOCK} annotation)")
    lock = json.loads(annotations[ANN_SNAPSHOT_LOCK])
    memory = None
    if ANN_SNAPSHOT_MEMORY in annotations:
        try:
            memory = msgspec.json.decode(annotations[ANN_SNAPSHOT_MEMORY].encode(), type=MemoryImage)
        except msgspec.DecodeError as e:
            raise EnvError(f"{ref}: its {ANN_SNAPSHOT_MEMORY} annotation is not a memory image: {e}") from None
    return lock, memory


def pull_memory(ref: str, image: MemoryImage, layout: LayoutStore) -> int:
    """Download the packs of ``image`` (published with ``ref``) that ``layout`` lacks, each
    checked against its digest and size before it is installed; the bytes downloaded."""
    r = parse_ref(ref)
    pulled = 0
    with open_store(r.registry) as store:
        for blob in image.blobs():
            final = layout.blob_path(blob.digest)
            if os.path.exists(final):
                continue
            tmp = os.path.join(os.path.dirname(final), f".pull-{secrets.token_hex(4)}")
            os.makedirs(os.path.dirname(final), exist_ok=True)
            h, n = hashlib.sha256(), 0
            try:
                with open(tmp, "wb") as f:
                    for part in store.iter_blob(r.repo, blob.digest, blob.size):
                        h.update(part)
                        n += len(part)
                        f.write(part)
                if n != blob.size or "sha256:" + h.hexdigest() != blob.digest:
                    raise EnvError(f"{ref}: memory pack {blob.digest} came down as {n} bytes with sha256 "
                                   f"{h.hexdigest()[:16]}…: not the pack its image names")
                os.replace(tmp, final)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            pulled += n
    return pulled
