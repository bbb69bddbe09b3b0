"""The container runtime seam: a prepared rootfs in, a running, locked-down env out.

:class:`Runtime` is the interface the daemon drives (async, trio); :class:`CrunRuntime` runs crun
for real, :class:`FakeRuntime` keeps containers in memory for unit tests of daemon logic. The
same conformance tests run against both.

How :class:`CrunRuntime` drives crun:

- crun keeps its state under weenv's own directory (``<run_dir>/crun``), never /run/crun, and runs
  with ``--cgroup-manager=disabled``: weenv owns the cgroups. Each crun process the runtime
  spawns (create, exec) writes its own pid into every ``cgroup.procs`` it is given before it
  execs crun, so the env's init and every exec'd process are born in the env's groups.
- ``create`` runs ``crun create`` in a private mount namespace with the cgroup2 mount hidden
  when the host needs it (:mod:`._hostcheck`); nothing else needs that.
- ``start`` first remounts the env's root ``nodev,nosuid`` from inside the container's mount
  namespace (the init is still parked on crun's exec fifo): crun re-applies its own flags to the
  root bind mount, and without a devices cgroup ``nodev`` is what keeps a device node shipped in
  a layer from being opened.
- ``exec`` passes the full OCI process (``crun exec --process``) so an exec'd command has the
  init's capabilities, no_new_privileges and rlimits; the JSON goes through a pipe, not a file.
  The crun process leads a new session; every process of the exec keeps that session id, so a
  timeout kills the whole tree (children, grandchildren, background jobs) by session and by
  parentage, with pidfds so that a recycled pid is never signalled.
"""

from __future__ import annotations

import abc
import ctypes
import errno
import inspect
import json
import math
import os
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from fcntl import ioctl

import msgspec
import trio

from ._errors import ContainerError, ContainerExistsError, ContainerNotFoundError, SpecError
from ._hostcheck import HostFacts, detect_host, private_mount_ns_recipe
from ._ocispec import ANNOTATION_NETWORK, DEFAULT_NOFILE, User, build_process, build_spec, merge_env, render_etc_files

DEFAULT_MAX_OUTPUT_BYTES = 16 << 20

OutputCallback = Callable[[str, bytes], "Awaitable[None] | None"]


class ExecResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one command did. ``exit_code`` is 128+N when a signal N ended it (137 after a
    timeout's SIGKILL) and 127 when the command does not exist in the env."""

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    duration_s: float = 0.0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    command_not_found: bool = False


class ContainerState(msgspec.Struct, frozen=True, kw_only=True):
    """crun's view of one container: status is "created", "running", "paused" or "stopped"."""

    id: str
    pid: int
    status: str
    bundle: str = ""
    created: str = ""


class Runtime(abc.ABC):
    """The runtime seam. Every method is async and never blocks the trio loop."""

    @abc.abstractmethod
    async def create(
        self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, cgroup_procs: Sequence[str] = ()
    ) -> int:
        """Set the container up with its init parked before exec; returns the init's host pid.
        The caller may attach it to more cgroups or adjust limits, then :meth:`start` it."""

    @abc.abstractmethod
    async def start(self, env_id: str) -> None:
        """Let the init run."""

    @abc.abstractmethod
    async def exec(
        self,
        env_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: User | None = None,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        cgroup_procs: Sequence[str] = (),
        on_output: OutputCallback | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the env (env vars laid over the init's; cwd and user default to the
        init's) and collect its output. ``on_output(stream, data)`` sees each chunk as it comes
        (``stream`` is "stdout" or "stderr"; it may be a coroutine function). At ``timeout_s`` the
        command and everything it started are killed."""

    @abc.abstractmethod
    async def kill(self, env_id: str, sig: int = signal.SIGKILL) -> None:
        """Signal the env's init (SIGKILL ends every process of the env: it is pid 1)."""

    @abc.abstractmethod
    async def delete(self, env_id: str, force: bool = True) -> None:
        """Remove the container (killing it if ``force``); a no-op when it is already gone.
        Returns once the init has exited."""

    @abc.abstractmethod
    async def state(self, env_id: str) -> ContainerState:
        """Raises :class:`ContainerNotFoundError` for an unknown env id."""

    @abc.abstractmethod
    async def list(self) -> list[ContainerState]:
        """Every container in this runtime's state directory (to re-adopt after a restart)."""


def prepare_bundle(bundle_dir: str, *, env_id: str, rootfs: str, host: HostFacts, network: str = "none", **spec_options) -> dict:
    """Write the env's /etc files into ``bundle_dir/etc`` and return its spec (see
    :func:`~weenv.provision._ocispec.build_spec` for ``spec_options``)."""
    etc_dir = os.path.join(bundle_dir, "etc")
    os.makedirs(etc_dir, exist_ok=True)
    for name, data in render_etc_files(env_id, network).items():
        with open(os.path.join(etc_dir, name), "wb") as f:
            f.write(data)
    init_path = None if spec_options.get("args") else host.require_init()
    soft, hard = spec_options.pop("nofile", DEFAULT_NOFILE)
    hard = min(hard, host.nofile_hard)
    spec_options["nofile"] = (min(soft, hard), hard)
    return build_spec(env_id=env_id, rootfs=rootfs, init_path=init_path, network=network, etc_dir=etc_dir, **spec_options)


# -- low-level helpers (run in the child before exec, or in worker threads) --------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
SYS_MOUNT_SETATTR = 442
AT_EMPTY_PATH = 0x1000
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _cgroup_entry(cgroup_procs: Sequence[str]) -> Callable[[], None]:
    paths = [os.fsencode(p) for p in cgroup_procs]
    getpid, os_open, os_write, os_close = os.getpid, os.open, os.write, os.close

    def enter() -> None:
        pid = b"%d" % getpid()
        for p in paths:
            fd = os_open(p, os.O_WRONLY)
            try:
                os_write(fd, pid)
            finally:
                os_close(fd)

    return enter


def _chain(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    steps = tuple(s for s in steps if s is not None)
    if not steps:
        return None

    def run() -> None:
        for step in steps:
            step()

    return run


def _root_remount_step(container_mnt_fd: int, container_root_fd: int, host_mnt_fd: int) -> Callable[[], None]:
    """For the child of ``crun start``: enter the container's mount namespace (a mount can only
    be changed from its own namespace, and only a single-threaded process may switch), set
    nodev+nosuid on the root mount, and come back before exec'ing crun."""
    attr = _MountAttr(MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID, 0, 0, 0)
    size = ctypes.sizeof(attr)
    setns, syscall, get_errno = _libc.setns, _libc.syscall, ctypes.get_errno

    def step() -> None:
        if setns(container_mnt_fd, CLONE_NEWNS) != 0:
            raise OSError(get_errno(), "setns into the env's mount namespace")
        rc = syscall(SYS_MOUNT_SETATTR, ctypes.c_int(container_root_fd), b"", ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr), ctypes.c_size_t(size))
        failed = get_errno() if rc != 0 else 0
        if setns(host_mnt_fd, CLONE_NEWNS) != 0:
            raise OSError(get_errno(), "setns back to the host mount namespace")
        if failed:
            raise OSError(failed, "mount_setattr(nodev,nosuid) on the env's root")

    return step


def set_loopback(init_pid: int, up: bool) -> None:
    """Set ``lo`` up or down in the env's network namespace (crun brings it up in every new
    namespace; ``network = "none"`` wants it down). Runs in a thread of its own (the netns is
    per thread) that ends right after, so no pooled thread is ever left in the env's netns."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            netfd = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(netfd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into the network namespace of pid {init_pid}: {os.strerror(err)}")
            finally:
                os.close(netfd)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("16sH14x", b"lo", 0)
                flags = struct.unpack("16sH14x", ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
                wanted = (flags | IFF_UP) if up else (flags & ~IFF_UP)
                if wanted != flags:
                    ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", wanted))
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    t = threading.Thread(target=work, name=f"weenv-lo-{init_pid}", daemon=True)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, session id, state) of a live pid, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[3]), fields[0].decode()


def _members(leader: int, sessions: set[int]) -> set[int]:
    """Live (non-zombie) processes of one exec: descendants of ``leader`` (crun's pid), plus
    every process in a session that one of them ever led or belonged to. crun's helper starts
    the command in a session of its own, and an orphaned background job (``(cmd &)``) is
    reparented to the env's init, so parentage alone misses it; its session does not.
    ``sessions`` accumulates across scans (a session id is not reused while any process is in
    it)."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    found = {leader}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, sid, _s) in table.items():
            if pid not in found and (ppid in found or sid in sessions):
                found.add(pid)
                grew = True
        for pid in found:
            if pid in table and table[pid][1] not in sessions:
                sessions.add(table[pid][1])
                grew = True
    return {pid for pid in found if pid in table and table[pid][2] not in ("Z", "X")}


def kill_exec_tree(leader: int, *, spare_leader: bool = True, deadline_s: float = 5.0) -> int:
    """SIGKILL every process of the exec led by ``leader`` (crun's pid) until a scan finds none
    alive; returns how many were signalled. The leader itself is spared when asked, so that crun
    can report the command's exit status."""
    signalled = 0
    sessions = {leader}
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        targets = _members(leader, sessions)
        if spare_leader:
            targets.discard(leader)
        if not targets:
            return signalled
        for pid in targets:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                # Re-checked once the pidfd pins the process: a pid freed and reused since the
                # scan belongs to someone else (and is in none of our sessions).
                st = _proc_stat(pid)
                if st is not None and (st[1] in sessions or st[0] in targets or st[0] == leader):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    signalled += 1
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.001)
    return signalled


_NOT_FOUND = re.compile(rb"executable file `(.*?)` not found")
# crun's words when the command exists but the kernel will not run it (mode, noexec, format).
_CANNOT_EXECUTE = re.compile(rb"(open executable|exec `[^`]*`)[^\n]*")
_NO_CONTAINER = (b"does not exist", b"error opening file", b"No such file or directory")


def _decode_status(code: int) -> int:
    return 128 - code if code < 0 else code


class CrunRuntime(Runtime):
    """Runs crun for real. ``run_dir`` is weenv's (``$WEENV_HOME/run``); crun's state goes to
    ``run_dir/crun``."""

    def __init__(
        self,
        run_dir: str,
        *,
        host: HostFacts | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        drain_grace_s: float = 0.1,
        kill_grace_s: float = 5.0,
    ):
        self.host = host if host is not None else detect_host()
        self.crun = self.host.require_crun()
        self.state_dir = os.path.join(run_dir, "crun")
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.max_output_bytes = max_output_bytes
        self.drain_grace_s = drain_grace_s
        self.kill_grace_s = kill_grace_s
        self._private_ns = (
            private_mount_ns_recipe(self.host.unified_mount)
            if self.host.crun_needs_private_mount_ns and self.host.unified_mount
            else None
        )
        self._base: list[str] = [self.crun, "--root", self.state_dir, "--cgroup-manager=disabled"]
        # env id -> (init pid, the container's process spec); rebuilt from crun's state on miss.
        self._known: dict[str, tuple[int, dict]] = {}
        # Env ids this runtime started (or found running): crun would exec into a container that
        # is still parked before start, where the root is not yet nodev; we do not.
        self._started: set[str] = set()

    # -- small crun calls --------------------------------------------------------------------

    async def _crun(self, *args: str, env_id: str | None = None) -> bytes:
        proc = await trio.run_process([*self._base, *args], capture_stdout=True, capture_stderr=True, check=False)
        if proc.returncode != 0:
            detail = proc.stderr.decode(errors="replace")
            if env_id is not None and any(m in proc.stderr for m in _NO_CONTAINER):
                raise ContainerNotFoundError("no such container", env_id=env_id, detail=detail)
            raise ContainerError(f"crun {args[0]} failed with exit status {proc.returncode}", env_id=env_id, detail=detail)
        return proc.stdout

    async def _lookup(self, env_id: str) -> tuple[int, dict]:
        known = self._known.get(env_id)
        if known is not None:
            return known
        st = await self.state(env_id)
        try:
            with open(os.path.join(self.state_dir, env_id, "config.json"), "rb") as f:
                spec = json.loads(f.read())
        except OSError as exc:
            raise ContainerNotFoundError("crun has no config for this container", env_id=env_id) from exc
        known = (st.pid, spec.get("process", {}))
        if st.pid > 0:
            self._known[env_id] = known
        if st.status in ("running", "paused"):
            self._started.add(env_id)
        return known

    # -- Runtime -------------------------------------------------------------------------------

    async def create(
        self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, cgroup_procs: Sequence[str] = ()
    ) -> int:
        spec = dict(spec)
        spec["root"] = {**spec.get("root", {}), "path": rootfs}
        config = os.path.join(bundle_dir, "config.json")
        pid_file = os.path.join(bundle_dir, "init.pid")
        crun_log = os.path.join(bundle_dir, "crun.log")
        # A few KiB to the page cache: not worth a thread hop on the start path.
        with open(config, "wb") as f:
            f.write(json.dumps(spec).encode())
        for stale in (pid_file, crun_log):
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        # The init's stdout/stderr: a log in the bundle (a pipe would keep crun create waiting).
        init_log = os.open(os.path.join(bundle_dir, "init.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            proc = await trio.run_process(
                [*self._base, f"--log=file:{crun_log}", "create", "--bundle", bundle_dir, "--pid-file", pid_file, env_id],
                stdin=subprocess.DEVNULL,
                stdout=init_log,
                stderr=init_log,
                check=False,
                preexec_fn=_chain(_cgroup_entry(cgroup_procs), self._private_ns),
            )
        finally:
            os.close(init_log)
        if proc.returncode != 0:
            try:
                with open(crun_log, "rb") as f:
                    detail = f.read()[-4000:].decode(errors="replace")
            except OSError:
                detail = ""
            if "already exists" in detail:
                raise ContainerExistsError("a container with this id already exists", env_id=env_id, detail=detail)
            raise ContainerError(f"crun create failed with exit status {proc.returncode}", env_id=env_id, detail=detail)
        with open(pid_file) as f:
            init_pid = int(f.read().strip())
        self._known[env_id] = (init_pid, spec.get("process", {}))
        self._started.discard(env_id)
        network = spec.get("annotations", {}).get(ANNOTATION_NETWORK, "none")
        if any(ns.get("type") == "network" and not ns.get("path") for ns in spec.get("linux", {}).get("namespaces", ())):
            try:
                await trio.to_thread.run_sync(set_loopback, init_pid, network == "loopback")
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self.delete(env_id)
                raise
        return init_pid

    async def start(self, env_id: str) -> None:
        init_pid, _ = await self._lookup(env_id)
        fds: list[int] = []
        try:
            for path, flags in (
                (f"/proc/{init_pid}/ns/mnt", os.O_RDONLY),
                (f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY),
                ("/proc/self/ns/mnt", os.O_RDONLY),
            ):
                fds.append(os.open(path, flags | os.O_CLOEXEC))
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise ContainerError("the env's init is gone before start", env_id=env_id, detail=str(exc)) from exc
        try:
            proc = await trio.run_process(
                [*self._base, "start", env_id],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                preexec_fn=_root_remount_step(*fds),
            )
        except subprocess.SubprocessError as exc:  # the preexec step failed in the child
            raise ContainerError("could not remount the env's root nodev,nosuid", env_id=env_id, detail=str(exc)) from exc
        finally:
            for fd in fds:
                os.close(fd)
        if proc.returncode != 0:
            detail = proc.stderr.decode(errors="replace")
            if any(m in proc.stderr for m in _NO_CONTAINER):
                raise ContainerNotFoundError("no such container", env_id=env_id, detail=detail)
            raise ContainerError(f"crun start failed with exit status {proc.returncode}", env_id=env_id, detail=detail)
        self._started.add(env_id)

    async def exec(
        self,
        env_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: User | None = None,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        cgroup_procs: Sequence[str] = (),
        on_output: OutputCallback | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        _init_pid, base = await self._lookup(env_id)
        if env_id not in self._started:
            raise ContainerError("cannot exec in an env that was created but not started", env_id=env_id)
        process = self._exec_process(base, argv, env=env, cwd=cwd, user=user)
        cap = self.max_output_bytes if max_output_bytes is None else max_output_bytes
        payload = json.dumps(process).encode()
        proc_r, proc_w = os.pipe2(os.O_CLOEXEC)
        log_r, log_w = os.pipe2(os.O_CLOEXEC)
        closing = [proc_r, proc_w, log_r, log_w]
        try:
            if len(payload) > 60_000:  # over a pipe buffer the write below would block
                raise SpecError(f"exec process description is {len(payload)} bytes; keep env and argv under 60 kB")
            os.write(proc_w, payload)
            os.close(proc_w)
            closing.remove(proc_w)
            started = time.perf_counter()
            proc = await trio.lowlevel.open_process(
                [*self._base, f"--log=file:/dev/fd/{log_w}", "exec", f"--process=/dev/fd/{proc_r}", env_id],
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(proc_r, log_w),
                preexec_fn=_cgroup_entry(cgroup_procs) if cgroup_procs else None,
            )
            for fd in (proc_r, log_w):
                os.close(fd)
                closing.remove(fd)
            return await self._collect(env_id, proc, log_r, started, stdin, timeout_s, on_output, cap, argv[:1])
        finally:
            for fd in closing:
                os.close(fd)

    def _exec_process(self, base: dict, argv: Sequence[str], *, env, cwd, user: User | None) -> dict:
        if user is None:
            bu = base.get("user", {})
            user = User(uid=bu.get("uid", 0), gid=bu.get("gid", 0), additional_gids=tuple(bu.get("additionalGids", ())))
            extra_env = dict(env or {})
        else:
            extra_env = {"HOME": user.home or "/", **(env or {})}
        nofile = next(
            ((r["soft"], r["hard"]) for r in base.get("rlimits", ()) if r.get("type") == "RLIMIT_NOFILE"), (1024, 524288)
        )
        caps = base.get("capabilities", {}).get("bounding", [])
        return build_process(
            args=argv,
            env=merge_env(base.get("env", []), extra_env),
            cwd=cwd or base.get("cwd", "/"),
            user=user,
            capabilities=caps,
            nofile=nofile,
        )

    async def _collect(
        self,
        env_id: str,
        proc: trio.Process,
        log_r: int,
        started: float,
        stdin: bytes | None,
        timeout_s: float | None,
        on_output: OutputCallback | None,
        cap: int,
        argv0: Sequence[str] = (),
    ) -> ExecResult:
        buffers = {"stdout": bytearray(), "stderr": bytearray()}
        truncated = {"stdout": False, "stderr": False}
        eof = {"stdout": trio.Event(), "stderr": trio.Event()}
        is_async = on_output is not None and inspect.iscoroutinefunction(on_output)

        async def pump(stream: trio.abc.ReceiveStream, name: str) -> None:
            buf = buffers[name]
            try:
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    room = cap - len(buf)
                    if room <= 0:
                        truncated[name] = True
                        continue  # keep draining so the command never blocks on a full pipe
                    if len(data) > room:
                        data = data[:room]
                        truncated[name] = True
                    buf += data
                    if on_output is not None:
                        if is_async:
                            await on_output(name, data)
                        else:
                            on_output(name, data)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass
            finally:
                eof[name].set()

        async def feed(stream: trio.abc.SendStream, data: bytes) -> None:
            try:
                if data:
                    await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the command exited or closed its stdin without reading everything
            finally:
                await stream.aclose()

        timed_out = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, proc.stdout, "stdout")
                nursery.start_soon(pump, proc.stderr, "stderr")
                if stdin is not None:
                    nursery.start_soon(feed, proc.stdin, stdin)
                with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as scope:
                    await proc.wait()
                if scope.cancelled_caught:
                    timed_out = True
                    await self._stop_exec(proc)
                # Background jobs may hold the pipes open after the command exits; do not wait
                # for them beyond a short grace.
                with trio.move_on_after(self.drain_grace_s):
                    await eof["stdout"].wait()
                    await eof["stderr"].wait()
                nursery.cancel_scope.cancel()
        finally:
            if proc.returncode is None:
                with trio.CancelScope(shield=True):
                    await self._stop_exec(proc)
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream is not None:
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
        duration_s = time.perf_counter() - started
        crun_log = _read_nonblocking(log_r)
        code = _decode_status(proc.returncode)
        stderr = bytes(buffers["stderr"])
        not_found = False
        if crun_log and code != 0:
            m = _NOT_FOUND.search(crun_log)
            if m:
                not_found = True
                code = 127
                stderr = b"weenv: command not found in env %s: %s\n" % (env_id.encode(), m.group(1))
            elif _CANNOT_EXECUTE.search(crun_log):
                code = 126
                detail = _CANNOT_EXECUTE.search(crun_log).group(0)
                stderr = b"weenv: cannot execute %s in env %s: %s\n" % (
                    (list(argv0)[0] if argv0 else "?").encode(), env_id.encode(), detail)
            elif any(s in crun_log for s in _NO_CONTAINER):
                raise ContainerNotFoundError("no such container", env_id=env_id, detail=crun_log.decode(errors="replace"))
            elif not timed_out:
                raise ContainerError("crun exec failed", env_id=env_id, detail=crun_log.decode(errors="replace"))
        return ExecResult(
            exit_code=code,
            stdout=bytes(buffers["stdout"]),
            stderr=stderr,
            timed_out=timed_out,
            duration_s=duration_s,
            stdout_truncated=truncated["stdout"],
            stderr_truncated=truncated["stderr"],
            command_not_found=not_found,
        )

    async def _stop_exec(self, proc: trio.Process) -> None:
        """Kill the command's whole tree, then let crun report (or kill it too)."""
        await trio.to_thread.run_sync(kill_exec_tree, proc.pid)
        with trio.move_on_after(self.kill_grace_s):
            await proc.wait()
            return
        proc.kill()
        await proc.wait()
        await trio.to_thread.run_sync(kill_exec_tree, proc.pid)

    async def kill(self, env_id: str, sig: int = signal.SIGKILL) -> None:
        await self._crun("kill", env_id, str(int(sig)), env_id=env_id)

    async def delete(self, env_id: str, force: bool = True) -> None:
        known = self._known.pop(env_id, None)
        self._started.discard(env_id)
        pid = known[0] if known else 0
        if pid <= 0:
            try:
                pid = (await self.state(env_id)).pid
            except ContainerNotFoundError:
                return
        pidfd = -1
        if pid > 0:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                pidfd = -1
        try:
            try:
                await self._crun("delete", *(["--force"] if force else []), env_id, env_id=env_id)
            except ContainerNotFoundError:
                return
            if pidfd >= 0:
                # SIGKILL of a pid namespace's init is asynchronous; "deleted" means it is gone.
                with trio.move_on_after(self.kill_grace_s):
                    await trio.lowlevel.wait_readable(pidfd)
        finally:
            if pidfd >= 0:
                os.close(pidfd)

    async def state(self, env_id: str) -> ContainerState:
        out = await self._crun("state", env_id, env_id=env_id)
        d = json.loads(out)
        return ContainerState(id=d["id"], pid=d.get("pid", 0), status=d["status"], bundle=d.get("bundle", ""), created=d.get("created", ""))

    async def list(self) -> list[ContainerState]:
        out = await self._crun("list", "--format=json")
        return [
            ContainerState(id=d["id"], pid=d.get("pid", 0), status=d["status"], bundle=d.get("bundle", ""), created=d.get("created", ""))
            for d in json.loads(out or b"[]")
        ]


def _read_nonblocking(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out


# -- the fake ------------------------------------------------------------------------------------

FakeCommand = Callable[[list[str], bytes], "Awaitable[tuple[int, bytes, bytes]] | tuple[int, bytes, bytes]"]


class FakeRuntime(Runtime):
    """Containers in memory, for unit tests of daemon logic. Commands are Python: a few built in
    (``true``, ``false``, ``echo``, ``cat``, ``sleep S``, ``exit N``, ``env``, ``pwd``, ``id``)
    and any others given as ``commands={"name": fn(argv, stdin) -> (code, out, err)}``."""

    def __init__(self, commands: Mapping[str, FakeCommand] | None = None):
        self.commands = dict(commands or {})
        self.containers: dict[str, dict] = {}
        self.calls: list[tuple] = []
        self._next_pid = 1000

    def _get(self, env_id: str) -> dict:
        c = self.containers.get(env_id)
        if c is None:
            raise ContainerNotFoundError("no such container", env_id=env_id)
        return c

    async def create(self, env_id, bundle_dir, rootfs, spec, cgroup_procs=()) -> int:
        await trio.lowlevel.checkpoint()
        self.calls.append(("create", env_id))
        if env_id in self.containers:
            raise ContainerExistsError("a container with this id already exists", env_id=env_id)
        self._next_pid += 1
        self.containers[env_id] = {
            "pid": self._next_pid,
            "status": "created",
            "bundle": bundle_dir,
            "rootfs": rootfs,
            "spec": dict(spec),
            "cgroup_procs": list(cgroup_procs),
        }
        return self._next_pid

    async def start(self, env_id) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append(("start", env_id))
        c = self._get(env_id)
        if c["status"] != "created":
            raise ContainerError(f"cannot start a container that is {c['status']}", env_id=env_id)
        c["status"] = "running"

    async def exec(
        self,
        env_id,
        argv,
        *,
        env=None,
        cwd=None,
        user=None,
        stdin=None,
        timeout_s=None,
        cgroup_procs=(),
        on_output=None,
        max_output_bytes=None,
    ) -> ExecResult:
        self.calls.append(("exec", env_id, list(argv)))
        c = self._get(env_id)
        if c["status"] != "running":
            raise ContainerError(f"cannot exec in a container that is {c['status']}", env_id=env_id)
        argv = list(argv)
        if not argv:
            raise SpecError("args must be a non-empty list of strings")
        proc = c["spec"].get("process", {})
        full_env = dict(kv.split("=", 1) for kv in proc.get("env", []))
        full_env.update(env or {})
        started = time.perf_counter()
        timed_out = False
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as scope:
            code, out, err = await self._run(argv, stdin or b"", full_env, cwd or proc.get("cwd", "/"), user or proc.get("user"))
        not_found = False
        if scope.cancelled_caught:
            timed_out, code, out, err = True, 137, b"", b""
        elif code is None:
            not_found, code, out, err = True, 127, b"", b"weenv: command not found in env %s: %s\n" % (env_id.encode(), argv[0].encode())
        cap = DEFAULT_MAX_OUTPUT_BYTES if max_output_bytes is None else max_output_bytes
        if on_output is not None:
            for name, data in (("stdout", out[:cap]), ("stderr", err[:cap])):
                if data:
                    r = on_output(name, data)
                    if inspect.isawaitable(r):
                        await r
        return ExecResult(
            exit_code=code,
            stdout=out[:cap],
            stderr=err[:cap],
            timed_out=timed_out,
            duration_s=time.perf_counter() - started,
            stdout_truncated=len(out) > cap,
            stderr_truncated=len(err) > cap,
            command_not_found=not_found,
        )

    async def _run(self, argv, stdin, env, cwd, user) -> tuple[int | None, bytes, bytes]:
        name = argv[0]
        if name in self.commands:
            r = self.commands[name](argv, stdin)
            if inspect.isawaitable(r):
                r = await r
            return r
        await trio.lowlevel.checkpoint()
        if name == "true":
            return 0, b"", b""
        if name == "false":
            return 1, b"", b""
        if name == "echo":
            return 0, (" ".join(argv[1:]) + "\n").encode(), b""
        if name == "cat":
            return 0, stdin, b""
        if name == "sleep":
            await trio.sleep(float(argv[1]))
            return 0, b"", b""
        if name == "exit":
            return int(argv[1]), b"", b""
        if name == "env":
            return 0, "".join(f"{k}={v}\n" for k, v in env.items()).encode(), b""
        if name == "pwd":
            return 0, f"{cwd}\n".encode(), b""
        if name == "id":
            uid = user.uid if isinstance(user, User) else (user or {}).get("uid", 0)
            gid = user.gid if isinstance(user, User) else (user or {}).get("gid", 0)
            return 0, f"uid={uid} gid={gid}\n".encode(), b""
        return None, b"", b""

    async def kill(self, env_id, sig=signal.SIGKILL) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append(("kill", env_id, int(sig)))
        c = self._get(env_id)
        if c["status"] == "stopped":
            raise ContainerError("container is not running", env_id=env_id)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            c["status"] = "stopped"
            c["pid"] = 0

    async def delete(self, env_id, force=True) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append(("delete", env_id))
        c = self.containers.get(env_id)
        if c is None:
            return
        if c["status"] in ("running", "paused") and not force:
            raise ContainerError("container is running (delete with force=True)", env_id=env_id)
        del self.containers[env_id]

    async def state(self, env_id) -> ContainerState:
        await trio.lowlevel.checkpoint()
        c = self._get(env_id)
        return ContainerState(id=env_id, pid=c["pid"], status=c["status"], bundle=c["bundle"])

    async def list(self) -> list[ContainerState]:
        await trio.lowlevel.checkpoint()
        return [ContainerState(id=k, pid=c["pid"], status=c["status"], bundle=c["bundle"]) for k, c in self.containers.items()]
