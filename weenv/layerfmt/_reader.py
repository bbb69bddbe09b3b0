"""Opening a layer: one speculative tail read, then random access to any file's bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import zstandard

from ._errors import (
    EntryNotFoundError,
    IntegrityError,
    LayerFormatError,
    LimitExceededError,
    TruncatedLayerError,
)
from ._io import RandomAccessReader, read_exact
from ._tocshape import TocShapeCheck
from ._toc import (
    DEFAULT_LIMITS,
    FOOTER_SIZE,
    SKIPPABLE_HEADER,
    SKIPPABLE_TOC_MAGIC,
    EMPTY_SHA256,
    FILE,
    Chunk,
    Columns,
    Entry,
    Footer,
    Limits,
    check_toc_digest,
    decode_toc,
    sha256,
)

DEFAULT_TAIL_READ = 256 << 10


def _decompress_exact(data: bytes, ulength: int, what: str, offset: int, path: str | None) -> bytes:
    try:
        # The frame header declares its content size; check it first, or a forged header would make the
        # decompressor allocate whatever it claims (max_output_size only applies when it is absent).
        declared = zstandard.frame_content_size(data)
        if declared != -1 and declared != ulength:
            raise IntegrityError(f"{what} frame declares {declared} bytes, expected {ulength}", path=path, offset=offset)
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=ulength)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"{what} is not a valid zstd frame: {e}", path=path, offset=offset) from None
    if len(out) != ulength:
        raise IntegrityError(
            f"{what} decompressed to {len(out)} bytes, expected {ulength}", path=path, offset=offset
        )
    return out


TOC_PIECE_BYTES = 1 << 20


def _decompress_toc(compressed: bytes, footer: Footer, limits: Limits) -> bytearray:
    """The decompressed TOC, streamed a piece at a time with its shape checked after each piece.

    Memory follows what has been decompressed so far, not what the footer or frame declare, and a
    hostile TOC (a zstd bomb, junk, a column far larger than its entry count allows) fails after
    the first piece that shows it (:mod:`._tocshape`).
    """
    ulength, where = footer.toc_ulength, footer.toc_offset
    try:
        declared = zstandard.frame_content_size(compressed)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"TOC is not a valid zstd frame: {e}", offset=where) from None
    if declared != -1 and declared != ulength:
        raise IntegrityError(f"TOC frame declares {declared} bytes, expected {ulength}", offset=where)
    shape = TocShapeCheck(limits, ulength, where)
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(compressed) as stream:
            while True:
                piece = stream.read(TOC_PIECE_BYTES)
                if not piece:
                    break
                if len(out) + len(piece) > ulength:
                    raise IntegrityError(f"TOC decompresses to more than the {ulength} bytes the footer declares",
                                         offset=where)
                out += piece
                shape.feed(out)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"TOC is not a valid zstd frame: {e}", offset=where) from None
    if len(out) != ulength:
        raise IntegrityError(f"TOC decompressed to {len(out)} bytes, expected {ulength}", offset=where)
    return out


def verify_chunk(data: bytes | bytearray | memoryview, expected_sha256: bytes, *, path: str | None = None,
                 offset: int | None = None) -> None:
    """Raise :class:`IntegrityError` unless ``data`` (decompressed chunk bytes) hashes to ``expected_sha256``.

    The one check every consumer runs on chunk bytes that come from outside the process (a store,
    a node disk cache, a peer) before it uses them; ``path`` and ``offset`` only name the chunk
    in the error.
    """
    if len(expected_sha256) != 32:
        raise ValueError(f"expected_sha256 must be 32 bytes (a raw sha256 digest), got {len(expected_sha256)}")
    if hashlib.sha256(data).digest() != expected_sha256:
        raise IntegrityError(f"chunk sha256 mismatch ({len(data)} bytes, expected {expected_sha256.hex()[:16]}…)",
                             path=path, offset=offset)


def decompress_chunk(chunk: Chunk, frame: bytes, *, path: str | None = None) -> bytes:
    """Decompress one chunk's frame to exactly ``chunk.ulength`` bytes, *without* verifying them."""
    if len(frame) != chunk.length:
        raise IntegrityError(
            f"chunk frame has {len(frame)} bytes, TOC says {chunk.length}", path=path, offset=chunk.offset
        )
    return _decompress_exact(frame, chunk.ulength, "chunk", chunk.offset, path)


def decode_chunk(chunk: Chunk, frame: bytes, *, path: str | None = None) -> bytes:
    """Decompress one chunk's frame and verify its sha256; corrupted bytes are never returned."""
    data = decompress_chunk(chunk, frame, path=path)
    verify_chunk(data, chunk.digest, path=path, offset=chunk.offset)
    return data


def read_tail(reader: RandomAccessReader, limits: Limits = DEFAULT_LIMITS,
              tail_read: int = DEFAULT_TAIL_READ) -> tuple[Footer, bytes]:
    """Return the footer and the compressed TOC bytes, reading the blob's tail once (twice at most)."""
    size = reader.size
    if size < FOOTER_SIZE:
        raise TruncatedLayerError(f"blob of {size} bytes is smaller than the {FOOTER_SIZE}-byte footer", offset=0)
    first = min(size, max(tail_read, FOOTER_SIZE))
    tail = read_exact(reader, size - first, first, "blob tail")
    footer = Footer.unpack(tail[-FOOTER_SIZE:], size)
    if footer.toc_length > limits.max_toc_bytes:
        raise LimitExceededError(
            f"TOC of {footer.toc_length} bytes exceeds the limit of {limits.max_toc_bytes}", offset=footer.toc_offset
        )
    if footer.toc_ulength > limits.max_toc_ubytes:
        raise LimitExceededError(
            f"decompressed TOC of {footer.toc_ulength} bytes exceeds the limit of {limits.max_toc_ubytes}",
            offset=footer.toc_offset,
        )
    frame_start = footer.toc_offset
    if frame_start >= size - first:
        rel = frame_start - (size - first)
        frame = tail[rel : len(tail) - FOOTER_SIZE]
    else:
        frame = read_exact(reader, frame_start, 8 + footer.toc_length, "TOC frame")
    magic, length = SKIPPABLE_HEADER.unpack_from(frame)
    if magic != SKIPPABLE_TOC_MAGIC or length != footer.toc_length:
        raise LayerFormatError("footer does not point at a TOC frame", offset=frame_start)
    return footer, frame[8:]


