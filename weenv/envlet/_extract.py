"""Write a registered layer out as a plain directory, exactly as the mount shows it to overlayfs.

Used by the daemon to keep hot layers as local trees. Compared with copying the mount (``cp -a``
through FUSE, one request per open/read/getxattr on the loop that serves every env), the chunks
come straight from the fetcher: first the whole layer into the disk cache in large range reads
(the prefetch path, which yields to foreground reads), then each file's verified chunks from
L1/L2, written by worker threads.

Safety: ``dest`` must not exist; it is created 0700 and everything below it is made relative to
its descriptor, through directories this function created (the layer tree only has children
under directories), with ``O_EXCL|O_NOFOLLOW`` for files and no-follow calls for attributes, so a
hostile layer cannot make it write outside ``dest``.

Inert on the host (docs/security.md, "User namespaces"): owners are written as the host ids of
the envs' user namespace (``id_base``; a setuid-root file is setuid to an unprivileged uid, a
file capability belongs to the envs' root), and a layer shipping a device node (other than a
whiteout, char 0:0) gets no tree at all: it stays on the envlet's mount, which is nodev.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import trio

from ..layerfmt._ids import CAPABILITY_XATTR, cap_to_host, to_host_id
from ..layerfmt._toc import BLOCK, CHAR
from ._tree import ROOT_LOCAL, LayerTree

_BATCH_BYTES = 16 << 20  # a file's chunks are fetched and written this much at a time
_SMALL_BYTES = 256 << 10  # files up to this size are written a directory (256 files) at a time


class DeviceNodeError(OSError):
    """The layer ships a device node: it gets no tree (a tree is on the host's disk, not nodev)."""


def _first_device(tree: LayerTree) -> str | None:
    """Path of the layer's first real device node (a char 0:0 opens nothing and is allowed)."""
    cols = tree.cols
    for i, t in enumerate(cols.types):
        if t in (CHAR, BLOCK) and cols.toc.devices.get(i, (0, 0)) != (0, 0):
            return cols.paths[i]
    return None


def _apply_attrs(root_fd: int, rel: bytes, attr: Any, xattrs: dict[str, bytes], *, fd: int | None = None,
                 symlink: bool = False, id_base: int = 0) -> None:
    """Owner, mode (after the owner: setuid bits survive), xattrs, mtime."""
    uid, gid = to_host_id(attr.uid, id_base), to_host_id(attr.gid, id_base)
    if fd is not None:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, stat.S_IMODE(attr.mode))
        for k, v in xattrs.items():
            os.setxattr(fd, k, cap_to_host(v, id_base) if k == CAPABILITY_XATTR else v)
        os.utime(fd, ns=(attr.mtime * 10**9, attr.mtime * 10**9))
        return
    os.chown(rel, uid, gid, dir_fd=root_fd, follow_symlinks=False)
    if not symlink:
        os.chmod(rel, stat.S_IMODE(attr.mode), dir_fd=root_fd)
    os.utime(rel, ns=(attr.mtime * 10**9, attr.mtime * 10**9), dir_fd=root_fd, follow_symlinks=False)


