"""Snapshots pulled from a registry onto this node (docs/snapshots.md); their published form and
the publishing are weenv/registry/_published.py's (the cluster publishes with it too).

:func:`read_published` reads ``REF`` back: the lock, and the memory image;
:func:`pull_memory` downloads its packs into this node's embedded store (each blob checked
against its digest) unless they are there already.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

import msgspec

from ...registry import LayoutStore, open_store, parse_ref
from ...registry._published import ANN_SNAPSHOT_LOCK, ANN_SNAPSHOT_MEMORY, SnapshotNotPublishable
from ...registry._published import publish_snapshot as _publish
from ...registry._group import parse_manifest
from .._errors import EnvError, EnvStateError
from ._snapshots import MemoryImage

class SnapshotPublishError(EnvStateError):
    """A snapshot cannot be published as asked (its plan's groups are local, no registry named, …)."""


def publish_snapshot(snap_id: str, lock: dict[str, Any], layers: list[dict[str, Any]], memory: dict[str, Any] | None,
                     ref: str, *, store: LayoutStore, source: str) -> dict[str, Any]:
    """:func:`weenv.registry._published.publish_snapshot`, its refusals as this node's 409s."""
    try:
        return _publish(snap_id, lock, layers, memory, ref, store=store, source=source)
    except SnapshotNotPublishable as e:
        raise SnapshotPublishError(str(e)) from None


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
