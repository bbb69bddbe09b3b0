"""A layer's TOC presented as the directory tree overlayfs expects of a lower layer.

Local ids: 1 is the layer's root directory, ``2 + i`` is TOC entry ``i``, and ids after
``2 + count`` are directories the TOC implies but does not list. A hardlink's names all map to the
local id of the entry holding the content (one inode, the right nlink); an OCI whiteout
``d/.wh.X`` appears as ``d/X``, a char device 0:0; ``d/.wh..wh..opq`` makes ``d`` answer the
``trusted.overlay.opaque`` xattr with ``y``.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ..layerfmt import Columns
from ..layerfmt._toc import BLOCK, CHAR, DIR, FIFO, FILE, HARDLINK, OPAQUE, SYMLINK, WHITEOUT

ROOT_LOCAL = 1
OPAQUE_XATTR = "trusted.overlay.opaque"
_FMT = {FILE: stat.S_IFREG, DIR: stat.S_IFDIR, SYMLINK: stat.S_IFLNK, CHAR: stat.S_IFCHR, BLOCK: stat.S_IFBLK,
        FIFO: stat.S_IFIFO, WHITEOUT: stat.S_IFCHR}


@dataclass(frozen=True)
class Attr:
    """What getattr answers for one local id."""

    mode: int  # file type and permission bits
    nlink: int
    uid: int
    gid: int
    size: int
    mtime: int
    rdev: int


def _name(path: str) -> bytes:
    return path[path.rfind("/") + 1 :].encode("utf-8", "surrogateescape")


class LayerTree:
    """Directory structure and attributes of one layer, built once at registration."""

    def __init__(self, cols: Columns):
        self.cols = cols
        n = len(cols)
        self.count = n
        paths, types = cols.paths, cols.types
        parents = cols.parents()
        self.root_entry = 0 if n and paths[0] == "." else -1
        self.children: dict[int, dict[bytes, int]] = {ROOT_LOCAL: {}}
        self.implicit: list[str] = []  # path of implicit dir k, local id 2 + n + k
        self._implicit_ids: dict[str, int] = {}
        self.opaque: set[int] = set()
        self.subdirs: dict[int, int] = {}
        self._sorted: dict[int, list[tuple[bytes, int]]] = {}
        index = cols.index
        whiteouts: list[tuple[int, int]] = []
        for i in range(n):
            if i == self.root_entry:
                continue
            t = types[i]
            p = paths[i]
            j = parents[i]
            if j >= 0:
                parent = ROOT_LOCAL if j == self.root_entry else 2 + j
            elif "/" in p:
                parent = self._implicit_dir(p[: p.rfind("/")])
            else:
                parent = ROOT_LOCAL
            if t == OPAQUE:
                self.opaque.add(parent)
                continue
            if t == WHITEOUT:
                whiteouts.append((parent, i))
                continue
            kids = self.children.setdefault(parent, {})
            if t == HARDLINK:
                kids[_name(p)] = 2 + index[cols.toc.links[i]]
                continue
            kids[_name(p)] = 2 + i
            if t == DIR:
                self.children.setdefault(2 + i, {})
                self.subdirs[parent] = self.subdirs.get(parent, 0) + 1
        for parent, i in whiteouts:  # a real entry of the same name in this layer wins
            kids = self.children.setdefault(parent, {})
            name = _name(paths[i])[4:]
            if name not in kids:
                kids[name] = 2 + i

    def _implicit_dir(self, path: str) -> int:
        local = self._implicit_ids.get(path)
        if local is not None:
            return local
        i = self.cols.index.get(path)
        if i is not None:  # listed (parents() guarantees it is a directory)
            return ROOT_LOCAL if i == self.root_entry else 2 + i
        slash = path.rfind("/")
        parent = self._implicit_dir(path[:slash]) if slash >= 0 else ROOT_LOCAL
        local = 2 + self.count + len(self.implicit)
        self.implicit.append(path)
        self._implicit_ids[path] = local
        self.children.setdefault(parent, {})[_name(path)] = local
        self.children.setdefault(local, {})
        self.subdirs[parent] = self.subdirs.get(parent, 0) + 1
        return local

    # ------------------------------------------------------------------ queries

    def valid(self, local: int) -> bool:
        return local == ROOT_LOCAL or 2 <= local < 2 + self.count + len(self.implicit)

    def entry_index(self, local: int) -> int:
        """TOC index for a local id, or -1 for the root (without a '.' entry) and implicit dirs."""
        if local == ROOT_LOCAL:
            return self.root_entry
        i = local - 2
        return i if i < self.count else -1

    def path(self, local: int) -> str:
        if local == ROOT_LOCAL:
            return "."
        i = local - 2
        return self.cols.paths[i] if i < self.count else self.implicit[i - self.count]

    def is_dir(self, local: int) -> bool:
        return local in self.children

    def lookup(self, parent: int, name: bytes) -> int | None:
        kids = self.children.get(parent)
        return None if kids is None else kids.get(name)

    def listing(self, local: int) -> list[tuple[bytes, int]]:
        """Children sorted by name: readdir offsets are positions in this list, stable for the mount's life."""
        out = self._sorted.get(local)
        if out is None:
            out = self._sorted[local] = sorted(self.children.get(local, {}).items())
        return out

    def attr(self, local: int) -> Attr:
        i = self.entry_index(local)
        if i < 0:
            return Attr(stat.S_IFDIR | 0o755, 2 + self.subdirs.get(local, 0), 0, 0, 0, 0, 0)
        cols = self.cols
        t = cols.types[i]
        if t == WHITEOUT:
            return Attr(stat.S_IFCHR, 1, 0, 0, 0, cols.mtimes[i], 0)
        mode = _FMT[t] | cols.modes[i]
        if t == DIR:
            return Attr(mode, 2 + self.subdirs.get(local, 0), cols.uids[i], cols.gids[i], 0, cols.mtimes[i], 0)
        size = rdev = 0
        if t == FILE:
            size = cols.size(i)
        elif t == SYMLINK:
            size = len(cols.toc.links[i].encode("utf-8", "surrogateescape"))
        elif t in (CHAR, BLOCK):
            major, minor = cols.toc.devices.get(i, (0, 0))
            rdev = os.makedev(major, minor)
        return Attr(mode, cols.nlinks.get(i, 1), cols.uids[i], cols.gids[i], size, cols.mtimes[i], rdev)

    def readlink(self, local: int) -> bytes | None:
        i = self.entry_index(local)
        if i < 0 or self.cols.types[i] != SYMLINK:
            return None
        return self.cols.toc.links[i].encode("utf-8", "surrogateescape")

    def xattrs(self, local: int) -> dict[str, bytes]:
        i = self.entry_index(local)
        out = dict(self.cols.toc.xattrs.get(i, {})) if i >= 0 else {}
        if local in self.opaque:
            out[OPAQUE_XATTR] = b"y"
        return out

    def file_index(self, local: int) -> int:
        """TOC index of a regular file (content holder), or -1."""
        i = self.entry_index(local)
        return i if i >= 0 and self.cols.types[i] == FILE else -1
