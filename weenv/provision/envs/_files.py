"""File operations inside an env's rootfs, from the host, that can never touch the host.

Every path is resolved with the rootfs as ``/``: ``openat2(RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS)``, so an absolute symlink (``/etc/shadow``) or a ``../../..`` chain lands
inside the rootfs, as it would for a process in the env. Where openat2 is missing (ENOSYS) the
same walk is done one component at a time with ``O_NOFOLLOW`` and symlinks expanded by hand.

Files are opened as ``O_PATH`` first and checked: a FIFO, socket or device is never opened (an
env could otherwise make the daemon block on a FIFO or read a device), and the regular file is
reopened through its ``O_PATH`` descriptor, so the object checked is the object read.
Writes are atomic (temp file in the same directory, then ``rename``); a symlink in the final
component is replaced, never followed. Created files and directories belong to the env user's
uid/gid when one is given. These calls block on disk (and on the envlet's FUSE lowers): async
callers run them in a worker thread.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import secrets
import shutil
import stat
from collections.abc import Iterable


from ... import _wire as wire
from .._errors import EnvFileError, EnvFileNotFoundError, EnvFileTooLargeError, EnvFileTypeError
from ._xattrs import USER_XATTR, user_xattrs

SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_MAX_SYMLINKS = 40

DEFAULT_MAX_READ_BYTES = 64 << 20
_MAX_ACCOUNT_FILE_BYTES = 4 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    raw = os.fsencode(path)
    for _ in range(16):
        fd = _libc.syscall(SYS_OPENAT2, ctypes.c_int(dirfd), ctypes.c_char_p(raw), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        # EAGAIN: a concurrent rename made ".." resolution ambiguous; the kernel asks to retry.
        if err != errno.EAGAIN:
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), path)


def _probe_openat2() -> bool:
    try:
        os.close(_openat2(-100, "/", os.O_PATH | os.O_CLOEXEC))  # AT_FDCWD
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter without openat2
            return False
        raise


OPENAT2_AVAILABLE = _probe_openat2()


def _resolve_by_walk(rootfd: int, rel: str, follow_last: bool) -> int:
    """openat2(RESOLVE_IN_ROOT) by hand: an O_PATH fd for ``rel`` with rootfd as ``/``."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    parts.reverse()  # a stack: pop() takes the next component
    stack: list[int] = []  # fds of the directories above ``cur``, for ".."
    cur = os.dup(rootfd)
    links = 0
    try:
        while parts:
            name = parts.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if stack:
                    os.close(cur)
                    cur = stack.pop()
                continue
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode) and (parts or follow_last):
                target = os.readlink(name, dir_fd=cur)
                os.close(fd)
                links += 1
                if links > _MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel)
                if target.startswith("/"):
                    for d in stack:
                        os.close(d)
                    stack.clear()
                    os.close(cur)
                    cur = os.dup(rootfd)
                parts.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
                continue
            if parts and not stat.S_ISDIR(st.st_mode):
                os.close(fd)
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), rel)
            stack.append(cur)
            cur = fd
        result, cur = cur, -1
        return result
    finally:
        if cur >= 0:
            os.close(cur)
        for d in stack:
            os.close(d)


_KIND = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "symlink",
    stat.S_IFCHR: "char",
    stat.S_IFBLK: "block",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
}


FileInfo = wire.FileInfo
"""One entry, as ``lstat`` sees it: :class:`weenv._wire.FileInfo`, as the daemon sends it."""


def _info(name: str, st: os.stat_result, link_target: str | None = None,
          xattrs: dict[str, str] | None = None) -> FileInfo:
    return FileInfo(
        name=name,
        kind=_KIND.get(stat.S_IFMT(st.st_mode), "unknown"),
        size_bytes=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        mtime_s=st.st_mtime,
        link_target=link_target,
        xattrs=xattrs,
    )


def normalize(path: str) -> str:
    """An env path as an absolute, normalized path (``..`` cannot climb above ``/``)."""
    if not isinstance(path, str) or "\0" in path or path == "":
        raise EnvFileError("path must be a non-empty string without NUL", path=path if isinstance(path, str) else None)
    return posixpath.normpath("/" + path).replace("//", "/")


def _split(path: str) -> tuple[str, str]:
    """(parent, name) of a normalized path; the rootfs itself has no name."""
    norm = normalize(path)
    if norm == "/":
        raise EnvFileTypeError("the env's root directory cannot be replaced or removed", path="/")
    parent, name = posixpath.split(norm)
    return parent, name


