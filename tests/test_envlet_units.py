"""Envlet logic without FUSE: the presented tree, the disk cache, the fetcher's rules (fake readers)."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import threading

import pytest
import trio

from weenv import layerfmt
from weenv.envlet import DiskCache, FetchError, Fetcher, LayerSource, LayerTree, MemoryCache, Metrics
from weenv.envlet._tier_disk import DiskTier
from weenv.envlet._tier_memory import MemoryTier
from weenv.envlet._tier_registry import RegistryTier
from weenv.layerfmt import BytesReader, Layer

from .layertrees import d, f, hard, make_tar, sym


def layer_of(*nodes, **kw) -> Layer:
    out = io.BytesIO()
    layerfmt.build_layer(io.BytesIO(make_tar(*nodes)), out, **kw)
    return Layer.open(BytesReader(out.getvalue()))


# ------------------------------------------------------------------------------------- tree


def test_tree_presents_whiteouts_opaque_dirs_hardlinks_and_implicit_dirs():
    lay = layer_of(d("etc"), f("etc/passwd", b"x"), f("etc/.wh.group"), d("var/cache"), f("var/cache/.wh..wh..opq"),
                   f("deep/implicit/file", b"i"), hard("etc/passwd-hl", "etc/passwd"), sym("link", "etc/passwd"),
                   f(".wh.top"), f("etc/.wh.passwd"))
    t = LayerTree(lay.columns)
    etc = t.lookup(1, b"etc")
    assert etc is not None and t.is_dir(etc)
    group = t.lookup(etc, b"group")
    a = t.attr(group)
    assert stat.S_ISCHR(a.mode) and a.rdev == 0 and stat.S_IMODE(a.mode) == 0
    assert t.lookup(etc, b".wh.group") is None
    passwd = t.lookup(etc, b"passwd")
    assert stat.S_ISREG(t.attr(passwd).mode)  # a real entry beats a whiteout of the same name
    assert t.lookup(etc, b"passwd-hl") == passwd and t.attr(passwd).nlink == 2
    cache = t.lookup(t.lookup(1, b"var"), b"cache")
    assert t.xattrs(cache) == {"trusted.overlay.opaque": b"y"} and t.listing(cache) == []
    implicit = t.lookup(1, b"deep")
    assert t.entry_index(implicit) == -1 and t.attr(implicit).mode == stat.S_IFDIR | 0o755
    assert t.lookup(t.lookup(implicit, b"implicit"), b"file") is not None
    assert t.readlink(t.lookup(1, b"link")) == b"etc/passwd"
    assert stat.S_ISCHR(t.attr(t.lookup(1, b"top")).mode)
    names = [n for n, _ in t.listing(1)]
    assert names == sorted(names) and b"top" in names and b".wh.top" not in names
    assert t.attr(1).nlink == 2 + 3  # etc, var, deep


def test_tree_of_a_layer_with_a_root_entry_uses_its_metadata():
    out = io.BytesIO()
    layerfmt.build_entries([layerfmt.SourceEntry(".", "dir", mode=0o700, uid=5, gid=6, mtime=77)], out)
    t = LayerTree(Layer.open(BytesReader(out.getvalue())).columns)
    a = t.attr(1)
    assert (a.mode, a.uid, a.gid, a.mtime) == (stat.S_IFDIR | 0o700, 5, 6, 77)


# ------------------------------------------------------------------------------------- disk cache


def test_disk_cache_bound_eviction_restart_and_corruption(tmp_path):
    m = Metrics()
    c = DiskCache(str(tmp_path / "l2"), 10_000, m)  # packs of 625 bytes: one chunk each, exact LRU
    items = [os.urandom(3000) for _ in range(6)]
    keys = [hashlib.sha256(x).digest() for x in items]
    for k, x in zip(keys, items):
        c.put(k, x)
        assert c.size_bytes <= 10_000
    assert c.get(keys[-1], 3000) == items[-1]
    assert c.get(keys[0], 3000) is None  # evicted first
    assert m.counters["l2_evictions"] >= 3
    assert len(os.listdir(tmp_path / "l2" / "packs")) == c.packs  # evicted packs are deleted
    # a restart rebuilds the index from the packs
    c2 = DiskCache(str(tmp_path / "l2"), 10_000, Metrics())
    assert c2.size_bytes == c.size_bytes and c2.files == c.files and c2.get(keys[-1], 3000) == items[-1]
    # a record torn by a crash: the restart cuts the pack before it
    path, offset, length = c2.locate(keys[-1])
    with open(path, "r+b") as fh:
        fh.truncate(offset + 100)
    c3 = DiskCache(str(tmp_path / "l2"), 10_000, Metrics())
    assert keys[-1] not in c3 and c3.get(keys[-1], 3000) is None
    assert c3.size_bytes == c2.size_bytes - (offset + length - (offset - 48))
    # a flipped byte is detected on read: a miss, counted, and the chunk forgotten (fetched again)
    m4 = Metrics()
    c4 = DiskCache(str(tmp_path / "l2"), 10_000, m4)
    victim = next(k for k in keys if k in c4)
    path, offset, _ = c4.locate(victim)
    with open(path, "r+b") as fh:
        fh.seek(offset + 7)
        b = fh.read(1)
        fh.seek(offset + 7)
        fh.write(bytes([b[0] ^ 1]))
    assert c4.get(victim, 3000) is None and victim not in c4 and m4.counters["l2_corrupt"] == 1
    c4.put(victim, items[keys.index(victim)])  # re-fetched bytes are stored again
    assert c4.get(victim, 3000) == items[keys.index(victim)]
    # foreign files in packs/ and the earlier one-file-per-chunk layout are swept at start
    (tmp_path / "l2" / "packs" / "junk").write_bytes(b"x")
    (tmp_path / "l2" / "chunks" / "ab").mkdir(parents=True)
    DiskCache(str(tmp_path / "l2"), 10_000, Metrics())
    assert not (tmp_path / "l2" / "packs" / "junk").exists() and not (tmp_path / "l2" / "chunks").exists()
    chunks, freed = c4.prune(0)
    assert c4.size_bytes == 0 and c4.files == 0 and chunks >= 1 and freed >= 3000


def _forge_l2_record(cache: DiskCache, digest: bytes, data: bytes) -> bytes:
    """Flip bytes of a stored chunk and rewrite the record's crc32 to match, as a forger would."""
    import struct
    import zlib

    path, offset, length = cache.locate(digest)
    forged = bytes([data[0] ^ 0xFF]) + data[1:]
    with open(path, "r+b") as fh:
        fh.seek(offset - 48)
        magic, key, n, _crc = struct.unpack("<4s32sQI", fh.read(48))
        assert key == digest and n == length
        fh.seek(offset - 48)
        fh.write(struct.pack("<4s32sQI", magic, key, n, zlib.crc32(forged)) + forged)
    return forged


