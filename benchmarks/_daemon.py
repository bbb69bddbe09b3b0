"""A private weenv daemon for one benchmark run (own $WEENV_HOME and cgroup root), torn down after."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from weenv.testing import DaemonHandle, busybox_plan, teardown_private_daemon


@contextmanager
def bench_daemon(name: str, *, replace: dict[str, str] | None = None) -> Iterator[DaemonHandle]:
    """Start a daemon with a locked busybox plan (``replace`` edits the lock's TOML text)."""
    home = tempfile.mkdtemp(prefix=f"weenv-bench-{name}-")
    plan, lock = busybox_plan(home, name)
    if replace:
        with open(lock) as f:
            text = f.read()
        for old, new in replace.items():
            text = text.replace(old, new)
        with open(lock, "w") as f:
            f.write(text)
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-bench-{os.getpid()}", lock, plan,
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    try:
        yield d
    finally:
        teardown_private_daemon(d)  # the home, with its snapshots, goes with it
