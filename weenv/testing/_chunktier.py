"""An in-memory :class:`~weenv.envlet.ChunkTier` for unit tests of the fetcher and of tier order;
the chunk-tier conformance suite (tests/test_chunk_tiers.py) runs against it as against the real tiers.

It holds what it is given (``put``) or seeded with (``seed``), optionally bounded in bytes (LRU),
and does not verify (``verified = False``: the fetcher checks what it answers). Knobs make it
misbehave the ways a peer node could: ``corrupt`` answers wrong bytes for the digests in it,
``fail`` raises from every ``get``, ``delay_s`` slows it. ``calls`` records
``(method, [chunk offsets])`` for tests that count round trips; ``discarded`` the digests the
fetcher told it were bad.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from weenv.envlet._tier import ChunkTier
from weenv.layerfmt import Chunk


class FakeChunkTier(ChunkTier):
    verified = False

    def __init__(self, name: str = "fake", *, capacity_bytes: int | None = None, blocking: bool = True,
                 read_only: bool = False, indexed: bool = True):
        self.name = name
        self.indexed = indexed  # False: has() cannot tell (None), as for a tier that must ask over the network
        self.blocking = blocking
        self.capacity_bytes = capacity_bytes
        self.read_only = read_only
        self.size_bytes = 0
        self.items: OrderedDict[bytes, bytes] = OrderedDict()
        self.corrupt: set[bytes] = set()
        self.fail: Exception | None = None
        self.delay_s = 0.0
        self.calls: list[tuple[str, list[int]]] = []
        self.discarded: list[bytes] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FakeChunkTier({self.name!r}, {len(self.items)} chunks)"

    def seed(self, chunk: Chunk, data: bytes) -> None:
        """Hold ``data`` for ``chunk`` (even in a read-only tier), as a tier filled elsewhere would."""
        self._store(chunk.digest, data)

    def has(self, chunk: Chunk) -> bool | None:
        return chunk.digest in self.items if self.indexed else None

    def get(self, src, chunks: Sequence[Chunk]) -> list[bytes | None]:
        with self._lock:
            self.calls.append(("get", [c.offset for c in chunks]))
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        out: list[bytes | None] = []
        with self._lock:
            for c in chunks:
                data = self.items.get(c.digest)
                if data is not None:
                    self.items.move_to_end(c.digest)
                    if c.digest in self.corrupt:
                        data = bytes([data[0] ^ 0xFF]) + data[1:] if data else b"x"
                out.append(data)
        return out

    def put(self, items: Sequence[tuple[Chunk, bytes]]) -> None:
        with self._lock:
            self.calls.append(("put", [c.offset for c, _ in items]))
        if not self.read_only:
            for c, data in items:
                self._store(c.digest, data)

    def discard(self, chunk: Chunk) -> None:
        with self._lock:
            self.discarded.append(chunk.digest)
            data = self.items.pop(chunk.digest, None)
            if data is not None:
                self.size_bytes -= len(data)
            self.corrupt.discard(chunk.digest)

    def _store(self, digest: bytes, data: bytes) -> None:
        with self._lock:
            if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
                return
            old = self.items.pop(digest, None)
            self.size_bytes += len(data) - (len(old) if old is not None else 0)
            self.items[digest] = bytes(data)
            while self.capacity_bytes is not None and self.size_bytes > self.capacity_bytes:
                _, gone = self.items.popitem(last=False)
                self.size_bytes -= len(gone)