def test_an_l2_record_with_flipped_bytes_and_a_recomputed_crc32_is_dropped_not_served(tmp_path):
    m = Metrics()
    c = DiskCache(str(tmp_path / "l2"), 1 << 20, m)
    data = os.urandom(5000)
    key = hashlib.sha256(data).digest()
    c.put(key, data)
    _forge_l2_record(c, key, data)
    assert c.get(key, 5000) is None and key not in c and m.counters["l2_corrupt"] == 1
    # a restart indexes the forged record again (headers only); the read still refuses it
    c2 = DiskCache(str(tmp_path / "l2"), 1 << 20, Metrics())
    assert key in c2 and c2.get(key, 5000) is None and key not in c2


def test_the_fetcher_refetches_a_chunk_whose_l2_record_was_forged(tmp_path):
    content = os.urandom(50_000)
    blob, lay = built(f("a", content))
    fetcher, reader, src, m = fetcher_setup(tmp_path, blob)
    chunk = lay.entry("a").chunks[0]

    async def main():
        assert await fetcher.get(src, [chunk], "a") == [content]
        _forge_l2_record(fetcher.l2, chunk.digest, content)
        fetcher.l1.clear()
        assert await fetcher.get(src, [chunk], "a") == [content]  # the store's bytes, not the forged ones
        assert len(reader.reads) == 2 and m.counters["l2_corrupt"] == 1
        fetcher.l1.clear()
        assert await fetcher.get(src, [chunk], "a") == [content]  # stored again, served from L2
        assert len(reader.reads) == 2 and m.counters["l2_hits"] == 1

    trio.run(main)


