"""The gVisor runtime on real runsc: create, exec (exit codes, output, not found, timeout kill),
files written from the host and from the env, pause/resume through the freezer, cgroup
placement and limits, no network, refusals, the platform probe, and the router."""

from __future__ import annotations

import os
import time

import pytest
import trio

from tests.fixtures_runtime import require_crun, runsc_skip_reason, start_env
from weenv.provision._errors import ContainerError, ContainerNotFoundError, HostError, SpecError
from weenv.provision.runtime._hostcheck import detect_host


def run(fn, *args):
    return trio.run(fn, *args)


@pytest.fixture(scope="session")
def gvisor_platform(tmp_path_factory) -> str:
    reason = runsc_skip_reason()
    if reason:
        print(f"SKIP gVisor tests: {reason}")
        pytest.skip(reason)
    from weenv.provision.runtime._gvisor import HOST_CACHE_DIR, probe_platform

    host = detect_host()
    # the machine's answer, as every daemon keeps it (a fresh probe waits 5 s on the kvm platform
    # that hangs here; test_probe_reports_each_platform_and_caches probes afresh)
    cache = HOST_CACHE_DIR if os.access(HOST_CACHE_DIR, os.W_OK) else str(tmp_path_factory.mktemp("probe"))
    try:
        found = probe_platform(host.runsc_path, host.init_path, cache_dir=cache)
    except HostError as e:
        print(f"SKIP gVisor tests: {e}")
        pytest.skip(str(e))
    print(f"gVisor platform: {found.platform} ({found.results})")
    return found.platform


@pytest.fixture
def gvisor_runtime(tmp_path, gvisor_platform):
    from weenv.provision.runtime._gvisor import GvisorRuntime

    runtime = GvisorRuntime(str(tmp_path / "run"), platform=gvisor_platform)
    try:
        yield runtime
    finally:

        async def cleanup() -> None:
            for st in await runtime.list():
                await runtime.delete(st.id, force=True)

        # runsc delete finishes in the background of the trio run that killed the env; a run
        # that ends first leaves the state of a dead env, which the next delete removes at once
        for _ in range(3):
            run(cleanup)
        assert run(runtime.list) == []
        deadline = time.monotonic() + 5
        while _sandbox_pids(runtime) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _sandbox_pids(runtime), "gofer or sandbox processes left behind"


