"""Fair file serving (weenv/envlet/_fair.py): requests attributed to envs by pid → cgroup, and one
env's storm slowed to its share while another env is active. Units on a fake clock; then a real
envlet mount with real processes in two test cgroups (weenv.testing._envletfair)."""

from __future__ import annotations

import hashlib
import io
import socket
import time

import httpx
import pytest
import trio
import trio.testing

from weenv import layerfmt
from weenv.envlet import EnvletProcess, StoreSpec
from weenv.envlet._fair import HOST_ENV, REQUEST_OVERHEAD_S, EnvResolver, FairShare, env_of_cgroup_text
from weenv.testing._envletfair import TwoCgroups, cold_reads, fair_layer_tar, start_storm, stop_storm

# ------------------------------------------------------------------------------------- attribution


def test_the_env_is_the_cgroup_below_weenvs_parent_group_in_any_hierarchy():
    v1 = "12:pids:/weenv/e1a2\n11:memory:/weenv/e1a2\n0::/\n"
    assert env_of_cgroup_text(v1) == "e1a2"
    nested = "4:memory:/process_api/40f7/weenv/env-7/sub\n1:cpu:/\n"  # a daemon under its own cgroup
    assert env_of_cgroup_text(nested) == "env-7"
    assert env_of_cgroup_text("0::/system.slice/weenv/abc\n") == "abc"  # cgroup v2
    assert env_of_cgroup_text("0::/weenv\n") == HOST_ENV  # weenv's parent itself: the daemon, not an env
    assert env_of_cgroup_text("0::/user.slice/x\n4:pids:/\n") == HOST_ENV
    assert env_of_cgroup_text("0::/t/fair-1/storm\n", "fair-1") == "storm"
    assert env_of_cgroup_text("0::/t/weenvx/storm\n") == HOST_ENV  # a component, not a prefix


def test_the_resolver_reads_proc_once_per_pid_for_a_while(tmp_path):
    now = [0.0]
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "cgroup").write_text("8:pids:/weenv/a\n")
    r = EnvResolver(proc_dir=str(tmp_path), cache_s=2.0, clock=lambda: now[0])
    assert r(41) == "a"
    (tmp_path / "41" / "cgroup").write_text("8:pids:/weenv/b\n")  # the pid was reused by another env
    now[0] = 1.9
    assert r(41) == "a"  # cached
    now[0] = 2.1
    assert r(41) == "b"
    assert r(42) == HOST_ENV and r(0) == HOST_ENV  # gone, or made by the kernel


# ------------------------------------------------------------------------------------- the share


def _drive(fair: FairShare, workers: list[tuple[str, int, float, float, float, float]]) -> dict[str, list[float]]:
    """Closed-loop workers on a fake clock, as processes are: each (env, threads, cost, pause, start,
    end) thread sends a request, waits for it, pauses, and again, until ``end``. Returns each env's waits."""
    waits: dict[str, list[float]] = {}

    async def thread(env: str, cost: float, pause: float, start: float, end: float) -> None:
        await trio.sleep_until(start)
        while trio.current_time() < end:
            t0 = trio.current_time()
            u = await fair.admit(env, "lookup")
            waits.setdefault(env, []).append(trio.current_time() - t0)
            fair.charge(u, cost)
            await trio.sleep(cost + pause)  # the loop is busy for ``cost``; then the process thinks

    async def main() -> None:
        fair.clock = trio.current_time
        async with trio.open_nursery() as n:
            for env, threads, cost, pause, start, end in workers:
                for _ in range(threads):
                    n.start_soon(thread, env, cost, pause, start, end)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return waits


def test_an_env_alone_is_never_delayed_however_much_it_asks():
    fair = FairShare(share_cores=0.1)
    waits = _drive(fair, [("storm", 4, 1e-4, 0.0, 0.0, 1.0)])  # 4 threads, each a core's worth, for 1 s
    n = len(waits["storm"])
    assert n >= 4 * 9000 and max(waits["storm"]) == 0 and fair.envs["storm"].delayed == 0
    assert fair.envs["storm"].busy_s == pytest.approx(n * (1e-4 + REQUEST_OVERHEAD_S))