async def extract_layer(tree: LayerTree, fetch: Any, prefetch: Any, dest: str, *, id_base: int = 0) -> dict[str, int]:
    """Create ``dest`` holding the layer. ``fetch(chunks, path) -> list[bytes]`` and
    ``prefetch(chunks)`` are the fetcher's, bound to the layer; owners are stored as host ids of
    the user namespace whose root is ``id_base`` (0: none). Returns counts of what was made.
    Raises :class:`DeviceNodeError` (before writing anything) for a layer with device nodes."""
    cols = tree.cols
    device = _first_device(tree)
    if device is not None:
        raise DeviceNodeError(f"the layer ships a device node ({device}): no tree, it stays on the envlet (nodev)")
    all_chunks = [cols.chunk(k, 0) for k in range(len(cols.chunk_offsets))]
    await prefetch(all_chunks)
    await trio.to_thread.run_sync(lambda: os.mkdir(dest, 0o700))
    root_fd = await trio.to_thread.run_sync(lambda: os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
    counts = {"dirs": 1, "files": 0, "links": 0, "symlinks": 0, "nodes": 0, "bytes": 0}
    made: dict[int, bytes] = {}  # local id of a file -> the first path made for it (hardlinks)
    try:
        async def write_file(rel: bytes, local: int) -> None:
            i = tree.file_index(local)
            r = cols.chunk_range(i)
            attr = tree.attr(local)
            fd = await trio.to_thread.run_sync(
                lambda: os.open(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                dir_fd=root_fd))
            try:
                uoff = 0
                batch: list[Any] = []
                size = 0
                ks = list(r) if r else []
                for n, k in enumerate(ks):
                    c = cols.chunk(k, uoff)
                    uoff += c.ulength
                    batch.append(c)
                    size += c.ulength
                    if size >= _BATCH_BYTES or n == len(ks) - 1:
                        datas = await fetch(batch, tree.path(local))
                        await trio.to_thread.run_sync(lambda d=datas: [os.write(fd, x) for x in d])
                        counts["bytes"] += size
                        batch, size = [], 0
                xattrs = tree.xattrs(local)
                await trio.to_thread.run_sync(lambda: _apply_attrs(root_fd, rel, attr, xattrs, fd=fd, id_base=id_base))
            finally:
                os.close(fd)
            counts["files"] += 1

        async def write_small_files(files: list[tuple[bytes, int]]) -> None:
            """Files of one directory below _SMALL_BYTES: one fetch, one worker call for all of them."""
            chunks: list[Any] = []
            spans = []
            for rel, local in files:
                r = cols.chunk_range(tree.file_index(local))
                uoff = 0
                first = len(chunks)
                for k in r or ():
                    c = cols.chunk(k, uoff)
                    uoff += c.ulength
                    chunks.append(c)
                spans.append((rel, local, first, len(chunks)))
            datas = await fetch(chunks, tree.path(files[0][1])) if chunks else []

            def write_all() -> None:
                for rel, local, a, b in spans:
                    fd = os.open(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=root_fd)
                    try:
                        for x in datas[a:b]:
                            os.write(fd, x)
                            counts["bytes"] += len(x)
                        _apply_attrs(root_fd, rel, tree.attr(local), tree.xattrs(local), fd=fd, id_base=id_base)
                    finally:
                        os.close(fd)
                    counts["files"] += 1

            await trio.to_thread.run_sync(write_all)

        links: list[tuple[bytes, int]] = []  # second names of files: made once every file exists
        dirs: list[tuple[bytes, int]] = []  # in pre-order; their attributes are set last, bottom-up

        def make_others(parent_rel: bytes, entries: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
            """Make the directories, symlinks and nodes of one directory; return its files."""
            files = []
            for name, local in entries:
                rel = name if not parent_rel else parent_rel + b"/" + name
                if tree.is_dir(local):
                    os.mkdir(rel, 0o700, dir_fd=root_fd)
                    counts["dirs"] += 1
                    continue
                if local in made:
                    links.append((rel, local))
                    continue
                made[local] = rel
                attr = tree.attr(local)
                kind = stat.S_IFMT(attr.mode)
                if kind == stat.S_IFREG:
                    files.append((rel, local))
                elif kind == stat.S_IFLNK:
                    os.symlink(tree.readlink(local) or b"", rel, dir_fd=root_fd)
                    _apply_attrs(root_fd, rel, attr, {}, symlink=True, id_base=id_base)
                    counts["symlinks"] += 1
                else:  # char/block devices, fifos, whiteouts (char 0:0)
                    os.mknod(rel, kind | 0o600, attr.rdev, dir_fd=root_fd)
                    _apply_attrs(root_fd, rel, attr, {}, id_base=id_base)
                    counts["nodes"] += 1
            return files

        async def walk(rel: bytes, local: int) -> None:
            dirs.append((rel, local))
            entries = tree.listing(local)
            files = await trio.to_thread.run_sync(make_others, rel, entries)
            small = [(r, x) for r, x in files if tree.attr(x).size <= _SMALL_BYTES]
            big = [(r, x) for r, x in files if tree.attr(x).size > _SMALL_BYTES]
            limiter = trio.CapacityLimiter(4)

            async def one(frel: bytes, flocal: int) -> None:
                async with limiter:
                    await write_file(frel, flocal)

            async with trio.open_nursery() as n:
                for k in range(0, len(small), 256):
                    n.start_soon(write_small_files, small[k : k + 256])
                for frel, flocal in big:
                    n.start_soon(one, frel, flocal)
            for name, child in entries:
                if tree.is_dir(child):
                    await walk(name if not rel else rel + b"/" + name, child)

        def finish() -> None:
            for rel, local in links:
                os.link(made[local], rel, src_dir_fd=root_fd, dst_dir_fd=root_fd, follow_symlinks=False)
                counts["links"] += 1
            for rel, local in reversed(dirs):  # children before parents: mtimes stay put
                dfd = os.open(rel or b".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
                try:
                    _apply_attrs(root_fd, rel, tree.attr(local), tree.xattrs(local), fd=dfd, id_base=id_base)
                finally:
                    os.close(dfd)

        await walk(b"", ROOT_LOCAL)
        await trio.to_thread.run_sync(finish)
    finally:
        os.close(root_fd)
    return counts
