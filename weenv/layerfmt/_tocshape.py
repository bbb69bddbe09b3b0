"""Checking the shape of a TOC while it decompresses, so a hostile one fails early and small.

The TOC is decoded by msgspec from the whole decompressed buffer; a TOC that decompresses to
hundreds of MiB of junk (a zstd bomb: 8 KiB of frame, 256 MiB of zeros) would be rejected only once
all of it sits in memory. :class:`TocShapeCheck` is fed the growing buffer after every decompressed
piece and walks the msgpack item headers as far as they have arrived — without decoding or
copying payloads — checking each against what a valid TOC can hold:

- the top level is a map of known TOC fields, in the order the encoder writes them;
- every field has its type (int, str, bin, map) and, once ``count`` is known, its size: the
  per-entry columns are ``count`` times their item size, the per-chunk columns agree with
  ``chunk_offsets`` (which lists at most one chunk per byte of data), ``paths`` fits ``count``
  paths of at most ``max_path_bytes``;
- the sparse maps hold at most ``count`` items of the right kinds and sizes (xattrs within
  ``max_xattrs`` / ``max_xattr_*_bytes``, links within ``max_link_bytes``, digests of 32 bytes)
  — walked only in TOCs above :data:`MAP_WALK_BYTES`;
- nothing follows the map.

So junk fails within the first decompressed piece (1 MiB), and a well-formed TOC is never more
than its limits allow. Upper bounds are checked with some slack (:data:`SLACK_BYTES`,
:data:`SLACK_ITEMS`): this check bounds memory; the precise limits, with messages that name the
entry's path, and everything else (paths, chunk geometry, …) are validated after decoding by
:func:`._toc._validate`.
"""

from __future__ import annotations

import struct

import msgspec

from ._errors import LayerFormatError, LimitExceededError
from ._toc import TOC, Limits

SLACK_BYTES = 1 << 20  # a str/bin may exceed its bound by this much before the shape check refuses it
SLACK_ITEMS = 1024  # and a map by this many items
# Below this many decompressed bytes the check stops at the first sparse map: walking map items
# costs ~2 µs each in Python (a 100k-entry TOC would open 6x slower), and the columns before
# them already show junk; a TOC this small is a small allocation whatever it holds.
MAP_WALK_BYTES = 32 << 20
_FIELDS = tuple(f.name for f in msgspec.structs.fields(TOC))
_INT_FIELDS = {"version", "chunk_size", "count", "prefetch_end"}
_ENTRY_COLUMNS = {"types": 1, "modes": 2, "uids": 4, "gids": 4, "mtimes": 8, "chunk_counts": 4}
_CHUNK_COLUMNS = {"chunk_offsets": 8, "chunk_lengths": 4, "chunk_ulengths": 4, "chunk_digests": 32}
_MAP_FIELDS = {"file_digests", "links", "devices", "xattrs"}
assert set(_FIELDS) == _INT_FIELDS | {"paths"} | set(_ENTRY_COLUMNS) | set(_CHUNK_COLUMNS) | _MAP_FIELDS

# msgpack item headers: lead byte -> (kind, bytes of length/value after the lead byte)
_U = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I"), 8: struct.Struct(">Q")}
_S = {1: struct.Struct(">b"), 2: struct.Struct(">h"), 4: struct.Struct(">i"), 8: struct.Struct(">q")}
_SIZED = {0xC4: ("bin", 1), 0xC5: ("bin", 2), 0xC6: ("bin", 4), 0xD9: ("str", 1), 0xDA: ("str", 2),
          0xDB: ("str", 4), 0xDC: ("array", 2), 0xDD: ("array", 4), 0xDE: ("map", 2), 0xDF: ("map", 4)}
