"""The fault matrix's tests that no other file had: each injects a fault into a running system (a real
envlet over a real docker-registry behind a fault proxy, or a real daemon) and checks the promise:
what keeps working, what fails with which clear error, what is cleaned up.

Faults already tested elsewhere are cited in benchmarks/soak.py's FAULTS table (docs/reliability.md),
not repeated here.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from weenv.envlet import StoreSpec
from weenv.testing import (DaemonHandle, Fault, leftovers, require_fuse, require_tool, start_proxy, stop_proxy,
                           teardown_private_daemon, wait_for)

from .layertrees import f, make_tree

pytestmark = pytest.mark.integration

DEADLINE_S = 2.0
SLACK_S = 2.0  # thread hand-offs, the FUSE round trip, a loaded 2-core machine


# ------------------------------------------------------------------ a layer behind a fault proxy


@pytest.fixture
def behind_proxy(tmp_path, envlet_factory, weenv_home):  # type: ignore[no-untyped-def]
    """(envlet, mounted layer path, file data, proxy): a 6 MB file in a layer pulled by an envlet
    (deadline 2 s, no read-ahead) from docker-registry through a fault proxy."""
    from weenv.registry import publish, resolve_group

    from .fixtures_registry import start_registry, stop_registry

    reg = start_registry(str(tmp_path / "reg"))
    proxy = start_proxy(reg.host)
    try:
        data = os.urandom(6_000_000)
        src = make_tree(tmp_path / "src", f("big", data), f("small", b"s" * 100))
        publish(str(src), f"{reg.host}/faults/layer:v1", group="faults", group_class="task")
        g = resolve_group(f"{reg.host}/faults/layer:v1")
        e = envlet_factory(deadline_s=DEADLINE_S, readahead_bytes=0)
        info = e.client.register(StoreSpec("registry", registry=proxy.host, insecure=True), g.layer_digest,
                                 g.layer_size, g.toc_digest, repo=g.repo)
        yield e, os.path.join(info.path, "big"), data, proxy
    finally:
        with proxy.server.fault_lock:
            proxy.faults.clear()
        stop_proxy(proxy)
        stop_registry(reg)


def _read(path: str, offset: int, n: int = 50_000) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(n)


def _eio_within_deadline(path: str, offset: int) -> float:
    t0 = time.monotonic()
    with pytest.raises(OSError) as ei:
        _read(path, offset)
    took = time.monotonic() - t0
    assert ei.value.errno == errno.EIO, ei.value
    assert took < DEADLINE_S + SLACK_S, f"EIO after {took:.1f} s, the deadline is {DEADLINE_S} s"
    return took


def _clear(proxy) -> None:  # type: ignore[no-untyped-def]
    from weenv.envlet._fetch import FAILURE_MEMORY_S

    with proxy.server.fault_lock:
        proxy.faults.clear()
    time.sleep(FAILURE_MEMORY_S + 0.1)  # a chunk that just failed fails again at once for this long


def test_registry_slow_10s(behind_proxy) -> None:  # type: ignore[no-untyped-def]
    e, big, data, proxy = behind_proxy
    assert _read(big, 0) == data[:50_000]  # cached from here on
    proxy.add_fault(Fault("slow", count=1000, delay_s=10.0, method="GET", path_contains="/blobs/"))
    _eio_within_deadline(big, 3_000_000)  # 2 s, not 10 s
    assert _read(big, 0) == data[:50_000]  # what was read before is still served
    _clear(proxy)
    t0 = time.monotonic()
    assert _read(big, 3_000_000) == data[3_000_000:3_050_000]
    assert time.monotonic() - t0 < 2.0
    assert e.alive()


def test_5xx_storm(behind_proxy) -> None:  # type: ignore[no-untyped-def]
    e, big, data, proxy = behind_proxy
    proxy.add_fault(Fault("status", count=3, status=503, method="GET", path_contains="/blobs/"))
    assert _read(big, 1_000_000) == data[1_000_000:1_050_000]  # a short storm is retried away
    proxy.add_fault(Fault("status", count=100_000, status=500, method="GET", path_contains="/blobs/"))
    _eio_within_deadline(big, 4_000_000)
    _clear(proxy)
    assert _read(big, 4_000_000) == data[4_000_000:4_050_000]
    s = e.client.stats()
    assert s["read_errors"] >= 1
    assert e.alive()


def test_range_answered_with_200_through_the_envlet(behind_proxy) -> None:  # type: ignore[no-untyped-def]
    e, big, data, proxy = behind_proxy
    proxy.add_fault(Fault("ignore_range", count=1000, method="GET", path_contains="/blobs/"))
    for where in (0, 2_500_000, 5_900_000):  # each answer is the whole blob: skipped to the range
        assert _read(big, where) == data[where:where + 50_000]
    assert e.alive()


def test_truncated_body_through_the_envlet(behind_proxy) -> None:  # type: ignore[no-untyped-def]
    e, big, data, proxy = behind_proxy
    proxy.add_fault(Fault("truncate_body", count=2, method="GET", path_contains="/blobs/"))
    assert _read(big, 2_000_000) == data[2_000_000:2_050_000]  # retried, never short data
    proxy.add_fault(Fault("truncate_body", count=100_000, method="GET", path_contains="/blobs/"))
    _eio_within_deadline(big, 5_000_000)
    _clear(proxy)
    assert _read(big, 5_000_000) == data[5_000_000:5_050_000]
    assert e.alive()


def test_truncated_body_at_the_store(registry, fault_proxy, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from weenv import registry as R
    from weenv.registry._oci import sha256_digest

    data = os.urandom(1 << 20)
    (tmp_path / "blob").write_bytes(data)
    digest = sha256_digest(data)
    with R.RemoteStore(registry.host, insecure=True, credentials=None) as direct:
        direct.put_blob("faults/trunc", digest, str(tmp_path / "blob"), len(data))
    policy = R.RetryPolicy(deadline_s=2.0, base_delay_s=0.01, max_delay_s=0.2, request_timeout_s=1.0)
    fault_proxy.add_fault(Fault("truncate_body", count=1, method="GET"))
    with R.RemoteStore(fault_proxy.host, insecure=True, credentials=None, policy=policy) as s:
        assert s.read_blob("faults/trunc", digest, 1000, 500_000) == data[1000:501_000]
        assert s.stats.retries == 1
    fault_proxy.add_fault(Fault("truncate_body", count=100_000, method="GET"))
    with R.RemoteStore(fault_proxy.host, insecure=True, credentials=None, policy=policy) as s:
        t0 = time.monotonic()
        with pytest.raises(R.RegistryError) as ei:
            s.read_blob("faults/trunc", digest, 0, 500_000)
        assert time.monotonic() - t0 < 2.0 + SLACK_S
    assert digest in str(ei.value)


# ------------------------------------------------------------------ the envlet itself


def test_a_full_cache_disk_still_serves_reads(tmp_path, envlet_factory) -> None:  # type: ignore[no-untyped-def]
    """The envlet's L2 on a 1 MiB tmpfs: a 6 MB file reads right, L2 counts only what it stored."""
    from .fixtures_envlet import build_layer_file, drop_page_cache

    data = os.urandom(6_000_000)
    src = make_tree(tmp_path / "src", f("big", data))
    layer = build_layer_file(str(src), str(tmp_path / "l"))
    cache = tmp_path / "small" / "cache"
    cache.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(cache)], check=True)
    e = None
    try:
        e = envlet_factory("small", memory_cache_size_bytes=0)
        info = layer.register(e)
        path = os.path.join(info.path, "big")
        for _ in range(2):
            with open(path, "rb") as fh:
                assert fh.read() == data
            drop_page_cache()
        s = e.client.stats()
        st = os.statvfs(cache)
        assert s["l2_size_bytes"] <= (st.f_blocks - st.f_bfree) * st.f_frsize + 4096
        assert e.alive()
    finally:
        if e is not None:
            e.stop()
        subprocess.run(["umount", "-l", str(cache)], capture_output=True)


