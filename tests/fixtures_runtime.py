"""Fixtures for the container runtime: a busybox rootfs, env cgroups, a crun runtime that cleans
up after itself, and a helper that starts a real env.

``busybox_rootfs`` is for every area's tests: a fresh directory per test with busybox-static and
its applets linked relatively (``bin/<applet> -> busybox``), /etc/passwd and /etc/group with
``root`` (0) and an unprivileged ``user`` (1000, also in group ``wheel`` 10), /tmp mode 1777.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import trio

from tests.fixtures_cgroups import left_behind, require_v1_host, unique_root_name
from tests.fixtures_common import require_command, require_root

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
USER_UID = 1000
USER_GID = 1000

PASSWD = "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
GROUP = "root:x:0:\nwheel:x:10:user\nuser:x:1000:\nnogroup:x:65534:\n"


def _busybox() -> str:
    for p in BUSYBOX_CANDIDATES:
        if os.path.exists(p):
            out = subprocess.run(["file", "-L", p], capture_output=True, text=True).stdout if shutil.which("file") else ""
            if not out or "statically linked" in out or "static-pie" in out:
                return p
    pytest.skip("needs busybox-static (apt-get install busybox-static)")


def make_busybox_rootfs(root: str) -> str:
    """Build the rootfs at ``root`` (created). Returns ``root``."""
    busybox = _busybox()
    os.makedirs(root, exist_ok=True)
    for d in ("bin", "etc", "proc", "sys", "dev", "root", "home/user", "tmp", "var/tmp", "usr/bin", "sbin"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    shutil.copy2(busybox, os.path.join(root, "bin/busybox"))  # a copy: envs run as root could write it
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            os.symlink("busybox", os.path.join(root, "bin", applet))
    with open(os.path.join(root, "etc/passwd"), "w") as f:
        f.write(PASSWD)
    with open(os.path.join(root, "etc/group"), "w") as f:
        f.write(GROUP)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    os.chmod(os.path.join(root, "var/tmp"), 0o1777)
    os.chmod(os.path.join(root, "root"), 0o700)
    if os.geteuid() == 0:
        os.chown(os.path.join(root, "home/user"), USER_UID, USER_GID)
    return root


@pytest.fixture
def busybox_rootfs(tmp_path) -> str:
    """A fresh busybox rootfs directory for this test."""
    return make_busybox_rootfs(str(tmp_path / "rootfs"))


# -- crun ----------------------------------------------------------------------------------------


def runsc_skip_reason() -> str | None:
    """Why runsc cannot run here, or None: only a host that truly cannot run it skips."""
    from weenv.provision.runtime._hostcheck import detect_host

    if os.geteuid() != 0:
        return "needs root"
    host = detect_host()
    if host.runsc_path is None:
        return "runsc is not installed (apt-get install runsc)"
    if host.init_path is None:
        return "needs catatonit (apt-get install catatonit)"
    return None


def require_crun() -> None:
    require_root()
    require_command("crun")
    from weenv.provision.runtime._hostcheck import detect_host

    if detect_host().init_path is None:
        pytest.skip("needs catatonit (apt-get install catatonit): the env init")


def _leftover_processes(state_dir: str) -> list[str]:
    """Host processes still running from this runtime's containers (by their crun state dirs)."""
    out = []
    if not os.path.isdir(state_dir):
        return out
    for name in os.listdir(state_dir):
        try:
            with open(os.path.join(state_dir, name, "status")) as f:
                status = f.read()
        except OSError:
            continue
        out.append(f"{name}: {status[:200]}")
    return out


@pytest.fixture
def crun_runtime(tmp_path) -> Iterator:
    """A :class:`CrunRuntime` with its state under tmp_path; teardown force-deletes every
    container it still has and checks crun's state directory is empty."""
    require_crun()
    from weenv.provision.runtime._runtime import CrunRuntime

    runtime = CrunRuntime(str(tmp_path / "run"))
    try:
        yield runtime
    finally:

        async def cleanup() -> None:
            for st in await runtime.list():
                await runtime.delete(st.id, force=True)

        trio.run(cleanup)
        left = _leftover_processes(runtime.state_dir)
        assert not left, f"containers left behind: {left}"


