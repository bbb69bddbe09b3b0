"""The chunk-tier contract (weenv/envlet/_tier.py), run against every tier: memory, disk (a real
directory), registry (a real docker-registry and the local OCI layout store) and the fake of
weenv.testing; then the fetcher's side of it — tier order from configuration, a tier's wrong bytes
caught and fetched from the next tier, a failing tier skipped, a new tier slotted in between."""

from __future__ import annotations

import glob
import hashlib
import io
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import trio

import weenv.registry as R
from weenv import layerfmt
from weenv.envlet import ChunkTier, FetchError, Fetcher, LayerSource, Metrics, TierConfig, TierConfigError, load_tiers
from weenv.layerfmt import BytesReader, Chunk, Layer, LayerError
from weenv.testing import FakeChunkTier

from .layertrees import f, make_tar

KINDS = ["memory", "disk", "registry-remote", "registry-layout", "fake", "peer"]


def built(*nodes, **kw) -> tuple[bytes, Layer]:
    out = io.BytesIO()
    layerfmt.build_layer(io.BytesIO(make_tar(*nodes)), out, **kw)
    return out.getvalue(), Layer.open(BytesReader(out.getvalue()))


@dataclass
class Harness:
    """One tier under test, over one layer blob, with what the contract needs to poke at it."""

    kind: str
    tier: ChunkTier
    metrics: Metrics
    blob: bytes
    layer: Layer
    src: LayerSource
    source_of_truth: bool = False  # holds the blob itself: "put" keeps nothing, every chunk is there
    bounded: bool = False
    corrupt_file: str | None = None  # where the tier's bytes live, for corrupting them
    remote_cache: object = None  # peer: the serving node's disk cache (what the tier's peer holds)
    closers: list = field(default_factory=list)

    def chunks(self) -> list[tuple[Chunk, bytes]]:
        out = []
        for path in ("a", "b", "big"):
            data = self.layer.read(path)
            for c in self.layer.entry(path).chunks:
                out.append((c, data[c.uoffset : c.uoffset + c.ulength]))
        return out

    def get(self, chunks: list[Chunk]) -> list:
        return self.tier.get(self.src, chunks)

    def hold(self, items: list[tuple[Chunk, bytes]]) -> None:
        if self.remote_cache is not None:  # the peer holds them; this node's tier keeps nothing
            for c, data in items:
                self.remote_cache.put(c.digest, data)  # type: ignore[attr-defined]
        elif not self.source_of_truth:
            self.tier.put(items)

    def corrupt(self, chunk: Chunk) -> None:
        """Make the tier's copy of ``chunk`` wrong, in place, as a disk or a store could."""
        if isinstance(self.tier, FakeChunkTier):
            self.tier.corrupt.add(chunk.digest)
            return
        if self.kind == "disk":
            path, offset, _ = self.tier.cache.locate(chunk.digest)
        elif self.kind == "peer":
            path, offset, _ = self.remote_cache.locate(chunk.digest)  # type: ignore[attr-defined]
        else:
            path, offset = self.corrupt_file, chunk.offset + chunk.length // 2
        with open(path, "r+b") as fh:
            fh.seek(offset)
            b = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([b[0] ^ 0xFF]))


def _layer_blob() -> tuple[bytes, Layer]:
    return built(f("a", os.urandom(40_000)), f("b", os.urandom(30_000)), f("big", os.urandom(300_000)),
                 chunk_size=100_000)


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest, tmp_path) -> Iterator[Harness]:  # type: ignore[no-untyped-def]
    kind = request.param
    blob, lay = _layer_blob()
    m = Metrics()
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    config = TierConfig(m, cache_dir=str(tmp_path / "cache"), cache_size_bytes=1 << 20,
                        memory_cache_size_bytes=1 << 20)
    if kind in ("memory", "disk"):
        (tier,) = load_tiers([kind], config)
        h = Harness(kind, tier, m, blob, lay, LayerSource("t", BytesReader(blob)), bounded=True)
    elif kind == "peer":  # a real peer server (over its own disk cache) on 127.0.0.1, a real client
        h = _peer_harness(tmp_path, m, blob, lay, digest)
    elif kind == "fake":
        h = Harness(kind, FakeChunkTier(capacity_bytes=1 << 20), m, blob, lay, LayerSource("t", BytesReader(blob)),
                    bounded=True)
    else:
        repo = f"tiers/{uuid.uuid4().hex[:10]}"
        if kind == "registry-layout":
            store: R.Store = R.LayoutStore(str(tmp_path / "store"))
        else:
            reg = request.getfixturevalue("registry")
            store = R.RemoteStore(reg.host, insecure=True, credentials=None)
        (tmp_path / "blob").write_bytes(blob)
        store.put_blob(repo, digest, str(tmp_path / "blob"), len(blob))
        if kind == "registry-layout":
            where = glob.glob(str(tmp_path / "store" / "**" / digest.split(":")[1]), recursive=True)
        else:
            where = glob.glob(os.path.join(reg.storage_dir, "**", digest.split(":")[1], "data"), recursive=True)
        assert len(where) == 1, where
        (tier,) = load_tiers(["registry"], config)
        h = Harness(kind, tier, m, blob, lay, LayerSource("t", R.BlobReader(store, repo, digest, len(blob))),
                    source_of_truth=True, corrupt_file=where[0], closers=[store.close])
    try:
        yield h
    finally:
        for close in h.closers:
            close()


