"""The runtime layer: the OCI spec (pure), host detection, a conformance suite run against the
fake and real crun, and crun-only behaviour (process-tree kill, cgroup placement, streaming,
users, network modes, re-adoption after a restart)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import trio

from tests.fixtures_runtime import make_busybox_rootfs, require_crun, start_env
from weenv.provision._errors import ContainerError, ContainerExistsError, ContainerNotFoundError, SpecError
from weenv.provision._errors import UserNotFoundError
from weenv.provision.envs._fileops import resolve_user
from weenv.provision.runtime._hostcheck import HostFacts, bind_unified_controllers_to_v1, detect_host, unbind_v1_controllers
from weenv.provision.runtime._ocispec import DEFAULT_CAPABILITIES, DENIED_SYSCALLS, INIT_ARGS, INIT_PATH
from weenv.provision.runtime._ocispec import BindMount, User, build_spec, default_seccomp, merge_env, parse_user
from weenv.provision.runtime._ocispec import render_etc_files
from weenv.provision.runtime._runtime import CrunRuntime, kill_exec_tree
from weenv.testing import FakeRuntime


def run(fn, *args):
    return trio.run(fn, *args)


# -- the spec (pure) ---------------------------------------------------------------------------


def _spec(**kw):
    base = dict(env_id="e1", rootfs="/r", init_path="/usr/bin/catatonit", etc_dir="/b/etc")
    base.update(kw)
    return build_spec(**base)


def test_spec_isolation_defaults():
    s = _spec()
    linux = s["linux"]
    assert {n["type"] for n in linux["namespaces"]} == {"pid", "network", "ipc", "uts", "mount", "cgroup"}
    assert "resources" not in linux and "cgroupsPath" not in linux  # weenv owns the cgroups
    assert s["hostname"] == "e1"
    p = s["process"]
    assert p["noNewPrivileges"] is True
    assert p["args"] == list(INIT_ARGS)
    caps = p["capabilities"]
    assert caps["bounding"] == list(DEFAULT_CAPABILITIES) == caps["effective"]
    assert "CAP_MKNOD" not in caps["bounding"] and "CAP_NET_RAW" not in caps["bounding"]
    assert "CAP_SYS_ADMIN" not in caps["bounding"] and caps["ambient"] == []
    assert "/proc/kcore" in linux["maskedPaths"] and "/proc/sys" in linux["readonlyPaths"]
    denied = linux["seccomp"]["syscalls"][0]["names"]
    for name in ("mount", "ptrace", "bpf", "kexec_load", "init_module", "keyctl", "perf_event_open"):
        assert name in denied
    dests = {m["destination"]: m for m in s["mounts"]}
    assert dests[INIT_PATH]["source"] == "/usr/bin/catatonit" and "ro" in dests[INIT_PATH]["options"]
    for name in ("hosts", "hostname", "resolv.conf"):
        assert dests[f"/etc/{name}"]["source"] == f"/b/etc/{name}" and "ro" in dests[f"/etc/{name}"]["options"]
    assert "nodev" in dests["/dev/shm"]["options"] and "noexec" in dests["/dev"]["options"]
    assert s["annotations"]["org.weenv.network"] == "none"
    json.dumps(s)  # plain JSON all the way down


def test_spec_non_root_user_has_no_effective_capabilities():
    s = _spec(user=User(uid=1000, gid=1000, additional_gids=(10,), home="/home/u"))
    p = s["process"]
    assert p["user"] == {"uid": 1000, "gid": 1000, "additionalGids": [1000, 10]}
    assert p["capabilities"]["effective"] == [] and p["capabilities"]["permitted"] == []
    assert p["capabilities"]["bounding"] == list(DEFAULT_CAPABILITIES)
    assert "HOME=/home/u" in p["env"]


def test_spec_env_cwd_init_override_and_binds():
    s = _spec(
        env={"FOO": "bar", "PATH": "/opt/bin"},
        cwd="/work/",
        args=["/bin/my-init", "--x"],
        init_path=None,
        bind_mounts=[BindMount(source="/data", destination="/mnt/data")],
        network="loopback",
    )
    p = s["process"]
    assert p["args"] == ["/bin/my-init", "--x"] and p["cwd"] == "/work"
    assert "FOO=bar" in p["env"] and "PATH=/opt/bin" in p["env"] and "HOSTNAME=e1" in p["env"]
    assert INIT_PATH not in {m["destination"] for m in s["mounts"]}
    bind = next(m for m in s["mounts"] if m["destination"] == "/mnt/data")
    assert {"ro", "nodev", "nosuid", "rbind"} <= set(bind["options"])
    assert s["annotations"]["org.weenv.network"] == "loopback"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(env={"A=B": "x"}), "env var name"),
        (dict(env={"": "x"}), "env var name"),
        (dict(env={"A": "x\0y"}), "NUL"),
        (dict(args=[]), "non-empty"),
        (dict(args="sh -c x"), "non-empty list"),
        (dict(cwd="relative"), "absolute"),
        (dict(network="bridge"), "network"),
        (dict(env_id="a/b"), "env id"),
        (dict(init_path=None), "no init"),
        (dict(bind_mounts=[BindMount(source="/x", destination="/proc")]), "cover"),
        (dict(bind_mounts=[BindMount(source="rel", destination="/x")]), "absolute"),
        (dict(nofile=(10, 5)), "nofile"),
    ],
)
def test_spec_rejects_bad_input(kw, match):
    with pytest.raises(SpecError, match=match):
        _spec(**kw)


def test_seccomp_profile_shape():
    prof = default_seccomp("x86_64")
    assert prof["defaultAction"] == "SCMP_ACT_ALLOW"
    assert "SCMP_ARCH_X86_64" in prof["architectures"]
    by_name = {n: r for r in prof["syscalls"] for n in r["names"]}
    assert by_name["clone3"]["errnoRet"] == 38  # ENOSYS: libc falls back to clone, which is filtered
    assert by_name["unshare"]["args"][0]["value"] == 0x10000000
    assert set(DENIED_SYSCALLS) <= set(by_name)


def test_merge_env_overrides_in_place():
    assert merge_env(["A=1", "B=2"], {"B": "3", "C": "4"}) == ["A=1", "B=3", "C=4"]
    assert merge_env({"X": "a=b"}, None) == ["X=a=b"]


def test_etc_files():
    files = render_etc_files("env-7", "none")
    assert b"127.0.1.1\tenv-7" in files["hosts"] and files["hostname"] == b"env-7\n"
    assert b"nameserver" not in files["resolv.conf"]


PASSWD = "root:x:0:0:root:/root:/bin/sh\n# comment\nbroken line\nuser:x:1000:1000::/home/user:/bin/sh\n"
GROUP = "root:x:0:\nwheel:x:10:user,other\nuser:x:1000:\naudio:x:29:user\n"


@pytest.mark.parametrize(
    "spec, expect",
    [
        (None, User(uid=0, gid=0, home="/root", name="root")),
        ("user", User(uid=1000, gid=1000, additional_gids=(10, 29), home="/home/user", name="user")),
        ("1000", User(uid=1000, gid=1000, additional_gids=(10, 29), home="/home/user", name="user")),
        ("user:audio", User(uid=1000, gid=29, additional_gids=(10,), home="/home/user", name="user")),
        ("4242:7", User(uid=4242, gid=7, home="/")),
        (4242, User(uid=4242, gid=0, home="/")),
    ],
)
def test_parse_user(spec, expect):
    assert parse_user(spec, PASSWD, GROUP) == expect


def test_parse_user_errors():
    with pytest.raises(UserNotFoundError, match="nobody"):
        parse_user("nobody", PASSWD, GROUP)
    # root is uid 0 even where the image has no /etc/passwd (busybox, distroless); no other name is
    assert (parse_user("root", "", "").uid, parse_user("root", "", "").gid) == (0, 0)
    with pytest.raises(UserNotFoundError, match="user"):
        parse_user("user", "", "")
    with pytest.raises(UserNotFoundError, match="staff"):
        parse_user("user:staff", PASSWD, GROUP)
    with pytest.raises(SpecError, match="range"):
        parse_user("99999999999", PASSWD, GROUP)
    with pytest.raises(SpecError):
        parse_user(":10", PASSWD, GROUP)


# -- host detection ----------------------------------------------------------------------------


def test_hostfacts_decides_when_crun_needs_the_recipe():
    assert HostFacts(cgroup_mode="hybrid", unified_controllers=("hugetlb",)).crun_needs_private_mount_ns
    assert not HostFacts(cgroup_mode="hybrid", unified_controllers=()).crun_needs_private_mount_ns
    assert not HostFacts(cgroup_mode="unified", unified_controllers=("cpu", "memory")).crun_needs_private_mount_ns
    assert not HostFacts(cgroup_mode="legacy").crun_needs_private_mount_ns


def test_detect_host_matches_this_host():
    facts = detect_host()
    if facts.unified_mount:
        with open(os.path.join(facts.unified_mount, "cgroup.controllers")) as f:
            assert facts.unified_controllers == tuple(f.read().split())
    print("host:", facts)


# -- conformance: the same behaviour from the fake and from crun --------------------------------


class Harness:
    def __init__(self, kind, runtime, tmp_path, rootfs):
        self.kind = kind
        self.runtime = runtime
        self.tmp_path = tmp_path
        self.rootfs = rootfs

    async def create(self, env_id="c1"):
        if self.kind == "fake":
            return await self.runtime.create(env_id, "/bundle", "/rootfs", _spec(env_id=env_id), [])
        from weenv.provision.runtime._runtime import prepare_bundle

        bundle = str(self.tmp_path / f"bundle-{env_id}")
        os.makedirs(bundle, exist_ok=True)
        spec = prepare_bundle(bundle, env_id=env_id, rootfs=self.rootfs, host=self.runtime.host)
        return await self.runtime.create(env_id, bundle, self.rootfs, spec, [])

    async def started(self, env_id="c1"):
        await self.create(env_id)
        await self.runtime.start(env_id)


@pytest.fixture(params=["fake", "crun"])
def harness(request, tmp_path):
    if request.param == "fake":
        yield Harness("fake", FakeRuntime(), tmp_path, None)
    else:
        runtime = request.getfixturevalue("crun_runtime")
        rootfs = make_busybox_rootfs(str(tmp_path / "rootfs"))
        yield Harness("crun", runtime, tmp_path, rootfs)


def test_conformance_lifecycle(harness):
    rt = harness.runtime

    async def main():
        pid = await harness.create("c1")
        assert pid > 0
        st = await rt.state("c1")
        assert (st.id, st.status, st.pid) == ("c1", "created", pid)
        await rt.start("c1")
        assert (await rt.state("c1")).status == "running"
        assert [s.id for s in await rt.list()] == ["c1"]
        with pytest.raises(ContainerExistsError):
            await harness.create("c1")
        await rt.kill("c1", signal.SIGKILL)
        with trio.fail_after(10):
            while (await rt.state("c1")).status != "stopped":
                await trio.sleep(0.01)
        await rt.delete("c1")
        await rt.delete("c1")  # idempotent
        with pytest.raises(ContainerNotFoundError):
            await rt.state("c1")
        assert await rt.list() == []

    run(main)


def test_conformance_exec(harness):
    rt = harness.runtime

    async def main():
        await harness.started("c1")
        r = await rt.exec("c1", ["echo", "hello", "world"])
        assert (r.exit_code, r.stdout, r.timed_out, r.command_not_found) == (0, b"hello world\n", False, False)
        assert (await rt.exec("c1", ["false"])).exit_code == 1
        r = await rt.exec("c1", ["cat"], stdin=b"from stdin")
        assert r.stdout == b"from stdin"
        r = await rt.exec("c1", ["env"], env={"FOO": "bar"})
        assert b"FOO=bar\n" in r.stdout and b"HOSTNAME=c1\n" in r.stdout
        assert (await rt.exec("c1", ["pwd"], cwd="/tmp")).stdout == b"/tmp\n"
        r = await rt.exec("c1", ["id"], user=User(uid=1000, gid=1000))
        assert re.match(rb"uid=1000\b.*gid=1000\b", r.stdout), r.stdout
        r = await rt.exec("c1", ["no-such-command", "arg"])
        assert r.exit_code == 127 and r.command_not_found and b"no-such-command" in r.stderr
        seen = []
        r = await rt.exec("c1", ["cat"], stdin=b"x" * 100_000, max_output_bytes=1000, on_output=lambda s, d: seen.append((s, d)))
        assert r.stdout == b"x" * 1000 and r.stdout_truncated and not r.stderr_truncated
        assert b"".join(d for s, d in seen if s == "stdout") == r.stdout
        r = await rt.exec("c1", ["sleep", "30"], timeout_s=0.3)
        assert r.timed_out and r.exit_code == 137
        with pytest.raises(ContainerNotFoundError):
            await rt.exec("nope", ["true"])
        with pytest.raises(SpecError):
            await rt.exec("c1", [])
        await rt.delete("c1")

    run(main)


def test_conformance_exec_before_start_and_after_stop_fail(harness):
    rt = harness.runtime

    async def main():
        await harness.create("c2")
        with pytest.raises(ContainerError):
            await rt.exec("c2", ["true"])
        await rt.start("c2")
        await rt.kill("c2", signal.SIGKILL)
        with trio.fail_after(10):
            while (await rt.state("c2")).status != "stopped":
                await trio.sleep(0.01)
        with pytest.raises(ContainerError):
            await rt.exec("c2", ["true"])
        await rt.delete("c2")

    run(main)


# -- crun only ---------------------------------------------------------------------------------


def _host_pids_in(cgroup) -> set[int]:
    return set(cgroup.pids())


def test_init_and_execs_are_born_in_the_env_cgroups(crun_runtime, busybox_rootfs, tmp_path, env_cgroup):
    async def main():
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs, cgroup=env_cgroup)
        assert _host_pids_in(env_cgroup) == {env.init_pid}
        for path in env_cgroup.procs_paths():
            with open(path) as f:
                assert str(env.init_pid) in f.read().split(), path  # every hierarchy, not just one
        r = await env.sh("sleep 1000 >/dev/null 2>&1 &")
        assert r.exit_code == 0
        pids = _host_pids_in(env_cgroup)
        assert len(pids) == 2 and env.init_pid in pids
        (bg,) = pids - {env.init_pid}
        with open(f"/proc/{bg}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"sleep"
        await crun_runtime.delete(env.env_id)
        assert _host_pids_in(env_cgroup) == set()

    run(main)


def test_timeout_kills_the_whole_process_tree(crun_runtime, busybox_rootfs, tmp_path, env_cgroup):
    async def main():
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs, cgroup=env_cgroup)
        # A background grandchild, a double-forked orphan, one in its own session, and the
        # foreground sleep.
        script = "sleep 1001 & (sleep 1002 &) ; setsid sleep 1003 & echo started; sleep 1004"
        r = await env.sh(script, timeout_s=1.0)
        assert r.timed_out and r.exit_code == 137 and r.stdout == b"started\n"
        with trio.fail_after(5):
            while _host_pids_in(env_cgroup) != {env.init_pid}:
                await trio.sleep(0.01)
        ps = await env.exec(["ps", "-o", "pid,comm"])
        assert b"sleep" not in ps.stdout, ps.stdout

    run(main)


def test_kill_exec_tree_spares_unrelated_processes():
    import subprocess

    bystander = subprocess.Popen(["sleep", "60"])
    target = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    try:
        children = f"/proc/{target.pid}/task/{target.pid}/children"
        deadline = time.monotonic() + 5
        while len(open(children).read().split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)  # the shell has forked both sleeps: the tree is complete
        killed = kill_exec_tree(target.pid, spare_leader=False)
        assert killed >= 3
        assert target.wait(timeout=5) == -signal.SIGKILL
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_kill_exec_tree_signals_parents_before_children(monkeypatch):
    """Killed in an arbitrary order, a shell whose child died first could exit 137 (or run its next
    command) before its own SIGKILL landed: the real-tree test above saw 137 in ~1 of 10 runs
    under load. Here a fake process table whose pids make a set iterate child first (9 % 8 < 7 % 8)."""
    import types

    from weenv.provision.runtime import _ns

    # pid: (ppid, sid, state): leader 7 -> 9 -> 10 -> 3 (a pid reused low), plus 8 in the leader's
    # session reparented to init; 1 and 2 are unrelated.
    table = {1: (0, 1, "S"), 2: (1, 2, "S"), 7: (1, 7, "S"), 9: (7, 7, "S"), 10: (9, 7, "S"), 3: (10, 7, "S"),
             8: (1, 7, "S")}
    signalled: list[int] = []

    def send(fd: int, sig: int) -> None:
        assert sig == signal.SIGKILL
        signalled.append(fd)
        del table[fd]

    fake_os = types.SimpleNamespace(listdir=lambda path: [str(p) for p in table], pidfd_open=lambda pid: pid,
                                    close=lambda fd: None)
    monkeypatch.setattr(_ns, "os", fake_os)
    monkeypatch.setattr(_ns, "signal", types.SimpleNamespace(SIGKILL=signal.SIGKILL, pidfd_send_signal=send))
    monkeypatch.setattr(_ns, "_proc_stat", lambda pid: table.get(pid))
    assert kill_exec_tree(7, spare_leader=False) == 5
    assert sorted(signalled) == [3, 7, 8, 9, 10] and set(table) == {1, 2}
    order = {pid: i for i, pid in enumerate(signalled)}
    assert order[7] < order[9] < order[10] < order[3], signalled


def _seccomp_program(pid: int) -> bytes:
    """The newest seccomp program of process ``pid`` as the kernel holds it (PTRACE_SECCOMP_GET_FILTER)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    seize, interrupt, detach, get_filter = 0x4206, 0x4207, 17, 0x420C
    assert libc.ptrace(seize, pid, None, None) == 0, os.strerror(ctypes.get_errno())
    try:
        libc.ptrace(interrupt, pid, None, None)
        os.waitpid(pid, 0x40000000)  # __WALL: the stop of a process that is not our child
        n = libc.ptrace(get_filter, pid, None, None)
        assert n > 0, os.strerror(ctypes.get_errno())
        buf = ctypes.create_string_buffer(n * 8)  # struct sock_filter: 8 bytes
        assert libc.ptrace(get_filter, pid, None, buf) == n
        return buf.raw
    finally:
        libc.ptrace(detach, pid, None, None)


