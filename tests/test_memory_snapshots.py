"""Memory snapshots on real runsc through the real daemon (docs/snapshots.md, "Memory"): a parked
env frees its memory and resumes with its processes, pids and in-memory state; a memory commit
restores into new envs; a fork with memory gives independent copies that continue from one
instant; crun envs are refused naming CRIU; bad input gets a clear error; the runtime's
checkpoint leaves the env running when it fails."""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import trio

import weenv
from tests.fixtures_runtime import runsc_skip_reason, start_env
from tests.test_gvisor import _gvisor_lock, _in_gvisor, _sandbox_pids

#: A busybox sh whose count lives only in its memory; SIGUSR1 makes it write the count to /tmp/v.<pid>.
COUNTER = ('i=0; trap \'echo $i > /tmp/v.$$\' USR1; while :; do i=$((i+1)); sleep 0.05; done')


@pytest.fixture(scope="module")
def gvisor_platform(tmp_path_factory) -> str:
    """The platform runsc runs on here; a skip (printed) only where runsc truly cannot run."""
    from weenv.provision._errors import HostError
    from weenv.provision.runtime._hostcheck import detect_host
    from weenv.provision.runtime._runsc import probe_platform

    reason = runsc_skip_reason()
    if reason is None:
        host = detect_host()
        try:
            return probe_platform(host.runsc_path, host.init_path, cache_dir=str(tmp_path_factory.mktemp("probe"))).platform
        except HostError as e:
            reason = str(e)
    print(f"SKIP memory snapshot tests: {reason}")
    pytest.skip(reason)


@pytest.fixture
def gvisor_runtime(tmp_path, gvisor_platform):
    """A gVisor runtime of the test's own; every sandbox it made is gone after the test."""
    from weenv.provision.runtime._gvisor import GvisorRuntime

    runtime = GvisorRuntime(str(tmp_path / "run"), platform=gvisor_platform)
    yield runtime

    async def cleanup() -> None:
        for st in await runtime.list():
            await runtime.delete(st.id, force=True)
            await runtime.wait_deleted(st.id)

    trio.run(cleanup)
    assert trio.run(runtime.list) == []
    deadline = time.monotonic() + 5
    while _sandbox_pids(runtime) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _sandbox_pids(runtime), "gofer or sandbox processes left behind"


def start_counter(env) -> int:
    r = env.exec(["sh", "-c", f"sh -c '{COUNTER.replace(chr(39), chr(39) + chr(92) + chr(39) + chr(39))}' "
                              "</dev/null >/dev/null 2>&1 & echo $!"])
    assert r.exit_code == 0, r
    return int(r.stdout)


def fill_shm(env, mib: int = 48) -> None:
    """``mib`` MiB of random bytes in /dev/shm/blob, checked (head -c reads until it has them all;
    dd counts a short read as a block and its check was only the exit status: a loaded CI run
    parked an image of 39.6 MiB after a 48 MiB dd, and nothing said how much dd wrote)."""
    r = env.exec(["sh", "-c", f"head -c {mib << 20} /dev/urandom >/dev/shm/blob && wc -c </dev/shm/blob"],
                 timeout_s=60)
    assert r.exit_code == 0 and int(r.stdout) == mib << 20, r


def read_counter(env, pid: int) -> int:
    """The count held in process ``pid``'s memory (it writes it when signalled)."""
    r = env.exec(["sh", "-c", f"rm -f /tmp/v.{pid}; kill -USR1 {pid} || exit 9; "
                              f"for _ in $(seq 100); do [ -s /tmp/v.{pid} ] && exec cat /tmp/v.{pid}; sleep 0.02; done; "
                              "exit 8"])
    assert r.exit_code == 0, (pid, r)
    return int(r.stdout)


def pids(env) -> set[int]:
    out = env.exec(["ps", "-o", "pid"]).stdout.decode().split()[1:]
    return {int(p) for p in out}


def cgroup_memory_bytes(env_id: str) -> int:
    """The env cgroup's memory use as the host charges it (v2 memory.current or v1 usage)."""
    for pattern in (f"/sys/fs/cgroup/**/{env_id}/memory.current", f"/sys/fs/cgroup/memory/**/{env_id}/memory.usage_in_bytes"):
        found = glob.glob(pattern, recursive=True)
        if found:
            with open(found[0]) as f:
                return int(f.read())
    raise AssertionError(f"no memory cgroup for {env_id}")


