"""A test run leaves no cgroup behind, and a removal that is only partly done says where.

What CI once found: ``weenv-test-<pid>-v1/env`` left in cpu, cpuacct, pids, freezer and unified
(a ``find /sys/fs/cgroup -maxdepth 3`` does not reach the memory hierarchy's copy: it sits below
this process's own memory group, one level deeper). That is what a test run ended by SIGTERM left:
pytest's default SIGTERM action skips every teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.fixtures_cgroups import left_behind, require_v1_host
from weenv.provision._errors import CgroupBusyError, CgroupError
from weenv.provision.cgroups import CgroupFs

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_INNER = '''
import json, time
import trio

def test_holds_a_group(v1_backend):
    group = v1_backend.create("env")
    dirs = [p.rsplit("/", 1)[0] for p in group.procs_paths()]
    print("READY " + json.dumps({"group": dirs, "parents": v1_backend.parent_dirs}), flush=True)
    if MODE == "trio":
        trio.run(trio.sleep, 60)
    else:
        time.sleep(60)
'''


def _rmdir_ours(dirs: list[str]) -> None:
    """Remove what the inner run left (its own groups, named by it), deepest first."""
    for d in sorted(dirs, key=len, reverse=True):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass


@pytest.mark.parametrize("mode", ["plain", "trio"])
def test_a_run_ended_by_sigterm_tears_its_cgroups_down(tmp_path, mode):
    require_v1_host()
    (tmp_path / "test_inner.py").write_text(f"MODE = {mode!r}\n" + _INNER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.fixtures_common",
         "-p", "tests.fixtures_cgroups", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    dirs: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in proc.stdout:  # bounded: the inner test prints READY, then sleeps 60 s at most
            if line.startswith("READY "):
                made = json.loads(line[6:])
                dirs = made["group"] + made["parents"]
                break
            assert time.monotonic() < deadline, "the inner run never got its group"
        assert dirs, "the inner run ended before it made its group"
        assert left_behind(dirs), "the inner run's group is not there"
        proc.send_signal(signal.SIGTERM)  # what `kill PID` and a job runner's stop send
        out, _ = proc.communicate(timeout=30)
        assert left_behind(dirs) == [], f"a SIGTERM'd run left its cgroups behind; its output: {out[-2000:]}"
        assert "KeyboardInterrupt" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _rmdir_ours(dirs)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def _enter(procs_file: str, pid: int) -> None:
    with open(procs_file, "w") as f:
        f.write(str(pid))


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_a_group_removed_from_memory_but_busy_elsewhere_names_both(v1_backend):
    group = v1_backend.create("half")
    dirs = [os.path.dirname(p) for p in group.procs_paths()]
    mem, cpu = dirs[0], dirs[1]
    assert "/memory/" in mem and "/cpu/" in cpu, dirs
    proc = _sleeper()
    try:
        _enter(f"{cpu}/cgroup.procs", proc.pid)  # inside in cpu only: memory's rmdir succeeds
        with pytest.raises(CgroupBusyError) as info:
            group.remove(timeout_s=0.3)
        msg = str(info.value)
        assert cpu in msg and f"already removed: {mem}" in msg and str(proc.pid) in msg, msg
        assert left_behind(dirs) == dirs[1:]
    finally:
        _end(proc)
    group.remove()  # what is left; the memory copy is gone already
    assert left_behind(dirs) == []


class _Recreating(CgroupFs):
    """The real cgroupfs, where another actor makes ``path`` again right after it is removed (as a
    stale ``open()`` repairing a group's later hierarchies would)."""

    def __init__(self, path: str):
        self.path = path

    def rmdir(self, path: str) -> None:
        super().rmdir(path)
        if path == self.path:
            os.mkdir(path)


def test_a_removal_that_leaves_a_directory_behind_is_an_error_naming_it(v1_backend):
    group = v1_backend.create("again")
    dirs = [os.path.dirname(p) for p in group.procs_paths()]
    again = dirs[2]
    group._fs = _Recreating(again)  # type: ignore[attr-defined]
    try:
        with pytest.raises(CgroupError, match="still present after removal") as info:
            group.remove()
        assert again in str(info.value) and f"1 of {len(dirs)} hierarchies" in str(info.value)
    finally:
        _rmdir_ours([again])
    assert left_behind(dirs) == []


def test_a_parent_half_removed_is_an_error_not_false(v1_backend):
    parents = v1_backend.parent_dirs
    mem, cpu = parents[0], parents[1]
    proc = _sleeper()
    try:
        _enter(f"{cpu}/cgroup.procs", proc.pid)  # in the cpu parent itself: no group listed
        assert v1_backend.list() == []
        with pytest.raises(CgroupBusyError) as info:
            v1_backend.remove_parent()
        msg = str(info.value)
        assert cpu in msg and f"already gone from {mem}" in msg, msg
    finally:
        _end(proc)
    assert v1_backend.remove_parent() is True
    assert left_behind(parents) == []


def test_a_parent_busy_in_its_first_hierarchy_is_false_and_untouched(v1_backend):
    parents = v1_backend.parent_dirs
    proc = _sleeper()
    try:
        _enter(f"{parents[0]}/cgroup.procs", proc.pid)
        assert v1_backend.remove_parent() is False
        assert left_behind(parents) == parents
    finally:
        _end(proc)