def test_crun_loads_the_seccomp_program_weenv_compiled_and_it_is_crun_s_own(crun_runtime, busybox_rootfs, tmp_path,
                                                                          monkeypatch):
    """weenv builds the seccomp program once (run.oci.seccomp_bpf_data) instead of crun on every
    create: the env's init holds it, byte for byte the program crun builds from the same profile."""
    from weenv.provision.runtime import _runtime

    async def main():
        ours = await start_env(crun_runtime, tmp_path, busybox_rootfs, env_id="bpf-weenv")
        with open(os.path.join(crun_runtime.state_dir, "bpf-weenv", "config.json")) as f:
            assert _runtime.ANNOTATION_SECCOMP_BPF in json.load(f)["annotations"]
        monkeypatch.setattr(_runtime, "compiled_seccomp", lambda profile: None)
        cruns = await start_env(crun_runtime, tmp_path, busybox_rootfs, env_id="bpf-crun")
        with open(os.path.join(crun_runtime.state_dir, "bpf-crun", "config.json")) as f:
            assert _runtime.ANNOTATION_SECCOMP_BPF not in json.load(f)["annotations"]
        program = _seccomp_program(ours.init_pid)
        assert len(program) > 100 * 8 and program == _seccomp_program(cruns.init_pid)
        for env in (ours, cruns):
            await crun_runtime.delete(env.env_id)

    run(main)