class Layer:
    """An opened layer: the validated TOC columns plus the reader it came from.

    Thread-safe for reads as long as the reader is (``FileReader`` is).
    """

    def __init__(self, reader: RandomAccessReader, footer: Footer, columns: Columns):
        self.reader = reader
        self.footer = footer
        self.columns = columns
        self.toc = columns.toc
        self._entries: list[Entry] | None = None

    @classmethod
    def open(
        cls,
        reader: RandomAccessReader,
        *,
        expected_toc_digest: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        tail_read: int = DEFAULT_TAIL_READ,
    ) -> "Layer":
        """Read and verify the tail, decode and validate the TOC.

        ``expected_toc_digest`` pins the TOC (``sha256:…``), as a plan lock or manifest annotation does.
        """
        footer, compressed = read_tail(reader, limits, tail_read)
        check_toc_digest(compressed, footer, expected_toc_digest)
        raw = _decompress_toc(compressed, footer, limits)
        toc = decode_toc(raw, footer.toc_offset)
        return cls(reader, footer, Columns(toc, footer.toc_offset, limits))

    @property
    def size(self) -> int:
        return self.reader.size

    @property
    def toc_digest(self) -> str:
        return self.footer.toc_digest

    @property
    def prefetch_end(self) -> int:
        return self.toc.prefetch_end

    def __len__(self) -> int:
        return self.toc.count

    @property
    def entries(self) -> list[Entry]:
        """Every entry, materialized (costly for huge layers: prefer :attr:`columns`)."""
        if self._entries is None:
            self._entries = [self.columns.entry(i) for i in range(self.toc.count)]
        return self._entries

    def __contains__(self, path: str) -> bool:
        return normalize_lookup(path) in self.columns.index

    def index_of(self, path: str) -> int:
        i = self.columns.index.get(normalize_lookup(path))
        if i is None:
            raise EntryNotFoundError("no such entry in the layer", path=path)
        return i

    def entry(self, path: str) -> Entry:
        """The entry at ``path`` (``a/b``, ``/a/b`` or ``./a/b``)."""
        return self.columns.entry(self.index_of(path))

    def content_entry(self, path: str) -> Entry:
        """Like :meth:`entry`, but a hardlink resolves to the entry that holds the content."""
        e = self.entry(path)
        if e.type == "hardlink":
            e = self.columns.entry(self.columns.index[e.link])
        return e

    def chunks_for(self, entry: Entry, offset: int = 0, n: int | None = None) -> list[Chunk]:
        """The chunks of ``entry`` that cover ``[offset, offset + n)``."""
        end = entry.size if n is None else min(entry.size, offset + n)
        return [c for c in entry.chunks if c.uoffset < end and c.uoffset + c.ulength > offset]

    def iter_read(self, path: str, offset: int = 0, n: int | None = None) -> Iterator[bytes]:
        """Yield the bytes of a file range, reading each run of adjacent chunks with one read_at."""
        e = self.content_entry(path)
        if e.type != "file":
            raise LayerFormatError(f"{e.type} entry has no content to read", path=path)
        end = e.size if n is None else min(e.size, offset + n)
        if offset >= end:
            return
        chunks = self.chunks_for(e, offset, end - offset)
        for run in _adjacent_runs(chunks):
            start = run[0].offset
            blob = read_exact(self.reader, start, run[-1].offset + run[-1].length - start, f"chunks of {path!r}")
            for c in run:
                data = decode_chunk(c, blob[c.offset - start : c.offset - start + c.length], path=e.path)
                lo = max(offset, c.uoffset) - c.uoffset
                hi = min(end, c.uoffset + c.ulength) - c.uoffset
                yield data[lo:hi] if (lo, hi) != (0, c.ulength) else data

    def read(self, path: str, offset: int = 0, n: int | None = None) -> bytes:
        return b"".join(self.iter_read(path, offset, n))

    def verify(self) -> None:
        """Verify every chunk of every file; raise :class:`IntegrityError` naming the first bad path."""
        cols = self.columns
        for i in (i for i, t in enumerate(cols.types) if t == FILE):
            path = cols.paths[i]
            e = cols.entry(i)
            if not e.chunks:
                if e.digest != EMPTY_SHA256:
                    raise IntegrityError("empty file with a non-empty digest", path=path)
                continue
            h = None if len(e.chunks) == 1 else hashlib.sha256()
            for part in self.iter_read(path):
                if h is not None:
                    h.update(part)
            if h is not None and h.digest() != e.digest:
                raise IntegrityError("file sha256 does not match its chunks", path=path)


def normalize_lookup(path: str) -> str:
    p = path.strip("/")
    while p.startswith("./"):
        p = p[2:]
    return p or "."


def _adjacent_runs(chunks: list[Chunk], max_run_bytes: int = 16 << 20) -> Iterator[list[Chunk]]:
    run: list[Chunk] = []
    for c in chunks:
        if run and (run[-1].offset + run[-1].length != c.offset or c.offset + c.length - run[0].offset > max_run_bytes):
            yield run
            run = []
        run.append(c)
    if run:
        yield run
