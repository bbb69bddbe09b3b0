"""The embedded store: one OCI image-layout directory serving many repositories.

Layout: ``oci-layout``, ``index.json``, ``blobs/sha256/<hex>``. Tags live in ``index.json`` as
manifest descriptors annotated with ``org.opencontainers.image.ref.name`` (the tag) and
``dev.weenv.repo`` (the repository); an untagged manifest keeps a descriptor with only the repo,
so it stays reachable. Blobs are shared by every repository (content addressed).

Concurrency: blobs are written to a temp file in ``blobs/sha256`` and renamed into place after
their digest is checked (two writers of one blob both rename the same bytes). ``index.json`` is
rewritten (temp + rename) only while holding ``flock`` on ``index.json.lock``, re-reading it
under the lock, so concurrent publishers (threads or processes) never lose each other's tags.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._atomic import atomic_write, atomic_writer
from ._errors import BlobRangeError, IntegrityError, NotFoundError, StoreError, mapped_errors
from ._oci import ANN_REF_NAME, ANN_REPO, INDEX_V1, descriptor_json, sha256_digest
from ._ref import check_digest, is_digest
from ._store import Descriptor, ProgressFn, Store

_COPY_BYTES = 4 << 20
LOCK_NAME = "index.json.lock"


class LayoutStore(Store):
    """A :class:`Store` over an OCI image-layout directory (created on first use)."""

    def __init__(self, root: str, *, fsync: bool = False):
        self.root = os.path.abspath(root)
        self.fsync = fsync
        self._blobs = os.path.join(self.root, "blobs", "sha256")
        self._thread_lock = threading.Lock()  # flock is per open file; threads also need exclusion
        with mapped_errors(f"layout store {self.root}"):
            os.makedirs(self._blobs, exist_ok=True)
            layout = os.path.join(self.root, "oci-layout")
            if not os.path.exists(layout):
                self._atomic_write(layout, b'{"imageLayoutVersion":"1.0.0"}')
            if not os.path.exists(os.path.join(self.root, "index.json")):
                with self._index_lock():
                    if not os.path.exists(os.path.join(self.root, "index.json")):
                        self._write_index([])

    def __repr__(self) -> str:
        return f"LayoutStore({self.root!r})"

    # ------------------------------------------------------------------ files

    def blob_path(self, digest: str) -> str:
        check_digest(digest)
        return os.path.join(self._blobs, digest.split(":", 1)[1])

    def _atomic_write(self, path: str, data: bytes) -> None:
        atomic_write(path, data, mode=None, fsync=self.fsync)

    @contextmanager
    def _index_lock(self) -> Iterator[None]:
        with self._thread_lock:
            fd = os.open(os.path.join(self.root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing drops the flock

    def _read_index(self) -> list[dict[str, Any]]:
        path = os.path.join(self.root, "index.json")
        try:
            with open(path, "rb") as f:
                index = json.load(f)
        except FileNotFoundError:
            return []
        except ValueError as e:
            raise StoreError(f"{path}: not valid JSON: {e}") from None
        manifests = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(manifests, list):
            raise StoreError(f"{path}: no manifests list")
        return [m for m in manifests if isinstance(m, dict)]

    def _write_index(self, manifests: list[dict[str, Any]]) -> None:
        index = {"schemaVersion": 2, "mediaType": INDEX_V1, "manifests": manifests}
        self._atomic_write(os.path.join(self.root, "index.json"), json.dumps(index, indent=1).encode() + b"\n")

    # ------------------------------------------------------------------ Store

    def _entry(self, repo: str, reference: str) -> dict[str, Any] | None:
        entries = self._read_index()
        if is_digest(reference):
            for m in entries:
                if m.get("digest") == reference and (m.get("annotations") or {}).get(ANN_REPO) == repo:
                    return m
            return None
        for m in entries:
            ann = m.get("annotations") or {}
            if ann.get(ANN_REPO) == repo and ann.get(ANN_REF_NAME) == reference:
                return m
        return None

    def resolve(self, repo: str, reference: str) -> Descriptor:
        with mapped_errors(f"{self.root}: resolve {repo}:{reference}"):
            m = self._entry(repo, reference)
            if m is None and is_digest(reference) and os.path.exists(self.blob_path(reference)):
                # content addressed: a manifest pushed to another repo (or by digest) still resolves
                data = self._read_whole(reference)
                mt = _manifest_media_type(data, reference)
                return Descriptor(mt, reference, len(data), artifact_type=_artifact_type(data))
            if m is None:
                raise NotFoundError(f"{self.root}: no manifest {repo}{'@' if is_digest(reference) else ':'}{reference}")
            ann = {k: v for k, v in (m.get("annotations") or {}).items() if k not in (ANN_REPO, ANN_REF_NAME)}
            return Descriptor(m["mediaType"], m["digest"], int(m["size"]), ann, m.get("artifactType"))

    def _read_whole(self, digest: str) -> bytes:
        try:
            with open(self.blob_path(digest), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise NotFoundError(f"{self.root}: no blob {digest}") from None

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str]:
        desc = self.resolve(repo, reference)
        with mapped_errors(f"{self.root}: read manifest {desc.digest}"):
            data = self._read_whole(desc.digest)
        if sha256_digest(data) != desc.digest:
            raise IntegrityError(f"{self.root}: manifest blob {desc.digest} does not match its digest (disk corruption?)")
        return data, desc.media_type

    def put_manifest(self, repo: str, data: bytes, media_type: str, tag: str | None = None) -> str:
        digest = sha256_digest(data)
        where = f"{self.root}: put manifest {repo}:{tag or digest}"
        with mapped_errors(where):
            self._put_bytes(digest, data)
            at = _artifact_type(data)
            with self._index_lock():
                entries = self._read_index()
                keep = []
                present = False
                for m in entries:
                    ann = m.get("annotations") or {}
                    if ann.get(ANN_REPO) != repo:
                        keep.append(m)
                    elif tag is not None and ann.get(ANN_REF_NAME) == tag:
                        continue  # retagged: the old descriptor goes
                    elif tag is None and m.get("digest") == digest:
                        present = True
                        keep.append(m)
                    elif ANN_REF_NAME not in ann and m.get("digest") == digest:
                        continue  # an untagged entry is superseded by the tagged one
                    else:
                        keep.append(m)
                if tag is not None or not present:
                    ann = {ANN_REPO: repo}
                    if tag is not None:
                        ann[ANN_REF_NAME] = tag
                    keep.append(descriptor_json(media_type, digest, len(data), ann, at))
                    self._write_index(keep)
        return digest

    def has_blob(self, repo: str, digest: str) -> bool:
        return os.path.exists(self.blob_path(digest))

    def _put_bytes(self, digest: str, data: bytes) -> None:
        final = self.blob_path(digest)
        if os.path.exists(final):
            return
        self._atomic_write(final, data)

    def put_blob(self, repo: str, digest: str, path: str, size: int, *, progress: ProgressFn | None = None) -> int:
        final = self.blob_path(digest)
        if os.path.exists(final):
            return 0
        where = f"{self.root}: put blob {digest} from {path}"
        with mapped_errors(where):
            h = hashlib.sha256()
            n = 0
            with open(path, "rb") as src, atomic_writer(final, mode=None, fsync=self.fsync) as dst:
                while True:
                    buf = src.read(_COPY_BYTES)
                    if not buf:
                        break
                    h.update(buf)
                    dst.write(buf)
                    n += len(buf)
                    if progress is not None:
                        progress(len(buf))
                got = "sha256:" + h.hexdigest()
                if got != digest or n != size:  # raised inside the block: the temp is removed, no blob appears
                    raise IntegrityError(f"{where}: file has {got} ({n} bytes), expected {digest} ({size} bytes)")
        return n

    def read_blob(self, repo: str, digest: str, offset: int, length: int) -> bytes:
        path = self.blob_path(digest)
        with mapped_errors(f"{self.root}: read blob {digest}"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise NotFoundError(f"{self.root}: no blob {digest}") from None
            try:
                size = os.fstat(fd).st_size
                if offset < 0 or length < 0 or offset + length > size:
                    raise BlobRangeError(
                        f"{self.root}: bytes {offset}..{offset + length} outside blob {digest} of {size} bytes"
                    )
                parts, pos, left = [], offset, length
                while left:
                    b = os.pread(fd, left, pos)
                    if not b:
                        raise StoreError(f"{self.root}: blob {digest} shrank while reading")
                    parts.append(b)
                    pos += len(b)
                    left -= len(b)
                return parts[0] if len(parts) == 1 else b"".join(parts)
            finally:
                os.close(fd)

    def blob_size(self, digest: str) -> int:
        try:
            return os.stat(self.blob_path(digest)).st_size
        except FileNotFoundError:
            raise NotFoundError(f"{self.root}: no blob {digest}") from None

    def list_tags(self, repo: str) -> list[str]:
        with mapped_errors(f"{self.root}: list tags of {repo}"):
            tags = {
                (m.get("annotations") or {}).get(ANN_REF_NAME)
                for m in self._read_index()
                if (m.get("annotations") or {}).get(ANN_REPO) == repo
            }
        tags.discard(None)
        return sorted(t for t in tags if t)

    def delete_manifest(self, repo: str, tag: str) -> bool:
        with mapped_errors(f"{self.root}: delete manifest {repo}:{tag}"):
            with self._index_lock():
                entries = self._read_index()
                named = self._entry(repo, tag) if not is_digest(tag) else None
                if named is None:
                    return False
                keep = [m for m in entries if not ((m.get("annotations") or {}).get(ANN_REPO) == repo
                                                   and m.get("digest") == named.get("digest"))]
                self._write_index(keep)
        return True

    def list_repos(self) -> list[str]:
        with mapped_errors(f"{self.root}: list repositories"):
            repos = {(m.get("annotations") or {}).get(ANN_REPO) for m in self._read_index()}
        repos.discard(None)
        return sorted(r for r in repos if r)


def _manifest_media_type(data: bytes, digest: str) -> str:
    try:
        mt = json.loads(data).get("mediaType")
    except (ValueError, AttributeError):
        raise NotFoundError(f"blob {digest} is not a manifest") from None
    if not isinstance(mt, str):
        raise NotFoundError(f"blob {digest} is not a manifest (no mediaType)")
    return mt


def _artifact_type(data: bytes) -> str | None:
    try:
        at = json.loads(data).get("artifactType")
    except (ValueError, AttributeError):
        return None
    return at if isinstance(at, str) else None