def test_a_storm_is_slowed_to_its_share_while_another_env_is_active_and_the_other_is_not_delayed():
    fair = FairShare(share_cores=0.2, burst_s=0.01)
    # a storm of 8 threads asking back to back (50 µs of loop each) for 2 s; a reader's light request
    # every 10 ms, and a burst of 100 of them (~5 ms of loop) at 1 s
    waits = _drive(fair, [("storm", 8, 5e-5, 0.0, 0.0, 2.0), ("reader", 1, 1e-5, 0.01, 0.0, 2.0),
                          ("reader", 1, 2e-5, 0.0, 1.0, 1.0 + 100 * 2e-5)])
    storm, reader = fair.envs["storm"], fair.envs["reader"]
    assert reader.delayed == 0 and max(waits["reader"]) == 0
    assert storm.delayed > 100
    # served at most its share, 0.2 cores / 2 envs, plus the burst, over the 2 s
    assert storm.busy_s <= 0.1 * 2.0 * 1.05 + 0.01 + 8 * (5e-5 + REQUEST_OVERHEAD_S)
    alone = FairShare(share_cores=0.2, burst_s=0.01)
    _drive(alone, [("storm", 8, 5e-5, 0.0, 0.0, 2.0)])
    assert alone.envs["storm"].busy_s > 5 * storm.busy_s  # the same storm, alone: as fast as it asks


def test_fairness_off_counts_but_never_delays_and_the_host_is_never_delayed_nor_counted_as_a_neighbour():
    off = FairShare(enabled=False, share_cores=0.1)
    waits = _drive(off, [("storm", 2, 5e-5, 0.0, 0.0, 0.5), ("reader", 1, 0.0, 0.01, 0.0, 0.5)])
    assert max(waits["storm"]) == 0 and off.envs["storm"].requests["lookup"] == len(waits["storm"]) > 1000
    on = FairShare(share_cores=0.1)
    waits = _drive(on, [(HOST_ENV, 2, 5e-5, 0.0, 0.0, 0.5), ("reader", 1, 0.0, 0.01, 0.0, 0.5)])
    assert max(waits[HOST_ENV]) == 0
    # and the host (the daemon extracting layer trees, tools) does not make an env share: one env
    # reading alongside it is alone
    waits = _drive(FairShare(share_cores=0.1), [(HOST_ENV, 2, 5e-5, 0.0, 0.0, 0.5), ("env", 2, 5e-5, 0.0, 0.0, 0.5)])
    assert max(waits["env"]) == 0


def test_what_an_env_used_alone_is_not_held_against_it_when_another_comes():
    fair = FairShare(share_cores=0.2, burst_s=0.01, max_wait_s=10.0)
    # "a" alone uses 4 cores' worth for 0.5 s; "b" comes at 0.6 s; "a" asks again at 0.61 s
    waits = _drive(fair, [("a", 4, 1e-3, 0.0, 0.0, 0.5), ("b", 1, 0.0, 1.0, 0.6, 0.61), ("a", 1, 0.0, 1.0, 0.61, 0.62)])
    assert waits["a"][-1] <= 2 * 0.01 / (0.2 / 2)  # at most the capped debt, not the 2 s it used


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="share_cores 0"):
        FairShare(share_cores=0)
    with pytest.raises(ValueError, match="burst_s"):
        FairShare(burst_s=-1)


# ------------------------------------------------------------------------------------- a real mount


@pytest.fixture
def fair_layer(tmp_path, require_root_fuse):  # type: ignore[no-untyped-def]
    blob = tmp_path / "layer.weenv"
    with open(blob, "wb") as f:
        res = layerfmt.build_layer(io.BytesIO(fair_layer_tar(sets=4)), f)
    return blob, "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest(), res


@pytest.fixture
def require_root_fuse():  # type: ignore[no-untyped-def]
    from tests.fixtures_common import require_fuse, require_root

    require_root()
    require_fuse()


@pytest.fixture
def groups():  # type: ignore[no-untyped-def]
    g = TwoCgroups()
    try:
        yield g
    finally:
        g.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _storm_rate_while_reader_active(groups: TwoCgroups, layer_dir: str, seconds: float = 2.0) -> float:
    """Storm lookups per second while the reader group looks up a name every 20 ms (so it is active)."""
    import subprocess
    import sys

    keepalive = subprocess.Popen(groups.argv("reader", sys.executable, "-c", (
        "import os, time, sys\n"
        f"end = time.monotonic() + {seconds + 0.5}\n"
        "i = 0\n"
        "while time.monotonic() < end:\n"
        "    try: os.stat(f'{sys.argv[1]}/keep-{os.getpid()}-{i}')\n"
        "    except FileNotFoundError: pass\n"
        "    i += 1; time.sleep(0.02)\n"), layer_dir))
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        storm = start_storm(groups, layer_dir, seconds, procs=2)
        for p in storm:
            p.wait(timeout=seconds + 30)
        n = stop_storm(storm)
        return n / (time.monotonic() - t0)
    finally:
        keepalive.kill()
        keepalive.wait()


