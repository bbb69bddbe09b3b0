"""Elastic resources through the real daemon (crun, cgroup v1, overlayfs, envlet): quotas follow the
load, memory grows by doubling without a kill under max, an OOM kill past max stays inside its env,
admission refuses envs whose min does not fit, and `weenv top`, `ps --json`, /v1/top and
/v1/metrics show it all.

The module starts its own daemon with monitor flags (a short hold so idle envs come back within a
test's patience; a node reserve the test can see in /v1/top), through `weenv daemon`'s options.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

import weenv

from .fixtures_common import require_command, require_fuse
from .fixtures_daemon import DaemonHandle, busybox_plan, leftovers, wait_for

pytestmark = pytest.mark.integration

MIB = 1 << 20
HOLD_S = 0.5
RESERVE = "256MiB"
DAEMON_FLAGS = ["--hold", str(HOLD_S), "--node-reserve", RESERVE, "--memory-headroom", "16MiB",
                "--monitor-interval-ms", "200"]


class ElasticDaemon(DaemonHandle):
    """The fixtures' daemon handle, started with monitor flags."""

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weenv", "daemon", "--cgroup-root", self.cgroup_root, *DAEMON_FLAGS],
            env=self.env_vars(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
        log.close()
        ok = wait_for(lambda: self._answers(), timeout_s=timeout_s)
        if not ok:
            raise RuntimeError(f"weenv daemon did not answer within {timeout_s} s:\n{self.log()[-3000:]}")

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"weenv daemon exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        try:
            with self.client() as c:
                c.ping()
            return True
        except weenv.WeenvError:
            return False


@pytest.fixture(scope="module")
def edaemon() -> Iterator[ElasticDaemon]:
    require_fuse()
    require_command("crun")
    require_command("gcc")
    home = tempfile.mkdtemp(prefix="weenv-elastic-")
    plan, lock = busybox_plan(home, "el")
    handle = ElasticDaemon(home, os.path.join(home, "run", "weenv.sock"), f"weenv-elastic-{os.getpid()}", lock, plan,
                           os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    try:
        handle.start()
        _favour_envs_on_a_busy_host(handle.cgroup_root)
        yield handle
    finally:
        try:
            with handle.client() as c:
                for info in c.list():
                    c.get(info["id"]).kill()
                c.gc()
        except weenv.WeenvError:
            pass
        if handle.proc is not None:
            handle.stop()
        try:
            from weenv.envlet import EnvletClient

            pid = EnvletClient(os.path.join(home, "run", "envlet.sock")).ping()["pid"]
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout_s=5)
        except Exception:
            pass
        subprocess.run(["fusermount3", "-u", "-z", os.path.join(home, "envlet", "mnt")], capture_output=True)
        left = leftovers(handle)
        from weenv.provision.cgroups import detect_backend

        try:
            detect_backend(handle.cgroup_root).remove_parent()
        except Exception:
            pass
        shutil.rmtree(home, ignore_errors=True)
        assert not left, f"the elastic tests left: {left}"


def _favour_envs_on_a_busy_host(cgroup_root: str) -> None:
    """Give the test daemon's parent cpu group 10x the default CFS weight. Every group competes
    with each other process on the host as one entity, so on a 2-core host busy with other test
    runs an env could not use even half a core, never be throttled at its quota, and the CPU
    tests would measure the neighbours. (A node would put weenv's parent in a weighted slice.)"""
    own = next(line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup")
               if "cpu" in line.split(":")[1].split(","))
    path = f"/sys/fs/cgroup/cpu{own.rstrip('/')}/{cgroup_root}/cpu.shares"
    if os.path.exists(path):
        with open(path, "w") as f:
            f.write("10240")


@pytest.fixture
def client(edaemon: ElasticDaemon) -> Iterator[weenv.Client]:
    with edaemon.client() as c:
        yield c
        for info in c.list():
            c.get(info["id"]).kill()


@pytest.fixture(scope="module")
def rollout() -> bytes:
    """A static helper that allocates memory from user space (busybox has no python)."""
    from weenv.testing import rollout_binary

    return rollout_binary().read_bytes()


def resources(c: weenv.Client, env_id: str) -> dict:
    return c.top()["envs"][env_id]


def watch(c: weenv.Client, env_id: str, key: str, until, timeout_s: float, interval_s: float = 0.01) -> list:
    """Poll /v1/top; the distinct values of ``resources[key[0]][key[1]]`` seen until ``until(value)``."""
    seen: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = resources(c, env_id)[key[0]][key[1]]
        if not seen or seen[-1] != value:
            seen.append(value)
        if until(value):
            return seen
        time.sleep(interval_s)
    raise AssertionError(f"{env_id}: {key} went {seen} and did not reach the goal within {timeout_s} s")


def path(daemon: DaemonHandle, env_id: str, resource: str) -> list[float]:
    """Every value the monitor gave ``resource`` of the env, in order, from its log lines
    (``env ID: cpu 0.25 -> 0.5 cores: ...``, ``env ID: memory 32 MiB -> 64 MiB: ...``): polling
    /v1/top misses steps the monitor takes within a few ms (a stalled task is answered between
    ticks) or while a loaded test process does not run. Values in cores or MiB."""
    pattern = re.compile(rf"env {re.escape(env_id)}: {resource} ([0-9.]+)(?: MiB| cores)? -> ([0-9.]+)")
    out: list[float] = []
    for m in pattern.finditer(daemon.log()):
        before, after = float(m[1]), float(m[2])
        assert not out or out[-1] == before, (out, m[0])  # one change follows the other
        out.extend([before, after] if not out else [after])
    return out


def test_daemon_flags_reach_the_monitor(client):
    top = client.top()
    assert top["policy"]["hold_s"] == HOLD_S
    assert top["policy"]["node_memory_reserve_bytes"] == 256 * MIB
    assert top["policy"]["memory_headroom_bytes"] == 16 * MIB
    assert top["policy"]["memory_burst_reservation"] is True
    assert top["interval_ms"] == 200
    # Other thresholds keep their defaults.
    assert top["policy"]["memory_high_water"] == 0.80 and top["policy"]["cpu_throttle_up_share"] == 0.30


def test_cpu_hungry_env_reaches_max_within_a_second_then_idles_back_to_min(edaemon, client):
    with client.create(edaemon.plan_lock, cpu="0.25-1", memory="32MiB-256MiB") as env:
        assert resources(client, env.id)["cpu"]["quota_cores"] == 0.25
        ticks0 = client.top()["ticks"]
        t0 = time.monotonic()
        # Two spinning shells: on a loaded 2-core host one alone may not use its whole quota.
        r = env.exec("(while :; do :; done) >/dev/null 2>&1 & (while :; do :; done) >/dev/null 2>&1 & echo started")
        assert r.stdout == b"started\n"
        seen = watch(client, env.id, ("cpu", "quota_cores"), lambda q: q == 1.0, timeout_s=10)
        up_s, up_ticks = time.monotonic() - t0, client.top()["ticks"] - ticks0
        print(f"cpu quota went {seen} in {up_s:.2f} s ({up_ticks} ticks)")
        assert seen[-1] == 1.0, seen
        assert path(edaemon, env.id, "cpu") == [0.25, 0.5, 1.0]  # doubling, never past max
        # Two doublings take two throttled ticks; "about a second", with slack for a loaded host.
        assert up_s <= 2.0, f"took {up_s:.2f} s"
        env.exec("kill $(ps -o pid,args | grep 'while' | grep -v grep | awk '{print $1}')")
        t0 = time.monotonic()
        seen = watch(client, env.id, ("cpu", "quota_cores"), lambda q: q == 0.25, timeout_s=15, interval_s=0.05)
        print(f"idle: cpu quota went {seen} in {time.monotonic() - t0:.2f} s (hold {HOLD_S} s per halving)")
        assert path(edaemon, env.id, "cpu") == [0.25, 0.5, 1.0, 0.5, 0.25]
        res = resources(client, env.id)
        m = res["metrics"]
        assert (m["cpu_up"], m["cpu_down"], m["oom_kills"]) == (2, 2, 0) and m["throttled_ns"] > 0
        assert res["last_change"]["resource"] == "cpu" and res["last_change"]["direction"] == "down"
        assert res["last_change"]["to"] == 0.25 and "for 0.5 s" in res["last_change"]["reason"]
        # `weenv ps --json` carries the same view.
        ps = [e for e in client.list() if e["id"] == env.id][0]["resources"]
        assert ps["cpu"]["quota_cores"] == 0.25 and ps["cpu"]["min_cores"] == 0.25 and ps["cpu"]["max_cores"] == 1.0
        assert ps["metrics"]["cpu_up"] == 2 and ps["metrics"]["throttled_ns"] >= m["throttled_ns"]


def test_envs_from_a_snapshot_start_at_the_cpu_quota_of_their_source(edaemon, client):
    with client.create(edaemon.plan_lock, cpu="0.25-1", memory="32MiB-256MiB") as env:
        env.exec("(while :; do :; done) >/dev/null 2>&1 & (while :; do :; done) >/dev/null 2>&1 & echo started")
        assert watch(client, env.id, ("cpu", "quota_cores"), lambda q: q == 1.0, timeout_s=10)[-1] == 1.0
        snap = env.commit()
        assert client.snapshot(snap)["cpu_quota_cores"] == 1.0
        try:
            with client.create(snap) as child:  # a fork of a busy env starts busy, not at its min
                assert resources(client, child.id)["cpu"]["quota_cores"] == 1.0
                assert resources(client, child.id)["cpu"]["min_cores"] == 0.25
                seen = watch(client, child.id, ("cpu", "quota_cores"), lambda q: q == 0.25, timeout_s=15)
                assert seen[-1] == 0.25 and path(edaemon, child.id, "cpu") == [1.0, 0.5, 0.25]  # like any env
        finally:
            client.delete_snapshot(snap)
    with client.create(edaemon.plan_lock, cpu="0.25-1") as idle:  # an idle source gives its min
        snap = idle.commit()
        try:
            with client.create(snap) as child:
                assert resources(client, child.id)["cpu"]["quota_cores"] == 0.25
        finally:
            client.delete_snapshot(snap)


def test_memory_grows_by_doubling_while_a_process_allocates_and_nothing_is_killed(edaemon, client, rollout):
    with client.create(edaemon.plan_lock, cpu="1", memory="32MiB-512MiB") as env:
        env.write_file("/usr/bin/rollout", rollout, mode=0o755)
        fast0 = client.top()["statistics"]["fast_steps"]
        result = {}

        def run() -> None:
            # 300 MiB written page by page from user space, held 1 s.
            result["r"] = env.exec(["rollout", "alloc", "300", "1000"], timeout_s=60)

        worker = threading.Thread(target=run)
        t0 = time.monotonic()
        worker.start()
        try:
            seen = watch(client, env.id, ("memory", "limit_bytes"), lambda v: v >= 512 * MIB, timeout_s=20,
                         interval_s=0.005)
        finally:
            worker.join(60)
        print("memory limit went", " -> ".join(f"{x // MIB}" for x in seen), f"MiB; exec took "
              f"{result['r'].duration_s:.2f} s for a 1 s hold ({time.monotonic() - t0:.2f} s)")
        r = result["r"]
        assert (r.exit_code, r.stdout) == (0, b"ok\n"), r
        assert path(edaemon, env.id, "memory") == [32, 64, 128, 256, 512]
        res = resources(client, env.id)
        m = res["metrics"]
        assert m["oom_kills"] == 0 and m["memory_up"] == 4 and m["memory_refusals"] == 0
        assert m["memory_limit_hits"] > 0  # it did press against each limit
        # The tasks that stalled at a limit were answered between ticks (memory events).
        assert client.top()["statistics"]["fast_steps"] > fast0
        # Freed: the limit comes back down (hold 0.5 s per halving), to the min (usage + the
        # 16 MiB headroom is below it).
        seen = watch(client, env.id, ("memory", "limit_bytes"), lambda v: v == 32 * MIB, timeout_s=15,
                     interval_s=0.05)
        assert path(edaemon, env.id, "memory") == [32, 64, 128, 256, 512, 256, 128, 64, 32]
        assert env.exec("echo alive").stdout == b"alive\n"


def test_past_its_max_a_process_is_oom_killed_inside_its_own_env_only(edaemon, client, rollout):
    with client.create(edaemon.plan_lock, cpu="1", memory="32MiB-128MiB", name="greedy") as greedy, \
            client.create(edaemon.plan_lock, cpu="1", memory="32MiB-128MiB", name="calm") as calm:
        greedy.write_file("/usr/bin/rollout", rollout, mode=0o755)
        calm.exec("sleep 1000 >/dev/null 2>&1 &")
        r = greedy.exec(["rollout", "alloc", "300", "1000"], timeout_s=60)
        assert r.exit_code == 137 and r.stdout == b""  # SIGKILL from the kernel's OOM killer
        assert wait_for(lambda: resources(client, greedy.id)["metrics"]["oom_kills"] >= 1, timeout_s=5)
        res = resources(client, greedy.id)
        # It grew to its max by doubling first, and was killed there.
        assert res["memory"]["limit_bytes"] == 128 * MIB and res["metrics"]["memory_up"] == 2
        # The env, its neighbour and the daemon live on.
        assert greedy.exec("echo alive").stdout == b"alive\n"
        assert b"sleep 1000" in calm.exec("ps -o args").stdout
        assert resources(client, calm.id)["metrics"]["oom_kills"] == 0
        assert client.ping()["envs"] == 2
        assert client.top()["totals"]["oom_kills"] >= 1
        # ps --json and prometheus carry the kill.
        ps = {e["id"]: e for e in client.list()}
        assert ps[greedy.id]["resources"]["metrics"]["oom_kills"] >= 1
        assert ps[calm.id]["resources"]["metrics"]["oom_kills"] == 0
        samples = prometheus(client)
        assert samples[("weenv_env_oom_kills_total", (("env", greedy.id),))] >= 1
        assert samples[("weenv_env_oom_kills_total", (("env", calm.id),))] == 0
        assert samples[("weenv_oom_kills_total", ())] >= 1


def prometheus(c: weenv.Client) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    resp = c.connection.request("metrics")
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(resp.text) for s in fam.samples}


