"""The table of contents: plain columnar data, one comment per field, and its validation.

The TOC lists the tar entries in blob order. It is stored as columns (packed little-endian arrays
plus a few sparse maps) rather than one record per entry, so that a 100k-entry TOC decodes and
validates in tens of milliseconds: every check below runs over whole columns.

OCI whiteouts keep their tar names (``dir/.wh.NAME`` with type ``whiteout``, ``dir/.wh..wh..opq``
with type ``opaque``); consumers translate them (the envlet shows a whiteout as a char 0:0 device).
"""

from __future__ import annotations

import array
import hashlib
import operator
import struct
import sys
from dataclasses import dataclass
from itertools import accumulate, compress
from typing import Literal

import msgspec

from ._errors import (
    IntegrityError,
    LayerFormatError,
    LimitExceededError,
    TruncatedLayerError,
    UnsafePathError,
)

FORMAT_VERSION = 1
MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
TOC_DIGEST_ANNOTATION = "dev.weenv.layer.toc.digest"
DEFAULT_CHUNK_SIZE = 1 << 20

# zstd skippable frames: 4-byte little-endian magic 0x184D2A5? then a 4-byte little-endian size.
SKIPPABLE_TOC_MAGIC = 0x184D2A5E
SKIPPABLE_FOOTER_MAGIC = 0x184D2A5F
FOOTER_MAGIC = b"WEENVTOC"
_FOOTER_PAYLOAD = struct.Struct("<8sHHIQQQ32s")  # magic, version, flags, reserved, toc off/clen/ulen, sha256
FOOTER_SIZE = 8 + _FOOTER_PAYLOAD.size  # 80 bytes
SKIPPABLE_HEADER = struct.Struct("<II")

EntryType = Literal["file", "dir", "symlink", "hardlink", "char", "block", "fifo", "whiteout", "opaque"]
TYPE_NAMES: tuple[EntryType, ...] = ("file", "dir", "symlink", "hardlink", "char", "block", "fifo", "whiteout", "opaque")
TYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(TYPE_NAMES)}
FILE, DIR, SYMLINK, HARDLINK, CHAR, BLOCK, FIFO, WHITEOUT, OPAQUE = range(9)
WHITEOUT_PREFIX = ".wh."
OPAQUE_NAME = ".wh..wh..opq"
EMPTY_SHA256 = hashlib.sha256(b"").digest()

if sys.byteorder != "little":  # pragma: no cover - columns are little-endian on disk
    raise ImportError("weenv.layerfmt needs a little-endian host")


class TOC(msgspec.Struct, omit_defaults=True, gc=False):
    """The encoded table of contents (msgpack). Entry i is described by position i of each column."""

    version: int  # FORMAT_VERSION the blob was written with
    chunk_size: int  # largest uncompressed chunk the builder produced
    count: int  # number of entries
    paths: str  # entry paths joined by NUL; relative, '/'-separated; "." (root dir) only as entry 0
    types: bytes  # one type code per entry (index into TYPE_NAMES)
    modes: bytes  # u16 per entry: permission bits incl. setuid/setgid/sticky
    uids: bytes  # u32 per entry
    gids: bytes  # u32 per entry
    mtimes: bytes  # i64 per entry, seconds since the epoch
    chunk_counts: bytes  # u32 per entry: how many chunks a regular file has (0 for empty files and non-files);
    #                      a file's size is the sum of its chunks' ulengths, so it cannot disagree with them
    chunk_offsets: bytes  # u64 per chunk: blob offset of the chunk's zstd frame; chunks are in blob order
    chunk_lengths: bytes  # u32 per chunk: compressed length of the frame
    chunk_ulengths: bytes  # u32 per chunk: bytes the frame decompresses to (its file slice)
    chunk_digests: bytes  # 32 bytes per chunk: sha256 of the decompressed slice (the L2 cache key)
    file_digests: dict[int, bytes] = {}  # entry index -> sha256 of the whole file, for files of 2+ chunks
    #                                      (a 0- or 1-chunk file's digest is that of its chunk, or of b"")
    links: dict[int, str] = {}  # entry index -> symlink target, or the earlier path a hardlink points to
    devices: dict[int, tuple[int, int]] = {}  # entry index -> (major, minor) for char/block entries
    xattrs: dict[int, dict[str, bytes]] = {}  # entry index -> extended attributes
    prefetch_end: int = 0  # blob offset where the prefetch region ends; [0, prefetch_end) is one read


