"""An in-memory :class:`~weenv.provision.runtime._runtime.Runtime` for unit tests of daemon logic; the runtime
conformance tests (tests/test_runtime.py) run against it and against crun alike."""

from __future__ import annotations

import inspect
import json
import math
import os
import signal
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import trio

from weenv import _wire as wire
from weenv.provision._errors import (
    ContainerError,
    ContainerExistsError,
    ContainerNotFoundError,
    ProcessNotFoundError,
    ProcessStartError,
    ProcessExitedError,
    ProcessStateError,
    SpecError,
)
from weenv.provision.runtime._ocispec import User
from weenv.provision.runtime._runtime import DEFAULT_MAX_OUTPUT_BYTES, ContainerState, ExecResult, Runtime
from weenv.provision.runtime._seam import C, MemorySnapshots

FakeCommand = Callable[[list[str], bytes], Awaitable[tuple[int, bytes, bytes]] | tuple[int, bytes, bytes]]


class FakeRuntime(Runtime, MemorySnapshots):
    """Containers in memory, for unit tests of daemon logic. Commands are Python: a few built in
    (``true``, ``false``, ``echo``, ``cat``, ``sleep S``, ``exit N``, ``env``, ``pwd``, ``id``)
    and any others given as ``commands={"name": fn(argv, stdin) -> (code, out, err)}``.

    Process handles behave as the agent's do (background, output kept while nobody reads, stdin,
    signals end the process with 128+N, pty size): ``cat`` echoes stdin as it comes, ``sleep S``
    waits, ``tty`` and ``stty size`` answer on a pty; other commands run as :meth:`exec` would,
    once their stdin is closed.

    ``memory_snapshots``: its envs have the :class:`MemorySnapshots` capability (an image is the
    container's record as JSON; background processes are not kept), else none, as crun's."""

    memory_runtime = "fake"

    def __init__(self, commands: Mapping[str, FakeCommand] | None = None, *, memory_snapshots: bool = False):
        self.memory_snapshots = memory_snapshots
        self.commands = dict(commands or {})
        self.containers: dict[str, dict] = {}
        self.calls: list[tuple] = []
        self._next_pid = 1000
        self.processes: dict[str, dict[int, _FakeProcess]] = {}
        self._next_proc_pid = 100

    def _get(self, env_id: str) -> dict:
        c = self.containers.get(env_id)
        if c is None:
            raise ContainerNotFoundError("no such container", env_id=env_id)
        return c

    async def create(self, env_id, bundle_dir, rootfs, spec, cgroup_procs=(), *, listen_fd=None) -> int:
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

    async def capability(self, env_id: str, kind: type[C]) -> C | None:
        await trio.lowlevel.checkpoint()
        if kind is MemorySnapshots and not self.memory_snapshots:
            return None
        return self if isinstance(self, kind) else None  # type: ignore[return-value]

    async def checkpoint(self, env_id: str, image_dir: str, *, leave_running: bool = False) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append(("checkpoint", env_id))
        c = self._get(env_id)
        if c["status"] != "running":
            raise ContainerError(f"cannot checkpoint a {c['status']} sandbox (only a running one)", env_id=env_id)
        if not os.path.isdir(image_dir) or os.listdir(image_dir):
            raise ContainerError(f"the checkpoint's image directory {image_dir} must exist and be empty", env_id=env_id)
        with open(os.path.join(image_dir, "checkpoint.img"), "w") as f:
            json.dump({"pid": c["pid"], "spec": c["spec"]}, f)
        if not leave_running:
            del self.containers[env_id]
            self.processes.pop(env_id, None)

    async def restore(self, env_id: str, bundle_dir: str, rootfs: str, spec: Mapping, image_dir: str,
                      cgroup_procs=()) -> int:
        self.calls.append(("restore", env_id))
        if not os.path.isfile(os.path.join(image_dir, "checkpoint.img")):
            raise ContainerError(f"no checkpoint image in {image_dir} (no checkpoint.img)", env_id=env_id)
        pid = await self.create(env_id, bundle_dir, rootfs, spec, cgroup_procs)
        self.containers[env_id]["status"] = "running"
        return pid

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

    # -- process handles ------------------------------------------------------------------------

    def _running_container(self, env_id: str) -> dict:
        c = self._get(env_id)
        if c["status"] != "running":
            raise ContainerError(f"cannot start processes in a container that is {c['status']}", env_id=env_id)
        return c

    async def start_process(self, env_id, argv, *, env=None, cwd=None, user=None, stdin=False, pty=None, tag=None,
                            buffer_bytes=None, cgroup_procs=()) -> "_FakeStream":
        await trio.lowlevel.checkpoint()
        self.calls.append(("start_process", env_id, list(argv)))
        c = self._running_container(env_id)
        argv = list(argv)
        if not argv:
            raise SpecError("args must be a non-empty list of strings")
        known = {"true", "false", "echo", "cat", "sleep", "exit", "env", "pwd", "id", "tty", "stty"}
        if argv[0] not in known and argv[0] not in self.commands:
            raise ProcessStartError(f"command not found in env {env_id}: {argv[0]}", not_found=True)
        self._next_proc_pid += 1
        proc_env = dict(kv.split("=", 1) for kv in c["spec"].get("process", {}).get("env", []))
        proc_env.update(env or {})
        p = _FakeProcess(self._next_proc_pid, argv, env=dict(env or {}), tag=tag, pty=pty, stdin=bool(stdin) or pty is not None,
                         buffer_bytes=buffer_bytes or (1 << 20), cwd=cwd or c["spec"].get("process", {}).get("cwd", "/"))
        self.processes.setdefault(env_id, {})[p.pid] = p
        stream = p.attach()
        trio.lowlevel.spawn_system_task(self._drive, p, proc_env, user)
        return stream

    async def _drive(self, p: "_FakeProcess", env: dict, user) -> None:  # type: ignore[no-untyped-def]
        try:
            await self._drive_one(p, env, user)
        except Exception as e:  # a fake command's bug ends its process, not the test's trio run
            p.emit("pty" if p.pty else "stderr", f"{type(e).__name__}: {e}\n".encode())
            p.finish(1)

    async def _drive_one(self, p: "_FakeProcess", env: dict, user) -> None:  # type: ignore[no-untyped-def]
        name = p.argv[0]
        out = "pty" if p.pty else "stdout"
        with p.scope:
            if name == "cat" and len(p.argv) == 1:
                async for chunk in p.stdin_rx:
                    p.emit(out, chunk)
                p.finish(0)
            elif name == "sleep":
                await trio.sleep(float(p.argv[1]))
                p.finish(0)
            elif name == "tty":
                p.emit(out, b"/dev/pts/0\r\n" if p.pty else b"not a tty\n")
                p.finish(0 if p.pty else 1)
            elif name == "stty" and p.argv[1:] == ["size"]:
                if p.pty:
                    p.emit(out, f"{p.pty[0]} {p.pty[1]}\r\n".encode())
                p.finish(0 if p.pty else 1)
            else:
                data = b"".join([chunk async for chunk in p.stdin_rx]) if p.stdin else b""
                code, o, e = await self._run(p.argv, data, env, p.cwd, user)
                if code is None:
                    code, e = 127, b"not found\n"
                if o:
                    p.emit(out, o)
                if e:
                    p.emit("pty" if p.pty else "stderr", e)
                p.finish(code)

    def _proc(self, env_id: str, pid: int) -> "_FakeProcess":
        self._running_container(env_id)
        p = self.processes.get(env_id, {}).get(pid)
        if p is None:
            raise ProcessNotFoundError(f"no process {pid} started by weenv", env_id=env_id)
        return p

    async def connect_process(self, env_id, pid) -> "_FakeStream":
        await trio.lowlevel.checkpoint()
        return self._proc(env_id, pid).attach()

    async def list_processes(self, env_id) -> list[wire.ProcessInfo]:
        await trio.lowlevel.checkpoint()
        self._running_container(env_id)
        return [p.info() for p in self.processes.get(env_id, {}).values()]

    async def send_stdin(self, env_id, pid, data, *, close=False) -> None:
        await trio.lowlevel.checkpoint()
        p = self._proc(env_id, pid)
        if p.end is not None:
            raise ProcessExitedError(f"process {pid} has exited", env_id=env_id)
        if not p.stdin or p.stdin_closed:
            raise ProcessStateError(f"process {pid}: its stdin is closed (or was never opened: start it with stdin)",
                                    env_id=env_id)
        if data:
            p.stdin_tx.send_nowait(bytes(data))
        if close:
            if p.pty:
                p.stdin_tx.send_nowait(b"\x04")
            else:
                p.stdin_closed = True
                p.stdin_tx.close()

    async def signal_process(self, env_id, pid, sig) -> None:
        await trio.lowlevel.checkpoint()
        p = self._proc(env_id, pid)
        if p.end is None:
            p.finish(128 + int(sig), int(sig))

    async def resize_process(self, env_id, pid, rows, cols) -> None:
        await trio.lowlevel.checkpoint()
        p = self._proc(env_id, pid)
        if not p.pty:
            raise ProcessStateError(f"process {pid}: it is not on a pty", env_id=env_id)
        p.pty = (int(rows), int(cols))

    async def wait_process(self, env_id, pid, timeout_s=None) -> wire.ProcessEnd | None:
        p = self._proc(env_id, pid)
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
            await p.ended.wait()
        return p.end


