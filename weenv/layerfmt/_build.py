"""Writing a layer: canonical order, one zstd frame per chunk, compressed in parallel, TOC at the tail."""

from __future__ import annotations

import array
import hashlib
import os
import tarfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from ._errors import LayerError, LayerInputError
from ._ids import CAPABILITY_XATTR, cap_to_layer, to_layer_id
from ._io import Writer
from ._source import PathOpener, SourceEntry, SpoolOpener, iter_directory, iter_tar_stream, scan_tar
from ._tarheader import tar_header
from ._toc import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_LIMITS,
    EMPTY_SHA256,
    FORMAT_VERSION,
    SKIPPABLE_HEADER,
    SKIPPABLE_TOC_MAGIC,
    Chunk,
    Columns,
    Entry,
    Footer,
    encode_toc,
    toc_from_entries,
)

DEFAULT_LEVEL = 3
_BATCH_BYTES = 4 << 20  # per worker task: big enough to amortize the hand-off, small enough to balance two cores


@dataclass
class BuildResult:
    """What a build wrote."""

    digest: str  # "sha256:…" of the whole blob: its OCI digest
    size: int  # blob bytes
    toc_digest: str  # "sha256:…" of the compressed TOC, pinned in manifests and locks
    entries: int
    files: int
    content_bytes: int  # uncompressed bytes of regular-file content
    tar_bytes: int  # size of the tar stream the blob decompresses to
    prefetch_end: int
    prefetch_missing: list[str] = field(default_factory=list)


class _Batch:
    """Frames to be: their uncompressed bytes back to back in one buffer, and what each frame is.

    One batch is one task for a worker: ``multi_compress_to_buffer`` compresses every segment as
    its own frame (byte-identical to ``ZstdCompressor.compress``) and releases the GIL once for
    the whole batch, so small files cost no per-file thread hand-offs.
    """

    __slots__ = ("buf", "view", "pos", "segments", "metas", "landmark", "whole")

    def __init__(self, buf: bytearray):
        self.buf = buf
        self.view = memoryview(buf)
        self.pos = 0
        self.segments = array.array("Q")  # (offset, length) pairs in buf
        self.metas: list[_Meta | None] = []  # per frame: a chunk, or None for a header frame
        self.landmark = -1  # index of the frame the prefetch region ends before (-1: not in this batch)
        self.whole: list[_WholeUpdate] = []  # slices of multi-chunk files, for their whole-file digests


_Meta = tuple[Entry, int, int, bool]  # entry, uoffset, ulength, is it the file's only chunk
_WholeUpdate = tuple["hashlib._Hash", memoryview, "Entry | None"]  # hash, slice, entry when it is the last slice
_Compressed = tuple[bytes, list[int], list]  # frames back to back, their lengths, chunk sha256s (None: header)