def test_a_storm_from_one_cgroup_is_held_to_its_share_and_every_request_is_counted_for_its_env(
        tmp_path, fair_layer, groups):  # type: ignore[no-untyped-def]
    blob, digest, res = fair_layer
    port = _free_port()
    rates = {}
    for fair in (False, True):
        env = EnvletProcess(str(tmp_path / f"mnt-{fair}"), str(tmp_path / f"cache-{fair}"),
                            str(tmp_path / f"ctl-{fair}.sock"), fair=fair, fair_share_cores=0.05,
                            env_cgroup=groups.root, metrics_port=port if fair else None)
        env.start()
        try:
            info = env.client.register(StoreSpec("file", path=str(blob)), digest, res.size, res.toc_digest)
            rates[fair] = _storm_rate_while_reader_active(groups, info.path)
            cold_reads(groups, info.path, 2 if fair else 0)
            envs = env.client.stats()["envs"]
            storm, reader = envs["storm"], envs["reader"]
            # every request lands on the env that made it: lookups from the storm, opens and reads
            # (which carry no pid: charged through the opener's handle) from the reader
            assert storm["requests"]["lookup"] >= rates[fair] and storm["requests"]["read"] == 0
            assert reader["requests"]["open"] >= 100 and reader["requests"]["read"] >= 100
            assert reader["read_bytes"] >= 100 * 4096 and storm["busy_s"] > 0
            if fair:
                assert storm["delayed"] > 0 and reader["delayed"] == 0
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                assert 'weenv_envlet_env_requests_total{env="storm",op="lookup"}' in text
                assert 'weenv_envlet_env_delayed_requests_total{env="storm"}' in text
                from click.testing import CliRunner

                from weenv.cli import main

                out = CliRunner().invoke(main, ["cache", "stats", "--control-socket", str(tmp_path / "ctl-True.sock")])
                assert out.exit_code == 0 and "env storm" in out.output and "env reader" in out.output, out.output
            else:
                assert storm["delayed"] == 0
        finally:
            env.stop()
    # 0.05 cores / 2 envs at ~35 µs a lookup: ~700/s, plus the burst; unfair, thousands
    assert rates[True] < 1500, rates
    assert rates[False] > 2 * rates[True], rates


def test_real_envs_requests_are_charged_to_their_env_ids(tmp_path, monkeypatch, require_root_fuse):  # type: ignore[no-untyped-def]
    # a private daemon whose lowers stay on the envlet (no layer trees): its envlet is told the
    # daemon's cgroup root, and each env's lookups, opens and reads land on that env's id
    import os
    import tempfile

    from weenv.envlet import EnvletClient
    from weenv.testing import DaemonHandle, busybox_plan, teardown_private_daemon

    home = tempfile.mkdtemp(prefix="weenv-fair-")
    toml, lock = busybox_plan(home, "bb")
    monkeypatch.setenv("WEENV_HOME", home)
    monkeypatch.setenv("WEENV_LAYER_TREES_AFTER", "0")
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-fair-{os.getpid()}", lock, toml,
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    try:
        with d.client() as c:
            a, b = c.create(lock), c.create(lock)
            before = EnvletClient(os.path.join(home, "run", "envlet.sock")).stats()["envs"]
            r = a.exec(["sh", "-c", "ls -lR /bin /etc >/dev/null && cat /etc/passwd >/dev/null && stat /nx-a"])
            assert r.exit_code != 0 and b"nx-a" in r.stderr  # the missing name was looked up
            assert b.exec(["cat", "/etc/group"]).exit_code == 0
            envs = EnvletClient(os.path.join(home, "run", "envlet.sock")).stats()["envs"]
            ra, rb = envs[a.id]["requests"], envs[b.id]["requests"]
            ra0 = before.get(a.id, {}).get("requests", dict.fromkeys(ra, 0))
            assert ra["lookup"] > ra0["lookup"] and ra["readdir"] > ra0["readdir"], (ra0, ra)
            assert rb["lookup"] + rb["getattr"] + rb["open"] > 0, rb
            assert envs[a.id]["busy_s"] > envs[b.id]["busy_s"]  # a did much more
    finally:
        left = teardown_private_daemon(d)
        assert not left, left