# ------------------------------------------------------------------ a private daemon


class _Daemon(DaemonHandle):
    """A private daemon started with extra environment variables and a wall clock that a test can move:
    ``time.time()`` in the daemon returns the real time plus the seconds written to ``clock_file``
    (the host's clock is never touched)."""

    extra_env: dict[str, str]
    clock_file: str

    def start(self, timeout_s: float = 30.0) -> None:
        code = ("import runpy, sys, time\n"
                "_real = time.time\n"
                f"def _now(_f={self.clock_file!r}):\n"
                "    try:\n"
                "        with open(_f) as fh:\n"
                "            return _real() + float(fh.read() or 0)\n"
                "    except OSError:\n"
                "        return _real()\n"
                "time.time = _now\n"
                f"sys.argv = ['weenv', 'daemon', '--cgroup-root', {self.cgroup_root!r}]\n"
                "runpy.run_module('weenv', run_name='__main__', alter_sys=True)\n")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env={**self.env_vars(), **self.extra_env},
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.wait_ready(timeout_s)

    def jump_clock(self, seconds: float) -> None:
        with open(self.clock_file, "w") as fh:
            fh.write(str(seconds))


def _data_plan(home: str, data: bytes) -> str:
    """A locked plan over one os group: busybox plus /data/big (``data``) and /data/other."""
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import publish, resolve_group
    from weenv.testing import busybox_tree
    from weenv.testing._daemon import weenv_home

    src = busybox_tree(Path(home) / "src-data")
    (src / "data").mkdir()
    (src / "data" / "big").write_bytes(data)
    (src / "data" / "other").write_bytes(os.urandom(300_000))
    with weenv_home(home):
        publish(str(src), "bbdata:test", group="os", group_class="os")
        plan = os.path.join(home, "bbdata.toml")
        with open(plan, "w") as fh:
            fh.write('name = "bbdata"\n\n[[groups]]\nname = "os"\nref = "bbdata:test"\nclass = "os"\n\n'
                     '[resources]\npids = 256\ndisk = "128MiB"\n\n[resources.memory]\nmin = "64MiB"\n'
                     'max = "512MiB"\n')
        lock = os.path.join(home, "bbdata.lock.toml")
        write_plan(lock_plan(load_plan(plan), resolve_group), lock)
    return lock