class _Pipeline:
    """Compresses batches on worker threads and writes their frames in order.

    The calling thread walks the entries, encodes tar headers, reads file contents straight into
    batch buffers and writes finished frames. Workers hash each chunk and run zstd; a single
    extra thread feeds multi-chunk files to their whole-file hashes, in order. Buffers are
    recycled, so reading does not fault in fresh pages for every batch.
    """

    def __init__(self, out: Writer, level: int, threads: int, max_pending_bytes: int, batch_bytes: int):
        self.out = out
        self.offset = 0
        self.prefetch_end = 0
        self._hash = hashlib.sha256()
        self._level = level
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weenv-build") if threads > 1 else None
        self._hasher: ThreadPoolExecutor | None = None  # one thread: whole-file updates must stay in order
        self._pending: deque[tuple[Future | _Compressed, Future | None, _Batch]] = deque()
        self._pending_bytes = 0
        self._max_pending = max_pending_bytes
        self._batch_bytes = batch_bytes
        self._free: list[bytearray] = []
        self.batch: _Batch | None = None

    def room(self, n: int) -> _Batch:
        """The current batch, with at least ``n`` free bytes (submitting the full one first)."""
        b = self.batch
        if b is not None:
            if len(b.buf) - b.pos >= n:
                return b
            self.submit()
        if n <= self._batch_bytes:
            buf = self._free.pop() if self._free else bytearray(self._batch_bytes)
        else:
            buf = bytearray(n)
        b = self.batch = _Batch(buf)
        return b

    def add_frame(self, data: bytes | bytearray) -> None:
        """A frame whose bytes are at hand (tar headers)."""
        n = len(data)
        b = self.room(n)
        pos = b.pos
        b.view[pos : pos + n] = data
        b.segments.append(pos)
        b.segments.append(n)
        b.metas.append(None)
        b.pos = pos + n

    def mark_landmark(self) -> None:
        b = self.room(0)
        b.landmark = len(b.metas)

    def submit(self) -> None:
        b = self.batch
        if b is None:
            return
        self.batch = None
        if self._pool is None:
            _update_whole(b.whole)
            self._pending.append((self._compress(b), None, b))
        else:
            hashed = None
            if b.whole:
                if self._hasher is None:
                    self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weenv-build-hash")
                hashed = self._hasher.submit(_update_whole, b.whole)
            self._pending.append((self._pool.submit(self._compress, b), hashed, b))
        self._pending_bytes += b.pos
        while self._pending and (self._pending_bytes > self._max_pending or _ready(self._pending[0])):
            self._drain_one()

    def _compress(self, b: _Batch) -> _Compressed:
        if not b.metas:
            return b"", [], []
        comp = getattr(self._local, "c", None)
        if comp is None:
            comp = self._local.c = zstandard.ZstdCompressor(level=self._level, write_content_size=True)
        view, segs, sha256 = b.view, b.segments, hashlib.sha256
        digests = [None if m is None else sha256(view[segs[2 * i] : segs[2 * i] + segs[2 * i + 1]]).digest()
                   for i, m in enumerate(b.metas)]
        frames = comp.multi_compress_to_buffer(zstandard.BufferWithSegments(b.buf, segs.tobytes()), threads=1)
        return b"".join(frames), [len(f) for f in frames], digests

    def _drain_one(self) -> None:
        work, hashed, b = self._pending.popleft()
        self._pending_bytes -= b.pos
        frames, lengths, digests = work.result() if isinstance(work, Future) else work
        if hashed is not None:
            hashed.result()
        offset = self.offset
        landmark = b.landmark
        for i, (n, meta, digest) in enumerate(zip(lengths, b.metas, digests)):
            if i == landmark:
                self.prefetch_end = offset
            if meta is not None:
                entry, uoffset, ulength, only = meta
                entry.chunks.append(Chunk(offset, n, uoffset, ulength, digest))
                if only:
                    entry.digest = digest
            offset += n
        if landmark == len(lengths):
            self.prefetch_end = offset
        self.raw(frames)
        if len(b.buf) == self._batch_bytes:
            self._free.append(b.buf)

    def flush(self) -> None:
        self.submit()
        while self._pending:
            self._drain_one()

    def raw(self, data: bytes) -> None:
        self.out.write(data)
        self._hash.update(data)
        self.offset += len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()

    def close(self) -> None:
        for pool in (self._pool, self._hasher):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


def _ready(pending: tuple[Future | _Compressed, Future | None, _Batch]) -> bool:
    work, hashed, _ = pending
    return (not isinstance(work, Future) or work.done()) and (hashed is None or hashed.done())


def _update_whole(updates: list[_WholeUpdate]) -> None:
    for whole, data, last in updates:
        whole.update(data)
        if last is not None:
            last.digest = whole.digest()