_INTS = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
         0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _header(buf: bytearray, pos: int) -> tuple[str, int, int] | None:
    """(kind, length or value, header bytes) of the item at ``pos``; None if it has not fully arrived."""
    if pos >= len(buf):
        return None
    b = buf[pos]
    if b <= 0x7F:
        return "int", b, 1
    if b >= 0xE0:
        return "int", b - 0x100, 1
    if 0x80 <= b <= 0x8F:
        return "map", b & 0x0F, 1
    if 0x90 <= b <= 0x9F:
        return "array", b & 0x0F, 1
    if 0xA0 <= b <= 0xBF:
        return "str", b & 0x1F, 1
    if b in _SIZED:
        kind, w = _SIZED[b]
        if pos + 1 + w > len(buf):
            return None
        return kind, _U[w].unpack_from(buf, pos + 1)[0], 1 + w
    if b in _INTS:
        w, signed = _INTS[b]
        if pos + 1 + w > len(buf):
            return None
        return "int", (_S if signed else _U)[w].unpack_from(buf, pos + 1)[0], 1 + w
    names = {0xC0: "nil", 0xC2: "false", 0xC3: "true", 0xCA: "float", 0xCB: "float"}
    return names.get(b, f"byte 0x{b:02x}"), 0, 1


class _Frame:
    __slots__ = ("field", "kind", "left", "total", "depth")

    def __init__(self, field: str, kind: str, items: int, depth: int):
        self.field, self.kind, self.depth = field, kind, depth
        self.total = self.left = 2 * items if kind == "map" else items


