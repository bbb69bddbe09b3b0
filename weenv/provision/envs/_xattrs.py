"""The ``user.*`` extended attributes weenv's file API reads and writes (E2B's file metadata is
``user.e2b.*``), on descriptors the caller resolved inside the env's rootfs."""

from __future__ import annotations

import os

from .._errors import EnvFileError

USER_XATTR = "user."
MAX_XATTRS_BYTES = 64 << 10


def user_xattrs(fd: int) -> dict[str, str]:
    """The ``user.*`` extended attributes of the file ``fd`` holds (an ``O_PATH`` fd: through its
    /proc/self/fd link, which names that inode and nothing else), prefix dropped; {} for a symlink or
    a file system without them. Values that are not UTF-8 are skipped."""
    where = f"/proc/self/fd/{fd}"
    try:
        names = [n for n in os.listxattr(where) if n.startswith(USER_XATTR)]
    except OSError:
        return {}
    out: dict[str, str] = {}
    for n in names[:256]:
        try:
            out[n[len(USER_XATTR):]] = os.getxattr(where, n).decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    return out


def check_xattrs(xattrs: dict[str, str]) -> dict[str, str]:
    """``{NAME: value}`` to set as ``user.NAME`` (names without NUL or '/', 1-200 bytes; 64 KiB in all)."""
    if sum(len(k) + len(v) for k, v in xattrs.items()) > MAX_XATTRS_BYTES:
        raise EnvFileError(f"extended attributes of more than {MAX_XATTRS_BYTES} bytes")
    for k, v in xattrs.items():
        if not isinstance(k, str) or not isinstance(v, str) or not 0 < len(k.encode()) <= 200 or "\0" in k + v:
            raise EnvFileError(f"extended attribute {str(k)[:60]!r}: names of 1-200 bytes and values without NUL")
    return xattrs
