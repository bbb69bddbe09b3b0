"""The disk tier (L2): the node-wide content-addressed chunk store in pack files (:class:`DiskCache`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..layerfmt import Chunk
from ._cache import DiskCache
from ._tier import ChunkTier, TierConfig


class DiskTier(ChunkTier):
    name = "disk"
    blocking = True
    # DiskCache.get checks each record's length and sha256 (verify_chunk) and forgets one that fails
    # (counted as l2_corrupt): a corrupt record is a miss, and the next tier's bytes replace it.
    verified = True

    def __init__(self, cache: DiskCache):
        self.cache = cache

    def has(self, chunk: Chunk) -> bool:
        return chunk.digest in self.cache

    def get(self, src, chunks: Sequence[Chunk]) -> list[bytes | None]:
        return [self.cache.get(c.digest, c.ulength) for c in chunks]

    def put(self, items: Sequence[tuple[Chunk, bytes]]) -> None:
        for c, data in items:
            self.cache.put(c.digest, data)

    def discard(self, chunk: Chunk) -> None:
        self.cache.discard(chunk.digest)


def make_tier(config: TierConfig) -> DiskTier:
    return DiskTier(DiskCache(os.path.join(config.cache_dir, "l2"), config.cache_size_bytes, config.metrics))