class TocShapeCheck:
    """Feed it the decompressed TOC as it grows; it raises :class:`LayerFormatError` (or
    :class:`LimitExceededError`) at the first item header a valid TOC cannot have."""

    def __init__(self, limits: Limits, ulength: int, blob_offset: int):
        self.limits = limits
        self.ulength = ulength  # decompressed bytes the footer declares
        self.blob_offset = blob_offset  # where the TOC frame sits in the blob, for errors
        self.pos = 0  # next item header (may lie beyond the buffer while a payload is skipped)
        self.done = False
        self.walk_maps = ulength > MAP_WALK_BYTES
        self._stopped = False  # at the first sparse map of a small TOC
        self._stack: list[_Frame] = []
        self._started = False
        self._field_index = -1
        self._count: int | None = None
        self._chunks: int | None = None

    def _fail(self, message: str, limit: bool = False) -> None:
        cls = LimitExceededError if limit else LayerFormatError
        raise cls(f"{message} (TOC byte {self.pos})", offset=self.blob_offset)

    def feed(self, buf: bytearray) -> None:
        while not self.done:
            if self._stopped:
                return
            h = _header(buf, self.pos)
            if h is None:
                return
            kind, n, hlen = h
            if not self._started:
                if kind != "map":
                    self._fail(f"the TOC is not a msgpack map but starts with {_a(kind)}")
                if n > len(_FIELDS):
                    self._fail(f"the TOC map has {n} fields, a TOC has at most {len(_FIELDS)}")
                self._started = True
                self.pos += hlen
                self._push(_Frame("", "map", n, 0))
                continue
            top = self._stack[-1]
            is_key = top.kind == "map" and (top.total - top.left) % 2 == 0
            if top.depth == 0 and is_key:
                if kind != "str" or n > 32:
                    self._fail(f"a TOC field name is {_a(kind)} of {n}")
                if self.pos + hlen + n > len(buf):
                    return  # wait for the name itself
                name = bytes(buf[self.pos + hlen : self.pos + hlen + n]).decode("utf-8", "replace")
                if name not in _FIELDS:
                    self._fail(f"unknown TOC field {name!r}")
                i = _FIELDS.index(name)
                if i <= self._field_index:
                    self._fail(f"TOC field {name!r} out of order or repeated")
                self._field_index = i
                top.field = name
                self.pos += hlen + n
                self._complete()
                continue
            self._check(top, is_key, kind, n)
            self.pos += hlen
            if kind in ("str", "bin"):
                self.pos += n
                if self.pos > self.ulength:
                    self._fail(f"{_a(kind)} of {n} bytes runs past the {self.ulength} bytes the footer declares")
            if kind == "map" and top.depth == 0 and not self.walk_maps:
                self._stopped = True
            elif kind in ("map", "array") and n:
                self._push(_Frame(top.field, kind, n, top.depth + 1))
            else:
                if kind == "int" and top.depth == 0:
                    self._int_field(top.field, n)
                self._complete()
        if self.pos < len(buf):
            self._fail(f"{len(buf) - self.pos} bytes follow the end of the TOC map")

    # ---------------------------------------------------------------- rules

    def _check(self, top: _Frame, is_key: bool, kind: str, n: int) -> None:
        """Is an item of ``kind`` (length/value ``n``) allowed here?"""
        L = self.limits
        field, depth = top.field, top.depth
        entries = L.max_entries if self._count is None else self._count
        where = f"TOC field {field}" if depth == 0 else f"an item of TOC field {field}"

        def want(expected: str) -> None:
            if kind != expected:
                self._fail(f"{where} is {_a(kind)}, expected {_a(expected)}")

        if depth == 0:  # the value of a top-level field
            if field in _INT_FIELDS:
                want("int")
            elif field == "paths":
                want("str")
                most = entries * (L.max_path_bytes + 1)
                if n > most + SLACK_BYTES:
                    self._fail(f"TOC field paths has {n} bytes, at most {most} for {entries} entries", limit=True)
            elif field in _ENTRY_COLUMNS:
                want("bin")
                expected = _ENTRY_COLUMNS[field] * entries
                if n > expected + SLACK_BYTES:
                    self._fail(f"TOC column {field} has {n} bytes, expected {expected}")
            elif field in _CHUNK_COLUMNS:
                want("bin")
                size = _CHUNK_COLUMNS[field]
                if self._chunks is None:
                    # chunks are disjoint, non-empty frames before the TOC: at most one per data byte
                    if n // size > self.blob_offset + SLACK_ITEMS:
                        self._fail(f"TOC column {field} lists {n // size} chunks in {self.blob_offset} bytes of data")
                    self._chunks = n // size
                elif n > size * self._chunks + SLACK_BYTES:
                    self._fail(f"TOC column {field} has {n} bytes, expected {size * self._chunks}")
            else:  # the sparse maps: at most one item per entry
                want("map")
                if n > entries + SLACK_ITEMS:
                    self._fail(f"TOC field {field} has {n} items for {entries} entries")
            return
        if depth == 1 and is_key:  # the entry index of a sparse map's item
            want("int")
            return
        if field == "file_digests":
            want("bin")
            if n != 32:
                self._fail(f"{where} is a digest of {n} bytes, expected 32")
        elif field == "links":
            want("str")
            if n > L.max_link_bytes + SLACK_BYTES:
                self._fail(f"{where} is a link target of {n} bytes, limit is {L.max_link_bytes}", limit=True)
        elif field == "devices":
            if depth == 1:
                want("array")
                if n != 2:
                    self._fail(f"{where} has {n} device numbers, expected 2")
            else:
                want("int")
        elif field == "xattrs":
            if depth == 1:
                want("map")
                if n > L.max_xattrs + SLACK_ITEMS:
                    self._fail(f"{where} has {n} xattrs, limit is {L.max_xattrs}", limit=True)
            elif is_key:
                want("str")
                if n > L.max_xattr_name_bytes + SLACK_BYTES:
                    self._fail(f"{where} is an xattr name of {n} bytes, limit is {L.max_xattr_name_bytes}", limit=True)
            else:
                want("bin")
                if n > L.max_xattr_value_bytes + SLACK_BYTES:
                    self._fail(f"{where} is an xattr value of {n} bytes, limit is {L.max_xattr_value_bytes}",
                               limit=True)
        else:
            self._fail(f"{where} is {_a(kind)} at depth {depth}")

    def _int_field(self, field: str, value: int) -> None:
        if field == "count":
            if not 0 <= value <= self.limits.max_entries:
                self._fail(f"TOC has {value} entries, limit is {self.limits.max_entries}", limit=True)
            self._count = value

    # ---------------------------------------------------------------- the container stack

    def _push(self, frame: _Frame) -> None:
        if frame.total == 0:
            self._complete()
            return
        self._stack.append(frame)

    def _complete(self) -> None:
        """One item of the innermost open container is done (which may close it, and so on up)."""
        while self._stack:
            top = self._stack[-1]
            top.left -= 1
            if top.left:
                return
            self._stack.pop()
        self.done = True
