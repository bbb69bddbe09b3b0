"""Writing a layer: canonical order, one zstd frame per chunk, compressed in parallel, TOC at the tail."""

from __future__ import annotations

import hashlib
import os
import tarfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from ._errors import LayerError, LayerInputError
from ._io import Writer
from ._source import SourceEntry, scan_directory, scan_tar
from ._toc import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_LIMITS,
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
_INLINE_BYTES = 32 << 10  # below this, compressing on the calling thread beats a pool round trip
_EMPTY_SHA256 = hashlib.sha256(b"").digest()
_TAR_TYPES = {
    "file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE, "whiteout": tarfile.REGTYPE, "opaque": tarfile.REGTYPE,
}


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


class _Done:
    """A completed stand-in for a Future (inline compression)."""

    __slots__ = ("_value",)

    def __init__(self, value: tuple[bytes, bytes | None]):
        self._value = value

    def result(self) -> tuple[bytes, bytes | None]:
        return self._value


class _FrameWriter:
    """Compresses frames on a thread pool and writes them strictly in submission order."""

    def __init__(self, out: Writer, level: int, threads: int, max_pending_bytes: int):
        self.out = out
        self.offset = 0
        self._hash = hashlib.sha256()
        self._level = level
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weenv-zstd") if threads > 1 else None
        self._pending: deque[tuple[Future | _Done, int, Callable[[int, int, bytes | None], None] | None]] = deque()
        self._pending_bytes = 0
        self._max_pending = max_pending_bytes

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self._level, write_content_size=True)
        return c

    def _compress(self, data: bytes, want_digest: bool) -> tuple[bytes, bytes | None]:
        return self._compressor().compress(data), (hashlib.sha256(data).digest() if want_digest else None)

    def frame(self, data: bytes, on_written: Callable[[int, int, bytes | None], None] | None = None,
              want_digest: bool = False) -> None:
        if self._pool is None or len(data) < _INLINE_BYTES:
            fut: Future | _Done = _Done(self._compress(data, want_digest))
        else:
            fut = self._pool.submit(self._compress, data, want_digest)
        self._pending.append((fut, len(data), on_written))
        self._pending_bytes += len(data)
        while self._pending_bytes > self._max_pending or (self._pending and isinstance(self._pending[0][0], _Done)):
            self._drain_one()

    def _drain_one(self) -> None:
        fut, n, cb = self._pending.popleft()
        self._pending_bytes -= n
        frame, digest = fut.result()
        start = self.offset
        self.raw(frame)
        if cb is not None:
            cb(start, len(frame), digest)

    def flush(self) -> None:
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
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


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