class Chunk(msgspec.Struct, frozen=True, gc=False):
    """One zstd frame holding a contiguous slice of one regular file."""

    offset: int  # blob offset of the frame's first byte
    length: int  # compressed length of the frame in bytes
    uoffset: int  # offset of the slice within the file
    ulength: int  # length of the slice (the frame decompresses to exactly this many bytes)
    digest: bytes  # sha256 of the decompressed slice (32 bytes)


class Entry(msgspec.Struct, omit_defaults=True):
    """One entry, materialized from the TOC columns for convenience."""

    path: str
    type: EntryType
    mode: int
    uid: int
    gid: int
    mtime: int
    size: int = 0
    link: str = ""
    devmajor: int = 0
    devminor: int = 0
    digest: bytes = b""  # sha256 of the whole content (regular files)
    chunks: list[Chunk] = []
    xattrs: dict[str, bytes] = {}


@dataclass(frozen=True)
class Footer:
    """The fixed-size tail frame (see docs/layer-format.md)."""

    version: int
    flags: int
    toc_offset: int  # blob offset of the TOC skippable frame header
    toc_length: int  # compressed TOC bytes inside that frame
    toc_ulength: int  # decompressed TOC bytes
    toc_sha256: bytes  # sha256 of the compressed TOC bytes

    @property
    def toc_digest(self) -> str:
        return "sha256:" + self.toc_sha256.hex()

    def pack(self) -> bytes:
        payload = _FOOTER_PAYLOAD.pack(
            FOOTER_MAGIC, self.version, self.flags, 0,
            self.toc_offset, self.toc_length, self.toc_ulength, self.toc_sha256,
        )
        return SKIPPABLE_HEADER.pack(SKIPPABLE_FOOTER_MAGIC, len(payload)) + payload

    @classmethod
    def unpack(cls, data: bytes, blob_size: int) -> "Footer":
        offset = blob_size - FOOTER_SIZE
        if len(data) != FOOTER_SIZE:
            raise TruncatedLayerError(f"blob of {blob_size} bytes is too small for a footer", offset=0)
        frame_magic, frame_size = SKIPPABLE_HEADER.unpack_from(data)
        if frame_magic != SKIPPABLE_FOOTER_MAGIC or frame_size != _FOOTER_PAYLOAD.size:
            raise LayerFormatError(
                "no weenv footer frame at the end of the blob (not a weenv layer?)", offset=offset
            )
        magic, version, flags, _reserved, toc_off, toc_len, toc_ulen, sha = _FOOTER_PAYLOAD.unpack_from(data, 8)
        if magic != FOOTER_MAGIC:
            raise LayerFormatError(f"bad footer magic {magic!r}", offset=offset + 8)
        if version != FORMAT_VERSION:
            raise LayerFormatError(
                f"unsupported layer format version {version} (this reader knows {FORMAT_VERSION})",
                offset=offset + 16,
            )
        if toc_off + 8 + toc_len != offset:
            raise LayerFormatError(
                f"TOC frame [{toc_off}, +{8 + toc_len}) does not end where the footer starts ({offset})",
                offset=offset,
            )
        return cls(version, flags, toc_off, toc_len, toc_ulen, sha)


@dataclass(frozen=True)
class Limits:
    """Upper bounds a reader enforces so a hostile blob cannot make it allocate without bound."""

    max_toc_bytes: int = 128 << 20  # compressed
    max_toc_ubytes: int = 256 << 20  # decompressed (4M entries at ~64 bytes each); streamed with
    #                                  its shape checked, so junk fails after the first MiB
    max_entries: int = 4_000_000
    max_path_bytes: int = 4096
    max_name_bytes: int = 255
    max_link_bytes: int = 4096
    max_chunk_bytes: int = 64 << 20  # decompressed length of one chunk
    max_xattrs: int = 128
    max_xattr_name_bytes: int = 255
    max_xattr_value_bytes: int = 64 << 10


DEFAULT_LIMITS = Limits()

_toc_encoder = msgspec.msgpack.Encoder()
_toc_decoder = msgspec.msgpack.Decoder(TOC)


def encode_toc(toc: TOC) -> bytes:
    return _toc_encoder.encode(toc)