def test_start_returns_once_the_init_runs_its_program(crun_runtime, busybox_rootfs, tmp_path):
    """Releasing the init returns before its execve (under load, well before). crun 1.8.1's exec
    into an init still running crun's code fails ("setns(pid=N, CLONE_*): Operation not permitted",
    containers/crun#1264; CI hit it), so start waits for the execve. The init is held stopped
    across start here: start must wait for it, then the first exec runs."""
    from weenv.provision.runtime._runtime import _exe

    async def main():
        held = {}

        def hold(pid: int) -> None:
            held.update(pid=pid, exe=_exe(pid))
            os.kill(pid, signal.SIGSTOP)

        async def release():
            await trio.sleep(0.3)
            held["waiting"] = _exe(held["pid"]) == held["exe"]  # still crun's code: start still waits
            os.kill(held["pid"], signal.SIGCONT)
            held["released"] = True

        async with trio.open_nursery() as nursery:
            nursery.start_soon(release)
            env = await start_env(crun_runtime, tmp_path, busybox_rootfs, before_start=hold)
            held["start_returned_after_release"] = held.get("released", False)
        try:
            assert held["start_returned_after_release"] and held["waiting"], held
            assert _exe(held["pid"]) != held["exe"], held
            r = await env.sh("echo ran")
            assert r.exit_code == 0 and r.stdout == b"ran\n", r
        finally:
            await crun_runtime.delete(env.env_id)

    run(main)


