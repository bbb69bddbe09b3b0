"""A checkpoint image as content-defined chunks: the cutting, the recipe, and writing it back.

No store or runtime here: bytes in, chunks out (:func:`chunk_image_file`), and a recipe plus
the chunks' bytes back to the file (:func:`write_image_file`). :mod:`._memory` keeps the
chunks in the embedded store, one pack per image holding only the chunks no earlier pack has.

Why cut the *decompressed* stream: runsc (20221219) writes ``checkpoint.img`` as a gVisor
statefile, ``gVisorSF``, an 8-byte big-endian metadata length, the metadata (JSON), 32 bytes of
its HMAC, then a compressio stream: a 4-byte big-endian block size (1 MiB) and, per block, a
4-byte big-endian length and a raw-deflate frame of one block of the state (the last shorter).
Each block is compressed on its own, but a few more bytes of kernel state shift every page
after them: two checkpoints of one env a second apart shared 2 of 14,600 4-KiB pages at the
same offsets, while nearly all their pages were the same bytes at other offsets. So the
stream is decompressed and cut where its content says: after an occurrence of :data:`MARKER`
at least :data:`MIN_CHUNK` bytes after the last cut, or at :data:`MAX_CHUNK` (one layerfmt
chunk); the same pages give the same chunks wherever they are. A file that is not such a
stream (another runsc, or another file of the image) is cut the same way as it is.

Writing back: the blocks are deflated at level 0 (stored frames: no compression work, and
runsc inflates them at memory speed), so the file is not byte for byte the one runsc wrote,
but it holds the same state: every chunk's sha256 is checked as it is read.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO, Literal

import msgspec

#: A cut comes right after these two bytes (random bytes hold them every 64 KiB on average).
MARKER = b"\x8f\x3d"
MIN_CHUNK = 16 << 10
MAX_CHUNK = 1 << 20  # layerfmt's DEFAULT_CHUNK_SIZE: a chunk is one zstd frame of its pack
STATEFILE_MAGIC = b"gVisorSF"
RECIPE_VERSION = 1


class ImageFormatError(ValueError):
    """The file is not a compressio statefile as this module reads it (it is then cut as it is)."""


class ImageFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file of the image directory, as chunks of its logical bytes."""

    name: str
    encoding: Literal["compressio", "raw"]  # compressio: the chunks are the decompressed stream
    size: int  # logical bytes (the sum of the chunks' lengths)
    chunks: list[tuple[str, int]]  # (sha256 hex, length) in order; a digest may repeat
    header: bytes = b""  # compressio: the statefile's bytes up to and including the block size
    block_bytes: int = 0  # compressio: the uncompressed size of every block but the last


class Recipe(msgspec.Struct, frozen=True, kw_only=True):
    """How the image's files are made of chunks (``recipe.json`` in its pack)."""

    version: int = RECIPE_VERSION
    files: list[ImageFile]


def encode_recipe(recipe: Recipe) -> bytes:
    return msgspec.json.encode(recipe)


def decode_recipe(data: bytes) -> Recipe:
    try:
        recipe = msgspec.json.decode(data, type=Recipe)
    except msgspec.ValidationError as e:
        raise ImageFormatError(f"memory image recipe: {e}") from None
    if recipe.version != RECIPE_VERSION:
        raise ImageFormatError(f"memory image recipe version {recipe.version}: this weenv reads {RECIPE_VERSION}")
    return recipe


