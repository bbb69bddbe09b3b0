"""Atomic file replacement: readers see the old file or the whole new one, never a part of it.

    atomic_write(path, b"...", mode=0o644)               # bytes or str, in one call
    with atomic_writer(path, encoding="utf-8") as f:      # a file object; streamed writes
        json.dump(entry, f)
    with AtomicFile(blobs + "/unnamed") as a:             # the name is known only at the end
        a.file.write(...)
        a.commit(os.path.join(blobs, digest))

The bytes go to a temp file created with ``O_EXCL`` beside the target (same directory, so same file
system: the rename is atomic) under a random name, ``.NAME.tmp-XXXXXXXXXXXX``; concurrent writers of
one path, threads or processes, never share a temp. On success: flush, ``fsync`` the file (unless
``fsync=False``), ``os.replace`` onto the target, ``fsync`` the directory so the rename survives a
crash. On any error (the ``with`` body's included) the temp is removed and the target untouched.

``mode`` is set with ``fchmod`` on the temp's descriptor before any byte is written, so the result
does not depend on the process umask and is never, even briefly, more open than ``mode``; the umask
itself is never read or changed (it is process-wide). ``mode=None`` keeps what ``open()`` would give
a new file: 0o666 less the umask.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["AtomicFile", "atomic_write", "atomic_writer", "fsync_dir"]

_NAME_TRIES = 64  # random 48-bit names: a collision at all is already a surprise


def fsync_dir(path: str) -> None:
    """``fsync`` the directory ``path``: makes the names created, renamed or removed in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A temp file beside ``path`` that :meth:`commit` renames onto ``path`` (or onto another name
    in the same directory). As a context manager: committed at the end of the block unless
    :meth:`commit` or :meth:`discard` ran; discarded if the block raises."""

    def __init__(self, path: str | os.PathLike[str], *, mode: int | None = 0o644, fsync: bool = True,
                 encoding: str | None = None):
        self.path = os.fspath(path)
        self.directory = os.path.dirname(os.path.abspath(self.path))
        self.fsync = fsync
        self._done = False
        base = os.path.basename(self.path) or "file"
        for _ in range(_NAME_TRIES):
            tmp = os.path.join(self.directory, f".{base}.tmp-{secrets.token_hex(6)}")
            try:
                # 0o600 until fchmod: never more open than asked, whatever the umask
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             0o666 if mode is None else 0o600)
            except FileExistsError:
                continue
            break
        else:
            raise FileExistsError(f"cannot create a temp file for {self.path!r}: {_NAME_TRIES} random names "
                                  f"in {self.directory!r} were all taken")
        self.tmp = tmp
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            self.file: IO[Any] = os.fdopen(fd, "w" if encoding else "wb", encoding=encoding)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise

    def commit(self, path: str | os.PathLike[str] | None = None) -> None:
        """Flush, fsync, rename onto ``path`` (default: the one given at creation; it must be in the
        same directory), fsync the directory. The temp is removed if any step fails."""
        if self._done:
            raise ValueError(f"{self.path!r}: the temp file was already committed or discarded")
        dest = self.path if path is None else os.fspath(path)
        if os.path.dirname(os.path.abspath(dest)) != self.directory:
            self.discard()
            raise ValueError(f"cannot commit {self.tmp!r} to {dest!r}: not in the same directory")
        try:
            self.file.flush()
            if self.fsync:
                os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, dest)
        except BaseException:
            self.discard()
            raise
        self._done = True
        if self.fsync:
            fsync_dir(self.directory)

    def discard(self) -> None:
        """Close and remove the temp; the target is left as it was. Idempotent."""
        if self._done:
            return
        self._done = True
        try:
            self.file.close()
        except OSError:
            pass
        self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.discard()
        elif not self._done:
            self.commit()


@contextmanager
def atomic_writer(path: str | os.PathLike[str], *, mode: int | None = 0o644, fsync: bool = True,
                  encoding: str | None = None) -> Iterator[IO[Any]]:
    """A file object (binary, or text with ``encoding``) whose bytes replace ``path`` when the block
    ends without an exception; see the module docstring."""
    with AtomicFile(path, mode=mode, fsync=fsync, encoding=encoding) as a:
        yield a.file


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = 0o644,
                 fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` (``str`` is written as UTF-8) atomically."""
    with atomic_writer(path, mode=mode, fsync=fsync) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
