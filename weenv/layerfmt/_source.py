"""Build inputs: a directory tree or a tar stream, read into a list of :class:`SourceEntry`.

Both sources produce the same canonical description so the builder can order entries and assign
hardlinks the same way whatever the input was; the same tree therefore gives the same blob.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from ._errors import LayerInputError, StreamOrderError
from ._toc import OPAQUE_NAME, WHITEOUT_PREFIX

OVERLAY_XATTR_PREFIX = "trusted.overlay."
# xattrs that describe the build host rather than the tree.
_DROPPED_XATTR_PREFIXES = (OVERLAY_XATTR_PREFIX, "security.selinux", "system.")


@dataclass
class SourceEntry:
    path: str  # canonical: "." for the root, else relative without "./" or trailing "/"
    type: str  # file dir symlink char block fifo whiteout opaque (hardlinks are grouped by link_key)
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    size: int = 0
    link: str = ""  # symlink target
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    opener: Callable[[], BinaryIO] | None = None  # content of regular files
    link_key: object = None  # entries with the same key are hardlinks of one inode


def keep_xattr(name: str) -> bool:
    return not name.startswith(_DROPPED_XATTR_PREFIXES)


def canonical_path(name: str, *, where: str) -> str:
    """Normalize a tar or relative path; reject what could escape the root."""
    if "\x00" in name:
        raise LayerInputError("path contains a NUL byte", path=name)
    if name.startswith("/"):
        raise LayerInputError(f"absolute path in {where}", path=name)
    parts = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise LayerInputError(f"path with '..' in {where}", path=name)
        parts.append(part)
    try:
        "/".join(parts).encode("utf-8")
    except UnicodeEncodeError:
        raise LayerInputError(f"path in {where} is not valid UTF-8", path=name) from None
    return "/".join(parts) or "."


# --------------------------------------------------------------------------------------- directory


class PathOpener:
    """Opens a file on disk; the builder recognizes it and reads with ``os.open``/``os.readv`` instead."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def __call__(self) -> BinaryIO:
        return open(self.path, "rb", buffering=0)


