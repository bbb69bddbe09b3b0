"""A private weenv daemon for one benchmark run (own $WEENV_HOME and cgroup root), torn down after."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.fixtures_daemon import DaemonHandle, busybox_plan


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
        try:
            with d.client() as c:
                for e in c.list():
                    c.get(e["id"]).kill()
                for s in c.snapshots():
                    c.delete_snapshot(s["id"])
                c.gc()
        except Exception:
            pass
        d.stop()
        from weenv.envlet import EnvletClient

        try:
            pid = EnvletClient(os.path.join(home, "run", "envlet.sock")).ping()["pid"]
            os.kill(pid, 15)
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.05)
        except Exception:
            pass
        os.system(f"fusermount3 -u -z {home}/envlet/mnt 2>/dev/null")
        from weenv.provision.cgroups import detect_backend

        try:
            detect_backend(d.cgroup_root).remove_parent()
        except Exception:
            pass
        shutil.rmtree(home, ignore_errors=True)