def _sandbox_pids(runtime) -> list[int]:
    """Host processes of runsc sandboxes/gofers under this runtime's state directory."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if runtime.state_dir.encode() in cmd:
                out.append(int(name))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


# -- platform probe ------------------------------------------------------------------------


def test_probe_reports_each_platform_and_caches(tmp_path, gvisor_platform):
    from weenv.provision.runtime._gvisor import PLATFORMS, probe_platform

    host = detect_host()
    found = probe_platform(host.runsc_path, host.init_path, cache_dir=str(tmp_path), timeout_s=5)
    assert found.platform in PLATFORMS and found.results[found.platform] == "ok"
    # every platform tried before the chosen one says why it was passed over
    for p in PLATFORMS[: PLATFORMS.index(found.platform)]:
        assert found.results[p] != "ok" and found.results[p]
    assert os.path.exists(tmp_path / "platform.json")
    again = probe_platform(host.runsc_path, host.init_path, cache_dir=str(tmp_path), kvm_device="/nonexistent")
    assert again == found  # from the cache: the kvm device is not looked at again


def test_probe_without_kvm_device_picks_ptrace(tmp_path, gvisor_platform):
    from weenv.provision.runtime._gvisor import probe_platform

    host = detect_host()
    found = probe_platform(host.runsc_path, host.init_path, kvm_device=str(tmp_path / "no-kvm"))
    assert found.platform == "ptrace" and "no " in found.results["kvm"]


# -- lifecycle, exec, files ------------------------------------------------------------------


def test_exec_exit_codes_output_stdin_and_not_found(gvisor_runtime, busybox_rootfs, tmp_path):
    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs)
        st = await gvisor_runtime.state(env.env_id)
        assert st.status == "running" and st.pid == env.init_pid
        r = await env.sh("echo out; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
        r = await env.exec(["cat"], stdin=b"hello\n" * 1000)
        assert r.exit_code == 0 and r.stdout == b"hello\n" * 1000
        # the plan's seccomp deny list is loaded into the sandbox for the init (--oci-seccomp)
        r = await env.sh("grep Seccomp: /proc/1/status")
        assert r.stdout.split() == [b"Seccomp:", b"2"], r.stdout
        r = await env.exec(["/no/such/binary"])
        assert r.exit_code == 127 and r.command_not_found and b"command not found" in r.stderr
        r = await env.sh("kill -9 $$")
        assert r.exit_code == 137
        # the env's boot id is its own (issue 29 item 5), not the node's
        r = await env.exec(["cat", "/proc/sys/kernel/random/boot_id"])
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            assert r.exit_code == 0 and len(r.stdout.strip()) == 36 and r.stdout != f.read(), r
        # the kernel the env sees is gVisor's, not the host's
        r = await env.exec(["dmesg"])
        assert b"gVisor" in r.stdout or b"Starting gVisor" in r.stdout, r.stdout[:300]
        r = await env.exec(["id", "-u"], user=__import__("weenv.provision.runtime._ocispec", fromlist=["User"]).User(uid=1000, gid=1000))
        assert r.stdout == b"1000\n"

    run(main)


def test_timeout_kills_the_command_tree_in_the_sandbox(gvisor_runtime, busybox_rootfs, tmp_path):
    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs)
        r = await env.sh("sleep 1001 & sleep 1002 & echo started; sleep 1004", timeout_s=1.0)
        assert r.timed_out and r.exit_code == 137 and r.stdout == b"started\n"
        ps = await env.exec(["ps", "-o", "pid,comm,args"])
        assert b"sleep 100" not in ps.stdout, ps.stdout

    run(main)


def test_files_cross_between_host_and_env_at_once(gvisor_runtime, busybox_rootfs, tmp_path):
    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs)
        # written by the env: on the host rootfs as soon as the exec returns (commit reads it there)
        r = await env.sh("echo from-env > /root/a; mkdir -p /tmp/d; echo tmp > /tmp/d/b")
        assert r.exit_code == 0
        assert open(os.path.join(busybox_rootfs, "root/a")).read() == "from-env\n"
        assert open(os.path.join(busybox_rootfs, "tmp/d/b")).read() == "tmp\n"  # /tmp is the rootfs's, not a tmpfs
        # written by the host (the files API writes the rootfs): seen by the env at once, also after a read
        r = await env.exec(["cat", "/root/a"])
        with open(os.path.join(busybox_rootfs, "root/a"), "w") as f:
            f.write("from-host\n")
        with open(os.path.join(busybox_rootfs, "root/new"), "w") as f:
            f.write("new\n")
        r = await env.sh("cat /root/a /root/new")
        assert r.stdout == b"from-host\nnew\n"
        os.unlink(os.path.join(busybox_rootfs, "root/new"))
        r = await env.sh("test -e /root/new; echo $?")
        assert r.stdout == b"1\n"

    run(main)


# -- cgroups, freezer, network ----------------------------------------------------------------


def test_sandbox_is_born_in_the_env_cgroups_and_limits_apply(gvisor_runtime, busybox_rootfs, tmp_path, env_cgroup):
    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs, cgroup=env_cgroup)
        in_group = set(env_cgroup.pids())
        sandbox = set(_sandbox_pids(gvisor_runtime))
        assert sandbox and sandbox <= in_group, (sandbox, in_group)  # gofer and sentry both
        before = env_cgroup.sample().memory_usage_bytes
        r = await env.sh("dd if=/dev/zero of=/dev/shm/x bs=1M count=64 2>/dev/null; echo ok")
        assert r.stdout == b"ok\n"
        assert env_cgroup.sample().memory_usage_bytes > before + (48 << 20)  # the env's memory is charged here
        env_cgroup.set_pids(len(env_cgroup.pids()) + 3)
        # a thread/process bomb in the sandbox stays within the host-side pids limit
        r = await env.sh("for i in 1 2 3 4 5 6 7 8; do sleep 30 & done; echo spawned", timeout_s=10)
        assert len(env_cgroup.pids()) <= len(in_group) + 3 + 3
        env_cgroup.set_pids(None)

    run(main)


def test_pause_resume_through_the_freezer(gvisor_runtime, busybox_rootfs, tmp_path, env_cgroup):
    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs, cgroup=env_cgroup)
        r = await env.sh("sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/tick; usleep 10000; done' >/dev/null 2>&1 &")
        assert r.exit_code == 0
        await trio.sleep(0.3)
        tick = os.path.join(busybox_rootfs, "tmp/tick")
        await trio.to_thread.run_sync(env_cgroup.freeze)
        assert env_cgroup.is_frozen()
        frozen_at = open(tick).read()
        await trio.sleep(0.5)
        assert open(tick).read() == frozen_at  # nothing in the sandbox runs
        await trio.to_thread.run_sync(env_cgroup.thaw)
        await trio.sleep(0.3)
        assert open(tick).read() != frozen_at
        r = await env.exec(["true"])
        assert r.exit_code == 0

    run(main)


def test_no_network_only_the_sandbox_loopback(gvisor_runtime, busybox_rootfs, tmp_path):
    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs)
        r = await env.sh("ip -o link 2>&1; ip -o addr 2>&1")
        links = [ln for ln in r.stdout.decode().splitlines() if ": " in ln and "link/" in ln]
        assert all(": lo:" in ln for ln in links), r.stdout
        r = await env.sh("wget -q -T 2 -O- http://127.0.0.1:1/ 2>&1; nc -w 2 10.0.2.2 80 </dev/null 2>&1; echo rc=$?",
                         timeout_s=20)
        assert b"rc=0" not in r.stdout

    run(main)


def test_refuses_what_gvisor_cannot_do(gvisor_runtime, busybox_rootfs, tmp_path):
    async def main():
        with pytest.raises(SpecError, match="not available under gVisor"):
            await start_env(gvisor_runtime, tmp_path, busybox_rootfs, env_id="h1", network="host")
        with pytest.raises(ContainerError, match="no in-env agent"):
            await gvisor_runtime.create("a1", str(tmp_path), busybox_rootfs, {}, listen_fd=3)
        with pytest.raises(ContainerNotFoundError):
            await gvisor_runtime.exec("nosuch", ["true"])

    run(main)


def test_a_new_runtime_readopts_running_envs(gvisor_runtime, busybox_rootfs, tmp_path):
    from weenv.provision.runtime._gvisor import GvisorRuntime

    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs)
        again = GvisorRuntime(os.path.dirname(gvisor_runtime.state_dir), platform=gvisor_runtime.platform)
        assert [s.id for s in await again.list()] == [env.env_id]
        r = await again.exec(env.env_id, ["echo", "hi"])
        assert r.stdout == b"hi\n"

    run(main)


def test_router_runs_crun_and_gvisor_envs_side_by_side(gvisor_runtime, busybox_rootfs, tmp_path):
    require_crun()
    from weenv.provision.runtime._gvisor import ANNOTATION_RUNTIME, RuntimeRouter
    from weenv.provision.runtime._runtime import CrunRuntime, prepare_bundle
    from tests.fixtures_runtime import make_busybox_rootfs

    crun = CrunRuntime(str(tmp_path / "crun-run"))
    router = RuntimeRouter({"crun": crun, "gvisor": gvisor_runtime}, default="crun")

    async def main():
        for env_id, name in (("c1", None), ("g1", "gvisor")):
            rootfs = make_busybox_rootfs(str(tmp_path / f"rootfs-{env_id}"))
            bundle = str(tmp_path / f"bundle-{env_id}")
            os.makedirs(bundle)
            spec = prepare_bundle(bundle, env_id=env_id, rootfs=rootfs, host=crun.host,
                                  annotations={ANNOTATION_RUNTIME: name} if name else None)
            await router.create(env_id, bundle, rootfs, spec)
            await router.start(env_id)
        c = await router.exec("c1", ["dmesg"])
        g = await router.exec("g1", ["dmesg"])
        assert b"gVisor" in g.stdout and b"gVisor" not in c.stdout
        assert sorted(s.id for s in await router.list()) == ["c1", "g1"]
        fresh = RuntimeRouter({"crun": crun, "gvisor": gvisor_runtime}, default="crun")
        assert (await fresh.exec("g1", ["echo", "x"])).stdout == b"x\n"  # found by asking each runtime
        for env_id in ("c1", "g1"):
            await router.delete(env_id)
        assert await router.list() == []
        with pytest.raises(HostError, match="unknown runtime"):
            router.get("kata")

    run(main)


# -- the plan field ------------------------------------------------------------------------------


def test_plan_runtime_field_and_its_refusals():
    from weenv.plan import PlanValidationError, load_text

    base = 'name = "p"\n[[groups]]\nname = "os"\nref = "localhost:5000/os:1"\nclass = "os"\n'
    assert load_text(base).runtime is None  # the node's default
    assert load_text('runtime = "gvisor"\n' + base).runtime == "gvisor"
    with pytest.raises(PlanValidationError, match=r"runtime.*'crun', 'gvisor'|runtime.*crun.*gvisor"):
        load_text('runtime = "kata"\n' + base)
    with pytest.raises(PlanValidationError, match=r"runtime.*cannot have network = 'host'"):
        load_text('runtime = "gvisor"\nnetwork = "host"\n' + base)
    assert load_text('runtime = "gvisor"\nnetwork = "loopback"\n' + base).network == "loopback"


def test_a_gvisor_plan_whose_disk_its_memory_cannot_hold_is_refused_naming_both():
    # gVisor keeps what an env writes in the sandbox's memory: 240 MiB of files at a 256 MiB max
    # killed the sandbox (224 MiB ran on); such a plan is refused, not started to die
    from weenv.plan import PlanValidationError, apply_overrides, load_text

    base = 'name = "p"\n[[groups]]\nname = "os"\nref = "localhost:5000/os:1"\nclass = "os"\n'
    sized = base + '[resources]\ndisk = "{disk}"\n[resources.memory]\nmin = "64MiB"\nmax = "256MiB"\n'
    assert load_text('runtime = "gvisor"\n' + sized.format(disk="224MiB")).resources.disk == 224 << 20
    assert load_text(sized.format(disk="1GiB")).resources.disk == 1 << 30  # crun: disk is on the host disk
    assert load_text('runtime = "gvisor"\n' + base).runtime == "gvisor"  # defaults: 1 GiB disk, 2 GiB max
    with pytest.raises(PlanValidationError) as refused:
        load_text('runtime = "gvisor"\n' + sized.format(disk="240MiB"))
    text = str(refused.value)
    assert "resources.disk" in text and "240MiB" in text and "256MiB" in text and "(here 224MiB)" in text, text
    fits = load_text('runtime = "gvisor"\n' + sized.format(disk="200MiB"))
    with pytest.raises(PlanValidationError, match=r"resources\.disk.*memory max 128MiB"):
        apply_overrides(fits, memory="128MiB")  # an override that shrinks memory under the disk
    assert apply_overrides(fits, memory="1GiB").resources.memory.max == 1 << 30


# -- paths runsc takes: a rootfs under a directory the env's root cannot walk (issue 26 item 4) ------


def _private_dir(path) -> str:
    """A directory only root may walk, as ``mktemp -d`` makes (or /root)."""
    os.makedirs(path)
    os.chown(path, 0, 0)
    os.chmod(path, 0o700)
    return str(path)


# where runsc's own mount namespace shows it rootfs and bundle (RUNSC_VIEW_DIR): never the host's
VIEW_DIR = "/run/weenv-gvisor"


def _mounts_naming(*paths: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.strip() for line in f if any(p in line for p in paths)]


def test_the_spec_names_rootfs_and_bundle_as_runsc_sees_them():
    from weenv.provision.runtime._gvisor import RUNSC_VIEW_DIR, range_root, runsc_view_spec

    assert RUNSC_VIEW_DIR == VIEW_DIR

    spec = {"root": {"path": "/h/envs/e/rootfs", "readonly": False},
            "linux": {"uidMappings": [{"containerID": 0, "hostID": 1 << 30, "size": 65536}],
                      "gidMappings": [{"containerID": 0, "hostID": (1 << 30) + 5, "size": 65536}]},
            "mounts": [{"destination": "/tmp", "type": "bind", "source": "/h/envs/e/rootfs/tmp"},
                       {"destination": "/etc/hosts", "type": "bind", "source": "/h/envs/e/bundle/etc/hosts"},
                       {"destination": "/data", "type": "bind", "source": "/srv/data"},
                       {"destination": "/x", "type": "bind", "source": "/h/envs/e/bundle-other/x"},
                       {"destination": "/proc", "type": "proc", "source": "proc"}]}
    seen = runsc_view_spec(spec, "/h/envs/e/rootfs", "/h/envs/e/bundle", "/run/v")
    assert seen["root"] == {"path": "/run/v/rootfs", "readonly": False}
    assert [m["source"] for m in seen["mounts"]] == [
        "/run/v/rootfs/tmp", "/run/v/bundle/etc/hosts", "/srv/data", "/h/envs/e/bundle-other/x", "proc"]
    assert spec["root"]["path"] == "/h/envs/e/rootfs"  # the caller's spec is left as it was
    # a rootfs inside the bundle (as the platform probe lays it out) is the rootfs's view, not the bundle's
    inner = runsc_view_spec({"root": {"path": "/b/rootfs"}, "mounts": [
        {"type": "bind", "source": "/b/rootfs/tmp", "destination": "/tmp"}]}, "/b/rootfs", "/b", "/run/v")
    assert inner["mounts"][0]["source"] == "/run/v/rootfs/tmp"
    assert range_root(spec) == (1 << 30, (1 << 30) + 5) and range_root({}) == (0, 0)


def test_a_rootfs_and_bundle_under_a_private_directory_run(gvisor_runtime, tmp_path):
    """runsc's gofer opens the rootfs as the env's root (host uid 1073741824) and runsc takes
    absolute paths only, so a 0700 directory above them failed every create ("cannot read client
    sync file: waiting for sandbox to start: EOF"). runsc now sees them in a mount namespace of its
    own; the directory stays 0700 root's, and no mount is left anywhere."""
    from tests.fixtures_runtime import make_busybox_rootfs, userns_idmap
    from weenv.provision.runtime._idmap import apply_userns
    from weenv.provision.runtime._runtime import prepare_bundle

    idmap = userns_idmap()
    if idmap is None:
        pytest.skip("WEENV_USERNS=0: the gofer runs as host root and walks every directory")
    private = _private_dir(tmp_path / "private")
    rootfs = make_busybox_rootfs(os.path.join(private, "rootfs"))
    for top, dirs, files in os.walk(rootfs):  # the owners the daemon's lowers have; nothing above is opened
        for name in [".", *dirs, *files]:
            p = os.path.join(top, name)
            st = os.lstat(p)
            if st.st_uid < idmap.base:
                os.lchown(p, idmap.host(st.st_uid), idmap.host(st.st_gid))
    bundle = os.path.join(private, "bundle")
    os.makedirs(bundle)
    spec = apply_userns(prepare_bundle(bundle, env_id="p1", rootfs=rootfs, host=gvisor_runtime.host), idmap)

    async def main():
        await gvisor_runtime.create("p1", bundle, rootfs, spec)
        await gvisor_runtime.start("p1")
        assert _mounts_naming(VIEW_DIR) == []  # runsc's view was never the host's
        r = await gvisor_runtime.exec("p1", ["sh", "-c", "echo hi > /root/x; cat /etc/hostname; id -u"], timeout_s=30)
        assert (r.exit_code, r.stdout) == (0, b"p1\n0\n"), r  # /etc/hostname: bound from the bundle
        assert open(os.path.join(rootfs, "root", "x")).read() == "hi\n"
        await gvisor_runtime.delete("p1")

    run(main)
    st = os.stat(private)
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o700, 0, 0)
    assert _mounts_naming(private, VIEW_DIR) == []


