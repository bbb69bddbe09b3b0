"""The table of contents: plain data, one comment per field, and its validation.

The TOC mirrors the tar stream entry by entry, in blob order. OCI whiteouts keep their tar names
(``dir/.wh.NAME`` with type ``whiteout``, ``dir/.wh..wh..opq`` with type ``opaque``); consumers
translate them (the envlet shows a whiteout as a char 0:0 device named ``NAME``).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
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
WHITEOUT_PREFIX = ".wh."
OPAQUE_NAME = ".wh..wh..opq"


class Chunk(msgspec.Struct, array_like=True, frozen=True):
    """One zstd frame holding a contiguous slice of one regular file."""

    offset: int  # blob offset of the frame's first byte
    length: int  # compressed length of the frame in bytes
    uoffset: int  # offset of the slice within the file
    ulength: int  # length of the slice (the frame decompresses to exactly this many bytes)
    digest: bytes  # sha256 of the decompressed slice (32 bytes); also the L2 cache key


class Entry(msgspec.Struct, array_like=True, omit_defaults=True):
    """One tar entry."""

    path: str  # relative, '/'-separated, no trailing slash; "." is the root directory
    type: EntryType
    mode: int  # permission bits including setuid/setgid/sticky (<= 0o7777)
    uid: int
    gid: int
    mtime: int  # seconds since the epoch
    size: int = 0  # bytes of content (regular files only)
    link: str = ""  # symlink target, or the earlier path a hardlink points to
    devmajor: int = 0
    devminor: int = 0
    digest: bytes = b""  # sha256 of the whole file content (regular files only)
    chunks: list[Chunk] = []
    xattrs: dict[str, bytes] = {}


class TOC(msgspec.Struct, omit_defaults=True):
    """The decoded table of contents."""

    version: int  # FORMAT_VERSION the blob was written with
    chunk_size: int  # maximum uncompressed chunk length used by the builder
    entries: list[Entry]
    prefetch_end: int = 0  # blob offset where the prefetch region ends; [0, prefetch_end) is one read


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
    max_toc_ubytes: int = 1 << 30  # decompressed
    max_entries: int = 4_000_000
    max_path_bytes: int = 4096
    max_name_bytes: int = 255
    max_link_bytes: int = 4096
    max_chunk_bytes: int = 64 << 20  # decompressed length of one chunk
    max_file_bytes: int = 1 << 44
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
    except msgspec.DecodeError as e:
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


def _check_path(path: str, limits: Limits) -> None:
    if path == ".":
        return
    if not path:
        raise UnsafePathError("empty entry path", path=path)
    if "\x00" in path:
        raise UnsafePathError("entry path contains a NUL byte", path=path)
    if path[0] == "/":
        raise UnsafePathError("entry path is absolute", path=path)
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafePathError("entry path is not valid UTF-8", path=path) from None
    if len(raw) > limits.max_path_bytes:
        raise LimitExceededError(f"entry path longer than {limits.max_path_bytes} bytes", path=path)
    for name in path.split("/"):
        if name in ("", ".", ".."):
            raise UnsafePathError(f"entry path has a {name or 'empty'!r} component", path=path)
        if len(name.encode("utf-8")) > limits.max_name_bytes:
            raise LimitExceededError(f"a name in the path is longer than {limits.max_name_bytes} bytes", path=path)


_LINKED_TYPES = frozenset(("file", "symlink", "char", "block", "fifo"))


def validate_toc(toc: TOC, data_end: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """Check every rule of docs/layer-format.md that the TOC alone can break.

    ``data_end`` is the blob offset where the TOC frame starts: every chunk must lie before it.
    Raises a :class:`LayerFormatError` subclass naming the first offending path or offset.
    """
    entries = toc.entries
    if len(entries) > limits.max_entries:
        raise LimitExceededError(f"TOC has {len(entries)} entries, limit is {limits.max_entries}")
    if toc.chunk_size <= 0 or toc.chunk_size > limits.max_chunk_bytes:
        raise LimitExceededError(f"chunk size {toc.chunk_size} outside (0, {limits.max_chunk_bytes}]")
    if not 0 <= toc.prefetch_end <= data_end:
        raise LayerFormatError(f"prefetch landmark {toc.prefetch_end} lies outside the data", offset=toc.prefetch_end)
    kinds: dict[str, str] = {}
    spans: list[tuple[int, int, str]] = []
    max_chunk = limits.max_chunk_bytes
    for e in entries:
        path = e.path
        _check_path(path, limits)
        if path in kinds:
            raise LayerFormatError("duplicate entry path", path=path)
        t = e.type
        if not 0 <= e.mode <= 0o7777:
            raise LayerFormatError(f"mode {e.mode:o} out of range", path=path)
        if not (0 <= e.uid < 1 << 32 and 0 <= e.gid < 1 << 32):
            raise LayerFormatError("uid/gid out of range", path=path)
        if not -(1 << 62) < e.mtime < 1 << 62:
            raise LayerFormatError("mtime out of range", path=path)
        if path == "." and t != "dir":
            raise LayerFormatError("the root entry must be a directory", path=path)
        slash = path.rfind("/")
        if slash > 0:
            parent_kind = kinds.get(path[:slash])
            if parent_kind is not None and parent_kind != "dir":
                raise LayerFormatError(f"parent {path[:slash]!r} is a {parent_kind}, not a directory", path=path)
        name = path[slash + 1 :]
        if t == "whiteout":
            if not name.startswith(WHITEOUT_PREFIX) or name == OPAQUE_NAME or len(name) == len(WHITEOUT_PREFIX):
                raise UnsafePathError("whiteout entry is not named .wh.NAME", path=path)
        elif t == "opaque":
            if name != OPAQUE_NAME:
                raise UnsafePathError(f"opaque entry is not named {OPAQUE_NAME}", path=path)
        elif name.startswith(WHITEOUT_PREFIX):
            raise UnsafePathError("a .wh. name must be a whiteout or opaque entry", path=path)
        if e.xattrs:
            if len(e.xattrs) > limits.max_xattrs:
                raise LimitExceededError(f"more than {limits.max_xattrs} xattrs", path=path)
            for k, v in e.xattrs.items():
                if not k or "\x00" in k or len(k.encode("utf-8", "surrogateescape")) > limits.max_xattr_name_bytes:
                    raise LayerFormatError(f"bad xattr name {k!r}", path=path)
                if len(v) > limits.max_xattr_value_bytes:
                    raise LimitExceededError(f"xattr {k!r} value above {limits.max_xattr_value_bytes} bytes", path=path)
        if t == "file":
            size = e.size
            if not 0 <= size <= limits.max_file_bytes:
                raise LimitExceededError(f"file size {size} out of range", path=path)
            if len(e.digest) != 32:
                raise LayerFormatError("file digest is not a sha256", path=path)
            expect = 0
            for c in e.chunks:
                if c.uoffset != expect or not 0 < c.ulength <= max_chunk:
                    raise LayerFormatError(
                        f"chunk at uncompressed offset {c.uoffset} (length {c.ulength}) breaks the file's "
                        f"contiguous chunk sequence", path=path, offset=c.offset,
                    )
                if c.length <= 0 or c.offset < 0 or c.offset + c.length > data_end:
                    raise LayerFormatError("chunk lies outside the data region", path=path, offset=c.offset)
                if c.length > c.ulength + (c.ulength >> 7) + 1024:
                    raise LimitExceededError("chunk frame is larger than zstd's bound", path=path, offset=c.offset)
                if len(c.digest) != 32:
                    raise LayerFormatError("chunk digest is not a sha256", path=path, offset=c.offset)
                spans.append((c.offset, c.length, path))
                expect += c.ulength
            if expect != size:
                raise LayerFormatError(f"chunks cover {expect} bytes of a {size}-byte file", path=path)
        else:
            if e.chunks or e.size:
                raise LayerFormatError(f"a {t} entry cannot have content", path=path)
            if t == "symlink":
                if not e.link or "\x00" in e.link or len(e.link.encode("utf-8", "surrogateescape")) > limits.max_link_bytes:
                    raise LayerFormatError("bad symlink target", path=path)
            elif t == "hardlink":
                target_kind = kinds.get(e.link)
                if target_kind is None:
                    raise LayerFormatError(f"hardlink to {e.link!r}, which is not an earlier entry", path=path)
                if target_kind not in _LINKED_TYPES:
                    raise LayerFormatError(f"hardlink to a {target_kind} entry {e.link!r}", path=path)
            elif e.link:
                raise LayerFormatError(f"a {t} entry cannot have a link target", path=path)
        kinds[path] = t
    if spans:
        spans.sort()
        prev_end, prev_path = -1, ""
        for off, length, path in spans:
            if off < prev_end:
                raise LayerFormatError(f"chunk overlaps a chunk of {prev_path!r}", path=path, offset=off)
            prev_end, prev_path = off + length, path
