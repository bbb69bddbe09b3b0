"""Snapshot records: an env's filesystem sealed into layers on top of its plan lock.

A snapshot is ``lock`` (the source env's plan lock) plus ``layers`` (sealed uppers, bottom first:
a snapshot of an env that itself started from a snapshot stacks one more layer), and for a memory
snapshot ``memory`` (the runtime's checkpoint image as deduplicated chunks in packs: :mod:`._memory`). Records live in
``$WEENV_HOME/snapshots/<id>.json``; the layer blobs live in the embedded store, and are deleted
only when no snapshot, running env or published tag references them.

:class:`SnapshotTrees`: the layers committed on this node are also kept as plain directories (a
copy of the sealed upper, ``$WEENV_HOME/snapshot-trees/<digest>/``): envs from the snapshot stack
them as overlay lowers directly, not through FUSE.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from ..._atomic import atomic_write
from .._errors import EnvError
from ._trees import LayerTrees


class SnapshotNotFoundError(EnvError, LookupError):
    """Raised for a snapshot id the daemon does not know."""


class SnapshotLayer(msgspec.Struct, frozen=True, kw_only=True):
    digest: str
    size: int
    toc_digest: str


class MemoryImage(msgspec.Struct, frozen=True, kw_only=True):
    """A memory snapshot's process state: the runtime's checkpoint image in the embedded store.

    ``chunked`` (every image made since): its blob is a pack of content-defined chunks of the
    image plus its recipe, holding only the chunks no earlier pack had; ``packs`` are the
    earlier packs it takes the others from (:mod:`._memory`, :mod:`._memchunks`). Not
    ``chunked``: its blob is a layer of the image directory's files, whole."""

    digest: str  # its own blob (a pack, or the layer of its files)
    size: int
    toc_digest: str
    image_bytes: int  # the checkpoint image as the runtime wrote it
    facts: dict[str, str] = {}  # what it restores under: runtime, platform, runtime version
    chunked: bool = False
    packs: list[SnapshotLayer] = []  # the other packs holding chunks of it

    def blobs(self) -> list[SnapshotLayer]:
        """Every blob it needs, its own first."""
        return [SnapshotLayer(digest=self.digest, size=self.size, toc_digest=self.toc_digest), *self.packs]


class SnapshotRecord(msgspec.Struct, kw_only=True):
    id: str
    source_env: str
    created_s: float = msgspec.field(default_factory=time.time)
    lock: dict[str, Any] = {}
    layers: list[SnapshotLayer] = []
    ref: str | None = None  # where it was published, if it was
    build_key: str | None = None  # set for snapshots made by `weenv build` steps
    diff_bytes: int = 0  # uncompressed content of the newest layer
    cpu_quota_cores: float | None = None  # the source env's CPU quota when committed: envs start there
    fork: bool = False  # made by fork (not commit or build): gc collects it once no env started from it is left
    memory: MemoryImage | None = None  # a memory snapshot: envs from it restore its processes

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "source_env": self.source_env, "created_s": self.created_s,
                "layers": [msgspec.to_builtins(layer) for layer in self.layers], "ref": self.ref,
                "plan": self.lock.get("name"), "build_key": self.build_key, "diff_bytes": self.diff_bytes,
                "cpu_quota_cores": self.cpu_quota_cores, "fork": self.fork,
                "memory": msgspec.to_builtins(self.memory) if self.memory is not None else None}


def new_snapshot_id() -> str:
    return f"snap-{secrets.token_hex(6)}"


class SnapshotStore:
    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, mode=0o700, exist_ok=True)
        self._enc = msgspec.json.Encoder()
        self._dec = msgspec.json.Decoder(SnapshotRecord)

    def _path(self, snap_id: str) -> str:
        if not snap_id.startswith("snap-") or "/" in snap_id or len(snap_id) > 64:
            raise SnapshotNotFoundError(f"{snap_id!r} is not a snapshot id (snap-…)")
        return os.path.join(self.root, f"{snap_id}.json")

    def save(self, rec: SnapshotRecord) -> None:
        atomic_write(self._path(rec.id), self._enc.encode(rec), mode=None, fsync=False)

    def get(self, snap_id: str) -> SnapshotRecord:
        try:
            with open(self._path(snap_id), "rb") as f:
                return self._dec.decode(f.read())
        except FileNotFoundError:
            raise SnapshotNotFoundError(f"no snapshot {snap_id}") from None
        except msgspec.DecodeError as e:
            raise SnapshotNotFoundError(f"snapshot record {snap_id} is unreadable: {e}") from None

    def list(self) -> list[SnapshotRecord]:
        out = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith(".json"):
                try:
                    out.append(self.get(name[:-5]))
                except SnapshotNotFoundError:
                    continue
        return sorted(out, key=lambda r: r.created_s)

    def delete(self, snap_id: str) -> SnapshotRecord:
        rec = self.get(snap_id)
        os.unlink(self._path(snap_id))
        return rec


class SnapshotTrees:
    """The snapshot trees under ``root``. Paths in :attr:`in_progress` (a commit's temporary copy
    and blob) are left alone by :meth:`gc`; ``spawn`` removes a discarded tree in the background
    (False: no background work runs, it is removed at once)."""

    def __init__(self, root: str, *, spawn: Callable[..., bool]):
        self.root = root
        self.in_progress: set[str] = set()
        self._spawn = spawn
        os.makedirs(root, mode=0o700, exist_ok=True)

    def path(self, digest: str) -> str:
        """Where a snapshot layer made on this node is kept as a directory (it may not exist)."""
        return os.path.join(self.root, LayerTrees.key(digest))

    def temp_path(self, env_id: str) -> str:
        """A new name for a commit's copy of the upper, until it is installed."""
        return os.path.join(self.root, f".commit-{env_id}-{secrets.token_hex(4)}")

    @staticmethod
    def install(tmp: str, final: str) -> bool:
        """Move a copied upper into place as the tree of its layer (one already there wins)."""
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):
                return False
            shutil.rmtree(tmp, ignore_errors=True)
        return True

    def discard(self, path: str) -> None:
        """Take a tree out of use at once (a rename); its files go in a worker thread, off the loop
        (a big tree takes seconds)."""
        trash = os.path.join(self.root, f".trash-{secrets.token_hex(6)}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        if not self._spawn(trio.to_thread.run_sync, shutil.rmtree, trash, True):
            shutil.rmtree(trash, ignore_errors=True)

    def gc(self, keep: set[str]) -> list[str]:
        """Remove the trees not in ``keep`` (a snapshot deleted while its envs ran, a commit or a
        removal cut short); names of the trees removed."""
        removed = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
                if not name.startswith("."):
                    removed.append(name)
        return removed