def test_a_bind_source_the_env_root_cannot_reach_is_named_with_the_fix(gvisor_runtime, busybox_rootfs, tmp_path):
    """A plan mount keeps its own path: one below a directory the env's root cannot walk is refused
    naming that directory and how to let it through, not with runsc's opaque EOF."""
    from tests.fixtures_runtime import userns_idmap
    from weenv.provision.runtime._ocispec import BindMount

    idmap = userns_idmap()
    if idmap is None:
        pytest.skip("WEENV_USERNS=0: the gofer runs as host root and walks every directory")
    private = _private_dir(tmp_path / "private-data")
    data = os.path.join(private, "data")
    os.makedirs(data)

    async def main():
        with pytest.raises(ContainerError) as refused:
            await start_env(gvisor_runtime, tmp_path, busybox_rootfs, env_id="m1",
                            bind_mounts=[BindMount(source=data, destination="/data")])
        msg = str(refused.value)
        assert f"cannot reach {data}" in msg and f"stopped at {private}" in msg, msg
        assert f"setfacl -m u:{idmap.base}:x {private}" in msg and f"chmod o+x {private}" in msg, msg
        assert busybox_rootfs not in msg  # the rootfs reaches runsc through its own view
        assert await gvisor_runtime.list() == []
        st = os.stat(private)
        assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o700, 0, 0)  # told, never changed
        # the fix it names works: the env's root, and no one else, may walk through
        _allow_walk(private, idmap.base)
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs, env_id="m2",
                              bind_mounts=[BindMount(source=data, destination="/data", readonly=True)])
        r = await env.sh("cat /data/f; echo x > /data/f")
        assert (r.stdout, r.exit_code) == (b"plan\n", 1) and b"Read-only" in r.stderr, r

    with open(os.path.join(data, "f"), "w") as f:
        f.write("plan\n")
    run(main)


