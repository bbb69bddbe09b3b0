"""Cgroup backends for tests: the real v1 host, real v2 (the hybrid host's unified mount), a
directory tree that mimics cgroup2, and the in-memory fake.

Every backend uses a parent named after this test process, and teardown kills and removes
every group under it and then the parent itself, even when the test failed, and even when the test
run is ended by SIGTERM (``kill``, a job runner's stop): that is turned into an interrupt, which
pytest answers by tearing every fixture down (a SIGTERM'd run used to leave its cgroups behind).

On this host the memory hierarchy's parent sits below this process's own memory group
(``/sys/fs/cgroup/memory/<own>/weenv-test-<pid>-v1``), deeper than the others
(``/sys/fs/cgroup/cpu/weenv-test-<pid>-v1``): look for leftovers without a depth limit.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.fixtures_common import require_root
from weenv.provision.cgroups import CgroupBackend, CgroupFs, V2Backend, detect_backend, parse_layout
from weenv.testing import FakeBackend

MIB = 1 << 20


def _layout():
    with open("/proc/self/mountinfo") as f, open("/proc/self/cgroup") as g:
        return parse_layout(f.read(), g.read())


def require_v1_host() -> None:
    require_root()
    layout = _layout()
    if layout.mode not in ("legacy", "hybrid"):
        pytest.skip(f"needs cgroup v1 controllers: this host's cgroup mode is {layout.mode}")


def unique_root_name(tag: str) -> str:
    return f"weenv-test-{os.getpid()}-{tag}"


# -- a directory tree that behaves like cgroup2 ------------------------------------------------

_PSI = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
_READ_ONLY = {
    "cgroup.controllers", "cgroup.events", "cgroup.stat", "cpu.stat", "memory.current",
    "memory.events", "memory.stat", "pids.current", "pids.events",
}  # fmt: skip


def _alive(pid: int) -> bool:
    # The kernel drops a task from cgroup.procs when it exits, before its parent reaps it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


class MimicCgroup2Fs(CgroupFs):
    """Plays the kernel's part on a plain directory tree: creates interface files on mkdir, refuses
    rmdir of populated groups, moves pids between groups, freezes with SIGSTOP, kills on
    ``cgroup.kill``, validates what is written. Counters stay where tests put them
    (:meth:`put`)."""

    def __init__(self, root: str, delegated: tuple[str, ...] = ("cpu", "memory", "pids")):
        self.root = root.rstrip("/")
        self._fd_paths: dict[int, str] = {}
        os.makedirs(self.root, exist_ok=True)
        self._files(self.root, controllers=("cpu", "io", "memory", "pids"), root=True)
        self.put(self.root, "cgroup.subtree_control", " ".join(delegated) + "\n")

    # the tree

    def _groups(self) -> Iterator[str]:
        for d, _dirs, _files in os.walk(self.root):
            yield d

    def _files(self, d: str, controllers: tuple[str, ...], root: bool = False) -> None:
        files = {
            "cgroup.procs": "",
            "cgroup.controllers": " ".join(controllers) + "\n",
            "cgroup.subtree_control": "\n",
            "cgroup.stat": "nr_descendants 0\nnr_dying_descendants 0\n",
            "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n",
            "cpu.pressure": _PSI,
            "memory.pressure": _PSI,
            "io.pressure": _PSI,
        }
        if not root:
            files.update({"cgroup.events": "populated 0\nfrozen 0\n", "cgroup.freeze": "0\n", "cgroup.kill": "",
                          "cgroup.type": "domain\n"})  # fmt: skip
        if "cpu" in controllers and not root:
            files["cpu.max"] = "max 100000\n"
            files["cpu.max.burst"] = "0\n"
            files["cpu.weight"] = "100\n"
            files["cpu.stat"] += "nr_periods 0\nnr_throttled 0\nthrottled_usec 0\nnr_bursts 0\nburst_usec 0\n"
        if "memory" in controllers and not root:
            files.update({
                "memory.current": "0\n", "memory.max": "max\n", "memory.high": "max\n", "memory.min": "0\n",
                "memory.low": "0\n", "memory.stat": "anon 0\nfile 0\n",
                "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
            })  # fmt: skip
        if "pids" in controllers and not root:
            files.update({"pids.max": "max\n", "pids.current": "0\n", "pids.events": "max 0\n"})
        for name, text in files.items():
            self.put(d, name, text)

    def put(self, d: str, name: str, text: str) -> None:
        """Set a file's content in place (kept descriptors see it, as with cgroupfs)."""
        with open(f"{d}/{name}", "w") as f:
            f.write(text)

    def get(self, d: str, name: str) -> str:
        with open(f"{d}/{name}") as f:
            return f.read()

    def _procs(self, d: str) -> list[int]:
        pids = [int(x) for x in self.get(d, "cgroup.procs").split()]
        live = [p for p in pids if _alive(p)]
        if live != pids:
            self._set_procs(d, live)
        return live

    def _set_procs(self, d: str, pids: list[int]) -> None:
        self.put(d, "cgroup.procs", "".join(f"{p}\n" for p in pids))
        if os.path.exists(f"{d}/pids.current"):
            self.put(d, "pids.current", f"{len(pids)}\n")
        if os.path.exists(f"{d}/cgroup.events"):
            frozen = self.get(d, "cgroup.freeze").strip()
            self.put(d, "cgroup.events", f"populated {1 if pids else 0}\nfrozen {frozen}\n")

    # CgroupFs

    def mkdir(self, path: str) -> None:
        parent = os.path.dirname(path.rstrip("/"))
        if not os.path.isfile(f"{parent}/cgroup.procs"):
            raise FileNotFoundError(errno.ENOENT, "parent is not a cgroup", path)
        os.mkdir(path)
        self._files(path, tuple(self.get(parent, "cgroup.subtree_control").split()))

    def rmdir(self, path: str) -> None:
        if not os.path.isdir(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if self._procs(path) or any(os.path.isdir(f"{path}/{e}") for e in os.listdir(path)):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)
        for e in os.listdir(path):
            os.unlink(f"{path}/{e}")
        os.rmdir(path)

    def read(self, path: str) -> bytes:
        d, name = os.path.split(path)
        if name in ("cgroup.procs", "pids.current", "cgroup.events") and os.path.isdir(d):
            self._procs(d)
        return super().read(path)

    def open_fd(self, path: str) -> int:
        fd = super().open_fd(path)
        self._fd_paths[fd] = path
        return fd

    def pread(self, fd: int) -> bytes:
        path = self._fd_paths.get(fd)
        if path is not None:
            d, name = os.path.split(path)
            if not os.path.exists(path):
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), path)
            if name == "pids.current":
                self._procs(d)
        return super().pread(fd)

    def write(self, path: str, data: str) -> None:
        d, name = os.path.split(path)
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if name in _READ_ONLY:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        value = data.strip()

        def invalid() -> OSError:
            return OSError(errno.EINVAL, f"invalid value {value!r}", path)

        if name == "cgroup.procs":
            pid = int(value)
            if not _alive(pid):
                raise ProcessLookupError(errno.ESRCH, os.strerror(errno.ESRCH), path)
            for g in self._groups():
                if g != d and pid in self._procs(g):
                    self._set_procs(g, [p for p in self._procs(g) if p != pid])
            self._set_procs(d, sorted({*self._procs(d), pid}))
            if self.get(d, "cgroup.freeze").strip() == "1":
                os.kill(pid, signal.SIGSTOP)
        elif name == "cgroup.subtree_control":
            have = set(self.get(d, "cgroup.controllers").split())
            enabled = set(self.get(d, "cgroup.subtree_control").split())
            for tok in value.split():
                if tok[0] not in "+-" or tok[1:] not in have:
                    raise OSError(errno.ENOENT, f"controller {tok!r} not available", path)
                (enabled.add if tok[0] == "+" else enabled.discard)(tok[1:])
            self.put(d, name, " ".join(sorted(enabled)) + "\n")
        elif name == "cgroup.freeze":
            if value not in ("0", "1"):
                raise invalid()
            for pid in self._procs(d):
                os.kill(pid, signal.SIGSTOP if value == "1" else signal.SIGCONT)
            self.put(d, name, value + "\n")
            self._set_procs(d, self._procs(d))
        elif name == "cgroup.kill":
            if value != "1":
                raise invalid()
            for pid in self._procs(d):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
        elif name == "cpu.max":
            parts = value.split()
            if len(parts) != 2 or not (parts[0] == "max" or (parts[0].isdigit() and int(parts[0]) >= 1000)):
                raise invalid()
            # Like the kernel: the banked burst may not exceed the quota.
            if parts[0] != "max" and int(self.get(d, "cpu.max.burst")) > int(parts[0]):
                raise invalid()
            self.put(d, name, value + "\n")
        elif name == "cpu.max.burst":
            quota = self.get(d, "cpu.max").split()[0]
            if not value.isdigit() or (quota != "max" and int(value) > int(quota)):
                raise invalid()
            self.put(d, name, value + "\n")
        elif name in ("memory.max", "memory.high", "pids.max"):
            if not (value == "max" or value.isdigit()):
                raise invalid()
            self.put(d, name, value + "\n")
        else:
            self.put(d, name, value + "\n")


