"""The layer format: round trips with GNU tar / zstd / tarfile, random access, integrity, hostile input."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile

import msgspec
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weenv import layerfmt
from weenv.layerfmt import (
    BytesReader,
    FileReader,
    IntegrityError,
    Layer,
    LayerError,
    LayerFormatError,
    LayerInputError,
    LimitExceededError,
    TruncatedLayerError,
    UnsafePathError,
    build_layer,
)
from weenv.layerfmt._toc import (
    FOOTER_SIZE,
    SKIPPABLE_HEADER,
    SKIPPABLE_TOC_MAGIC,
    Chunk,
    Entry,
    Footer,
    encode_toc,
    toc_from_entries,
)

from .layertrees import (
    chardev,
    d,
    f,
    fifo,
    hard,
    make_tar,
    make_tree,
    normalize_groups,
    snapshot,
    sym,
)


def build_bytes(src, **kw) -> tuple[bytes, layerfmt.BuildResult]:
    out = io.BytesIO()
    if isinstance(src, bytes):
        src = io.BytesIO(src)
    res = build_layer(src, out, **kw)
    return out.getvalue(), res


def sample_tree(root):
    big = os.urandom(300_000) + b"x" * 700_000
    return make_tree(
        root,
        d("etc"),
        f("etc/hosts", b"127.0.0.1 localhost\n"),
        f("etc/shadow", b"root:*:1::::::\n", mode=0o640, gid=42),
        d("usr/bin", mode=0o755),
        f("usr/bin/tool", b"#!/bin/sh\necho hi\n", mode=0o4755),
        f("usr/lib/big.so", big),
        hard("usr/lib/big-hardlink.so", "usr/lib/big.so"),
        sym("usr/lib/libz.so", "big.so"),
        sym("abs-link", "/etc/hosts"),
        f("empty", b""),
        d("tmp", mode=0o1777),
        fifo("run/initctl"),
        chardev("dev/null", 1, 3, mode=0o666),
        f("home/user/notes.txt", b"n" * 5000, uid=1000, gid=1000),
        f("home/" + "L" * 150 + "/" + "é" * 80 + ".txt", "ünïcødé ✓\n".encode()),
        f("with.xattr", b"x", xattrs={"user.weenv.test": b"\x00\x01binary\xff", "trusted.note": b"t"}),
    )


# ---------------------------------------------------------------------------------------------- round trips


def test_blob_extracts_identically_with_gnu_tar_zstd_and_tarfile(tmp_path):
    src = sample_tree(tmp_path / "src")
    blob, res = build_bytes(src, chunk_size=256 * 1024)
    path = tmp_path / "layer.tar.zst"
    path.write_bytes(blob)
    expected = normalize_groups(snapshot(src))

    gnu = tmp_path / "gnu"
    gnu.mkdir()
    subprocess.run(["tar", "--zstd", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-xpf", str(path), "-C", str(gnu)],
                   check=True)
    assert normalize_groups(snapshot(gnu)) == expected

    piped = tmp_path / "piped"
    piped.mkdir()
    subprocess.run(f"zstd -dc {path} | tar --xattrs --xattrs-include='*' --numeric-owner -xpf - -C {piped}",
                   shell=True, check=True)
    assert normalize_groups(snapshot(piped)) == expected

    py = tmp_path / "py"
    py.mkdir()
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        tf.extractall(py, numeric_owner=True, filter="fully_trusted")
    # tarfile does not restore xattrs; everything else must match
    assert normalize_groups(snapshot(py, xattrs=False)) == normalize_groups(snapshot(src, xattrs=False))
    assert res.tar_bytes == len(raw)


def test_every_file_reads_back_through_the_toc(tmp_path):
    src = sample_tree(tmp_path / "src")
    blob, _ = build_bytes(src, chunk_size=64 * 1024)
    layer = Layer.open(BytesReader(blob))
    for rel, v in snapshot(src).items():
        kind, payload = v[0]
        e = layer.entry(rel)
        if kind == "file":
            assert layer.read(rel) == payload
            assert layer.content_entry(rel).digest == hashlib.sha256(payload).digest()
        elif kind == "symlink":
            assert (e.type, e.link) == ("symlink", payload)
        elif kind == "char":
            assert (e.type, e.devmajor, e.devminor) == ("char", *payload)
        else:
            assert e.type == kind
        assert e.mode == v[1] or e.type == "hardlink"
        assert (e.uid, e.gid) == (v[2], v[3]) or e.type == "hardlink"
    assert layer.entry(".").type == "dir"
    assert layer.entry("with.xattr").xattrs == {"trusted.note": b"t", "user.weenv.test": b"\x00\x01binary\xff"}
    layer.verify()


def test_large_files_split_into_chunks_and_any_range_reads_correctly(tmp_path):
    data = os.urandom(1_000_003)
    src = make_tree(tmp_path / "src", f("blob.bin", data))
    blob, _ = build_bytes(src, chunk_size=100_000)
    layer = Layer.open(BytesReader(blob))
    e = layer.entry("blob.bin")
    assert [c.ulength for c in e.chunks] == [100_000] * 10 + [3]
    for off, n in [(0, 1), (99_999, 2), (100_000, 100_000), (123_456, 654_321), (999_999, 100), (1_000_002, 1), (5, 0)]:
        assert layer.read("blob.bin", off, n) == data[off : off + n]
    assert layer.read("blob.bin", 2_000_000, 10) == b""


def test_same_tree_gives_byte_identical_blob_from_dir_and_from_tar(tmp_path):
    src = sample_tree(tmp_path / "src")
    a, ra = build_bytes(src, threads=1)
    b, rb = build_bytes(src, threads=4)
    assert a == b and ra.digest == rb.digest
    tar_path = tmp_path / "src.tar"
    subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "-cf", str(tar_path), "-C", str(src), "."],
                   check=True)
    c, rc = build_bytes(tar_path.read_bytes())
    assert rc.digest == ra.digest and c == a


def test_tar_gz_and_tar_zst_inputs_convert_like_plain_tar(tmp_path):
    tar = make_tar(d("a"), f("a/x", b"hello"), sym("a/y", "x"), hard("a/z", "a/x"))
    plain, r1 = build_bytes(tar)
    import gzip

    gz, r2 = build_bytes(gzip.compress(tar, mtime=0))
    zs, r3 = build_bytes(zstandard.ZstdCompressor().compress(tar))
    assert plain == gz == zs
    layer = Layer.open(BytesReader(plain))
    assert layer.entry("a/z").type == "hardlink" and layer.read("a/z") == b"hello"


def test_a_weenv_layer_is_itself_a_valid_conversion_input(tmp_path):
    src = sample_tree(tmp_path / "src")
    blob, r1 = build_bytes(src)
    again, r2 = build_bytes(blob)
    assert r2.digest == r1.digest


def test_oci_whiteouts_in_tar_become_whiteout_and_opaque_entries():
    tar = make_tar(d("etc"), f("etc/.wh.passwd"), d("var/cache"), f("var/cache/.wh..wh..opq"), f("keep", b"k"))
    blob, _ = build_bytes(tar)
    layer = Layer.open(BytesReader(blob))
    assert layer.entry("etc/.wh.passwd").type == "whiteout"
    assert layer.entry("var/cache/.wh..wh..opq").type == "opaque"
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True).read()
    names = tarfile.open(fileobj=io.BytesIO(raw)).getnames()
    assert "etc/.wh.passwd" in names and "var/cache/.wh..wh..opq" in names


def test_overlay_upper_dirs_convert_whiteouts_and_opaque_dirs(tmp_path):
    up = make_tree(tmp_path / "upper", d("etc"), chardev("etc/passwd", 0, 0, mode=0), d("var/cache"), f("new", b"n"))
    os.setxattr(up / "var/cache" if hasattr(up, "__truediv__") else os.path.join(up, "var/cache"),
                "trusted.overlay.opaque", b"y")
    blob, _ = build_bytes(up, overlay_upper=True)
    layer = Layer.open(BytesReader(blob))
    assert layer.entry("etc/.wh.passwd").type == "whiteout"
    assert "etc/passwd" not in layer
    assert layer.entry("var/cache/.wh..wh..opq").type == "opaque"
    assert "trusted.overlay.opaque" not in layer.entry("var/cache").xattrs
    # without the flag a char 0:0 is just a device node
    plain, _ = build_bytes(up)
    assert Layer.open(BytesReader(plain)).entry("etc/passwd").type == "char"


def test_prefetch_files_come_first_and_one_read_covers_them(tmp_path):
    src = make_tree(tmp_path / "src", *[f(f"lib/m{i:03}.py", os.urandom(2000)) for i in range(50)],
                    f("bin/python", os.urandom(300_000)), f("zzz/late.txt", b"late"))
    prefetch = ["zzz/late.txt", "bin/python", "missing/file"]
    blob, res = build_bytes(src, prefetch=prefetch)
    assert res.prefetch_missing == ["missing/file"]
    layer = Layer.open(BytesReader(blob))
    assert layer.prefetch_end == res.prefetch_end > 0
    paths = [e.path for e in layer.entries]
    assert paths.index("zzz/late.txt") < paths.index("bin/python") < paths.index("lib/m000.py")
    for p in ("zzz/late.txt", "bin/python"):
        assert all(c.offset + c.length <= layer.prefetch_end for c in layer.entry(p).chunks)
    assert all(c.offset >= layer.prefetch_end for c in layer.entry("lib/m000.py").chunks)
    # the blob still extracts to the same tree
    out = tmp_path / "x"
    out.mkdir()
    (tmp_path / "b").write_bytes(blob)
    subprocess.run(["tar", "--zstd", "-xpf", str(tmp_path / "b"), "-C", str(out)], check=True)
    assert snapshot(out) == snapshot(src)


class CountingReader:
    def __init__(self, inner):
        self.inner = inner
        self.reads: list[tuple[int, int]] = []

    @property
    def size(self):
        return self.inner.size

    def read_at(self, offset, n):
        self.reads.append((offset, n))
        return self.inner.read_at(offset, n)


def test_cat_of_one_small_file_reads_only_the_tail_and_its_chunks(tmp_path):
    src = make_tree(tmp_path / "src", *[f(f"d{i // 100}/f{i}", os.urandom(4096)) for i in range(3000)],
                    f("needle.txt", b"the needle\n"))
    path = tmp_path / "l"
    with open(path, "wb") as out:
        build_layer(src, out)
    reader = CountingReader(FileReader.open(path))
    layer = Layer.open(reader)
    assert len(reader.reads) == 1  # footer + TOC in one speculative tail read
    tail_bytes = reader.reads[0][1]
    assert layer.read("needle.txt") == b"the needle\n"
    c = layer.entry("needle.txt").chunks[0]
    assert reader.reads[1:] == [(c.offset, c.length)]
    assert tail_bytes + c.length < reader.size / 20


def test_opening_a_layer_with_a_toc_larger_than_the_speculative_read_takes_two_reads(tmp_path):
    src = make_tree(tmp_path / "src", *[f(f"many/{i:05}", b"") for i in range(4000)])
    blob, _ = build_bytes(src)
    reader = CountingReader(BytesReader(blob))
    Layer.open(reader, tail_read=1024)
    assert len(reader.reads) == 2


def test_cli_build_inspect_cat_verify_convert(tmp_path):
    from click.testing import CliRunner

    from weenv.cli import main

    src = sample_tree(tmp_path / "src")
    out = tmp_path / "l.weenv"
    r = CliRunner().invoke(main, ["layer", "build", str(src), "-o", str(out), "--chunk-size", "128KiB", "--json"])
    assert r.exit_code == 0, r.output
    built = msgspec.json.decode(r.output)
    r = CliRunner().invoke(main, ["layer", "inspect", str(out), "--json"])
    assert r.exit_code == 0, r.output
    info = msgspec.json.decode(r.output)
    assert info["digest"] == built["digest"] and info["toc_digest"] == built["toc_digest"]
    assert {e["path"] for e in info["entries"]} >= {"etc/hosts", "usr/lib/big.so"}
    assert any(len(e.get("chunks", [])) > 1 for e in info["entries"])
    r = CliRunner().invoke(main, ["layer", "cat", str(out), "etc/hosts"])
    assert r.exit_code == 0 and r.stdout_bytes == b"127.0.0.1 localhost\n"
    r = CliRunner().invoke(main, ["layer", "verify", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["layer", "cat", str(out), "no/such"])
    assert r.exit_code != 0 and "no/such" in r.output
    tar = tmp_path / "x.tar.gz"
    subprocess.run(["tar", "-czf", str(tar), "-C", str(src), "."], check=True)
    r = CliRunner().invoke(main, ["layer", "convert", str(tar), "-o", str(tmp_path / "c.weenv")])
    assert r.exit_code == 0, r.output
    assert Layer.open(FileReader.open(tmp_path / "c.weenv")).read("etc/hosts") == b"127.0.0.1 localhost\n"


# ---------------------------------------------------------------------------------------------- integrity


def test_corrupted_chunk_is_detected_on_read_and_by_verify(tmp_path):
    src = make_tree(tmp_path / "src", f("a.txt", b"A" * 10_000), f("b.txt", os.urandom(10_000)))
    blob, _ = build_bytes(src)
    layer = Layer.open(BytesReader(blob))
    c = layer.entry("b.txt").chunks[0]
    bad = bytearray(blob)
    bad[c.offset + c.length // 2] ^= 0xFF
    broken = Layer.open(BytesReader(bytes(bad)))
    assert broken.read("a.txt") == b"A" * 10_000  # other files unaffected
    with pytest.raises(IntegrityError) as ei:
        broken.read("b.txt")
    assert ei.value.path == "b.txt" and "b.txt" in str(ei.value)
    with pytest.raises(IntegrityError, match="b.txt"):
        broken.verify()
    p = tmp_path / "bad"
    p.write_bytes(bytes(bad))
    from click.testing import CliRunner

    from weenv.cli import main

    r = CliRunner().invoke(main, ["layer", "verify", str(p)])
    assert r.exit_code != 0 and "b.txt" in r.output


def test_a_valid_frame_with_other_content_is_rejected_by_its_sha256(tmp_path):
    src = make_tree(tmp_path / "src", f("a", b"AAAA"), f("b", b"BBBB"))
    blob, _ = build_bytes(src)
    layer = Layer.open(BytesReader(blob))
    ca, cb = layer.entry("a").chunks[0], layer.entry("b").chunks[0]
    assert ca.length == cb.length
    swapped = bytearray(blob)
    swapped[ca.offset : ca.offset + ca.length] = blob[cb.offset : cb.offset + cb.length]
    with pytest.raises(IntegrityError, match="sha256"):
        Layer.open(BytesReader(bytes(swapped))).read("a")


def test_verify_chunk_is_the_explicit_check_apart_from_decompression(tmp_path):
    src = make_tree(tmp_path / "src", f("a", b"A" * 3000))
    blob, _ = build_bytes(src)
    c = Layer.open(BytesReader(blob)).entry("a").chunks[0]
    frame_bytes = blob[c.offset : c.offset + c.length]
    data = layerfmt.decompress_chunk(c, frame_bytes)
    assert data == b"A" * 3000
    layerfmt.verify_chunk(data, c.digest)  # passes silently
    layerfmt.verify_chunk(memoryview(data), c.digest)
    forged = b"B" + data[1:]
    with pytest.raises(IntegrityError, match="sha256 mismatch.*path 'a'"):
        layerfmt.verify_chunk(forged, c.digest, path="a", offset=c.offset)
    # decompression alone does not verify: a valid frame of other bytes decompresses fine
    other = zstandard.ZstdCompressor().compress(forged)
    lie = Chunk(c.offset, len(other), 0, len(forged), c.digest)
    assert layerfmt.decompress_chunk(lie, other) == forged
    with pytest.raises(IntegrityError, match="sha256"):
        layerfmt.decode_chunk(lie, other)
    with pytest.raises(ValueError, match="32 bytes"):
        layerfmt.verify_chunk(data, c.digest.hex().encode())


@pytest.mark.parametrize("cut", [1, FOOTER_SIZE - 1, FOOTER_SIZE + 10, 1000])
def test_truncated_blob_is_rejected(tmp_path, cut):
    src = make_tree(tmp_path / "src", f("a", os.urandom(5000)))
    blob, _ = build_bytes(src)
    with pytest.raises(LayerFormatError):
        Layer.open(BytesReader(blob[:-cut]))


def test_truncated_data_region_fails_reads_not_open(tmp_path):
    src = make_tree(tmp_path / "src", f("a", os.urandom(5000)))
    blob, _ = build_bytes(src)
    layer = Layer.open(BytesReader(blob))

    class Short(BytesReader):
        def read_at(self, offset, n):
            return super().read_at(offset, n)[: max(0, n - 1)]

    short = Layer(Short(blob), layer.footer, layer.columns)
    with pytest.raises(TruncatedLayerError):
        short.read("a")


def test_toc_digest_is_checked_against_the_footer_and_the_pinned_digest(tmp_path):
    src = make_tree(tmp_path / "src", f("a", b"a"))
    blob, res = build_bytes(src)
    Layer.open(BytesReader(blob), expected_toc_digest=res.toc_digest)
    with pytest.raises(IntegrityError, match="pinned"):
        Layer.open(BytesReader(blob), expected_toc_digest="sha256:" + "0" * 64)
    layer = Layer.open(BytesReader(blob))
    bad = bytearray(blob)
    bad[layer.footer.toc_offset + 12] ^= 1
    with pytest.raises(IntegrityError, match="TOC sha256"):
        Layer.open(BytesReader(bytes(bad)))


def test_wrong_magic_and_version_are_named():
    blob, _ = build_bytes(make_tar(f("a", b"a")))
    bad = bytearray(blob)
    bad[-FOOTER_SIZE + 8] = ord("X")
    with pytest.raises(LayerFormatError, match="magic"):
        Layer.open(BytesReader(bytes(bad)))
    bad = bytearray(blob)
    bad[-FOOTER_SIZE + 16] = 99
    with pytest.raises(LayerFormatError, match="version 99"):
        Layer.open(BytesReader(bytes(bad)))
    with pytest.raises(LayerFormatError, match="not a weenv layer"):
        Layer.open(BytesReader(zstandard.ZstdCompressor().compress(make_tar(f("a", b"a")))))


# ---------------------------------------------------------------------------------------------- hostile TOCs


def forge(entries: list[Entry], data: bytes = b"", *, chunk_size: int = 1 << 20, prefetch_end: int = 0,
          toc_bytes: bytes | None = None) -> bytes:
    """A blob with an arbitrary TOC: the builder would refuse to write these."""
    raw = encode_toc(toc_from_entries(entries, chunk_size, prefetch_end)) if toc_bytes is None else toc_bytes
    comp = zstandard.ZstdCompressor().compress(raw)
    footer = Footer(1, 0, len(data), len(comp), len(raw), hashlib.sha256(comp).digest())
    return data + SKIPPABLE_HEADER.pack(SKIPPABLE_TOC_MAGIC, len(comp)) + comp + footer.pack()


def frame(content: bytes) -> tuple[bytes, Chunk]:
    fr = zstandard.ZstdCompressor().compress(content)
    return fr, Chunk(0, len(fr), 0, len(content), hashlib.sha256(content).digest())


def E(path, type="file", **kw):
    kw.setdefault("digest", hashlib.sha256(b"").digest() if type == "file" else b"")
    return Entry(path, type, kw.pop("mode", 0o644), 0, 0, 0, **kw)


@pytest.mark.parametrize(
    "entries, exc, match",
    [
        ([E("../etc/passwd")], UnsafePathError, "'..'"),
        ([E("a/../../x")], UnsafePathError, "'..'"),
        ([E("/etc/passwd")], UnsafePathError, "absolute"),
        ([E("a\x00b")], LayerFormatError, "NUL"),
        ([E("a//b")], UnsafePathError, "empty"),
        ([E("a/./b")], UnsafePathError, "'.'"),
        ([E("")], UnsafePathError, "empty"),
        ([E("a"), E("a")], LayerFormatError, "duplicate"),
        ([E("b", "hardlink", link="a", digest=b""), E("a")], LayerFormatError, "earlier"),
        ([E("b", "hardlink", link="missing", digest=b"")], LayerFormatError, "earlier"),
        ([E("d", "dir", digest=b""), E("b", "hardlink", link="d", digest=b"")], LayerFormatError, "dir"),
        ([E(".", "file")], LayerFormatError, "root"),
        ([E("x", "whiteout", digest=b"")], UnsafePathError, ".wh."),
        ([E("d/.wh.x", "file")], UnsafePathError, ".wh."),
        ([E("d/.wh..wh..opq", "whiteout", digest=b"")], UnsafePathError, ".wh."),
        ([E("x", "symlink", link="", digest=b"")], LayerFormatError, "symlink"),
        ([E("x", mode=0o17777)], LayerFormatError, "mode"),
        ([E("x" * 300)], LimitExceededError, "255"),
        ([E("/".join(["abcdefgh"] * 600))], LimitExceededError, "4096"),
        ([E("x", xattrs={f"user.{i}": b"" for i in range(200)})], LimitExceededError, "xattrs"),
        ([E("x", xattrs={"user.big": b"v" * 100_000})], LimitExceededError, "xattr"),
    ],
)
def test_hostile_toc_entries_are_rejected_with_the_path_named(entries, exc, match):
    with pytest.raises(exc, match=match):
        Layer.open(BytesReader(forge(entries)))


def test_hostile_chunks_are_rejected():
    fr, c = frame(b"hello world" * 10)
    ok = [E("a", size=c.ulength, digest=c.digest, chunks=[c])]
    Layer.open(BytesReader(forge(ok, fr))).read("a")
    half = Chunk(len(fr) // 2, len(fr) - len(fr) // 2, 0, 5, c.digest)
    cases = [
        ([E("a", chunks=[Chunk(0, len(fr) + 100, 0, c.ulength, c.digest)])], "outside"),
        ([E("a", chunks=[c]), E("b", chunks=[c])], "overlaps"),
        ([E("a", chunks=[c, half])], "overlaps"),
        ([E("a", chunks=[Chunk(0, len(fr), 0, 100 << 20, c.digest)])], "oversized"),
        ([E("a", chunks=[Chunk(0, 0, 0, 10, c.digest)])], "empty"),
        ([E("d", "dir", digest=b"", chunks=[c])], "content"),
    ]
    for entries, match in cases:
        with pytest.raises(LayerFormatError, match=match):
            Layer.open(BytesReader(forge(entries, fr)))
    with pytest.raises(OverflowError):  # the encoder itself refuses negative offsets
        forge([E("a", chunks=[Chunk(-1, len(fr), 0, c.ulength, c.digest)])], fr)


def test_sparse_maps_must_match_their_entries():
    toc = toc_from_entries([E("a"), E("l", "symlink", link="a", digest=b"")], 4096, 0)
    for change, match in [
        (dict(links={}), "without a target"),
        (dict(links={0: "x", 1: "a"}), "cannot have a link target"),
        (dict(devices={0: (1, 3)}), "not a device"),
        (dict(file_digests={0: b"x" * 32}), "multi-chunk"),
        (dict(xattrs={7: {"user.a": b""}}), "does not exist"),
        (dict(modes=toc.modes[:-2]), "modes"),
        (dict(count=3), "paths"),
    ]:
        bad = msgspec.structs.replace(toc, **change)
        with pytest.raises(LayerFormatError, match=match):
            Layer.open(BytesReader(forge([], toc_bytes=encode_toc(bad))))


def test_a_file_used_as_a_parent_directory_is_caught_when_building_the_tree():
    layer = Layer.open(BytesReader(forge([E("a"), E("a/b")])))
    with pytest.raises(LayerFormatError, match="not a directory"):
        layer.columns.parents()
    ok = Layer.open(BytesReader(forge([E(".", "dir", digest=b""), E("d", "dir", digest=b""), E("d/f"), E("x/y")])))
    assert ok.columns.parents() == [-1, 0, 1, -1]


def test_a_huge_declared_toc_is_refused_before_allocation():
    blob = forge([E("a")])
    footer = Footer.unpack(blob[-FOOTER_SIZE:], len(blob))
    lying = Footer(1, 0, footer.toc_offset, footer.toc_length, 50 << 30, footer.toc_sha256)
    with pytest.raises(LimitExceededError, match="decompressed TOC"):
        Layer.open(BytesReader(blob[:-FOOTER_SIZE] + lying.pack()))
    small = layerfmt.Limits(max_entries=3)
    with pytest.raises(LimitExceededError, match="entries"):
        Layer.open(BytesReader(forge([E(f"f{i}") for i in range(5)])), limits=small)


def test_toc_that_is_not_msgpack_or_has_wrong_types_is_rejected():
    with pytest.raises(LayerFormatError, match="TOC"):
        Layer.open(BytesReader(forge([], toc_bytes=b"\xc1garbage")))
    with pytest.raises(LayerFormatError, match="TOC"):
        Layer.open(BytesReader(forge([], toc_bytes=msgspec.msgpack.encode({"version": "x", "entries": 3}))))


# ---------------------------------------------------------------------------------------------- bad build input


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/../../b"])
def test_tar_input_with_unsafe_names_is_rejected(name):
    with pytest.raises(LayerInputError, match="path"):
        build_bytes(make_tar(f("x", b"1"), names={"x": name}))


def test_tar_input_hardlink_to_missing_target_is_rejected():
    with pytest.raises(LayerInputError, match="not in the archive"):
        build_bytes(make_tar(hard("b", "nope")))


def test_garbage_input_is_a_clear_error(tmp_path):
    with pytest.raises(LayerInputError, match="tar"):
        build_bytes(b"definitely not a tar archive" * 40)
    with pytest.raises(LayerInputError):
        build_bytes(str(tmp_path / "missing"))


def test_names_starting_with_wh_in_a_plain_dir_are_refused(tmp_path):
    src = make_tree(tmp_path / "s", f(".wh.sneaky", b""))
    with pytest.raises(LayerInputError, match=".wh."):
        build_bytes(src)


# ---------------------------------------------------------------------------------------------- properties and fuzzing

_names = st.text(alphabet="abcxyzé_-.0", min_size=1, max_size=12).filter(lambda s: s not in (".", "..")
                                                                          and not s.startswith(".wh."))


@st.composite
def trees(draw):
    nodes = []
    dirs = [""]
    files = []
    for _ in range(draw(st.integers(1, 25))):
        parent = draw(st.sampled_from(dirs))
        path = f"{parent}/{draw(_names)}".lstrip("/")
        if any(n.path == path for n in nodes) or any(path.startswith(p.path + "/") for p in nodes if p.kind != "dir"):
            continue
        kind = draw(st.sampled_from(["file", "file", "file", "dir", "symlink", "hardlink"]))
        if kind == "file":
            size = draw(st.sampled_from([0, 1, 100, 4096, 70_000]))
            nodes.append(f(path, draw(st.binary(min_size=size, max_size=size)) if size < 200 else os.urandom(size),
                           mode=draw(st.sampled_from([0o644, 0o755, 0o600, 0o4755])), uid=draw(st.integers(0, 70000))))
            files.append(path)
        elif kind == "dir":
            nodes.append(d(path, mode=draw(st.sampled_from([0o755, 0o700, 0o1777]))))
            dirs.append(path)
        elif kind == "symlink":
            nodes.append(sym(path, draw(_names)))
        elif files:
            nodes.append(hard(path, draw(st.sampled_from(files))))
    return nodes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nodes=trees(), chunk_size=st.sampled_from([1000, 4096, 1 << 20]))
def test_property_round_trip_of_random_trees(tmp_path_factory, nodes, chunk_size):
    root = tmp_path_factory.mktemp("t")
    src = make_tree(root / "src", *nodes)
    blob, res = build_bytes(src, chunk_size=chunk_size)
    layer = Layer.open(BytesReader(blob), expected_toc_digest=res.toc_digest)
    layer.verify()
    snap = snapshot(src)
    for rel, v in snap.items():
        if v[0][0] == "file":
            assert layer.read(rel) == v[0][1]
    (root / "l").write_bytes(blob)
    out = root / "out"
    out.mkdir()
    subprocess.run(["tar", "--zstd", "--numeric-owner", "-xpf", str(root / "l"), "-C", str(out)], check=True)
    assert normalize_groups(snapshot(out)) == normalize_groups(snap)
    assert build_bytes(src, chunk_size=chunk_size)[0] == blob


_FUZZ_BASE: list[bytes] = []


def _fuzz_base() -> bytes:
    if not _FUZZ_BASE:
        tar = make_tar(d("a"), f("a/x", b"hello" * 100), sym("a/y", "x"), hard("a/z", "a/x"), f(".wh.gone"),
                       f("big", bytes(range(256)) * 40))
        _FUZZ_BASE.append(build_bytes(tar, chunk_size=4096)[0])
    return _FUZZ_BASE[0]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_open_and_read_only_raise_typed_errors(data):
    blob = bytearray(_fuzz_base())
    region = data.draw(st.sampled_from(["tail", "any", "toc"]))
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        if region == "tail":
            pos = len(blob) - 1 - data.draw(st.integers(0, min(len(blob) - 1, 400)))
        else:
            pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    try:
        layer = Layer.open(BytesReader(bytes(blob)))
        for e in layer.entries:
            if e.type in ("file", "hardlink"):
                try:
                    layer.read(e.path)
                except LayerError:
                    pass
    except LayerError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_forged_tocs_only_raise_typed_errors(data):
    raw = bytearray(encode_toc(toc_from_entries(
        [E("a"), E("b", "dir", digest=b""), E("b/c", "symlink", link="x", digest=b"")], 4096, 0)))
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    try:
        Layer.open(BytesReader(forge([], toc_bytes=bytes(raw))))
    except LayerError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_tar_conversion_only_raises_typed_errors(data):
    tar = bytearray(make_tar(d("a"), f("a/x", b"hello" * 300), sym("a/y", "x"), hard("a/z", "a/x"),
                             f("p" * 120, b"long name")))
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(tar) - 1))
        tar[pos] = data.draw(st.integers(0, 255))
    try:
        blob, _ = build_bytes(bytes(tar))
    except LayerError:
        return
    Layer.open(BytesReader(blob)).verify()


# ---------------------------------------------------------------------------------------------- purity


def test_layerfmt_imports_nothing_from_other_weenv_packages_or_network_or_fuse():
    code = (
        "import sys, weenv.layerfmt\n"
        "bad = [m for m in sys.modules if m.startswith(('weenv.registry', 'weenv.envlet', 'weenv.plan', "
        "'weenv.provision', 'weenv.cli', 'httpx', 'httpcore', 'oras', 'requests', 'pyfuse3', 'trio', 'asyncio', "
        "'socket', 'ssl', 'urllib.request', 'http.client'))]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


@settings(max_examples=300, deadline=None)
@given(name=st.text(min_size=1, max_size=120), kind=st.sampled_from(["file", "dir", "symlink", "hardlink", "char",
                                                                     "fifo", "whiteout"]),
       mode=st.integers(0, 0o7777), uid=st.integers(0, 1 << 22), size=st.integers(0, 1 << 40),
       mtime=st.integers(0, 1 << 34), link=st.text(max_size=110), dev=st.integers(0, 4095))
def test_fast_tar_headers_are_byte_identical_to_tarfile(name, kind, mode, uid, size, mtime, link, dev):
    from weenv.layerfmt._tarheader import _TYPE_FLAGS, tar_header

    name = name.replace("\x00", "")
    link = link.replace("\x00", "") if kind in ("symlink", "hardlink") else ""
    size = size if kind == "file" else 0
    if not name:
        return
    ti = tarfile.TarInfo(name + ("/" if kind == "dir" and not name.endswith("/") else ""))
    ti.type = _TYPE_FLAGS[kind]
    ti.mode, ti.uid, ti.gid, ti.size, ti.mtime, ti.linkname = mode, uid, uid, size, mtime, link
    ti.uname = ti.gname = ""
    ti.devmajor = ti.devminor = dev if kind == "char" else 0
    expected = ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    got = tar_header(name, kind, mode, uid, uid, size, mtime, link, ti.devmajor, ti.devminor)
    assert got == expected
