"""Tiny declarative helpers that build trees on disk or as in-memory tars, and compare trees.

    make_tree(tmp, d("etc", mode=0o755), f("etc/hosts", b"127.0.0.1 localhost\n"), sym("link", "etc/hosts"))
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from dataclasses import dataclass, field

MTIME = 1_700_000_000


@dataclass
class Node:
    path: str
    kind: str  # file dir symlink hardlink fifo char block
    data: bytes = b""
    mode: int | None = None
    link: str = ""
    uid: int = 0
    gid: int = 0
    mtime: int = MTIME
    dev: tuple[int, int] = (0, 0)
    xattrs: dict[str, bytes] = field(default_factory=dict)


def f(path: str, data: bytes = b"", mode: int = 0o644, **kw) -> Node:
    return Node(path, "file", data, mode, **kw)


def d(path: str, mode: int = 0o755, **kw) -> Node:
    return Node(path, "dir", mode=mode, **kw)


def sym(path: str, target: str, **kw) -> Node:
    return Node(path, "symlink", link=target, mode=0o777, **kw)


def hard(path: str, target: str, **kw) -> Node:
    return Node(path, "hardlink", link=target, **kw)


def fifo(path: str, mode: int = 0o644, **kw) -> Node:
    return Node(path, "fifo", mode=mode, **kw)


def chardev(path: str, major: int, minor: int, mode: int = 0o644, **kw) -> Node:
    return Node(path, "char", mode=mode, dev=(major, minor), **kw)


def make_tree(root: str | os.PathLike[str], *nodes: Node) -> str:
    """Create ``nodes`` under ``root`` (parents as 0755 dirs); set modes, owners, mtimes, xattrs."""
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    dirs = []
    for n in nodes:
        p = os.path.join(root, n.path)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if n.kind == "file":
            with open(p, "wb") as fh:
                fh.write(n.data)
        elif n.kind == "dir":
            os.makedirs(p, exist_ok=True)
            dirs.append(n)
        elif n.kind == "symlink":
            os.symlink(n.link, p)
        elif n.kind == "hardlink":
            os.link(os.path.join(root, n.link), p)
            continue
        elif n.kind == "fifo":
            os.mkfifo(p)
        elif n.kind == "char":
            os.mknod(p, stat.S_IFCHR | (n.mode or 0o644), os.makedev(*n.dev))
        for k, v in n.xattrs.items():
            os.setxattr(p, k, v, follow_symlinks=False)
        os.lchown(p, n.uid, n.gid)
        if n.kind != "symlink":
            os.chmod(p, n.mode if n.mode is not None else 0o644)
        if n.kind != "dir":
            os.utime(p, (n.mtime, n.mtime), follow_symlinks=False)
    for n in sorted(dirs, key=lambda n: -n.path.count("/")):
        os.utime(os.path.join(root, n.path), (n.mtime, n.mtime))
    os.utime(root, (MTIME, MTIME))
    return root


def make_tar(*nodes: Node, names: dict[str, str] | None = None) -> bytes:
    """An uncompressed tar holding ``nodes`` in the given order (``names`` renames on the way out)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for n in nodes:
            ti = tarfile.TarInfo((names or {}).get(n.path, n.path))
            ti.mtime, ti.uid, ti.gid = n.mtime, n.uid, n.gid
            ti.mode = n.mode if n.mode is not None else 0o644
            content = None
            if n.kind == "file":
                ti.size = len(n.data)
                content = io.BytesIO(n.data)
            elif n.kind == "dir":
                ti.type = tarfile.DIRTYPE
            elif n.kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, n.link
            elif n.kind == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, n.link
            elif n.kind == "fifo":
                ti.type = tarfile.FIFOTYPE
            elif n.kind == "char":
                ti.type = tarfile.CHRTYPE
                ti.devmajor, ti.devminor = n.dev
            if n.xattrs:
                ti.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape") for k, v in n.xattrs.items()}
            tf.addfile(ti, content)
    return buf.getvalue()


def snapshot(root: str | os.PathLike[str], *, xattrs: bool = True, root_meta: bool = False) -> dict[str, tuple]:
    """A comparable description of a tree: path → (kind, mode, uid, gid, mtime, content/target/dev, xattrs, inode group)."""
    root = os.fspath(root)
    out: dict[str, tuple] = {}
    inodes: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            m = st.st_mode
            if stat.S_ISREG(m):
                with open(p, "rb") as fh:
                    what = ("file", fh.read())
            elif stat.S_ISDIR(m):
                what = ("dir", None)
            elif stat.S_ISLNK(m):
                what = ("symlink", os.readlink(p))
            elif stat.S_ISCHR(m):
                what = ("char", (os.major(st.st_rdev), os.minor(st.st_rdev)))
            elif stat.S_ISBLK(m):
                what = ("block", (os.major(st.st_rdev), os.minor(st.st_rdev)))
            elif stat.S_ISFIFO(m):
                what = ("fifo", None)
            else:
                what = ("other", None)
            group = None
            if st.st_nlink > 1 and not stat.S_ISDIR(m):
                group = inodes.setdefault((st.st_dev, st.st_ino), rel)
            xa = {}
            if xattrs:
                try:
                    xa = {k: os.getxattr(p, k, follow_symlinks=False) for k in sorted(os.listxattr(p, follow_symlinks=False))
                          if not k.startswith(("security.selinux", "trusted.overlay."))}
                except OSError:
                    xa = {}
            mtime = None if stat.S_ISLNK(m) else int(st.st_mtime)
            out[rel] = (what, stat.S_IMODE(m), st.st_uid, st.st_gid, mtime, tuple(xa.items()), group)
    if root_meta:
        st = os.lstat(root)
        out["."] = (("dir", None), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime), (), None)
    return out


def normalize_groups(snap: dict[str, tuple]) -> dict[str, tuple]:
    """Replace hardlink group representatives by the sorted set of names, so trees compare regardless of link order."""
    groups: dict[str, list[str]] = {}
    for path, v in snap.items():
        if v[6] is not None:
            groups.setdefault(v[6], []).append(path)
    out = {}
    for path, v in snap.items():
        g = tuple(sorted(groups[v[6]])) if v[6] is not None else None
        out[path] = v[:6] + (g,)
    return out
