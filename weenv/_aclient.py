"""The Python client of the weenv daemon, async (asyncio or trio, through httpx's own async layer):
:class:`AsyncClient`, :class:`AsyncEnv`, :class:`AsyncProcess`. Each call is the one the sync
client makes (weenv/_calls.py), awaited.

    async with weenv.AsyncClient() as client, client.create("plan.lock") as env:
        print((await env.exec("echo hello")).stdout)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import httpx

from . import _calls as calls
from . import _wire as wire
from . import _wire_volumes as vw
from ._calls import ExecResult
from ._connection import ApiError, AsyncConnection, EnvNotFoundError, WeenvError

__all__ = ["AsyncClient", "AsyncEnv", "AsyncProcess"]


def _shielded() -> Any:
    """A cancel scope that lets cleanup finish when the task is being cancelled (asyncio or trio)."""
    import anyio

    return anyio.CancelScope(shield=True)


async def _first_pid(lines: AsyncIterator[str]) -> int:
    async for line in lines:
        pid = calls.started_pid(calls.process_event(line))
        if pid is not None:
            return pid
    raise ApiError(500, "stream", "the process stream ended before its start")


class AsyncProcess(calls.ProcessHandle):
    """A process handle in an env (async): as :class:`weenv.Process`, with ``async for ev in proc.events()``."""

    async def _run(self, call: calls.Call) -> Any:
        return await self.env.client._run(call)

    async def events(self) -> AsyncIterator[wire.ProcessEvent]:
        if self._lines is None:
            await self._attach()
        assert self._lines is not None
        try:
            async for line in self._lines:
                ev = calls.process_event(line)
                if ev is None or ev.start is not None:
                    continue
                if ev.end is not None:
                    self.end = ev.end
                    async for _rest in self._lines:  # as Process.events: to the body's end, the connection kept
                        break
                yield ev
                if ev.end is not None:
                    return
        except httpx.TransportError as e:
            raise calls.transport_lost(self.env.client.target, e) from None
        finally:
            if self.end is not None:
                with _shielded():
                    await self.detach()
        if self.end is None:
            await self.detach()
            raise calls.stream_cut(self.pid)

    async def _attach(self) -> None:
        call = calls.process_stream(self.env.id, self.pid)
        cm = self.env.client.connection.stream(call.route, call.params, **call.kw())
        resp = await cm.__aenter__()
        self._cm, self._lines = cm, resp.aiter_lines()

    async def send_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        for call in calls.stdin_calls(self.env.id, self.pid, data, close):
            await self._run(call)

    async def close_stdin(self) -> None:
        await self.send_stdin(b"", close=True)

    async def signal(self, sig: int | str = 15) -> None:
        await self._run(calls.signal(self.env.id, self.pid, sig))

    async def kill(self) -> None:
        await self.signal(9)

    async def resize(self, rows: int, cols: int) -> None:
        await self._run(calls.resize(self.env.id, self.pid, rows, cols))

    async def info(self) -> wire.ProcessInfo:
        return await self._run(calls.process_show(self.env.id, self.pid))  # type: ignore[no-any-return]

    async def wait(self, timeout_s: float | None = None) -> wire.ProcessEnd | None:
        if self._lines is not None and timeout_s is None:
            async for _ev in self.events():
                pass
            return self.end
        self.end = (await self._run(calls.wait(self.env.id, self.pid, timeout_s))).end
        return self.end

    async def detach(self) -> None:
        cm, self._cm, self._lines = self._cm, None, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def __aenter__(self) -> "AsyncProcess":
        return self

    async def __aexit__(self, *exc: object) -> None:
        with _shielded():
            await self.detach()


class AsyncEnv(calls.EnvHandle):
    """A running env (async: asyncio or trio). ``async with`` kills it on exit, together with the
    envs it forked (but those forked with ``keep=True``)."""

    @classmethod
    def of(cls, client: "AsyncClient", env_id: str) -> "AsyncEnv":
        """A handle on env ``env_id`` without asking the daemon for its info (it is checked on use)."""
        return cls(client, wire.EnvInfo(id=env_id, name="", status="", created_s=0.0))

    async def _run(self, call: calls.Call) -> Any:
        return await self.client._run(call)

    async def exec(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                   user: str | None = None, stdin: bytes | str | None = None, timeout_s: float | None = None,
                   on_output: Callable[[str, bytes], Any] | None = None) -> ExecResult:
        call = calls.exec_(self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s,
                           stream=on_output is not None)
        if on_output is None:
            return await self._run(call)  # type: ignore[no-any-return]
        async with self.client.connection.stream(call.route, call.params, **call.kw()) as resp:
            async for line in resp.aiter_lines():
                result = calls.exec_line(line, on_output)
                if result is not None:
                    return result
        raise ApiError(500, "stream", "exec stream ended without a result")

    async def spawn(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                    user: str | None = None, stdin: bool = False, pty: tuple[int, int] | None = None,
                    tag: str | None = None, buffer_bytes: int | None = None) -> AsyncProcess:
        """As :meth:`weenv.Env.spawn`."""
        call = calls.spawn(self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, pty=pty, tag=tag,
                           buffer_bytes=buffer_bytes)
        cm = self.client.connection.stream(call.route, call.params, **call.kw())
        resp = await cm.__aenter__()
        try:
            lines = resp.aiter_lines()
            pid = await _first_pid(lines)
        except BaseException:
            with _shielded():
                await cm.__aexit__(None, None, None)
            raise
        return AsyncProcess(self, pid, cm, lines)

    async def connect(self, pid: int) -> AsyncProcess:
        proc = AsyncProcess(self, pid)
        await proc._attach()
        assert proc._lines is not None
        await _first_pid(proc._lines)
        return proc

    async def processes(self) -> list[wire.ProcessInfo]:
        return await self._run(calls.process_list(self.id))  # type: ignore[no-any-return]

    def process(self, pid: int) -> AsyncProcess:
        return AsyncProcess(self, pid)

    async def read_file(self, path: str, *, user: str | None = None) -> bytes:
        return await self._run(calls.files_read(self.id, path, user))  # type: ignore[no-any-return]

    async def write_file(self, path: str, data: Any, *, mode: int = 0o644, user: str | None = None,
                         xattrs: dict[str, str] | None = None) -> wire.PathDone:
        """``data``: bytes, str, or an async iterator of bytes (streamed as it comes); ``xattrs``:
        ``{NAME: value}`` set as ``user.NAME`` on the file."""
        return await self._run(calls.files_write(self.id, path, data, mode, user, xattrs))  # type: ignore[no-any-return]

    async def put_archive(self, path: str, data: bytes) -> wire.PathDone:
        """See :meth:`weenv.Env.put_archive`."""
        return await self._run(calls.archive_put(self.id, path, data))  # type: ignore[no-any-return]

    async def get_archive(self, path: str) -> bytes:
        """See :meth:`weenv.Env.get_archive`."""
        return await self._run(calls.archive_get(self.id, path))  # type: ignore[no-any-return]

    async def list_dir(self, path: str, *, xattrs: bool = False) -> list[wire.FileInfo]:
        return await self._run(calls.files_list(self.id, path, xattrs))  # type: ignore[no-any-return]

    async def stat(self, path: str, *, xattrs: bool = False) -> wire.FileInfo:
        """``xattrs``: the entry's ``user.*`` extended attributes too (``info.xattrs``)."""
        return await self._run(calls.files_stat(self.id, path, xattrs))  # type: ignore[no-any-return]

    async def mkdir(self, path: str, *, mode: int = 0o755, user: str | None = None) -> None:
        await self._run(calls.files_mkdir(self.id, path, mode, user))

    async def move(self, path: str, to: str) -> wire.FileInfo:
        """Rename ``path`` to ``to`` in the env; the moved entry's info."""
        return await self._run(calls.files_move(self.id, path, to))  # type: ignore[no-any-return]

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._run(calls.files_remove(self.id, path, recursive))

    async def pause(self, *, memory: bool | Literal["park"] = True, park_after_s: float | None = None) -> None:
        """Freeze the env; ``memory=False``: end its processes and keep its files (resume boots it again);
        ``memory="park"``: checkpoint its processes to disk and free their memory (gVisor envs);
        ``park_after_s``: a freeze parked once it stayed paused that long (see :meth:`Env.pause`)."""
        await self._run(calls.pause(self.id, memory, park_after_s))

    async def resume(self) -> None:
        await self._run(calls.resume(self.id))

    async def metrics(self, start: float | None = None, end: float | None = None) -> list[dict[str, float]]:
        """Usage points (``t``, cpu and memory) from ``start`` to ``end`` (epoch seconds), oldest first."""
        return await self._run(calls.env_metrics(self.id, start, end))  # type: ignore[no-any-return]

    async def set_timeout(self, ttl_s: float | None) -> None:
        await self._run(calls.set_ttl(self.id, ttl_s))

    async def network(self) -> wire.NetworkInfo:
        """An egress env's addresses, policy, pinned names and accounting (docs/network.md)."""
        return await self._run(calls.network(self.id))  # type: ignore[no-any-return]

    async def set_network(self, *, allow: list[str] = [], deny: list[str] = [],  # noqa: B006 (never mutated)
                          remove: list[str] = []) -> wire.NetworkInfo:  # noqa: B006
        """Change a running egress env's policy: new connections follow it when this returns."""
        return await self._run(calls.set_network(self.id, allow, deny, remove))  # type: ignore[no-any-return]

    async def refresh(self) -> wire.EnvInfo:
        self.info = await self._run(calls.env_show(self.id))
        return self.info

    async def commit(self, *, ref: str | None = None, memory: bool = False) -> str:
        return (await self.client.commit(self.id, ref=ref, memory=memory)).snapshot

    async def fork(self, n: int, *, keep: bool = False, memory: bool = False) -> list["AsyncEnv"]:
        """As :meth:`weenv.Env.fork`: the children go when this env's ``async with`` ends, unless ``keep``."""
        children = [AsyncEnv(self.client, info) for info in (await self.client.fork(self.id, n, memory=memory)).envs]
        if not keep:
            self.forks.extend(children)
        return children

    async def kill(self) -> None:
        """Kill this env (its forks live on: they are independent envs); one already gone is fine."""
        try:
            await self.client.kill(self.id)
        except EnvNotFoundError:
            pass

    async def _kill_with_forks(self) -> None:
        import anyio  # httpx's own async layer: task groups under asyncio and trio alike

        forks, self.forks = self.forks, []
        errors: list[WeenvError] = []

        async def kill(child: AsyncEnv) -> None:
            try:
                await child._kill_with_forks()
            except WeenvError as e:  # the others still go
                errors.append(e)

        async with anyio.create_task_group() as tg:
            for child in forks:
                tg.start_soon(kill, child)
        await self.kill()
        if errors:
            raise errors[0]

    async def __aenter__(self) -> "AsyncEnv":
        return self

    async def __aexit__(self, *exc: object) -> None:
        with _shielded():
            await self._kill_with_forks()