def _peer_harness(tmp_path, m: Metrics, blob: bytes, lay: Layer, digest: str) -> Harness:
    import queue
    import threading
    from types import SimpleNamespace

    from weenv.envlet._cache import DiskCache
    from weenv.envlet._peer_server import PeerServer
    from weenv.envlet._tier_peer import PeerOptions, PeerTier

    served = Metrics()
    cache = DiskCache(str(tmp_path / "peer-l2"), 1 << 20, served)
    node = SimpleNamespace(l1=None, l2=cache, fetcher=SimpleNamespace(foreground_busy=False, serving_yields=False), by_name={},
                           metrics=served)
    server = PeerServer(node, PeerOptions(token="conformance", listen=("127.0.0.1", 0)))  # type: ignore[arg-type]
    ready: queue.Queue = queue.Queue()

    async def run() -> None:
        async with trio.open_nursery() as n:
            addr = await n.start(server.serve)
            ready.put((addr, trio.lowlevel.current_trio_token(), n.cancel_scope))

    t = threading.Thread(target=trio.run, args=(run,), daemon=True)
    t.start()
    addr, token, scope = ready.get(timeout=10)
    tier = PeerTier(m, PeerOptions(token="conformance"))
    tier.set_peers({addr: [digest]})

    def stop() -> None:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        t.join(10)

    return Harness("peer", tier, m, blob, lay, LayerSource("t", BytesReader(blob), digest), remote_cache=cache,
                   closers=[stop])


# ------------------------------------------------------------------------------------- the contract


def test_a_chunk_the_tier_does_not_hold_is_never_answered_with_bytes(harness: Harness) -> None:
    other_blob, other = _layer_blob()  # same shape, other bytes: same offsets, other digests
    foreign = [c for path in ("a", "big") for c in other.entry(path).chunks]
    if harness.source_of_truth:
        # the store holds a blob, not chunks: what is at those offsets is not these chunks
        answers = harness.get(foreign[:1])
        assert isinstance(answers[0], LayerError)
        return
    # a peer cannot tell without asking (None); the others know they lack them
    assert all(harness.tier.has(c) is (None if harness.kind == "peer" else False) for c in foreign)
    assert harness.get(foreign) == [None] * len(foreign)


def test_put_then_get_gives_the_same_bytes(harness: Harness) -> None:
    items = harness.chunks()
    harness.hold(items)
    chunks = [c for c, _ in items]
    assert harness.get(chunks) == [d for _, d in items]
    remote = harness.source_of_truth or harness.remote_cache is not None
    assert [harness.tier.has(c) for c in chunks] == [None if remote else True] * len(chunks)
    assert harness.get(chunks[2:4]) == [d for _, d in items[2:4]]  # any subset, any order of asking
    harness.tier.put(items)  # storing again is harmless
    assert harness.get(chunks[:1]) == [items[0][1]]


def test_a_tiers_wrong_bytes_are_caught_counted_and_fetched_from_the_next_tier(harness: Harness) -> None:
    if harness.kind == "memory":
        pytest.skip("the memory tier holds only bytes the fetcher verified; nothing outside writes to it")
    items = harness.chunks()
    harness.hold(items)
    victim, good = items[0]
    harness.corrupt(victim)
    backstop = FakeChunkTier("backstop")
    backstop.seed(victim, good)
    fetcher = Fetcher([harness.tier, backstop], harness.metrics)

    async def main() -> list[bytes]:
        return await fetcher.get(harness.src, [victim], "a")

    assert trio.run(main) == [good]
    st = fetcher.tier_stats[harness.tier.name]
    assert backstop.calls == [("get", [victim.offset])]  # the next tier was asked for it
    if harness.kind == "disk":  # the disk tier verifies each record itself: a corrupt one is a miss
        assert harness.metrics.counters["l2_corrupt"] == 1 and st.misses == 1
    else:  # the fetcher (fake) or the tier (registry) caught the bytes: counted, and the tier told
        assert harness.metrics.counters["verify_failures"] == 1 and st.rejected == 1
    assert fetcher.tier_stats["backstop"].hits == 1
    if harness.kind == "peer":  # the peer that sent them is penalised: not asked again for a while
        assert harness.metrics.counters["peer_corrupt"] == 1
        assert harness.get([victim]) == [None] and harness.tier.stats()["peers"]
    elif not harness.source_of_truth:  # the good bytes were written back over the bad ones
        assert harness.get([victim]) == [good]