def test_output_streams_while_the_command_runs(crun_runtime, busybox_rootfs, tmp_path):
    async def main():
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs)
        first = trio.Event()

        def on_output(stream, data):
            if stream == "stdout" and b"first" in data:
                first.set()

        async def release():
            await first.wait()  # only reached if "first" arrived before the command ended
            await env.exec(["touch", "/tmp/go"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(release)
            r = await env.sh("echo first; while [ ! -e /tmp/go ]; do sleep 0.01; done; echo second >&2", on_output=on_output, timeout_s=20)
        assert not r.timed_out and r.stdout == b"first\n" and r.stderr == b"second\n"

    run(main)


def test_async_output_callback_and_exit_codes(crun_runtime, busybox_rootfs, tmp_path):
    async def main():
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs)
        got = []

        async def on_output(stream, data):
            await trio.lowlevel.checkpoint()
            got.append(stream)

        r = await env.sh("echo out; echo err >&2; exit 3", on_output=on_output)
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n") and sorted(got) == ["stderr", "stdout"]
        assert (await env.sh("kill -9 $$")).exit_code == 137
        r = await env.exec(["/etc/passwd"])
        assert r.exit_code == 126 and not r.command_not_found and b"/etc/passwd" in r.stderr

    run(main)


def test_users_groups_and_capabilities(crun_runtime, busybox_rootfs, tmp_path):
    async def main():
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs)
        user = resolve_user(busybox_rootfs, "user")
        r = await env.exec(["id"], user=user)
        assert r.stdout.strip() == b"uid=1000(user) gid=1000(user) groups=10(wheel),1000(user)"  # the kernel sorts them
        r = await env.sh("grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; echo $HOME", user=user)
        assert b"CapEff:\t0000000000000000" in r.stdout and b"NoNewPrivs:\t1" in r.stdout and b"Seccomp:\t2" in r.stdout
        assert r.stdout.endswith(b"/home/user\n")
        r = await env.sh("grep -E '^(CapEff|NoNewPrivs):' /proc/self/status")
        assert b"CapEff:\t00000000a00405fb" in r.stdout and b"NoNewPrivs:\t1" in r.stdout
        with pytest.raises(UserNotFoundError):
            resolve_user(busybox_rootfs, "ghost")

    run(main)