def _allow_walk(path: str, uid: int) -> None:
    """``setfacl -m u:<uid>:x path`` (no setfacl here): a POSIX ACL, user::rwx user:<uid>:--x
    group::--- mask::--x other::---."""
    import struct

    entries = [(0x01, 7, 0xFFFFFFFF), (0x02, 1, uid), (0x04, 0, 0xFFFFFFFF), (0x10, 1, 0xFFFFFFFF), (0x20, 0, 0xFFFFFFFF)]
    os.setxattr(path, "system.posix_acl_access",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, i) for tag, perm, i in entries))


# -- through a real daemon: plan runtime = "gvisor" ----------------------------------------------


def _in_gvisor(env) -> bool:
    """gVisor's kernel says it is Linux 4.4.0; the host's is what os.uname says."""
    release = env.exec(["uname", "-r"]).stdout.strip().decode()
    return release != os.uname().release and release == "4.4.0"


def _gvisor_lock(daemon, tmp_path, extra: str = "") -> str:
    text = open(daemon.plan_lock).read()
    path = tmp_path / "gvisor.lock.toml"
    path.write_text(f'runtime = "gvisor"\n{extra}' + text)
    return str(path)


def test_the_daemon_refuses_a_gvisor_create_whose_memory_override_cannot_hold_its_disk(daemon, tmp_path,
                                                                                       gvisor_platform):
    import weenv

    lock = _gvisor_lock(daemon, tmp_path)  # disk 64 MiB, memory max 512 MiB
    with daemon.client() as c:
        with pytest.raises(weenv.ApiError) as refused:
            c.create(lock, memory="80MiB")
        assert refused.value.status == 400, refused.value
        assert "resources.disk" in str(refused.value) and "80MiB" in str(refused.value), refused.value
        assert c.list() == []  # nothing started
        env = c.create(lock, memory="96MiB")  # 64 MiB + 32 MiB fits
        env.kill()


