"""The daemon on real parts: lifecycle without leaks, concurrency, restart re-adoption, bad input."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
import trio

import weenv

from .fixtures_daemon import leftovers, wait_for

pytestmark = pytest.mark.integration


def test_lifecycle_start_exec_files_pause_resume_kill_leaves_nothing(daemon):
    with daemon.client() as c:
        env = c.create(daemon.plan_lock)
        assert env.info["status"] == "running"
        r = env.exec(["sh", "-c", "echo out; echo err >&2; hostname; exit 7"])
        assert (r.exit_code, r.stdout, r.stderr) == (7, b"out\n" + env.id.encode() + b"\n", b"err\n")
        assert env.exec("cat", stdin=b"piped").stdout == b"piped"  # str cmd runs via sh -c
        assert env.exec(["env"], env={"FOO": "bar"}).stdout.count(b"FOO=bar") == 1
        assert env.exec(["pwd"], cwd="/tmp").stdout == b"/tmp\n"
        assert env.exec(["id", "-u"], user="user").stdout == b"1000\n"
        # files
        env.write_file("/work/dir/a.txt", "hello\n")
        assert env.read_file("/work/dir/a.txt") == b"hello\n"
        assert env.exec(["cat", "/work/dir/a.txt"]).stdout == b"hello\n"
        env.mkdir("/work/sub")
        names = {e["name"] for e in env.list_dir("/work")}
        assert names == {"dir", "sub"}
        env.remove("/work", recursive=True)
        with pytest.raises(weenv.ApiError) as ei:
            env.read_file("/work/dir/a.txt")
        assert ei.value.status == 404
        # a symlink out of the rootfs resolves inside it
        env.exec(["ln", "-s", "/../../../../etc/passwd", "/tmp/escape"])
        assert env.read_file("/tmp/escape") == env.exec(["cat", "/etc/passwd"]).stdout != open("/etc/passwd", "rb").read()
        # streaming output
        seen = []
        r = env.exec(["sh", "-c", "echo one; sleep 0.2; echo two"], on_output=lambda s, d: seen.append((s, d)))
        assert r.exit_code == 0 and b"".join(d for s, d in seen if s == "stdout") == b"one\ntwo\n"
        # pause / resume
        env.pause()
        assert c.get(env.id).info["status"] == "paused"
        with pytest.raises(weenv.ApiError) as ei:
            env.exec(["true"])
        assert ei.value.status == 409 and "paused" in str(ei.value)
        env.resume()
        assert env.exec(["true"]).exit_code == 0
        env.kill()
        with pytest.raises(weenv.EnvNotFoundError):
            c.get(env.id)
        env.kill()  # idempotent
        assert c.gc()["envs"] == []
    assert leftovers(daemon) == []
    assert not os.path.exists(os.path.join(daemon.home, "envs", env.id))


def test_timeout_kills_the_whole_tree_and_missing_commands_are_clear(daemon):
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        t0 = time.monotonic()
        r = env.exec(["sh", "-c", "sleep 100 & sleep 100; echo never"], timeout_s=1.0)
        assert r.timed_out and r.exit_code == 137 and time.monotonic() - t0 < 10
        assert env.exec(["sh", "-c", "ps -o comm | grep -c sleep"]).stdout.strip() == b"0"
        r = env.exec(["no-such-command", "--flag"])
        assert r.exit_code == 127 and r.command_not_found and b"no-such-command" in r.stderr


def _sleepers(env, marker: str) -> int:
    out = env.exec(["sh", "-c", f"ps -o args | grep -c '^[s]leep {marker}'"]).stdout
    return int(out.strip() or b"0")


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_an_exec_whose_client_goes_away_is_killed(daemon, stream):
    """Closing the connection ends the command (and its children), not its own timeout minutes later."""
    import socket

    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        marker = "301" if stream else "302"
        body = json.dumps({"argv": ["sh", "-c", f"sleep {marker} & sleep {marker}"], "timeout_s": 600,
                           "stream": stream}).encode()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.socket)
        s.sendall(f"POST /v1/envs/{env.id}/exec HTTP/1.1\r\nhost: weenv\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: _sleepers(env, marker) == 2, timeout_s=10), "the command did not start"
        s.close()
        t0 = time.monotonic()
        assert wait_for(lambda: _sleepers(env, marker) == 0, timeout_s=5), \
            f"still running {time.monotonic() - t0:.1f} s after the client went away"
        assert env.exec(["echo", "ok"]).stdout == b"ok\n"  # the env and the daemon carry on


def test_upper_dir_is_bounded_and_a_full_disk_only_fails_inside(daemon):
    # memory min above the 64 MiB disk: the upper (tmpfs, charged to the env) must hit its size
    # bound, not the env's memory limit
    with daemon.client() as c, c.create(daemon.plan_lock, memory="160MiB-512MiB") as env, \
            c.create(daemon.plan_lock) as other:
        r = env.exec(["sh", "-c", "dd if=/dev/zero of=/fill bs=1M count=200 2>&1; echo rc=$?"], timeout_s=60)
        assert b"No space left" in r.stdout
        assert other.exec(["sh", "-c", "echo fine > /tmp/x && cat /tmp/x"]).stdout == b"fine\n"
        env.exec(["rm", "/fill"])
        assert env.exec(["sh", "-c", "echo again > /tmp/y && cat /tmp/y"]).stdout == b"again\n"


def test_writes_never_reach_the_lower_layers_or_the_host(daemon):
    with daemon.client() as c, c.create(daemon.plan_lock) as a, c.create(daemon.plan_lock) as b:
        a.exec(["sh", "-c", "echo mine > /bin/ls-note; rm /bin/cat; echo x > /etc/passwd"])
        assert b.exec(["cat", "/etc/passwd"]).stdout.startswith(b"root:")
        assert b.exec(["ls", "/bin/cat"]).exit_code == 0
        envlet_mnt = os.path.join(daemon.home, "envlet", "mnt")
        for layer in os.listdir(envlet_mnt):
            assert os.path.exists(os.path.join(envlet_mnt, layer, "bin", "cat"))
            assert not os.path.exists(os.path.join(envlet_mnt, layer, "bin", "ls-note"))
        r = a.exec(["sh", "-c", "ls /proc | grep -c '^[0-9]'"])
        assert int(r.stdout) < 10  # its own pid namespace
        assert b.exec(["cat", "/proc/net/route"]).stdout.count(b"\n") == 1  # network = none: no route at all
        assert b.exec(["ls", "/sys/class/net"]).stdout.split() == [b"lo"]


def test_concurrent_lifecycles_leave_no_leaks(daemon):
    n, parallel = (200, 16) if os.environ.get("WEENV_FULL_TESTS", "1") == "1" else (32, 8)
    failures: list[str] = []
    times: list[float] = []

    async def one(c: weenv.AsyncClient, i: int, limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            t0 = time.perf_counter()
            try:
                env = await c.create(daemon.plan_lock)
                try:
                    r = await env.exec(["sh", "-c", f"echo {i}"])
                    if r.stdout != f"{i}\n".encode():
                        failures.append(f"{i}: wrong output {r.stdout!r}")
                finally:
                    await env.kill()
            except Exception as e:  # noqa: BLE001 - collected and reported below
                failures.append(f"{i}: {type(e).__name__}: {e}")
            times.append(time.perf_counter() - t0)

    async def main() -> None:
        limiter = trio.CapacityLimiter(parallel)
        async with daemon.async_client() as c:
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, c, i, limiter)

    trio.run(main)
    assert failures == []
    with daemon.client() as c:
        assert c.list() == []
    assert leftovers(daemon) == []


def test_async_client_under_asyncio(daemon):
    async def main() -> bytes:
        async with daemon.async_client() as c:
            async with await c.create(daemon.plan_lock) as env:
                await env.write_file("/tmp/f", b"async")
                out = await env.exec(["cat", "/tmp/f"])
                return out.stdout

    assert asyncio.run(main()) == b"async"


def test_ttl_expiry_kills_the_env_and_timeout_resets_it(daemon):
    with daemon.client() as c:
        env = c.create(daemon.plan_lock, ttl_s=1.0)
        keep = c.create(daemon.plan_lock, ttl_s=1.0)
        keep.set_timeout(60)
        assert wait_for(lambda: env.id not in {e["id"] for e in c.list()}, timeout_s=10)
        assert keep.id in {e["id"] for e in c.list()}
        keep.kill()


def test_bad_input_gets_clear_errors_and_the_daemon_keeps_serving(daemon, tmp_path):
    with daemon.client() as c:
        bad = tmp_path / "bad.toml"
        bad.write_text('name = "x"\n[[groups]]\nname = "os"\nref = ""\nclass = "os"\n')
        with pytest.raises(weenv.ApiError) as ei:
            c.create(str(bad))
        assert ei.value.status == 400 and "groups[0].ref" in str(ei.value)
        missing = tmp_path / "missing.toml"
        missing.write_text('name = "x"\n[[groups]]\nname = "os"\nref = "nope:v1"\nclass = "os"\n')
        with pytest.raises(weenv.ApiError) as ei:
            c.create(str(missing))
        assert "nope" in str(ei.value)
        with pytest.raises(weenv.EnvNotFoundError):
            c.get("no-such-env")
        with pytest.raises(weenv.ApiError) as ei:
            c.create(daemon.plan_lock, memory="1TiB")  # within what a plan takes, far above this node
        assert ei.value.status == 503 and "memory" in str(ei.value)
        with c.create(daemon.plan_lock) as env:
            assert env.exec(["true"]).exit_code == 0
    assert leftovers(daemon) == []


def test_an_unlocked_plan_is_locked_by_the_daemon(daemon):
    with daemon.client() as c, c.create(daemon.plan_toml) as env:
        assert env.exec(["echo", "ok"]).stdout == b"ok\n"


def test_daemon_sigkill_then_restart_readopts_live_envs(daemon):
    with daemon.client() as c:
        live = c.create(daemon.plan_lock)
        live.exec(["sh", "-c", "echo kept > /tmp/state"])
        paused = c.create(daemon.plan_lock)
        paused.pause()
    daemon.kill9()
    daemon.start()
    with daemon.client() as c:
        ids = {e["id"]: e["status"] for e in c.list()}
        assert ids == {live.id: "running", paused.id: "paused"}
        env = c.get(live.id)
        assert env.exec(["cat", "/tmp/state"]).stdout == b"kept\n"
        c.get(paused.id).resume()
        assert c.get(paused.id).exec(["true"]).exit_code == 0
        top = c.top()
        assert live.id in top["envs"]
        env.kill()
        c.get(paused.id).kill()
    assert leftovers(daemon) == []


def test_a_pause_without_memory_ends_the_processes_keeps_the_files_and_boots_again(daemon):
    """Issue 29 item 12 (daemon side): ``pause(memory=False)`` ends every process of the env and keeps
    its files; it holds no memory while paused; resume boots it again (a new boot id, processes gone),
    a daemon restart keeps it paused, commit and kill still work; gc leaves it alone."""
    with daemon.client() as c:
        env = c.create(daemon.plan_lock)
        env.exec(["sh", "-c", "echo kept > /root/state; (sleep 1000 &) ; sleep 0.1"])
        boot = env.exec(["cat", "/proc/sys/kernel/random/boot_id"]).stdout
        env.pause(memory=False)
        assert c.get(env.id).info["status"] == "paused"
        assert env.id not in c.top()["envs"]  # nothing running: nothing for the monitor to hold
        with pytest.raises(weenv.ApiError, match="paused"):
            env.exec(["true"])
        assert env.read_file("/root/state") == b"kept\n"  # files stay readable
        env.pause(memory=False)  # again: nothing to do
        assert c.gc()["envs"] == []
    daemon.kill9()
    daemon.start()
    with daemon.client() as c:
        assert {e["id"]: e["status"] for e in c.list()} == {env.id: "paused"}
        env = c.get(env.id)
        env.resume()
        assert env.exec(["cat", "/root/state"]).stdout == b"kept\n"
        assert env.exec(["cat", "/proc/sys/kernel/random/boot_id"]).stdout != boot
        assert env.exec(["sh", "-c", "ps -o args | grep -c '^[s]leep 1000'"]).stdout.strip() == b"0"
        env.write_file("/root/two", "2")
        env.pause()  # a frozen env may end its processes too
        env.pause(memory=False)
        env.resume()
        assert env.exec(["cat", "/root/two"]).stdout == b"2"
        env.pause(memory=False)
        child = c.create(env.commit())  # a commit of its files
        assert child.exec(["cat", "/root/state"]).stdout == b"kept\n"
        child.kill()
        env.kill()
    assert leftovers(daemon) == []


def test_cli_up_exec_ps_kill(daemon):
    env_vars = daemon.env_vars()

    def weenv_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "weenv", *args], env=env_vars, capture_output=True, text=True,
                              check=check, timeout=60)

    info = json.loads(weenv_cli("up", daemon.plan_lock, "--json").stdout)
    env_id = info["id"]
    r = weenv_cli("exec", env_id, "--", "sh", "-c", "echo hi; exit 5", check=False)
    assert r.returncode == 5 and r.stdout == "hi\n"
    ps = json.loads(weenv_cli("ps", "--json").stdout)
    assert [e["id"] for e in ps] == [env_id] and ps[0]["resources"]["cpu"]["quota_cores"] >= 0.05
    src = os.path.join(daemon.home, "cp-src.txt")
    with open(src, "w") as f:
        f.write("copied\n")
    weenv_cli("cp", src, f"{env_id}:/tmp/c.txt")
    assert weenv_cli("exec", env_id, "--", "cat", "/tmp/c.txt").stdout == "copied\n"
    weenv_cli("kill", env_id)
    r = weenv_cli("exec", env_id, "--", "true", check=False)
    assert r.returncode == 1 and "no such env" in r.stderr


def test_a_pulled_image_config_becomes_plan_defaults(daemon, busybox_oci, tmp_path, monkeypatch):
    from weenv.registry import pull

    monkeypatch.setenv("WEENV_HOME", daemon.home)
    pull(f"oci:{busybox_oci}:bb", name="imported/bb:v1")
    plan = tmp_path / "imported.toml"
    plan.write_text('name = "imported"\n[[groups]]\nname = "os"\nref = "imported/bb:v1"\nclass = "os"\n'
                    '[env]\nPLAN = "wins"\n[resources.cpu]\nmin = 0.05\nmax = 1.0\n')
    with daemon.client() as c, c.create(str(plan)) as env:
        out = env.exec(["sh", "-c", "echo $FOO $PLAN; pwd; id -u"]).stdout
        assert out == b"bar wins\n/srv\n1000\n"


def test_warm_pool_hands_out_started_envs_and_drops_idle_pools(tmp_path, monkeypatch):
    import tempfile

    from .fixtures_daemon import DaemonHandle, busybox_plan, teardown_private_daemon

    home = tempfile.mkdtemp(prefix="weenv-pool-")
    plan, lock = busybox_plan(home, "pool")
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-pool-{os.getpid()}", lock, plan,
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    monkeypatch.setenv("WEENV_POOL_SIZE", "2")
    monkeypatch.setenv("WEENV_POOL_IDLE_S", "3")
    d.start()
    try:
        with d.client() as c:
            first = c.create(lock)
            assert "pool" not in first.info["timings_ms"]  # a miss starts the pool
            assert wait_for(lambda: len(os.listdir(os.path.join(home, "envs"))) == 3, timeout_s=20)
            log = os.path.join(home, "daemon.log")  # both pooled envs finish starting (a fixed 0.5 s was a guess)
            assert wait_for(lambda: open(log).read().count(" pooled (") == 2, timeout_s=20), open(log).read()[-2000:]
            second, third = c.create(lock, ttl_s=30), c.create(lock)
            assert "pool" in second.info["timings_ms"] and "pool" in third.info["timings_ms"]
            assert second.info["expires_s"] is not None  # the TTL starts at hand-out
            second.exec(["sh", "-c", "echo mine > /tmp/f"])
            assert third.exec(["cat", "/tmp/f"]).exit_code != 0  # pooled envs are independent
            assert {e["id"] for e in c.list()} == {first.id, second.id, third.id}  # pooled ones are not listed
            for e in (first, second, third):
                e.kill()
            # nobody asks for this lock any more: its pool goes after the idle time
            assert wait_for(lambda: os.listdir(os.path.join(home, "envs")) == [], timeout_s=30)
    finally:
        log = d.log()
        left = teardown_private_daemon(d)
        assert left == [], (left, log[-5000:])


def test_the_agent_socket_is_out_of_reach_inside_the_env(daemon):
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        assert env.exec(["ls", "/dev/.weenv"]).exit_code != 0  # no socket path inside the env at all
        r = env.exec(["ls", "/proc/1/fd"], user="user")
        assert r.exit_code != 0 and b"denied" in r.stderr  # the init's inherited socket is root's
        assert env.exec(["id", "-u"], user="user").stdout == b"1000\n"
        r = env.exec(["sh", "-c", "cat /proc/self/status | grep CapEff"], user="user")
        assert r.stdout.split()[-1] == b"0000000000000000"  # a non-root command has no capability


def test_network_host_is_an_explicit_opt_in_with_egress(daemon):
    with daemon.client() as c:
        with c.create(daemon.plan_lock) as isolated, c.create(daemon.plan_lock, network="host") as host:
            assert isolated.exec(["cat", "/proc/net/route"]).stdout.count(b"\n") == 1
            assert isolated.exec(["ls", "/sys/class/net"]).stdout.split() == [b"lo"]
            host_ifaces = set(os.listdir("/sys/class/net"))
            assert set(host.exec(["ls", "/sys/class/net"]).stdout.decode().split()) == host_ifaces


def test_autostart_starts_one_daemon_for_concurrent_clients(tmp_path, monkeypatch):
    import threading as _threading

    from .fixtures_common import require_fuse

    require_fuse()
    home = str(tmp_path / "home")
    sock = os.path.join(home, "run", "weenv.sock")
    with pytest.raises(weenv.DaemonUnavailableError, match="WEENV_AUTOSTART=0"):
        weenv.Client(sock).ping()
    monkeypatch.setenv("WEENV_AUTOSTART", "1")
    pids: list[int] = []

    def ping() -> None:
        with weenv.Client(sock) as c:
            pids.append(c.ping()["pid"])

    threads = [_threading.Thread(target=ping) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(pids) == 4 and len(set(pids)) == 1
        running = subprocess.run(["pgrep", "-f", "weenv daemon"], capture_output=True, text=True).stdout.split()
        mine = [p for p in running if f"WEENV_HOME={home}" in open(f"/proc/{p}/environ").read().replace("\0", " ")]
        assert mine == [str(pids[0])]
    finally:
        os.kill(pids[0], 15) if pids else None
        from weenv.envlet import EnvletClient

        time.sleep(1)
        try:
            os.kill(EnvletClient(os.path.join(home, "run", "envlet.sock")).ping()["pid"], 15)
            time.sleep(1)
        except Exception:
            pass
        subprocess.run(["fusermount3", "-u", "-z", os.path.join(home, "envlet", "mnt")], capture_output=True)
        from weenv.provision.cgroups import detect_backend

        detect_backend("weenv").remove_parent()  # the autostarted daemon's parent group (empty by now)
