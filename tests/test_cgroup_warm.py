"""The create path's cgroup-move warm-up (weenv/provision/cgroups/_warm.py) on the real cgroupfs:
a parked process moved between two scratch groups, which no listing shows as an env's and which
go with the parked process."""

from __future__ import annotations

import os
import threading
import time

import pytest

from weenv.provision.cgroups import detect_backend


@pytest.fixture
def backend():
    b = detect_backend(f"weenv-test-warm-{os.getpid()}")
    if b.version not in ("v1", "v2"):
        pytest.skip(f"no kernel cgroups here ({b.version})")
    yield b
    b.stop_warming()
    for name in b.list():
        b.open(name).remove()
    b.remove_parent()


def _procs(d: str) -> list[int]:
    with open(os.path.join(d, "cgroup.procs")) as f:
        return [int(x) for x in f.read().split()]


def test_each_kick_moves_the_parked_process_to_the_other_scratch_group(backend, monkeypatch):
    monkeypatch.setenv("WEENV_CGROUP_KEEP_WARM_S", "0")  # kicks only: no ticker between the looks
    backend.warm_moves()
    warmer = backend._warmer
    a, b = warmer.dirs
    pid = warmer._proc.pid
    assert os.path.basename(a).startswith("_") and not os.path.basename(a)[0].isalnum()  # never an env's name
    seen = []
    for _ in range(4):
        seen.append((_procs(a), _procs(b)))
        backend.warm_moves()
    assert seen == [([], [pid]), ([pid], []), ([], [pid]), ([pid], [])]
    assert backend.list() == []  # not an env's group
    env = backend.create("e1")
    assert backend.list() == ["e1"]
    env.remove()


def test_stop_ends_the_parked_process_and_removes_the_scratch_groups(backend):
    backend.warm_moves()
    proc, dirs = backend._warmer._proc, backend._warmer.dirs
    backend.stop_warming()
    assert proc.poll() is not None and not any(os.path.isdir(d) for d in dirs)
    backend.warm_moves()  # a new one starts when asked again
    assert backend._warmer._proc.poll() is None


def test_a_parked_process_ends_with_its_daemon_and_remove_parent_takes_what_is_left(backend, monkeypatch):
    monkeypatch.setenv("WEENV_CGROUP_KEEP_WARM_S", "0")  # a dead daemon's ticker is gone with it
    backend.warm_moves()
    warmer = backend._warmer
    os.close(warmer._hold)  # what the daemon's end does to the pipe, however it ends
    warmer._hold = -1
    warmer._proc.wait(timeout=5)  # raises if it did not end
    assert all(os.path.isdir(d) for d in warmer.dirs)  # empty scratch groups are what a dead daemon leaves
    backend._warmer = None
    fresh = detect_backend(backend_name(backend))
    assert fresh.list() == [] and fresh.remove_parent()
    assert not any(os.path.isdir(d) for d in warmer.dirs)


def backend_name(b) -> str:
    return os.path.basename(b.parent_dirs[0])


def test_after_a_kick_the_parked_process_keeps_moving_until_the_window_ends(backend, monkeypatch):
    """A burst's later creates find the semaphore ready: the warmer moves every TICK_S for
    keep_warm_s after the last kick, then stops (no thread, no moves) until the next kick."""
    monkeypatch.setenv("WEENV_CGROUP_KEEP_WARM_S", "0.4")
    backend.warm_moves()
    warmer = backend._warmer
    time.sleep(0.2)
    mid = warmer.moves
    assert mid >= 5, f"only {mid} moves 0.2 s into a 0.4 s window of 5 ms ticks"
    backend.warm_moves()  # a second kick extends the window from now
    time.sleep(0.3)
    assert warmer.moves > mid + 5, "the second kick did not keep the ticker going"
    deadline = time.monotonic() + 5
    while warmer._ticker is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warmer._ticker is None, "the ticker outlived its window"
    done = warmer.moves
    time.sleep(0.1)
    assert warmer.moves == done
    assert not [t for t in threading.enumerate() if t.name == "weenv-cgroup-warm"]
    a, b = warmer.dirs
    assert sorted(_procs(a) + _procs(b)) == [warmer._proc.pid]  # always in exactly one of them
    backend.warm_moves()  # the next kick starts a new window
    assert warmer._ticker is not None


def test_stop_warming_ends_a_running_ticker(backend, monkeypatch):
    monkeypatch.setenv("WEENV_CGROUP_KEEP_WARM_S", "30")
    backend.warm_moves()
    warmer = backend._warmer
    ticker = warmer._ticker
    assert ticker is not None and ticker.is_alive()
    backend.stop_warming()
    assert not ticker.is_alive() and warmer._proc is None
    assert not any(os.path.isdir(d) for d in warmer.dirs)


def test_a_bad_keep_warm_setting_falls_back_to_the_default(monkeypatch, caplog):
    from weenv.provision.cgroups import _warm

    monkeypatch.setenv("WEENV_CGROUP_KEEP_WARM_S", "soon")
    assert _warm._keep_warm_s() == _warm.KEEP_WARM_S
    assert "WEENV_CGROUP_KEEP_WARM_S='soon' is not a number" in caplog.text
    monkeypatch.setenv("WEENV_CGROUP_KEEP_WARM_S", "-1")
    assert _warm._keep_warm_s() == 0.0