def test_daemon_runs_a_gvisor_env_like_any_other(daemon, tmp_path, gvisor_platform):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c:
        env = c.create(lock)
        gv_id = env.id
        r = env.exec(["sh", "-c", "echo out; echo err >&2; hostname; exit 7"])
        assert (r.exit_code, r.stdout, r.stderr) == (7, b"out\n" + env.id.encode() + b"\n", b"err\n")
        assert _in_gvisor(env)  # really in the sandbox
        assert env.exec(["id", "-u"], user="user").stdout == b"1000\n"
        assert env.exec(["pwd"], cwd="/tmp").stdout == b"/tmp\n"
        # files both ways
        env.write_file("/work/a.txt", "hello\n")
        assert env.exec(["cat", "/work/a.txt"]).stdout == b"hello\n"
        env.exec(["sh", "-c", "echo from-env > /work/b.txt"])
        assert env.read_file("/work/b.txt") == b"from-env\n"
        # pause/resume
        env.pause()
        assert c.get(env.id).info["status"] == "paused"
        env.resume()
        assert env.exec(["true"]).exit_code == 0
        # commit and fork: the children are gVisor envs too and see the parent's files
        env.exec(["sh", "-c", "echo committed > /root/state"])
        children = env.fork(2)
        try:
            for child in children:
                assert child.exec(["cat", "/root/state"]).stdout == b"committed\n"
                assert _in_gvisor(child)
        finally:
            for child in children:
                child.kill()
        # a crun env next to it on the same daemon
        with c.create(daemon.plan_lock) as plain:
            assert not _in_gvisor(plain)
        # no process handles under gVisor: a clear refusal, not a hang
        with pytest.raises(Exception, match="not available under gVisor"):
            env.spawn(["sleep", "1"])
        env.kill()
    assert gv_id


