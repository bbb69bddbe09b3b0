"""crun as weenv's runtime: :class:`CrunRuntime`, the containers interface over crun, and the bundle
(:func:`prepare_bundle`). The env's processes are the shared process host's (:mod:`._processes`);
what is crun's in them is :class:`_CrunExec`.

How :class:`CrunRuntime` drives crun:

- crun keeps its state under weenv's own directory (``<run_dir>/crun``), never /run/crun, and runs
  with ``--cgroup-manager=disabled``: weenv owns the cgroups. Every crun process is exec'd from a
  sealed in-memory copy of the binary (:func:`~._spawn.sealed_binary`): crun then skips copying
  itself on each start (its guard against a container overwriting the host binary through
  /proc/self/exe), a second exec of itself and its ten libraries that cost 2-3 ms per call.
  ``start`` of a container without hooks is done without crun: one byte into its exec fifo
  (:meth:`CrunRuntime._release_init`). Each crun process the runtime
  spawns (create, exec) writes its own pid into every ``cgroup.procs`` it is given before it
  execs crun (a two-line POSIX shell trampoline, so Python can vfork instead of forking the whole
  daemon for a preexec_fn), so the env's init and every exec'd process are born in the env's
  groups. The seccomp program is built once per profile (:mod:`._seccomp`).
- ``create`` spawns ``crun create`` from a fresh thread that first enters a private mount
  namespace with the cgroup2 mount hidden, when the host needs it (:mod:`._hostcheck`); the
  namespace's teardown happens as that thread ends, off the caller's path. Then, while the init
  is still parked on crun's exec fifo, another fresh thread joins the env's mount namespace and
  remounts its root ``nodev,nosuid`` (crun re-applies its own flags to the root bind mount, and
  with no devices cgroup ``nodev`` is what keeps a device node shipped in a layer from being
  opened), and sets ``lo`` up or down. No extra process is started for any of this.
- an env without the agent runs each command by ``crun exec --process`` (the JSON through a pipe,
  not a file); crun's own errors go to a log pipe, and a timeout kills the command's whole tree
  (children, grandchildren, orphaned background jobs: :func:`~._ns.kill_exec_tree`), with pidfds
  so that a recycled pid is never signalled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import time
from collections.abc import Mapping, Sequence
from functools import partial

import msgspec
import trio

from .._errors import ContainerError, ContainerExistsError, ContainerNotFoundError
from ._hostcheck import HostFacts, detect_host, private_mount_ns_recipe
from ._ns import _CgroupFds, _empty_stdin, _setup_env_namespaces, in_fresh_thread, kill_exec_tree
from ._oci import EnvTable, OciCli, create_failure, log_tail, write_config
from ._ocispec import ANNOTATION_NETWORK, DEFAULT_NOFILE, build_spec, render_etc_files
from ._processes import ExecCall, ProcessHost, ProcessTarget
from ._seam import DEFAULT_MAX_OUTPUT_BYTES, ContainerState, ExecResult, Runtime
from ._seccomp import ANNOTATION_SECCOMP_BPF, compiled_seccomp
from ._spawn import sealed_binary, spawn_create

_timing_log = logging.getLogger("weenv.runtime.timing")


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


class CrunRuntime(Runtime):
    """Runs crun for real. ``run_dir`` is weenv's (``$WEENV_HOME/run``); crun's state goes to
    ``run_dir/crun``."""

    name = "crun"
    no_process_handles = None

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
        self._cli = OciCli("crun", [sealed_binary(self.crun), "--root", self.state_dir, "--cgroup-manager=disabled"],
                           _NO_CONTAINER)
        self._envs = EnvTable(self.state, lambda env_id, _st: os.path.join(self.state_dir, env_id, "config.json"),
                              "crun has no config for this container", agents=True)
        # Envs this runtime created whose start is the exec fifo alone (no hooks): see _release_init.
        self._plain_start: set[str] = set()
        self.process_host = ProcessHost(self.process_target)

    async def process_target(self, env_id: str) -> ProcessTarget:
        return await self._envs.target(env_id, self)

    def exec_call(self, env_id: str, process_path: str) -> ExecCall:
        return _CrunExec(self._cli.base, env_id, process_path)

    # -- Containers ------------------------------------------------------------------------------

    async def create(
        self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, cgroup_procs: Sequence[str] = (),
        *, listen_fd: int | None = None,
    ) -> int:
        spec = dict(spec)
        spec["root"] = {**spec.get("root", {}), "path": rootfs}
        seccomp = spec.get("linux", {}).get("seccomp")
        notes = spec.get("annotations", {})
        if seccomp and ANNOTATION_SECCOMP_BPF not in notes:
            bpf = compiled_seccomp(seccomp)
            if bpf is not None:
                spec["annotations"] = {**notes, ANNOTATION_SECCOMP_BPF: bpf}
        pid_file = os.path.join(bundle_dir, "init.pid")
        crun_log = os.path.join(bundle_dir, "crun.log")
        write_config(bundle_dir, spec, pid_file, crun_log)
        # The init's stdout/stderr: a log in the bundle (a pipe would keep crun create waiting).
        init_log = os.open(os.path.join(bundle_dir, "init.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        recipe = self._private_ns
        try:
            with _CgroupFds(cgroup_procs) as cg:
                argv = [*self._cli.base, f"--log=file:{crun_log}", "create", "--bundle", bundle_dir, "--pid-file",
                        pid_file, *(["--preserve-fds=1"] if listen_fd is not None else []), env_id]

                def spawn() -> int:
                    # In a fresh thread: the private mount namespace (when the host needs one) is
                    # this thread's, crun inherits it, and its teardown happens when the thread
                    # ends, after we have our answer.
                    if recipe is not None:
                        recipe()
                    stdin_r = _empty_stdin()
                    try:
                        return spawn_create(argv, stdin=stdin_r, out=init_log, fd3=listen_fd, cgroup_fds=cg.fds)
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
            detail = create_failure(returncode, log_tail(crun_log), cgroup_procs)
            if "already exists" in detail:
                raise ContainerExistsError("a container with this id already exists", env_id=env_id, detail=detail)
            raise ContainerError(f"crun create failed with exit status {returncode}", env_id=env_id, detail=detail)
        with open(pid_file) as f:
            init_pid = int(f.read().strip())
        self._envs.created(env_id, init_pid, spec)
        if not spec.get("hooks"):  # crun start would run poststart hooks; weenv's specs have none
            self._plain_start.add(env_id)
        network = spec.get("annotations", {}).get(ANNOTATION_NETWORK, "none")
        new_netns = any(ns.get("type") == "network" and not ns.get("path") for ns in spec.get("linux", {}).get("namespaces", ()))
        try:
            _t0 = time.perf_counter()
            await trio.to_thread.run_sync(
                in_fresh_thread,
                lambda: _setup_env_namespaces(init_pid, remount_root=True, loopback=(network == "loopback") if new_netns else None,
                                              setuid=spec.get("process", {}).get("noNewPrivileges", True) is False),
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
        pid, _process = await self._envs.lookup(env_id)
        # Without the agent the next call is a crun exec: it must not come before the init's execve.
        exe = _exe(pid) if not self._envs.has_agent(env_id) else None
        if not (env_id in self._plain_start and self._release_init(env_id)):
            await self._cli.run("start", env_id, env_id=env_id)
        if exe is not None:
            await _until_exec(pid, exe)
        self._envs.started(env_id)

    def _release_init(self, env_id: str) -> bool:
        """What ``crun start`` does for a container without hooks, without a crun process (4.6 ms
        p50 here even from the sealed copy; this is 0.1): open the exec fifo the parked init reads,
        unlink it (crun state says "running" from then on), write one byte. False (nothing done)
        when the fifo is not there or no init reads it: ``crun start`` then runs and reports as it
        does."""
        self._plain_start.discard(env_id)
        fifo = os.path.join(self.state_dir, env_id, "exec.fifo")
        try:
            # non-blocking: ENXIO instead of waiting forever when no init holds the other end
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            os.unlink(fifo)
            os.write(fd, b"\0")
        except OSError as exc:
            raise ContainerError("could not let the env's init run", env_id=env_id, detail=str(exc)) from exc
        finally:
            os.close(fd)
        return True

    async def kill(self, env_id: str, sig: int = signal.SIGKILL) -> None:
        await self._cli.run("kill", env_id, str(int(sig)), env_id=env_id)

    async def delete(self, env_id: str, force: bool = True) -> None:
        pid = self._envs.forget(env_id)
        self._plain_start.discard(env_id)
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
                await self._cli.run("delete", *(["--force"] if force else []), env_id, env_id=env_id)
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
        return _state(json.loads(await self._cli.run("state", env_id, env_id=env_id)))

    async def list(self) -> list[ContainerState]:
        return [_state(d) for d in json.loads(await self._cli.run("list", "--format=json") or b"[]")]


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


async def _until_exec(pid: int, crun_exe: str, deadline_s: float = 2.0) -> None:
    """Wait (bounded) until the init at ``pid`` runs its own program, not crun's code any more.

    Releasing the init (one byte into its exec fifo, or ``crun start``) returns before its execve;
    under load well before. A ``crun exec`` in between fails in crun before 1.8.7 with "setns(pid=N,
    CLONE_*): Operation not permitted" (containers/crun#1264: having joined the env's user namespace
    first, crun can no longer reach the namespaces of an init whose memory is still the host's).
    Agent envs skip this: their key handshake is the init's own program answering. Normally well
    under a millisecond; an init that never gets there (killed, frozen) costs ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while _exe(pid) == crun_exe and time.monotonic() < deadline:
        await trio.sleep(0.0005)