def cgroup_procs(env_id: str) -> list[str]:
    found = glob.glob(f"/sys/fs/cgroup/**/{env_id}/cgroup.procs", recursive=True)
    assert found, env_id
    with open(found[0]) as f:
        return f.read().split()


def test_park_frees_the_memory_and_resume_brings_the_processes_back(daemon, tmp_path, gvisor_platform):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock, ttl_s=600) as env:
        pid = start_counter(env)
        # 48 MiB in the sandbox's memory (its /dev/shm is the Sentry's tmpfs), checkpointed with it
        fill_shm(env)
        sum_before = env.exec(["md5sum", "/dev/shm/blob"]).stdout
        time.sleep(0.3)
        before = read_counter(env, pid)
        used_before = cgroup_memory_bytes(env.id)
        expires = c.get(env.id).info["expires_s"]
        env.pause(memory="park")
        info = c.get(env.id).info
        assert (info["status"], info["parked"], info["init_pid"]) == ("paused", True, 0), info
        assert info["expires_s"] == expires  # its TTL kept
        assert cgroup_procs(env.id) == []  # the sandbox and its gofer are gone
        used_after = cgroup_memory_bytes(env.id)
        print(f"cgroup memory before park {used_before >> 20} MiB, after {used_after >> 20} MiB")
        assert used_after < used_before / 2 and used_before - used_after > 40 << 20, (used_before, used_after)
        with pytest.raises(weenv.ApiError, match="paused"):
            env.exec(["true"])
        env.pause(memory="park")  # parked already: nothing to do
        t0 = time.perf_counter()
        env.resume()
        print(f"resume {1000 * (time.perf_counter() - t0):.0f} ms")
        info = c.get(env.id).info
        assert (info["status"], info["parked"]) == ("running", False), info
        assert _in_gvisor(env)
        assert pid in pids(env)  # the same process, same pid
        after = read_counter(env, pid)
        assert after >= before, (before, after)  # counted on from where it was
        assert env.exec(["md5sum", "/dev/shm/blob"]).stdout == sum_before
        time.sleep(0.3)
        assert read_counter(env, pid) > after  # and it keeps counting
        assert not os.path.exists(os.path.join(daemon.home, "envs", env.id, "memory"))  # the image is done with


def test_a_park_checkpoints_the_env_unthrottled(daemon, tmp_path, gvisor_platform):
    """The monitor halves an idle env's CPU (a quiet gVisor sandbox uses ~0.15 cores: 1 -> 0.5
    cores after 2 s, down to its min); runsc's checkpoint runs in the env's cgroup, and under that
    quota the first park after 5 s of quiet took 1.2 s instead of 0.48. A park lifts the quota
    while the sandbox is checkpointed: seen from the host as it runs."""
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock, ttl_s=600) as env:
        start_counter(env)
        fill_shm(env, 16)
        quota = glob.glob(f"/sys/fs/cgroup/cpu*/**/{env.id}/cpu.cfs_quota_us", recursive=True)
        if not quota:
            pytest.skip("no cgroup v1 cpu controller here (cpu.cfs_quota_us): the v2 contract is cpu.max")
        burst = os.path.join(os.path.dirname(quota[0]), "cpu.cfs_burst_us")
        if os.path.exists(burst):  # a burst above the quota is refused (EINVAL)
            with open(burst, "w") as f:
                f.write("0")
        with open(quota[0], "w") as f:
            f.write("5000")  # 0.05 cores: what the monitor leaves an env idle for long enough
        seen: list[tuple[str, bool]] = []
        done = threading.Event()

        procs = os.path.join(os.path.dirname(quota[0]), "cgroup.procs")

        def watch() -> None:
            while not done.is_set():
                with open(quota[0]) as f, open(procs) as g:
                    seen.append((f.read().strip(), bool(g.read().split())))
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            env.pause(memory="park")
        finally:
            done.set()
            watcher.join()
        running = [q for q, busy in seen if busy]
        assert running and running[-1] == "-1", seen[-20:]  # the sandbox's last moments: unthrottled
        env.resume()


def test_park_of_a_frozen_env_and_resume_again(daemon, tmp_path, gvisor_platform):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        pid = start_counter(env)
        env.pause()  # the freezer first
        env.pause(memory="park")
        assert c.get(env.id).info["parked"] is True
        env.resume()
        assert read_counter(env, pid) > 0
        env.pause(memory="park")  # a second park of the same env
        env.resume()
        assert pid in pids(env)