class _EnvStart:
    """What :meth:`AsyncClient.create` returns: ``await`` it for the :class:`AsyncEnv`, or use it
    as ``async with client.create(...) as env:`` to kill the env (and its forks) on exit."""

    def __init__(self, coro: Any):
        self._coro = coro
        self._env: AsyncEnv | None = None

    def __await__(self) -> Any:
        return self._coro.__await__()

    async def __aenter__(self) -> AsyncEnv:
        self._env = await self._coro
        return self._env

    async def __aexit__(self, *exc: object) -> None:
        if self._env is not None:
            await self._env.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"AsyncClient.create() returns no env yet: write `env = await client.create(...)` "
                             f"or `async with client.create(...) as env:` before `env.{name}`")


class AsyncClient:
    """Async client of the local weenv daemon or of ``weenv serve`` (httpx.AsyncClient: asyncio or trio).

    ``connection``: an :class:`weenv._connection.AsyncConnection` to use instead (a node's daemon
    API with the cluster token, a fake transport in tests)."""

    def __init__(self, socket_path: str | None = None, *, token: str | None = None, timeout_s: float | None = 300.0,
                 autostart: bool = True, connection: AsyncConnection | None = None):
        self.connection = connection or AsyncConnection(socket_path, token=token, timeout_s=timeout_s,
                                                        autostart=autostart)

    @property
    def target(self) -> str:
        """The daemon's socket path, or the server's URL."""
        return self.connection.target

    socket_path = target

    async def _run(self, call: calls.Call) -> Any:
        return calls.decode(call, await self.connection.request(call.route, call.params, **call.kw()))

    async def ping(self) -> wire.Ping:
        return await self._run(calls.ping())  # type: ignore[no-any-return]

    def create(self, plan_or_lock: Any, *, name: str | None = None, ttl_s: float | None = None,
               cpu: str | float | None = None, memory: str | int | None = None,
               env: dict[str, str] | None = None, workdir: str | None = None, user: str | None = None,
               network: str | None = None, volumes: list[dict[str, Any]] | None = None) -> _EnvStart:
        """Start an env: ``env = await client.create(...)``, or ``async with client.create(...) as env:``
        to kill it on exit. Arguments as :meth:`weenv.Client.create`."""
        call = calls.create(plan_or_lock, name=name, ttl_s=ttl_s, cpu=cpu, memory=memory, env=env, workdir=workdir,
                            user=user, network=network, volumes=volumes)
        return _EnvStart(self._create(call))

    async def _create(self, call: calls.Call) -> AsyncEnv:
        return AsyncEnv(self, await self._run(call))

    async def create_from(self, body: dict[str, Any]) -> wire.EnvInfo:
        """``POST /v1/envs`` with a request body as the daemon takes it (``weenv._wire.CreateRequest``)."""
        return await self._run(calls.Call("env_create", json=body, answer=wire.EnvInfo))  # type: ignore[no-any-return]

    async def get(self, env_id: str) -> AsyncEnv:
        return AsyncEnv(self, await self._run(calls.env_show(env_id)))

    def env(self, env_id: str) -> AsyncEnv:
        """A handle on env ``env_id``, not looked up (its first call says if it is gone)."""
        return AsyncEnv.of(self, env_id)

    async def list(self) -> list[wire.EnvInfo]:
        return await self._run(calls.env_list())  # type: ignore[no-any-return]

    async def gc(self) -> wire.GcReport:
        return await self._run(calls.gc())  # type: ignore[no-any-return]

    async def top(self) -> wire.Top:
        return await self._run(calls.top())  # type: ignore[no-any-return]

    async def snapshots(self) -> list[wire.SnapshotInfo]:
        return await self._run(calls.snapshot_list())  # type: ignore[no-any-return]

    async def snapshot(self, snapshot_id: str) -> wire.SnapshotDetail:
        return await self._run(calls.snapshot_show(snapshot_id))  # type: ignore[no-any-return]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._run(calls.snapshot_delete(snapshot_id))

    async def pull_snapshot(self, ref: str) -> wire.SnapshotDetail:
        return await self._run(calls.snapshot_pull(ref))  # type: ignore[no-any-return]

    # -- volumes: node-local storage envs mount (a plan's [[volumes]], or create(..., volumes=[...]))

    async def create_volume(self, name: str | None = None, *, size_bytes: int | None = None) -> vw.VolumeInfo:
        """A new volume of ``size_bytes`` (default 1 GiB) on the daemon's node."""
        return await self._run(calls.volume_create(name, size_bytes))  # type: ignore[no-any-return]

    async def volumes(self) -> list[vw.VolumeInfo]:
        return await self._run(calls.volume_list())  # type: ignore[no-any-return]

    async def volume(self, ref: str) -> vw.VolumeInfo:
        """One volume, by id or name: its size, the bytes used, the envs mounting it."""
        return await self._run(calls.volume_show(ref))  # type: ignore[no-any-return]

    async def delete_volume(self, ref: str) -> None:
        """Remove a volume and its files (ApiError ``volume_in_use`` while an env mounts it)."""
        await self._run(calls.volume_delete(ref))

    async def list_volume_dir(self, ref: str, path: str = "/") -> list[wire.FileInfo]:
        return await self._run(calls.volume_list_dir(ref, path))  # type: ignore[no-any-return]

    async def read_volume_file(self, ref: str, path: str) -> bytes:
        return await self._run(calls.volume_read(ref, path))  # type: ignore[no-any-return]

    async def write_volume_file(self, ref: str, path: str, data: bytes | str, *, mode: int | None = None) -> wire.FileInfo:
        return await self._run(calls.volume_write(ref, path, data, mode))  # type: ignore[no-any-return]

    async def kill(self, env_id: str) -> wire.EnvStatus:
        """Kill env ``env_id`` (EnvNotFoundError when there is none)."""
        return await self._run(calls.kill(env_id))  # type: ignore[no-any-return]

    async def commit(self, env_id: str, *, ref: str | None = None, memory: bool = False) -> wire.CommitResponse:
        """Seal env ``env_id`` into a snapshot (the answer names it: ``.snapshot``)."""
        return await self._run(calls.commit(env_id, ref, memory))  # type: ignore[no-any-return]

    async def fork(self, env_id: str, n: int, *, memory: bool = False) -> wire.ForkResponse:
        """Fork env ``env_id`` ``n`` ways: the snapshot made and the children's infos."""
        return await self._run(calls.fork(env_id, n, memory))  # type: ignore[no-any-return]

    async def stop_daemon(self, *, kill_envs: bool = False) -> wire.StopResponse:
        return await self._run(calls.daemon_stop(kill_envs))  # type: ignore[no-any-return]

    async def send_route(self, name: str, params: dict[str, Any] | None = None, *, query: Any = None,
                         content: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
        """The daemon's route ``name`` (weenv/_routes.py) with path ``params``, its answer streamed
        whatever its status (the caller reads or closes it): for relaying it as it comes."""
        return await self.connection.send(name, params, query=query, content=content, headers=headers)

    async def aclose(self) -> None:
        await self.connection.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
