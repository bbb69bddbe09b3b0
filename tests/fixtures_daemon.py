"""A real weenv daemon (real envlet, crun, cgroups, overlayfs) for integration tests; the harness
itself (:class:`weenv.testing.DaemonHandle` and friends) is shared with the benchmarks.

``weenv_daemon`` (session scope) starts ``python -m weenv daemon`` with a private $WEENV_HOME and a
private cgroup root, publishes a busybox ``os`` group to the embedded store and locks a plan over
it. At the end it kills every env, runs gc, stops the daemon and the envlet, and checks that no
mount, cgroup or process is left.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from weenv.testing import DaemonHandle, busybox_plan, leftovers, teardown_private_daemon, wait_for

from .fixtures_common import require_command, require_fuse


@pytest.fixture(scope="session")
def weenv_daemon() -> Iterator[DaemonHandle]:
    require_fuse()
    require_command("crun")
    require_command("docker-registry")
    home = tempfile.mkdtemp(prefix="weenv-daemon-")
    plan, lock = busybox_plan(home)
    handle = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-test-{os.getpid()}", lock, plan,
                          os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    handle.start()
    try:
        yield handle
    finally:
        left = teardown_private_daemon(handle)
        assert not left, f"the daemon tests left: {left}"


@pytest.fixture
def daemon(weenv_daemon: DaemonHandle) -> Iterator[DaemonHandle]:
    """The session daemon, checked for leaks after each test."""
    yield weenv_daemon
    with weenv_daemon.client() as c:  # the next test starts from a clean daemon
        for env_id in [e["id"] for e in c.list()]:
            c.get(env_id).kill()
        for snap in c.snapshots():
            c.delete_snapshot(snap["id"])
        for vol in c.volumes():
            c.delete_volume(vol.id)


__all__ = ["DaemonHandle", "busybox_plan", "daemon", "leftovers", "teardown_private_daemon", "wait_for",
           "weenv_daemon"]
