"""Memory snapshot images as deduplicated chunks (docs/snapshots.md, "Memory"): the content-defined
cutting finds shifted bytes again; a compressio statefile is cut decompressed and written back
to a stream that holds the same state; the embedded store keeps one pack per image with only its
new chunks; a restore verifies every chunk and a missing or corrupt one is a clear error that
changes nothing. Then on real runsc through the real daemon: four memory commits of one env a
second apart store at most 1.5x one image, and each restores its processes."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import struct
import time
import zlib

import pytest

from weenv import layerfmt
from weenv.provision.envs import _memchunks
from weenv.provision.envs._memimages import MemoryImageError, MemoryImages
from weenv.registry import LayoutStore


def statefile(state: bytes, block: int = 1 << 16, level: int = 6) -> bytes:
    """A gVisor statefile as runsc writes it: magic, metadata, its 32-byte HMAC, compressio blocks."""
    meta = b'{"timestamp":"now"}'
    out = [b"gVisorSF", struct.pack(">Q", len(meta)), meta, hashlib.sha256(meta).digest(), struct.pack(">I", block)]
    for i in range(0, len(state), block):
        comp = zlib.compressobj(level, zlib.DEFLATED, -15)
        frame = comp.compress(state[i:i + block]) + comp.flush()
        out += [struct.pack(">I", len(frame)), frame]
    return b"".join(out)


def decompressed(data: bytes) -> bytes:
    f = io.BytesIO(data)
    _, block = _memchunks.compressio_header(f)
    return b"".join(_memchunks.compressio_blocks(f, block))


def chunks_of(data: bytes) -> list[bytes]:
    c = _memchunks.Chunker()
    out = []
    for i in range(0, len(data), 100_000):  # fed in pieces that are not chunk boundaries
        out += c.feed(data[i:i + 100_000])
    return out + list(c.finish())


def test_cuts_are_content_defined_and_find_shifted_bytes_again():
    body = os.urandom(3 << 20)
    a, b = chunks_of(b"kernel state " * 100 + body), chunks_of(b"more kernel state" * 333 + body)
    assert b"".join(a).endswith(body) and b"".join(b).endswith(body)  # nothing lost or reordered
    assert all(len(x) <= _memchunks.MAX_CHUNK for x in a)
    assert all(len(x) >= _memchunks.MIN_CHUNK for x in a[:-1])
    shared = {hashlib.sha256(x).digest() for x in a} & {hashlib.sha256(x).digest() for x in b}
    shared_bytes = sum(len(x) for x in b if hashlib.sha256(x).digest() in shared)
    assert shared_bytes >= len(body) - 2 * _memchunks.MAX_CHUNK // 4, (shared_bytes, len(body))
    # bytes without the marker (a heap of spaces) are cut at the maximum, and are one chunk many times
    flat = chunks_of(b" " * (5 << 20))
    assert len(flat) == 5 and len({hashlib.sha256(x).digest() for x in flat}) == 1


def test_a_statefile_is_cut_decompressed_and_written_back_as_the_same_state():
    state = os.urandom(200_000) + b" " * 300_000 + os.urandom(123_457)
    img = statefile(state)
    info, it = _memchunks.iter_chunks(io.BytesIO(img))
    pieces = list(it)
    assert info["encoding"] == "compressio" and info["size"] == len(state) and info["block_bytes"] == 1 << 16
    assert b"".join(c for _, c in pieces) == state
    f = _memchunks.ImageFile(name="checkpoint.img", chunks=[(d.hex(), len(c)) for d, c in pieces], **info)
    out = io.BytesIO()
    _memchunks.write_image_file(out, f, (c for _, c in pieces))
    assert out.getvalue()[:len(info["header"])] == img[:len(info["header"])]
    assert decompressed(out.getvalue()) == state  # stored frames, the same blocks


@pytest.mark.parametrize("bad", [b"not a statefile at all" * 10, statefile(b"x" * 100)[:-3],
                                 statefile(os.urandom(1000), block=400)[:60] + b"\x00\x00\x00\x05junk!"])
def test_what_is_not_a_compressio_statefile_says_so(bad):
    with pytest.raises(_memchunks.ImageFormatError):
        _, it = _memchunks.iter_chunks(io.BytesIO(bad))
        list(it)
    info, it = _memchunks.iter_chunks(io.BytesIO(bad), raw=True)  # then it is cut as it is
    assert b"".join(c for _, c in it) == bad and info["encoding"] == "raw"


def test_a_bad_recipe_is_a_clear_error():
    with pytest.raises(_memchunks.ImageFormatError, match="recipe"):
        _memchunks.decode_recipe(b'{"files": [{"name": 3}]}')
    with pytest.raises(_memchunks.ImageFormatError, match="version 9"):
        _memchunks.decode_recipe(b'{"version": 9, "files": []}')


@pytest.fixture
def images(tmp_path):
    store = LayoutStore(str(tmp_path / "store"))
    known: list = []
    imgs = MemoryImages(str(tmp_path / "memory-images"), lambda: store, known=lambda: list(known))
    imgs.known_list = known  # what the snapshots of this node would name
    return imgs


def write_image(directory, state: bytes, extra: bytes = b"") -> None:
    os.makedirs(directory)
    with open(os.path.join(directory, "checkpoint.img"), "wb") as f:
        f.write(statefile(state))
    if extra:
        with open(os.path.join(directory, "other"), "wb") as f:
            f.write(extra)


def read_back(images: MemoryImages, image) -> tuple[bytes, bytes]:
    d = images.checkout(image)
    try:
        with open(os.path.join(d, "checkpoint.img"), "rb") as f:
            state = decompressed(f.read())
        other = open(os.path.join(d, "other"), "rb").read() if os.path.exists(os.path.join(d, "other")) else b""
    finally:
        images.release(image)
    assert not os.path.exists(d)  # a written-out copy goes with its last use
    return state, other


def test_packs_hold_only_new_chunks_and_restore_the_whole_image(images, tmp_path):
    body = os.urandom(4 << 20)
    states = [f"state {i} ".encode() * (1000 + 37 * i) + body + os.urandom(50_000) for i in range(4)]
    made = []
    for i, state in enumerate(states):
        write_image(tmp_path / f"img{i}", state, extra=b"side file" if i == 0 else b"")
        made.append(images.seal(str(tmp_path / f"img{i}"), {"runtime": "test"}))
        images.known_list.append(made[-1])  # recorded
        images.release_seal(made[-1])
    first, rest = made[0], made[1:]
    assert first.chunked and first.packs == [] and first.size >= len(body)
    for m in rest:
        assert m.size < len(body) / 8, (m.size, len(body))  # only what changed, and its recipe
        assert first.digest in {p.digest for p in m.packs}
    assert sum(m.size for m in made) <= 1.5 * first.size
    for m, state in zip(made, states):
        assert read_back(images, m) == (state, b"side file" if m is first else b"")
    # the first snapshot deleted: its pack stays (the others read from it), and new images still share it
    images.known_list.remove(first)
    write_image(tmp_path / "img4", b"state 4 " * 2000 + body)
    fifth = images.seal(str(tmp_path / "img4"), {})
    assert first.digest in {p.digest for p in fifth.packs} and fifth.size < len(body) / 8
    images.release_seal(fifth)
    # concurrent users of one image share one copy
    d1, d2 = images.checkout(made[2]), images.checkout(made[2])
    assert d1 == d2
    images.release(made[2])
    assert os.path.exists(d1)
    images.release(made[2])
    assert not os.path.exists(d1)


def test_a_missing_or_corrupt_chunk_is_a_clear_error_and_changes_nothing(images, tmp_path):
    body = os.urandom(2 << 20)
    write_image(tmp_path / "a", b"A" * 1000 + body)
    write_image(tmp_path / "b", b"BB" * 700 + body)
    a = images.seal(str(tmp_path / "a"), {})
    images.known_list.append(a)
    b = images.seal(str(tmp_path / "b"), {})
    assert a.digest in {p.digest for p in b.packs}
    blob = images._layout().blob_path(a.digest)
    good = open(blob, "rb").read()
    with contextlib.closing(layerfmt.FileReader.open(images._layout().blob_path(b.digest))) as reader:
        reads = {d for f in _memchunks.decode_recipe(layerfmt.Layer.open(reader).read("recipe.json")).files
                 for d, _ in f.chunks}
    with contextlib.closing(layerfmt.FileReader.open(blob)) as reader:  # a chunk of a's pack that b reads
        chunk = next(e for e in layerfmt.Layer.open(reader).entries if e.path[2:] in reads).chunks[0]
    with open(blob, "r+b") as f:  # one byte of its frame (the TOC at the tail stays valid)
        f.seek(chunk.offset + chunk.length // 2)
        f.write(bytes([good[chunk.offset + chunk.length // 2] ^ 0xFF]))
    with pytest.raises(MemoryImageError, match=r"memory image sha256:\w+: chunk \d+ of checkpoint.img .* corrupt"):
        images.checkout(b)
    assert not [n for n in os.listdir(images.root) if not n.startswith(".spool")], os.listdir(images.root)
    os.unlink(blob)
    with pytest.raises(MemoryImageError, match=f"its pack {a.digest} is not in this node's store"):
        images.checkout(b)
    with open(blob, "wb") as f:  # the snapshot is intact: with its pack back, it restores
        f.write(good)
    assert read_back(images, b)[0] == b"BB" * 700 + body


def test_a_pack_a_seal_shares_stays_pinned_until_the_snapshot_is_recorded(images, tmp_path):
    write_image(tmp_path / "a", os.urandom(1 << 20))
    a = images.seal(str(tmp_path / "a"), {})
    assert a.digest in images.pinned()
    images.release_seal(a)
    assert images.pinned() == set()


# ------------------------------------------------------------------ real runsc, real daemon

from tests.fixtures_daemon import daemon  # noqa: E402,F401
from tests.test_memory_snapshots import gvisor_platform, pids, read_counter, start_counter  # noqa: E402,F401
from tests.test_gvisor import _gvisor_lock  # noqa: E402


def test_four_memory_commits_a_second_apart_store_at_most_1_5x_one_image(daemon, tmp_path, gvisor_platform):  # noqa: F811
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        r = env.exec(["sh", "-c", "head -c 25165824 /dev/urandom > /dev/shm/blob"])
        assert r.exit_code == 0, r
        pid = start_counter(env)
        snaps = []
        for _ in range(4):
            snaps.append(env.commit(memory=True))
            time.sleep(1)
        mems = [c.snapshot(s).memory for s in snaps]
        sizes = [m["size"] for m in mems]
        print(f"memory packs of 4 commits: {[round(s / 2**20, 1) for s in sizes]} MiB; images "
              f"{[round(m['image_bytes'] / 2**20, 1) for m in mems]} MiB")
        assert all(m["chunked"] for m in mems)
        assert sizes[0] > 16 << 20  # the random bytes are in the first pack, once
        assert sum(sizes) <= 1.5 * max(sizes), sizes
        store = os.path.join(daemon.home, "store", "blobs", "sha256")
        on_disk = sum(os.path.getsize(os.path.join(store, m["digest"].split(":")[1])) for m in mems)
        assert on_disk == sum(sizes)
        assert not [n for n in os.listdir(os.path.join(daemon.home, "memory-images")) if not n.startswith(".")]

        before = read_counter(env, pid)
        with c.create(snaps[3]) as child:  # made whole from four packs, every chunk checked
            assert pid in pids(child) and read_counter(child, pid) >= 0
            assert child.exec(["sh", "-c", "wc -c < /dev/shm/blob"]).stdout.strip() == b"25165824"
        assert read_counter(env, pid) >= before
        assert os.listdir(os.path.join(daemon.home, "memory-images")) == []  # its copy went after the restore

        # a corrupt chunk in the first pack: the later snapshot says so, and is left as it was
        first = os.path.join(store, mems[0]["digest"].split(":")[1])
        good = open(first, "rb").read()
        with open(first, "r+b") as f:
            f.seek(len(good) // 3)
            f.write(bytes([good[len(good) // 3] ^ 0xFF]))
        with pytest.raises(Exception, match="corrupt") as bad:
            c.create(snaps[3])
        print(f"restore from a corrupt pack: {bad.value}")
        assert snaps[3] in {s.id for s in c.snapshots()}
        with open(first, "wb") as f:
            f.write(good)

        c.delete_snapshot(snaps[0])  # its pack stays: the later images read chunks from it
        assert os.path.exists(first)
        with c.create(snaps[2]) as child:
            assert pid in pids(child)
        for s in snaps[1:]:
            c.delete_snapshot(s)
        left = [m["digest"] for m in mems if os.path.exists(os.path.join(store, m["digest"].split(":")[1]))]
        assert left == [], left


# ------------------------------------------------------------------ published, and restored on another daemon

from tests.fixtures_registry import registry  # noqa: E402,F401


@pytest.fixture
def registry_gvisor_lock(registry, tmp_path):  # noqa: F811
    """A gVisor plan lock whose busybox group is in the test registry: any daemon can start it."""
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import publish, resolve_group
    from weenv.testing import busybox_tree
    from weenv.testing._daemon import weenv_home

    home = str(tmp_path / "publisher")
    os.makedirs(home)
    with weenv_home(home):
        publish(str(busybox_tree(tmp_path / "src-busybox")), f"{registry.host}/memdedup/os:bb", group="os",
                group_class="os")
        plan = tmp_path / "bbr.toml"
        plan.write_text(f'name = "bbr"\nruntime = "gvisor"\n\n[[groups]]\nname = "os"\nref = "{registry.host}/memdedup/'
                        'os:bb"\nclass = "os"\n\n[resources]\npids = 256\ndisk = "64MiB"\n\n[resources.cpu]\nmin = 0.05'
                        '\nmax = 1.0\n\n[resources.memory]\nmin = "64MiB"\nmax = "512MiB"\n')
        lock = str(tmp_path / "bbr.lock.toml")
        write_plan(lock_plan(load_plan(str(plan)), resolve_group), lock)
    return lock


@pytest.fixture
def second_daemon(tmp_path):
    """Another daemon on this host, with its own $WEENV_HOME (its own store, envlet and cgroups)."""
    import tempfile

    from weenv.testing import DaemonHandle, teardown_private_daemon

    home = tempfile.mkdtemp(prefix="weenv-daemon-b-")
    handle = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-test-b-{os.getpid()}", "", "",
                          os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    handle.start()
    try:
        yield handle
    finally:
        left = teardown_private_daemon(handle)
        assert not left, f"the second daemon left: {left}"


def test_a_memory_snapshot_published_to_a_registry_restores_on_another_daemon(
        daemon, second_daemon, registry, registry_gvisor_lock, gvisor_platform):  # noqa: F811
    from weenv.registry import open_store, parse_ref

    ref1, ref2 = f"{registry.host}/memdedup/snaps:one", f"{registry.host}/memdedup/snaps:two"
    with daemon.client() as a, a.create(registry_gvisor_lock) as env:
        assert env.exec(["sh", "-c", "head -c 8388608 /dev/urandom > /dev/shm/blob"]).exit_code == 0
        pid = start_counter(env)
        env.exec(["sh", "-c", "echo from-node-a > /root/f"])
        s1 = env.commit(memory=True, ref=ref1)
        at_commit = read_counter(env, pid)
        s2 = env.commit(memory=True, ref=ref2)
        m1, m2 = a.snapshot(s1).memory, a.snapshot(s2).memory
        assert a.snapshot(s1).ref == ref1
        assert m1["digest"] in {p["digest"] for p in m2["packs"]}  # the second image reads the first's chunks
        with open_store(registry.host) as store:  # every pack is in the registry, each once
            for m in (m1, m2):
                for blob in [m, *m["packs"]]:
                    assert store.has_blob(parse_ref(ref1).repo, blob["digest"]), blob

    with second_daemon.client() as b:
        pulled = b.pull_snapshot(ref2)
        assert pulled.memory["digest"] == m2["digest"] and pulled.ref == ref2
        store_b = os.path.join(second_daemon.home, "store", "blobs", "sha256")
        assert all(os.path.exists(os.path.join(store_b, x["digest"].split(":")[1])) for x in [m2, *m2["packs"]])
        copies = [b.create(pulled.id) for _ in range(2)]  # restored twice, from the registry's packs
        try:
            for child in copies:
                assert pid in pids(child), child.id
                assert read_counter(child, pid) >= at_commit  # the process continues with its count
                assert child.exec(["cat", "/root/f"]).stdout == b"from-node-a\n"
                assert child.exec(["sh", "-c", "wc -c < /dev/shm/blob"]).stdout.strip() == b"8388608"
            assert copies[0].exec(["kill", "-9", str(pid)]).exit_code == 0  # independent copies
            time.sleep(0.2)
            assert pid not in pids(copies[0]) and pid in pids(copies[1])
        finally:
            for child in copies:
                child.kill()
        b.delete_snapshot(pulled.id)
        with pytest.raises(Exception, match="not a published weenv snapshot"):
            b.pull_snapshot(f"{registry.host}/memdedup/os:bb")


def test_publishing_a_memory_snapshot_of_a_plan_in_the_embedded_store_is_refused_before_anything(
        daemon, registry, tmp_path, gvisor_platform):  # noqa: F811
    import weenv

    lock = _gvisor_lock(daemon, tmp_path)  # its busybox group is in the daemon's embedded store
    with daemon.client() as c, c.create(lock) as env:
        pid = start_counter(env)
        before = {s.id for s in c.snapshots()}
        with pytest.raises(weenv.ApiError, match="embedded store; publish them to a registry first") as refused:
            env.commit(memory=True, ref=f"{registry.host}/memdedup/snaps:refused")
        assert refused.value.status == 409
        assert {s.id for s in c.snapshots()} == before
        assert read_counter(env, pid) >= 0  # never checkpointed
