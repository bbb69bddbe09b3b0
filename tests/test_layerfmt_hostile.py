"""Hostile TOCs are rejected early and small: a zstd bomb or a column far larger than the entry
count allows fails with a typed error while the reader's peak memory stays bounded (in a fresh
subprocess, so nothing else counts: the peak RSS (VmHWM) after the open minus the resident size
before it, an upper bound of what the open added)."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import textwrap

import pytest
import zstandard

from weenv import layerfmt
from weenv.layerfmt._toc import SKIPPABLE_HEADER, SKIPPABLE_TOC_MAGIC, Footer

PROBE = textwrap.dedent("""
    import json, sys
    from weenv import layerfmt

    def status_kib(key):  # VmHWM is this process's own peak (ru_maxrss would carry the parent's over exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    reader = layerfmt.FileReader.open(sys.argv[1])
    before_kib = status_kib("VmRSS")
    try:
        layerfmt.Layer.open(reader)
        error = None
    except layerfmt.LayerError as e:
        error = [type(e).__name__, str(e)]
    print(json.dumps({"error": error, "growth_kib": status_kib("VmHWM") - before_kib}))
""")


def write_toc_bomb(path: str, ulength: int, prefix: bytes = b"") -> int:
    """A blob with no data and a TOC of ``prefix`` + zeros, ``ulength`` bytes decompressed, written
    in pieces (this process never holds it); returns the compressed TOC size."""
    cobj = zstandard.ZstdCompressor(level=3).compressobj(size=ulength)
    parts, left, zero = [cobj.compress(prefix)], ulength - len(prefix), bytes(1 << 20)
    while left:
        parts.append(cobj.compress(zero[: min(left, len(zero))]))
        left -= min(left, len(zero))
    parts.append(cobj.flush())
    comp = b"".join(parts)
    footer = Footer(1, 0, 0, len(comp), ulength, hashlib.sha256(comp).digest())
    with open(path, "wb") as f:
        f.write(SKIPPABLE_HEADER.pack(SKIPPABLE_TOC_MAGIC, len(comp)) + comp + footer.pack())
    return len(comp)


def huge_paths_prefix(ulength: int) -> bytes:
    """A TOC-shaped start: count = 1, then a paths string that claims nearly all of the TOC."""
    head = (b"\xde\x00\x13\xa7version\x01\xaachunk_size\xce\x00\x10\x00\x00\xa5count\x01\xa5paths\xdb")
    return head + struct.pack(">I", ulength - len(head) - 4)


@pytest.mark.parametrize("kind", ["zeros", "huge-paths"])
def test_a_toc_bomb_is_rejected_with_a_typed_error_and_bounded_memory(tmp_path, kind):
    ulength = 256 << 20  # exactly the limit: the footer's claim alone is acceptable
    assert ulength <= layerfmt.DEFAULT_LIMITS.max_toc_ubytes
    path = str(tmp_path / "bomb")
    compressed = write_toc_bomb(path, ulength, huge_paths_prefix(ulength) if kind == "huge-paths" else b"")
    assert compressed < 1 << 20  # a bomb indeed
    r = subprocess.run([sys.executable, "-c", PROBE, path], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] is not None, "a hostile TOC was accepted"
    name, message = out["error"]
    assert issubclass(getattr(layerfmt, name), layerfmt.LayerFormatError), (name, message)
    assert "TOC" in message
    growth_mib = out["growth_kib"] / 1024
    print(f"{kind}: {name}: {message}; peak RSS growth {growth_mib:.1f} MiB for a {ulength >> 20} MiB TOC")
    assert growth_mib < 16, f"rejecting the {ulength >> 20} MiB TOC grew the peak RSS by {growth_mib:.0f} MiB"


def test_the_decompressed_toc_limit_is_256_mib():
    assert layerfmt.DEFAULT_LIMITS.max_toc_ubytes == 256 << 20


def test_the_shape_check_walks_every_field_of_real_tocs_without_complaint(monkeypatch):
    import io

    from weenv.layerfmt import _tocshape

    from .layertrees import chardev, d, f, hard, make_tar, sym

    monkeypatch.setattr(_tocshape, "MAP_WALK_BYTES", 0)  # walk the sparse maps too, as in a big TOC
    tar = make_tar(d("etc"), f("etc/big", bytes(range(256)) * 1000), hard("etc/big2", "etc/big"),
                   sym("etc/link", "big"), chardev("dev/null", 1, 3), f("x", b"x", xattrs={"user.a": b"\x00" * 100}),
                   f("empty", b""))
    out = io.BytesIO()
    layerfmt.build_layer(io.BytesIO(tar), out, chunk_size=64 << 10)
    lay = layerfmt.Layer.open(layerfmt.BytesReader(out.getvalue()))
    assert lay.toc.file_digests and lay.toc.links and lay.toc.devices and lay.toc.xattrs
    assert lay.read("etc/big") == bytes(range(256)) * 1000


def _toc_with_an_xattr_value_claiming(n: int) -> bytearray:
    from weenv.layerfmt._toc import Entry, encode_toc, toc_from_entries

    e = [Entry("x", "file", 0o644, 0, 0, 0, digest=hashlib.sha256(b"").digest(), xattrs={"user.a": b"v" * 10})]
    raw = encode_toc(toc_from_entries(e, 1 << 20, 0))
    small = b"\xc4\x0a" + b"v" * 10
    assert raw.count(small) == 1
    return bytearray(raw.replace(small, b"\xc6" + struct.pack(">I", n) + b"v" * 10))


def test_junk_inside_a_sparse_map_of_a_big_toc_fails_at_its_header():
    from weenv.layerfmt._tocshape import TocShapeCheck

    buf = _toc_with_an_xattr_value_claiming(200 << 20)  # the footer would declare ~200 MiB
    check = TocShapeCheck(layerfmt.DEFAULT_LIMITS, 201 << 20, 0)
    with pytest.raises(layerfmt.LimitExceededError, match="xattr value of 209715200 bytes"):
        check.feed(buf)  # only the first few hundred bytes have arrived


@pytest.mark.parametrize("raw, match", [
    (b"\x00" * 64, "not a msgpack map"),
    (b"\x81\xa3bad\x01", "unknown TOC field 'bad'"),
    (b"\x82\xa5count\x01\xa7version\x01", "out of order"),
    (b"\x81\xa7version\xa1x", "version is a str, expected an int"),
    (b"\x81\xa5count\xce\x7f\xff\xff\xff", "entries, limit is"),
    (b"\x80\x00", "1 bytes follow the end"),
])
def test_shape_errors_name_what_is_wrong_and_where(raw, match):
    from weenv.layerfmt._tocshape import TocShapeCheck

    with pytest.raises(layerfmt.LayerFormatError, match=match) as ei:
        TocShapeCheck(layerfmt.DEFAULT_LIMITS, 1 << 20, 1234).feed(bytearray(raw))
    assert "TOC byte" in str(ei.value) and ei.value.offset == 1234
