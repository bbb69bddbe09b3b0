"""The container runtime seam: a prepared rootfs in, a running, locked-down env out.

:class:`Runtime` is the interface the daemon drives (async, trio); :class:`CrunRuntime` runs crun
for real, :class:`weenv.testing.FakeRuntime` keeps containers in memory for unit tests of daemon
logic. The same conformance tests run against both.

How :class:`CrunRuntime` drives crun:

- crun keeps its state under weenv's own directory (``<run_dir>/crun``), never /run/crun, and runs
  with ``--cgroup-manager=disabled``: weenv owns the cgroups. Each crun process the runtime
  spawns (create, exec) writes its own pid into every ``cgroup.procs`` it is given before it
  execs crun (a two-line POSIX shell trampoline, so Python can vfork instead of forking the whole
  daemon for a preexec_fn), so the env's init and every exec'd process are born in the env's
  groups.
- ``create`` spawns ``crun create`` from a fresh thread that first enters a private mount
  namespace with the cgroup2 mount hidden, when the host needs it (:mod:`._hostcheck`); the
  namespace's teardown happens as that thread ends, off the caller's path. Then, while the init
  is still parked on crun's exec fifo, another fresh thread joins the env's mount namespace and
  remounts its root ``nodev,nosuid`` (crun re-applies its own flags to the root bind mount, and
  with no devices cgroup ``nodev`` is what keeps a device node shipped in a layer from being
  opened), and sets ``lo`` up or down. No extra process is started for any of this.
- ``exec`` passes the full OCI process (``crun exec --process``) so an exec'd command has the
  init's capabilities, no_new_privileges and rlimits; the JSON goes through a pipe, not a file.
  The crun process leads a new session and every process of the exec is its descendant or in a
  session one of them made, so a timeout kills the whole tree (children, grandchildren,
  orphaned background jobs), with pidfds so that a recycled pid is never signalled.
"""

from __future__ import annotations

import abc
import inspect
import json
import logging
import math
import os
import re
import select
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Protocol

import msgspec
import trio

from .._errors import ContainerError, ContainerExistsError, ContainerNotFoundError, SpecError
from ._hostcheck import HostFacts, detect_host, private_mount_ns_recipe
from ._ocispec import (
    ANNOTATION_AGENT_SOCKET,
    ANNOTATION_EXEC_USER,
    ANNOTATION_NETWORK,
    DEFAULT_NOFILE,
    User,
    build_process,
    build_spec,
    merge_env,
    render_etc_files,
)
from ... import _wire as wire
from ._ns import (
    TRAMPOLINE_FAILED,
    _CgroupFds,
    _empty_stdin,
    _setup_env_namespaces,
    in_fresh_thread,
    kill_exec_tree,
)
from ._agent import agent_attach, agent_control, agent_exec, agent_list, agent_start, agent_wait

_timing_log = logging.getLogger("weenv.runtime.timing")

DEFAULT_MAX_OUTPUT_BYTES = 16 << 20

OutputCallback = Callable[[str, bytes], Awaitable[None] | None]


ExecResult = wire.ExecResult
"""What one command did (one type from runtime to client: :class:`weenv._wire.ExecResult`)."""


class ContainerState(msgspec.Struct, frozen=True, kw_only=True):
    """crun's view of one container: status is "created", "running", "paused" or "stopped"."""

    id: str
    pid: int
    status: str
    bundle: str = ""
    created: str = ""


