"""``weenv cp``: files and directory trees between the host and an env, as ``docker cp`` does.

- A directory is copied with everything in it. Into an existing directory it lands under its own
  name (``SRC/.`` copies only its content); to a path that does not exist, that path becomes the copy.
- A destination ending in ``/`` means "into this directory": it must exist.
- A file to an existing directory lands under its own name; to another path, the parent must exist.
- Symlinks inside a tree are copied as symlinks to the host; the env's files API cannot make them,
  so host-to-env copies skip them (and FIFOs, sockets, devices either way) and say so.

Each side is a small set of operations (kind, list, read, write, mkdir, symlink), so one walk
serves both directions.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from dataclasses import dataclass, field
from typing import Any, Protocol


class CopyError(Exception):
    """Raised for a copy that cannot be done; the message names the path and what is wrong."""


@dataclass
class Entry:
    name: str
    kind: str  # "file", "dir", "symlink" or another kind (skipped)
    mode: int
    link_target: str | None = None


@dataclass
class CopyReport:
    files: int = 0
    dirs: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)


class Side(Protocol):
    path: Any  # os.path or posixpath

    def show(self, path: str) -> str: ...
    def stat(self, path: str) -> tuple[str, int] | None: ...  # (kind, mode), symlinks followed; None: missing
    def list(self, path: str) -> list[Entry]: ...  # entries as lstat sees them
    def read(self, path: str) -> bytes: ...
    def write(self, path: str, data: bytes, mode: int) -> None: ...
    def mkdir(self, path: str, mode: int) -> None: ...  # an existing directory is fine
    def symlink(self, path: str, target: str) -> bool: ...  # False: this side cannot make symlinks


def _kind_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return {stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "char", stat.S_IFBLK: "block"}.get(
        stat.S_IFMT(mode), "unknown")


class HostSide:
    path = os.path

    def show(self, path: str) -> str:
        return path

    def _err(self, e: OSError, path: str) -> CopyError:
        return CopyError(f"{path}: {e.strerror or e}")

    def stat(self, path: str) -> tuple[str, int] | None:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a parent is a file
            return None
        except OSError as e:
            raise self._err(e, path) from None
        return _kind_of(st.st_mode), stat.S_IMODE(st.st_mode)

    def list(self, path: str) -> list[Entry]:
        out = []
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            raise self._err(e, path) from None
        for name in names:
            p = os.path.join(path, name)
            try:
                st = os.lstat(p)
                target = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            except FileNotFoundError:
                continue  # removed while we walked
            except OSError as e:
                raise self._err(e, p) from None
            out.append(Entry(name, _kind_of(st.st_mode), stat.S_IMODE(st.st_mode), target))
        return out

    def read(self, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise self._err(e, path) from None

    def write(self, path: str, data: bytes, mode: int) -> None:
        # O_NOFOLLOW: a symlink already at a name inside the tree is not followed out of it.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CopyError(f"{path}: is a symlink (not written through)") from None
            raise self._err(e, path) from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), mode & 0o777)
        except OSError as e:
            raise self._err(e, path) from None

    def mkdir(self, path: str, mode: int) -> None:
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, mode & 0o777)  # exact, whatever the umask
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise CopyError(f"{path}: exists and is not a directory") from None
        except OSError as e:
            raise self._err(e, path) from None

    def symlink(self, path: str, target: str) -> bool:
        try:
            os.symlink(target, path)
        except FileExistsError:
            raise CopyError(f"{path}: already exists (a symlink is not written over it)") from None
        except OSError as e:
            raise self._err(e, path) from None
        return True


class EnvSide:
    """An env through the daemon's files API (a ``weenv.Env``)."""

    path = posixpath

    def __init__(self, env: Any):
        self.env = env

    def show(self, path: str) -> str:
        return f"{self.env.id}:{path}"

    def _err(self, e: Exception, path: str) -> CopyError:
        msg = str(getattr(e, "detail", e))
        if msg.endswith(f": {path!r}"):  # the daemon names the path too
            msg = msg[: -len(f": {path!r}")]
        return CopyError(f"{self.show(path)}: {msg}")

    def stat(self, path: str) -> tuple[str, int] | None:
        from .._client import ApiError

        try:
            info = self.env.stat(path)
        except ApiError as e:
            if e.kind == "file_not_found":
                return None
            raise self._err(e, path) from None
        if info["kind"] != "symlink":
            return info["kind"], info["mode"]
        try:  # that was an lstat: see what the link leads to (inside the env)
            self.env.list_dir(path)
            return "dir", 0o755
        except ApiError as e:
            return None if e.kind == "file_not_found" else ("file", 0o644)

    def list(self, path: str) -> list[Entry]:
        from .._client import ApiError

        try:
            return [Entry(i["name"], i["kind"], i["mode"], i.get("link_target")) for i in self.env.list_dir(path)]
        except ApiError as e:
            raise self._err(e, path) from None

    def read(self, path: str) -> bytes:
        from .._client import ApiError

        try:
            return self.env.read_file(path)
        except ApiError as e:
            raise self._err(e, path) from None

    def write(self, path: str, data: bytes, mode: int) -> None:
        from .._client import ApiError

        try:
            self.env.write_file(path, data, mode=mode & 0o777)
        except ApiError as e:
            raise self._err(e, path) from None

    def mkdir(self, path: str, mode: int) -> None:
        from .._client import ApiError

        try:
            self.env.mkdir(path, mode=mode & 0o777)
        except ApiError as e:
            raise self._err(e, path) from None

    def symlink(self, path: str, target: str) -> bool:
        return False