def test_init_env_cwd_and_user_are_exec_defaults(crun_runtime, busybox_rootfs, tmp_path):
    async def main():
        user = resolve_user(busybox_rootfs, "user")
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs, env={"PLAN_VAR": "1"}, cwd="/home/user", user=user)
        r = await env.sh("echo $PLAN_VAR $HOME; pwd; id -u")
        assert r.stdout == b"1 /home/user\n/home/user\n1000\n"
        r = await env.sh("id -u; echo $HOME", user=resolve_user(busybox_rootfs, "root"), env={"PLAN_VAR": "2"})
        assert r.stdout == b"0\n/root\n"

    run(main)


@pytest.mark.parametrize("network, lo_up", [("none", False), ("loopback", True)])
def test_network_modes(crun_runtime, busybox_rootfs, tmp_path, network, lo_up):
    async def main():
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs, network=network)
        r = await env.exec(["ip", "-o", "link"])
        links = r.stdout.decode().strip().splitlines()
        assert len(links) == 1 and ": lo:" in links[0], links  # an empty namespace
        assert ("UP" in links[0].split("<")[1].split(">")[0].split(",")) == lo_up
        r = await env.sh("nc -l -p 8080 -e echo pong & sleep 0.2; echo ping | nc -w 2 127.0.0.1 8080", timeout_s=10)
        assert (b"pong" in r.stdout) == lo_up, r
        assert (await env.exec(["hostname"])).stdout == b"env1\n"

    run(main)


