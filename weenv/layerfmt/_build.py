"""Writing a layer: canonical order, one zstd frame per chunk, compressed in parallel, TOC at the tail."""

from __future__ import annotations

import hashlib
import os
import tarfile
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from ._errors import LayerError, LayerInputError
from ._io import Writer
from ._source import SourceEntry, scan_directory, scan_tar
from ._tarheader import tar_header
from ._toc import (
    DEFAULT_CHUNK_SIZE,
    EMPTY_SHA256,
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


_HEADER, _CHUNK, _LANDMARK = 0, 1, 2


class _Item:
    """One unit of work: a header frame, one chunk of a file, or the prefetch landmark."""

    __slots__ = ("kind", "data", "source", "entry", "uoffset", "ulength", "last", "multi")

    def __init__(self, kind: int, data: bytes = b"", source: SourceEntry | None = None, entry: Entry | None = None,
                 uoffset: int = 0, ulength: int = 0, last: bool = False, multi: bool = False):
        self.kind, self.data, self.source, self.entry = kind, data, source, entry
        self.uoffset, self.ulength, self.last, self.multi = uoffset, ulength, last, multi


class _Pipeline:
    """Reads, hashes and compresses batches of items on worker threads; writes frames in order.

    Batching amortizes the pool round trip over many small files; the calling thread only orders
    entries, encodes tar headers and writes, so two cores keep two compressors busy.
    """

    def __init__(self, out: Writer, level: int, threads: int, max_pending_bytes: int, batch_bytes: int = 1 << 20):
        self.out = out
        self.offset = 0
        self.prefetch_end = 0
        self._hash = hashlib.sha256()
        self._level = level
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weenv-build") if threads > 1 else None
        self._pending: deque[tuple[Future | list, list[_Item], int]] = deque()
        self._pending_bytes = 0
        self._max_pending = max_pending_bytes
        self._batch: list[_Item] = []
        self._batch_cost = 0
        self._batch_limit = batch_bytes
        self._whole: hashlib._Hash | None = None

    def add(self, item: _Item) -> None:
        self._batch.append(item)
        self._batch_cost += item.ulength + len(item.data) + 4096  # small files still cost an open()
        if self._batch_cost >= self._batch_limit or len(self._batch) >= 256:
            self.submit()

    def submit(self) -> None:
        if not self._batch:
            return
        batch, cost = self._batch, self._batch_cost
        self._batch, self._batch_cost = [], 0
        fut: Future | list = self._pool.submit(self._work, batch) if self._pool is not None else self._work(batch)
        self._pending.append((fut, batch, cost))
        self._pending_bytes += cost
        while self._pending_bytes > self._max_pending or (self._pending and isinstance(self._pending[0][0], list)):
            self._drain_one()

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self._level, write_content_size=True)
        return c

    def _work(self, batch: list[_Item]) -> list[tuple[bytes, bytes, bytes | None]]:
        comp = self._compressor()
        out: list[tuple[bytes, bytes, bytes | None]] = []
        f = None
        f_source = None
        try:
            for it in batch:
                if it.kind == _HEADER:
                    out.append((comp.compress(it.data), b"", None))
                elif it.kind == _CHUNK:
                    src = it.source
                    assert src is not None and src.opener is not None
                    if f_source is not src:
                        if f is not None:
                            f.close()
                        f, f_source = _open_source(src), src
                        if it.uoffset:
                            f.seek(it.uoffset)
                    data = _read_full(f, it.ulength, src.path)
                    if len(data) != it.ulength:
                        raise LayerInputError(
                            f"file shrank while building ({it.uoffset + len(data)} of {src.size} bytes)", path=src.path
                        )
                    if it.last and f.read(1):
                        raise LayerInputError(f"file grew while building (beyond {src.size} bytes)", path=src.path)
                    out.append((comp.compress(data), hashlib.sha256(data).digest(), data if it.multi else None))
                else:
                    out.append((b"", b"", None))
        finally:
            if f is not None:
                f.close()
        return out

    def _drain_one(self) -> None:
        fut, batch, cost = self._pending.popleft()
        self._pending_bytes -= cost
        results = fut if isinstance(fut, list) else fut.result()
        for it, (frame, digest, data) in zip(batch, results):
            if it.kind == _LANDMARK:
                self.prefetch_end = self.offset
                continue
            start = self.offset
            self.raw(frame)
            if it.kind == _CHUNK:
                e = it.entry
                assert e is not None
                e.chunks.append(Chunk(start, len(frame), it.uoffset, it.ulength, digest))
                if not it.multi:
                    e.digest = digest
                    continue
                if it.uoffset == 0:
                    self._whole = hashlib.sha256()
                assert self._whole is not None and data is not None
                self._whole.update(data)
                if it.last:
                    e.digest = self._whole.digest()

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
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _open_source(src: SourceEntry) -> BinaryIO:
    assert src.opener is not None
    try:
        return src.opener()
    except OSError as err:
        raise LayerInputError(f"cannot read file: {err.strerror}", path=src.path) from None


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
    if not 0 < chunk_size <= DEFAULT_LIMITS.max_chunk_bytes:
        raise LayerInputError(f"chunk size {chunk_size} outside (0, {DEFAULT_LIMITS.max_chunk_bytes}]")
    ordered, n_prefetch, missing = _order(entries, prefetch)
    threads = threads or min(os.cpu_count() or 1, 8)
    pipe = _Pipeline(out, level, threads, max_pending_bytes)
    toc_entries: list[Entry] = []
    holders: dict[object, str] = {}
    header = bytearray()
    tar_bytes = content_bytes = files = 0
    try:
        for idx, e in enumerate(ordered):
            if idx == n_prefetch and n_prefetch:
                if header:
                    pipe.add(_Item(_HEADER, bytes(header)))
                    tar_bytes += len(header)
                    header.clear()
                pipe.add(_Item(_LANDMARK))
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
            pipe.add(_Item(_HEADER, bytes(header)))
            tar_bytes += len(header)
            header.clear()
            multi = size > chunk_size
            for uoff in range(0, size, chunk_size):
                n = min(chunk_size, size - uoff)
                pipe.add(_Item(_CHUNK, source=e, entry=entry, uoffset=uoff, ulength=n,
                               last=uoff + n == size, multi=multi))
            content_bytes += size
            tar_bytes += size
            header += b"\0" * (-size % 512)
        if n_prefetch == len(ordered) and n_prefetch:
            if header:
                pipe.add(_Item(_HEADER, bytes(header)))
                tar_bytes += len(header)
                header.clear()
            pipe.add(_Item(_LANDMARK))
        header += b"\0" * 1024  # end-of-archive marker
        pipe.add(_Item(_HEADER, bytes(header)))
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


def _read_full(f: BinaryIO, n: int, path: str) -> bytes:
    try:
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
    except OSError as err:
        raise LayerInputError(f"cannot read file: {err.strerror}", path=path) from None
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