def _state(d: dict) -> ContainerState:
    return ContainerState(id=d["id"], pid=d.get("pid", 0), status=d["status"], bundle=d.get("bundle", ""),
                          created=d.get("created", ""))


class _CrunExec(ExecCall):
    """``crun exec --process``: crun's own errors go to a log pipe, read once it has exited; a
    timeout kills the command's tree on the host (its processes are ours to see)."""

    def __init__(self, base: Sequence[str], env_id: str, process_path: str):
        self.env_id = env_id
        self._log_r, self._log_w = os.pipe2(os.O_CLOEXEC)
        self.argv = [*base, f"--log=file:/dev/fd/{self._log_w}", "exec", f"--process={process_path}", env_id]
        self.pass_fds = (self._log_w,)

    def spawned(self) -> None:
        os.close(self._log_w)
        self._log_w = -1

    async def kill_tree(self, proc: trio.Process) -> None:
        await trio.to_thread.run_sync(kill_exec_tree, proc.pid)

    async def after_kill(self, proc: trio.Process) -> None:
        # Still there: its cgroup is frozen (SIGKILL lands on thaw). Do not hang the caller.
        await trio.to_thread.run_sync(partial(kill_exec_tree, proc.pid, spare_leader=False, deadline_s=0.1))

    def result(self, result: ExecResult, argv: Sequence[str]) -> ExecResult:
        crun_log = _read_nonblocking(self._log_r)
        if not crun_log or result.exit_code == 0:
            return result
        env_id = self.env_id
        m = _NOT_FOUND.search(crun_log)
        if m:
            return msgspec.structs.replace(
                result, exit_code=127, command_not_found=True,
                stderr=b"weenv: command not found in env %s: %s\n" % (env_id.encode(), m.group(1)))
        cannot = _CANNOT_EXECUTE.search(crun_log)
        if cannot:
            return msgspec.structs.replace(result, exit_code=126, stderr=b"weenv: cannot execute %s in env %s: %s\n" % (
                (list(argv)[0] if argv else "?").encode(), env_id.encode(), cannot.group(0)))
        if any(s in crun_log for s in _NO_CONTAINER):
            raise ContainerNotFoundError("no such container", env_id=env_id, detail=crun_log.decode(errors="replace"))
        if not result.timed_out:
            raise ContainerError("crun exec failed", env_id=env_id, detail=crun_log.decode(errors="replace"))
        return result

    def close(self) -> None:
        for fd in (self._log_r, self._log_w):
            if fd >= 0:
                os.close(fd)
        self._log_r = self._log_w = -1


def _read_nonblocking(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out
