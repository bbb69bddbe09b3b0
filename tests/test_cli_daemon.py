"""`weenv daemon status` / `weenv daemon stop` and SIGTERM on a private real daemon (issue 14, item 7):
the envlet and its mount go with the daemon unless envs kept running still stack its layers."""

from __future__ import annotations

import os
import tempfile

import pytest
from click.testing import CliRunner

from weenv.cli import main

from .fixtures_daemon import DaemonHandle, busybox_plan, leftovers, teardown_private_daemon, wait_for

pytestmark = pytest.mark.integration


def private_daemon(tag: str) -> DaemonHandle:
    home = tempfile.mkdtemp(prefix=f"weenv-{tag}-")
    plan, lock = busybox_plan(home)
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-{tag}-{os.getpid()}", lock, plan,
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    return d


def envlet_pid(d: DaemonHandle) -> int | None:
    from weenv.envlet import EnvletClient, EnvletError

    try:
        return int(EnvletClient(os.path.join(d.home, "run", "envlet.sock")).ping()["pid"])
    except EnvletError:
        return None


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cli(d: DaemonHandle, *args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, list(args), env={"WEENV_HOME": d.home})


def test_daemon_stop_keeps_the_envlet_for_kept_envs_and_kill_envs_stops_everything() -> None:
    d = private_daemon("stop")
    mnt = os.path.join(d.home, "envlet", "mnt")
    try:
        r = cli(d, "daemon", "status")
        assert r.exit_code == 0 and f"pid {d.proc.pid}" in r.output and "envlet  running" in r.output, r.output
        with d.client() as c:
            env = c.create(d.plan_lock)
        init_pid, envlet = env.info["init_pid"], envlet_pid(d)
        assert envlet and init_pid

        r = cli(d, "daemon", "stop")
        assert r.exit_code == 0, r.output
        assert f"daemon stopped (pid {d.proc.pid})" in r.output and "envlet kept" in r.output, r.output
        assert d.proc.wait(10) == 0
        assert running(init_pid) and running(envlet) and os.path.ismount(mnt)  # the env keeps working
        r = cli(d, "daemon", "status")
        assert r.exit_code == 3 and "daemon  not running" in r.output and f"pid {envlet}" in r.output, r.output
        assert "not running" in cli(d, "daemon", "stop").output

        d.start()  # re-adopts the env; then everything goes
        with d.client() as c:
            assert env.id in {e["id"] for e in c.list()}
        r = cli(d, "daemon", "stop", "--kill-envs")
        assert r.exit_code == 0, r.output
        assert "killed 1 env" in r.output and "envlet stopped" in r.output, r.output
        assert d.proc.wait(10) == 0
        assert not running(init_pid) and not running(envlet) and not os.path.ismount(mnt)
        assert leftovers(d) == []
        parents = [top for h in ("memory", "cpu", "pids", "freezer") for top, _, _ in os.walk(f"/sys/fs/cgroup/{h}")
                   if os.path.basename(top) == d.cgroup_root]
        assert parents == []  # weenv's parent cgroup went with the last env
    finally:
        assert teardown_private_daemon(d) == []


def test_sigterm_stops_the_daemon_and_its_envlet_when_no_env_runs() -> None:
    d = private_daemon("sigterm")
    mnt = os.path.join(d.home, "envlet", "mnt")
    try:
        with d.client() as c:
            with c.create(d.plan_lock) as env:
                assert env.exec(["true"]).exit_code == 0
        envlet = envlet_pid(d)
        assert envlet and os.path.ismount(mnt)
        d.stop()  # SIGTERM, as systemd or `kill` would
        assert d.proc.returncode == 0
        assert wait_for(lambda: not running(envlet), 5) and not os.path.ismount(mnt)
        assert "the envlet too" in d.log()
    finally:
        assert teardown_private_daemon(d) == []


def test_daemon_options_do_not_apply_to_status_or_stop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = CliRunner().invoke(main, ["daemon", "--debug", "--hold", "3", "stop"], env={"WEENV_HOME": str(tmp_path)})
    assert r.exit_code == 2 and "configure a running daemon, not `weenv daemon stop`" in r.output, r.output
    assert "--debug" in r.output and "--hold" in r.output, r.output
    r = CliRunner().invoke(main, ["daemon", "status"], env={"WEENV_HOME": str(tmp_path)})
    assert r.exit_code == 3 and "daemon  not running" in r.output and "envlet  not running" in r.output, r.output
    r = CliRunner().invoke(main, ["daemon", "stop"], env={"WEENV_HOME": str(tmp_path)})
    assert r.exit_code == 0 and "not running" in r.output, r.output
