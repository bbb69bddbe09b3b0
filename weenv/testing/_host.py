"""What the harness needs from the host, and the one error it raises when something is missing."""

from __future__ import annotations

import os
import shutil
import unittest


class HostUnsupported(unittest.SkipTest):
    """The host lacks something the harness needs (a tool on PATH, a libc feature).

    A :class:`unittest.SkipTest`, so pytest reports it as a skip carrying this message; a benchmark
    stops with it as a one-line error.
    """


def require_tool(name: str) -> str:
    """The path of ``name`` on PATH; :class:`HostUnsupported` when it is not there."""
    path = shutil.which(name)
    if path is None:
        raise HostUnsupported(f"needs {name!r} on PATH (apt package missing on this host)")
    return path


def require_root() -> None:
    """:class:`HostUnsupported` unless this process runs as root."""
    if os.geteuid() != 0:
        raise HostUnsupported(f"needs root: this host runs as uid {os.geteuid()}")


def require_fuse() -> None:
    """Root, /dev/fuse and fusermount3, or :class:`HostUnsupported`."""
    require_root()
    if not os.path.exists("/dev/fuse"):
        raise HostUnsupported("needs /dev/fuse: this host has no FUSE device")
    require_tool("fusermount3")