def test_the_bound_holds_and_the_least_recently_used_goes_first(harness: Harness) -> None:
    if not harness.bounded:
        pytest.skip(f"the {harness.kind} tier keeps nothing of its own")
    payloads = [os.urandom(60_000) for _ in range(30)]  # 1.8 MB through a 1 MiB tier
    chunks = [Chunk(offset=i * 60_000, length=60_000, uoffset=0, ulength=60_000, digest=hashlib.sha256(p).digest())
              for i, p in enumerate(payloads)]
    for c, p in zip(chunks, payloads):
        harness.tier.put([(c, p)])
        if harness.kind != "disk":  # the disk keeps a pack of slack (its bound holds at write time)
            assert _size(harness.tier) <= 1 << 20
        harness.get(chunks[:1])  # the first is kept recent
    assert _size(harness.tier) <= 1 << 20
    assert harness.get(chunks[:1]) == [payloads[0]]
    assert harness.get(chunks[1:2]) == [None] and not harness.tier.has(chunks[1])  # the oldest unread went
    assert harness.get(chunks[-1:]) == [payloads[-1]]


def _size(tier: ChunkTier) -> int:
    return tier.size_bytes if isinstance(tier, FakeChunkTier) else tier.cache.size_bytes  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------- the fetcher's side


def test_tiers_come_from_configuration_and_bad_names_are_refused(tmp_path) -> None:
    config = TierConfig(Metrics(), cache_dir=str(tmp_path))
    assert [t.name for t in load_tiers("memory,disk,registry", config)] == ["memory", "disk", "registry"]
    assert [t.name for t in load_tiers(["memory", "registry"], config)] == ["memory", "registry"]
    with pytest.raises(TierConfigError, match=r"tiers\[2\] 'nosuch': no such tier .*_tier_nosuch.py"):
        load_tiers("memory,disk,nosuch,registry", config)
    with pytest.raises(TierConfigError, match="peer tier: the cluster token is missing"):
        load_tiers("memory,disk,peer,registry", config)
    peer = TierConfig(Metrics(), cache_dir=str(tmp_path), options={"peer.token": "t"})
    assert [t.name for t in load_tiers("memory,disk,peer,registry", peer)] == ["memory", "disk", "peer", "registry"]
    with pytest.raises(TierConfigError, match=r"tiers\[1\] 'memory': named twice"):
        load_tiers("memory,memory", config)
    with pytest.raises(TierConfigError, match=r"tiers\[0\] 'Disk/x'"):
        load_tiers("Disk/x", config)
    with pytest.raises(TierConfigError, match="one or more"):
        load_tiers("", config)


def test_a_new_tier_between_disk_and_registry_serves_and_is_written_back(tmp_path) -> None:
    # what a peer tier will be: asked after the disk, before the registry; its chunks land in memory and disk
    blob, lay = _layer_blob()
    m = Metrics()
    memory, disk, registry = load_tiers("memory,disk,registry", TierConfig(m, cache_dir=str(tmp_path)))
    peer = FakeChunkTier("peer")
    a = lay.entry("a").chunks[0]
    b = lay.entry("b").chunks[0]
    peer.seed(a, lay.read("a"))
    fetcher = Fetcher([memory, disk, peer, registry], m)

    async def main() -> None:
        assert await fetcher.get(LayerSource("t", BytesReader(blob)), [a, b], "ab") == [lay.read("a"), lay.read("b")]

    trio.run(main)
    assert m.counters["remote_fetches"] == 1 and m.counters["remote_chunks"] == 1  # only b went to the store
    assert fetcher.tier_stats["peer"].hits == 1 and fetcher.tier_stats["registry"].hits == 1
    assert memory.has(a) and disk.has(a) and memory.has(b) and disk.has(b)
    assert ("put", [b.offset]) in peer.calls  # the store's chunk was offered to the peer tier too


def test_a_failing_tier_is_a_miss_and_the_last_tiers_error_fails_the_read(tmp_path) -> None:
    blob, lay = _layer_blob()
    m = Metrics()
    broken, last = FakeChunkTier("broken"), FakeChunkTier("last", indexed=False)
    a = lay.entry("a").chunks[0]
    broken.seed(a, lay.read("a"))
    last.seed(a, lay.read("a"))
    broken.fail = ConnectionResetError("peer went away")
    fetcher = Fetcher([broken, last], m, failure_memory_s=0)
    src = LayerSource("t", BytesReader(blob))

    async def main() -> None:
        assert await fetcher.get(src, [a], "a") == [lay.read("a")]
        assert fetcher.tier_stats["broken"].errors == 1
        last.items.clear()
        last.fail = OSError("the last tier is down")
        with pytest.raises(FetchError, match="last read failed: the last tier is down"):
            await fetcher.get(src, [lay.entry("b").chunks[0]], "b")
        last.fail = None
        with pytest.raises(FetchError, match="no tier holds the chunk"):
            await fetcher.get(src, [lay.entry("b").chunks[0]], "b")

    trio.run(main)