class Chunker:
    """Cuts a stream fed in pieces into content-defined chunks (see the module's docstring)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._start = 0

    def feed(self, data: bytes | memoryview) -> Iterator[bytes]:
        """The chunks that ``data`` completes."""
        if self._start > (8 << 20):  # drop what was handed out, now and then rather than per chunk
            del self._buf[:self._start]
            self._start = 0
        self._buf += data
        yield from self._cuts(final=False)

    def finish(self) -> Iterator[bytes]:
        yield from self._cuts(final=True)
        self._buf, self._start = bytearray(), 0

    def _cuts(self, *, final: bool) -> Iterator[bytes]:
        buf, end = self._buf, len(self._buf)
        while self._start < end:
            start = self._start
            i = buf.find(MARKER, start + MIN_CHUNK - len(MARKER), min(end, start + MAX_CHUNK))
            if i >= 0:
                cut = i + len(MARKER)
            elif end - start >= MAX_CHUNK:
                cut = start + MAX_CHUNK
            elif final:
                cut = end
            else:
                return
            self._start = cut
            yield bytes(buf[start:cut])


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ImageFormatError(f"truncated statefile: {what}")
    return data


def compressio_header(f: BinaryIO) -> tuple[bytes, int]:
    """The statefile header (up to and including the block size) and the block size."""
    head = f.read(16)
    if len(head) < 16 or head[:8] != STATEFILE_MAGIC:
        raise ImageFormatError("not a gVisor statefile (no gVisorSF magic)")
    (meta_len,) = struct.unpack(">Q", head[8:16])
    if meta_len > (1 << 20):
        raise ImageFormatError(f"statefile metadata of {meta_len} bytes (more than 1 MiB)")
    rest = _read_exact(f, meta_len + 32 + 4, "metadata")
    (block,) = struct.unpack(">I", rest[-4:])
    if not 0 < block <= (64 << 20):
        raise ImageFormatError(f"compressio block size {block}")
    return head + rest, block


def compressio_blocks(f: BinaryIO, block: int) -> Iterator[bytes]:
    """The decompressed blocks after :func:`compressio_header`; every one but the last holds
    exactly ``block`` bytes (else :class:`ImageFormatError`: the stream is not as read here)."""
    short = False
    while True:
        head = f.read(4)
        if not head:
            return
        if len(head) != 4:
            raise ImageFormatError("truncated compressio block length")
        (n,) = struct.unpack(">I", head)
        frame = _read_exact(f, n, "compressio block")
        d = zlib.decompressobj(-15)
        try:
            data = d.decompress(frame, block + 1)
        except zlib.error as e:
            raise ImageFormatError(f"compressio block: {e}") from None
        if short or not d.eof or d.unconsumed_tail or d.unused_data or not 0 < len(data) <= block:
            raise ImageFormatError("compressio blocks not as expected (a keyed stream, or another format)")
        short = len(data) < block
        yield data


def iter_chunks(f: BinaryIO, *, raw: bool = False) -> tuple[dict, Iterator[tuple[bytes, bytes]]]:
    """Cut one file of the image. Returns a dict that holds ``encoding``, ``header``,
    ``block_bytes`` at once and ``size`` once the iterator is spent, and the iterator of
    ``(sha256, chunk)``. ``raw``: cut the bytes as they are; otherwise the file must be a
    compressio statefile (:class:`ImageFormatError` if not, from here or from the iterator:
    then seek back and cut it ``raw``)."""
    info: dict = {"encoding": "raw", "header": b"", "block_bytes": 0, "size": 0}
    if raw:
        pieces: Iterable[bytes] = iter(lambda: f.read(4 << 20), b"")
    else:
        info["header"], info["block_bytes"] = compressio_header(f)
        info["encoding"] = "compressio"
        pieces = compressio_blocks(f, info["block_bytes"])

    def gen() -> Iterator[tuple[bytes, bytes]]:
        chunker = Chunker()
        for piece in pieces:
            for c in chunker.feed(piece):
                info["size"] += len(c)
                yield hashlib.sha256(c).digest(), c
        for c in chunker.finish():
            info["size"] += len(c)
            yield hashlib.sha256(c).digest(), c

    return info, gen()


def write_image_file(out: BinaryIO, f: ImageFile, chunks: Iterable[bytes]) -> int:
    """Write ``f`` to ``out`` from its chunks' bytes (in recipe order, already verified); the bytes written."""
    if f.encoding == "raw":
        n = 0
        for c in chunks:
            out.write(c)
            n += len(c)
        return n
    out.write(f.header)
    written = len(f.header)
    block = bytearray()

    def flush(data: bytes | bytearray | memoryview) -> int:
        comp = zlib.compressobj(0, zlib.DEFLATED, -15)
        frame = comp.compress(data) + comp.flush()
        out.write(struct.pack(">I", len(frame)))
        out.write(frame)
        return 4 + len(frame)

    for c in chunks:
        view = memoryview(c)
        while len(view):
            take = min(len(view), f.block_bytes - len(block))
            if not block and take == f.block_bytes:
                written += flush(view[:take])  # a whole block inside one chunk: no copy
            else:
                block += view[:take]
                if len(block) == f.block_bytes:
                    written += flush(block)
                    block.clear()
            view = view[take:]
    if block:
        written += flush(block)
    return written
