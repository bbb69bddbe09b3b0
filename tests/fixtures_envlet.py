"""Fixtures for the envlet: a real FUSE envlet process in a temp dir, and layer files to register."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from weenv import layerfmt
from weenv.envlet import EnvletProcess, LayerInfo, StoreSpec

from .fixtures_common import require_fuse


@dataclass
class BuiltLayer:
    path: str
    digest: str
    size: int
    toc_digest: str

    def register(self, envlet: EnvletProcess, **kw: object) -> LayerInfo:
        return envlet.client.register(StoreSpec("file", path=self.path), self.digest, self.size, self.toc_digest, **kw)


def build_layer_file(src: str, out: str, **kw: object) -> BuiltLayer:
    with open(out, "wb") as f:
        res = layerfmt.build_layer(src, f, **kw)
    with open(out, "rb") as f:
        assert "sha256:" + hashlib.file_digest(f, "sha256").hexdigest() == res.digest
    return BuiltLayer(out, res.digest, res.size, res.toc_digest)


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def mounts_under(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]


@pytest.fixture
def envlet_factory(tmp_path) -> Iterator[Callable[..., EnvletProcess]]:
    """Start envlets (real FUSE mounts) under tmp_path; all are stopped and unmounted afterwards."""
    require_fuse()
    started: list[EnvletProcess] = []

    def start(name: str = "e", **kw: object) -> EnvletProcess:
        base = tmp_path / name
        p = EnvletProcess(str(base / "mnt"), str(base / "cache"), str(base / "ctl.sock"), **kw)  # type: ignore[arg-type]
        started.append(p)
        return p.start()

    yield start
    for p in started:
        p.stop()
        p.kill()
    for m in mounts_under(str(tmp_path)):
        subprocess.run(["umount", "-l", m], capture_output=True)
    assert not mounts_under(str(tmp_path)), "envlet test left mounts behind"


@pytest.fixture
def envlet(envlet_factory) -> EnvletProcess:
    return envlet_factory()
