"""L1 (memory) and L2 (node disk) chunk caches, both keyed by the chunk's sha256.

Content addressing makes both caches node-wide: the same bytes in two layers, or in two
registrations of one layer, are stored and fetched once.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict

from ._metrics import Metrics


class MemoryCache:
    """L1: an LRU of verified, decompressed chunks, bounded in bytes."""

    def __init__(self, capacity_bytes: int, metrics: Metrics):
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._metrics = metrics

    def get(self, digest: bytes) -> bytes | None:
        with self._lock:
            data = self._items.get(digest)
            if data is not None:
                self._items.move_to_end(digest)
        return data

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._items

    def put(self, digest: bytes, data: bytes) -> None:
        if len(data) > self.capacity_bytes:
            return
        evicted = 0
        with self._lock:
            old = self._items.pop(digest, None)
            if old is not None:
                self.size_bytes -= len(old)
            self._items[digest] = data
            self.size_bytes += len(data)
            while self.size_bytes > self.capacity_bytes:
                _, gone = self._items.popitem(last=False)
                self.size_bytes -= len(gone)
                evicted += 1
        if evicted:
            self._metrics.inc("l1_evictions", evicted)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.size_bytes = 0


class DiskCache:
    """L2: a content-addressed chunk store on the node's disk, bounded in bytes with LRU eviction.

    Files hold decompressed chunks at ``chunks/ab/cdef…`` (hex sha256). Writes go to ``tmp/`` and are
    renamed into place, so a reader sees a whole file or none; a file torn or corrupted anyway (disk
    error, crash during write-back) fails its sha256 on read, is deleted and counted, and the chunk
    is fetched again. The index is rebuilt from the directory at start (oldest mtime evicted first).
    All methods are blocking and thread-safe: call them from worker threads.
    """

    def __init__(self, root: str, capacity_bytes: int, metrics: Metrics):
        self.root = os.path.abspath(root)
        self.capacity_bytes = capacity_bytes
        self._chunks = os.path.join(self.root, "chunks")
        self._tmp = os.path.join(self.root, "tmp")
        self._metrics = metrics
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self.size_bytes = 0
        self._seq = 0
        os.makedirs(self._chunks, exist_ok=True)
        os.makedirs(self._tmp, exist_ok=True)
        self._load()

    def _path(self, digest: bytes) -> str:
        h = digest.hex()
        return os.path.join(self._chunks, h[:2], h[2:])

    def _load(self) -> None:
        for name in os.listdir(self._tmp):  # torn writes of a previous run
            try:
                os.unlink(os.path.join(self._tmp, name))
            except OSError:
                pass
        found = []
        for sub in os.listdir(self._chunks):
            d = os.path.join(self._chunks, sub)
            if len(sub) != 2 or not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                try:
                    digest = bytes.fromhex(sub + name)
                    st = os.stat(os.path.join(d, name))
                except (ValueError, OSError):
                    continue
                if len(digest) == 32:
                    found.append((st.st_mtime_ns, digest, st.st_size))
        found.sort()
        for _, digest, size in found:
            self._index[digest] = size
            self.size_bytes += size
        self._evict_to(self.capacity_bytes)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._index

    def get(self, digest: bytes, ulength: int) -> bytes | None:
        """The verified chunk, or None (missing, or corrupt and now deleted)."""
        with self._lock:
            if digest not in self._index:
                self._metrics.inc("l2_misses")
                return None
            self._index.move_to_end(digest)
        path = self._path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.read(fd, ulength)
                if len(data) == ulength and os.read(fd, 1):
                    data = b""  # longer than the chunk: corrupt
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._forget(digest)
            self._metrics.inc("l2_misses")
            return None
        if len(data) != ulength or hashlib.sha256(data).digest() != digest:
            self._metrics.inc("l2_corrupt")
            self._forget(digest)
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        self._metrics.inc("l2_hits")
        self._metrics.inc("l2_bytes_read", len(data))
        return data

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            size = self._index.pop(digest, None)
            if size is not None:
                self.size_bytes -= size

    def put(self, digest: bytes, data: bytes) -> None:
        """Store a verified chunk (temp + rename); evict least recently used chunks beyond the bound."""
        if digest in self._index or len(data) > self.capacity_bytes:
            return
        with self._lock:
            self._seq += 1
            tmp = os.path.join(self._tmp, f"{digest.hex()}.{os.getpid()}.{threading.get_ident()}.{self._seq}")
        path = self._path(digest)
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(data)
            try:
                os.rename(tmp, path)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.rename(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return  # a full or failing cache disk degrades to fetching again, never to an error
        with self._lock:
            if digest not in self._index:
                self._index[digest] = len(data)
                self.size_bytes += len(data)
        self._metrics.inc("l2_bytes_written", len(data))
        if self.size_bytes > self.capacity_bytes:
            self._evict_to(self.capacity_bytes * 9 // 10)

    def _evict_to(self, target_bytes: int) -> tuple[int, int]:
        files = freed = 0
        while True:
            with self._lock:
                if self.size_bytes <= target_bytes or not self._index:
                    break
                digest, size = self._index.popitem(last=False)
                self.size_bytes -= size
            try:
                os.unlink(self._path(digest))
            except OSError:
                pass
            files += 1
            freed += size
        if files:
            self._metrics.inc("l2_evictions", files)
        return files, freed

    def prune(self, to_bytes: int) -> tuple[int, int]:
        """Evict least recently used chunks until at most ``to_bytes`` remain; (files, bytes) freed."""
        return self._evict_to(max(0, to_bytes))

    @property
    def files(self) -> int:
        return len(self._index)