# -- teardown on SIGTERM -------------------------------------------------------------------------


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM ends the run as Ctrl-C does (teardown runs); a second SIGTERM kills at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return  # someone else handles it
    owner = os.getpid()

    def on_sigterm(signum, frame) -> None:  # type: ignore[no-untyped-def]
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.getpid() != owner:  # a forked child: die as it would have
            os.kill(os.getpid(), signal.SIGTERM)
            return
        # SIGINT's handler, called here (a raise_signal would only be seen after a blocking call
        # this one interrupted resumes): trio's, inside trio.run, delivers it where it is safe to.
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt("SIGTERM: tearing the fixtures down")

    signal.signal(signal.SIGTERM, on_sigterm)


# -- backends ----------------------------------------------------------------------------------


def _cleanup(backend: CgroupBackend) -> None:
    problems = []
    for name in backend.list():
        try:
            group = backend.open(name)
            try:
                group.thaw()
            except Exception:
                pass
            group.kill_all()
            group.remove(timeout_s=5.0)
        except Exception as exc:  # keep cleaning the others
            problems.append(f"{name}: {exc}")
    try:
        if not backend.remove_parent():
            problems.append(f"parent still holds {backend.list()}")
    except Exception as exc:  # half removed: named by the error
        problems.append(f"parent: {exc}")
    assert not problems, f"cgroup cleanup failed: {problems}"