class _FakeProcess:
    def __init__(self, pid: int, argv: list[str], *, env: dict[str, str], tag, pty, stdin: bool,  # type: ignore[no-untyped-def]
                 buffer_bytes: int, cwd: str):
        self.pid, self.argv, self.env, self.tag, self.pty, self.stdin, self.cwd = pid, argv, env, tag, pty, stdin, cwd
        self.stdin_tx, self.stdin_rx = trio.open_memory_channel[bytes](math.inf)
        if not stdin:
            self.stdin_tx.close()
        self.stdin_closed = not stdin
        self.buffer_bytes = buffer_bytes
        self.kept: deque[wire.ProcessEvent] = deque()
        self.kept_bytes = 0
        self.dropped = 0
        self.readers: list[_FakeStream] = []
        self.end: wire.ProcessEnd | None = None
        self.ended = trio.Event()
        self.scope = trio.CancelScope()

    def attach(self) -> "_FakeStream":
        s = _FakeStream(self)
        if self.dropped:
            s.queue.append(wire.ProcessEvent(dropped=self.dropped))
        s.queue.extend(self.kept)
        self.kept.clear()
        self.kept_bytes = self.dropped = 0
        if self.end is not None:
            s.queue.append(wire.ProcessEvent(end=self.end))
        else:
            self.readers.append(s)
        return s

    def emit(self, stream: str, data: bytes) -> None:
        ev = wire.ProcessEvent(stream=stream, data_b64=data)  # type: ignore[arg-type]
        if self.readers:
            for r in self.readers:
                r.push(ev)
            return
        self.kept.append(ev)
        self.kept_bytes += len(data)
        while self.kept_bytes > self.buffer_bytes:
            old = self.kept.popleft()
            self.kept_bytes -= len(old.data_b64 or b"")
            self.dropped += len(old.data_b64 or b"")

    def finish(self, code: int, sig: int | None = None) -> None:
        if self.end is not None:
            return
        name = signal.Signals(sig).name[3:].lower() if sig else ""
        words = {"term": "terminated", "kill": "killed", "int": "interrupt"}
        self.end = wire.ProcessEnd(exit_code=code, signal=sig,
                                   status=f"signal: {words.get(name, name)}" if sig else f"exit status {code}")
        self.scope.cancel()
        for r in self.readers:
            r.push(wire.ProcessEvent(end=self.end))
        self.readers.clear()
        self.ended.set()

    def info(self) -> wire.ProcessInfo:
        return wire.ProcessInfo(pid=self.pid, argv=list(self.argv), env=dict(self.env), cwd=self.cwd, tag=self.tag, pty=self.pty is not None,
                                stdin=self.stdin and not self.stdin_closed and self.end is None,
                                running=self.end is None, end=self.end, buffered_bytes=self.kept_bytes,
                                dropped_bytes=self.dropped)


