"""Getting verified chunk bytes: L1 memory → L2 node disk → L3 store range reads.

Rules this module keeps:
- one fetch in flight per chunk: a second reader of a chunk being fetched waits for that fetch
  (with the same deadline) instead of fetching again;
- adjacent missing chunks of one read, plus read-ahead within the file, go out as one range read;
- every chunk is verified (frame size, length, sha256) before it is cached or served, whether it
  comes from the store or from L2 (:func:`weenv.layerfmt.verify_chunk`);
- decompression, hashing and disk I/O run in worker threads, never on the trio loop;
- a failing store becomes :class:`FetchError` within ``deadline_s``, never a hang; and a read of a
  chunk whose fetch failed less than ``failure_memory_s`` ago fails at once with that error (the
  kernel retries a failed read-ahead with a read of its own, which made one ``read()`` wait twice
  the deadline);
- background prefetch yields to foreground reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from ..layerfmt import Chunk, LayerError, RandomAccessReader, decompress_chunk, verify_chunk
from ._cache import DiskCache, MemoryCache
from ._errors import ChunkIntegrityError, FetchError
from ._metrics import Metrics

log = logging.getLogger("weenv.envlet")
# How long a chunk whose fetch failed (store unreachable, deadline) fails again at once. It covers
# the kernel's retry of a failed read-ahead (same read() call, milliseconds later), short enough
# that a store back up is used by the next read a person or program makes.
FAILURE_MEMORY_S = 1.0


@dataclass
class LayerSource:
    """What the fetcher needs from a registered layer."""

    name: str  # short stable name, for logs
    reader: RandomAccessReader  # blocking range reads against the store (called in worker threads)


@dataclass
class _InFlight:
    event: trio.Event = field(default_factory=trio.Event)
    data: bytes | None = None
    error: BaseException | None = None


class Fetcher:
    def __init__(
        self,
        l1: MemoryCache,
        l2: DiskCache,
        metrics: Metrics,
        *,
        deadline_s: float = 30.0,
        max_concurrent_fetches: int = 8,
        merge_gap_bytes: int = 16 << 10,
        max_run_bytes: int = 8 << 20,
        failure_memory_s: float = FAILURE_MEMORY_S,
    ):
        self.l1, self.l2, self.metrics = l1, l2, metrics
        self.deadline_s = deadline_s
        self.failure_memory_s = failure_memory_s
        self._failures: dict[bytes, tuple[float, FetchError]] = {}  # digest -> (trio time, error)
        self.merge_gap_bytes = merge_gap_bytes
        self.max_run_bytes = max_run_bytes
        self._inflight: dict[bytes, _InFlight] = {}
        self._fetch_limiter = trio.CapacityLimiter(max_concurrent_fetches)
        self._foreground = 0
        self._foreground_idle = trio.Event()
        self._foreground_idle.set()
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery) -> None:
        """Give the fetcher a nursery for background work (L2 write-back, async read-ahead, prefetch)."""
        self._nursery = nursery

    # ----------------------------------------------------------------- foreground

    async def get(self, src: LayerSource, chunks: Sequence[Chunk], path: str,
                  readahead: Sequence[Chunk] = (), neighbors: Sequence[Chunk] = ()) -> list[bytes]:
        """Verified bytes of ``chunks`` (in order).

        ``readahead`` (the rest of the file) is fetched along when a chunk misses and loaded in the
        background otherwise; ``neighbors`` (chunks that follow in the blob, usually small files of the
        same directory) only ride along with a remote fetch, which saves round trips at a small cost.
        """
        results: list[bytes | None] = [None] * len(chunks)
        missing = []
        for i, c in enumerate(chunks):
            data = self.l1.get(c.digest)
            if data is None:
                missing.append(i)
            else:
                results[i] = data
        m = self.metrics
        if len(missing) != len(chunks):
            hit_bytes = sum(len(results[i] or b"") for i in range(len(chunks)) if i not in missing)
            m.inc("l1_hits", len(chunks) - len(missing))
            m.inc("l1_bytes", hit_bytes)
        if not missing:
            if readahead:
                self._readahead_async(src, readahead, path)
            return results  # type: ignore[return-value]
        m.inc("l1_misses", len(missing))
        self._fail_fast(chunks, missing)
        self._foreground += 1
        self._foreground_idle = trio.Event() if self._foreground_idle.is_set() else self._foreground_idle
        try:
            with trio.fail_after(self.deadline_s):
                waits: list[tuple[int, _InFlight]] = []
                claimed: list[Chunk] = []
                claimed_pos: dict[bytes, list[int]] = {}
                for i in missing:
                    c = chunks[i]
                    fl = self._inflight.get(c.digest)
                    if fl is not None:
                        waits.append((i, fl))
                        m.inc("coalesced_waits")
                    elif c.digest in claimed_pos:
                        claimed_pos[c.digest].append(i)
                    else:
                        self._inflight[c.digest] = _InFlight()
                        claimed.append(c)
                        claimed_pos[c.digest] = [i]
                if claimed:
                    extra = [c for c in (*readahead, *neighbors) if self._claimable(c)]
                    for c in extra:
                        self._inflight[c.digest] = _InFlight()
                    mine = {c.digest: self._inflight[c.digest] for c in claimed}
                    try:
                        await self._load(src, claimed, extra, path)
                    finally:
                        for c in claimed:  # later readers must retry, not inherit a stale failure
                            self._release(c.digest)
                    for c in claimed:
                        for i in claimed_pos[c.digest]:
                            results[i] = self._result(mine[c.digest], src, path)
                for i, fl in waits:
                    await fl.event.wait()
                    results[i] = self._result(fl, src, path)
        except trio.TooSlowError:
            err = FetchError(
                f"layer {src.name}: {path}: no data within the {self.deadline_s:g} s deadline (store unreachable or slow)"
            )
            self._remember_failure(chunks, missing, err)
            raise err from None
        except FetchError as e:
            self._remember_failure(chunks, missing, e)
            raise
        finally:
            self._foreground -= 1
            if self._foreground == 0:
                self._foreground_idle.set()
        if readahead:
            self._readahead_async(src, readahead, path)
        return results  # type: ignore[return-value]

    def _fail_fast(self, chunks: Sequence[Chunk], missing: list[int]) -> None:
        if not self._failures:
            return
        now = trio.current_time()
        for i in missing:
            failed = self._failures.get(chunks[i].digest)
            if failed is not None:
                if now - failed[0] < self.failure_memory_s:
                    self.metrics.inc("failed_fast")
                    raise FetchError(f"{failed[1]} (failed {now - failed[0]:.2f} s ago; tried again after "
                                     f"{self.failure_memory_s:g} s)")
                del self._failures[chunks[i].digest]

    def _remember_failure(self, chunks: Sequence[Chunk], missing: list[int], err: FetchError) -> None:
        now = trio.current_time()
        if len(self._failures) > 10_000:  # bounded: forget what is past its memory
            self._failures = {d: v for d, v in self._failures.items() if now - v[0] < self.failure_memory_s}
        for i in missing:
            if chunks[i].digest not in self.l1:
                self._failures[chunks[i].digest] = (now, err)

    def _claimable(self, c: Chunk) -> bool:
        return c.digest not in self._inflight and c.digest not in self.l1 and c.digest not in self.l2

    def _release(self, digest: bytes) -> None:
        fl = self._inflight.pop(digest, None)
        if fl is not None and not fl.event.is_set():
            fl.error = fl.error or FetchError("fetch ended without data")
            fl.event.set()

    @staticmethod
    def _result(fl: _InFlight, src: LayerSource, path: str) -> bytes:
        if fl.error is not None:
            if isinstance(fl.error, (FetchError, ChunkIntegrityError)):
                raise fl.error
            raise FetchError(f"layer {src.name}: {path}: {fl.error}") from fl.error
        assert fl.data is not None
        return fl.data

    # ----------------------------------------------------------------- loading

    async def _load(self, src: LayerSource, claimed: list[Chunk], extra: list[Chunk], path: str,
                    *, background: bool = False) -> None:
        """Resolve every claimed chunk (data or error); never leaves a claim unresolved."""
        all_claims = claimed + extra
        try:
            l2 = self.l2
            found = await trio.to_thread.run_sync(lambda: [l2.get(c.digest, c.ulength) for c in claimed])
            remote: list[Chunk] = []
            for c, data in zip(claimed, found):
                if data is None:
                    remote.append(c)
                else:
                    self._resolve(c.digest, data)
            if extra:
                self.metrics.inc("readahead_chunks", len(extra))
            remote += extra
            if remote:
                async with trio.open_nursery() as n:
                    for run in self._runs(remote):
                        n.start_soon(self._fetch_run, src, run, path, background)
        except BaseException as e:  # cancelled (deadline) or a thread died: fail every open claim
            err = FetchError(f"layer {src.name}: {path}: {type(e).__name__} while fetching")
            for c in all_claims:
                fl = self._inflight.get(c.digest)
                if fl is not None and not fl.event.is_set():
                    fl.error = err
                    fl.event.set()
            raise
        finally:
            for c in extra:  # read-ahead claims have no reader of their own
                self._release(c.digest)

    def _runs(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """Group chunks into blob ranges: neighbours closer than merge_gap_bytes share one request."""
        runs: list[list[Chunk]] = []
        for c in sorted(chunks, key=lambda c: c.offset):
            if runs:
                last = runs[-1][-1]
                gap = c.offset - (last.offset + last.length)
                if 0 <= gap <= self.merge_gap_bytes and c.offset + c.length - runs[-1][0].offset <= self.max_run_bytes:
                    runs[-1].append(c)
                    continue
            runs.append([c])
        return runs

    async def _fetch_run(self, src: LayerSource, run: list[Chunk], path: str, background: bool) -> None:
        """Fetch one blob range and resolve each of its chunks (errors included: never raises but Cancelled)."""
        start = run[0].offset
        length = run[-1].offset + run[-1].length - start
        m = self.metrics
        try:
            async with self._fetch_limiter:
                t0 = time.monotonic()
                m.inc("remote_fetches")
                blob = await trio.to_thread.run_sync(src.reader.read_at, start, length, abandon_on_cancel=True)
                m.observe_fetch(time.monotonic() - t0)
            if len(blob) != length:
                raise FetchError(f"short read from the store ({len(blob)} of {length} bytes)")
        except Exception as e:
            m.inc("remote_errors")
            log.warning("layer %s: %s: range %d+%d failed: %s", src.name, path, start, length, e)
            err = FetchError(f"layer {src.name}: {path}: store read failed: {e}")
            for c in run:
                self._fail(c.digest, err)
            return
        m.inc("remote_bytes", length)
        m.inc("remote_chunks", len(run))
        if background:
            m.inc("prefetch_bytes", length)

        def decode_all() -> list[bytes | BaseException]:
            out: list[bytes | BaseException] = []
            for c in run:
                try:
                    data = decompress_chunk(c, blob[c.offset - start : c.offset - start + c.length], path=path)
                    verify_chunk(data, c.digest, path=path, offset=c.offset)  # store bytes are outside bytes
                    out.append(data)
                except LayerError as e:
                    out.append(e)
            return out

        decoded = await trio.to_thread.run_sync(decode_all)
        good: list[tuple[bytes, bytes]] = []
        for c, data in zip(run, decoded):
            if isinstance(data, BaseException):
                m.inc("verify_failures")
                log.error("layer %s: %s: chunk at %d failed verification: %s", src.name, path, c.offset, data)
                self._fail(c.digest, ChunkIntegrityError(f"layer {src.name}: {path}: {data}"))
            else:
                self._resolve(c.digest, data)
                good.append((c.digest, data))
        if good:
            self._write_back(good)

    def _resolve(self, digest: bytes, data: bytes) -> None:
        self._failures.pop(digest, None)
        self.l1.put(digest, data)
        fl = self._inflight.get(digest)
        if fl is not None and not fl.event.is_set():
            fl.data = data
            fl.event.set()

    def _fail(self, digest: bytes, err: BaseException) -> None:
        fl = self._inflight.get(digest)
        if fl is not None and not fl.event.is_set():
            fl.error = err
            fl.event.set()

    def _write_back(self, items: list[tuple[bytes, bytes]]) -> None:
        l2 = self.l2

        def write() -> None:
            for digest, data in items:
                l2.put(digest, data)

        if self._nursery is None:
            write()
        else:
            self._nursery.start_soon(trio.to_thread.run_sync, write)

    # ----------------------------------------------------------------- background

    def _readahead_async(self, src: LayerSource, chunks: Sequence[Chunk], path: str) -> None:
        """Start loading the chunks after a read: from L2 into L1, or from the store, without waiting."""
        if self._nursery is None:
            return
        local, remote = [], []
        for c in chunks:
            if c.digest in self._inflight or c.digest in self.l1:
                continue
            (local if c.digest in self.l2 else remote).append(c)
            self._inflight[c.digest] = _InFlight()
        if local:
            self._nursery.start_soon(self._background_l2, local)
        if remote:
            self._nursery.start_soon(self._background_load, src, remote, path)

    async def _background_l2(self, chunks: list[Chunk]) -> None:
        """Load chunks from L2 into L1 in parallel: separate chunk files read one by one are latency-bound."""

        async def one(c: Chunk) -> None:
            try:
                data = await trio.to_thread.run_sync(self.l2.get, c.digest, c.ulength)
                if data is not None:
                    self._resolve(c.digest, data)
            finally:
                self._release(c.digest)

        async with trio.open_nursery() as n:
            for c in chunks:
                n.start_soon(one, c)

    async def _background_load(self, src: LayerSource, chunks: list[Chunk], path: str) -> None:
        try:
            with trio.move_on_after(self.deadline_s):
                await self._load(src, [], chunks, path, background=True)
        except (FetchError, ChunkIntegrityError) as e:
            log.info("layer %s: %s: read-ahead failed: %s", src.name, path, e)

    async def prefetch(self, src: LayerSource, chunks: Sequence[Chunk], *, batch_bytes: int = 4 << 20) -> int:
        """Fetch ``chunks`` into L2 in the background, yielding to foreground reads; returns bytes fetched."""
        fetched = 0
        batch: list[Chunk] = []
        size = 0
        for c in chunks:
            batch.append(c)
            size += c.length
            if size >= batch_bytes:
                fetched += await self._prefetch_batch(src, batch)
                batch, size = [], 0
        if batch:
            fetched += await self._prefetch_batch(src, batch)
        return fetched

    async def _prefetch_batch(self, src: LayerSource, batch: list[Chunk]) -> int:
        while self._foreground:
            await self._foreground_idle.wait()
        todo = [c for c in batch if self._claimable(c)]
        if not todo:
            return 0
        for c in todo:
            self._inflight[c.digest] = _InFlight()
        try:
            with trio.move_on_after(self.deadline_s):
                await self._load(src, [], todo, "(prefetch)", background=True)
        except (FetchError, ChunkIntegrityError) as e:
            log.info("layer %s: prefetch failed: %s", src.name, e)
            return 0
        return sum(c.length for c in todo)