def _read_xattrs(path: str, rel: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    if not names:
        return {}
    out = {}
    for name in sorted(names):
        try:
            out[name] = os.getxattr(path, name, follow_symlinks=False)
        except OSError as e:
            raise LayerInputError(f"cannot read xattr {name}: {e.strerror}", path=rel) from None
    return out


def scan_directory(root: str | os.PathLike[str], *, overlay_upper: bool = False) -> list[SourceEntry]:
    """Describe the tree under ``root``, in canonical order (see :func:`iter_directory`)."""
    return list(iter_directory(root, overlay_upper=overlay_upper))


def iter_directory(root: str | os.PathLike[str], *, overlay_upper: bool = False) -> Iterator[SourceEntry]:
    """Describe the tree under ``root`` lazily, depth-first with siblings sorted by name.

    That is the builder's canonical order (``.`` first, then paths compared component by
    component), so a build can start compressing before the walk ends.

    With ``overlay_upper`` the tree is an overlayfs upper directory: char 0:0 devices become OCI
    whiteouts and directories marked ``trusted.overlay.opaque=y`` get an opaque entry.
    """
    root = os.fspath(root)
    try:
        st = os.lstat(root)
    except OSError as e:
        raise LayerInputError(f"cannot read build source: {e.strerror}", path=root) from None
    if not stat.S_ISDIR(st.st_mode):
        raise LayerInputError("build source is not a directory", path=root)
    top = _describe(root, ".", st, overlay_upper)
    assert top is not None
    yield top[1]
    # a stack of sibling iterators: the walk resumes a parent's listing when a child's ends
    stack = [iter(_children(root, "", overlay_upper, top[1].mtime if top[3] else None))]
    while stack:
        for _name, entry, subdir, opaque in stack[-1]:
            yield entry
            if subdir is not None:
                stack.append(iter(_children(subdir, entry.path + "/", overlay_upper, entry.mtime if opaque else None)))
                break
        else:
            stack.pop()


_Child = tuple[str, SourceEntry, "str | None", bool]  # sort name, entry, directory to descend into, opaque


def _children(abs_dir: str, rel_dir: str, overlay_upper: bool, opaque_mtime: int | None) -> list[_Child]:
    """The entries directly inside one directory, sorted by name (``opaque_mtime``: the dir is opaque)."""
    out: list[_Child] = []
    if opaque_mtime is not None:
        out.append((OPAQUE_NAME, SourceEntry(rel_dir + OPAQUE_NAME, "opaque", 0, 0, 0, opaque_mtime), None, False))
    try:
        with os.scandir(abs_dir) as it:
            listing = list(it)
    except OSError as e:
        raise LayerInputError(f"cannot list directory: {e.strerror}", path=rel_dir.rstrip("/") or ".") from None
    for d in listing:
        name = d.name
        rel = rel_dir + name
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise LayerInputError("file name is not valid UTF-8", path=os.fsencode(rel).decode("utf-8", "replace")) from None
        try:
            st = d.stat(follow_symlinks=False)
        except OSError as e:
            raise LayerInputError(f"cannot stat: {e.strerror}", path=rel) from None
        child = _describe(d.path, rel, st, overlay_upper)
        if child is not None:
            out.append(child)
    out.sort(key=_by_name)
    return out


def _by_name(child: _Child) -> str:
    return child[0]


def _describe(abs_path: str, rel: str, st: os.stat_result, overlay_upper: bool) -> _Child | None:
    m = st.st_mode
    name = rel.rpartition("/")[2]
    mtime = int(st.st_mtime)
    if overlay_upper and stat.S_ISCHR(m) and st.st_rdev == 0:
        parent = rel[: len(rel) - len(name)]
        wname = WHITEOUT_PREFIX + name
        return (wname, SourceEntry(parent + wname, "whiteout", 0, 0, 0, mtime), None, False)
    if rel != "." and name.startswith(WHITEOUT_PREFIX):
        raise LayerInputError("names starting with .wh. are reserved for OCI whiteouts", path=rel)
    xattrs = _read_xattrs(abs_path, rel)
    opaque = False
    if xattrs:
        xattrs = {k: v for k, v in xattrs.items() if keep_xattr(k) or k == "trusted.overlay.opaque"}
        opaque = overlay_upper and xattrs.pop("trusted.overlay.opaque", b"") == b"y"
        xattrs.pop("trusted.overlay.opaque", None)
    mode, uid, gid = stat.S_IMODE(m), st.st_uid, st.st_gid
    link_key = (st.st_dev, st.st_ino) if st.st_nlink > 1 and not stat.S_ISDIR(m) else None
    if stat.S_ISREG(m):
        e = SourceEntry(rel, "file", mode, uid, gid, mtime, st.st_size, "", 0, 0, xattrs, PathOpener(abs_path), link_key)
    elif stat.S_ISDIR(m):
        return (name, SourceEntry(rel, "dir", mode, uid, gid, mtime, 0, "", 0, 0, xattrs), abs_path, opaque)
    elif stat.S_ISLNK(m):
        try:
            target = os.readlink(abs_path)
        except OSError as err:
            raise LayerInputError(f"cannot read symlink: {err.strerror}", path=rel) from None
        e = SourceEntry(rel, "symlink", mode, uid, gid, mtime, 0, target, 0, 0, xattrs, None, link_key)
    elif stat.S_ISCHR(m) or stat.S_ISBLK(m):
        e = SourceEntry(rel, "char" if stat.S_ISCHR(m) else "block", mode, uid, gid, mtime, 0, "",
                        os.major(st.st_rdev), os.minor(st.st_rdev), xattrs, None, link_key)
    elif stat.S_ISFIFO(m):
        e = SourceEntry(rel, "fifo", mode, uid, gid, mtime, 0, "", 0, 0, xattrs, None, link_key)
    else:
        return None  # sockets cannot be archived, as with tar
    return (name, e, None, False)


# --------------------------------------------------------------------------------------- tar


class _SpoolSlice(io.RawIOBase):
    def __init__(self, fd: int, offset: int, size: int):
        self._fd, self._start, self._pos, self._end = fd, offset, offset, offset + size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0:
            raise io.UnsupportedOperation("only absolute seeks")
        self._pos = min(self._start + pos, self._end)
        return self._pos - self._start

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self._end - self._pos
        n = min(n, self._end - self._pos)
        data = os.pread(self._fd, n, self._pos) if n > 0 else b""
        self._pos += len(data)
        return data


class SpoolOpener:
    """Opens a slice of the spool file; the builder recognizes it and reads with ``os.preadv`` instead."""

    __slots__ = ("fd", "offset", "size")

    def __init__(self, fd: int, offset: int, size: int):
        self.fd, self.offset, self.size = fd, offset, size

    def __call__(self) -> BinaryIO:
        return _SpoolSlice(self.fd, self.offset, self.size)  # type: ignore[return-value]


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _decompressing(fileobj: BinaryIO) -> BinaryIO:
    """Wrap a tar stream that may be gzip- or zstd-compressed (tarfile's r|* lacks zstd)."""
    buffered = io.BufferedReader(fileobj) if not hasattr(fileobj, "peek") else fileobj
    head = buffered.peek(4)[:4]
    if head == ZSTD_MAGIC or (len(head) == 4 and head[0] & 0xF0 == 0x50 and head[1:] == b"\x2a\x4d\x18"):
        return zstandard.ZstdDecompressor().stream_reader(buffered, read_across_frames=True)
    return buffered


def _pax_xattrs(ti: tarfile.TarInfo) -> dict[str, bytes]:
    xattrs = {}
    for k, v in sorted(ti.pax_headers.items()):
        if k.startswith("SCHILY.xattr."):
            xname = k[len("SCHILY.xattr."):]
            if keep_xattr(xname):
                xattrs[xname] = v.encode("utf-8", "surrogateescape")
    return xattrs


def _tar_entry(ti: tarfile.TarInfo, path: str) -> tuple[SourceEntry, str | None]:
    """The entry one tar header describes, and a hardlink's target (whose fields the caller copies
    into it); a regular file's content (its opener) is also the caller's."""
    name = path.rpartition("/")[2]
    xattrs = _pax_xattrs(ti)
    base = dict(mode=ti.mode & 0o7777, uid=ti.uid, gid=ti.gid, mtime=int(ti.mtime))
    if name == OPAQUE_NAME:
        return SourceEntry(path, "opaque", mode=0, mtime=base["mtime"]), None
    if name.startswith(WHITEOUT_PREFIX):
        if name == WHITEOUT_PREFIX:
            raise LayerInputError("whiteout without a name", path=path)
        return SourceEntry(path, "whiteout", mode=0, mtime=base["mtime"]), None
    if ti.isreg():
        return SourceEntry(path, "file", size=ti.size, xattrs=xattrs, **base), None
    if ti.isdir():
        return SourceEntry(path, "dir", xattrs=xattrs, **base), None
    if ti.issym():
        if not ti.linkname:
            raise LayerInputError("symlink with an empty target", path=path)
        return SourceEntry(path, "symlink", link=ti.linkname, xattrs=xattrs, **base), None
    if ti.islnk():
        return SourceEntry(path, "file", xattrs=xattrs, **base), canonical_path(ti.linkname, where="hardlink target")
    if ti.ischr() or ti.isblk():
        return SourceEntry(path, "char" if ti.ischr() else "block", devmajor=ti.devmajor, devminor=ti.devminor,
                           xattrs=xattrs, **base), None
    if ti.isfifo():
        return SourceEntry(path, "fifo", xattrs=xattrs, **base), None
    raise LayerInputError(f"unsupported tar entry type {ti.type!r}", path=path)


def _link_to(e: SourceEntry, t: SourceEntry, target: str) -> None:
    """Make hardlink ``e`` share everything with its target ``t`` except its name."""
    if t.type not in ("file", "symlink", "char", "block", "fifo"):
        raise LayerInputError(f"hardlink to a {t.type} entry {target!r}", path=e.path)
    e.type, e.mode, e.uid, e.gid, e.mtime = t.type, t.mode, t.uid, t.gid, t.mtime
    e.size, e.link, e.devmajor, e.devminor = t.size, t.link, t.devmajor, t.devminor
    e.xattrs, e.opener, e.link_key = t.xattrs, t.opener, t.link_key


def scan_tar(fileobj: BinaryIO, *, spool_dir: str | None = None) -> tuple[list[SourceEntry], BinaryIO]:
    """Describe the entries of a tar / tar.gz / tar.zst stream (read once, front to back).

    File contents are copied to an anonymous temp file (returned; close it after building) so the
    builder can emit entries in canonical order. OCI whiteouts become whiteout/opaque entries.
    Later entries for the same path replace earlier ones, as extraction would.
    """
    spool = tempfile.TemporaryFile(dir=spool_dir)
    spool_fd = spool.fileno()
    spool_pos = 0
    by_path: dict[str, SourceEntry] = {}
    hardlinks: list[tuple[SourceEntry, str]] = []
    try:
        tf = tarfile.open(fileobj=_decompressing(fileobj), mode="r|*")
    except (tarfile.TarError, zstandard.ZstdError, OSError) as e:
        spool.close()
        raise LayerInputError(f"not a readable tar stream: {e}") from None
    try:
        for ti in tf:
            path = canonical_path(ti.name, where="tar input")
            e, target = _tar_entry(ti, path)
            if target is not None:
                hardlinks.append((e, target))
            elif e.type == "file":
                src = tf.extractfile(ti)
                start = spool_pos
                remaining = ti.size
                while remaining:
                    buf = src.read(min(remaining, 4 << 20))
                    if not buf:
                        raise LayerInputError("tar stream ends inside a file", path=path)
                    os.pwrite(spool_fd, buf, spool_pos)  # pwrite: no implicit buffering to flush
                    spool_pos += len(buf)
                    remaining -= len(buf)
                e.opener = SpoolOpener(spool_fd, start, ti.size)
            if path in by_path and by_path[path].type == "dir" and e.type == "dir":
                by_path[path] = e  # a later directory header only updates metadata
            else:
                by_path.pop(path, None)
                by_path[path] = e
    except tarfile.TarError as e:
        spool.close()
        raise LayerInputError(f"corrupt tar stream: {e}") from None
    except zstandard.ZstdError as e:
        spool.close()
        raise LayerInputError(f"corrupt zstd stream: {e}") from None
    except BaseException:
        spool.close()
        raise
    for e, target in hardlinks:
        t = by_path.get(target)
        if t is None or t is e:
            spool.close()
            raise LayerInputError(f"hardlink to {target!r}, which is not in the archive", path=e.path)
        if t.link_key is None:
            t.link_key = ("tar", t.path)
        try:
            _link_to(e, t, target)
        except LayerInputError:
            spool.close()
            raise
    return list(by_path.values()), spool


def _parent_dir(path: str) -> str:
    return path.rpartition("/")[0] or "."


def iter_tar_stream(fileobj: BinaryIO, *, drop_whiteouts: bool = False) -> Iterator[SourceEntry]:
    """The entries of an uncompressed tar stream in the stream's own order, read once, front to back.

    A regular file's opener reads its content straight from the stream and is valid only until the
    next entry is asked for (the builder reads a file before it asks). Entries are what
    :func:`scan_tar` would give for the same stream, squashed alone as one OCI layer: hardlinks share
    their target's fields and identity, whiteouts are whiteout/opaque entries, or are dropped with
    ``drop_whiteouts`` (a bottom layer has nothing below it to hide).

    The layer format wants the root first; tar writers that put it later (mmdebstrap writes ``./dev``
    first) have it moved to the front when only entries without content (at most
    ``_ROOT_LOOKAHEAD``) come before it. A single pass cannot see what comes later, so a stream that
    needs it raises :class:`StreamOrderError` (nothing Docker or umoci writes): a path that
    comes twice, the root after a file's content, a hardlink to a later entry, and -- keeping
    whiteouts -- a whiteout of a path this layer also holds, or one that would hide whiteouts this
    layer already had.
    """
    return _root_first(_tar_stream_entries(fileobj, drop_whiteouts))


_ROOT_LOOKAHEAD = 10_000  # entries without content held back while looking for the root


def _root_first(entries: Iterator[SourceEntry]) -> Iterator[SourceEntry]:
    ahead: list[SourceEntry] | None = []
    for e in entries:
        if ahead is None:
            if e.path == ".":
                raise StreamOrderError("the root directory comes after file contents", path=e.path)
            yield e
        elif e.path == ".":
            yield e
            yield from ahead
            ahead = None
        elif e.opener is None and len(ahead) < _ROOT_LOOKAHEAD:
            ahead.append(e)  # no content to read before the stream moves on: it can wait
        else:
            yield from ahead
            ahead = None
            yield e
    if ahead:
        yield from ahead


def _tar_stream_entries(fileobj: BinaryIO, drop_whiteouts: bool) -> Iterator[SourceEntry]:
    try:
        tf = tarfile.open(fileobj=fileobj, mode="r|")
    except (tarfile.TarError, OSError) as e:
        raise LayerInputError(f"not a readable tar stream: {e}") from None
    seen: dict[str, SourceEntry] = {}
    hidden: set[str] = set()  # paths a whiteout of this stream hides (kept whiteouts only)
    marked: set[str] = set()  # directories with a whiteout or opaque entry of this stream somewhere below
    try:
        while True:
            ti = tf.next()
            if ti is None:
                break
            tf.members.clear()  # tarfile keeps every header it has read; a single pass needs none of them
            path = canonical_path(ti.name, where="tar input")
            if path in seen:
                raise StreamOrderError("the path comes twice in the stream", path=path)
            e, target = _tar_entry(ti, path)
            seen[path] = e
            if e.type in ("whiteout", "opaque"):
                if drop_whiteouts:
                    continue
                parent = _parent_dir(path)
                if e.type == "whiteout":
                    gone = _join_path(parent, path.rpartition("/")[2][len(WHITEOUT_PREFIX):])
                    if gone in seen or gone in marked:
                        raise StreamOrderError("a whiteout of a path this layer also has, or hides whiteouts of",
                                               path=path)
                    hidden.add(gone)
                elif parent in marked:
                    raise StreamOrderError("an opaque directory after whiteouts inside it", path=path)
                d = parent
                while d not in marked:
                    marked.add(d)
                    if d == ".":
                        break
                    d = _parent_dir(d)
            elif path in hidden:
                raise StreamOrderError("an entry after a whiteout of it in the same layer", path=path)
            if target is not None:
                t = seen.get(target)
                if t is None or t is e:
                    raise StreamOrderError(f"hardlink to {target!r}, which has not come before it", path=path)
                _link_to(e, t, target)
            elif e.type == "file" and e.size:
                e.opener = _TarMember(tf, ti)
            if e.type not in ("dir", "whiteout", "opaque") and e.link_key is None:
                e.link_key = path  # any later entry may be a hardlink to it: the builder must know its holder
            yield e
            e.opener = None  # read by now; let the header go
    except tarfile.TarError as e:
        raise LayerInputError(f"corrupt tar stream: {e}") from None


def _join_path(parent: str, name: str) -> str:
    return name if parent == "." else f"{parent}/{name}"


class _TarMember:
    """Opens a file's content in a tar stream (once, while the stream is at it)."""

    __slots__ = ("tf", "ti")

    def __init__(self, tf: tarfile.TarFile, ti: tarfile.TarInfo):
        self.tf, self.ti = tf, ti

    def __call__(self) -> BinaryIO:
        f = self.tf.extractfile(self.ti)
        assert f is not None
        return f  # type: ignore[return-value]
