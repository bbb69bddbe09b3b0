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


class FuzzStats:
    """Each fuzz target's examples and time, appended to ``$WEENV_FUZZ_STATS`` at the end of the
    module (docs/reliability.md, ``make soak``'s fuzz table)."""

    def __init__(self, module: str):
        self.module = module
        self.stats: dict[str, list] = {}

    def count(self, target: str, test: str) -> None:
        import time

        now = time.monotonic()
        s = self.stats.setdefault(target, [test, 0, now, now])
        s[1] += 1
        s[3] = now

    def write(self) -> None:
        import json

        path = os.environ.get("WEENV_FUZZ_STATS")
        if path:
            with open(path, "a") as f:
                for target, (test, n, t0, t1) in self.stats.items():
                    f.write(json.dumps({"target": target, "test": f"{self.module}::{test}", "examples": n,
                                        "duration_s": round(t1 - t0, 2)}) + "\n")