def test_a_new_runtime_readopts_running_envs(crun_runtime, busybox_rootfs, tmp_path):
    async def main():
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs, env={"KEPT": "yes"})
        again = CrunRuntime(os.path.dirname(crun_runtime.state_dir))
        (st,) = await again.list()
        assert (st.id, st.pid, st.status) == ("env1", env.init_pid, "running")
        r = await again.exec("env1", ["sh", "-c", "echo $KEPT"])
        assert r.stdout == b"yes\n"
        await again.delete("env1")
        assert await crun_runtime.list() == []

    run(main)


def test_plan_init_override_and_shell_less_rootfs(crun_runtime, tmp_path):
    # A rootfs with one static binary and nothing else still starts: the init comes from the host.
    rootfs = tmp_path / "bare"
    rootfs.mkdir()
    make_busybox_rootfs(str(tmp_path / "bb"))
    os.link(tmp_path / "bb/bin/busybox", rootfs / "busybox")

    async def main():
        env = await start_env(crun_runtime, tmp_path, str(rootfs), env_id="bare")
        r = await env.exec(["/busybox", "echo", "ok"])
        assert r.stdout == b"ok\n"
        custom = await start_env(crun_runtime, tmp_path, str(rootfs), env_id="custom", args=["/busybox", "sleep", "1000"])
        r = await custom.exec(["/busybox", "ps", "-o", "pid,args"])
        assert b"1 /busybox sleep 1000" in r.stdout

    run(main)


