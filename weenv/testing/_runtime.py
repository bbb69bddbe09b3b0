"""An in-memory :class:`~weenv.provision._runtime.Runtime` for unit tests of daemon logic; the runtime
conformance tests (tests/test_runtime.py) run against it and against crun alike."""

from __future__ import annotations

import inspect
import math
import signal
import time
from collections.abc import Awaitable, Callable, Mapping

import trio

from weenv.provision._errors import ContainerError, ContainerExistsError, ContainerNotFoundError, SpecError
from weenv.provision._ocispec import User
from weenv.provision._runtime import DEFAULT_MAX_OUTPUT_BYTES, ContainerState, ExecResult, Runtime

FakeCommand = Callable[[list[str], bytes], Awaitable[tuple[int, bytes, bytes]] | tuple[int, bytes, bytes]]


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
