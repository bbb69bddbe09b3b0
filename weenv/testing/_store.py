"""An in-memory :class:`~weenv.registry.Store` for unit tests of code that publishes to or reads from
a store; the store conformance suite (tests/test_store_conformance.py) runs against it too.

It behaves as the embedded layout store does: blobs (manifests included) are content addressed
and shared by every repository, tags and untagged manifests belong to one repository, a digest
that names a manifest blob resolves in any repository. ``calls`` records ``(method, repo,
reference)`` for tests that count round trips.
"""

from __future__ import annotations

import hashlib
import json
import threading

from weenv.registry._errors import BlobRangeError, IntegrityError, NotFoundError
from weenv.registry._ref import check_digest, is_digest
from weenv.registry._store import Descriptor, ProgressFn, Store

_COPY_BYTES = 4 << 20


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class FakeStore(Store):
    """Blobs and manifests in dicts, behind one lock (the seam promises thread safety)."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        #: repo -> tag -> (manifest digest, media type)
        self.tags: dict[str, dict[str, tuple[str, str]]] = {}
        #: repo -> digest -> media type: every manifest put into the repo, tagged or not
        self.manifests: dict[str, dict[str, str]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FakeStore({len(self.blobs)} blobs, {sum(map(len, self.tags.values()))} tags)"

    def _record(self, method: str, repo: str, reference: str) -> None:
        self.calls.append((method, repo, reference))

    def _find(self, repo: str, reference: str) -> tuple[str, str]:
        """``(digest, media type)`` of a manifest by tag or digest; NotFoundError when there is none."""
        if is_digest(reference):
            media_type = self.manifests.get(repo, {}).get(reference)
            if media_type is None and reference in self.blobs:
                media_type = _manifest_media_type(self.blobs[reference])
            if media_type is not None:
                return reference, media_type
        elif reference in self.tags.get(repo, {}):
            return self.tags[repo][reference]
        raise NotFoundError(f"fake store: no manifest {repo}{'@' if is_digest(reference) else ':'}{reference}")

    def resolve(self, repo: str, reference: str) -> Descriptor:
        with self._lock:
            self._record("resolve", repo, reference)
            digest, media_type = self._find(repo, reference)
            data = self.blobs[digest]
        return Descriptor(media_type, digest, len(data), artifact_type=_artifact_type(data))

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str]:
        with self._lock:
            self._record("get_manifest", repo, reference)
            digest, media_type = self._find(repo, reference)
            return self.blobs[digest], media_type

    def put_manifest(self, repo: str, data: bytes, media_type: str, tag: str | None = None) -> str:
        digest = _sha256(data)
        with self._lock:
            self._record("put_manifest", repo, tag or digest)
            self.blobs.setdefault(digest, bytes(data))
            self.manifests.setdefault(repo, {})[digest] = media_type
            if tag is not None:
                self.tags.setdefault(repo, {})[tag] = (digest, media_type)
        return digest

    def delete_manifest(self, repo: str, tag: str) -> bool:
        with self._lock:
            self._record("delete_manifest", repo, tag)
            named = self.tags.get(repo, {}).get(tag)
            if named is None:
                return False
            self.tags[repo] = {t: v for t, v in self.tags[repo].items() if v[0] != named[0]}
            self.manifests.get(repo, {}).pop(named[0], None)
            return True

    def has_blob(self, repo: str, digest: str) -> bool:
        check_digest(digest)
        with self._lock:
            self._record("has_blob", repo, digest)
            return digest in self.blobs

    def put_blob(self, repo: str, digest: str, path: str, size: int, *, progress: ProgressFn | None = None) -> int:
        check_digest(digest)
        with self._lock:
            self._record("put_blob", repo, digest)
            if digest in self.blobs:
                return 0
        parts = []
        with open(path, "rb") as f:
            while buf := f.read(_COPY_BYTES):
                parts.append(buf)
                if progress is not None:
                    progress(len(buf))
        data = b"".join(parts)
        got = _sha256(data)
        if got != digest or len(data) != size:
            raise IntegrityError(f"fake store: put blob {digest} from {path}: file has {got} ({len(data)} bytes), "
                                 f"expected {digest} ({size} bytes)")
        with self._lock:
            self.blobs.setdefault(digest, data)
        return len(data)

    def read_blob(self, repo: str, digest: str, offset: int, length: int) -> bytes:
        check_digest(digest)
        with self._lock:
            self._record("read_blob", repo, digest)
            data = self.blobs.get(digest)
        if data is None:
            raise NotFoundError(f"fake store: no blob {digest}")
        if offset < 0 or length < 0 or offset + length > len(data):
            raise BlobRangeError(f"fake store: bytes {offset}..{offset + length} outside blob {digest} "
                                 f"of {len(data)} bytes")
        return data[offset : offset + length]

    def list_tags(self, repo: str) -> list[str]:
        with self._lock:
            self._record("list_tags", repo, "")
            return sorted(self.tags.get(repo, {}))


def _manifest_media_type(data: bytes) -> str | None:
    try:
        media_type = json.loads(data).get("mediaType")
    except (ValueError, AttributeError):
        return None
    return media_type if isinstance(media_type, str) else None


def _artifact_type(data: bytes) -> str | None:
    try:
        artifact_type = json.loads(data).get("artifactType")
    except (ValueError, AttributeError):
        return None
    return artifact_type if isinstance(artifact_type, str) else None
