"""Fixtures every area uses: skips that print why, small tree builders."""

from __future__ import annotations

import os
import shutil

import pytest


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: this host runs the tests as uid %d" % os.geteuid())


def require_command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"needs {name!r} on PATH (apt package missing on this host)")
    return path


def require_fuse() -> None:
    require_root()
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse: this host has no FUSE device")
    require_command("fusermount3")
