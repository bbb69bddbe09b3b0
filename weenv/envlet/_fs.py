"""The FUSE filesystem: one read-only mount, one directory per registered layer.

Inode numbers are ``slot << 32 | local id``: a layer's slot is never reused while the envlet runs,
so inode numbers are stable for the mount's life. All errors become an errno in ``_errno`` only.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate
from typing import TYPE_CHECKING

import pyfuse3

from ..layerfmt import Chunk
from ..layerfmt._ids import to_host_id
from ._errors import ChunkIntegrityError, FetchError

if TYPE_CHECKING:
    from ._server import Envlet, MountedLayer

log = logging.getLogger("weenv.envlet")

LAYER_TIMEOUT_S = 24 * 3600.0  # layer content is immutable
ROOT_TIMEOUT_S = 1.0  # the list of layers changes
SLOT_SHIFT = 32
LOCAL_MASK = (1 << SLOT_SHIFT) - 1


@contextmanager
def _errno(what: str) -> Iterator[None]:
    """The one place where exceptions become errno values for the kernel."""
    try:
        yield
    except pyfuse3.FUSEError:
        raise
    except (FetchError, ChunkIntegrityError) as e:
        log.error("%s: %s", what, e)
        raise pyfuse3.FUSEError(errno.EIO) from None
    except FileNotFoundError:
        raise pyfuse3.FUSEError(errno.ENOENT) from None
    except OSError as e:
        log.error("%s: %s", what, e)
        raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
    except Exception:
        log.exception("%s: unexpected error", what)
        raise pyfuse3.FUSEError(errno.EIO) from None


def _fill(attr: pyfuse3.EntryAttributes, inode: int, mode: int, nlink: int, uid: int, gid: int, size: int,
          mtime: int, rdev: int, timeout_s: float) -> pyfuse3.EntryAttributes:
    attr.st_ino = inode
    attr.generation = 0
    attr.entry_timeout = timeout_s
    attr.attr_timeout = timeout_s
    attr.st_mode = mode
    attr.st_nlink = nlink
    attr.st_uid = uid
    attr.st_gid = gid
    attr.st_rdev = rdev
    attr.st_size = size
    attr.st_blksize = 4096
    attr.st_blocks = (size + 511) // 512
    ns = mtime * 1_000_000_000
    attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = ns
    return attr


class EnvletFS(pyfuse3.Operations):
    """Read-only presentation of every registered layer under the mount root."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, envlet: "Envlet"):
        super().__init__()
        self.envlet = envlet
        self.fair = envlet.fair
        self._prefix_cache: dict[tuple[int, int], list[int]] = {}
        # open files and directories: fh -> (inode, the opener's env), so reads and readdirs (which
        # carry no RequestContext) are charged to the env that opened
        self._handles: dict[int, tuple[int, EnvUsage]] = {}
        self._next_fh = 1

    async def _admit(self, ctx: pyfuse3.RequestContext, op: str) -> EnvUsage:
        return await self.fair.admit(self.fair.env_of(ctx.pid), op)

    def _handle(self, inode: int, u: EnvUsage) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = (inode, u)
        return fh

    # ------------------------------------------------------------- resolving

    def _layer(self, inode: int) -> tuple["MountedLayer", int]:
        layer = self.envlet.by_slot.get(inode >> SLOT_SHIFT)
        local = inode & LOCAL_MASK
        if layer is None or not layer.tree.valid(local):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return layer, local

    def _root_attr(self) -> pyfuse3.EntryAttributes:
        n = len(self.envlet.by_name)
        return _fill(pyfuse3.EntryAttributes(), pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755, 2 + n, 0, 0, 0,
                     int(self.envlet.started_s), 0, ROOT_TIMEOUT_S)

    def _attr(self, layer: "MountedLayer", local: int) -> pyfuse3.EntryAttributes:
        a = layer.tree.attr(local)
        base = self.envlet.id_base  # owners as the host ids of the envs' user namespace (0: none)
        return _fill(pyfuse3.EntryAttributes(), (layer.slot << SLOT_SHIFT) | local, a.mode, a.nlink,
                     to_host_id(a.uid, base), to_host_id(a.gid, base), a.size, a.mtime, a.rdev, LAYER_TIMEOUT_S)

    # ------------------------------------------------------------- metadata

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        u = await self._admit(ctx, "lookup")
        t0 = time.perf_counter()
        try:
            return self._lookup(parent_inode, name)
        finally:
            self.fair.charge(u, time.perf_counter() - t0)

    def _lookup(self, parent_inode: int, name: bytes) -> pyfuse3.EntryAttributes:
        with _errno("lookup"):
            if parent_inode == pyfuse3.ROOT_INODE:
                layer = self.envlet.by_name.get(name.decode("utf-8", "surrogateescape"))
                if layer is None:
                    raise pyfuse3.FUSEError(errno.ENOENT)
                attr = self._attr(layer, 1)
                attr.entry_timeout = ROOT_TIMEOUT_S
                return attr
            layer, local = self._layer(parent_inode)
            child = layer.tree.lookup(local, name)
            if child is None:
                # A negative entry the kernel may keep as long as a positive one: layers never
                # change. overlayfs probes every lower layer for every name it resolves, so without
                # this each env (and each repeat) pays a FUSE round trip per missing name.
                negative = pyfuse3.EntryAttributes()
                negative.st_ino = 0
                negative.entry_timeout = LAYER_TIMEOUT_S
                return negative
            return self._attr(layer, child)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        u = await self._admit(ctx, "getattr")
        t0 = time.perf_counter()
        try:
            with _errno("getattr"):
                if inode == pyfuse3.ROOT_INODE:
                    return self._root_attr()
                layer, local = self._layer(inode)
                return self._attr(layer, local)
        finally:
            self.fair.charge(u, time.perf_counter() - t0)

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        self.fair.charge(await self._admit(ctx, "other"), 0.0)
        with _errno("readlink"):
            layer, local = self._layer(inode)
            target = layer.tree.readlink(local)
            if target is None:
                raise pyfuse3.FUSEError(errno.EINVAL)
            return target

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        self.fair.charge(await self._admit(ctx, "xattr"), 0.0)
        with _errno("getxattr"):
            if inode == pyfuse3.ROOT_INODE:
                raise pyfuse3.FUSEError(errno.ENODATA)
            layer, local = self._layer(inode)
            value = layer.tree.xattrs(local).get(name.decode("utf-8", "surrogateescape"))
            if value is None:
                raise pyfuse3.FUSEError(errno.ENODATA)
            return value

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        self.fair.charge(await self._admit(ctx, "xattr"), 0.0)
        with _errno("listxattr"):
            if inode == pyfuse3.ROOT_INODE:
                return []
            layer, local = self._layer(inode)
            return [k.encode("utf-8", "surrogateescape") for k in layer.tree.xattrs(local)]

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        self.fair.charge(await self._admit(ctx, "other"), 0.0)
        # overlayfs refuses a lower whose statfs fails; report the layers' total size, nothing free.
        s = pyfuse3.StatvfsData()
        total = sum(layer.size for layer in self.envlet.by_name.values())
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = sum(layer.tree.count for layer in self.envlet.by_name.values()) + 1
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        return None  # inodes are computed, not allocated

    # ------------------------------------------------------------- directories

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        u = await self._admit(ctx, "open")
        self.fair.charge(u, 0.0)
        with _errno("opendir"):
            if inode != pyfuse3.ROOT_INODE:
                layer, local = self._layer(inode)
                if not layer.tree.is_dir(local):
                    raise pyfuse3.FUSEError(errno.ENOTDIR)
            return self._handle(inode, u)

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        fh, u = self._handles.get(fh, (0, None))
        if u is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        await self.fair.admit_usage(u, "readdir")
        t0 = time.perf_counter()
        try:
            self._readdir(fh, start_id, token)
        finally:
            self.fair.charge(u, time.perf_counter() - t0)

    def _readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        with _errno("readdir"):
            if fh == pyfuse3.ROOT_INODE:
                names = sorted(self.envlet.by_name)
                for pos in range(start_id, len(names)):
                    layer = self.envlet.by_name[names[pos]]
                    if not pyfuse3.readdir_reply(token, names[pos].encode(), self._attr(layer, 1), pos + 1):
                        return
                return
            layer, local = self._layer(fh)
            listing = layer.tree.listing(local)
            for pos in range(start_id, len(listing)):
                name, child = listing[pos]
                if not pyfuse3.readdir_reply(token, name, self._attr(layer, child), pos + 1):
                    return

    async def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)

    # ------------------------------------------------------------- files

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        u = await self._admit(ctx, "open")
        self.fair.charge(u, 0.0)
        with _errno("open"):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
                raise pyfuse3.FUSEError(errno.EROFS)
            layer, local = self._layer(inode)
            if layer.tree.file_index(local) < 0:
                raise pyfuse3.FUSEError(errno.EISDIR if layer.tree.is_dir(local) else errno.EACCES)
            return pyfuse3.FileInfo(fh=self._handle(inode, u), keep_cache=True, direct_io=False)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        inode, u = self._handles.get(fh, (0, None))
        if u is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        await self.fair.admit_usage(u, "read")
        out = await self._read(inode, off, size)
        self.fair.charge(u, 0.0, len(out))
        return out

    async def _read(self, fh: int, off: int, size: int) -> bytes:
        layer, local = self._layer(fh)
        i = layer.tree.file_index(local)
        path = layer.tree.path(local)
        with _errno(f"read layer {layer.name} {path}"):
            m = self.envlet.metrics
            m.inc("fuse_reads")
            layer.note_read(i)
            cols = layer.tree.cols
            r = cols.chunk_range(i)
            if not r or size <= 0:
                return b""
            prefix = self._prefix(layer, i, r)
            file_size = prefix[-1]
            if off >= file_size:
                return b""
            end = min(off + size, file_size)
            k0 = bisect.bisect_right(prefix, off) - 1
            k1 = bisect.bisect_left(prefix, end)
            chunks = [cols.chunk(r.start + k, prefix[k]) for k in range(k0, k1)]
            ra_end = bisect.bisect_left(prefix, min(file_size, end + self.envlet.readahead_bytes))
            readahead = [cols.chunk(r.start + k, prefix[k]) for k in range(k1, ra_end)]
            neighbors = []
            if ra_end == len(r):  # the rest of the file is covered: look past it, in blob order
                budget = self.envlet.neighbor_bytes
                k = r.stop
                n_chunks = len(cols.chunk_offsets)
                while k < n_chunks and cols.chunk_lengths[k] <= budget:  # small files only
                    neighbors.append(cols.chunk(k, 0))
                    budget -= cols.chunk_lengths[k]
                    k += 1
            try:
                datas = await self.envlet.fetcher.get(layer.source, chunks, path, readahead, neighbors)
            except (FetchError, ChunkIntegrityError):
                m.inc("read_errors")
                raise
            out = _assemble(chunks, datas, off, end)
            m.inc("fuse_read_bytes", len(out))
            return out

    def _prefix(self, layer: "MountedLayer", i: int, r: range) -> list[int]:
        key = (layer.slot, i)
        p = self._prefix_cache.get(key)
        if p is None:
            p = list(accumulate((layer.tree.cols.chunk_ulengths[k] for k in r), initial=0))
            if len(self._prefix_cache) > 4096:
                self._prefix_cache.clear()
            self._prefix_cache[key] = p
        return p

    async def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        self.fair.charge(await self._admit(ctx, "other"), 0.0)
        return not mode & os.W_OK


def _assemble(chunks: list[Chunk], datas: list[bytes], off: int, end: int) -> bytes:
    if len(chunks) == 1:
        c = chunks[0]
        return datas[0][off - c.uoffset : end - c.uoffset]
    parts = []
    for c, data in zip(chunks, datas):
        lo = max(off, c.uoffset) - c.uoffset
        hi = min(end, c.uoffset + c.ulength) - c.uoffset
        parts.append(data[lo:hi])
    return b"".join(parts)