def test_create_failure_names_the_problem(crun_runtime, busybox_rootfs, tmp_path):
    async def main():
        with pytest.raises(ContainerError, match="env 'broken'"):
            await start_env(
                crun_runtime, tmp_path, busybox_rootfs, env_id="broken",
                bind_mounts=[BindMount(source=str(tmp_path / "missing"), destination="/mnt/x")],
            )  # fmt: skip
        assert await crun_runtime.list() == []

    run(main)


def test_v1_binding_alternative_removes_the_need_for_the_recipe(tmp_path, busybox_rootfs):
    require_crun()
    facts = detect_host()
    if not facts.crun_needs_private_mount_ns:
        pytest.skip(f"this host ({facts.cgroup_mode}, cgroup2 controllers {facts.unified_controllers}) needs no recipe")
    mount_root = tmp_path / "cg"
    made = bind_unified_controllers_to_v1(facts, str(mount_root))
    try:
        after = detect_host()
        assert after.unified_controllers == () and not after.crun_needs_private_mount_ns
        runtime = CrunRuntime(str(tmp_path / "run"), host=after)
        assert runtime._private_ns is None

        async def main():
            env = await start_env(runtime, tmp_path, busybox_rootfs)
            assert (await env.exec(["echo", "ok"])).stdout == b"ok\n"
            await runtime.delete(env.env_id)

        run(main)
    finally:
        unbind_v1_controllers(made)
    # The kernel frees the v1 hierarchy once the last mount of it (the env's, too) is gone.
    deadline = time.monotonic() + 10
    while detect_host().unified_controllers != facts.unified_controllers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert detect_host().unified_controllers == facts.unified_controllers


def test_exec_into_a_frozen_env_times_out_without_hanging(crun_runtime, busybox_rootfs, tmp_path, env_cgroup):
    crun_runtime.kill_grace_s = 1.5

    async def main():
        env = await start_env(crun_runtime, tmp_path, busybox_rootfs, cgroup=env_cgroup)
        env_cgroup.freeze()
        try:
            t0 = time.monotonic()
            with pytest.raises(ContainerError, match="did not die within 3 s of SIGKILL"):
                await env.exec(["echo", "never"], timeout_s=0.5)
            # the timeout plus the two kill graces the error names (it was 4: the kill ran twice)
            elapsed_s = time.monotonic() - t0
            assert elapsed_s < 0.5 + 2 * 1.5 + 1.4, elapsed_s
        finally:
            env_cgroup.thaw()
        with trio.fail_after(10):
            while set(env_cgroup.pids()) != {env.init_pid}:
                await trio.sleep(0.02)
        assert (await env.exec(["echo", "thawed"])).stdout == b"thawed\n"

    run(main)