class RootFS:
    """An env's rootfs directory, with every path resolved inside it.

    ``uid``/``gid`` own what is created unless a call says otherwise. Keeps one ``O_PATH`` fd of
    the root open; :meth:`close` it (or use ``with``). Safe to share between threads.
    """

    def __init__(self, root: str, *, uid: int | None = None, gid: int | None = None, use_openat2: bool | None = None):
        self.root = root
        self.uid = uid
        self.gid = gid
        self._openat2 = OPENAT2_AVAILABLE if use_openat2 is None else (use_openat2 and OPENAT2_AVAILABLE)
        try:
            self._rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise EnvFileNotFoundError("rootfs directory is not there", path=root) from exc

    def close(self) -> None:
        if self._rootfd >= 0:
            os.close(self._rootfd)
            self._rootfd = -1

    def __enter__(self) -> RootFS:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- resolution ----------------------------------------------------------------------------

    def _resolve(self, path: str, *, follow_last: bool = True) -> int:
        """An O_PATH fd for ``path`` inside the rootfs. Raises OSError (callers translate)."""
        rel = normalize(path).lstrip("/") or "."
        if self._openat2:
            flags = os.O_PATH | os.O_CLOEXEC | (0 if follow_last else os.O_NOFOLLOW)
            return _openat2(self._rootfd, rel, flags)
        return _resolve_by_walk(self._rootfd, rel, follow_last)

    def _translate(self, exc: OSError, path: str) -> EnvFileError:
        if exc.errno == errno.ENOENT:
            return EnvFileNotFoundError("no such file or directory in the env", path=path)
        if exc.errno == errno.ENOTDIR:
            return EnvFileNotFoundError("a parent of this path is not a directory", path=path)
        if exc.errno == errno.EISDIR:
            return EnvFileTypeError("is a directory", path=path)
        if exc.errno == errno.ENOTEMPTY:
            return EnvFileError("directory not empty (remove it with recursive=True)", path=path)
        if exc.errno == errno.ELOOP:
            return EnvFileError("too many levels of symbolic links", path=path)
        return EnvFileError(f"{exc.strerror or exc}", path=path)

    def _reopen(self, pathfd: int, flags: int) -> int:
        # The O_PATH fd pins the inode we checked; reopening through it cannot pick another.
        return os.open(f"/proc/self/fd/{pathfd}", flags | os.O_CLOEXEC)

    def _parent_fd(self, parent: str, path: str) -> int:
        try:
            fd = self._resolve(parent)
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                os.close(fd)
                raise EnvFileNotFoundError("the parent of this path is not a directory", path=path)
            return fd
        except OSError as exc:
            raise self._translate(exc, path) from exc

    def _owner(self, uid: int | None, gid: int | None) -> tuple[int, int]:
        u = uid if uid is not None else self.uid
        g = gid if gid is not None else self.gid
        return (-1 if u is None else u, -1 if g is None else g)

    # -- operations ----------------------------------------------------------------------------

    def read(self, path: str, *, max_bytes: int = DEFAULT_MAX_READ_BYTES) -> bytes:
        """The content of a regular file (symlinks followed inside the rootfs)."""
        try:
            pfd = self._resolve(path)
        except OSError as exc:
            raise self._translate(exc, path) from exc
        try:
            st = os.fstat(pfd)
            if stat.S_ISDIR(st.st_mode):
                raise EnvFileTypeError("is a directory", path=path)
            if not stat.S_ISREG(st.st_mode):
                raise EnvFileTypeError(f"not a regular file ({_KIND.get(stat.S_IFMT(st.st_mode), '?')})", path=path)
            if st.st_size > max_bytes:
                raise EnvFileTooLargeError(f"file is {st.st_size} bytes, over the {max_bytes}-byte limit", path=path)
            fd = self._reopen(pfd, os.O_RDONLY)
        except OSError as exc:
            raise self._translate(exc, path) from exc
        finally:
            os.close(pfd)
        try:
            chunks = []
            total = 0
            while True:
                # The file may grow while we read; the limit holds on what we return.
                chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    raise EnvFileTooLargeError(f"file grew over the {max_bytes}-byte limit", path=path)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write(
        self,
        path: str,
        data: bytes | Iterable[bytes],
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        make_parents: bool = False,
        durable: bool = False,
        xattrs: dict[str, str] | None = None,
    ) -> None:
        """Replace (or create) a file atomically. An existing file keeps its mode and owner unless
        they are given; a new one gets 0o644 and the env user. ``durable`` fsyncs before rename.
        ``xattrs``: set as ``user.NAME`` on the new file before it takes the path.
        ``data`` may be an iterable of chunks (an upload read as it arrives); if it raises, the
        file is left as it was."""
        parent, name = _split(path)
        if make_parents:
            self.mkdir(parent, parents=True, uid=uid, gid=gid)
        dfd = self._parent_fd(parent, path)
        tmp = f".{name[:200]}.weenv-{secrets.token_hex(6)}"
        try:
            try:
                old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and stat.S_ISDIR(old.st_mode):
                raise EnvFileTypeError("is a directory", path=path)
            keep = old is not None and stat.S_ISREG(old.st_mode)
            new_mode = mode if mode is not None else (stat.S_IMODE(old.st_mode) if keep else 0o644)
            u, g = self._owner(uid, gid)
            if keep:
                u = old.st_uid if uid is None else u
                g = old.st_gid if gid is None else g
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                    view = memoryview(chunk)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                if u != -1 or g != -1:
                    os.fchown(fd, u, g)
                os.fchmod(fd, new_mode)  # after chown, which clears setuid/setgid bits
                for k, v in (xattrs or {}).items():
                    os.setxattr(fd, USER_XATTR + k, v.encode())
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            tmp = ""
        except OSError as exc:
            raise self._translate(exc, path) from exc
        finally:
            if tmp:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
            os.close(dfd)

    def stat(self, path: str, *, xattrs: bool = False) -> FileInfo:
        """``lstat`` of the final component (parents are followed inside the rootfs); ``xattrs``: its
        ``user.*`` extended attributes too."""
        norm = normalize(path)
        try:
            fd = self._resolve(norm, follow_last=False)
        except OSError as exc:
            raise self._translate(exc, path) from exc
        try:
            st = os.fstat(fd)
            target = os.readlink("", dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
            got = (user_xattrs(fd) if target is None else {}) if xattrs else None
            return _info(posixpath.basename(norm) or "/", st, target, got)
        except OSError as exc:
            raise self._translate(exc, path) from exc
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except EnvFileNotFoundError:
            return False

    def list(self, path: str, *, xattrs: bool = False) -> list[FileInfo]:
        """The entries of a directory, sorted by name, each as :meth:`stat` reports it."""
        try:
            pfd = self._resolve(path)
        except OSError as exc:
            raise self._translate(exc, path) from exc
        try:
            if not stat.S_ISDIR(os.fstat(pfd).st_mode):
                raise EnvFileTypeError("not a directory", path=path)
            dfd = self._reopen(pfd, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise self._translate(exc, path) from exc
        finally:
            os.close(pfd)
        try:
            out = []
            for name in sorted(os.listdir(dfd)):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
                except FileNotFoundError:
                    continue  # removed while we listed
                got = None
                if xattrs:
                    got = {}
                    if target is None:
                        try:
                            efd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                        except OSError:
                            efd = -1
                        if efd >= 0:
                            try:
                                got = user_xattrs(efd)
                            finally:
                                os.close(efd)
                out.append(_info(name, st, target, got))
            return out
        except OSError as exc:
            raise self._translate(exc, path) from exc
        finally:
            os.close(dfd)

    def mkdir(
        self,
        path: str,
        *,
        parents: bool = True,
        mode: int = 0o755,
        exist_ok: bool = True,
        uid: int | None = None,
        gid: int | None = None,
    ) -> None:
        """Make a directory (and its missing parents); new ones belong to the env user."""
        norm = normalize(path)
        if norm == "/":
            return
        parts = norm.strip("/").split("/")
        u, g = self._owner(uid, gid)
        for i in range(1 if parents else len(parts), len(parts) + 1):
            prefix = "/" + "/".join(parts[:i])
            is_target = i == len(parts)
            try:
                fd = self._resolve(prefix)
                isdir = stat.S_ISDIR(os.fstat(fd).st_mode)
                os.close(fd)
                if not isdir:
                    raise EnvFileTypeError("exists and is not a directory", path=prefix)
                if is_target and not exist_ok:
                    raise EnvFileError("directory already exists", path=path)
                continue
            except OSError as exc:
                if exc.errno != errno.ENOENT or (not parents and not is_target):
                    raise self._translate(exc, path) from exc
            parent, name = posixpath.split(prefix)
            dfd = self._parent_fd(parent, path)
            try:
                try:
                    os.mkdir(name, mode, dir_fd=dfd)
                except FileExistsError:
                    # A dangling symlink in the way, or a racing mkdir: check what is there now.
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode):
                        raise EnvFileTypeError("exists and is not a directory", path=prefix) from None
                    continue
                # Through an O_NOFOLLOW fd: the env may swap the new name for a symlink meanwhile.
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    if u != -1 or g != -1:
                        os.fchown(nfd, u, g)
                    os.fchmod(nfd, mode)  # exact mode, whatever the daemon's umask
                finally:
                    os.close(nfd)
            except OSError as exc:
                raise self._translate(exc, path) from exc
            finally:
                os.close(dfd)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, symlink (never its target) or directory (with its content if
        ``recursive``; without, it must be empty)."""
        parent, name = _split(path)
        dfd = self._parent_fd(parent, path)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if recursive:
                    # The fd-based rmtree opens each level with O_NOFOLLOW relative to its parent,
                    # so a symlink swapped in mid-walk is unlinked, not entered.
                    shutil.rmtree(name, dir_fd=dfd)
                else:
                    os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        except OSError as exc:
            raise self._translate(exc, path) from exc
        finally:
            os.close(dfd)

    def move(self, path: str, to: str) -> None:
        """Rename ``path`` to ``to`` (both inside the rootfs; a file at ``to`` is replaced, as
        ``rename(2)`` does; neither path's last component is followed if it is a symlink)."""
        src_parent, src_name = _split(path)
        dst_parent, dst_name = _split(to)
        sfd = self._parent_fd(src_parent, path)
        try:
            dfd = self._parent_fd(dst_parent, to)
            try:
                os.rename(src_name, dst_name, src_dir_fd=sfd, dst_dir_fd=dfd)
            except OSError as exc:
                raise self._translate(exc, path if exc.errno == errno.ENOENT else to) from exc
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)
