"""Tar archives into and out of an env's rootfs: what ``weenv build``'s COPY and the Docker API's
``put_archive`` / ``get_archive`` carry.

Every path is resolved inside the rootfs (:class:`~._files.RootFS`: ``openat2(RESOLVE_IN_ROOT)``),
so neither a member name nor a symlink the env made can reach a host file. Extraction keeps what
the tar says of each member (type, mode with setuid/setgid, owner, mtime, ``user.*`` xattrs),
owners mapped onto the env's user namespace range; it refuses device nodes (an env never gets one
from a file copy) and member names that climb out of the destination. The archive of a path is
named by its last component, as Docker names it, with hard links kept and owners as the env
sees them. Both stream: nothing is held whole in memory.
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import stat
import tarfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from .._errors import EnvFileError, EnvFileNotFoundError, EnvFileTypeError
from ._files import RootFS, normalize

CHUNK = 1 << 20
XATTR_PREFIX = "SCHILY.xattr."
KEPT_XATTRS = ("user.",)
"""Extended attributes an extraction sets: ``user.*`` only (``security.*`` and ``trusted.*``
decide what the kernel lets a file do; an env sets those itself, as its root may)."""


class ArchiveError(EnvFileError):
    """A tar the env cannot take (a bad member, a device node, not a tar at all); names the member."""


def _member_path(dest: str, name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"tar member {name!r} climbs out of the destination", path=dest)
    return normalize(posixpath.join(dest, *parts)) if parts else normalize(dest)


class ChunkReader(io.RawIOBase):
    """A readable file over an iterable of byte chunks (an upload read as it arrives)."""

    def __init__(self, chunks: Iterable[bytes] | bytes):
        self._it = iter([chunks] if isinstance(chunks, (bytes, bytearray)) else chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                self._buf = bytes(next(self._it))
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


class _Extractor:
    def __init__(self, fs: RootFS, dest: str, host_id: Callable[[int], int]):
        self.fs = fs
        self.dest = dest
        self.host_id = host_id
        self.dir_times: list[tuple[str, int]] = []
        self.made: set[str] = set()  # directories known to be there
        self.count = 0

    def _parent(self, path: str) -> tuple[int, str]:
        """The parent's fd (missing parents made, owned by the env's root) and the last name."""
        parent, name = posixpath.split(path)
        if parent not in self.made:
            self.fs.mkdir(parent, parents=True, uid=self.host_id(0), gid=self.host_id(0))
            self.made.add(parent)
        return self.fs._parent_fd(parent, path), name

    def _clear(self, dfd: int, name: str, path: str) -> None:
        """Make room for a non-directory: an existing file or symlink goes, a directory stays an error."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise EnvFileTypeError("is a directory (a tar member of another type names it)", path=path)
        os.unlink(name, dir_fd=dfd)

    def _finish(self, dfd: int, name: str, m: tarfile.TarInfo, path: str, *, chmod: bool = True) -> None:
        uid, gid = self.host_id(m.uid), self.host_id(m.gid)
        os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
        if chmod:  # after chown, which clears setuid / setgid
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(m.mode))
                for key, value in (m.pax_headers or {}).items():
                    if key.startswith(XATTR_PREFIX) and key[len(XATTR_PREFIX):].startswith(KEPT_XATTRS):
                        raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
                        os.setxattr(f"/proc/self/fd/{fd}", key[len(XATTR_PREFIX):], raw)
            finally:
                os.close(fd)
        os.utime(name, (m.mtime, m.mtime), dir_fd=dfd, follow_symlinks=False)

    def member(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        path = _member_path(self.dest, m.name)
        if m.ischr() or m.isblk():
            raise ArchiveError(f"tar member {m.name!r} is a device node: a copy never makes one", path=path)
        if path == "/" and not m.isdir():
            raise ArchiveError(f"tar member {m.name!r} names the root", path=path)
        self.count += 1
        if m.isdir():
            if path != "/":
                dfd, name = self._parent(path)
                try:
                    try:
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        if not stat.S_ISDIR(st.st_mode):
                            os.unlink(name, dir_fd=dfd)  # a file or symlink where the tar has a directory
                            os.mkdir(name, 0o700, dir_fd=dfd)
                    except FileNotFoundError:
                        os.mkdir(name, 0o700, dir_fd=dfd)
                    self._finish(dfd, name, m, path)
                finally:
                    os.close(dfd)
                self.made.add(path)
            self.dir_times.append((path, int(m.mtime)))
            return
        dfd, name = self._parent(path)
        try:
            if m.isfile():
                src = tar.extractfile(m)
                assert src is not None
                self.fs.write(path, _chunks(src), mode=stat.S_IMODE(m.mode), uid=self.host_id(m.uid),
                              gid=self.host_id(m.gid))
                self._finish(dfd, name, m, path)
            elif m.issym():
                self._clear(dfd, name, path)
                os.symlink(m.linkname, name, dir_fd=dfd)
                self._finish(dfd, name, m, path, chmod=False)
            elif m.islnk():
                target = _member_path(self.dest, m.linkname)
                sparent, sname = posixpath.split(target)
                sfd = self.fs._parent_fd(sparent, target)
                try:
                    self._clear(dfd, name, path)
                    os.link(sname, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise ArchiveError(f"tar member {m.name!r} links to {m.linkname!r}, which the archive has "
                                       "not made", path=path) from None
                finally:
                    os.close(sfd)
            elif m.isfifo():
                self._clear(dfd, name, path)
                os.mkfifo(name, 0o600, dir_fd=dfd)
                self._finish(dfd, name, m, path)
            else:
                raise ArchiveError(f"tar member {m.name!r} has a type a copy does not make ({m.type!r})", path=path)
        finally:
            os.close(dfd)

    def restore_dir_times(self) -> None:
        for path, mtime in reversed(self.dir_times):  # children first: their creation moved the parents'
            try:
                fd = self.fs._resolve(path)
            except OSError:
                continue
            try:
                os.utime(f"/proc/self/fd/{fd}", (mtime, mtime))
            except OSError:
                pass
            finally:
                os.close(fd)


def extract(fs: RootFS, dest: str, stream: BinaryIO, *, host_id: Callable[[int], int] = lambda i: i) -> int:
    """Unpack the tar read from ``stream`` (plain, gzip, bzip2 or xz) into directory ``dest`` of
    the rootfs; returns the number of members. ``host_id`` maps the tar's owners (the env's ids)
    to the ids the host writes (a user namespace's range)."""
    dest = normalize(dest)
    try:
        fd = fs._resolve(dest)  # a symlink to a directory is followed, inside the rootfs
    except OSError as e:
        raise fs._translate(e, dest) from None
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise EnvFileTypeError("the destination of an archive must be a directory", path=dest)
    finally:
        os.close(fd)
    ex = _Extractor(fs, dest, host_id)
    try:
        with tarfile.open(fileobj=io.BufferedReader(stream, CHUNK) if isinstance(stream, io.RawIOBase) else stream,
                          mode="r|*") as tar:
            for m in tar:
                try:
                    ex.member(tar, m)
                except OSError as e:
                    raise ArchiveError(f"tar member {m.name!r}: {e.strerror or e}", path=dest) from None
    except tarfile.TarError as e:
        raise ArchiveError(f"not a readable tar archive: {e}", path=dest) from None
    ex.restore_dir_times()
    return ex.count


class _Sink:
    """A write-only file for tarfile that hands each piece to ``send``."""

    def __init__(self, send: Callable[[bytes], Any]):
        self.send = send
        self.buf = bytearray()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.buf += data
        self.size += len(data)
        if len(self.buf) >= CHUNK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self.buf:
            self.send(bytes(self.buf))
            self.buf.clear()


def archive(fs: RootFS, path: str, send: Callable[[bytes], Any], *, env_id: Callable[[int], int] = lambda i: i) -> int:
    """Write a tar of ``path`` (a file, or a directory and everything under it, symlinks not
    followed) to ``send`` in pieces, its members named from ``path``'s last component; returns
    the bytes sent. ``env_id``: host owner -> the owner the env sees."""
    norm = normalize(path)
    top = posixpath.basename(norm) or "."
    try:
        fd = fs._resolve(norm, follow_last=False)
    except OSError as e:
        raise fs._translate(e, path) from None
    sink = _Sink(send)
    seen: dict[tuple[int, int], str] = {}
    # tarfile's defaults (10 KiB stream blocks, 16 KiB copies) cost 4-5x the time of 1 MiB ones
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK) as tar:  # type: ignore[call-overload]
        tar.copybufsize = CHUNK
        _add(tar, fd, top, env_id, seen, path)
    sink.flush()
    return sink.size


def _add(tar: tarfile.TarFile, fd: int, name: str, env_id: Callable[[int], int], seen: dict[tuple[int, int], str],
         where: str) -> None:
    """Add the inode ``fd`` (an O_PATH fd, closed here) as ``name``, and a directory's entries."""
    try:
        st = os.fstat(fd)
        ti = tarfile.TarInfo(name)
        ti.mode, ti.uid, ti.gid, ti.mtime = stat.S_IMODE(st.st_mode), env_id(st.st_uid), env_id(st.st_gid), \
            int(st.st_mtime)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen:
            ti.type, ti.linkname = tarfile.LNKTYPE, seen[(st.st_dev, st.st_ino)]
            tar.addfile(ti)
        elif stat.S_ISREG(st.st_mode):
            if st.st_nlink > 1:
                seen[(st.st_dev, st.st_ino)] = name
            ti.size = st.st_size
            rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            with os.fdopen(rfd, "rb") as f:
                tar.addfile(ti, f)
        elif stat.S_ISLNK(st.st_mode):
            ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink("", dir_fd=fd)
            tar.addfile(ti)
        elif stat.S_ISFIFO(st.st_mode):
            ti.type = tarfile.FIFOTYPE
            tar.addfile(ti)
        elif stat.S_ISDIR(st.st_mode):
            ti.type = tarfile.DIRTYPE
            tar.addfile(ti)
            dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for child in sorted(os.listdir(dfd)):
                    try:
                        cfd = os.open(child, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                    except FileNotFoundError:
                        continue  # removed while we walked
                    _add(tar, cfd, f"{name}/{child}", env_id, seen, where)
            finally:
                os.close(dfd)
        # sockets and device nodes are left out, as a copy would leave them
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise EnvFileNotFoundError(f"{name}: {e.strerror}", path=where) from None
        raise EnvFileError(f"{name}: {e.strerror or e}", path=where) from None
    finally:
        os.close(fd)
