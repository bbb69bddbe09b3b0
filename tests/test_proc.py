"""weenv._proc: the one "has this pid exited / wait until it has" helper (CLI, daemon, local cluster)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time

import pytest

from weenv._proc import gone, wait_gone

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def sleeper():
    """A child that runs until killed; killed and reaped at the end whatever the test did."""
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


def _zombie(p: subprocess.Popen) -> None:
    """Kill ``p`` and wait (bounded) until it is a zombie, without reaping it."""
    p.kill()
    for _ in range(200):
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"{p.pid} did not exit")


def test_a_running_process_is_not_gone(sleeper) -> None:
    assert not gone(sleeper.pid)
    assert not gone(sleeper.pid, reap=True)  # reaping a running child does nothing
    assert not gone(os.getpid())


def test_a_zombie_is_gone_and_left_to_its_waiter_unless_asked_to_reap(sleeper) -> None:
    _zombie(sleeper)
    assert gone(sleeper.pid)
    assert os.path.exists(f"/proc/{sleeper.pid}")  # not reaped: its Popen still waits for it
    assert gone(sleeper.pid, reap=True)
    assert not os.path.exists(f"/proc/{sleeper.pid}")  # reaped
    with pytest.raises(ChildProcessError):
        os.waitpid(sleeper.pid, os.WNOHANG)


def test_a_process_that_is_not_ours_is_looked_up_not_reaped() -> None:
    assert not gone(1, reap=True)  # init runs, and is nobody's child to reap


def test_a_pid_with_no_process_is_gone(sleeper) -> None:
    sleeper.kill()
    sleeper.wait(timeout=10)
    assert gone(sleeper.pid) and gone(sleeper.pid, reap=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []
        self.on_sleep = lambda: None

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s
        self.on_sleep()


def test_wait_gone_gives_up_at_the_timeout(sleeper) -> None:
    clock = FakeClock()
    assert wait_gone(sleeper.pid, 1.0, interval_s=0.25, clock=clock, sleep=clock.sleep) is False
    assert clock.sleeps == [0.25] * 4 and clock.now == 101.0
    assert not gone(sleeper.pid)


def test_wait_gone_returns_once_the_process_exits(sleeper) -> None:
    clock = FakeClock()
    clock.on_sleep = lambda: _zombie(sleeper) if len(clock.sleeps) == 3 else None
    assert wait_gone(sleeper.pid, 60.0, interval_s=0.5, clock=clock, sleep=clock.sleep) is True
    assert clock.sleeps == [0.5] * 3


def test_wait_gone_checks_once_with_no_time_to_wait(sleeper) -> None:
    clock = FakeClock()
    assert wait_gone(sleeper.pid, 0.0, clock=clock, sleep=clock.sleep) is False
    _zombie(sleeper)
    assert wait_gone(sleeper.pid, 0.0, clock=clock, sleep=clock.sleep) is True
    assert clock.sleeps == []


def test_wait_gone_on_the_real_clock_is_bounded(sleeper) -> None:
    t0 = time.monotonic()
    assert wait_gone(sleeper.pid, 0.2) is False
    assert 0.2 <= time.monotonic() - t0 < 2.0


def test_the_cli_the_daemon_and_the_local_cluster_share_it() -> None:
    """The three places that waited for a pid to go each had their own copy; now they use this one."""
    for user in ("weenv/cli/_daemonctl.py", "weenv/cluster/_local.py", "weenv/provision/_daemon.py"):
        text = (ROOT / user).read_text()
        assert "from .._proc import" in text, user
        assert "/stat" not in text and "waitpid" not in text, user