def test_the_registry_tier_gets_adjacent_chunks_as_one_range_and_caches_are_asked_per_chunk(tmp_path) -> None:
    blob, lay = _layer_blob()
    m = Metrics()
    counting = FakeChunkTier("counting")  # an empty cache before the store: says so, is not asked
    (registry,) = load_tiers("registry", TierConfig(m))
    fetcher = Fetcher([counting, registry], m)
    chunks = lay.entry("big").chunks

    class Reads:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []
            self.size = len(blob)

        def read_at(self, off: int, n: int) -> bytes:
            self.calls.append((off, n))
            return blob[off : off + n]

    reads = Reads()

    async def main() -> None:
        got = await fetcher.get(LayerSource("t", reads), chunks[:1], "big", readahead=chunks[1:])
        assert got == [lay.read("big")[: chunks[0].ulength]]

    trio.run(main)
    assert reads.calls == [(chunks[0].offset, chunks[-1].offset + chunks[-1].length - chunks[0].offset)]
    assert [call for call in counting.calls if call[0] == "get"] == []  # has() said no: not asked
    assert all(counting.has(c) for c in chunks)  # everything written back


def test_the_cli_refuses_a_tier_list_it_cannot_build(tmp_path) -> None:
    from click.testing import CliRunner

    from weenv.cli import main

    r = CliRunner().invoke(main, ["envlet", "serve", "--mountpoint", str(tmp_path / "m"), "--cache-dir",
                                  str(tmp_path / "c"), "--tiers", "memory,disk,nosuch,registry"])
    assert r.exit_code == 2 and "--tiers" in r.output and "tiers[2] 'nosuch': no such tier" in r.output
    assert not (tmp_path / "m").exists()  # refused before anything was mounted or made
    # the peer tier without the cluster token, or with a misspelt option: refused, naming the option
    for opts, says in (([], "cluster token is missing"), (["peer.token=t", "peer.k=zero"], "peer.k=zero")):
        r = CliRunner().invoke(main, ["envlet", "serve", "--mountpoint", str(tmp_path / "m"), "--cache-dir",
                                      str(tmp_path / "c"), "--tiers", "memory,disk,peer,registry",
                                      *[a for o in opts for a in ("--tier-option", o)]])
        assert r.exit_code == 2 and "--tier-option" in r.output and says in r.output, r.output
    assert not (tmp_path / "m").exists()


def test_a_new_tier_is_one_module_named_after_it(tmp_path, monkeypatch) -> None:
    # what weenv/envlet/_tier_peer.py will be: a module with make_tier(config); --tiers puts it in line
    import importlib.machinery
    import sys
    import types

    made: list[TierConfig] = []
    peer = types.ModuleType("weenv.envlet._tier_peer")
    peer.__spec__ = importlib.machinery.ModuleSpec("weenv.envlet._tier_peer", None)

    def make_tier(config: TierConfig) -> ChunkTier:
        made.append(config)
        return FakeChunkTier("peer", capacity_bytes=int(config.options["peer.capacity_bytes"]))

    peer.make_tier = make_tier  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "weenv.envlet._tier_peer", peer)
    config = TierConfig(Metrics(), cache_dir=str(tmp_path), options={"peer.capacity_bytes": "1000"})
    tiers = load_tiers("memory,disk,peer,registry", config)
    assert [t.name for t in tiers] == ["memory", "disk", "peer", "registry"] and made == [config]
    assert tiers[2].capacity_bytes == 1000  # type: ignore[attr-defined]
    peer.make_tier = lambda config: object()  # type: ignore[attr-defined]
    with pytest.raises(TierConfigError, match=r"tiers\[0\] 'peer': make_tier returned object, not a ChunkTier"):
        load_tiers("peer", config)


def test_the_cli_refuses_a_tier_option_that_is_not_key_value(tmp_path) -> None:
    from click.testing import CliRunner

    from weenv.cli import main

    r = CliRunner().invoke(main, ["envlet", "serve", "--mountpoint", str(tmp_path / "m"), "--cache-dir",
                                  str(tmp_path / "c"), "--tier-option", "peer.address=x", "--tier-option", "nope"])
    assert r.exit_code == 2 and "--tier-option" in r.output and "'nope' (the 2. one) is not KEY=VALUE" in r.output
