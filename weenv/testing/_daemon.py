"""A real weenv daemon (real envlet, crun, cgroups, overlayfs) with a private $WEENV_HOME and cgroup
root, for integration tests and benchmarks: start and stop it, publish a busybox plan into its
embedded store, list what it left behind, tear it down.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ._images import busybox_tree


@dataclass
class DaemonHandle:
    home: str
    socket: str
    cgroup_root: str
    plan_lock: str  # a locked busybox plan
    plan_toml: str  # the same, unlocked
    log_path: str
    proc: subprocess.Popen

    def client(self, **kw):  # type: ignore[no-untyped-def]
        import weenv

        return weenv.Client(self.socket, autostart=False, **kw)

    def async_client(self, **kw):  # type: ignore[no-untyped-def]
        import weenv

        return weenv.AsyncClient(self.socket, autostart=False, **kw)

    def env_vars(self) -> dict[str, str]:
        return {**os.environ, "WEENV_HOME": self.home}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    # -- lifecycle (tests that restart the daemon use these) ---------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weenv", "daemon", "--cgroup-root", self.cgroup_root],
            env=self.env_vars(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
        log.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the spawned daemon (``self.proc``) answers a ping; fail with its log if it exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weenv daemon exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with self.client() as c:
                    c.ping()
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"weenv daemon did not answer within {timeout_s} s:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextmanager
def weenv_home(home: str) -> Iterator[None]:
    """Point ``WEENV_HOME`` at ``home`` (for in-process publish/lock) and put the old value back."""
    old = os.environ.get("WEENV_HOME")
    os.environ["WEENV_HOME"] = home
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WEENV_HOME", None)
        else:
            os.environ["WEENV_HOME"] = old


def busybox_plan(home: str, name: str = "bb") -> tuple[str, str]:
    """Publish a busybox os group into ``home``'s embedded store; write a plan and its lock."""
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import publish, resolve_group

    src = busybox_tree(Path(home) / "src-busybox")
    with weenv_home(home):
        publish(str(src), "busybox:test", group="os", group_class="os")
        plan_path = os.path.join(home, f"{name}.toml")
        with open(plan_path, "w") as f:
            f.write(f'name = "{name}"\n\n[[groups]]\nname = "os"\nref = "busybox:test"\nclass = "os"\n\n'
                    '[resources]\npids = 256\ndisk = "64MiB"\n\n[resources.cpu]\nmin = 0.05\nmax = 1.0\n\n'
                    '[resources.memory]\nmin = "64MiB"\nmax = "512MiB"\n')
        lock_path = os.path.join(home, f"{name}.lock.toml")
        write_plan(lock_plan(load_plan(plan_path), resolve_group), lock_path)
    return plan_path, lock_path


def leftovers(handle: DaemonHandle) -> list[str]:
    """Mounts under the home (but the envlet), cgroups under the test root, crun containers."""
    problems = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4]
            if mnt.startswith((os.path.join(handle.home, "envs"), os.path.join(handle.home, "volumes"))):
                problems.append(f"mount {mnt}")
    loops = subprocess.run(["losetup", "-a", "-n", "-O", "NAME,BACK-FILE"], capture_output=True, text=True).stdout
    problems += [f"loop device {line.split()[0]}" for line in loops.splitlines()
                 if len(line.split()) > 1 and line.split()[1].startswith(handle.home + "/")]
    for hier in ("memory", "cpu", "pids", "freezer", "cpuacct"):
        base = f"/sys/fs/cgroup/{hier}"
        for dirpath, dirnames, _ in os.walk(base):
            if os.path.basename(dirpath) == handle.cgroup_root:
                # the create path's scratch groups (cgroups/_warm.py) are not an env's: remove_parent takes them
                problems += [f"cgroup {dirpath}/{d}" for d in dirnames if not d.startswith("_moves-")]
                break
    crun_root = os.path.join(handle.home, "run", "crun")
    if os.path.isdir(crun_root):
        problems += [f"container {c}" for c in os.listdir(crun_root) if os.path.isdir(os.path.join(crun_root, c))]
    return problems


def teardown_private_daemon(d: DaemonHandle) -> list[str]:
    """Stop a test's own daemon and its envlet, remove its cgroups and home; what it left behind."""
    try:
        with d.client() as c:
            for e in c.list():
                c.get(e["id"]).kill()
            c.gc()
    except Exception:
        pass
    d.stop()
    try:  # the envlet outlives the daemon by design: stop it (it unmounts) and wait for it to go
        from weenv.envlet import EnvletClient

        pid = EnvletClient(os.path.join(d.home, "run", "envlet.sock")).ping()["pid"]
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.05)
    except Exception:
        pass
    subprocess.run(["fusermount3", "-u", "-z", os.path.join(d.home, "envlet", "mnt")], capture_output=True)
    left = leftovers(d)
    from weenv.provision.cgroups import detect_backend

    try:
        detect_backend(d.cgroup_root).remove_parent()
    except Exception:
        pass
    shutil.rmtree(d.home, ignore_errors=True)
    return left


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False