def _tar_header(e: SourceEntry, toc_type: str, link: str, size: int) -> bytes:
    name = "./" if e.path == "." else e.path
    ti = tarfile.TarInfo(name)
    ti.type = _TAR_TYPES[toc_type]
    ti.mode = e.mode
    ti.uid, ti.gid = e.uid, e.gid
    ti.uname = ti.gname = ""  # numeric ids only: extraction must not remap through the host's passwd
    ti.mtime = e.mtime
    ti.size = size
    ti.linkname = link
    ti.devmajor, ti.devminor = e.devmajor, e.devminor
    if e.xattrs:
        ti.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape") for k, v in sorted(e.xattrs.items())}
    try:
        return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    except (ValueError, tarfile.HeaderError) as err:
        raise LayerInputError(f"cannot write a tar header: {err}", path=e.path) from None


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
    if not 0 < chunk_size <= DEFAULT_LIMITS.max_chunk_bytes:
        raise LayerInputError(f"chunk size {chunk_size} outside (0, {DEFAULT_LIMITS.max_chunk_bytes}]")
    ordered, n_prefetch, missing = _order(entries, prefetch)
    threads = threads or min(os.cpu_count() or 1, 8)
    fw = _FrameWriter(out, level, threads, max_pending_bytes)
    toc_entries: list[Entry] = []
    holders: dict[object, str] = {}
    header = bytearray()
    tar_bytes = content_bytes = files = 0
    prefetch_end = 0
    try:
        for idx, e in enumerate(ordered):
            if idx == n_prefetch and n_prefetch:
                if header:
                    fw.frame(bytes(header))
                    tar_bytes += len(header)
                    header.clear()
                fw.flush()
                prefetch_end = fw.offset
            toc_type, link, size = e.type, e.link, e.size
            if e.link_key is not None:
                holder = holders.get(e.link_key)
                if holder is None:
                    holders[e.link_key] = e.path
                else:
                    toc_type, link, size = "hardlink", holder, 0
            entry = Entry(e.path, toc_type, e.mode, e.uid, e.gid, e.mtime, size=size, link=link,
                          devmajor=e.devmajor, devminor=e.devminor, xattrs=dict(e.xattrs))
            toc_entries.append(entry)
            header += _tar_header(e, toc_type, link, size)
            if toc_type != "file":
                continue
            files += 1
            if size == 0:
                entry.digest = _EMPTY_SHA256
                continue
            fw.frame(bytes(header))
            tar_bytes += len(header)
            header.clear()
            _emit_content(fw, e, entry, chunk_size)
            content_bytes += size
            tar_bytes += size
            pad = -size % 512
            header += b"\0" * pad
        header += b"\0" * 1024  # end-of-archive marker
        if n_prefetch == len(ordered) and n_prefetch:
            fw.frame(bytes(header[:-1024]))  # keep the landmark before the end-of-archive frame
            tar_bytes += len(header) - 1024
            del header[:-1024]
            fw.flush()
            prefetch_end = fw.offset
        fw.frame(bytes(header))
        tar_bytes += len(header)
        fw.flush()
        toc = toc_from_entries(toc_entries, chunk_size, prefetch_end)
        data_end = fw.offset
        try:
            Columns(toc, data_end)
        except LayerError as err:
            raise LayerInputError(f"input cannot form a valid layer: {err}", path=err.path) from None
        raw = encode_toc(toc)
        compressed = zstandard.ZstdCompressor(level=max(level, 9), write_content_size=True).compress(raw)
        fw.raw(SKIPPABLE_HEADER.pack(SKIPPABLE_TOC_MAGIC, len(compressed)) + compressed)
        footer = Footer(FORMAT_VERSION, 0, data_end, len(compressed), len(raw), hashlib.sha256(compressed).digest())
        fw.raw(footer.pack())
    finally:
        fw.close()
    return BuildResult(
        digest=fw.digest, size=fw.offset, toc_digest=footer.toc_digest, entries=len(toc_entries), files=files,
        content_bytes=content_bytes, tar_bytes=tar_bytes, prefetch_end=prefetch_end, prefetch_missing=missing,
    )


def _emit_content(fw: _FrameWriter, e: SourceEntry, entry: Entry, chunk_size: int) -> None:
    size = e.size
    single = size <= chunk_size
    whole = None if single else hashlib.sha256()
    chunks: list[Chunk] = []

    def on_written(uoffset: int, ulength: int) -> Callable[[int, int, bytes | None], None]:
        def cb(offset: int, length: int, digest: bytes | None) -> None:
            assert digest is not None
            chunks.append(Chunk(offset, length, uoffset, ulength, digest))
            if single:
                entry.digest = digest
        return cb

    assert e.opener is not None
    try:
        f = e.opener()
    except OSError as err:
        raise LayerInputError(f"cannot read file: {err.strerror}", path=e.path) from None
    with f:
        pos = 0
        while pos < size:
            want = min(chunk_size, size - pos)
            try:
                data = _read_full(f, want)
            except OSError as err:
                raise LayerInputError(f"cannot read file: {err.strerror}", path=e.path) from None
            if len(data) != want:
                raise LayerInputError(f"file shrank while building ({pos + len(data)} of {size} bytes)", path=e.path)
            if whole is not None:
                whole.update(data)
            fw.frame(data, on_written(pos, want), want_digest=True)
            pos += want
        if f.read(1):
            raise LayerInputError(f"file grew while building (beyond {size} bytes)", path=e.path)
    entry.chunks = chunks  # filled in order as frames are written
    if whole is not None:
        entry.digest = whole.digest()


def _read_full(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = f.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


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
) -> BuildResult:
    """Build a layer from a directory, a tar file path, or a binary tar stream (tar, tar.gz, tar.zst)."""
    prefetch = list(prefetch)
    kwargs = dict(chunk_size=chunk_size, prefetch=prefetch, level=level, threads=threads)
    if isinstance(src, (str, os.PathLike)):
        if os.path.isdir(src):
            return build_entries(scan_directory(src, overlay_upper=overlay_upper), out, **kwargs)
        try:
            f = open(src, "rb")
        except OSError as err:
            raise LayerInputError(f"cannot open build source: {err.strerror}", path=os.fspath(src)) from None
        with f:
            return build_layer(f, out, spool_dir=spool_dir, **kwargs)
    entries, spool = scan_tar(src, spool_dir=spool_dir)
    with spool:
        return build_entries(entries, out, **kwargs)
