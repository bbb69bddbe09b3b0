"""Commands in an env: one-shot ``exec`` and process handles (docs/architecture.md, "Processes").

:class:`EnvProcesses` is the part of :class:`~._manager.EnvManager` that runs commands: it checks
the env runs, resolves the user inside the env's rootfs and the cgroup files the process joins,
and hands the rest to the runtime, whose in-env agent keeps the table of started processes (so
they outlive the client that started them, and this daemon).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from ..._wire import ProcessEnd, ProcessInfo
from .._errors import EnvStateError, ProcessNotFoundError
from ..cgroups import Cgroup
from ..runtime._ocispec import User
from ..runtime._seam import ExecResult, OutputCallback, ProcessStream, Runtime
from ._fileops import resolve_user
from ._state import EnvRecord


class EnvProcesses:
    """The manager's command operations; the manager provides the env table, the rootfs and the
    cgroups they use."""

    runtime: Runtime
    cgroups: dict[str, Cgroup]
    get: Callable[[str], EnvRecord]
    rootfs: Callable[[str], str]

    def _running(self, env_id: str) -> EnvRecord:
        rec = self.get(env_id)
        if rec.status == "paused":
            raise EnvStateError("is paused (resume it first)", env_id=env_id)
        if rec.status != "running":
            raise EnvStateError(f"is {rec.status}", env_id=env_id)
        return rec

    async def _exec_target(self, env_id: str, argv: Sequence[str],
                           user: str | None) -> tuple[User | None, Sequence[str]]:
        """What exec and start_process check and resolve first: the env runs, a command, the user, the
        cgroup files the process joins."""
        self._running(env_id)
        if not argv:
            raise EnvStateError("empty command", env_id=env_id)
        who: User | None = None
        if user is not None:
            who = await trio.to_thread.run_sync(resolve_user, self.rootfs(env_id), user)
        cg = self.cgroups.get(env_id)
        return who, (cg.procs_paths() if cg is not None else ())

    async def exec(self, env_id: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, user: str | None = None, stdin: bytes | None = None,
                   timeout_s: float | None = None, on_output: OutputCallback | None = None) -> ExecResult:
        who, procs = await self._exec_target(env_id, argv, user)
        return await self.runtime.exec(env_id, argv, env=env, cwd=cwd, user=who, stdin=stdin, timeout_s=timeout_s,
                                       cgroup_procs=procs, on_output=on_output)

    # -- process handles (docs/architecture.md, "Processes"): the env's agent keeps the table,
    # so they outlive the client that started them and this daemon

    async def start_process(self, env_id: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                            cwd: str | None = None, user: str | None = None, stdin: bool = False,
                            pty: tuple[int, int] | None = None, tag: str | None = None,
                            buffer_bytes: int | None = None) -> ProcessStream:
        who, procs = await self._exec_target(env_id, argv, user)
        return await self.runtime.start_process(env_id, argv, env=env, cwd=cwd, user=who, stdin=stdin, pty=pty,
                                                tag=tag, buffer_bytes=buffer_bytes,
                                                cgroup_procs=procs)

    async def connect_process(self, env_id: str, pid: int) -> ProcessStream:
        self._running(env_id)
        return await self.runtime.connect_process(env_id, pid)

    async def processes(self, env_id: str) -> list[ProcessInfo]:
        self._running(env_id)
        return await self.runtime.list_processes(env_id)

    async def process(self, env_id: str, pid: int) -> ProcessInfo:
        for info in await self.processes(env_id):
            if info.pid == pid:
                return info
        raise ProcessNotFoundError(f"no process {pid} started by weenv", env_id=env_id)

    async def send_stdin(self, env_id: str, pid: int, data: bytes, *, close: bool = False) -> None:
        self._running(env_id)
        await self.runtime.send_stdin(env_id, pid, data, close=close)

    async def signal_process(self, env_id: str, pid: int, sig: int) -> None:
        self._running(env_id)
        await self.runtime.signal_process(env_id, pid, sig)

    async def resize_process(self, env_id: str, pid: int, rows: int, cols: int) -> None:
        self._running(env_id)
        await self.runtime.resize_process(env_id, pid, rows, cols)

    async def wait_process(self, env_id: str, pid: int, timeout_s: float | None = None) -> ProcessEnd | None:
        self._running(env_id)
        return await self.runtime.wait_process(env_id, pid, timeout_s)
