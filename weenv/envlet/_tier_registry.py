"""The registry tier (L3): range reads of the layer's blob from its store, one request per run of chunks.

Read-only (``put`` keeps nothing). Each chunk's frame is decompressed and checked with
:func:`weenv.layerfmt.verify_chunk` in the worker thread that read it; a frame that does not
decompress or hash is answered as a :class:`~weenv.layerfmt.LayerError`, never as bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..layerfmt import Chunk, LayerError, decompress_chunk, verify_chunk
from ._errors import FetchError
from ._metrics import Metrics
from ._tier import ChunkTier, TierConfig

if TYPE_CHECKING:
    from ._fetch import LayerSource

log = logging.getLogger("weenv.envlet")


class RegistryTier(ChunkTier):
    name = "registry"
    blocking = True
    verified = True

    def __init__(self, metrics: Metrics, *, max_concurrent_fetches: int = 8, merge_gap_bytes: int = 16 << 10,
                 max_run_bytes: int = 8 << 20):
        self.metrics = metrics
        self.max_concurrency = max_concurrent_fetches
        self.merge_gap_bytes = merge_gap_bytes
        self.max_run_bytes = max_run_bytes

    def has(self, chunk: Chunk) -> None:
        return None  # only a request can tell

    def get(self, src: "LayerSource", chunks: Sequence[Chunk]) -> list[bytes | LayerError | None]:
        start = chunks[0].offset
        length = chunks[-1].offset + chunks[-1].length - start
        m = self.metrics
        m.inc("remote_fetches")
        t0 = time.monotonic()
        try:
            blob = src.reader.read_at(start, length)
            if len(blob) != length:
                raise FetchError(f"short read from the store ({len(blob)} of {length} bytes)")
        except Exception:
            m.inc("remote_errors")
            raise
        m.observe_fetch(time.monotonic() - t0)
        m.inc("remote_bytes", length)
        m.inc("remote_chunks", len(chunks))
        out: list[bytes | LayerError | None] = []
        for c in chunks:
            try:
                data = decompress_chunk(c, blob[c.offset - start : c.offset - start + c.length])
                verify_chunk(data, c.digest, offset=c.offset)  # store bytes are outside bytes
                out.append(data)
            except LayerError as e:
                out.append(e)
        return out

    def put(self, items: Sequence[tuple[Chunk, bytes]]) -> None:
        return None  # the store is the source, not a cache


def make_tier(config: TierConfig) -> RegistryTier:
    return RegistryTier(config.metrics, max_concurrent_fetches=config.max_concurrent_fetches,
                        merge_gap_bytes=config.merge_gap_bytes, max_run_bytes=config.max_run_bytes)
