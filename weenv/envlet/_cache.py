"""L1 (memory) and L2 (node disk) chunk caches, both keyed by the chunk's sha256.

Content addressing makes both caches node-wide: the same bytes in two layers, or in two
registrations of one layer, are stored and fetched once.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator

from ..layerfmt import IntegrityError, verify_chunk
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

    def discard(self, digest: bytes) -> None:
        with self._lock:
            old = self._items.pop(digest, None)
            if old is not None:
                self.size_bytes -= len(old)

    @property
    def metrics(self) -> Metrics:
        return self._metrics

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.size_bytes = 0


_RECORD = struct.Struct("<4s32sQI")  # magic, chunk sha256, length, crc32 of the bytes; then the bytes
_MAGIC = b"WLC1"
_MAX_SEGMENT = 256 << 20


class _Segment:
    """One append-only pack file; its descriptor closes when the last reader lets go of it."""

    __slots__ = ("seq", "path", "fd", "size", "stored", "digests")

    def __init__(self, seq: int, path: str, fd: int, size: int = 0):
        self.seq, self.path, self.fd, self.size = seq, path, fd, size  # size: where the next record goes
        self.stored = size  # bytes of records written or being written (a failed write is not counted)
        self.digests: list[bytes] = []

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class DiskCache:
    """L2: a content-addressed chunk store on the node's disk, bounded in bytes, LRU by pack file.

    Verified chunks are appended to pack files (``packs/00000001.pack``…) as records: a 48-byte
    header (magic, sha256, length, crc32) followed by the decompressed bytes. Chunks fetched together
    (the chunks of one file, a prefetch region) land next to each other, so a cold read of them is
    one sequential disk read with the kernel's read-ahead rather than one small file per chunk
    (cold 1 MiB chunk reads: 1.2 GB/s instead of 0.45 GB/s here), and a hit costs one ``pread`` on an
    open descriptor: no open, no path lookup.

    - Integrity: every read verifies the record's length and the bytes' sha256 (the index key) with
      :func:`weenv.layerfmt.verify_chunk` before they are used, so a torn, corrupted or forged
      record (a crc32 can be recomputed along with flipped bytes) is dropped from the index
      (counted as ``l2_corrupt``) and fetched again. The sha256 costs ~0.5 ms per MiB
      (benchmarks/envlet_read.py, "L2 verify"), next to ~1 ms for the FUSE round trips of a MiB.
      The header still carries a crc32 of the bytes (the pack format is unchanged); nothing trusts it.
    - Bound and eviction: the store holds at most ``capacity_bytes`` (headers included). Eviction
      deletes the least recently used pack file (a hit on any of its chunks makes it recent); packs
      are ``capacity / 16`` bytes (at most 256 MiB), so eviction is LRU to within 1/16 of the bound.
    - A full or failing disk: a write that fails is not stored and not counted (``size_bytes``
      counts what is stored; ``l2_write_errors`` the failures), and a partly written last record
      is cut off.
    - Restart: the index is rebuilt by scanning the record headers (packs oldest first); a record cut
      short by a crash ends its pack, which is truncated there.
    All methods are blocking and thread-safe: call them from worker threads.
    """

    def __init__(self, root: str, capacity_bytes: int, metrics: Metrics):
        self.root = os.path.abspath(root)
        self.capacity_bytes = capacity_bytes
        # 16 packs or more: eviction is LRU to 1/16 of the bound; at most 256 MiB a pack (a 1 TiB
        # cache holds 4096 packs, one open descriptor each: serve() raises the open files limit).
        self.segment_bytes = max(1, min(_MAX_SEGMENT, capacity_bytes // 16))
        self._packs = os.path.join(self.root, "packs")
        self._metrics = metrics
        self._lock = threading.Lock()
        self._index: dict[bytes, tuple[_Segment, int, int, int]] = {}  # digest -> (pack, offset, length, crc)
        self._segments: OrderedDict[int, _Segment] = OrderedDict()  # least recently used first
        self._active: _Segment | None = None
        self._writing: set[bytes] = set()
        self.size_bytes = 0
        self._seq = 0
        os.makedirs(self._packs, exist_ok=True)
        for old in ("chunks", "tmp"):  # the earlier one-file-per-chunk layout: a cache, it refills
            shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)
        self._load()

    # ------------------------------------------------------------------ start

    def _load(self) -> None:
        seqs = []
        for name in os.listdir(self._packs):
            stem, dot, ext = name.partition(".")
            if ext == "pack" and stem.isdigit():
                seqs.append(int(stem))
            else:
                try:
                    os.unlink(os.path.join(self._packs, name))
                except OSError:
                    pass
        for seq in sorted(seqs):
            self._seq = max(self._seq, seq)
            path = self._pack_path(seq)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            seg = _Segment(seq, path, fd)
            self._scan(seg)
            if not seg.digests:
                self._delete(seg)
                continue
            self._segments[seq] = seg
            self.size_bytes += seg.stored
        self._evict_to(self.capacity_bytes)

    def _scan(self, seg: _Segment) -> None:
        end = 0
        for digest, offset, length, crc in scan_pack(seg.fd):
            if digest not in self._index:
                self._index[digest] = (seg, offset, length, crc)
                seg.digests.append(digest)
            end = offset + length
        if end != os.fstat(seg.fd).st_size:  # a record torn by a crash (or garbage): the pack ends before it
            os.ftruncate(seg.fd, end)
        seg.size = seg.stored = end

    def _pack_path(self, seq: int) -> str:
        return os.path.join(self._packs, f"{seq:08d}.pack")

    # ------------------------------------------------------------------ reads and writes

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._index

    def get(self, digest: bytes, ulength: int) -> bytes | None:
        """The chunk (length and sha256 verified), or None (missing, or corrupt and now forgotten)."""
        with self._lock:
            entry = self._index.get(digest)
            if entry is None:
                self._metrics.inc("l2_misses")
                return None
            seg, offset, length, crc = entry
            if seg.seq in self._segments:
                self._segments.move_to_end(seg.seq)
        try:
            data = os.pread(seg.fd, length, offset) if length == ulength else b""
        except OSError:
            data = b""
        try:
            if len(data) != ulength:
                raise IntegrityError(f"L2 record has {len(data)} bytes, expected {ulength}")
            verify_chunk(data, digest)  # not the record's crc32: it can be rewritten along with the bytes
        except IntegrityError:
            self._metrics.inc("l2_corrupt")
            with self._lock:
                if self._index.get(digest) is entry:
                    del self._index[digest]  # its bytes stay counted until the pack is evicted
            return None
        self._metrics.inc("l2_hits")
        self._metrics.inc("l2_bytes_read", len(data))
        return data

    def discard(self, digest: bytes) -> None:
        """Forget a chunk (its bytes stay counted until its pack is evicted); it is fetched again."""
        with self._lock:
            self._index.pop(digest, None)

    def put(self, digest: bytes, data: bytes) -> None:
        """Store a verified chunk; evict least recently used packs beyond the bound."""
        need = _RECORD.size + len(data)
        if digest in self._index or need > self.capacity_bytes:
            return
        crc = zlib.crc32(data)
        header = _RECORD.pack(_MAGIC, digest, len(data), crc)
        with self._lock:
            if digest in self._index or digest in self._writing:
                return
            evicted = []
            if self.size_bytes + need > self.capacity_bytes:  # make room first: the bound always holds
                evicted = self._pop_lru(self.capacity_bytes * 9 // 10 - need)
            seg = self._active
            if seg is None or (seg.size and seg.size + need > self.segment_bytes) or seg.seq not in self._segments:
                seg = self._new_segment()  # None: the disk is full or failing (what was evicted still goes)
            if seg is not None:
                offset = seg.size
                seg.size += need
                seg.stored += need
                self.size_bytes += need
                self._writing.add(digest)
        self._finish_eviction(evicted)
        if seg is None:
            return
        ok = False
        try:
            ok = os.pwritev(seg.fd, [header, data], offset) == need
        except OSError:
            pass  # a full or failing cache disk degrades to fetching again, never to an error
        finally:
            with self._lock:
                self._writing.discard(digest)
                if ok and seg.seq in self._segments:
                    self._index[digest] = (seg, offset + _RECORD.size, len(data), crc)
                    seg.digests.append(digest)
                elif not ok:
                    self._unreserve(seg, offset, need)
        if ok:
            self._metrics.inc("l2_bytes_written", len(data))
        else:
            self._metrics.inc("l2_write_errors")

    def _unreserve(self, seg: _Segment, offset: int, need: int) -> None:
        """Take back the room of a record whose write failed (lock held): the stats count what is stored.

        The last record of its pack gives its room back (and any part written is cut off); one with
        records after it leaves a hole that a restart's scan stops at (the pack is cut there).
        """
        if seg.seq not in self._segments:
            return  # evicted meanwhile: its bytes left the count with it
        seg.stored -= need
        self.size_bytes -= need
        if seg.size == offset + need:
            seg.size = offset
            try:
                os.ftruncate(seg.fd, offset)
            except OSError:
                pass

    def _new_segment(self) -> _Segment | None:
        """Start a new pack (call with the lock held)."""
        self._seq += 1
        path = self._pack_path(self._seq)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        seg = self._active = _Segment(self._seq, path, fd)
        self._segments[seg.seq] = seg
        return seg

    # ------------------------------------------------------------------ eviction

    def _delete(self, seg: _Segment) -> None:
        try:
            os.unlink(seg.path)  # readers holding the segment keep reading the unlinked file
        except OSError:
            pass

    def _pop_lru(self, target_bytes: int) -> list[tuple[_Segment, int]]:
        """Drop least recently used packs from the index until ``target_bytes`` remain (lock held)."""
        out = []
        while self.size_bytes > target_bytes and self._segments:
            _, seg = self._segments.popitem(last=False)
            if seg is self._active:
                self._active = None
            self.size_bytes -= seg.stored
            chunks = 0
            for digest in seg.digests:
                entry = self._index.get(digest)
                if entry is not None and entry[0] is seg:
                    del self._index[digest]
                    chunks += 1
            out.append((seg, chunks))
        return out

    def _finish_eviction(self, evicted: list[tuple[_Segment, int]]) -> tuple[int, int]:
        for seg, _ in evicted:
            self._delete(seg)
        chunks = sum(n for _, n in evicted)
        if chunks:
            self._metrics.inc("l2_evictions", chunks)
        return chunks, sum(seg.stored for seg, _ in evicted)

    def _evict_to(self, target_bytes: int) -> tuple[int, int]:
        with self._lock:
            evicted = self._pop_lru(target_bytes)
        return self._finish_eviction(evicted)

    def prune(self, to_bytes: int) -> tuple[int, int]:
        """Evict least recently used packs until at most ``to_bytes`` remain; (chunks, bytes) freed."""
        return self._evict_to(max(0, to_bytes))

    def record(self, digest: bytes) -> tuple[object, int, int, int] | None:
        """(holder, fd, offset, length) of a chunk's bytes in its pack, for zero-copy serving (peers).

        Keep ``holder`` while using ``fd``: the descriptor closes when the last holder lets go. The
        bytes are not verified here (the receiver verifies them); a hit makes the pack recent.
        """
        with self._lock:
            entry = self._index.get(digest)
            if entry is None:
                return None
            seg, offset, length, _ = entry
            if seg.seq in self._segments:
                self._segments.move_to_end(seg.seq)
        return seg, seg.fd, offset, length

    def locate(self, digest: bytes) -> tuple[str, int, int] | None:
        """(pack path, offset, length) of a chunk's bytes, for tools and tests."""
        entry = self._index.get(digest)
        return None if entry is None else (entry[0].path, entry[1], entry[2])

    @property
    def files(self) -> int:
        """Chunks held."""
        return len(self._index)

    @property
    def packs(self) -> int:
        return len(self._segments)


def scan_pack(fd: int) -> Iterator[tuple[bytes, int, int, int]]:
    """(sha256, offset of the bytes, length, crc32) of each whole record of an L2 pack, in order."""
    end = os.fstat(fd).st_size
    off = 0
    with open(fd, "rb", closefd=False) as f:
        while off + _RECORD.size <= end:
            f.seek(off)
            magic, digest, length, crc = _RECORD.unpack(f.read(_RECORD.size))
            if magic != _MAGIC or off + _RECORD.size + length > end:
                return
            yield digest, off + _RECORD.size, length, crc
            off += _RECORD.size + length
