"""Cached fixtures for tests and benchmarks: built once per host, checked every time they are read.

An entry is one file or directory ``ROOT/NAME``. ``ROOT`` is ``$WEENV_FIXTURE_CACHE``
(default ``/var/cache/weenv-fixtures``); CI points it at a fresh empty directory so it sees what a
fresh machine sees.

Building: under an exclusive ``flock`` on ``ROOT/NAME.lock`` (several pytest or benchmark
processes may want the same entry), the builder writes ``ROOT/.NAME.build-PID/NAME`` -- the
entry's own name, so tools that choose their output format by suffix (mmdebstrap writes a tar only
for ``*.tar``) make the right kind of thing -- the output is checked, then renamed into place
atomically. Readers therefore see either no entry or a whole one.

Reading: every entry is checked before it is handed out (a tar must be a regular, complete tar
with the expected members, a binary a regular ELF executable, a tree a directory with the expected
paths). An entry that fails its check is not trusted: it is removed and rebuilt. Errors::

    FixtureCacheError        the cache root is unusable ($WEENV_FIXTURE_CACHE is not an absolute path)
     ├── BadEntry            raised by a check: the entry is not what it claims (the message says why)
     └── BuildError          a builder's output failed its check (it is never renamed into place)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import sys
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path

ENV_VAR = "WEENV_FIXTURE_CACHE"
DEFAULT_ROOT = "/var/cache/weenv-fixtures"
_END_OF_ARCHIVE = b"\0" * 1024  # two zero blocks end every complete tar

Check = Callable[[Path], None]

# Entries that passed their check in this process, by identity: a changed file is checked again.
_checked: set[tuple[str, int, int, int, int]] = set()


class FixtureCacheError(Exception):
    """The fixture cache cannot be used as configured."""


class BadEntry(FixtureCacheError):
    """Raised by a check when a cache entry is not what it claims to be; the message says why."""


class BuildError(FixtureCacheError):
    """A builder's output failed its check; nothing was put into the cache."""


def cache_root() -> Path:
    """``$WEENV_FIXTURE_CACHE``, else ``/var/cache/weenv-fixtures`` (read at each call)."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return Path(DEFAULT_ROOT)
    if not os.path.isabs(value):
        raise FixtureCacheError(f"{ENV_VAR} must be an absolute directory path, got {value!r}")
    return Path(value)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file"


def _lstat_regular(path: Path, what: str) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BadEntry(f"{path}: missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadEntry(f"{path}: is {_kind(st.st_mode)}, not {what}")
    return st


def check_tar(path: Path, members: Iterable[str] = ()) -> None:
    """``path`` is a regular file holding one complete uncompressed tar that has ``members``.

    tarfile alone reads a tar cut short as a shorter valid one, so completeness is the
    end-of-archive marker found right after the last member.
    """
    st = _lstat_regular(path, "a tar file")
    wanted = {m.strip("/") for m in members}
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                name = m.name[2:] if m.name.startswith("./") else m.name
                wanted.discard(name.rstrip("/"))
            end = tf.offset
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BadEntry(f"{path}: not a readable tar ({e})") from None
    with open(path, "rb") as f:
        f.seek(end)
        if end + len(_END_OF_ARCHIVE) > st.st_size or f.read(len(_END_OF_ARCHIVE)) != _END_OF_ARCHIVE:
            raise BadEntry(f"{path}: truncated tar (no end-of-archive marker after byte {end} of {st.st_size})")
    if wanted:
        raise BadEntry(f"{path}: tar lacks {', '.join(sorted(wanted))}")


def check_executable(path: Path) -> None:
    """``path`` is a regular, executable ELF file."""
    st = _lstat_regular(path, "an executable")
    if not st.st_mode & 0o111:
        raise BadEntry(f"{path}: not executable (mode {stat.S_IMODE(st.st_mode):o})")
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF":
            raise BadEntry(f"{path}: not an ELF binary")


def check_file(path: Path, min_bytes: int = 1) -> None:
    """``path`` is a regular file of at least ``min_bytes``."""
    st = _lstat_regular(path, "a file")
    if st.st_size < min_bytes:
        raise BadEntry(f"{path}: {st.st_size} bytes, expected at least {min_bytes}")


def check_tree(path: Path, members: Iterable[str] = ()) -> None:
    """``path`` is a directory (not a symlink) in which every one of ``members`` exists."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BadEntry(f"{path}: missing") from None
    if not stat.S_ISDIR(st.st_mode):
        raise BadEntry(f"{path}: is {_kind(st.st_mode)}, not a directory")
    missing = [m for m in members if not os.path.lexists(path / m)]
    if missing:
        raise BadEntry(f"{path}: tree lacks {', '.join(missing)}")


def _identity(path: Path) -> tuple[str, int, int, int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _valid(path: Path, check: Check) -> str | None:
    """None when ``path`` passes ``check`` (remembered for this process), else why not."""
    ident = _identity(path)
    if ident is None:
        return "missing"
    if ident in _checked:
        return None
    try:
        check(path)
    except BadEntry as e:
        return str(e)
    _checked.add(ident)
    return None


def _remove(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or name.endswith(".lock"):
        raise ValueError(f"fixture cache entry name {name!r}: must be a plain file name, "
                         "not hidden and not ending in .lock")


def find(name: str, check: Check, *, root: Path | None = None) -> Path | None:
    """The entry ``NAME`` when it exists and passes ``check``, else None (nothing is built)."""
    _check_name(name)
    path = (root or cache_root()) / name
    return path if _valid(path, check) is None else None


def cached(name: str, build: Callable[[Path], object], check: Check, *, root: Path | None = None) -> Path:
    """The entry ``NAME`` under ``root`` (default: ``cache_root()``), built by ``build`` unless a valid one exists.

    ``build(out)`` must create ``out`` (a file or a directory; ``out.name == name``). The directory
    holding ``out`` is private to this build and removed afterwards: use it for scratch space.
    Exceptions from ``build`` propagate (after clean-up); output that fails ``check`` raises
    BuildError.
    """
    _check_name(name)
    root = root or cache_root()
    path = root / name
    if _valid(path, check) is None:
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        why = _valid(path, check)  # another process may have built it meanwhile
        if why is None:
            return path
        if why != "missing":
            print(f"weenv fixture cache: rebuilding, not trusting {why}", file=sys.stderr)
            _remove(path)
        for stale in root.glob(f".{name}.build-*"):  # left by killed builders: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        scratch = root / f".{name}.build-{os.getpid()}"
        scratch.mkdir()
        try:
            out = scratch / name
            build(out)
            try:
                check(out)
            except BadEntry as e:
                raise BuildError(f"building fixture {name!r}: the builder's output is not valid: {e}") from None
            os.replace(out, path)
            ident = _identity(path)
            if ident is not None:
                _checked.add(ident)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return path