def decode_toc(data: bytes, offset: int) -> TOC:
    try:
        return _toc_decoder.decode(data)
    except msgspec.ValidationError as e:
        raise LayerFormatError(f"invalid TOC: {e}", offset=offset) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec lets invalid UTF-8 escape as UnicodeDecodeError
        raise LayerFormatError(f"undecodable TOC: {e}", offset=offset) from None


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def check_toc_digest(compressed: bytes, footer: Footer, expected: str | None) -> None:
    actual = sha256(compressed)
    if actual != footer.toc_sha256:
        raise IntegrityError("TOC sha256 does not match the footer", offset=footer.toc_offset)
    if expected is not None and footer.toc_digest != expected:
        raise IntegrityError(
            f"TOC digest {footer.toc_digest} is not the pinned {expected}", offset=footer.toc_offset
        )


def _u(code: str, data: bytes, what: str, count: int) -> array.array:
    a = array.array(code)
    if len(data) != a.itemsize * count:
        raise LayerFormatError(f"TOC column {what} has {len(data)} bytes, expected {a.itemsize * count}")
    a.frombytes(data)
    return a


def toc_from_entries(entries: list[Entry], chunk_size: int, prefetch_end: int) -> TOC:
    """Encode materialized entries as columns (the builder's last step)."""
    modes = array.array("H", (e.mode for e in entries))
    uids = array.array("I", (e.uid for e in entries))
    gids = array.array("I", (e.gid for e in entries))
    mtimes = array.array("q", (e.mtime for e in entries))
    chunks = [c for e in entries for c in e.chunks]
    return TOC(
        version=FORMAT_VERSION,
        chunk_size=chunk_size,
        count=len(entries),
        paths="\x00".join(e.path for e in entries),
        types=bytes(TYPE_CODES[e.type] for e in entries),
        modes=modes.tobytes(), uids=uids.tobytes(), gids=gids.tobytes(), mtimes=mtimes.tobytes(),
        chunk_counts=array.array("I", (len(e.chunks) for e in entries)).tobytes(),
        chunk_offsets=array.array("Q", (c.offset for c in chunks)).tobytes(),
        chunk_lengths=array.array("I", (c.length for c in chunks)).tobytes(),
        chunk_ulengths=array.array("I", (c.ulength for c in chunks)).tobytes(),
        chunk_digests=b"".join(c.digest for c in chunks),
        file_digests={i: e.digest for i, e in enumerate(entries) if e.type == "file" and len(e.chunks) > 1},
        links={i: e.link for i, e in enumerate(entries) if e.type in ("symlink", "hardlink")},
        devices={i: (e.devmajor, e.devminor) for i, e in enumerate(entries) if e.type in ("char", "block")},
        xattrs={i: e.xattrs for i, e in enumerate(entries) if e.xattrs},
        prefetch_end=prefetch_end,
    )


_FILE_MASK = bytes(1 if code == FILE else 0 for code in range(256))


