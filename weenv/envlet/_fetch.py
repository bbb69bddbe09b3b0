"""Getting verified chunk bytes from the chunk tiers, in their configured order (:mod:`._tier`).

    memory (L1) ─► disk (L2) ─► registry (L3)          the default; ``--tiers`` changes it

Rules this module keeps, whatever the tiers:
- one fetch in flight per chunk: a second reader of a chunk being fetched waits for that fetch
  (with the same deadline) instead of fetching again;
- adjacent missing chunks of one read, plus read-ahead within the file, are asked of a tier
  together; a range-reading tier (``merge_gap_bytes`` set: the registry) gets them as runs of
  neighbours, one range request each;
- no chunk is cached or served unverified: a tier either checks its bytes with
  :func:`weenv.layerfmt.verify_chunk` itself (``verified``) or the fetcher does, in the worker
  thread that got them; a chunk that fails is counted, discarded from that tier and asked of the
  next one; a chunk found in tier *k* is written back to tiers ``0..k-1``;
- a tier that fails is a miss for its chunks (counted), except the last, whose error fails the read;
- decompression, hashing and disk I/O run in worker threads, never on the trio loop;
- a failing store becomes :class:`FetchError` within ``deadline_s``, never a hang; and a read of a
  chunk whose fetch failed less than ``failure_memory_s`` ago fails at once with that error (the
  kernel retries a failed read-ahead with a read of its own, which made one ``read()`` wait twice
  the deadline);
- background prefetch yields to foreground reads.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from ..layerfmt import Chunk, IntegrityError, LayerError, RandomAccessReader, verify_chunk
from ._errors import ChunkIntegrityError, FetchError
from ._metrics import Metrics
from ._tier import ChunkTier

log = logging.getLogger("weenv.envlet")
# How long a chunk whose fetch failed (store unreachable, deadline) fails again at once. It covers
# the kernel's retry of a failed read-ahead (same read() call, milliseconds later), short enough
# that a store back up is used by the next read a person or program makes.
FAILURE_MEMORY_S = 1.0
_Answer = bytes | LayerError | BaseException | None
_OWN = contextvars.ContextVar("weenv_fetch_own", default=False)  # set in get() for this node's own reads


@dataclass
class LayerSource:
    """What the fetcher needs from a registered layer."""

    name: str  # short stable name, for logs
    reader: RandomAccessReader  # blocking range reads against the store (called in worker threads)
    digest: str = ""  # the layer blob's digest (the peer tier asks the peers that hold this layer)


@dataclass
class _InFlight:
    event: trio.Event = field(default_factory=trio.Event)
    data: bytes | None = None
    error: BaseException | None = None


@dataclass
class TierStats:
    """What one tier did for the fetcher (``stats()["tiers"]``)."""

    hits: int = 0  # chunks it answered with good bytes
    hit_bytes: int = 0
    misses: int = 0  # chunks asked (or skipped: has() said no) that it did not hold
    rejected: int = 0  # chunks whose bytes failed verification (then asked of the next tier)
    errors: int = 0  # calls that raised (their chunks asked of the next tier)


class Fetcher:
    def __init__(
        self,
        tiers: Sequence[ChunkTier],
        metrics: Metrics,
        *,
        deadline_s: float = 30.0,
        failure_memory_s: float = FAILURE_MEMORY_S,
    ):
        self.tiers = list(tiers)
        if not self.tiers:
            raise ValueError("the fetcher needs one or more chunk tiers")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"chunk tier names must differ: {names}")
        self.metrics = metrics
        # leading tiers answered on the loop (memory): looked up before any claim is made
        self._fast = 0
        while self._fast < len(self.tiers) and not self.tiers[self._fast].blocking and self.tiers[self._fast].verified:
            self._fast += 1
        self._limiters = {i: trio.CapacityLimiter(t.max_concurrency) for i, t in enumerate(self.tiers)
                          if t.max_concurrency}
        self.tier_stats = {t.name: TierStats() for t in self.tiers}
        # per layer (source name) and tier after the fast ones: [chunks, bytes] answered (peer vs registry)
        self.layer_tiers: dict[str, dict[str, list[int]]] = {}
        self.deadline_s = deadline_s
        self.failure_memory_s = failure_memory_s
        self._failures: dict[bytes, tuple[float, FetchError]] = {}  # digest -> (trio time, error)
        self._inflight: dict[bytes, _InFlight] = {}
        self._foreground = 0
        self._foreground_idle = trio.Event()
        self._foreground_idle.set()
        self._own_waits = 0  # own reads in a call of a tier with peer_serving_yields (see serving_yields)
        self._own_waits_idle = trio.Event()
        self._own_waits_idle.set()
        self._nursery: trio.Nursery | None = None

    @property
    def foreground_busy(self) -> bool:
        """Reads of this node are waiting for chunks (peer serving yields to them)."""
        return self._foreground > 0

    @property
    def serving_yields(self) -> bool:
        """This node's own reads wait on a tier peer serving competes with (disk, registry): serve less."""
        return self._own_waits > 0

    async def own_waits_done(self) -> None:
        """Return once no own read waits on such a tier (at once when none does)."""
        while self._own_waits:
            await self._own_waits_idle.wait()

    def attach(self, nursery: trio.Nursery) -> None:
        """Give the fetcher a nursery for background work (write-back, async read-ahead, prefetch)."""
        self._nursery = nursery

    def tier(self, name: str) -> ChunkTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no chunk tier named {name!r} (tiers: {', '.join(t.name for t in self.tiers)})")

    # ----------------------------------------------------------------- foreground

    async def get(self, src: LayerSource, chunks: Sequence[Chunk], path: str,
                  readahead: Sequence[Chunk] = (), neighbors: Sequence[Chunk] = (), *,
                  own: bool = True) -> list[bytes]:
        """Verified bytes of ``chunks`` (in order).

        ``readahead`` (the rest of the file) is fetched along when a chunk misses and loaded in the
        background otherwise; ``neighbors`` (chunks that follow in the blob, usually small files of the
        same directory) only ride along with a remote fetch, which saves round trips at a small cost.
        """
        results: list[bytes | None] = [None] * len(chunks)
        missing = list(range(len(chunks)))
        for k in range(self._fast):
            tier = self.tiers[k]
            got = tier.get(src, [chunks[i] for i in missing])
            still = []
            st = self.tier_stats[tier.name]
            for i, data in zip(missing, got):
                if isinstance(data, bytes):
                    results[i] = data
                    st.hits += 1
                    st.hit_bytes += len(data)
                    for earlier in self.tiers[:k]:
                        earlier.put([(chunks[i], data)])
                else:
                    still.append(i)
            st.misses += len(still)
            missing = still
            if not missing:
                break
        if not missing:
            if readahead:
                self._readahead_async(src, readahead, path)
            return results  # type: ignore[return-value]
        m = self.metrics
        self._fail_fast(chunks, missing)
        _OWN.set(own)  # this task's context (and its children's): get() runs in a task of its own
        if own:
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
            if own:
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
            if not self._held_fast(chunks[i]):
                self._failures[chunks[i].digest] = (now, err)

    def _held_fast(self, c: Chunk) -> bool:
        return any(t.has(c) for t in self.tiers[: self._fast])

    def _claimable(self, c: Chunk) -> bool:
        return c.digest not in self._inflight and not any(t.has(c) for t in self.tiers)

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
            if extra:
                self.metrics.inc("readahead_chunks", len(extra))
            await self._walk(src, all_claims, path, background)
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

    async def _walk(self, src: LayerSource, chunks: list[Chunk], path: str, background: bool, start: int = -1,
                    errors: dict[bytes, BaseException] | None = None) -> None:
        """Ask the tiers after the fast ones (from ``start``), in order, for claimed ``chunks``; resolve or
        fail each claim.

        A tier that splits the chunks into groups (:meth:`ChunkTier.split`) has each group walk on by itself:
        one group's wait (a peer fetching a region for us) never holds up another group's claims —
        which a peer may be waiting for (a cycle of two nodes each waiting for the other otherwise).
        Raises only on cancellation.
        """
        pending = chunks
        errors = {} if errors is None else errors
        m = self.metrics
        for idx in range(self._fast if start < 0 else start, len(self.tiers)):
            if not pending:
                break
            tier = self.tiers[idx]
            st = self.tier_stats[tier.name]
            ask, rest = [], []
            for c in pending:
                (rest if tier.has(c) is False else ask).append(c)
            st.misses += len(rest)
            if not ask:
                continue
            groups = tier.split(src, ask) if len(ask) > 1 else [ask]
            if len(groups) > 1:
                async with trio.open_nursery() as n:
                    for g in groups:
                        n.start_soon(self._walk, src, list(g), path, background, idx, errors)
                    if rest:
                        n.start_soon(self._walk, src, rest, path, background, idx + 1, errors)
                return
            answers: dict[bytes, _Answer] = {}
            batches = self._batches(tier, ask)
            if len(batches) == 1:
                await self._ask(idx, src, batches[0], path, answers, background)
            else:
                async with trio.open_nursery() as n:
                    for batch in batches:
                        n.start_soon(self._ask, idx, src, batch, path, answers, background)
            still: list[Chunk] = []
            good: list[tuple[Chunk, bytes]] = []
            for c in pending:
                a = answers.get(c.digest)
                if isinstance(a, bytes):
                    st.hits += 1
                    st.hit_bytes += len(a)
                    self._resolve(c, a, idx)
                    good.append((c, a))
                    continue
                still.append(c)
                if isinstance(a, LayerError):
                    st.rejected += 1
                    m.inc("verify_failures")
                    log.error("layer %s: %s: chunk at %d from the %s tier failed verification: %s",
                              src.name, path, c.offset, tier.name, a)
                    errors[c.digest] = ChunkIntegrityError(f"layer {src.name}: {path}: {tier.name} tier: {a}")
                    try:
                        tier.discard(c)
                    except Exception as e:  # a tier that cannot forget still never serves: we verify
                        log.warning("%s tier: discard failed: %s", tier.name, e)
                elif isinstance(a, BaseException):
                    errors[c.digest] = FetchError(f"layer {src.name}: {path}: {tier.name} read failed: {a}")
                elif c.digest in answers:
                    st.misses += 1
            if good:
                per = self.layer_tiers.get(src.name)
                if per is None and len(self.layer_tiers) < 10_000:
                    per = self.layer_tiers[src.name] = {}
                if per is not None:
                    acc = per.setdefault(tier.name, [0, 0])
                    acc[0] += len(good)
                    acc[1] += sum(len(a) for _, a in good)
                self._write_back(idx, good)
            pending = still
        for c in pending:
            self._fail(c.digest, errors.get(c.digest) or FetchError(
                f"layer {src.name}: {path}: no tier holds the chunk at blob offset {c.offset} "
                f"(asked {', '.join(t.name for t in self.tiers[self._fast:])})"))

    def _batches(self, tier: ChunkTier, chunks: list[Chunk]) -> list[list[Chunk]]:
        """One call for all, or runs of blob neighbours for a range-reading tier (one request a run)."""
        gap, max_run = tier.merge_gap_bytes, tier.max_run_bytes
        if gap is None:
            return [chunks]
        runs: list[list[Chunk]] = []
        for c in sorted(chunks, key=lambda c: c.offset):
            if runs:
                last = runs[-1][-1]
                d = c.offset - (last.offset + last.length)
                if 0 <= d <= gap and (max_run is None or c.offset + c.length - runs[-1][0].offset <= max_run):
                    runs[-1].append(c)
                    continue
            runs.append([c])
        return runs

    async def _ask(self, idx: int, src: LayerSource, batch: list[Chunk], path: str,
                   answers: dict[bytes, _Answer], background: bool) -> None:
        """One call of a tier's get (in a worker thread when it blocks); never raises but Cancelled."""
        tier = self.tiers[idx]
        check = not tier.verified

        def call() -> list[_Answer]:
            got: list[_Answer] = list(tier.get(src, batch))
            if len(got) != len(batch):
                raise FetchError(f"{tier.name} tier answered {len(got)} items for {len(batch)} chunks")
            if check:
                for k, (c, data) in enumerate(zip(batch, got)):
                    if data is not None and not isinstance(data, LayerError):
                        try:
                            if not isinstance(data, (bytes, bytearray, memoryview)):
                                raise IntegrityError(f"the tier answered a {type(data).__name__}, not bytes")
                            if len(data) != c.ulength:
                                raise IntegrityError(f"{len(data)} bytes, the TOC says {c.ulength}",
                                                     path=path, offset=c.offset)
                            verify_chunk(data, c.digest, path=path, offset=c.offset)
                            got[k] = bytes(data)
                        except LayerError as e:
                            got[k] = e
            return got

        own_wait = not background and tier.peer_serving_yields and _OWN.get()
        if own_wait:
            self._own_waits += 1
            if self._own_waits_idle.is_set():
                self._own_waits_idle = trio.Event()
        try:
            if not tier.blocking:
                got = call()
            else:
                limiter = self._limiters.get(idx)
                if limiter is None:
                    got = await trio.to_thread.run_sync(call, abandon_on_cancel=True)
                else:
                    async with limiter:
                        got = await trio.to_thread.run_sync(call, abandon_on_cancel=True)
        except Exception as e:
            self._own_wait_end(own_wait)
            self.tier_stats[tier.name].errors += 1
            log.warning("layer %s: %s: %s tier failed for %d chunks at %d: %s", src.name, path, tier.name,
                        len(batch), batch[0].offset, e)
            for c in batch:
                answers[c.digest] = e
            return
        except BaseException:
            self._own_wait_end(own_wait)
            raise
        self._own_wait_end(own_wait)
        for c, data in zip(batch, got):
            answers[c.digest] = data
        if background and tier.has(batch[0]) is None:  # fetched from off the node
            span = (batch[-1].offset + batch[-1].length - batch[0].offset if tier.merge_gap_bytes is not None
                    else sum(c.length for c in batch))
            self.metrics.inc("prefetch_bytes", span)

    def _own_wait_end(self, own_wait: bool) -> None:
        if own_wait:
            self._own_waits -= 1
            if self._own_waits == 0:
                self._own_waits_idle.set()

    def _resolve(self, c: Chunk, data: bytes, idx: int) -> None:
        self._failures.pop(c.digest, None)
        for t in self.tiers[: min(idx, self._fast)]:
            t.put([(c, data)])
        fl = self._inflight.get(c.digest)
        if fl is not None and not fl.event.is_set():
            fl.data = data
            fl.event.set()

    def _fail(self, digest: bytes, err: BaseException) -> None:
        fl = self._inflight.get(digest)
        if fl is not None and not fl.event.is_set():
            fl.error = err
            fl.event.set()

    def _write_back(self, idx: int, items: list[tuple[Chunk, bytes]]) -> None:
        """Verified chunks found in tier ``idx`` go to the blocking tiers before it (in the background)."""
        targets = [t for t in self.tiers[self._fast : idx]]
        if not targets:
            return

        def write() -> None:
            for t in targets:
                try:
                    t.put(items)
                except Exception as e:  # a cache that cannot store degrades to fetching again
                    log.warning("%s tier: storing %d chunks failed: %s", t.name, len(items), e)

        if self._nursery is None:
            write()
        else:
            self._nursery.start_soon(trio.to_thread.run_sync, write)

    # ----------------------------------------------------------------- background

    def _readahead_async(self, src: LayerSource, chunks: Sequence[Chunk], path: str) -> None:
        """Start loading the chunks after a read: from a node tier into memory, or fetched, without waiting."""
        if self._nursery is None:
            return
        local, remote = [], []
        for c in chunks:
            if c.digest in self._inflight or self._held_fast(c):
                continue
            (local if any(t.has(c) for t in self.tiers[self._fast :]) else remote).append(c)
            self._inflight[c.digest] = _InFlight()
        if local:
            self._nursery.start_soon(self._background_local, src, local, path)
        if remote:
            self._nursery.start_soon(self._background_load, src, remote, path)

    async def _background_local(self, src: LayerSource, chunks: list[Chunk], path: str) -> None:
        """Load chunks held on the node in parallel: chunks read one by one are latency-bound."""

        async def one(c: Chunk) -> None:
            try:
                await self._walk(src, [c], path, True)
            finally:
                self._release(c.digest)

        with trio.move_on_after(self.deadline_s):
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