@pytest.fixture
def env_cgroup(v1_backend):
    """A real v1 cgroup (memory, pids, cpu, cpuacct, freezer under this process's own groups)
    for one env, limits off; teardown kills what is left in it, removes it and checks it is gone
    from every hierarchy (naming those it is not), before the backend removes its parent."""
    group = v1_backend.create("env")
    yield group
    try:
        group.thaw()
    except Exception:
        pass  # a removed group or no freezer: the kill and the removal below still say what is wrong
    group.kill_all()
    group.remove(timeout_s=5.0)
    left = left_behind([os.path.dirname(p) for p in group.procs_paths()])
    assert not left, f"env cgroup left behind in {len(left)} hierarchies: {left}"


class EnvHandle:
    """One started env: its id, bundle, rootfs and the cgroup.procs paths to pass to exec."""

    def __init__(self, runtime, env_id: str, bundle: str, rootfs: str, cgroup_procs: list[str], init_pid: int):
        self.runtime = runtime
        self.env_id = env_id
        self.bundle = bundle
        self.rootfs = rootfs
        self.cgroup_procs = cgroup_procs
        self.init_pid = init_pid

    async def exec(self, argv, **kw):
        kw.setdefault("cgroup_procs", self.cgroup_procs)
        kw.setdefault("timeout_s", 30)
        return await self.runtime.exec(self.env_id, argv, **kw)

    async def sh(self, script: str, **kw):
        return await self.exec(["/bin/sh", "-c", script], **kw)


def userns_idmap():
    """The runtime tests run their envs in a user namespace, as the daemon does by default
    (docs/security.md, "User namespaces"); with WEENV_USERNS=0 without one, as ``--no-userns``."""
    from weenv.provision.runtime._idmap import IdMap

    return None if os.environ.get("WEENV_USERNS", "").strip().lower() in ("0", "false", "no", "off") else IdMap()


def _into_range(rootfs: str, idmap) -> None:
    """What the daemon's lowers look like: owners shifted into the range (once per rootfs), and
    every directory on the way traversable by the range's root."""
    if os.lstat(rootfs).st_uid < idmap.base:
        for top, dirs, files in os.walk(rootfs):
            for name in [*dirs, *files]:
                p = os.path.join(top, name)
                st = os.lstat(p)
                if st.st_uid < idmap.base:
                    os.lchown(p, idmap.host(st.st_uid), idmap.host(st.st_gid))
        st = os.lstat(rootfs)
        os.lchown(rootfs, idmap.host(st.st_uid), idmap.host(st.st_gid))
    p = os.path.dirname(os.path.abspath(rootfs))
    while p != "/":
        st = os.stat(p)
        if not st.st_mode & 0o001:  # others cannot walk it: the range's root group may
            os.chown(p, st.st_uid, idmap.base)
            os.chmod(p, (st.st_mode & 0o7777) | 0o010)
        p = os.path.dirname(p)


async def start_env(runtime, tmp_path, rootfs: str, *, env_id: str = "env1", cgroup=None, before_start=None,
                    **spec_options) -> EnvHandle:
    """Prepare a bundle next to ``rootfs``, create and start the env (``before_start(init_pid)``
    runs between the two)."""
    from weenv.provision.runtime._idmap import apply_userns, own_cgroups_only
    from weenv.provision.runtime._runtime import prepare_bundle

    bundle = str(tmp_path / f"bundle-{env_id}")
    os.makedirs(bundle, exist_ok=True)
    spec = prepare_bundle(bundle, env_id=env_id, rootfs=rootfs, host=runtime.host, **spec_options)
    idmap = userns_idmap()
    if idmap is not None:
        _into_range(rootfs, idmap)
        _into_range(os.path.join(bundle, "etc", "hosts"), idmap)
        spec = apply_userns(spec, idmap)
        if cgroup is not None:  # as the daemon does: the env's own groups, not crun's cgroup mount
            spec = own_cgroups_only(spec, [os.path.dirname(p) for p in cgroup.procs_paths()], "v1")
    procs = cgroup.procs_paths() if cgroup is not None else []
    pid = await runtime.create(env_id, bundle, rootfs, spec, procs)
    if before_start is not None:
        before_start(pid)
    await runtime.start(env_id)
    return EnvHandle(runtime, env_id, bundle, rootfs, procs, pid)


__all__ = [
    "EnvHandle",
    "make_busybox_rootfs",
    "require_crun",
    "require_v1_host",
    "runsc_skip_reason",
    "start_env",
    "unique_root_name",
]
