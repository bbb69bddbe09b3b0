"""The store seam: everything weenv needs from an OCI registry or an OCI image-layout directory."""

from __future__ import annotations

import abc
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

ProgressFn = Callable[[int], None]
"""Called with the number of bytes just transferred."""


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor."""

    media_type: str
    digest: str  # "sha256:<hex>"
    size: int
    annotations: dict[str, str] = field(default_factory=dict)
    artifact_type: str | None = None


class Store(abc.ABC):
    """A content-addressed store of blobs and manifests, organised by repository.

    Implementations: a remote OCI registry and a local OCI image-layout directory (and, for unit
    tests, :class:`weenv.testing.FakeStore` in memory). All pass the shared conformance suite
    (tests/test_store_conformance.py). Methods are synchronous and
    thread-safe; async callers run them in worker threads.
    """

    @abc.abstractmethod
    def resolve(self, repo: str, reference: str) -> Descriptor:
        """The manifest descriptor for a tag or digest in ``repo``."""

    @abc.abstractmethod
    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str]:
        """Manifest bytes and media type for a tag or digest."""

    @abc.abstractmethod
    def put_manifest(self, repo: str, data: bytes, media_type: str, tag: str | None = None) -> str:
        """Store a manifest (and tag it); return its digest."""

    @abc.abstractmethod
    def has_blob(self, repo: str, digest: str) -> bool:
        """Whether the blob exists (a HEAD on registries)."""

    @abc.abstractmethod
    def put_blob(self, repo: str, digest: str, path: str, size: int, *, progress: ProgressFn | None = None) -> int:
        """Upload the blob stored in file ``path`` unless present; return the bytes uploaded."""

    @abc.abstractmethod
    def read_blob(self, repo: str, digest: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of a blob from ``offset`` (a Range read on registries)."""

    @abc.abstractmethod
    def list_tags(self, repo: str) -> list[str]:
        """Tags of ``repo``, sorted."""

    @abc.abstractmethod
    def delete_manifest(self, repo: str, tag: str) -> bool:
        """Remove from ``repo`` the manifest ``tag`` names, with every tag of ``repo`` naming it
        (registries delete manifests by digest). False: no such tag. Blobs stay (a registry's
        garbage collection removes unreferenced ones), so envs reading them by digest read on."""

    def close(self) -> None:
        """Release connections and file handles."""

    # Conveniences built on the methods above; implementations may do better.

    def put_blob_bytes(self, repo: str, data: bytes) -> str:
        """Store small bytes (configs) as a blob; return the digest."""
        import hashlib

        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.has_blob(repo, digest):
            return digest
        fd, path = tempfile.mkstemp(prefix="weenv-blob-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self.put_blob(repo, digest, path, len(data))
        finally:
            os.unlink(path)
        return digest

    def iter_blob(self, repo: str, digest: str, size: int, chunk_bytes: int = 8 << 20) -> Iterator[bytes]:
        """The blob's bytes in order, ``chunk_bytes`` at a time (never the whole blob in memory)."""
        for off in range(0, size, chunk_bytes):
            yield self.read_blob(repo, digest, off, min(chunk_bytes, size - off))

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlobReader:
    """Adapts one blob of a store to :class:`weenv.layerfmt.RandomAccessReader`."""

    def __init__(self, store: Store, repo: str, digest: str, size: int):
        self.store, self.repo, self.digest, self._size = store, repo, digest, size

    @property
    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self._size - offset))
        return self.store.read_blob(self.repo, self.digest, offset, n) if n else b""
