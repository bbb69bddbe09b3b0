"""A real registry for tests: Debian's docker-registry on 127.0.0.1, plus loopback proxies (the
harness itself, shared with the benchmarks, is weenv/testing/_registry.py).

Fixtures:
- ``registry`` (session): an open registry; ``.host`` ("127.0.0.1:PORT"), ``.url``, ``.storage_dir``.
- ``auth_registry`` (session): the same with htpasswd basic auth; ``.username`` / ``.password``.
- ``recording_proxy``: a proxy in front of ``registry`` that records ``(method, path, status)``.
- ``fault_proxy``: a proxy in front of ``registry`` whose faults a test schedules
  (``proxy.add_fault(Fault(...))``): 500s, 429 + Retry-After, reset mid-body, Range answered
  with 200, slow answers.

Processes are stopped by PID; temp dirs are removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from tests.fixtures_common import require_command, require_root
from weenv.testing import Fault, Proxy, ProxyLog, RegistryProcess, start_proxy, start_registry, stop_proxy
from weenv.testing import stop_registry


@pytest.fixture(scope="session")
def registry() -> Iterator[RegistryProcess]:
    workdir = tempfile.mkdtemp(prefix="weenv-registry-")
    reg = start_registry(workdir)
    try:
        yield reg
    finally:
        stop_registry(reg)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def auth_registry() -> Iterator[RegistryProcess]:
    workdir = tempfile.mkdtemp(prefix="weenv-registry-auth-")
    reg = start_registry(workdir, htpasswd=("weenv", "s3cret-pass"))
    try:
        yield reg
    finally:
        stop_registry(reg)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def recording_proxy(registry: RegistryProcess) -> Iterator[Proxy]:
    proxy = start_proxy(registry.host)
    try:
        yield proxy
    finally:
        stop_proxy(proxy)


@pytest.fixture
def fault_proxy(registry: RegistryProcess) -> Iterator[Proxy]:
    proxy = start_proxy(registry.host)
    try:
        yield proxy
    finally:
        stop_proxy(proxy)


@pytest.fixture
def weenv_home(tmp_path: "os.PathLike[str]", monkeypatch: pytest.MonkeyPatch) -> str:
    """A private $WEENV_HOME (embedded store, publish cache) for one test."""
    home = os.path.join(str(tmp_path), "weenv-home")
    os.makedirs(home)
    monkeypatch.setenv("WEENV_HOME", home)
    monkeypatch.delenv("WEENV_REGISTRY_USERNAME", raising=False)
    monkeypatch.delenv("WEENV_REGISTRY_PASSWORD", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", os.path.join(home, "docker-config"))
    return home


# ------------------------------------------------------------------------------------- images


def run_tool(*cmd: str) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p


def umoci_unpack(image: str, dest: str) -> str:
    run_tool("umoci", "unpack", "--image", image, dest)
    return os.path.join(dest, "rootfs")


@pytest.fixture(scope="session")
def busybox_oci() -> Iterator[str]:
    """An OCI layout ``DIR`` with tag ``bb``: three layers made by umoci from a busybox-static rootfs.

    Layer 0: the rootfs (applets as relative symlinks, a hardlink, files to delete later).
    Layer 1: deletes a file and a directory (whiteouts) and adds etc/new.
    Layer 2: re-creates the deleted directory with new content.
    """
    require_root()
    for tool in ("umoci", "skopeo", "busybox"):
        require_command(tool)
    work = tempfile.mkdtemp(prefix="weenv-bb-")
    try:
        layout = os.path.join(work, "oci")
        bundle = os.path.join(work, "bundle")
        run_tool("umoci", "init", "--layout", layout)
        run_tool("umoci", "new", "--image", f"{layout}:bb")
        run_tool("umoci", "unpack", "--image", f"{layout}:bb", bundle)
        rootfs = os.path.join(bundle, "rootfs")
        for d in ("bin", "etc", "tmp/cache", "var/lib/x", "srv/data"):
            os.makedirs(os.path.join(rootfs, d), exist_ok=True)
        shutil.copy2(shutil.which("busybox") or "/usr/bin/busybox", os.path.join(rootfs, "bin", "busybox"))
        for applet in ("sh", "ls", "cat", "echo"):
            os.symlink("busybox", os.path.join(rootfs, "bin", applet))
        with open(os.path.join(rootfs, "etc", "motd"), "w") as f:
            f.write("hi\n")
        os.link(os.path.join(rootfs, "etc", "motd"), os.path.join(rootfs, "etc", "motd.hard"))
        for rel in ("var/lib/x/gone", "tmp/cache/old", "srv/data/keep"):
            with open(os.path.join(rootfs, rel), "w") as f:
                f.write(rel)
        os.chmod(os.path.join(rootfs, "srv/data/keep"), 0o600)
        run_tool("umoci", "repack", "--image", f"{layout}:bb", bundle)
        shutil.rmtree(bundle)
        run_tool("umoci", "unpack", "--image", f"{layout}:bb", bundle)
        os.unlink(os.path.join(rootfs, "var/lib/x/gone"))
        shutil.rmtree(os.path.join(rootfs, "tmp/cache"))
        with open(os.path.join(rootfs, "etc", "new"), "w") as f:
            f.write("new\n")
        run_tool("umoci", "repack", "--image", f"{layout}:bb", bundle)
        shutil.rmtree(bundle)
        run_tool("umoci", "unpack", "--image", f"{layout}:bb", bundle)
        os.makedirs(os.path.join(rootfs, "tmp/cache"))
        with open(os.path.join(rootfs, "tmp/cache/fresh"), "w") as f:
            f.write("fresh\n")
        run_tool("umoci", "repack", "--image", f"{layout}:bb", bundle)
        run_tool("umoci", "config", "--image", f"{layout}:bb", "--config.env=FOO=bar", "--config.workingdir=/srv",
            "--config.user=1000:1000", "--config.cmd=/bin/sh", "--config.entrypoint=/bin/busybox")
        yield layout
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def busybox_reference(busybox_oci: str) -> Iterator[str]:
    """umoci's own unpack of the busybox image: the tree every import/export must reproduce."""
    work = tempfile.mkdtemp(prefix="weenv-bb-ref-")
    try:
        yield umoci_unpack(f"{busybox_oci}:bb", os.path.join(work, "b"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["Fault", "Proxy", "ProxyLog", "RegistryProcess", "start_proxy", "start_registry", "stop_proxy",
           "stop_registry", "run_tool", "umoci_unpack"]
