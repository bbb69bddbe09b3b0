"""The processes of an env, for every runtime: one :class:`ProcessHost`.

A command runs through the env's agent (weenv-agent, the env's init: :mod:`._agent`) when it has
one: the agent forks it in the env, in its own session, and keeps the process table behind the
process handles (background processes, attach, stdin, signals, pty sizes, wait). Without the
agent (catatonit as the init, or gVisor, which cannot hand the agent its socket) a command is the
runtime's own exec, ``crun exec`` or ``runsc exec`` with the full OCI process read from a pipe (so
it has the init's capabilities, no_new_privileges and rlimits), collected here; such envs have no
process handles, and say so.

A runtime tells the host about each env with a :class:`ProcessTarget`: the init's OCI process
(every command's is built on it), whether the env was started, its agent, and the runtime itself
(:class:`OwnExec`: its exec for envs without the agent, and the limits of every command). Where
crun's exec and runsc's differ (the argv, where their errors are told, how a command's tree is
killed at a timeout), the runtime's :class:`ExecCall` says; nothing else differs.
"""

from __future__ import annotations

import abc
import inspect
import json
import math
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

import trio

from ... import _wire as wire
from .._errors import ContainerError, SpecError
from ._agent import agent_attach, agent_control, agent_exec, agent_list, agent_start, agent_wait
from ._ns import TRAMPOLINE_FAILED, _CgroupFds, _empty_stdin
from ._ocispec import User, build_process, merge_env
from ._seam import ExecResult, OutputCallback, ProcessStream

#: the OCI process goes to the runtime's exec through a pipe: a larger one would block the write
MAX_PROCESS_BYTES = 60_000


class ExecCall(abc.ABC):
    """One command a runtime runs itself (its env has no agent): the argv of the runtime's exec
    process, reading the OCI process at the path it was given; how the command's tree is killed
    at a timeout; what the command's end means in the runtime's words. Closed once done."""

    argv: list[str]
    pass_fds: tuple[int, ...] = ()

    def spawned(self) -> None:
        """The exec process runs: descriptors only it needed may be closed."""

    @abc.abstractmethod
    async def kill_tree(self, proc: trio.Process) -> None:
        """SIGKILL the command and everything it started; the exec process (``proc``) is spared
        to report how the command ended."""

    async def after_kill(self, proc: trio.Process) -> None:
        """The exec process was SIGKILLed too and waited for (a frozen env may still hold it)."""

    @abc.abstractmethod
    def result(self, result: ExecResult, argv: Sequence[str]) -> ExecResult:
        """``result`` as the runtime's own words make it (command not found: 127, cannot execute:
        126); raises when the exec itself failed (the container is gone, the runtime broke)."""

    def close(self) -> None:
        """Release what the call holds (descriptors, files)."""


class OwnExec(Protocol):
    """What the process host needs of a runtime: its own exec, for envs without the agent, and
    the limits of every command of its envs."""

    max_output_bytes: int
    drain_grace_s: float
    kill_grace_s: float
    no_process_handles: str | None
    """Why no env of this runtime has process handles; None: each env's agent decides."""

    def exec_call(self, env_id: str, process_path: str) -> ExecCall: ...


class ProcessTarget(NamedTuple):
    """One env, as the runtime that holds it tells the process host."""

    process: Mapping
    """The init's OCI process (env, cwd, user, capabilities, rlimits): what commands run with."""
    started: bool
    agent: tuple[str, User] | None
    """The agent's socket on the host and the user of a command that names none; None: no agent."""
    runtime: OwnExec


def command_process(base: Mapping, argv: Sequence[str], *, env: Mapping[str, str] | None, cwd: str | None,
                    user: User | None) -> dict:
    """The OCI process of one command: ``base`` (the init's) with ``argv``, env vars laid over the
    init's, and cwd and user when given (a user brings its own HOME)."""
    if user is None:
        bu = base.get("user", {})
        user = User(uid=bu.get("uid", 0), gid=bu.get("gid", 0), additional_gids=tuple(bu.get("additionalGids", ())))
        extra_env = dict(env or {})
    else:
        extra_env = {"HOME": user.home or "/", **(env or {})}
    nofile = next(
        ((r["soft"], r["hard"]) for r in base.get("rlimits", ()) if r.get("type") == "RLIMIT_NOFILE"), (1024, 524288)
    )
    return build_process(args=argv, env=merge_env(base.get("env", []), extra_env), cwd=cwd or base.get("cwd", "/"),
                         user=user, capabilities=base.get("capabilities", {}).get("bounding", []), nofile=nofile,
                         no_new_privileges=base.get("noNewPrivileges", True) is not False)