def left_behind(dirs: list[str]) -> list[str]:
    """Of ``dirs`` (a group's or a parent's directory in each hierarchy), those still there, each
    with what it holds: a leak is named per hierarchy where it happens."""
    out = []
    for d in dirs:
        if os.path.isdir(d):
            groups = sorted(e for e in os.listdir(d) if os.path.isdir(os.path.join(d, e)))
            out.append(f"{d} (groups {groups})" if groups else d)
    return out


@pytest.fixture
def v1_backend() -> Iterator[CgroupBackend]:
    require_v1_host()
    backend = detect_backend(unique_root_name("v1"))
    try:
        yield backend
    finally:
        try:
            _cleanup(backend)
        finally:
            left = left_behind(backend.parent_dirs)  # type: ignore[attr-defined]
            assert not left, f"cgroup parent left behind in {len(left)} hierarchies: {left}"


def _v2_real_backend() -> V2Backend:
    require_root()
    layout = _layout()
    if layout.unified_mount is None:
        pytest.skip("needs a cgroup2 mount: this host has none")
    return V2Backend(layout.unified_mount, own_path=layout.unified_own or "/", root_name=unique_root_name("v2"))


@pytest.fixture
def v2_real_backend() -> Iterator[V2Backend]:
    backend = _v2_real_backend()
    try:
        yield backend
    finally:
        _cleanup(backend)
        assert not os.path.exists(backend.parent_dir), f"left behind {backend.parent_dir}"


@pytest.fixture
def v2_mimic(tmp_path) -> Iterator[tuple[V2Backend, MimicCgroup2Fs]]:
    fs = MimicCgroup2Fs(str(tmp_path / "cgroup2"))
    fs.mkdir(f"{fs.root}/daemon.service")
    fs.put(f"{fs.root}/daemon.service", "cgroup.subtree_control", "cpu memory pids\n")
    backend = V2Backend(fs.root, own_path="/daemon.service", root_name="weenv", fs=fs)
    try:
        yield backend, fs
    finally:
        _cleanup(backend)


class Harness:
    """A backend plus how to put real processes in its groups (None for the fake)."""

    def __init__(self, kind: str, backend: CgroupBackend, real_processes: bool, kernel: bool):
        self.kind = kind
        self.backend = backend
        #: Processes in its groups are real (signals reach them): v1, v2, the mimic.
        self.real_processes = real_processes
        #: Its cgroup.procs files are the kernel's, so a preexec write is an attach.
        self.kernel = kernel
        self._children: list[subprocess.Popen] = []

    def spawn(self, group, code: str = "import time; time.sleep(60)") -> subprocess.Popen:
        """A python child that writes itself into every cgroup.procs of ``group`` before exec,
        the way the runtime's preexec_fn does."""
        paths = group.procs_paths()

        def enter() -> None:
            pid = str(os.getpid()).encode()
            for p in paths:
                fd = os.open(p, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

        if self.kernel:
            proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=enter, stdout=subprocess.PIPE)
        else:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
            group.attach(proc.pid)
        self._children.append(proc)
        return proc

    def close(self) -> None:
        for proc in self._children:
            if proc.poll() is None:
                proc.kill()
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            proc.wait()
            if proc.stdout:
                proc.stdout.close()


@pytest.fixture(params=["v1", "v2-unified", "v2-mimic", "fake"])
def cgroup_harness(request, tmp_path) -> Iterator[Harness]:
    """The conformance suite's backend: each test runs once per implementation."""
    kind = request.param
    if kind == "v1":
        require_v1_host()
        backend: CgroupBackend = detect_backend(unique_root_name("conf"))
        real = kernel = True
    elif kind == "v2-unified":
        backend = _v2_real_backend()
        real = kernel = True
    elif kind == "v2-mimic":
        fs = MimicCgroup2Fs(str(tmp_path / "cgroup2"))
        backend = V2Backend(fs.root, root_name="weenv", fs=fs)
        real, kernel = True, False
    else:
        backend = FakeBackend()
        real = kernel = False
    harness = Harness(kind, backend, real, kernel)
    try:
        yield harness
    finally:
        harness.close()
        _cleanup(backend)


@pytest.fixture
def fake_backend() -> FakeBackend:
    return FakeBackend()