def test_a_gvisor_envs_memory_is_its_max_from_the_start(daemon, tmp_path, gvisor_platform):
    """Promise: a gVisor env holds its plan's memory max from its first command (64-512 MiB here;
    a crun env beside it starts at its min): a write burst well over the min, which killed the
    sandbox at an elastic 64 MiB limit, just runs."""
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env, c.create(daemon.plan_lock) as plain:
        memory = {e.id: c.get(e.id).info["resources"]["memory"] for e in (env, plain)}
        assert memory[env.id]["limit_bytes"] == 512 << 20 and memory[env.id]["hard"] is False, memory
        assert memory[plain.id]["limit_bytes"] == 64 << 20, memory
        r = env.exec(["sh", "-c", "dd if=/dev/zero of=/tmp/burst bs=1M count=48 2>/dev/null && echo done"],
                     timeout_s=30)
        assert (r.exit_code, r.stdout) == (0, b"done\n"), r
        assert env.exec(["echo", "alive"]).stdout == b"alive\n"


def test_daemon_refuses_gvisor_with_host_network(daemon, tmp_path, gvisor_platform):
    import weenv

    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c:
        with pytest.raises(weenv.ApiError, match="not available under gVisor|cannot have network"):
            c.create(lock, network="host")


# -- routing logic (pure) --------------------------------------------------------------------------


