"""The memory tier (L1): verified, decompressed chunks in an LRU bounded in bytes (:class:`MemoryCache`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..layerfmt import Chunk
from ._cache import MemoryCache
from ._tier import ChunkTier, TierConfig


class MemoryTier(ChunkTier):
    name = "memory"
    blocking = False  # dict look-ups: answered on the trio loop
    verified = True  # holds only bytes the fetcher verified

    def __init__(self, cache: MemoryCache):
        self.cache = cache

    def has(self, chunk: Chunk) -> bool:
        return chunk.digest in self.cache

    def get(self, src, chunks: Sequence[Chunk]) -> list[bytes | None]:
        out = [self.cache.get(c.digest) for c in chunks]
        hits = [d for d in out if d is not None]
        m = self.cache.metrics
        if hits:
            m.inc("l1_hits", len(hits))
            m.inc("l1_bytes", sum(map(len, hits)))
        if len(hits) != len(out):
            m.inc("l1_misses", len(out) - len(hits))
        return out

    def put(self, items: Sequence[tuple[Chunk, bytes]]) -> None:
        for c, data in items:
            self.cache.put(c.digest, data)

    def discard(self, chunk: Chunk) -> None:
        self.cache.discard(chunk.digest)


def make_tier(config: TierConfig) -> MemoryTier:
    return MemoryTier(MemoryCache(config.memory_cache_size_bytes, config.metrics))