class Columns:
    """The decoded columns of a validated TOC, as arrays for O(1) access by entry index.

    Construction validates everything a reader relies on, over whole columns (no per-entry
    Python work beyond splitting the paths), so a 100k-entry TOC opens in tens of milliseconds.
    The parent-is-a-directory rule needs a pass over every path and is checked by
    :meth:`parents`, which tree builders (the envlet) call anyway.
    """

    __slots__ = ("toc", "paths", "types", "modes", "uids", "gids", "mtimes", "index", "chunk_start",
                 "chunk_offsets", "chunk_lengths", "chunk_ulengths", "chunk_digests", "nlinks", "_prefix")

    def __init__(self, toc: TOC, data_end: int, limits: Limits = DEFAULT_LIMITS):
        self.toc = toc
        self._prefix: list[int] | None = None
        _validate(self, toc, data_end, limits)

    def __len__(self) -> int:
        return self.toc.count

    def entry_type(self, i: int) -> EntryType:
        return TYPE_NAMES[self.types[i]]

    def chunk_range(self, i: int) -> range:
        """Indices (into the chunk columns) of entry ``i``'s chunks."""
        return range(self.chunk_start[i], self.chunk_start[i + 1])

    def chunk(self, k: int, uoffset: int) -> Chunk:
        return Chunk(self.chunk_offsets[k], self.chunk_lengths[k], uoffset, self.chunk_ulengths[k],
                     self.chunk_digests[32 * k : 32 * k + 32])

    def chunks(self, i: int) -> list[Chunk]:
        """The chunks of regular-file entry ``i`` (empty for other types)."""
        out = []
        uoff = 0
        for k in self.chunk_range(i):
            c = self.chunk(k, uoff)
            out.append(c)
            uoff += c.ulength
        return out

    def size(self, i: int) -> int:
        if self._prefix is None:
            self._prefix = list(accumulate(self.chunk_ulengths, initial=0))
        return self._prefix[self.chunk_start[i + 1]] - self._prefix[self.chunk_start[i]]

    def file_digest(self, i: int) -> bytes:
        if self.types[i] != FILE:
            return b""
        d = self.toc.file_digests.get(i)
        if d is not None:
            return d
        r = self.chunk_range(i)
        if len(r) == 1:
            k = r.start
            return self.chunk_digests[32 * k : 32 * k + 32]
        return EMPTY_SHA256 if not r else b""

    def entry(self, i: int) -> Entry:
        t = TYPE_NAMES[self.types[i]]
        major, minor = self.toc.devices.get(i, (0, 0))
        return Entry(
            self.paths[i], t, self.modes[i], self.uids[i], self.gids[i], self.mtimes[i],
            size=self.size(i), link=self.toc.links.get(i, ""), devmajor=major, devminor=minor,
            digest=self.file_digest(i), chunks=self.chunks(i), xattrs=dict(self.toc.xattrs.get(i, {})),
        )

    def parents(self) -> list[int]:
        """Index of each entry's parent directory entry (-1 for the root or an implicit parent).

        Raises :class:`LayerFormatError` when an entry's parent exists but is not a directory.
        """
        index, types, paths = self.index, self.types, self.paths
        out = [-1] * len(paths)
        for i, p in enumerate(paths):
            slash = p.rfind("/")
            if slash < 0:
                out[i] = 0 if p != "." and paths and paths[0] == "." else -1
                continue
            j = index.get(p[:slash], -1)
            if j >= 0 and types[j] != DIR:
                raise LayerFormatError(f"parent {p[:slash]!r} is a {TYPE_NAMES[types[j]]}, not a directory", path=p)
            out[i] = j
        return out