def test_plan_runtime_and_start_cpu_hint_logic():
    from weenv.provision.runtime._gvisor import ANNOTATION_RUNTIME, RuntimeRouter, plan_runtime, start_cpu_hint
    from weenv.testing import FakeRuntime

    class FakeGvisor(FakeRuntime):
        name = "gvisor"
        supports_agent = False

    router = RuntimeRouter({"crun": FakeRuntime(), "gvisor": FakeGvisor()}, default="crun")
    assert plan_runtime(router, None) == ({ANNOTATION_RUNTIME: "crun"}, True)
    assert plan_runtime(router, "gvisor") == ({ANNOTATION_RUNTIME: "gvisor"}, False)  # no agent under gVisor
    with pytest.raises(HostError, match="unknown runtime 'kata'"):
        plan_runtime(router, "kata")
    # a daemon given one plain runtime runs only that kind
    assert plan_runtime(FakeRuntime(), "crun") == ({}, True)
    with pytest.raises(HostError, match='runtime = "gvisor": this daemon runs only crun'):
        plan_runtime(FakeRuntime(), "gvisor")
    # gVisor envs start at a core (clamped to the plan's range later), crun envs as they were asked
    assert start_cpu_hint({ANNOTATION_RUNTIME: "crun"}, None) is None
    assert start_cpu_hint({ANNOTATION_RUNTIME: "crun"}, 0.5) == 0.5
    assert start_cpu_hint({ANNOTATION_RUNTIME: "gvisor"}, None) == 1.0
    assert start_cpu_hint({ANNOTATION_RUNTIME: "gvisor"}, 2.0) == 2.0


def test_an_env_over_its_hard_memory_limit_dies_whole_and_exec_says_so(gvisor_runtime, busybox_rootfs, tmp_path,
                                                                     env_cgroup):
    """Under gVisor the kernel's OOM kill picks the sandbox (it holds all of the env's memory): the
    env ends, and the exec that was running raises instead of returning runsc's words as output."""

    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs, cgroup=env_cgroup)
        env_cgroup.set_memory(128 << 20)  # hard: no elastic headroom, the OOM killer on
        with pytest.raises(ContainerError, match="sandbox died"):
            await env.sh("""awk 'BEGIN{s=sprintf("%300000000s",""); print length(s)}'""", timeout_s=60)
        assert (await gvisor_runtime.state(env.env_id)).status == "stopped"

    run(main)


def test_a_node_whose_default_is_gvisor_runs_plans_that_name_no_runtime_there(monkeypatch, gvisor_platform):
    import tempfile

    import weenv

    from tests.fixtures_daemon import DaemonHandle, busybox_plan, teardown_private_daemon

    home = tempfile.mkdtemp(prefix="weenv-gvdefault-")
    plan, lock = busybox_plan(home, "gvdefault")
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-gvdefault-{os.getpid()}", lock, plan,
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    monkeypatch.setenv("WEENV_RUNTIME", "gvisor")  # what weenv daemon --runtime gvisor sets
    d.start()
    try:
        with d.client() as c:
            with c.create(lock) as env:
                assert _in_gvisor(env)
            crun_lock = os.path.join(home, "crun.lock.toml")
            with open(crun_lock, "w") as f:
                f.write('runtime = "crun"\n' + open(lock).read())
            with c.create(crun_lock) as env:  # a plan that names crun still gets it
                assert not _in_gvisor(env)
            # a plan naming no runtime runs under gVisor here: its disk must fit its memory max too
            with pytest.raises(weenv.ApiError) as refused:
                c.create(lock, memory="80MiB")  # disk 64 MiB + 32 MiB does not fit
            assert refused.value.status == 400, refused.value
            assert "resources.disk" in str(refused.value) and "default runtime" in str(refused.value), refused.value
            with c.create(crun_lock, memory="80MiB") as env:  # under crun the disk is the host's
                assert not _in_gvisor(env)
            assert c.list() == []
    finally:
        left = teardown_private_daemon(d)
    assert not left, left


# -- the runtime seam's conformance suite, on gVisor ------------------------------------------------


@pytest.fixture
def gvisor_harness(gvisor_runtime, tmp_path):
    from tests.fixtures_runtime import make_busybox_rootfs
    from tests.test_runtime import Harness

    return Harness("gvisor", gvisor_runtime, tmp_path, make_busybox_rootfs(str(tmp_path / "rootfs")))


def test_conformance_exec_on_gvisor(gvisor_harness):
    from tests.test_runtime import test_conformance_exec

    test_conformance_exec(gvisor_harness)


def test_conformance_exec_before_start_and_after_stop_fail_on_gvisor(gvisor_harness):
    from tests.test_runtime import test_conformance_exec_before_start_and_after_stop_fail

    test_conformance_exec_before_start_and_after_stop_fail(gvisor_harness)