def _add_content(pipe: _Pipeline, src: SourceEntry, entry: Entry, size: int, chunk_size: int) -> None:
    """Read every chunk of one regular file into batch buffers and queue it."""
    opener = src.opener
    fd = -1
    file: BinaryIO | None = None
    try:
        if type(opener) is PathOpener:
            # the walk saw a regular file: a symlink or fifo swapped in since must not be followed or block
            fd = os.open(opener.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        elif type(opener) is not SpoolOpener:
            if opener is None:
                raise LayerInputError("regular file without content", path=src.path)
            file = opener()
    except OSError as err:
        raise LayerInputError(f"cannot read file: {err.strerror}", path=src.path) from None
    try:
        whole = hashlib.sha256() if size > chunk_size else None
        for uoff in range(0, size, chunk_size):
            n = min(chunk_size, size - uoff)
            last = uoff + n == size
            want = n + 1 if last else n  # one byte more tells that the file grew
            b = pipe.room(want)
            pos = b.pos
            view = b.view[pos : pos + want]
            try:
                if fd >= 0:
                    got = os.readv(fd, (view,))
                    # a short read of a regular file is its end; only a shrunk file needs a second look
                    while 0 < got < n:
                        more = os.readv(fd, (view[got:],))
                        if not more:
                            break
                        got += more
                elif file is None:
                    assert type(opener) is SpoolOpener
                    got, stop = 0, min(want, opener.size - uoff)
                    while got < stop:
                        more = os.preadv(opener.fd, (view[got:stop],), opener.offset + uoff + got)
                        if not more:
                            break
                        got += more
                else:
                    got = _read_file(file, view)
            except OSError as err:
                raise LayerInputError(f"cannot read file: {err.strerror}", path=src.path) from None
            if got < n:
                raise LayerInputError(f"file shrank while building ({uoff + got} of {size} bytes)", path=src.path)
            if got > n:
                raise LayerInputError(f"file grew while building (beyond {size} bytes)", path=src.path)
            if whole is not None:  # chunk digests are computed by the workers
                b.whole.append((whole, view[:n], entry if last else None))
            b.segments.append(pos)
            b.segments.append(n)
            b.metas.append((entry, uoff, n, whole is None))
            b.pos = pos + n
    finally:
        if fd >= 0:
            os.close(fd)
        if file is not None:
            file.close()


def _read_file(f: BinaryIO, view: memoryview) -> int:
    got = 0
    while got < len(view):
        data = f.read(len(view) - got)
        if not data:
            break
        view[got : got + len(data)] = data
        got += len(data)
    return got


def _sort_key(path: str) -> tuple[str, ...]:
    return () if path == "." else tuple(path.split("/"))


def _order(entries: list[SourceEntry], prefetch: Sequence[str]) -> tuple[list[SourceEntry], int, list[str]]:
    """Canonical order: prefetch files (with their ancestors) first, then depth-first by name."""
    by_path = {e.path: e for e in entries}
    ordered: list[SourceEntry] = []
    seen: set[str] = set()
    missing: list[str] = []
    for raw in prefetch:
        p = raw.strip().strip("/")
        while p.startswith("./"):
            p = p[2:]
        if not p:
            continue
        if p not in by_path:
            missing.append(raw)
            continue
        parts = p.split("/")
        for i in range(0, len(parts)):
            anc = "/".join(parts[:i]) or "."
            if anc not in seen and anc in by_path:
                seen.add(anc)
                ordered.append(by_path[anc])
        if p not in seen:
            seen.add(p)
            ordered.append(by_path[p])
    n_prefetch = len(ordered)
    rest = sorted((e for e in entries if e.path not in seen), key=lambda e: _sort_key(e.path))
    ordered.extend(rest)
    return ordered, n_prefetch, missing


def build_entries(
    entries: list[SourceEntry],
    out: Writer,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    prefetch: Sequence[str] = (),
    level: int = DEFAULT_LEVEL,
    threads: int | None = None,
    max_pending_bytes: int = 64 << 20,
) -> BuildResult:
    """Write the layer for ``entries`` to ``out``; the core that every other build entry point uses."""
    _check_chunk_size(chunk_size)
    ordered, n_prefetch, missing = _order(entries, prefetch)
    return _build_ordered(ordered, n_prefetch, missing, out, chunk_size=chunk_size, level=level, threads=threads,
                          max_pending_bytes=max_pending_bytes)


def _check_chunk_size(chunk_size: int) -> None:
    if not 0 < chunk_size <= DEFAULT_LIMITS.max_chunk_bytes:
        raise LayerInputError(f"chunk size {chunk_size} outside (0, {DEFAULT_LIMITS.max_chunk_bytes}]")


def _build_ordered(
    ordered: Iterable[SourceEntry],
    n_prefetch: int,
    missing: list[str],
    out: Writer,
    *,
    chunk_size: int,
    level: int,
    threads: int | None,
    max_pending_bytes: int = 64 << 20,
) -> BuildResult:
    """Write entries that are already in canonical order, the first ``n_prefetch`` of them the prefetch region."""
    threads = threads or min(os.cpu_count() or 1, 8)
    pipe = _Pipeline(out, level, threads, max_pending_bytes, _BATCH_BYTES)
    toc_entries: list[Entry] = []
    holders: dict[object, str] = {}
    header = bytearray()
    tar_bytes = content_bytes = files = 0
    try:
        for idx, e in enumerate(ordered):
            if idx == n_prefetch and n_prefetch:
                if header:
                    pipe.add_frame(header)
                    tar_bytes += len(header)
                    header.clear()
                pipe.mark_landmark()
            toc_type, link, size = e.type, e.link, e.size
            if e.link_key is not None:
                holder = holders.get(e.link_key)
                if holder is None:
                    holders[e.link_key] = e.path
                else:
                    toc_type, link, size = "hardlink", holder, 0
            entry = Entry(e.path, toc_type, e.mode, e.uid, e.gid, e.mtime, size, link, e.devmajor, e.devminor,
                          xattrs=dict(e.xattrs) if e.xattrs else {})
            toc_entries.append(entry)
            try:
                header += tar_header("./" if e.path == "." else e.path, toc_type, e.mode, e.uid, e.gid, size,
                                     e.mtime, link, e.devmajor, e.devminor, e.xattrs)
            except (ValueError, tarfile.HeaderError) as err:
                raise LayerInputError(f"cannot write a tar header: {err}", path=e.path) from None
            if toc_type != "file":
                continue
            files += 1
            if size == 0:
                entry.digest = EMPTY_SHA256
                continue
            pipe.add_frame(header)
            tar_bytes += len(header)
            header.clear()
            _add_content(pipe, e, entry, size, chunk_size)
            content_bytes += size
            tar_bytes += size
            header += _ZEROS[: -size % 512]
        if n_prefetch == len(toc_entries) and n_prefetch:
            if header:
                pipe.add_frame(header)
                tar_bytes += len(header)
                header.clear()
            pipe.mark_landmark()
        header += _ZEROS[:1024]  # end-of-archive marker
        pipe.add_frame(header)
        tar_bytes += len(header)
        pipe.flush()
        toc = toc_from_entries(toc_entries, chunk_size, pipe.prefetch_end)
        data_end = pipe.offset
        try:
            Columns(toc, data_end).parents()
        except LayerError as err:
            raise LayerInputError(f"input cannot form a valid layer: {err}", path=err.path) from None
        raw = encode_toc(toc)
        compressed = zstandard.ZstdCompressor(level=max(level, 9), write_content_size=True).compress(raw)
        pipe.raw(SKIPPABLE_HEADER.pack(SKIPPABLE_TOC_MAGIC, len(compressed)) + compressed)
        footer = Footer(FORMAT_VERSION, 0, data_end, len(compressed), len(raw), hashlib.sha256(compressed).digest())
        pipe.raw(footer.pack())
    finally:
        pipe.close()
    return BuildResult(
        digest=pipe.digest, size=pipe.offset, toc_digest=footer.toc_digest, entries=len(toc_entries), files=files,
        content_bytes=content_bytes, tar_bytes=tar_bytes, prefetch_end=pipe.prefetch_end, prefetch_missing=missing,
    )


_ZEROS = bytes(1024)


def _layer_ids(entries: Iterable[SourceEntry], id_base: int) -> Iterator[SourceEntry]:
    """Owners and file capabilities of a tree written through a user namespace, as the layer's."""
    for e in entries:
        if id_base:
            e.uid, e.gid = to_layer_id(e.uid, id_base), to_layer_id(e.gid, id_base)
            cap = e.xattrs.get(CAPABILITY_XATTR) if e.xattrs else None
            if cap is not None:
                e.xattrs[CAPABILITY_XATTR] = cap_to_layer(cap, id_base)
        yield e


def build_layer(
    src: str | os.PathLike[str] | BinaryIO,
    out: Writer,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    prefetch: Iterable[str] = (),
    level: int = DEFAULT_LEVEL,
    threads: int | None = None,
    overlay_upper: bool = False,
    spool_dir: str | None = None,
    id_base: int = 0,
) -> BuildResult:
    """Build a layer from a directory, a tar file path, or a binary tar stream (tar, tar.gz, tar.zst).

    ``id_base``: the directory's owners are host ids of a user namespace whose root is host uid
    ``id_base`` (an env's upper): the layer records the env's ids (see :mod:`._ids`)."""
    prefetch = list(prefetch)
    kwargs = dict(chunk_size=chunk_size, prefetch=prefetch, level=level, threads=threads)
    if isinstance(src, (str, os.PathLike)):
        if os.path.isdir(src):
            walk = _layer_ids(iter_directory(src, overlay_upper=overlay_upper), id_base)
            if not prefetch:  # the walk already yields canonical order: compress while walking
                _check_chunk_size(chunk_size)
                return _build_ordered(walk, 0, [], out, chunk_size=chunk_size, level=level, threads=threads)
            return build_entries(list(walk), out, **kwargs)
        try:
            f = open(src, "rb")
        except OSError as err:
            raise LayerInputError(f"cannot open build source: {err.strerror}", path=os.fspath(src)) from None
        with f:
            return build_layer(f, out, spool_dir=spool_dir, **kwargs)
    entries, spool = scan_tar(src, spool_dir=spool_dir)
    with spool:
        return build_entries(entries, out, **kwargs)


def build_tar_stream(
    src: BinaryIO,
    out: Writer,
    *,
    drop_whiteouts: bool = False,
    on_entry: Callable[[SourceEntry], object] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    level: int = DEFAULT_LEVEL,
    threads: int | None = None,
) -> BuildResult:
    """Build a layer from an uncompressed tar stream read once, front to back, in the stream's order.

    Nothing is spooled: each file's content goes from the stream into its compressed frames chunk by
    chunk, so memory is the pipeline's buffers plus the entries' metadata, and the only bytes on
    disk are the layer's (a run of zeros, such as a sparse file's, compresses to a few bytes per
    chunk). The TOC lists entries in blob order, which is here the tar's: the same stream always
    gives the same blob, but a tree tarred in another order gives another one (:func:`build_layer`
    sorts). ``on_entry`` sees each entry as it is written (content already read for earlier ones);
    ``drop_whiteouts`` and :class:`StreamOrderError` are :func:`iter_tar_stream`'s.
    """
    _check_chunk_size(chunk_size)
    entries: Iterable[SourceEntry] = iter_tar_stream(src, drop_whiteouts=drop_whiteouts)
    if on_entry is not None:
        entries = _tapped(entries, on_entry)
    try:
        return _build_ordered(entries, 0, [], out, chunk_size=chunk_size, level=level, threads=threads)
    except (tarfile.TarError, EOFError) as err:  # raised inside a file's content, while the builder reads it
        raise LayerInputError(f"corrupt tar stream: {err}") from None


def _tapped(entries: Iterable[SourceEntry], on_entry: Callable[[SourceEntry], object]) -> Iterator[SourceEntry]:
    for e in entries:
        on_entry(e)
        yield e