def _validate(cols: Columns, toc: TOC, data_end: int, limits: Limits) -> None:  # noqa: C901 - one block per rule
    n = toc.count
    if not 0 <= n <= limits.max_entries:
        raise LimitExceededError(f"TOC has {n} entries, limit is {limits.max_entries}")
    if toc.chunk_size <= 0 or toc.chunk_size > limits.max_chunk_bytes:
        raise LimitExceededError(f"chunk size {toc.chunk_size} outside (0, {limits.max_chunk_bytes}]")
    if not 0 <= toc.prefetch_end <= data_end:
        raise LayerFormatError(f"prefetch landmark {toc.prefetch_end} lies outside the data", offset=toc.prefetch_end)
    joined = toc.paths
    paths = joined.split("\x00") if n else []
    if len(paths) != n:
        raise LayerFormatError(f"TOC lists {len(paths)} paths for {n} entries (a path with a NUL byte?)")
    types = toc.types
    if len(types) != n:
        raise LayerFormatError(f"TOC column types has {len(types)} bytes, expected {n}")
    if types.translate(None, bytes(range(len(TYPE_NAMES)))):
        i = next(i for i, t in enumerate(types) if t >= len(TYPE_NAMES))
        raise LayerFormatError(f"unknown entry type code {types[i]}", path=paths[i])
    modes = _u("H", toc.modes, "modes", n)
    uids = _u("I", toc.uids, "uids", n)
    gids = _u("I", toc.gids, "gids", n)
    mtimes = _u("q", toc.mtimes, "mtimes", n)
    if max(modes, default=0) > 0o7777:
        i = next(i for i, m in enumerate(modes) if m > 0o7777)
        raise LayerFormatError(f"mode {modes[i]:o} out of range", path=paths[i])

    # ---- paths, checked over the whole NUL-joined string with C-speed string operations
    if n and paths[0] == "." and types[0] != DIR:
        raise LayerFormatError("the root entry must be a directory", path=".")
    rest = paths[1:] if n and paths[0] == "." else paths
    framed = ("\x00" + "\x00".join(rest) + "\x00").replace("/", "\x00") if rest else ""
    if "\x00\x00" in framed or "\x00.\x00" in framed or "\x00..\x00" in framed:
        for p in rest:
            if p.startswith("/"):
                raise UnsafePathError("entry path is absolute", path=p)
            bad = next((c for c in p.split("/") if c in ("", ".", "..")), None)
            if bad is not None:
                raise UnsafePathError(f"entry path has a {bad or 'empty'!r} component", path=p)
    longest = max(map(len, paths), default=0)
    ascii_only = joined.isascii()
    if longest > limits.max_path_bytes or not ascii_only:
        for p in paths:
            if len(p.encode("utf-8", "surrogatepass")) > limits.max_path_bytes:
                raise LimitExceededError(f"entry path longer than {limits.max_path_bytes} bytes", path=p)
    if longest > limits.max_name_bytes or not ascii_only:
        for p in paths:
            if len(p) > limits.max_name_bytes or not p.isascii():
                if any(len(c.encode("utf-8", "surrogatepass")) > limits.max_name_bytes for c in p.split("/")):
                    raise LimitExceededError(f"a name in the path is longer than {limits.max_name_bytes} bytes", path=p)
    if not ascii_only:
        try:
            joined.encode("utf-8")
        except UnicodeEncodeError:
            raise UnsafePathError("entry path is not valid UTF-8",
                                  path=next(p for p in paths if not _is_utf8(p))) from None
    index = dict(zip(paths, range(n)))
    if len(index) != n:
        seen: set[str] = set()
        dup = next(p for p in paths if p in seen or seen.add(p))  # type: ignore[func-returns-value]
        raise LayerFormatError("duplicate entry path", path=dup)

    # ---- whiteouts: a .wh. name is a whiteout or opaque entry, and nothing else is
    marked: set[int] = set()
    if ".wh." in joined:
        for needle in ("\x00.wh.", "/.wh."):
            pos = joined.find(needle)
            while pos >= 0:
                marked.add(index[_path_at(joined, pos + 1)])
                pos = joined.find(needle, pos + 1)
        if joined.startswith(".wh."):
            marked.add(0)
    special = types.count(WHITEOUT) + types.count(OPAQUE)
    if special or marked:
        for i in sorted(marked):
            p = paths[i]
            name = p[p.rfind("/") + 1 :]
            t = types[i]
            in_parent = "/.wh." in "/" + p[: len(p) - len(name)]
            if t == OPAQUE:
                if name != OPAQUE_NAME or in_parent:
                    raise UnsafePathError(f"opaque entry is not named {OPAQUE_NAME}", path=p)
            elif t == WHITEOUT:
                if not name.startswith(WHITEOUT_PREFIX) or name in (OPAQUE_NAME, WHITEOUT_PREFIX) or in_parent:
                    raise UnsafePathError("whiteout entry is not named .wh.NAME", path=p)
            else:
                raise UnsafePathError("a .wh. name must be a whiteout or opaque entry", path=p)
        if special != sum(1 for i in marked if types[i] in (WHITEOUT, OPAQUE)):
            i = next(i for i, t in enumerate(types) if t in (WHITEOUT, OPAQUE) and i not in marked)
            raise UnsafePathError("whiteout entry is not named .wh.NAME", path=paths[i])

    # ---- chunks: in blob order, inside the data region, never overlapping, owned by files only
    counts = _u("I", toc.chunk_counts, "chunk_counts", n)
    nc = sum(counts)
    offsets = _u("Q", toc.chunk_offsets, "chunk_offsets", nc)
    lengths = _u("I", toc.chunk_lengths, "chunk_lengths", nc)
    ulengths = _u("I", toc.chunk_ulengths, "chunk_ulengths", nc)
    if len(toc.chunk_digests) != 32 * nc:
        raise LayerFormatError(f"TOC column chunk_digests has {len(toc.chunk_digests)} bytes, expected {32 * nc}")
    start = array.array("Q", accumulate(counts, initial=0))
    if nc:
        if sum(compress(counts, types.translate(_FILE_MASK))) != nc:
            i = next(i for i in range(n) if counts[i] and types[i] != FILE)
            raise LayerFormatError(f"a {TYPE_NAMES[types[i]]} entry cannot have content", path=paths[i])
        if min(lengths) == 0 or min(ulengths) == 0 or max(ulengths) > limits.max_chunk_bytes:
            k = next(k for k in range(nc) if not lengths[k] or not 0 < ulengths[k] <= limits.max_chunk_bytes)
            raise LayerFormatError("chunk with an empty or oversized frame", path=_chunk_path(k, start, paths),
                                   offset=offsets[k])
        ends = list(map(operator.add, offsets, lengths))
        if max(ends) > data_end:
            k = next(k for k in range(nc) if ends[k] > data_end)
            raise LayerFormatError("chunk lies outside the data region", path=_chunk_path(k, start, paths),
                                   offset=offsets[k])
        if not all(map(operator.ge, offsets[1:], ends)):
            k = next(k for k in range(1, nc) if offsets[k] < ends[k - 1])
            raise LayerFormatError(
                f"chunk overlaps (or precedes) the chunk of {_chunk_path(k - 1, start, paths)!r}",
                path=_chunk_path(k, start, paths), offset=offsets[k],
            )
    for i, d in toc.file_digests.items():
        if not (0 <= i < n and types[i] == FILE and counts[i] > 1 and len(d) == 32):
            raise LayerFormatError("file digest for an entry that is not a multi-chunk file",
                                   path=paths[i] if 0 <= i < n else None)

    # ---- links, devices, xattrs (sparse maps: loops over the map only)
    links = toc.links
    nlinks: dict[int, int] = {}
    for i, target in links.items():
        if not 0 <= i < n:
            raise LayerFormatError(f"link target for entry {i}, which does not exist")
        t = types[i]
        if t == SYMLINK:
            if not target or "\x00" in target or len(target.encode("utf-8", "surrogatepass")) > limits.max_link_bytes:
                raise LayerFormatError("bad symlink target", path=paths[i])
        elif t == HARDLINK:
            j = index.get(target)
            if j is None or j >= i:
                raise LayerFormatError(f"hardlink to {target!r}, which is not an earlier entry", path=paths[i])
            if types[j] not in (FILE, SYMLINK, CHAR, BLOCK, FIFO):
                raise LayerFormatError(f"hardlink to a {TYPE_NAMES[types[j]]} entry {target!r}", path=paths[i])
            nlinks[j] = nlinks.get(j, 1) + 1
        else:
            raise LayerFormatError(f"a {TYPE_NAMES[t]} entry cannot have a link target", path=paths[i])
    if len(links) != types.count(SYMLINK) + types.count(HARDLINK):  # every key is a link entry by now
        i = next(i for i, t in enumerate(types) if t in (SYMLINK, HARDLINK) and i not in links)
        raise LayerFormatError("symlink or hardlink without a target", path=paths[i])
    for i, (major, minor) in toc.devices.items():
        if not (0 <= i < n and types[i] in (CHAR, BLOCK)) or not (0 <= major < 1 << 32 and 0 <= minor < 1 << 32):
            raise LayerFormatError("device numbers on an entry that is not a device", path=paths[i] if 0 <= i < n else None)
    for i, xa in toc.xattrs.items():
        p = paths[i] if 0 <= i < n else None
        if p is None:
            raise LayerFormatError(f"xattrs for entry {i}, which does not exist")
        if len(xa) > limits.max_xattrs:
            raise LimitExceededError(f"more than {limits.max_xattrs} xattrs", path=p)
        for k, v in xa.items():
            if not k or "\x00" in k or len(k.encode("utf-8", "surrogatepass")) > limits.max_xattr_name_bytes:
                raise LayerFormatError(f"bad xattr name {k!r}", path=p)
            if len(v) > limits.max_xattr_value_bytes:
                raise LimitExceededError(f"xattr {k!r} value above {limits.max_xattr_value_bytes} bytes", path=p)

    cols.paths, cols.types, cols.modes, cols.uids, cols.gids, cols.mtimes = paths, types, modes, uids, gids, mtimes
    cols.index = index
    cols.chunk_start = start
    cols.chunk_offsets, cols.chunk_lengths, cols.chunk_ulengths = offsets, lengths, ulengths
    cols.chunk_digests = toc.chunk_digests
    cols.nlinks = nlinks


def _is_utf8(p: str) -> bool:
    try:
        p.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _path_at(joined: str, pos: int) -> str:
    """The NUL-separated path that contains position ``pos``."""
    start = joined.rfind("\x00", 0, pos) + 1
    end = joined.find("\x00", pos)
    return joined[start : end if end >= 0 else len(joined)]


def _chunk_path(k: int, start: array.array, paths: list[str]) -> str:
    import bisect

    return paths[bisect.bisect_right(start, k) - 1]