def test_a_memory_fork_gives_three_independent_copies_of_the_running_processes(daemon, tmp_path, gvisor_platform):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        pid = start_counter(env)
        env.exec(["sh", "-c", "echo parent-file > /root/f"])
        time.sleep(0.3)
        at_fork = read_counter(env, pid)
        t0 = time.perf_counter()
        children = env.fork(3, memory=True)
        print(f"fork x3 with memory {1000 * (time.perf_counter() - t0):.0f} ms")
        assert len({ch.id for ch in children}) == 3
        snap = c.snapshot(children[0].info.snapshot)
        assert snap.memory is not None and snap.memory["image_bytes"] > 0, snap
        assert snap.memory["facts"]["runtime"] == "gvisor"
        counts = {}
        for ch in [env, *children]:
            assert pid in pids(ch), ch.id
            counts[ch.id] = read_counter(ch, pid)
            assert counts[ch.id] >= at_fork, (ch.id, counts[ch.id], at_fork)  # from the instant of the fork
            assert ch.exec(["cat", "/root/f"]).stdout == b"parent-file\n"  # its files of the same instant
        # independent: ending the counter in one copy leaves it running in the others
        assert children[0].exec(["kill", "-9", str(pid)]).exit_code == 0
        time.sleep(0.2)
        assert pid not in pids(children[0])
        for ch in [env, *children[1:]]:
            assert pid in pids(ch) and read_counter(ch, pid) > counts[ch.id], ch.id
        children[1].exec(["sh", "-c", "echo mine > /root/f"])
        assert children[2].exec(["cat", "/root/f"]).stdout == b"parent-file\n"
        hostnames = {ch.exec(["hostname"]).stdout.strip().decode() for ch in children}
        print(f"hostnames of the copies: {hostnames} (parent {env.id})")


def test_a_memory_commit_restores_into_new_envs_and_can_be_made_of_a_parked_env(daemon, tmp_path, gvisor_platform):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        pid = start_counter(env)
        snap_id = env.commit(memory=True)
        assert read_counter(env, pid) >= 0  # the source runs on
        env.pause(memory="park")
        parked_snap = env.commit(memory=True)  # of the parked env: its image as it is
        assert c.get(env.id).info["parked"] is True
        for sid in (snap_id, parked_snap):
            with c.create(sid) as child:
                assert pid in pids(child) and read_counter(child, pid) >= 0
                assert child.info.snapshot == sid
        memory = c.snapshot(snap_id).memory
        blobs = [os.path.join(daemon.home, "store", "blobs", "sha256", b["digest"].split(":")[1])
                 for b in [memory, *memory["packs"]]]
        assert all(os.path.isfile(b) for b in blobs), blobs
        # the copies written out for the restores are gone (tests/test_memory_dedup.py: chunks and packs)
        assert os.listdir(os.path.join(daemon.home, "memory-images")) == []
        c.delete_snapshot(snap_id)  # its pack goes with it, unless the parked commit's image reads chunks from it
        kept = {p["digest"] for p in c.snapshot(parked_snap).memory["packs"]}
        assert os.path.exists(blobs[0]) == (memory["digest"] in kept), (memory["digest"], kept)
        env.resume()
        assert pid in pids(env)