def test_conformance_lifecycle_on_gvisor(gvisor_harness):
    """As the seam's lifecycle test, but for the one documented difference: create already lets the
    init run (runsc run --detach), so the env is "running" before start; exec still waits for start."""
    from weenv.provision._errors import ContainerExistsError

    rt = gvisor_harness.runtime

    async def main():
        pid = await gvisor_harness.create("c1")
        assert pid > 0
        st = await rt.state("c1")
        assert (st.id, st.status, st.pid) == ("c1", "running", pid)
        with pytest.raises(ContainerError, match="not started"):
            await rt.exec("c1", ["true"])
        await rt.start("c1")
        assert [s.id for s in await rt.list()] == ["c1"]
        with pytest.raises(ContainerExistsError):
            await gvisor_harness.create("c1")
        await gvisor_harness.create("c3")
        t0 = time.monotonic()
        await rt.delete("c3")  # running: killed, and back once sandbox and gofer exited
        assert time.monotonic() - t0 < 1.0  # not after runsc delete's wait for PID 1 to reap (~2 s here)
        assert not [p for p in _sandbox_pids(rt) if _cmdline(p).endswith(b"\0c3\0") or b"bundle-c3" in _cmdline(p)]  # its sandbox and gofer are gone
        await rt.kill("c1", 9)
        with trio.fail_after(10):
            while (await rt.state("c1")).status != "stopped":
                await trio.sleep(0.01)
        await rt.delete("c1")
        await rt.delete("c1")  # idempotent
        with pytest.raises(ContainerNotFoundError):
            await rt.state("c1")
        assert await rt.list() == []

    run(main)


def test_daemon_sigkill_then_restart_readopts_gvisor_envs(daemon, tmp_path, gvisor_platform):
    from weenv.testing import leftovers

    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c:
        live = c.create(lock)
        live.exec(["sh", "-c", "echo kept > /tmp/state"])
        paused = c.create(lock)
        paused.pause()
    daemon.kill9()
    daemon.start()
    with daemon.client() as c:
        assert {e["id"]: e["status"] for e in c.list()} == {live.id: "running", paused.id: "paused"}
        env = c.get(live.id)
        assert env.exec(["cat", "/tmp/state"]).stdout == b"kept\n"
        assert _in_gvisor(env)
        c.get(paused.id).resume()
        assert c.get(paused.id).exec(["true"]).exit_code == 0
        env.kill()
        c.get(paused.id).kill()
    assert leftovers(daemon) == []


def test_a_daemon_whose_home_is_under_a_private_directory_runs_gvisor_envs(gvisor_platform):
    """Issue 26 item 4: $WEENV_HOME under a 0700 directory (``mktemp -d``, /root/...). Every gVisor
    create failed with runsc's "cannot read client sync file: waiting for sandbox to start: EOF"
    while crun envs worked; both work now, and the directory above the home is left as it was."""
    import shutil
    import tempfile

    from tests.fixtures_daemon import DaemonHandle, busybox_plan, teardown_private_daemon

    require_crun()
    parent = tempfile.mkdtemp(prefix="weenv-private-")  # 0700 root's
    home = os.path.join(parent, "home")
    os.mkdir(home)
    plan, lock = busybox_plan(home, "private")
    home_mode = (os.stat(home).st_mode & 0o7777, 0, 0)
    gvisor_lock = os.path.join(home, "gvisor.lock.toml")
    with open(gvisor_lock, "w") as f:
        f.write('runtime = "gvisor"\n' + open(lock).read())
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-private-{os.getpid()}", lock, plan,
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    try:
        with d.client() as c:
            with c.create(gvisor_lock) as env:
                assert _in_gvisor(env)
                r = env.exec(["sh", "-c", "echo kept > /tmp/a; cat /tmp/a; hostname"])
                assert (r.exit_code, r.stdout) == (0, b"kept\n" + env.id.encode() + b"\n"), r
                assert env.read_file("/tmp/a") == b"kept\n"
                # runsc reads its view: neither the home nor envs/ is opened to the range
                hs, es = os.stat(home), os.stat(os.path.join(home, "envs"))
                assert (hs.st_mode & 0o7777, hs.st_uid, hs.st_gid) == home_mode, home
                assert (es.st_mode & 0o7777, es.st_uid, es.st_gid) == (0o700, 0, 0)
            with c.create(lock) as env:  # a crun env in the same home
                assert not _in_gvisor(env)
                assert env.exec(["echo", "crun"]).stdout == b"crun\n"
    finally:
        left = teardown_private_daemon(d)
        st = os.stat(parent)
        mounts = _mounts_naming(parent, VIEW_DIR)
        shutil.rmtree(parent, ignore_errors=True)
    assert not left, left
    assert not mounts, mounts
    assert (st.st_mode & 0o7777, st.st_uid) == (0o700, 0)