def test_disk_cache_packs_chunks_together_and_evicts_the_least_recently_used_pack(tmp_path):
    m = Metrics()
    c = DiskCache(str(tmp_path / "l2"), 160_000, m)  # packs of 10 000 bytes: 4 chunks of 2 000 each
    items = [os.urandom(2000) for _ in range(84)]  # 170 kB: a tenth more than the bound
    keys = [hashlib.sha256(x).digest() for x in items]
    for k, x in zip(keys[:24], items[:24]):
        c.put(k, x)
    assert c.packs == 6 and c.files == 24
    paths = [c.locate(k)[0] for k in keys[:24]]
    assert paths[0] == paths[3] != paths[4]  # neighbours share a pack, in order
    assert c.locate(keys[1])[1] == c.locate(keys[0])[1] + 2000 + 48
    for i in range(24):  # random access gives each chunk its own bytes
        j = (i * 7) % 24
        assert c.get(keys[j], 2000) == items[j]
    assert c.get(keys[0], 2000) == items[0]  # the first pack is now the most recently used
    for k, x in zip(keys[24:], items[24:]):
        c.put(k, x)
        assert c.size_bytes <= 160_000
    assert keys[0] in c and keys[3] in c  # kept: recently read
    assert keys[4] not in c and keys[7] not in c  # the least recently used pack went first, whole
    assert m.counters["l2_evictions"] >= 4
    assert c.get(keys[3], 2000) == items[3] and c.get(keys[-1], 2000) == items[-1]
    assert c.get(keys[2], 1999) is None  # a length that does not match is never served


