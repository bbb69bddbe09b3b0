"""The Python client of the weenv daemon, synchronous: :class:`Client`, :class:`Env`, :class:`Process`
(the async ones, :class:`~weenv.AsyncClient` and friends, are in weenv/_aclient.py).

It talks to ``$WEENV_HOME/run/weenv.sock`` (starting the daemon when it is not running, unless
``autostart=False``), or, given a URL (``Client("http://host:3000", token=...)``, or
``$WEENV_HOST`` / ``$WEENV_TOKEN``), to ``weenv serve`` or the cluster gateway. Answers are the
daemon's ``_wire`` Structs (``env.info.id``; ``env.info["id"]`` reads them too).

    with weenv.Client() as client, client.create("plan.lock") as env:
        print(env.exec("echo hello").stdout)

What each call sends is built in weenv/_calls.py, which the async client shares; the connection
(routes, errors, autostart) is weenv/_connection.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import httpx

from . import _calls as calls
from . import _wire as wire
from . import _wire_volumes as vw
from ._calls import ExecResult
from ._connection import (ApiError, AsyncConnection, Connection, DaemonUnavailableError, EnvNotFoundError, WeenvError,
                          start_daemon)

__all__ = ["ApiError", "Client", "DaemonUnavailableError", "Env", "EnvNotFoundError", "ExecResult", "Process",
           "WeenvError", "iter_envs", "start_daemon"]


def __getattr__(name: str) -> Any:  # the async client lives in its own module
    if name in ("AsyncClient", "AsyncEnv", "AsyncProcess"):
        from . import _aclient

        return getattr(_aclient, name)
    if name == "AsyncConnection":
        return AsyncConnection
    raise AttributeError(f"module 'weenv._client' has no attribute {name!r}")


class Process(calls.ProcessHandle):
    """A process handle in an env (synchronous): what :meth:`Env.spawn` and :meth:`Env.connect`
    return. It runs on when this handle is closed or the client goes away; the output nobody read
    is kept (a bounded amount) for the next :meth:`Env.connect`.

    ``events()`` yields :class:`weenv._wire.ProcessEvent` (``stream`` + ``data_b64`` bytes,
    ``dropped``, finally ``end``). ``with`` detaches on exit."""

    def _run(self, call: calls.Call) -> Any:
        return self.env.client._run(call)

    def events(self) -> Iterator[wire.ProcessEvent]:
        """Its events until it ends (attaching first if this handle is not attached)."""
        if self._lines is None:
            self._attach()
        assert self._lines is not None
        try:
            for line in self._lines:
                ev = calls.process_event(line)
                if ev is None or ev.start is not None:
                    continue
                if ev.end is not None:
                    self.end = ev.end
                    for _rest in self._lines:  # read to the body's end (the daemon sends nothing after the
                        break  # end): httpx then keeps the connection for the next request, not closes it
                yield ev
                if ev.end is not None:
                    return
        except httpx.TransportError as e:
            raise calls.transport_lost(self.env.client.target, e) from None
        finally:
            if self.end is not None:
                self.detach()
        if self.end is None:
            self.detach()
            raise calls.stream_cut(self.pid)

    def _attach(self) -> None:
        call = calls.process_stream(self.env.id, self.pid)
        cm = self.env.client.connection.stream(call.route, call.params, **call.kw())
        resp = cm.__enter__()
        self._cm, self._lines = cm, resp.iter_lines()

    def send_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        for call in calls.stdin_calls(self.env.id, self.pid, data, close):
            self._run(call)

    def close_stdin(self) -> None:
        self.send_stdin(b"", close=True)

    def signal(self, sig: int | str = 15) -> None:
        """Signal its whole session: a number or a name (``"SIGTERM"``, ``"KILL"``)."""
        self._run(calls.signal(self.env.id, self.pid, sig))

    def kill(self) -> None:
        self.signal(9)

    def resize(self, rows: int, cols: int) -> None:
        self._run(calls.resize(self.env.id, self.pid, rows, cols))

    def info(self) -> wire.ProcessInfo:
        return self._run(calls.process_show(self.env.id, self.pid))  # type: ignore[no-any-return]

    def wait(self, timeout_s: float | None = None) -> wire.ProcessEnd | None:
        """How it ended (None if ``timeout_s`` came first). An attached handle reads (and drops)
        the rest of its output; otherwise the output stays for the next reader."""
        if self._lines is not None and timeout_s is None:
            for _ev in self.events():
                pass
            return self.end
        self.end = self._run(calls.wait(self.env.id, self.pid, timeout_s)).end
        return self.end

    def detach(self) -> None:
        """Stop following it (it runs on)."""
        cm, self._cm, self._lines = self._cm, None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def __enter__(self) -> "Process":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def _first_pid(lines: Iterator[str]) -> int:
    for line in lines:
        pid = calls.started_pid(calls.process_event(line))
        if pid is not None:
            return pid
    raise ApiError(500, "stream", "the process stream ended before its start")


class Env(calls.EnvHandle):
    """A running env (synchronous). Use it as a context manager to kill it on exit, together with
    the envs it forked (but those forked with ``keep=True``). ``info``: its :class:`weenv._wire.EnvInfo`."""

    def _run(self, call: calls.Call) -> Any:
        return self.client._run(call)

    def exec(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | str | None = None, timeout_s: float | None = None,
             on_output: Callable[[str, bytes], Any] | None = None) -> ExecResult:
        """Run a command (a str runs via /bin/sh -c). ``on_output(stream, data)`` streams output as it comes."""
        call = calls.exec_(self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s,
                           stream=on_output is not None)
        if on_output is None:
            return self._run(call)  # type: ignore[no-any-return]
        with self.client.connection.stream(call.route, call.params, **call.kw()) as resp:
            for line in resp.iter_lines():
                result = calls.exec_line(line, on_output)
                if result is not None:
                    return result
        raise ApiError(500, "stream", "exec stream ended without a result")

    def spawn(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
              user: str | None = None, stdin: bool = False, pty: tuple[int, int] | None = None,
              tag: str | None = None, buffer_bytes: int | None = None) -> Process:
        """Start a background process (a str runs via /bin/sh -c) and return its handle, attached
        to its output. It outlives the handle and this client. ``stdin`` keeps its stdin open for
        :meth:`Process.send_stdin`; ``pty=(rows, cols)`` runs it on a pseudo-terminal."""
        call = calls.spawn(self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, pty=pty, tag=tag,
                           buffer_bytes=buffer_bytes)
        cm = self.client.connection.stream(call.route, call.params, **call.kw())
        resp = cm.__enter__()
        try:
            lines = resp.iter_lines()
            pid = _first_pid(lines)
        except BaseException:
            cm.__exit__(None, None, None)
            raise
        return Process(self, pid, cm, lines)

    def connect(self, pid: int) -> Process:
        """Attach to a process started by weenv: first the output kept since its last reader."""
        proc = Process(self, pid)
        proc._attach()
        assert proc._lines is not None
        _first_pid(proc._lines)
        return proc

    def processes(self) -> list[wire.ProcessInfo]:
        """The env's processes started by weenv (running, and recently finished background ones)."""
        return self._run(calls.process_list(self.id))  # type: ignore[no-any-return]

    def process(self, pid: int) -> Process:
        """A handle on process ``pid``, not attached (``events()`` attaches)."""
        return Process(self, pid)

    def read_file(self, path: str, *, user: str | None = None) -> bytes:
        return self._run(calls.files_read(self.id, path, user))  # type: ignore[no-any-return]

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, user: str | None = None,
                   xattrs: dict[str, str] | None = None) -> None:
        """``xattrs``: ``{NAME: value}`` set as ``user.NAME`` on the file (E2B's file metadata)."""
        self._run(calls.files_write(self.id, path, data, mode, user, xattrs))

    def put_archive(self, path: str, data: bytes | Iterable[bytes]) -> wire.PathDone:
        """Unpack a tar (plain or compressed; bytes, or chunks sent as they come) into directory
        ``path`` of the env, keeping its members' modes, owners and times (no device nodes)."""
        return self._run(calls.archive_put(self.id, path, data))  # type: ignore[no-any-return]

    def get_archive(self, path: str) -> bytes:
        """A tar of ``path`` (a file or a whole directory), its members named from its last component."""
        return self._run(calls.archive_get(self.id, path))  # type: ignore[no-any-return]

    def list_dir(self, path: str, *, xattrs: bool = False) -> list[wire.FileInfo]:
        return self._run(calls.files_list(self.id, path, xattrs))  # type: ignore[no-any-return]

    def stat(self, path: str, *, xattrs: bool = False) -> wire.FileInfo:
        """``xattrs``: the entry's ``user.*`` extended attributes too (``info.xattrs``)."""
        return self._run(calls.files_stat(self.id, path, xattrs))  # type: ignore[no-any-return]

    def mkdir(self, path: str, *, mode: int = 0o755, user: str | None = None) -> None:
        self._run(calls.files_mkdir(self.id, path, mode, user))

    def move(self, path: str, to: str) -> wire.FileInfo:
        """Rename ``path`` to ``to`` in the env; the moved entry's info."""
        return self._run(calls.files_move(self.id, path, to))  # type: ignore[no-any-return]

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._run(calls.files_remove(self.id, path, recursive))

    def pause(self, *, memory: bool | Literal["park"] = True, park_after_s: float | None = None) -> None:
        """Freeze the env (its processes resume where they were); ``memory=False``: end its processes
        and keep its files, so it holds no memory while paused (resume boots it again);
        ``memory="park"``: checkpoint its processes to disk and free their memory (gVisor envs;
        resume restores them as they were; docs/snapshots.md, "Memory"). A freeze is parked by the
        daemon once it stayed paused ``park_after_s`` (``math.inf``: never; None: the daemon's
        ``--park-after``, off by default); crun envs stay frozen (their info says why)."""
        self._run(calls.pause(self.id, memory, park_after_s))

    def resume(self) -> None:
        self._run(calls.resume(self.id))

    def set_timeout(self, ttl_s: float | None) -> None:
        self._run(calls.set_ttl(self.id, ttl_s))

    def metrics(self, start: float | None = None, end: float | None = None) -> list[dict[str, float]]:
        """Usage points (``t``, cpu and memory) from ``start`` to ``end`` (epoch seconds), oldest first:
        one every 5 s for the last hour, then now."""
        return self._run(calls.env_metrics(self.id, start, end))  # type: ignore[no-any-return]

    def network(self) -> wire.NetworkInfo:
        """An egress env's addresses, policy, pinned names and accounting (docs/network.md)."""
        return self._run(calls.network(self.id))  # type: ignore[no-any-return]

    def set_network(self, *, allow: list[str] = [], deny: list[str] = [],  # noqa: B006 (never mutated)
                    remove: list[str] = []) -> wire.NetworkInfo:  # noqa: B006
        """Change a running egress env's policy: new connections follow it when this returns."""
        return self._run(calls.set_network(self.id, allow, deny, remove))  # type: ignore[no-any-return]

    def refresh(self) -> wire.EnvInfo:
        self.info = self._run(calls.env_show(self.id))
        return self.info

    def commit(self, *, ref: str | None = None, memory: bool = False) -> str:
        """Seal the env's filesystem into a snapshot (``memory``: its processes too, a memory
        snapshot envs start from with them; gVisor envs); returns its id."""
        return self.client.commit(self.id, ref=ref, memory=memory).snapshot

    def fork(self, n: int, *, keep: bool = False, memory: bool = False) -> list["Env"]:
        """Commit once and start ``n`` independent children from that state (``memory``: each
        continues this env's processes from the same instant; gVisor envs).

        The children are killed when this env's ``with`` block ends, unless ``keep``; the snapshot
        the fork made is collected by ``gc`` once no env started from it is left."""
        children = [Env(self.client, info) for info in self.client.fork(self.id, n, memory=memory).envs]
        if not keep:
            self.forks.extend(children)
        return children

    def kill(self) -> None:
        """Kill this env (its forks live on: they are independent envs); one already gone is fine."""
        try:
            self.client.kill(self.id)
        except EnvNotFoundError:
            pass

    def _kill_with_forks(self) -> None:
        forks, self.forks = self.forks, []
        errors: list[WeenvError] = []
        for child in forks:
            try:
                child._kill_with_forks()
            except WeenvError as e:  # the others still go
                errors.append(e)
        self.kill()
        if errors:
            raise errors[0]

    def __enter__(self) -> "Env":
        return self

    def __exit__(self, *exc: object) -> None:
        self._kill_with_forks()