class ProcessStream(Protocol):
    """An attached process handle (docs/architecture.md, "Processes"): its events come in
    (:class:`weenv._wire.ProcessEvent`: output, ``dropped``, then ``end``), stdin, signals and pty
    sizes go out. Closing it detaches; the process runs on."""

    pid: int
    pty: bool
    end: wire.ProcessEnd | None

    async def receive(self) -> wire.ProcessEvent | None:
        """The next event; None after ``end``."""

    def __aiter__(self) -> AsyncIterator[wire.ProcessEvent]: ...

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def signal(self, sig: int) -> None: ...

    async def resize(self, rows: int, cols: int) -> None: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> "ProcessStream": ...

    async def __aexit__(self, *exc: object) -> None: ...


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

    # -- process handles (docs/architecture.md, "Processes"); a runtime without them says so ----

    async def start_process(
        self,
        env_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: User | None = None,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
        tag: str | None = None,
        buffer_bytes: int | None = None,
        cgroup_procs: Sequence[str] = (),
    ) -> ProcessStream:
        """Start ``argv`` as a background process (as :meth:`exec` runs one) and return it
        attached. It outlives the stream: closing the stream only detaches. ``stdin`` keeps its
        stdin open; ``pty`` (rows, cols) puts it on a pseudo-terminal. Output produced while nobody
        is attached is kept (``buffer_bytes``, the newest) for the next :meth:`connect_process`.
        Raises :class:`~weenv.provision.ProcessStartError` when the command cannot start."""
        raise ContainerError(f"the {type(self).__name__} runtime has no process handles", env_id=env_id)

    async def connect_process(self, env_id: str, pid: int) -> ProcessStream:
        """Attach to process ``pid`` (a running or recently finished one): first the output kept
        since the last reader, then live. Raises :class:`~weenv.provision.ProcessNotFoundError`."""
        raise ContainerError(f"the {type(self).__name__} runtime has no process handles", env_id=env_id)

    async def list_processes(self, env_id: str) -> list[wire.ProcessInfo]:
        """The env's processes weenv started: running ones, and recently finished background ones."""
        raise ContainerError(f"the {type(self).__name__} runtime has no process handles", env_id=env_id)

    async def send_stdin(self, env_id: str, pid: int, data: bytes, *, close: bool = False) -> None:
        """Write ``data`` to the process's stdin (then close it, on a pty send ^D). Calls are taken
        in order. Raises :class:`~weenv.provision.ProcessStateError` when its stdin is closed."""
        raise ContainerError(f"the {type(self).__name__} runtime has no process handles", env_id=env_id)

    async def signal_process(self, env_id: str, pid: int, sig: int) -> None:
        """Send ``sig`` to every process of the process's session."""
        raise ContainerError(f"the {type(self).__name__} runtime has no process handles", env_id=env_id)

    async def resize_process(self, env_id: str, pid: int, rows: int, cols: int) -> None:
        """Set the size of the process's pty (it gets SIGWINCH)."""
        raise ContainerError(f"the {type(self).__name__} runtime has no process handles", env_id=env_id)

    async def wait_process(self, env_id: str, pid: int, timeout_s: float | None = None) -> wire.ProcessEnd | None:
        """How the process ended, once it has; None if ``timeout_s`` came first. Its output stays
        for the next reader."""
        raise ContainerError(f"the {type(self).__name__} runtime has no process handles", env_id=env_id)

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
    :func:`~weenv.provision.runtime._ocispec.build_spec` for ``spec_options``)."""
    etc_dir = os.path.join(bundle_dir, "etc")
    os.makedirs(etc_dir, exist_ok=True)
    for name, data in render_etc_files(env_id, network, spec_options.pop("nameserver", None),
                                       spec_options.pop("node_address", None)).items():
        with open(os.path.join(etc_dir, name), "wb") as f:
            f.write(data)
    agent = spec_options.get("agent_path") is not None and spec_options.get("agent_socket") is not None
    init_path = None if spec_options.get("args") or agent else host.require_init()
    soft, hard = spec_options.pop("nofile", DEFAULT_NOFILE)
    hard = min(hard, host.nofile_hard)
    spec_options["nofile"] = (min(soft, hard), hard)
    return build_spec(env_id=env_id, rootfs=rootfs, init_path=init_path, network=network, etc_dir=etc_dir, **spec_options)


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
        # env id -> (agent socket on the host, default exec user) for envs whose init is weenv-agent
        self._agents: dict[str, tuple[str, User]] = {}

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
        self._note_agent(env_id, spec)
        if st.pid > 0:
            self._known[env_id] = known
        if st.status in ("running", "paused"):
            self._started.add(env_id)
        return known

    def _note_agent(self, env_id: str, spec: Mapping) -> None:
        notes = spec.get("annotations", {})
        sock = notes.get(ANNOTATION_AGENT_SOCKET)
        if not sock:
            self._agents.pop(env_id, None)
            return
        uid, gid, gids, home = json.loads(notes.get(ANNOTATION_EXEC_USER, "[0, 0, [], \"/root\"]"))
        self._agents[env_id] = (sock, User(uid=uid, gid=gid, additional_gids=tuple(gids), home=home or "/"))

    # -- Runtime -------------------------------------------------------------------------------

    async def create(
        self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, cgroup_procs: Sequence[str] = (),
        *, listen_fd: int | None = None,
    ) -> int:
        """``listen_fd`` is handed to the init as descriptor 3 (the in-env agent's listening socket)."""
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
        recipe = self._private_ns
        try:
            with _CgroupFds(cgroup_procs) as cg:
                argv = cg.wrap(
                    [*self._base, f"--log=file:{crun_log}", "create", "--bundle", bundle_dir, "--pid-file", pid_file,
                     *(["--preserve-fds=1"] if listen_fd is not None else []), env_id],
                    fd3=listen_fd,
                )

                def spawn() -> int:
                    # In a fresh thread: the private mount namespace (when the host needs one) is
                    # this thread's, crun inherits it, and its teardown happens when the thread
                    # ends, after we have our answer.
                    if recipe is not None:
                        recipe()
                    stdin_r = _empty_stdin()
                    try:
                        return subprocess.run(
                            argv, stdin=stdin_r, stdout=init_log, stderr=init_log,
                            pass_fds=(*cg.fds, *([listen_fd] if listen_fd is not None else [])),
                        ).returncode
                    finally:
                        os.close(stdin_r)

                _t0 = time.perf_counter()
                returncode = await trio.to_thread.run_sync(in_fresh_thread, spawn)
                _timing_log.debug("crun create %s: spawn %.1f ms", env_id, (time.perf_counter() - _t0) * 1000)
        except OSError as exc:
            raise ContainerError("could not open the env's cgroups", env_id=env_id, detail=str(exc)) from exc
        finally:
            os.close(init_log)
        if returncode != 0:
            try:
                with open(crun_log, "rb") as f:
                    detail = f.read()[-4000:].decode(errors="replace")
            except OSError:
                detail = ""
            if returncode == TRAMPOLINE_FAILED and not detail:
                detail = f"could not write the new process into {', '.join(cgroup_procs)}"
            if "already exists" in detail:
                raise ContainerExistsError("a container with this id already exists", env_id=env_id, detail=detail)
            raise ContainerError(f"crun create failed with exit status {returncode}", env_id=env_id, detail=detail)
        with open(pid_file) as f:
            init_pid = int(f.read().strip())
        self._known[env_id] = (init_pid, spec.get("process", {}))
        self._note_agent(env_id, spec)
        self._started.discard(env_id)
        network = spec.get("annotations", {}).get(ANNOTATION_NETWORK, "none")
        new_netns = any(ns.get("type") == "network" and not ns.get("path") for ns in spec.get("linux", {}).get("namespaces", ()))
        try:
            _t0 = time.perf_counter()
            await trio.to_thread.run_sync(
                in_fresh_thread,
                lambda: _setup_env_namespaces(init_pid, remount_root=True, loopback=(network == "loopback") if new_netns else None),
            )
            _timing_log.debug("crun create %s: namespace setup %.1f ms", env_id, (time.perf_counter() - _t0) * 1000)
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self.delete(env_id)
            if isinstance(exc, OSError):
                raise ContainerError("could not lock the env down before start", env_id=env_id, detail=str(exc)) from exc
            raise
        return init_pid

    async def start(self, env_id: str) -> None:
        await self._lookup(env_id)
        proc = await trio.run_process([*self._base, "start", env_id], capture_stdout=True, capture_stderr=True, check=False)
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
        cap = self.max_output_bytes if max_output_bytes is None else max_output_bytes
        agent = self._agents.get(env_id)
        if agent is not None:
            sock, default_user = agent
            process = self._exec_process(base, argv, env=env, cwd=cwd, user=user or default_user)
            who = process["user"]
            return await agent_exec(sock, process["args"], env=process["env"], cwd=process["cwd"], uid=who["uid"],
                                    gid=who["gid"], groups=who.get("additionalGids", ()), stdin=stdin,
                                    timeout_s=timeout_s, on_output=on_output, max_output_bytes=cap, env_id=env_id,
                                    kill_grace_s=self.kill_grace_s)
        process = self._exec_process(base, argv, env=env, cwd=cwd, user=user)
        payload = json.dumps(process).encode()
        proc_r, proc_w = os.pipe2(os.O_CLOEXEC)
        log_r, log_w = os.pipe2(os.O_CLOEXEC)
        closing = [proc_r, proc_w, log_r, log_w]
        if stdin is None:
            closing.append(_empty_stdin())
        try:
            if len(payload) > 60_000:  # over a pipe buffer the write below would block
                raise SpecError(f"exec process description is {len(payload)} bytes; keep env and argv under 60 kB")
            os.write(proc_w, payload)
            os.close(proc_w)
            closing.remove(proc_w)
            started = time.perf_counter()
            with _CgroupFds(cgroup_procs) as cg:
                proc = await trio.lowlevel.open_process(
                    cg.wrap([*self._base, f"--log=file:/dev/fd/{log_w}", "exec", f"--process=/dev/fd/{proc_r}", env_id]),
                    stdin=subprocess.PIPE if stdin is not None else closing[-1],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    pass_fds=(proc_r, log_w, *cg.fds),
                )
            for fd in (proc_r, log_w):
                os.close(fd)
                closing.remove(fd)
            return await self._collect(env_id, proc, log_r, started, stdin, timeout_s, on_output, cap, argv[:1])
        finally:
            for fd in closing:
                os.close(fd)

    # -- process handles: all through the env's agent, which keeps the process table ----------

    async def _agent_socket(self, env_id: str) -> tuple[str, dict, User]:
        _init_pid, base = await self._lookup(env_id)
        if env_id not in self._started:
            raise ContainerError("cannot start processes in an env that was created but not started", env_id=env_id)
        agent = self._agents.get(env_id)
        if agent is None:
            raise ContainerError("process handles need the in-env agent; this env runs without it "
                                 "(daemon use_agent=False or no C compiler)", env_id=env_id)
        return agent[0], base, agent[1]

    async def start_process(
        self,
        env_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: User | None = None,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
        tag: str | None = None,
        buffer_bytes: int | None = None,
        cgroup_procs: Sequence[str] = (),
    ) -> ProcessStream:
        sock, base, default_user = await self._agent_socket(env_id)
        process = self._exec_process(base, argv, env=env, cwd=cwd, user=user or default_user)
        who = process["user"]
        return await agent_start(sock, process["args"], env=process["env"], cwd=process["cwd"], uid=who["uid"],
                                 gid=who["gid"], groups=who.get("additionalGids", ()), stdin=stdin, env_id=env_id,
                                 background=True, pty=pty, tag=tag, buffer_bytes=buffer_bytes,
                                 shown_env=[f"{k}={v}" for k, v in (env or {}).items()])

    async def connect_process(self, env_id: str, pid: int) -> ProcessStream:
        sock, _base, _user = await self._agent_socket(env_id)
        return await agent_attach(sock, pid, env_id=env_id)

    async def list_processes(self, env_id: str) -> list[wire.ProcessInfo]:
        sock, _base, _user = await self._agent_socket(env_id)
        return await agent_list(sock, env_id=env_id)

    async def send_stdin(self, env_id: str, pid: int, data: bytes, *, close: bool = False) -> None:
        sock, _base, _user = await self._agent_socket(env_id)
        frames = [(b"I", data[i : i + (1 << 20)]) for i in range(0, len(data), 1 << 20)]
        await agent_control(sock, pid, frames + ([(b"E", b"")] if close else []), env_id=env_id)

    async def signal_process(self, env_id: str, pid: int, sig: int) -> None:
        sock, _base, _user = await self._agent_socket(env_id)
        await agent_control(sock, pid, [(b"K", str(int(sig)).encode())], env_id=env_id)

    async def resize_process(self, env_id: str, pid: int, rows: int, cols: int) -> None:
        sock, _base, _user = await self._agent_socket(env_id)
        await agent_control(sock, pid, [(b"W", f"{int(rows)} {int(cols)}".encode())], env_id=env_id)

    async def wait_process(self, env_id: str, pid: int, timeout_s: float | None = None) -> wire.ProcessEnd | None:
        sock, _base, _user = await self._agent_socket(env_id)
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
            return await agent_wait(sock, pid, env_id=env_id)
        return None

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

        timed_out = stopped = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, proc.stdout, "stdout")
                nursery.start_soon(pump, proc.stderr, "stderr")
                if stdin is not None:
                    nursery.start_soon(feed, proc.stdin, stdin)
                with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as scope:
                    await proc.wait()
                if scope.cancelled_caught:
                    timed_out = stopped = True
                    await self._stop_exec(proc)
                # Background jobs may hold the pipes open after the command exits; do not wait
                # for them beyond a short grace.
                with trio.move_on_after(self.drain_grace_s):
                    await eof["stdout"].wait()
                    await eof["stderr"].wait()
                nursery.cancel_scope.cancel()
        finally:
            # Once only: a second round after a timeout's doubled the wait on a frozen env (4 kill
            # graces where the error below says 2).
            if proc.returncode is None and not stopped:
                with trio.CancelScope(shield=True):
                    await self._stop_exec(proc)
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream is not None:
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
        duration_s = time.perf_counter() - started
        if proc.returncode is None:
            raise ContainerError(
                f"the command did not die within {2 * self.kill_grace_s:.0f} s of SIGKILL (is the env frozen?); "
                "it ends when the env is thawed or killed",
                env_id=env_id,
            )
        crun_log = _read_nonblocking(log_r)
        code = _decode_status(proc.returncode)
        stderr = bytes(buffers["stderr"])
        not_found = False
        if code == TRAMPOLINE_FAILED and stderr.startswith(b"weenv-spawn:"):
            raise ContainerError("could not put the command into the env's cgroups", env_id=env_id, detail=stderr.decode(errors="replace"))
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
        with trio.move_on_after(self.kill_grace_s):
            await proc.wait()
        # Still there: its cgroup is frozen (SIGKILL lands on thaw). Do not hang the caller.
        await trio.to_thread.run_sync(partial(kill_exec_tree, proc.pid, spare_leader=False, deadline_s=0.1))

    async def kill(self, env_id: str, sig: int = signal.SIGKILL) -> None:
        await self._crun("kill", env_id, str(int(sig)), env_id=env_id)

    async def delete(self, env_id: str, force: bool = True) -> None:
        known = self._known.pop(env_id, None)
        self._agents.pop(env_id, None)
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