class _FakeStream:
    """What the fake's start_process and connect_process return (a ProcessStream)."""

    def __init__(self, proc: _FakeProcess):
        self.proc, self.pid, self.pty = proc, proc.pid, proc.pty is not None
        self.end: wire.ProcessEnd | None = None
        self.queue: deque[wire.ProcessEvent] = deque()
        self.ready = trio.Event()

    def push(self, ev: wire.ProcessEvent) -> None:
        self.queue.append(ev)
        self.ready.set()

    async def receive(self) -> wire.ProcessEvent | None:
        if self.end is not None:
            return None
        while not self.queue:
            self.ready = trio.Event()
            await self.ready.wait()
        ev = self.queue.popleft()
        if ev.end is not None:
            self.end = ev.end
        return ev

    def __aiter__(self) -> AsyncIterator[wire.ProcessEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[wire.ProcessEvent]:
        while (ev := await self.receive()) is not None:
            yield ev

    async def write_stdin(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if self.proc.stdin and not self.proc.stdin_closed:
            self.proc.stdin_tx.send_nowait(bytes(data))

    async def close_stdin(self) -> None:
        await trio.lowlevel.checkpoint()
        if self.proc.stdin and not self.proc.stdin_closed:
            self.proc.stdin_closed = True
            self.proc.stdin_tx.close()

    async def signal(self, sig: int) -> None:
        await trio.lowlevel.checkpoint()
        if self.proc.end is None:
            self.proc.finish(128 + int(sig), int(sig))

    async def resize(self, rows: int, cols: int) -> None:
        await trio.lowlevel.checkpoint()
        if self.proc.pty:
            self.proc.pty = (int(rows), int(cols))

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        if self in self.proc.readers:
            self.proc.readers.remove(self)

    async def __aenter__(self) -> "_FakeStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        with trio.CancelScope(shield=True):
            await self.aclose()