class Client:
    """Synchronous client of the local weenv daemon (a socket path), or of ``weenv serve`` (a URL).

    ``connection``: a :class:`weenv._connection.Connection` to use instead (one made with a fake
    transport, in tests)."""

    def __init__(self, socket_path: str | None = None, *, token: str | None = None, timeout_s: float = 300.0,
                 autostart: bool = True, connection: Connection | None = None):
        self.connection = connection or Connection(socket_path, token=token, timeout_s=timeout_s, autostart=autostart)

    @property
    def target(self) -> str:
        """The daemon's socket path, or the server's URL."""
        return self.connection.target

    socket_path = target

    def _run(self, call: calls.Call) -> Any:
        return calls.decode(call, self.connection.request(call.route, call.params, **call.kw()))

    def ping(self) -> wire.Ping:
        return self._run(calls.ping())  # type: ignore[no-any-return]

    def create(self, plan_or_lock: Any, *, name: str | None = None, ttl_s: float | None = None,
               cpu: str | float | None = None, memory: str | int | None = None, env: dict[str, str] | None = None,
               workdir: str | None = None, user: str | None = None, network: str | None = None,
               volumes: list[dict[str, Any]] | None = None) -> Env:
        """Start an env from a plan or lock (path, dict or Plan) or a snapshot id.

        ``network="host"`` (the node's network, with egress) is for trusted build steps only.
        ``volumes``: ``[[volumes]]`` tables (``{"name", "path", "read_only"}``) mounted beside the plan's."""
        return Env(self, self._run(calls.create(plan_or_lock, name=name, ttl_s=ttl_s, cpu=cpu, memory=memory, env=env,
                                                workdir=workdir, user=user, network=network, volumes=volumes)))

    def get(self, env_id: str) -> Env:
        return Env(self, self._run(calls.env_show(env_id)))

    def list(self) -> list[wire.EnvInfo]:
        return self._run(calls.env_list())  # type: ignore[no-any-return]

    def gc(self) -> wire.GcReport:
        return self._run(calls.gc())  # type: ignore[no-any-return]

    def top(self) -> wire.Top:
        return self._run(calls.top())  # type: ignore[no-any-return]

    def snapshots(self) -> list[wire.SnapshotInfo]:
        return self._run(calls.snapshot_list())  # type: ignore[no-any-return]

    def snapshot(self, snapshot_id: str) -> wire.SnapshotDetail:
        """One snapshot: its layers, its plan lock (``lock``), where it came from."""
        return self._run(calls.snapshot_show(snapshot_id))  # type: ignore[no-any-return]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._run(calls.snapshot_delete(snapshot_id))

    def pull_snapshot(self, ref: str) -> wire.SnapshotDetail:
        """Record the snapshot published at ``ref`` (``commit(memory=True, ref=...)`` on another
        node) as one of this node's; envs from its id restore its processes."""
        return self._run(calls.snapshot_pull(ref))  # type: ignore[no-any-return]

    # -- volumes: node-local storage envs mount (a plan's [[volumes]], or create(..., volumes=[...]))

    def create_volume(self, name: str | None = None, *, size_bytes: int | None = None) -> vw.VolumeInfo:
        """A new volume of ``size_bytes`` (default 1 GiB) on the daemon's node."""
        return self._run(calls.volume_create(name, size_bytes))  # type: ignore[no-any-return]

    def volumes(self) -> list[vw.VolumeInfo]:
        return self._run(calls.volume_list())  # type: ignore[no-any-return]

    def volume(self, ref: str) -> vw.VolumeInfo:
        """One volume, by id or name: its size, the bytes used, the envs mounting it."""
        return self._run(calls.volume_show(ref))  # type: ignore[no-any-return]

    def delete_volume(self, ref: str) -> None:
        """Remove a volume and its files (ApiError ``volume_in_use`` while an env mounts it)."""
        self._run(calls.volume_delete(ref))

    def list_volume_dir(self, ref: str, path: str = "/") -> list[wire.FileInfo]:
        return self._run(calls.volume_list_dir(ref, path))  # type: ignore[no-any-return]

    def read_volume_file(self, ref: str, path: str) -> bytes:
        return self._run(calls.volume_read(ref, path))  # type: ignore[no-any-return]

    def write_volume_file(self, ref: str, path: str, data: bytes | str, *, mode: int | None = None) -> wire.FileInfo:
        return self._run(calls.volume_write(ref, path, data, mode))  # type: ignore[no-any-return]

    def kill(self, env_id: str) -> wire.EnvStatus:
        """Kill env ``env_id`` (EnvNotFoundError when there is none)."""
        return self._run(calls.kill(env_id))  # type: ignore[no-any-return]

    def commit(self, env_id: str, *, ref: str | None = None, memory: bool = False) -> wire.CommitResponse:
        """Seal env ``env_id`` into a snapshot (the answer names it: ``.snapshot``)."""
        return self._run(calls.commit(env_id, ref, memory))  # type: ignore[no-any-return]

    def fork(self, env_id: str, n: int, *, memory: bool = False) -> wire.ForkResponse:
        """Fork env ``env_id`` ``n`` ways: the snapshot made and the children's infos."""
        return self._run(calls.fork(env_id, n, memory))  # type: ignore[no-any-return]

    def env(self, env_id: str) -> Env:
        """A handle on env ``env_id``, not looked up (its first call says if it is gone)."""
        return Env(self, wire.EnvInfo(id=env_id, name="", status="", created_s=0.0))

    def stop_daemon(self, *, kill_envs: bool = False) -> wire.StopResponse:
        """Ask the daemon to stop (``kill_envs``: its envs first)."""
        return self._run(calls.daemon_stop(kill_envs))  # type: ignore[no-any-return]

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_envs(client: Client) -> Iterator[Env]:
    for info in client.list():
        yield Env(client, info)