def test_admission_refuses_an_env_whose_min_does_not_fit(edaemon, client):
    node = client.top()["node"] or {}
    total = node.get("memory_total_bytes") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    refused0 = client.top()["statistics"]["admission_refusals"]
    # Memory: a min of the whole node never fits next to the reserve.
    gib = -(-total // (1 << 30))
    with pytest.raises(weenv.ApiError) as ei:
        client.create(edaemon.plan_lock, memory=f"{gib}GiB")
    assert ei.value.status == 503 and ei.value.kind == "not_admitted" and "memory min" in str(ei.value)
    # CPU: mins add up to at most the node's cores (2 here, or whatever this host has).
    cores = client.top()["node"]["cpu_cores"]
    big = round(cores * 0.75, 2)
    with client.create(edaemon.plan_lock, cpu=str(big), memory="32MiB-64MiB") as first:
        with pytest.raises(weenv.ApiError) as ei:
            client.create(edaemon.plan_lock, cpu=str(big), memory="32MiB-64MiB")
        assert ei.value.status == 503 and "cpu min" in str(ei.value), ei.value
        # The refused env left nothing behind, and the first one is untouched.
        assert [e["id"] for e in client.list()] == [first.id]
        assert first.exec("echo ok").stdout == b"ok\n"
    # With the first gone, the same request fits.
    with client.create(edaemon.plan_lock, cpu=str(big), memory="32MiB-64MiB") as second:
        assert second.exec("echo ok").stdout == b"ok\n"
    stats = client.top()["statistics"]
    assert stats["admission_refusals"] == refused0 + 2
    assert prometheus(client)[("weenv_refusals_total", (("resource", "admission"),))] == refused0 + 2
    assert leftovers(edaemon) == []


def test_weenv_top_once_json_live_and_ps_json(edaemon, client):
    from click.testing import CliRunner

    from weenv.cli import main

    with client.create(edaemon.plan_lock, cpu="0.25-1", memory="32MiB-256MiB") as env:
        # Let the monitor take a reading of it.
        assert wait_for(lambda: resources(client, env.id)["memory"]["used_bytes"] is not None, timeout_s=5)
        runner = CliRunner(env={"WEENV_HOME": edaemon.home, "COLUMNS": "200"})
        out = runner.invoke(main, ["top", "--once"])
        assert out.exit_code == 0, out.output
        row = next(line for line in out.output.splitlines() if line.split()[:1] == [env.id])
        assert "/0.25" in row and "0.25-1.00" in row and "/32.0MiB" in row and "256.0MiB" in row, row
        assert "1 env ·" in out.output and "admission refused" in out.output
        assert "layer trees " in out.output and "of 16.0GiB" in out.output
        out = runner.invoke(main, ["top", "--json"])
        assert out.exit_code == 0, out.output
        top = json.loads(out.output)
        assert top["envs"][env.id]["memory"]["limit_bytes"] == 32 * MIB and "statistics" in top
        out = runner.invoke(main, ["ps", "--json"])
        assert out.exit_code == 0, out.output
        (ps,) = [e for e in json.loads(out.output) if e["id"] == env.id]
        assert ps["resources"]["memory"]["max_bytes"] == 256 * MIB
        assert set(ps["resources"]["metrics"]) >= {"cpu_up", "cpu_down", "memory_up", "memory_down", "cpu_refusals",
                                                   "memory_refusals", "throttled_ns", "oom_kills", "oom_events"}
        # The live view: three refreshes, then it stops by itself.
        proc = subprocess.run([sys.executable, "-m", "weenv", "top", "--interval", "0.2", "-n", "3"],
                              env={**edaemon.env_vars(), "COLUMNS": "200"}, capture_output=True, timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert env.id.encode() in proc.stdout and b"MEM USED/LIMIT" in proc.stdout


def test_daemon_rejects_bad_monitor_flags(tmp_path):
    r = subprocess.run([sys.executable, "-m", "weenv", "daemon", "--memory-low-water", "0.9"],
                       env={**os.environ, "WEENV_HOME": str(tmp_path)}, capture_output=True, timeout=30)
    assert r.returncode == 2 and b"--memory-low-water" in r.stderr
    r = subprocess.run([sys.executable, "-m", "weenv", "daemon", "--node-reserve", "lots"],
                       env={**os.environ, "WEENV_HOME": str(tmp_path)}, capture_output=True, timeout=30)
    assert r.returncode == 2 and b"not a size" in r.stderr
    assert not os.path.exists(tmp_path / "run" / "weenv.sock")