def test_disk_cache_concurrent_writers_of_the_same_chunk(tmp_path):
    c = DiskCache(str(tmp_path / "l2"), 1 << 20, Metrics())
    data = os.urandom(50_000)
    key = hashlib.sha256(data).digest()
    threads = [threading.Thread(target=c.put, args=(key, data)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get(key, len(data)) == data and c.size_bytes == len(data) + 48 and c.files == 1  # stored once


def test_memory_cache_is_an_lru_bounded_in_bytes():
    m = Metrics()
    c = MemoryCache(1000, m)
    c.put(b"a", b"x" * 400)
    c.put(b"b", b"x" * 400)
    assert c.get(b"a") is not None  # a is now the most recent
    c.put(b"c", b"x" * 400)
    assert c.get(b"b") is None and c.get(b"a") is not None and c.size_bytes == 800
    c.put(b"huge", b"x" * 2000)
    assert c.get(b"huge") is None


# ------------------------------------------------------------------------------------- fetcher


class FakeStoreReader:
    """A blob in memory that counts range reads and can be slowed, failed or blocked."""

    def __init__(self, data: bytes):
        self.data = data
        self.reads: list[tuple[int, int]] = []
        self.delay_s = 0.0
        self.fail: Exception | None = None
        self.block = threading.Event()
        self.block.set()

    @property
    def size(self) -> int:
        return len(self.data)

    def read_at(self, offset: int, n: int) -> bytes:
        self.reads.append((offset, n))
        self.block.wait(30)
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return self.data[offset : offset + n]


def fetcher_setup(tmp_path, blob: bytes, **kw):
    m = Metrics()
    fetcher = Fetcher([MemoryTier(MemoryCache(64 << 20, m)), DiskTier(DiskCache(str(tmp_path / "l2"), 64 << 20, m)),
                       RegistryTier(m)], m, **kw)
    fetcher.l1, fetcher.l2 = fetcher.tier("memory").cache, fetcher.tier("disk").cache  # what the tests look into
    reader = FakeStoreReader(blob)
    return fetcher, reader, LayerSource("test", reader), m


def built(*nodes, **kw) -> tuple[bytes, Layer]:
    out = io.BytesIO()
    layerfmt.build_layer(io.BytesIO(make_tar(*nodes)), out, **kw)
    return out.getvalue(), Layer.open(BytesReader(out.getvalue()))


def test_concurrent_gets_of_one_chunk_share_one_fetch(tmp_path):
    blob, lay = built(f("a", os.urandom(100_000)))
    fetcher, reader, src, m = fetcher_setup(tmp_path, blob)
    chunk = lay.entry("a").chunks[0]
    reader.delay_s = 0.2

    async def main():
        out = []

        async def one():
            out.append(await fetcher.get(src, [chunk], "a"))

        async with trio.open_nursery() as n:
            for _ in range(64):
                n.start_soon(one)
        return out

    out = trio.run(main)
    assert len(out) == 64 and all(x == [lay.read("a")] for x in out)
    assert len(reader.reads) == 1 and m.counters["coalesced_waits"] == 63


def test_adjacent_missing_chunks_and_readahead_go_out_as_one_range(tmp_path):
    data = os.urandom(1_000_000)
    blob, lay = built(f("big", data), chunk_size=100_000)
    fetcher, reader, src, m = fetcher_setup(tmp_path, blob)
    chunks = lay.entry("big").chunks

    async def main():
        got = await fetcher.get(src, chunks[2:4], "big", readahead=chunks[4:7])
        assert b"".join(got) == data[200_000:400_000]
        assert len(reader.reads) == 1
        assert reader.reads[0] == (chunks[2].offset, chunks[6].offset + chunks[6].length - chunks[2].offset)
        assert m.counters["readahead_chunks"] == 3
        again = await fetcher.get(src, chunks[4:7], "big")  # read-ahead landed in L1
        assert b"".join(again) == data[400_000:700_000] and len(reader.reads) == 1

    trio.run(main)


def test_l2_serves_after_l1_is_dropped_and_remote_is_not_asked(tmp_path):
    blob, lay = built(f("a", os.urandom(50_000)))
    fetcher, reader, src, m = fetcher_setup(tmp_path, blob)
    chunk = lay.entry("a").chunks[0]

    async def main():
        await fetcher.get(src, [chunk], "a")
        fetcher.l1.clear()
        got = await fetcher.get(src, [chunk], "a")
        assert got == [lay.read("a")] and len(reader.reads) == 1 and m.counters["l2_hits"] == 1

    trio.run(main)


def test_a_hanging_store_fails_within_the_deadline_and_the_next_read_retries(tmp_path):
    blob, lay = built(f("a", os.urandom(50_000)))
    fetcher, reader, src, m = fetcher_setup(tmp_path, blob, deadline_s=0.5, failure_memory_s=0.3)
    chunk = lay.entry("a").chunks[0]
    reader.block.clear()

    async def main():
        with pytest.raises(FetchError, match="deadline"):
            await fetcher.get(src, [chunk], "a")
        assert not fetcher._inflight  # nothing stuck
        reader.block.set()
        await trio.sleep(0.3)  # past the failure memory
        assert await fetcher.get(src, [chunk], "a") == [lay.read("a")]

    trio.run(main)


def test_a_read_retried_right_after_a_deadline_fails_at_once_so_one_read_waits_one_deadline(tmp_path):
    # the kernel retries a failed read-ahead with a read of its own: together they must not take 2 deadlines
    blob, lay = built(f("a", os.urandom(50_000)), f("b", os.urandom(50_000)))
    fetcher, reader, src, m = fetcher_setup(tmp_path, blob, deadline_s=0.5, failure_memory_s=1.0)
    ca, cb = lay.entry("a").chunks[0], lay.entry("b").chunks[0]
    reader.block.clear()

    async def main():
        t0 = trio.current_time()
        with pytest.raises(FetchError, match="deadline"):
            await fetcher.get(src, [ca], "a")
        t1 = trio.current_time()
        with pytest.raises(FetchError, match="deadline.*failed 0.*s ago"):
            await fetcher.get(src, [ca], "a")  # the retry: no second wait
        t2 = trio.current_time()
        assert t1 - t0 >= 0.5 and t2 - t1 < 0.1 and m.counters["failed_fast"] == 1
        assert len(reader.reads) == 1
        reader.block.set()
        assert await fetcher.get(src, [cb], "b") == [lay.read("b")]  # other chunks are fetched as usual
        await trio.sleep(1.0)
        assert await fetcher.get(src, [ca], "a") == [lay.read("a")]  # and this one after the memory
        assert not fetcher._failures

    trio.run(main)


def test_store_errors_and_corrupt_bytes_fail_the_read_and_are_not_cached(tmp_path):
    blob, lay = built(f("a", os.urandom(50_000)), f("b", os.urandom(50_000)))
    fetcher, reader, src, m = fetcher_setup(tmp_path, blob, failure_memory_s=0)
    ca, cb = lay.entry("a").chunks[0], lay.entry("b").chunks[0]

    async def main():
        reader.fail = ConnectionResetError("reset by peer")
        with pytest.raises(FetchError, match="reset by peer"):
            await fetcher.get(src, [ca], "a")
        reader.fail = None
        assert await fetcher.get(src, [ca], "a") == [lay.read("a")]
        bad = bytearray(blob)
        bad[cb.offset + 10] ^= 0xFF
        reader.data = bytes(bad)
        from weenv.envlet import ChunkIntegrityError

        with pytest.raises(ChunkIntegrityError):
            await fetcher.get(src, [cb], "b")
        assert cb.digest not in fetcher.l1 and cb.digest not in fetcher.l2
        assert m.counters["verify_failures"] == 1 and m.counters["remote_errors"] == 1

    trio.run(main)


def test_prefetch_yields_to_foreground_reads(tmp_path):
    blob, lay = built(*[f(f"p{i}", os.urandom(40_000)) for i in range(10)], f("fg", os.urandom(40_000)))
    fetcher, reader, src, m = fetcher_setup(tmp_path, blob)
    pre = [lay.entry(f"p{i}").chunks[0] for i in range(10)]
    fg = lay.entry("fg").chunks[0]
    order = []

    async def main():
        async with trio.open_nursery() as n:
            fetcher.attach(n)
            reader.delay_s = 0.05

            async def foreground():
                order.append("fg-start")
                await fetcher.get(src, [fg], "fg")
                order.append("fg-done")

            async def background():
                await trio.sleep(0.01)  # starts while the foreground read is in flight
                order.append("prefetch-start")
                await fetcher.prefetch(src, pre, batch_bytes=1)
                order.append("prefetch-done")

            n.start_soon(foreground)
            n.start_soon(background)
        assert order.index("fg-done") < order.index("prefetch-done")
        first_prefetch_read = min(i for i, (off, _) in enumerate(reader.reads) if off != fg.offset)
        fg_read = next(i for i, (off, _) in enumerate(reader.reads) if off == fg.offset)
        assert fg_read < first_prefetch_read
        assert m.counters["prefetch_bytes"] > 0 and all(c.digest in fetcher.l2 for c in pre)

    trio.run(main)


def test_the_envlet_gives_the_stores_it_opens_its_own_deadline(tmp_path):
    # a worker thread abandoned at the envlet's deadline must not stay blocked on the store's longer one
    from weenv.envlet import StoreSpec
    from weenv.envlet._server import Envlet

    e = Envlet(str(tmp_path / "mnt"), str(tmp_path / "cache"), cache_size_bytes=1 << 20,
               memory_cache_size_bytes=1 << 20, control_socket=str(tmp_path / "ctl.sock"), deadline_s=2.0)
    reader = e._reader(StoreSpec("registry", registry="127.0.0.1:9", insecure=True), "r", "sha256:" + "a" * 64, 10)
    policy = reader.store.policy
    assert policy.deadline_s == 2.0 and policy.request_timeout_s <= 2.0 and policy.connect_timeout_s <= 2.0
    reader.store.close()


def _du_bytes(root) -> int:
    return sum(os.stat(os.path.join(dp, n)).st_size for dp, _, ns in os.walk(root) for n in ns)


def test_l2_on_a_full_disk_counts_only_what_it_stored(tmp_path):
    # a real ENOSPC: a 1 MiB tmpfs under a cache that believes it has 10 MiB
    import subprocess

    from .fixtures_common import require_root

    require_root()
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        m = Metrics()
        c = DiskCache(str(mnt / "l2"), 10 << 20, m)
        items = [os.urandom(300_000) for _ in range(5)]
        keys = [hashlib.sha256(x).digest() for x in items]
        for k, x in zip(keys, items):
            c.put(k, x)
        stored = [k for k in keys if k in c]
        assert 0 < len(stored) < 5 and m.counters["l2_write_errors"] == 5 - len(stored)
        assert c.files == len(stored)
        assert c.size_bytes == len(stored) * (48 + 300_000) == _du_bytes(mnt / "l2")  # partial writes cut off
        s = m.snapshot()
        assert s["l2_bytes_written"] == len(stored) * 300_000
        for k in stored:
            assert c.get(k, 300_000) == items[keys.index(k)]
        again = DiskCache(str(mnt / "l2"), 10 << 20, Metrics())  # a restart finds the same
        assert again.files == c.files and again.size_bytes == c.size_bytes
        del c, again
    finally:
        import gc

        gc.collect()  # close the packs' descriptors before the unmount
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_failed_write_between_two_good_ones_leaves_the_stats_right(tmp_path, monkeypatch):
    # the hole case: a later record was placed after the one whose write fails
    import errno as _errno

    from weenv.envlet import _cache

    m = Metrics()
    c = DiskCache(str(tmp_path / "l2"), 1 << 20, m)
    a, b = os.urandom(1000), os.urandom(2000)
    ka, kb = hashlib.sha256(a).digest(), hashlib.sha256(b).digest()
    real = os.pwritev
    a_waits, b_done = threading.Event(), threading.Event()

    def pwritev(fd, bufs, offset):
        if len(bufs[1]) == 1000:  # a: wait until b is placed after it and written, then fail
            a_waits.set()
            assert b_done.wait(10)
            raise OSError(_errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(_cache.os, "pwritev", pwritev)
    t = threading.Thread(target=c.put, args=(ka, a))
    t.start()
    assert a_waits.wait(10)
    c.put(kb, b)
    b_done.set()
    t.join(10)
    assert ka not in c and c.get(kb, 2000) == b
    assert c.files == 1 and c.size_bytes == 48 + 2000 and m.counters["l2_write_errors"] == 1
    monkeypatch.setattr(_cache.os, "pwritev", real)
    again = DiskCache(str(tmp_path / "l2"), 1 << 20, Metrics())  # the scan stops at the hole: a cache refills
    assert again.size_bytes == 48 * again.files + 2000 * again.files and again.files in (0, 1)