def _strip(path: str) -> str:
    """The path without trailing ``/`` or ``/.`` (the root stays the root)."""
    p = path
    while len(p) > 1 and (p.endswith("/") or p.endswith("/.")):
        p = p[:-1] if p.endswith("/") else p[:-2]
    return p or "/"


def copy(src_side: Side, src: str, dst_side: Side, dst: str) -> tuple[CopyReport, str]:
    """Copy ``src`` to ``dst`` (rules in the module docstring); the report and the path written."""
    report = CopyReport()
    src_path, dst_path = _strip(src), _strip(dst)
    contents_only = src.endswith("/.") or src_path in ("/", ".")
    into_dir = dst.endswith("/") or dst.endswith("/.")
    found = src_side.stat(src_path)
    if found is None:
        raise CopyError(f"{src_side.show(src)}: no such file or directory")
    src_kind, src_mode = found
    if src_kind not in ("file", "dir"):
        raise CopyError(f"{src_side.show(src)}: is a {src_kind}, not a file or directory")
    if src_kind == "file" and src != src_path:
        raise CopyError(f"{src_side.show(src)}: not a directory (it is a file)")
    there = dst_side.stat(dst_path)
    name = src_side.path.basename(src_path)
    if there is not None and there[0] == "dir":
        target = dst_path if contents_only or not name else dst_side.path.join(dst_path, name)
    elif there is not None:
        if into_dir:
            raise CopyError(f"{dst_side.show(dst)}: not a directory (it is a {there[0]})")
        if src_kind == "dir":
            raise CopyError(f"cannot copy directory {src_side.show(src)} onto {dst_side.show(dst)}, "
                            f"which is a {there[0]}")
        target = dst_path
    else:
        if into_dir and src_kind == "file":
            raise CopyError(f"{dst_side.show(dst)}: no such directory (a trailing / means into this "
                            "directory, which must exist)")
        parent = dst_side.path.dirname(dst_path) or "."
        if (dst_side.stat(parent) or ("",))[0] != "dir":
            raise CopyError(f"{dst_side.show(parent)}: no such directory")
        target = dst_path
    if src_kind == "file":
        _copy_file(src_side, src_path, dst_side, target, src_mode, report)
    else:
        _copy_tree(src_side, src_path, dst_side, target, src_mode, report, 0)
    return report, target


def _copy_file(src_side: Side, src: str, dst_side: Side, dst: str, mode: int, report: CopyReport) -> None:
    data = src_side.read(src)
    dst_side.write(dst, data, mode)
    report.files += 1
    report.bytes += len(data)


def _copy_tree(src_side: Side, src: str, dst_side: Side, dst: str, mode: int, report: CopyReport,
               depth: int) -> None:
    if depth > 256:
        raise CopyError(f"{src_side.show(src)}: directories nested over 256 deep")
    entries = src_side.list(src)
    dst_side.mkdir(dst, mode)
    report.dirs += 1
    for e in entries:
        s, d = src_side.path.join(src, e.name), dst_side.path.join(dst, e.name)
        if e.kind == "file":
            _copy_file(src_side, s, dst_side, d, e.mode, report)
        elif e.kind == "dir":
            _copy_tree(src_side, s, dst_side, d, e.mode, report, depth + 1)
        elif e.kind == "symlink" and e.link_target is not None and dst_side.symlink(d, e.link_target):
            report.files += 1
        else:
            report.skipped.append(f"{src_side.show(s)} ({e.kind})")