@pytest.fixture
def private_daemon():  # type: ignore[no-untyped-def]
    """``start(env=..., home=...)``: a private daemon over a busybox + /data plan (``.plan_lock``),
    torn down after the test, with nothing left behind."""
    require_fuse()
    require_tool("crun")
    started: list[_Daemon] = []

    def start(env: dict[str, str] | None = None, home: str | None = None, data: bytes = b"") -> _Daemon:
        home = home or tempfile.mkdtemp(prefix="weenv-faults-")
        lock = _data_plan(home, data or os.urandom(1 << 20))
        d = _Daemon(home, os.path.join(home, "run", "weenv.sock"), f"weenv-faults-{os.getpid()}-{len(started)}",
                    lock, "", os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
        d.extra_env = {"WEENV_LAYER_TREES_AFTER": "0", **(env or {})}
        d.clock_file = os.path.join(home, "clock-offset")
        started.append(d)
        d.start()
        return d

    yield start
    for d in started:
        left = teardown_private_daemon(d)
        assert not left, f"the daemon left: {left}"


def test_a_sigstopped_envlet_never_hangs_reads_forever(private_daemon) -> None:  # type: ignore[no-untyped-def]
    """kill -STOP of the envlet: a read in an env of a file not read before fails (the daemon kills the
    silent envlet after its deadline, which aborts its FUSE connection) within the deadline and slack,
    never waits for ever; a new envlet serves new envs."""
    deadline_s = 3.0
    d = private_daemon(env={"WEENV_ENVLET_DEADLINE_S": str(deadline_s)})
    from weenv.envlet import EnvletClient

    old_pid = EnvletClient(os.path.join(d.home, "run", "envlet.sock")).ping()["pid"]
    with d.client(timeout_s=120) as c, c.create(d.plan_lock) as env:
        assert env.exec(["sh", "-c", "head -c 1000 /data/big | wc -c"]).stdout.strip() == b"1000"
        os.kill(old_pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            try:
                r = env.exec(["sh", "-c", "cat /data/other > /dev/null; echo rc=$?"], timeout_s=30)
            except Exception as e:
                raise AssertionError(f"{e}\n{d.log()[-4000:]}") from e
            took = time.monotonic() - t0
        finally:
            try:
                os.kill(old_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        # the deadline, a 2 s ping, the supervisor's tick, the kill: never the 90 s of the exec timeout
        assert not r.timed_out and took < deadline_s + 2 + 8, f"the read took {took:.0f} s: {r}"
        # cat fails, or sh itself cannot be loaded (its pages were on the aborted mount): a clear error
        assert b"rc=1" in r.stdout or r.exit_code == 126, r
        assert any(m in r.stderr for m in (b"Transport endpoint", b"connection abort", b"I/O error")), r
        assert "has not answered" in d.log()
        assert wait_for(lambda: _envlet_pid(d) not in (None, old_pid), 15)
        with c.create(d.plan_lock) as fresh:  # the new envlet serves new envs
            r = fresh.exec(["sh", "-c", "cat /data/other | wc -c"])
            assert r.stdout.strip() == b"300000", r


def _envlet_pid(d: DaemonHandle) -> int | None:
    from weenv.envlet import EnvletClient, EnvletError

    try:
        return int(EnvletClient(os.path.join(d.home, "run", "envlet.sock")).ping()["pid"])
    except EnvletError:
        return None


def test_a_wall_clock_jump_neither_expires_nor_keeps_envs(private_daemon) -> None:  # type: ignore[no-untyped-def]
    """The daemon's wall clock (its time.time, through the harness: the host's clock is never changed)
    jumps an hour ahead, then two hours back: an env with 60 s left lives on, and one with 3 s left
    still goes after about 3 s."""
    d = private_daemon()
    with d.client() as c:
        long = c.create(d.plan_lock, ttl_s=60)
        d.jump_clock(3600)
        time.sleep(1.5)  # six ticks of the ttl loop
        assert {e["id"]: e["status"] for e in c.list()}.get(long.id) == "running", "expired by a clock jump"
        short = c.create(d.plan_lock, ttl_s=3)
        time.sleep(0.5)  # the loop has seen its deadline
        d.jump_clock(-3600)
        assert wait_for(lambda: short.id not in {e["id"] for e in c.list()}, 8.0), "kept by a clock jump"
        assert long.id in {e["id"] for e in c.list()}
        long.kill()


def _half_made(d: DaemonHandle, c) -> list[str]:  # type: ignore[no-untyped-def]
    """Env dirs, snapshot records, snapshot trees and commit temp files on disk that nothing listed owns."""
    envs = {e["id"] for e in c.list()}
    snaps = {s["id"] for s in c.snapshots()}
    trees = {"sha256-" + layer["digest"].split(":", 1)[1] for s in snaps for layer in c.snapshot(s)["layers"]}
    left = [f"env dir {n}" for n in os.listdir(os.path.join(d.home, "envs")) if n not in envs]
    sdir = os.path.join(d.home, "snapshots")
    if os.path.isdir(sdir):
        left += [f"snapshot file {n}" for n in os.listdir(sdir) if n.split(".", 1)[0] not in snaps]
    tdir = os.path.join(d.home, "snapshot-trees")
    if os.path.isdir(tdir):
        left += [f"snapshot tree {n}" for n in os.listdir(tdir)
                 if n != ".id-base" and n not in trees]  # .id-base: the trees' owner
    blobs = os.path.join(d.home, "store", "blobs", "sha256")
    if os.path.isdir(blobs):
        left += [f"blob temp {n}" for n in os.listdir(blobs) if n.startswith(".")]
    return left


@pytest.mark.parametrize("op", ["create", "commit", "fork"])
def test_daemon_sigkill_during(private_daemon, op) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL of the daemon in the middle of a create, commit or fork, then a restart: every env it
    lists is whole (running, exec works), every snapshot it lists is whole (an env starts from it with
    the committed file), and once they are killed, deleted and collected nothing is left: no env
    dir, snapshot record or tree, mount, cgroup or container."""
    import threading

    d = private_daemon()
    with d.client(timeout_s=120) as c:
        base = c.create(d.plan_lock)
        assert base.exec(["sh", "-c", "head -c 24000000 /dev/urandom > /tmp/fill && echo ok"]).stdout == b"ok\n"
        for delay in (0.05, 0.4, 1.0):
            def go() -> None:
                try:
                    with d.client(timeout_s=60) as c2:
                        if op == "create":
                            c2.create(d.plan_lock)
                        elif op == "commit":
                            c2.get(base.id).commit()
                        else:
                            c2.get(base.id).fork(2, keep=True)
                except Exception:  # noqa: S110 (the daemon dies under it: any answer or none)
                    pass

            t = threading.Thread(target=go)
            t.start()
            time.sleep(delay)
            d.kill9()
            t.join(60)
            d.start()
            listed = c.list()
            assert base.id in {e["id"] for e in listed}
            for e in listed:
                assert e["status"] == "running", e
                r = c.get(e["id"]).exec(["true"], timeout_s=20)
                assert r.exit_code == 0 and not r.timed_out, (e["id"], r)
            for snap in c.snapshots():
                with c.create(snap["id"]) as child:
                    assert child.exec(["wc", "-c", "/tmp/fill"]).stdout.split()[0] == b"24000000"
            c.gc()  # takes what the cut-short call left: a tree or a blob with no snapshot
            assert _half_made(d, c) == [], f"after a SIGKILL {delay} s into {op}"
        for e in c.list():
            c.get(e["id"]).kill()
        for snap in c.snapshots():
            c.delete_snapshot(snap["id"])
        c.gc()
        assert _half_made(d, c) == []
    assert leftovers(d) == []


def test_commit_on_a_full_home_fails_clearly_and_leaves_nothing(private_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The daemon's home (store, snapshot trees, envlet cache) on a 160 MiB tmpfs filled to 4 MiB free:
    a commit of 24 MB fails with an error naming the full disk, the env runs on (thawed), no snapshot
    or half-written blob or tree is left; with room again the same commit works."""
    home = tmp_path / "home"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", str(home)], check=True)
    try:
        d = private_daemon(home=str(home))
        with d.client(timeout_s=120) as c, c.create(d.plan_lock) as env:
            assert env.exec(["sh", "-c", "head -c 24000000 /dev/urandom > /tmp/fill && echo ok"]).stdout == b"ok\n"
            st = os.statvfs(home)
            filler = home / "filler"
            with open(filler, "wb") as fh:
                left = st.f_bavail * st.f_frsize - (4 << 20)
                while left > 0:
                    left -= fh.write(b"\0" * min(left, 8 << 20))
            from weenv import ApiError

            with pytest.raises(ApiError) as ei:
                env.commit()
            assert "No space left" in str(ei.value) or "ENOSPC" in str(ei.value), ei.value
            r = env.exec(["sh", "-c", "echo alive > /tmp/a && cat /tmp/a"], timeout_s=20)
            assert r.stdout == b"alive\n" and not r.timed_out, r
            assert c.snapshots() == []
            c.gc()
            assert _half_made(d, c) == []
            filler.unlink()
            snap = env.commit()
            with c.create(snap) as child:
                assert child.exec(["wc", "-c", "/tmp/fill"]).stdout.split()[0] == b"24000000"
            c.delete_snapshot(snap)
    finally:
        pass  # the fixture tears the daemon down (and empties the home) after the test; then the unmount


@pytest.fixture(autouse=True)
def _unmount_tmpfs_homes(tmp_path):  # type: ignore[no-untyped-def]
    yield
    home = tmp_path / "home"
    if os.path.ismount(home):
        subprocess.run(["umount", "-l", str(home)], capture_output=True)


def test_a_fork_on_a_full_node_is_a_refusal_not_a_failure(private_daemon) -> None:  # type: ignore[no-untyped-def]
    """Found by the soak: a fork whose children the node cannot admit answered 500 (start_failed; the
    E2B SDK saw a SandboxException), where a create answers 503 not_admitted (E2B: 429 RateLimit).
    The parent runs on, no child is left, gc takes the fork's snapshot."""
    from weenv import ApiError

    d = private_daemon()
    with d.client(timeout_s=120) as c, c.create(d.plan_lock, cpu="1.5-2") as env:
        with pytest.raises(ApiError) as ei:
            env.fork(1)
        assert ei.value.status == 503 and ei.value.kind == "not_admitted", ei.value
        assert "not admitted" in str(ei.value)
        assert [e["id"] for e in c.list()] == [env.id]
        assert env.exec(["true"]).exit_code == 0
        c.gc()
        assert c.snapshots() == []


def test_every_test_the_fault_matrix_cites_exists():
    """`make soak` runs the tests benchmarks/soak.py's FAULTS and EXISTING_FUZZ tables name and
    publishes their results in docs/reliability.md: a renamed test must not silently drop its row
    (pytest refuses the whole run on an id it cannot find)."""
    from benchmarks import soak

    ids = sorted({t.split("[")[0] for _, _, ts in soak.FAULTS for t in ts} | {t for _, t, _ in soak.EXISTING_FUZZ})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                       cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    collected = {line.split("[")[0] for line in r.stdout.splitlines() if "::" in line}
    assert set(ids) <= collected, sorted(set(ids) - collected)
