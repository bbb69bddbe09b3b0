"""The builder's fast paths: pinned output bytes, canonical walk order, batching, reading files safely.

The pinned digests were produced by the builder before it was rewritten for speed (one
``ZstdCompressor.compress`` per frame on a thread pool); any change to them means published
layers stop deduplicating, so a new pin needs a reason in the commit message.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading

import pytest
import zstandard

from weenv import layerfmt
from weenv.layerfmt import BytesReader, Layer, LayerInputError, SourceEntry, build_entries, build_layer
from weenv.layerfmt import _build as builder
from weenv.layerfmt._source import iter_directory

from .layertrees import MTIME, chardev, d, f, fifo, hard, make_tar, make_tree, sym


def _data(seed: int, n: int) -> bytes:
    """Incompressible but reproducible bytes."""
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(b"%d/%d" % (seed, i)).digest()
        i += 1
    return bytes(out[:n])


PINNED_TREE = (
    d(".", mode=0o755),
    d("etc"),
    f("etc/hosts", b"127.0.0.1 localhost\n"),
    f("etc/shadow", b"root:*:1::::::\n", mode=0o640, gid=42),
    d("usr", mode=0o755),
    d("usr/bin", mode=0o755),
    f("usr/bin/tool", b"#!/bin/sh\necho hi\n" * 40, mode=0o4755),
    d("usr/lib", mode=0o755),
    f("usr/lib/big.so", _data(1, 150_000) + b"z" * 100_000),
    hard("usr/lib/big-hardlink.so", "usr/lib/big.so"),
    sym("usr/lib/libz.so", "big.so"),
    f("empty", b""),
    d("tmp", mode=0o1777),
    d("run"),
    fifo("run/initctl"),
    d("dev"),
    chardev("dev/null", 1, 3, mode=0o666),
    d("home"),
    d("home/user", uid=1000, gid=1000),
    f("home/user/notes.txt", b"n" * 5000, uid=1000, gid=1000),
    d("home/" + "L" * 150),
    f("home/" + "L" * 150 + "/" + "é" * 80 + ".txt", "ünïcødé ✓\n".encode()),
    f("with.xattr", b"x", xattrs={"user.weenv.test": b"\x00\x01binary\xff"}),
)
PINNED_PREFETCH = ["usr/lib/big.so", "etc/hosts"]
# (zstd library version, chunk size, prefetch?) -> blob digest
PINNED = {
    ((1, 5, 7), 1 << 20, False): "sha256:60075376e62eefc1d1a1967b4931161d21938e724e6689dbc34a21cb821810ab",
    ((1, 5, 7), 4096, True): "sha256:6af0b8152f6d600165ecbfab2559e7ad65360ca8b7d8a1481176ba605df96fc1",
}


def _build(src, **kw) -> tuple[bytes, layerfmt.BuildResult]:
    out = io.BytesIO()
    res = build_layer(io.BytesIO(src) if isinstance(src, bytes) else src, out, **kw)
    return out.getvalue(), res


def _pin(chunk_size: int, prefetch: bool) -> str:
    key = (zstandard.ZSTD_VERSION, chunk_size, prefetch)
    if key not in PINNED:
        pytest.fail(f"no pinned digest for zstd {zstandard.ZSTD_VERSION}: a new zstd may change every blob's bytes; "
                    "check that builds are still deterministic, then pin the new digests")
    return PINNED[key]


@pytest.mark.parametrize("chunk_size, prefetch", [(1 << 20, False), (4096, True)])
def test_a_fixed_tree_builds_to_its_pinned_digest_from_tar_dir_and_entries(tmp_path, chunk_size, prefetch):
    kw = dict(chunk_size=chunk_size, prefetch=PINNED_PREFETCH if prefetch else ())
    expected = _pin(chunk_size, prefetch)
    blob, res = _build(make_tar(*PINNED_TREE), **kw)
    assert res.digest == expected == "sha256:" + hashlib.sha256(blob).hexdigest()
    # in-memory entries read through their generic opener
    entries, spool = layerfmt.scan_tar(io.BytesIO(make_tar(*PINNED_TREE)))
    with spool:
        contents = {e.path: e.opener().read() for e in entries if e.opener is not None}
    generic = [SourceEntry(e.path, e.type, e.mode, e.uid, e.gid, e.mtime, e.size, e.link, e.devmajor, e.devminor,
                           e.xattrs, (lambda b=contents[e.path]: io.BytesIO(b)) if e.opener else None, e.link_key)
               for e in entries]
    out = io.BytesIO()
    assert build_entries(generic, out, **kw).digest == expected
    for threads in (1, 3):
        assert _build(make_tar(*PINNED_TREE), threads=threads, **kw)[1].digest == expected
    if os.geteuid() != 0:
        pytest.skip("the directory half needs root (chown, mknod)")
    root = make_tree(tmp_path / "src", *PINNED_TREE)
    os.utime(root, (MTIME, MTIME))
    assert _build(root, **kw)[1].digest == expected


@pytest.mark.parametrize("batch_bytes", [1, 600, 5000, 70_000])
def test_batch_size_never_changes_the_bytes(monkeypatch, batch_bytes):
    """Frames that straddle batches, oversized buffers, a landmark at a batch edge: same blob."""
    tar = make_tar(*PINNED_TREE)
    reference, ref_res = _build(tar, chunk_size=4096, prefetch=PINNED_PREFETCH)
    monkeypatch.setattr(builder, "_BATCH_BYTES", batch_bytes)
    for threads in (1, 2):
        blob, res = _build(tar, chunk_size=4096, prefetch=PINNED_PREFETCH, threads=threads)
        assert blob == reference and res.prefetch_end == ref_res.prefetch_end > 0


def test_multi_chunk_files_get_whole_file_digests_across_batches(monkeypatch):
    monkeypatch.setattr(builder, "_BATCH_BYTES", 3000)
    contents = {f"f{i}": _data(i, n) for i, n in enumerate([1, 4095, 4096, 4097, 50_000, 123_457])}
    tar = make_tar(*(f(p, c) for p, c in contents.items()))
    blob, _ = _build(tar, chunk_size=4096, threads=2)
    layer = Layer.open(BytesReader(blob))
    layer.verify()
    for p, c in contents.items():
        e = layer.entry(p)
        assert e.digest == hashlib.sha256(c).digest() and layer.read(p) == c
        assert len(e.chunks) == -(-len(c) // 4096)


def test_directory_walk_is_the_canonical_order(tmp_path):
    names = ["a", "a.b", "a-b", "a0", "B", "é", "z", "a/x", "a/x/deep", "a/y", "a.b/in", "zz/.hidden"]
    nodes = []
    for n in sorted(names, key=len):
        is_dir = any(other.startswith(n + "/") for other in names)
        nodes.append(d(n) if is_dir else f(n, n.encode()))
    root = make_tree(tmp_path / "t", *nodes)
    walked = [e.path for e in iter_directory(root)]
    ordered, _, _ = builder._order(list(iter_directory(root)), [])
    assert walked == [e.path for e in ordered]
    assert walked[0] == "."
    assert walked.index("a/x/deep") < walked.index("a/y") < walked.index("a-b") < walked.index("a.b")


def test_overlay_upper_walk_places_whiteouts_and_opaque_entries_by_their_oci_names(tmp_path):
    up = make_tree(tmp_path / "upper", d("etc"), f("etc/a", b"a"), chardev("etc/passwd", 0, 0, mode=0),
                   f("etc/-x", b"x"), d("var/cache"), f("var/cache/new", b"n"), f("var/cache/-first", b"f"))
    os.setxattr(os.path.join(up, "var/cache"), "trusted.overlay.opaque", b"y")
    streamed, _ = _build(up, overlay_upper=True)
    # the list path sorts everything again; the streaming walk must already agree with it
    out = io.BytesIO()
    res = build_entries(layerfmt.scan_directory(up, overlay_upper=True), out)
    assert streamed == out.getvalue()
    paths = [e.path for e in Layer.open(BytesReader(streamed)).entries]
    assert paths.index("etc/-x") < paths.index("etc/.wh.passwd") < paths.index("etc/a")
    assert paths.index("var/cache/-first") < paths.index("var/cache/.wh..wh..opq") < paths.index("var/cache/new")
    assert res.entries == len(paths)


def _entry(size: int, data: bytes) -> list[SourceEntry]:
    return [SourceEntry(".", "dir", 0o755), SourceEntry("f", "file", 0o644, size=size,
                                                        opener=lambda: io.BytesIO(data))]


@pytest.mark.parametrize("declared, actual, chunk_size, message", [
    (10, b"12345", 1 << 20, "shrank"),
    (10, b"12345678901", 1 << 20, "grew"),
    (10_000, b"x" * 9_000, 4096, "shrank"),
    (8192, b"x" * 8193, 4096, "grew"),
])
def test_a_file_that_changes_size_while_building_is_an_input_error(declared, actual, chunk_size, message):
    with pytest.raises(LayerInputError, match=message) as err:
        build_entries(_entry(declared, actual), io.BytesIO(), chunk_size=chunk_size)
    assert err.value.path == "f"


def test_files_on_disk_that_change_or_vanish_after_the_walk_are_input_errors(tmp_path):
    root = make_tree(tmp_path / "t", f("grows", b"abc"), f("shrinks", b"abcdef"), f("gone", b"x"))
    entries = layerfmt.scan_directory(root)
    by_path = {e.path: e for e in entries}
    for path, change, message in [("grows", lambda p: open(p, "ab").write(b"more"), "grew"),
                                  ("shrinks", lambda p: open(p, "wb").write(b"ab"), "shrank"),
                                  ("gone", os.unlink, "cannot read file")]:
        snapshot = [e for e in entries if e.type != "file" or e is by_path[path]]
        change(os.path.join(root, path))
        with pytest.raises(LayerInputError, match=message) as err:
            build_entries(snapshot, io.BytesIO())
        assert err.value.path == path


def test_a_failed_build_leaves_no_threads_behind():
    before = threading.active_count()
    entries = [SourceEntry(".", "dir", 0o755)]
    entries += [SourceEntry(f"f{i:04}", "file", size=5000, opener=lambda: io.BytesIO(b"y" * 5000)) for i in range(400)]
    entries.append(SourceEntry("zz", "file", size=3, opener=lambda: io.BytesIO(b"")))
    with pytest.raises(LayerInputError, match="shrank"):
        build_entries(entries, io.BytesIO(), threads=2)
    assert threading.active_count() == before


def test_a_file_swapped_for_a_symlink_or_fifo_after_the_walk_is_refused_not_followed(tmp_path):
    root = make_tree(tmp_path / "t", f("a", b"abc"), f("b", b"abc"))
    secret = tmp_path / "secret"
    secret.write_bytes(b"top")  # same size: following the link would go unnoticed
    entries = layerfmt.scan_directory(root)
    os.unlink(os.path.join(root, "a"))
    os.symlink(secret, os.path.join(root, "a"))
    os.unlink(os.path.join(root, "b"))
    os.mkfifo(os.path.join(root, "b"))
    outcome: dict[str, BaseException | None] = {}

    def build(path: str) -> None:
        try:
            build_entries([e for e in entries if e.path in (".", path)], io.BytesIO())
            outcome[path] = None
        except BaseException as err:  # noqa: BLE001 - checked below
            outcome[path] = err

    for path in ("a", "b"):
        t = threading.Thread(target=build, args=(path,), daemon=True)
        t.start()
        t.join(30)  # a fifo opened without O_NONBLOCK would wait for a writer forever
        if t.is_alive():
            with open(os.path.join(root, "b"), "wb"):
                pass  # release the stuck open so the thread ends
            t.join()
            pytest.fail(f"building {path} blocked")
        assert isinstance(outcome[path], LayerInputError) and outcome[path].path == path