class ProcessHost:
    """exec and process handles for the envs ``target`` knows (a runtime's, or the router's: every
    env of the node). ``target(env_id)`` raises ContainerNotFoundError for an env nobody holds."""

    def __init__(self, target: Callable[[str], Awaitable[ProcessTarget]]):
        self.target = target

    async def exec(
        self, env_id: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
        user: User | None = None, stdin: bytes | None = None, timeout_s: float | None = None,
        cgroup_procs: Sequence[str] = (), on_output: OutputCallback | None = None, max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the env (env vars laid over the init's; cwd and user default to the
        init's) and collect its output. ``on_output(stream, data)`` sees each chunk as it comes
        (``stream`` is "stdout" or "stderr"; it may be a coroutine function). At ``timeout_s`` the
        command and everything it started are killed. ``cgroup_procs``: the exec process of a
        runtime's own exec is written there before it runs (the agent's commands are born there)."""
        t = await self.target(env_id)
        if not t.started:
            raise ContainerError("cannot exec in an env that was created but not started", env_id=env_id)
        rt = t.runtime
        cap = rt.max_output_bytes if max_output_bytes is None else max_output_bytes
        if t.agent is None:
            process = command_process(t.process, argv, env=env, cwd=cwd, user=user)
            return await _own_exec(env_id, rt, process, stdin=stdin, timeout_s=timeout_s, cgroup_procs=cgroup_procs,
                                   on_output=on_output, cap=cap)
        sock, default_user = t.agent
        process = command_process(t.process, argv, env=env, cwd=cwd, user=user or default_user)
        who = process["user"]
        return await agent_exec(sock, process["args"], env=process["env"], cwd=process["cwd"], uid=who["uid"],
                                gid=who["gid"], groups=who.get("additionalGids", ()), stdin=stdin, timeout_s=timeout_s,
                                on_output=on_output, max_output_bytes=cap, env_id=env_id, kill_grace_s=rt.kill_grace_s)

    # -- process handles: all through the env's agent, which keeps the process table ----------

    async def _agent(self, env_id: str) -> tuple[str, Mapping, User]:
        t = await self.target(env_id)
        if t.runtime.no_process_handles:
            raise ContainerError(t.runtime.no_process_handles, env_id=env_id)
        if not t.started:
            raise ContainerError("cannot start processes in an env that was created but not started", env_id=env_id)
        if t.agent is None:
            raise ContainerError("process handles need the in-env agent; this env runs without it "
                                 "(daemon use_agent=False or no C compiler)", env_id=env_id)
        return t.agent[0], t.process, t.agent[1]

    async def start_process(
        self, env_id: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
        user: User | None = None, stdin: bool = False, pty: tuple[int, int] | None = None, tag: str | None = None,
        buffer_bytes: int | None = None, cgroup_procs: Sequence[str] = (),
    ) -> ProcessStream:
        """Start ``argv`` as a background process (as :meth:`exec` runs one) and return it
        attached. It outlives the stream: closing the stream only detaches. ``stdin`` keeps its
        stdin open; ``pty`` (rows, cols) puts it on a pseudo-terminal. Output produced while nobody
        is attached is kept (``buffer_bytes``, the newest) for the next :meth:`connect_process`.
        Raises :class:`~weenv.provision.ProcessStartError` when the command cannot start."""
        sock, base, default_user = await self._agent(env_id)
        process = command_process(base, argv, env=env, cwd=cwd, user=user or default_user)
        who = process["user"]
        return await agent_start(sock, process["args"], env=process["env"], cwd=process["cwd"], uid=who["uid"],
                                 gid=who["gid"], groups=who.get("additionalGids", ()), stdin=stdin, env_id=env_id,
                                 background=True, pty=pty, tag=tag, buffer_bytes=buffer_bytes,
                                 shown_env=[f"{k}={v}" for k, v in (env or {}).items()])

    async def connect_process(self, env_id: str, pid: int) -> ProcessStream:
        """Attach to process ``pid`` (a running or recently finished one): first the output kept
        since the last reader, then live. Raises :class:`~weenv.provision.ProcessNotFoundError`."""
        sock, _base, _user = await self._agent(env_id)
        return await agent_attach(sock, pid, env_id=env_id)

    async def list_processes(self, env_id: str) -> list[wire.ProcessInfo]:
        """The env's processes weenv started: running ones, and recently finished background ones."""
        sock, _base, _user = await self._agent(env_id)
        return await agent_list(sock, env_id=env_id)

    async def send_stdin(self, env_id: str, pid: int, data: bytes, *, close: bool = False) -> None:
        """Write ``data`` to the process's stdin (then close it, on a pty send ^D). Calls are taken
        in order. Raises :class:`~weenv.provision.ProcessStateError` when its stdin is closed."""
        sock, _base, _user = await self._agent(env_id)
        frames = [(b"I", data[i : i + (1 << 20)]) for i in range(0, len(data), 1 << 20)]
        await agent_control(sock, pid, frames + ([(b"E", b"")] if close else []), env_id=env_id)

    async def signal_process(self, env_id: str, pid: int, sig: int) -> None:
        """Send ``sig`` to every process of the process's session."""
        sock, _base, _user = await self._agent(env_id)
        await agent_control(sock, pid, [(b"K", str(int(sig)).encode())], env_id=env_id)

    async def resize_process(self, env_id: str, pid: int, rows: int, cols: int) -> None:
        """Set the size of the process's pty (it gets SIGWINCH)."""
        sock, _base, _user = await self._agent(env_id)
        await agent_control(sock, pid, [(b"W", f"{int(rows)} {int(cols)}".encode())], env_id=env_id)

    async def wait_process(self, env_id: str, pid: int, timeout_s: float | None = None) -> wire.ProcessEnd | None:
        """How the process ended, once it has; None if ``timeout_s`` came first. Its output stays
        for the next reader."""
        sock, _base, _user = await self._agent(env_id)
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
            return await agent_wait(sock, pid, env_id=env_id)
        return None


# -- a command through the runtime's own exec (the env has no agent) ---------------------------------


async def _own_exec(env_id: str, rt: OwnExec, process: Mapping, *, stdin: bytes | None, timeout_s: float | None,
                    cgroup_procs: Sequence[str], on_output: OutputCallback | None, cap: int) -> ExecResult:
    """The exec process leads a new session and every process of the command is its descendant
    or in a session one of them made, so a timeout kills the whole tree (:meth:`ExecCall.kill_tree`)."""
    payload = json.dumps(process).encode()
    if len(payload) > MAX_PROCESS_BYTES:
        raise SpecError(f"exec process description is {len(payload)} bytes; keep env and argv under 60 kB")
    proc_r, proc_w = os.pipe2(os.O_CLOEXEC)
    closing = [proc_r, proc_w]
    empty = _empty_stdin() if stdin is None else None
    if empty is not None:
        closing.append(empty)
    call: ExecCall | None = None
    try:
        os.write(proc_w, payload)
        os.close(proc_w)
        closing.remove(proc_w)
        call = rt.exec_call(env_id, f"/dev/fd/{proc_r}")
        started = time.perf_counter()
        with _CgroupFds(cgroup_procs) as cg:
            proc = await trio.lowlevel.open_process(
                cg.wrap(call.argv),
                stdin=subprocess.PIPE if empty is None else empty,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(proc_r, *call.pass_fds, *cg.fds),
            )
        os.close(proc_r)
        closing.remove(proc_r)
        call.spawned()
        result = await _collect(env_id, rt, call, proc, started, stdin, timeout_s, on_output, cap)
        return call.result(result, process["args"][:1])
    finally:
        for fd in closing:
            os.close(fd)
        if call is not None:
            call.close()


def _decode_status(code: int) -> int:
    return 128 - code if code < 0 else code


async def _collect(env_id: str, rt: OwnExec, call: ExecCall, proc: trio.Process, started: float, stdin: bytes | None,
                   timeout_s: float | None, on_output: OutputCallback | None, cap: int) -> ExecResult:
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
                await _stop(proc, call, rt.kill_grace_s)
            # Background jobs may hold the pipes open after the command exits; do not wait
            # for them beyond a short grace.
            with trio.move_on_after(rt.drain_grace_s):
                await eof["stdout"].wait()
                await eof["stderr"].wait()
            nursery.cancel_scope.cancel()
    finally:
        # Once only: a second round after a timeout's doubled the wait on a frozen env (4 kill
        # graces where the error below says 2).
        if proc.returncode is None and not stopped:
            with trio.CancelScope(shield=True):
                await _stop(proc, call, rt.kill_grace_s)
        for stream in (proc.stdout, proc.stderr, proc.stdin):
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
    duration_s = time.perf_counter() - started
    if proc.returncode is None:
        raise ContainerError(
            f"the command did not die within {2 * rt.kill_grace_s:.0f} s of SIGKILL (is the env frozen?); "
            "it ends when the env is thawed or killed",
            env_id=env_id,
        )
    stderr = bytes(buffers["stderr"])
    code = _decode_status(proc.returncode)
    if code == TRAMPOLINE_FAILED and stderr.startswith(b"weenv-spawn:"):
        raise ContainerError("could not put the command into the env's cgroups", env_id=env_id,
                             detail=stderr.decode(errors="replace"))
    return ExecResult(exit_code=code, stdout=bytes(buffers["stdout"]), stderr=stderr, timed_out=timed_out,
                      duration_s=duration_s, stdout_truncated=truncated["stdout"],
                      stderr_truncated=truncated["stderr"])


async def _stop(proc: trio.Process, call: ExecCall, grace_s: float) -> None:
    """Kill the command's whole tree, then let the exec process report (or kill it too)."""
    await call.kill_tree(proc)
    with trio.move_on_after(grace_s):
        await proc.wait()
        return
    proc.kill()
    with trio.move_on_after(grace_s):
        await proc.wait()
    await call.after_kill(proc)