def test_a_restore_that_fails_leaves_the_env_parked_with_its_image(daemon, tmp_path, gvisor_platform):
    """A parked env whose image cannot be restored (cut short here, as a full disk would): the
    resume fails with runsc's words, the env stays parked with its image as it was, and a pause
    memory=false gives up its memory and keeps its files (the next resume boots it afresh)."""
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        start_counter(env)
        env.exec(["sh", "-c", "echo kept > /root/file"])
        env.pause(memory="park")
        image = os.path.join(daemon.home, "envs", env.id, "memory", "checkpoint.img")
        os.truncate(image, os.path.getsize(image) // 2)
        size = os.path.getsize(image)
        with pytest.raises(weenv.ApiError) as failed:
            env.resume()
        print(f"resume failed: {failed.value.status} {str(failed.value)[:300]}")
        assert "runsc restore failed" in str(failed.value), failed.value
        info = c.get(env.id).info
        assert (info["status"], info["parked"]) == ("paused", True), info
        assert info["error"].startswith("resume failed: ") and "runsc restore" in info["error"], info["error"]
        assert os.path.getsize(image) == size  # the image as it was: another resume may try again
        assert cgroup_procs(env.id) == []  # nothing half-started left
        env.pause(memory=False)  # give up its memory: its files stay, resume boots it afresh
        assert not os.path.exists(image)
        env.resume()
        info = c.get(env.id).info
        assert (info["status"], info["parked"], info["error"]) == ("running", False, ""), info
        assert env.exec(["cat", "/root/file"]).stdout == b"kept\n"


def test_a_process_holding_the_execs_output_cannot_be_restored_and_says_so(daemon, tmp_path, gvisor_platform):
    """Under gVisor an exec's stdout is a host file given to the sandbox; a background process
    that keeps it holds that host file, which this runsc cannot restore: the resume fails, the
    env stays parked (docs/snapshots.md: background processes need their own stdio)."""
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        env.exec(["sh", "-c", "sleep 100000 &"])  # its stdout and stderr: the exec's
        env.pause(memory="park")
        with pytest.raises(weenv.ApiError, match="runsc restore failed: .*host FD") as failed:
            env.resume()
        print(f"resume failed: {str(failed.value)[:600]}")
        assert "must have its own" in str(failed.value)  # and what to do
        assert c.get(env.id).info["parked"] is True
        env.pause(memory=False)
        env.resume()
        assert env.exec(["true"]).exit_code == 0


def test_a_parked_env_stays_parked_across_a_daemon_restart(daemon, tmp_path, gvisor_platform):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c:
        env = c.create(lock)
        pid = start_counter(env)
        env.pause(memory="park")
    daemon.kill9()
    daemon.start()
    with daemon.client() as c:
        info = c.get(env.id).info
        assert (info["status"], info["parked"]) == ("paused", True), info
        c.get(env.id).resume()
        assert pid in pids(c.get(env.id)) and read_counter(c.get(env.id), pid) >= 0
        c.get(env.id).kill()


def test_e2b_pause_parks_where_the_runtime_can_and_freezes_elsewhere():
    from weenv._connection import ApiError
    from weenv.api._e2b import pause_env

    class FakeEnv:
        def __init__(self, parks: bool):
            self.parks, self.calls = parks, []

        async def pause(self, *, memory=True):
            self.calls.append(memory)
            if memory == "park" and not self.parks:
                raise ApiError(409, "memory_unavailable", "runtime crun: memory snapshots need gVisor")

    async def main():
        gvisor, crun, gone = FakeEnv(True), FakeEnv(False), FakeEnv(True)
        await pause_env(gvisor)
        await pause_env(crun)
        await pause_env(gone, keep_memory=False)
        assert (gvisor.calls, crun.calls, gone.calls) == (["park"], ["park", True], [False])

    trio.run(main)


def test_crun_envs_are_refused_naming_criu(daemon, tmp_path):
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        for call in (lambda: env.pause(memory="park"), lambda: env.commit(memory=True),
                     lambda: env.fork(2, memory=True)):
            with pytest.raises(weenv.ApiError) as refused:
                call()
            assert refused.value.status == 409, refused.value
            text = str(refused.value)
            assert "runtime crun" in text and "gVisor" in text and "CRIU" in text, text
            print(text)
        assert c.get(env.id).info["status"] == "running"  # nothing was changed
        assert env.exec(["echo", "ok"]).stdout == b"ok\n"
        assert c.snapshots() == []


def test_bad_input_gets_a_clear_error(daemon, tmp_path, gvisor_platform):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        with pytest.raises(ValueError, match="park"):
            env.pause(memory="deep")  # type: ignore[arg-type]
        with pytest.raises(weenv.ApiError, match="not true, false or park"):
            c._run(weenv._calls.Call("env_pause", weenv._calls.env(env.id), query={"memory": "deep"}))
        with pytest.raises(weenv.ApiError, match="publish them to a registry first"):  # tests/test_memory_dedup.py
            c.commit(env.id, ref="localhost:1/x:y", memory=True)
        with pytest.raises(weenv.ApiError, match="not paused"):
            env.resume()
        for n in (0, 2000):
            with pytest.raises(weenv.ApiError) as bad_n:
                env.fork(n, memory=True)
            assert bad_n.value.status == 400 and "$.n" in str(bad_n.value), bad_n.value
        assert c.snapshots() == []  # nothing was made
        with pytest.raises(weenv.ApiError) as unknown:
            c.create("snap-000000000000")
        assert unknown.value.status == 404, unknown.value
        env.pause(memory=False)  # paused without its memory: nothing to park
        with pytest.raises(weenv.ApiError, match="without its memory"):
            env.pause(memory="park")
        env.resume()
        assert env.exec(["true"]).exit_code == 0
    with pytest.raises(weenv.ApiError) as gone:
        with daemon.client() as c:
            c.env(env.id).pause(memory="park")
    assert gone.value.status == 404


def test_a_failed_checkpoint_leaves_the_env_running(gvisor_runtime, busybox_rootfs, tmp_path):
    from weenv.provision._errors import ContainerError

    async def main():
        env = await start_env(gvisor_runtime, tmp_path, busybox_rootfs)
        r = await env.sh("(i=0; while :; do i=$((i+1)); sleep 0.05; done) </dev/null >/dev/null 2>&1 & echo $!")
        bg = int(r.stdout)
        full = tmp_path / "full"
        full.mkdir()
        (full / "x").write_text("not empty")
        with pytest.raises(ContainerError, match="must exist and be empty"):
            await gvisor_runtime.checkpoint(env.env_id, str(full))
        with pytest.raises(ContainerError, match="no checkpoint image"):
            await gvisor_runtime.restore("env2", env.bundle, env.rootfs, {}, str(full))
        assert (await gvisor_runtime.state(env.env_id)).status == "running"
        image = tmp_path / "image"
        image.mkdir()
        await gvisor_runtime.checkpoint(env.env_id, str(image), leave_running=True)  # through its own restore
        r = await env.sh(f"kill -0 {bg} && echo alive")
        assert r.stdout == b"alive\n", r

    trio.run(main)


@pytest.fixture(params=["fake", "gvisor"])
def memory_runtime(request, tmp_path):
    """(runtime, start(env_id) -> bundle, rootfs): the fake and gVisor alike (the seam's conformance)."""
    if request.param == "fake":
        from weenv.testing import FakeRuntime

        rt = FakeRuntime(memory_snapshots=True)

        async def start(env_id):
            await rt.create(env_id, str(tmp_path), str(tmp_path), {"process": {}})
            await rt.start(env_id)
            return str(tmp_path), str(tmp_path), {"process": {}}

        yield rt, start
        return
    from tests.fixtures_runtime import make_busybox_rootfs

    rt = request.getfixturevalue("gvisor_runtime")
    rootfs = make_busybox_rootfs(str(tmp_path / "rootfs"))

    async def start(env_id):
        env = await start_env(rt, tmp_path, rootfs, env_id=env_id)
        return env.bundle, rootfs, rt._boots[env_id][2]

    yield rt, start


def test_conformance_checkpoint_and_restore(memory_runtime, tmp_path):
    from weenv.provision._errors import ContainerError, ContainerNotFoundError
    from weenv.provision.runtime._seam import MemorySnapshots

    rt, start = memory_runtime

    async def main():
        assert isinstance(await rt.capability("m1", MemorySnapshots), MemorySnapshots)
        bundle, rootfs, spec = await start("m1")
        image = tmp_path / "img"
        image.mkdir()
        with pytest.raises(ContainerNotFoundError):
            await rt.checkpoint("nope", str(image))
        (image / "x").write_text("x")
        with pytest.raises(ContainerError, match="must exist and be empty"):
            await rt.checkpoint("m1", str(image))
        (image / "x").unlink()
        with pytest.raises(ContainerError, match="no checkpoint image"):
            await rt.restore("m2", bundle, rootfs, spec, str(image))
        await rt.checkpoint("m1", str(image))
        assert (image / "checkpoint.img").is_file()
        with pytest.raises(ContainerNotFoundError):
            await rt.state("m1")  # its sandbox ended
        await rt.restore("m1", bundle, rootfs, spec, str(image))
        assert (await rt.state("m1")).status == "running"
        assert (await rt.exec("m1", ["true"])).exit_code == 0
        with pytest.raises(ContainerError):
            await rt.restore("m1", bundle, rootfs, spec, str(image))  # it exists
        again = tmp_path / "again"
        again.mkdir()
        await rt.checkpoint("m1", str(again), leave_running=True)
        assert (await rt.state("m1")).status == "running"
        await rt.delete("m1")

    trio.run(main)


def test_a_fake_runtime_without_the_capability_says_none():
    from weenv.provision.runtime._seam import MemorySnapshots
    from weenv.testing import FakeRuntime

    assert trio.run(FakeRuntime().capability, "e", MemorySnapshots) is None


def test_the_crun_refusal_names_this_hosts_criu():
    from weenv.provision.runtime._criu import criu_version, crun_memory_reason

    why = crun_memory_reason()
    print(why)
    assert "gVisor" in why and "CRIU >= 4.1" in why
    version = criu_version()
    assert ("not installed" in why) if version is None else (".".join(map(str, version)) in why)


# -- the unmodified E2B SDK through weenv serve ------------------------------------------------------


def test_e2b_pause_parks_a_gvisor_sandbox_and_connect_restores_its_processes(e2b_served, daemon, tmp_path,
                                                                               gvisor_platform):
    """E2B's pause keeps memory: a gVisor sandbox is parked (not frozen) and connect restores its
    processes. (Commands go through the daemon: the SDK's commands need process handles, which
    gVisor envs do not have.)"""
    e2b = pytest.importorskip("e2b")
    from weenv.api import TemplateStore

    TemplateStore(os.path.join(daemon.home, "api")).set("bbgv", _gvisor_lock(daemon, tmp_path))
    s = e2b.Sandbox.create("bbgv", timeout=120)
    try:
        with daemon.client() as c:
            (env_id,) = [e["id"] for e in c.list()]
            pid = start_counter(c.get(env_id))
        assert s.pause() is True
        assert e2b.Sandbox.get_info(s.sandbox_id).state.value == "paused"
        with daemon.client() as c:
            info = c.get(env_id).info
            assert (info["status"], info["parked"]) == ("paused", True), info  # parked, not frozen
        again = e2b.Sandbox.connect(s.sandbox_id)
        assert again.get_info().state.value == "running"
        with daemon.client() as c:
            assert pid in pids(c.get(env_id)) and read_counter(c.get(env_id), pid) >= 0
    finally:
        s.kill()


def test_e2b_fork_copies_a_gvisor_sandbox_with_its_running_processes(e2b_served, daemon, tmp_path,
                                                                     gvisor_platform):
    """E2B's fork of a gVisor sandbox is a memory fork: every copy has the parent's counter process,
    counting on from the instant of the fork (before: a filesystem fork, fresh processes)."""
    e2b = pytest.importorskip("e2b")
    from weenv.api import TemplateStore

    TemplateStore(os.path.join(daemon.home, "api")).set("bbgvfork", _gvisor_lock(daemon, tmp_path))
    s = e2b.Sandbox.create("bbgvfork", timeout=120)
    children: list = []
    try:
        with daemon.client() as c:
            (env_id,) = [e["id"] for e in c.list()]
            pid = start_counter(c.get(env_id))
            time.sleep(0.3)
            at_fork = read_counter(c.get(env_id), pid)
        children = s.fork(count=2)
        assert len(children) == 2 and not any(isinstance(ch, Exception) for ch in children), children
        with daemon.client() as c:
            for ch in children:
                env = c.get(ch.sandbox_id)
                assert env.info["snapshot"], env.info
                assert c.snapshot(env.info["snapshot"]).memory is not None  # a memory snapshot's copy
                assert pid in pids(env), ch.sandbox_id
                assert read_counter(env, pid) >= at_fork
    finally:
        for ch in children:
            if not isinstance(ch, Exception):
                ch.kill()
        s.kill()


def test_e2b_fork_of_a_crun_sandbox_copies_its_files(e2b_served, daemon, tmp_path):
    """Where the runtime cannot checkpoint (crun without CRIU >= 4.1), E2B's fork falls back to a
    filesystem fork instead of failing with the memory refusal."""
    e2b = pytest.importorskip("e2b")
    s = e2b.Sandbox.create("bb", timeout=60)  # the busybox lock, on crun
    children: list = []
    try:
        s.files.write("/tmp/marker", "parent")
        children = s.fork(count=1)
        assert not isinstance(children[0], Exception), children
        assert children[0].files.read("/tmp/marker") == "parent"
        with daemon.client() as c:
            assert c.snapshot(c.get(children[0].sandbox_id).info["snapshot"]).memory is None
    finally:
        for ch in children:
            if not isinstance(ch, Exception):
                ch.kill()
        s.kill()


@pytest.fixture
def e2b_served(request, daemon, monkeypatch):
    served = request.getfixturevalue("weenv_serve")
    for k, v in served.e2b_env().items():
        monkeypatch.setenv(k, v)
    yield served


from tests.fixtures_api import weenv_serve  # noqa: E402, F401  (the session's weenv serve)
