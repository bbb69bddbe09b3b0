"""The envlet SIGKILLed under load, with a real daemon: it comes back, new envs start, and the envs
that were running see what docs/architecture.md ("When the envlet dies") promises:

- layers an env stacks as local trees keep working (no FUSE under them);
- an env whose lowers are on the dead mount keeps running; a file it had not read fails with
  ENOTCONN ("Transport endpoint is not connected"), at once and for good (the kernel's FUSE
  connection is gone; a new envlet serves a new mount), never a hang.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

import pytest

from .fixtures_daemon import DaemonHandle, busybox_plan, teardown_private_daemon, wait_for
from .test_snapshots import overlay_lowers

pytestmark = pytest.mark.integration

N_FILES = 120
# shell builtins only: after the kill, exec of any busybox applet on the dead mount fails too
READ_LOOP = ("for f in /data/f*; do if read -r -n 3 x 2>/tmp/err < $f && [ \"$x\" = one ]; then echo OK $f; "
             "else read -r msg < /tmp/err; echo FAIL $f $msg; fi; sleep 0.02 2>/dev/null; done")


def _task_dir(root: str, tag: str) -> str:
    os.makedirs(os.path.join(root, "data"))
    for i in range(N_FILES):
        with open(os.path.join(root, "data", f"f{i:03d}"), "wb") as f:
            f.write(tag.encode() + os.urandom(16 << 10))
    return root


def _lock(home: str, name: str, task_ref: str) -> str:
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import resolve_group

    plan = os.path.join(home, f"{name}.toml")
    with open(plan, "w") as f:
        f.write(f'name = "{name}"\n[[groups]]\nname = "os"\nref = "busybox:test"\nclass = "os"\n'
                f'[[groups]]\nname = "task"\nref = "{task_ref}"\nclass = "task"\n')
    lock = os.path.join(home, f"{name}.lock.toml")
    write_plan(lock_plan(load_plan(plan), resolve_group), lock)
    return lock


def _envlet_pid(home: str) -> int | None:
    from weenv.envlet import EnvletClient, EnvletError

    try:
        return EnvletClient(os.path.join(home, "run", "envlet.sock")).ping(timeout_s=0.5)["pid"]
    except EnvletError:
        return None


def test_a_sigkilled_envlet_is_back_within_2_s_and_running_envs_see_trees_work_and_fuse_lowers_fail_clearly(
        tmp_path, monkeypatch):
    from weenv.registry import publish

    home = tempfile.mkdtemp(prefix="weenv-restart-")
    busybox_plan(home, "bb")
    monkeypatch.setenv("WEENV_HOME", home)
    publish(_task_dir(str(tmp_path / "task"), "one"), "task:one", group="task", group_class="task")
    publish(_task_dir(str(tmp_path / "task2"), "two"), "task:two", group="task", group_class="task")
    lock = _lock(home, "one", "task:one")
    lock2 = _lock(home, "two", "task:two")
    monkeypatch.setenv("WEENV_LAYER_TREES_AFTER", "1")
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-restart-{os.getpid()}", lock, "",
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    trees = os.path.join(home, "layer-trees")
    try:
        with d.client() as c:
            on_fuse = c.create(lock)  # started through the envlet; queues both layers' tree copies
            assert all(p.startswith(os.path.join(home, "envlet")) for p in overlay_lowers(d, on_fuse.id))
            assert wait_for(lambda: c.top()["layer_trees"]["trees"] == 2, timeout_s=60), d.log()[-2000:]
            on_trees = c.create(lock)
            assert all(p.startswith(trees + "/") for p in overlay_lowers(d, on_trees.id))

            outputs: dict[str, str] = {}

            def read_all(name: str, env) -> None:  # type: ignore[no-untyped-def]
                r = env.exec(["sh", "-c", READ_LOOP], timeout_s=60)
                outputs[name] = r.stdout.decode()

            readers = [threading.Thread(target=read_all, args=(n, e)) for n, e in
                       (("fuse", on_fuse), ("trees", on_trees))]
            for t in readers:
                t.start()
            time.sleep(0.8)  # both envs are reading
            old_pid = _envlet_pid(home)
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            t_kill = time.monotonic()
            assert wait_for(lambda: _envlet_pid(home) not in (None, old_pid), timeout_s=10, interval_s=0.02), \
                d.log()[-3000:]
            back_s = time.monotonic() - t_kill
            for t in readers:
                t.join(90)
                assert not t.is_alive(), "a reader hung on the dead mount"

            # trees: every file read, before and after the kill
            lines = outputs["trees"].splitlines()
            assert len(lines) == N_FILES and all(x.startswith("OK ") for x in lines), outputs["trees"][-500:]
            # FUSE lowers: what was read worked; what came after the kill fails with ENOTCONN, not EIO or a hang
            lines = outputs["fuse"].splitlines()
            assert len(lines) == N_FILES
            assert lines[0].startswith("OK "), lines[:3]
            failed = [x for x in lines if x.startswith("FAIL ")]
            assert failed, "the dead mount served every file?"
            assert all("Transport endpoint is not connected" in x for x in failed), failed[:3]
            last = on_fuse.exec(["cat", "/data/f119"])
            print("exec on the dead mount:", last.exit_code, last.stdout, last.stderr)
            assert last.exit_code != 0 and b"Transport endpoint is not connected" in last.stderr

            # a new env through the new envlet (its task layer is not a tree yet)
            with c.create(lock2) as fresh:
                lowers = overlay_lowers(d, fresh.id)
                assert any(p.startswith(os.path.join(home, "envlet", "mnt") + "/") for p in lowers), lowers
                r = fresh.exec(["sh", "-c", "cat /data/f* | wc -c"])
                assert r.exit_code == 0 and int(r.stdout) == N_FILES * (3 + (16 << 10))
            on_fuse.kill()
            on_trees.kill()
            c.gc()
        print(f"envlet back {back_s * 1000:.0f} ms after SIGKILL")
        assert back_s <= 2.0, f"the envlet took {back_s:.2f} s to come back"
    finally:
        left = teardown_private_daemon(d)
        assert not left, left
