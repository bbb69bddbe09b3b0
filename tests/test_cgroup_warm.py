"""The create path's cgroup-move warm-up (weenv/provision/cgroups/_warm.py) on the real cgroupfs:
a parked process moved between two scratch groups, which no listing shows as an env's and which
go with the parked process."""

from __future__ import annotations

import os

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


def test_each_kick_moves_the_parked_process_to_the_other_scratch_group(backend):
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


def test_a_parked_process_ends_with_its_daemon_and_remove_parent_takes_what_is_left(backend):
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
