"""The in-env agent: weenv-agent (C, static) as the env's init, and the daemon's side of its protocol.

``crun exec`` costs a crun process, state parsing and a setns into every namespace (12-20 ms);
the agent is already inside the env and only forks and execs (~1 ms). Commands it starts are
children of the env's init, so they share its namespaces, cgroups, seccomp filter, capability
bounding set and no_new_privileges. The daemon binds the agent's listening socket in the env's
directory on the host, never visible inside the env (so nothing there can swap it for a link to
another socket), and crun hands it to the init as descriptor 3. See
weenv/provision/agent/weenv-agent.c for the frame format.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import inspect
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Sequence

import trio

from ..._atomic import atomic_write
from ..._unixsock import bind_unix
from ... import _wire as wire
from .._errors import ContainerError, ProcessExitedError, ProcessNotFoundError, ProcessStartError, ProcessStateError

log = logging.getLogger("weenv.daemon")

AGENT_SOURCE = os.path.join(os.path.dirname(__file__), "agent", "weenv-agent.c")
from ._ocispec import AGENT_PATH as AGENT_PATH  # noqa: E402
_HDR = struct.Struct(">cI")
AGENT_KEY_BYTES = 32


def agent_key_path(socket_path: str) -> str:
    """Where the daemon keeps the env's agent key (next to the socket, in the root-only env dir)."""
    return socket_path + ".key"


def agent_listener(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` (mode 0600) for an env's agent to inherit, with the
    env's agent key already waiting in it.

    The key (32 random bytes, kept for the daemon at :func:`agent_key_path`) is sent on a
    connection made here, before anything else holds the socket: it is the first connection the
    agent accepts, so the agent reads it from that connection into its memory and the key is never
    on a file system the env can see. The agent proves itself with it on every later connection.
    """
    sock = bind_unix(path, 0o600)
    try:
        key = secrets.token_bytes(AGENT_KEY_BYTES)
        atomic_write(agent_key_path(path), key, mode=0o600, fsync=False)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
            first.connect(path)  # queued in the backlog until the agent accepts it
            first.sendall(_frame(b"K", key))
    except BaseException:
        sock.close()
        raise
    return sock


def _read_key(socket_path: str) -> bytes | None:
    try:
        with open(agent_key_path(socket_path), "rb") as f:
            return f.read(AGENT_KEY_BYTES + 1)
    except FileNotFoundError:
        return None


def ensure_agent(lib_dir: str) -> str | None:
    """The compiled agent for this source (built once with ``gcc -static``), or None if it cannot be built."""
    try:
        with open(AGENT_SOURCE, "rb") as f:
            source = f.read()
    except OSError:
        return None
    target = os.path.join(lib_dir, f"weenv-agent-{hashlib.sha256(source).hexdigest()[:12]}")
    if os.access(target, os.X_OK):
        return target
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler: envs use `crun exec` instead of the in-env agent")
        return None
    os.makedirs(lib_dir, exist_ok=True)
    tmp = f"{target}.tmp{os.getpid()}"
    r = subprocess.run([cc, "-static", "-O2", "-o", tmp, AGENT_SOURCE], capture_output=True, text=True)
    if r.returncode != 0:
        log.warning("could not build the in-env agent (static libc missing?): %s", r.stderr.strip()[-500:])
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        return None
    os.replace(tmp, target)
    return target


async def _read_frame(stream: trio.SocketStream, buf: bytearray) -> tuple[bytes, bytes] | None:
    while True:
        if len(buf) >= 5:
            kind, n = _HDR.unpack_from(buf)
            if len(buf) >= 5 + n:
                body = bytes(buf[5 : 5 + n])
                del buf[: 5 + n]
                return kind, body
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data


def _frame(kind: bytes, body: bytes = b"") -> bytes:
    return _HDR.pack(kind, len(body)) + body


async def _connect(path: str, deadline_s: float) -> trio.SocketStream:
    """The agent creates its socket right after ``crun start``: wait for it briefly."""
    end = time.monotonic() + deadline_s
    delay = 0.0005
    while True:
        try:
            return await trio.open_unix_socket(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            if time.monotonic() > end:
                raise ContainerError(f"the env's agent is not answering on {path}", detail=str(e)) from None
        await trio.sleep(delay)
        delay = min(delay * 2, 0.02)


async def _check_agent(stream: trio.SocketStream, buf: bytearray, key: bytes, deadline_s: float, env_id: str) -> None:
    """The agent's first frame must carry the env's key: nothing else answers for it."""
    with trio.move_on_after(deadline_s):
        frame = await _read_frame(stream, buf)
        if frame is not None and frame[0] == b"H" and hmac.compare_digest(frame[1], key):
            return
        raise ContainerError(
            "the env's agent socket answered without the env's agent key: refusing to trust it with a command",
            env_id=env_id, detail=f"first frame {frame[0]!r}" if frame is not None else "connection closed")
    raise ContainerError(f"the env's agent did not identify itself within {deadline_s:g} s", env_id=env_id)


def _request(argv: Sequence[str], env: Sequence[str], cwd: str, uid: int, gid: int, groups: Sequence[int],
             env_id: str, **extra: str | None) -> bytes:
    fields: list[str] = []
    for a in argv:
        fields += ["arg", a]
    for e in env:
        fields += ["env", e]
    fields += ["cwd", cwd, "uid", str(uid), "gid", str(gid)]
    for g in groups:
        fields += ["group", str(g)]
    for k, v in extra.items():
        if v is not None:
            fields += [k, v]
    if any("\0" in f for f in fields):
        raise ContainerError("argv, env and cwd must not contain NUL bytes", env_id=env_id)
    return b"".join(f.encode("utf-8", "surrogateescape") + b"\0" for f in fields)


def _kv(body: bytes) -> list[tuple[str, str]]:
    parts = body.split(b"\0")
    return [(parts[i].decode("utf-8", "surrogateescape"), parts[i + 1].decode("utf-8", "surrogateescape"))
            for i in range(0, len(parts) - 1, 2)]


def _end(body: bytes) -> wire.ProcessEnd:
    """An 'X' payload: "CODE" or "CODE SIGNAL" (older agents send only the code)."""
    words = body.split()
    code = int(words[0]) if words and words[0].isdigit() else 255
    sig = int(words[1]) if len(words) > 1 and words[1].isdigit() else None
    if sig is not None:
        try:
            name = signal.Signals(sig).name[3:].lower()
        except ValueError:
            name = str(sig)
        status = f"signal: {_SIGNAL_WORDS.get(name, name)}"
    else:
        status = f"exit status {code}"
    return wire.ProcessEnd(exit_code=code, signal=sig, status=status)


_SIGNAL_WORDS = {"term": "terminated", "kill": "killed", "int": "interrupt", "hup": "hangup", "quit": "quit",
                 "abrt": "aborted", "segv": "segmentation fault", "pipe": "broken pipe", "alrm": "alarm clock"}
_STREAMS = {b"O": "stdout", b"e": "stderr", b"T": "pty"}


def _failure_text(body: bytes, argv0: str, cwd: str, uid: int, gid: int, env_id: str) -> tuple[str, bool]:
    """An 'F' payload ("errno*10+stage stage-name") in words; and whether the command does not exist."""
    number = body.decode("utf-8", "replace").partition(" ")[0]
    n, stage = divmod(int(number), 10) if number.isdigit() else (0, 0)
    why = os.strerror(n) if n else "unknown error"
    if stage == 3 and n in (errno.ENOENT, errno.ENOTDIR):
        return f"weenv: command not found in env {env_id}: {argv0}\n", True
    if stage == 2:
        return f"weenv: cannot change to directory {cwd!r} in env {env_id}: {why}\n", False
    if stage == 1:
        return f"weenv: cannot switch to uid {uid} gid {gid} in env {env_id}: {why}\n", False
    if stage == 4:
        return f"weenv: no such process in env {env_id}\n", False
    return f"weenv: cannot run {argv0!r} in env {env_id}: {why} ({body.decode('utf-8', 'replace')})\n", False


class AgentProcess:
    """One connection to the agent about one process: its events come in, stdin, signals and
    terminal sizes go out. Closing it detaches: a background process runs on (a one-shot one is
    killed, with its whole session). Implements :class:`weenv.provision.ProcessStream`."""

    def __init__(self, stream: trio.SocketStream, buf: bytearray, env_id: str, pid: int, *, pty: bool = False):
        self._stream, self._buf, self.env_id, self.pid, self.pty = stream, buf, env_id, pid, pty
        self.end: wire.ProcessEnd | None = None
        self._closed = False

    async def receive(self) -> wire.ProcessEvent | None:
        """The next output, ``dropped`` or ``end`` event; None after the end."""
        while self.end is None:
            frame = await _read_frame(self._stream, self._buf)
            if frame is None:
                raise ContainerError("the env's agent closed the connection (did the env stop?)", env_id=self.env_id)
            kind, body = frame
            name = _STREAMS.get(kind)
            if name is not None:
                return wire.ProcessEvent(stream=name, data_b64=body)  # type: ignore[arg-type]
            if kind == b"X":
                self.end = _end(body)
                return wire.ProcessEvent(end=self.end)
            if kind == b"D":
                return wire.ProcessEvent(dropped=int(body) if body.isdigit() else 0)
            if kind == b"Y":
                continue
        return None

    def __aiter__(self) -> AsyncIterator[wire.ProcessEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[wire.ProcessEvent]:
        while (ev := await self.receive()) is not None:
            yield ev

    async def send(self, kind: bytes, body: bytes = b"") -> None:
        await self._stream.send_all(_frame(kind, body))

    async def write_stdin(self, data: bytes) -> None:
        for i in range(0, len(data), 1 << 20):
            await self.send(b"I", data[i : i + (1 << 20)])

    async def close_stdin(self) -> None:
        await self.send(b"E")

    async def signal(self, sig: int) -> None:
        await self.send(b"K", str(int(sig)).encode())

    async def resize(self, rows: int, cols: int) -> None:
        await self.send(b"W", f"{int(rows)} {int(cols)}".encode())

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._stream.aclose()

    async def __aenter__(self) -> AgentProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with trio.CancelScope(shield=True):
            await self.aclose()


async def _open(socket_path: str, env_id: str, connect_deadline_s: float) -> tuple[trio.SocketStream, bytearray]:
    key = _read_key(socket_path)
    stream = await _connect(socket_path, connect_deadline_s)
    buf = bytearray()
    try:
        if key is not None:
            await _check_agent(stream, buf, key, connect_deadline_s, env_id)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    return stream, buf


async def _first(stream: trio.SocketStream, buf: bytearray, env_id: str) -> tuple[bytes, bytes]:
    frame = await _read_frame(stream, buf)
    if frame is None:
        raise ContainerError("the env's agent closed the connection (did the env stop?)", env_id=env_id)
    return frame


async def agent_start(
    socket_path: str, argv: Sequence[str], *, env: Sequence[str], cwd: str, uid: int, gid: int,
    groups: Sequence[int], stdin: bool | bytes, env_id: str, background: bool = True,
    pty: tuple[int, int] | None = None, tag: str | None = None, buffer_bytes: int | None = None,
    shown_env: Sequence[str] = (), connect_deadline_s: float = 5.0,
) -> AgentProcess:
    """Start ``argv`` through the agent; returns the attached :class:`AgentProcess` once it runs.

    ``stdin``: True keeps it open, bytes are written and then closed, False gives /dev/null.
    ``shown_env`` (NAME=VALUE) is what a listing shows as its environment (the variables the
    caller asked for, not the env's whole environment). Raises :class:`ProcessStartError` when the
    command cannot start (``not_found`` for a command the env does not have)."""
    request = _request(argv, env, cwd, uid, gid, groups, env_id, stdin="1" if stdin is not False else "0",
                       background="1" if background else None, pty="1" if pty else None,
                       rows=str(pty[0]) if pty else None, cols=str(pty[1]) if pty else None, tag=tag,
                       buffer=str(buffer_bytes) if buffer_bytes else None)
    shown = [f"shown_env\0{e}\0" for e in shown_env]
    if any("\0" in e for e in shown_env):
        raise ContainerError("env must not contain NUL bytes", env_id=env_id)
    request += "".join(shown).encode("utf-8", "surrogateescape")
    stream, buf = await _open(socket_path, env_id, connect_deadline_s)
    try:
        msg = _frame(b"R", request)
        if isinstance(stdin, bytes):
            for i in range(0, len(stdin), 1 << 20):
                msg += _frame(b"I", stdin[i : i + (1 << 20)])
            msg += _frame(b"E")
        await stream.send_all(msg)
        kind, body = await _first(stream, buf, env_id)
        if kind == b"P":
            return AgentProcess(stream, buf, env_id, int(body), pty=pty is not None)
        if kind in (b"O", b"e", b"T", b"X"):  # an agent that does not say 'P' first: the pid is unknown
            buf[:0] = _frame(kind, body)
            return AgentProcess(stream, buf, env_id, 0, pty=pty is not None)
        if kind == b"F":
            text, not_found = _failure_text(body, argv[0], cwd, uid, gid, env_id)
            # the text names the env already
            raise ProcessStartError(text.strip().removeprefix("weenv: "), not_found=not_found)
        raise ContainerError(f"the env's agent answered a start with frame {kind!r}", env_id=env_id)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise


async def agent_attach(socket_path: str, pid: int, *, env_id: str, output: bool = True,
                       connect_deadline_s: float = 5.0) -> AgentProcess:
    """Attach to process ``pid``: with ``output`` its events (first the output kept while nobody
    read, then live), else control only (stdin, signals, resize, and its end)."""
    stream, buf = await _open(socket_path, env_id, connect_deadline_s)
    try:
        await stream.send_all(_frame(b"A", b"pid\0%d\0output\0%s\0" % (pid, b"1" if output else b"0")))
        kind, body = await _first(stream, buf, env_id)
        if kind == b"P":
            return AgentProcess(stream, buf, env_id, pid)
        if kind == b"F":
            raise ProcessNotFoundError(f"no process {pid} started by weenv", env_id=env_id)
        raise ContainerError(f"the env's agent answered an attach with frame {kind!r}", env_id=env_id)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise


async def agent_control(socket_path: str, pid: int, frames: Sequence[tuple[bytes, bytes]], *, env_id: str,
                        connect_deadline_s: float = 5.0) -> None:
    """Send ``frames`` (stdin 'I'/'E', signal 'K', size 'W') to process ``pid``; returns once the
    agent has taken them (so a later call's frames come after these). Raises
    :class:`ProcessStateError` when the process could not take one."""
    async with await agent_attach(socket_path, pid, env_id=env_id, output=False,
                                  connect_deadline_s=connect_deadline_s) as proc:
        for kind, body in frames:
            try:
                await proc.send(kind, body)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # a finished process's attach is answered 'P', 'X' and closed: read on
            frame = await _read_frame(proc._stream, proc._buf)
            if frame is None:
                raise ContainerError("the env's agent closed the connection (did the env stop?)", env_id=env_id)
            if frame[0] == b"X" or (frame != (b"Y", b"1") and kind == b"K"):
                raise ProcessExitedError(f"process {pid} has exited", env_id=env_id)
            if frame != (b"Y", b"1"):
                what = {b"I": "its stdin is closed (or was never opened: start it with stdin)",
                        b"E": "its stdin is closed", b"W": "it is not on a pty"}.get(kind, "it refused the frame")
                raise ProcessStateError(f"process {pid}: {what}", env_id=env_id)


async def agent_wait(socket_path: str, pid: int, *, env_id: str, connect_deadline_s: float = 5.0) -> wire.ProcessEnd:
    """Wait for process ``pid`` to end (its output stays for the next reader)."""
    async with await agent_attach(socket_path, pid, env_id=env_id, output=False,
                                  connect_deadline_s=connect_deadline_s) as proc:
        async for _ev in proc:
            pass
    assert proc.end is not None
    return proc.end


async def agent_list(socket_path: str, *, env_id: str, connect_deadline_s: float = 5.0) -> list[wire.ProcessInfo]:
    """The processes the agent started that it still knows (running, and recently finished background ones)."""
    stream, buf = await _open(socket_path, env_id, connect_deadline_s)
    out: list[wire.ProcessInfo] = []
    async with stream:
        await stream.send_all(_frame(b"L"))
        while (frame := await _read_frame(stream, buf)) is not None:
            if frame[0] != b"L":
                continue
            d: dict[str, str] = {}
            argv: list[str] = []
            shown: dict[str, str] = {}
            for k, v in _kv(frame[1]):
                if k == "arg":
                    argv.append(v)
                elif k == "env":
                    name, _, value = v.partition("=")
                    shown[name] = value
                else:
                    d[k] = v
            running = d.get("state") == "running"
            end = None
            if not running:
                end = _end(f"{d.get('code', '255')} {d.get('signal', '')}".encode())
            out.append(wire.ProcessInfo(
                pid=int(d["pid"]), argv=argv, env=shown, cwd=d.get("cwd"), tag=d.get("tag"), pty=d.get("pty") == "1",
                background=d.get("background") == "1", stdin=d.get("stdin") == "1", running=running, end=end,
                buffered_bytes=int(d.get("buffered", "0")), dropped_bytes=int(d.get("dropped", "0"))))
    return out


async def agent_exec(
    socket_path: str,
    argv: Sequence[str],
    *,
    env: Sequence[str],
    cwd: str,
    uid: int,
    gid: int,
    groups: Sequence[int],
    stdin: bytes | None,
    timeout_s: float | None,
    on_output,  # type: ignore[no-untyped-def]
    max_output_bytes: int,
    env_id: str,
    kill_grace_s: float = 5.0,
    connect_deadline_s: float = 5.0,
):  # type: ignore[no-untyped-def]
    """Run one command through the agent (a one-shot process: it dies with this call) and
    collect it; returns an ExecResult (exit 137 and timed_out at the timeout)."""
    from ._runtime import ExecResult

    started = time.perf_counter()
    out, err = bytearray(), bytearray()
    trunc = {"stdout": False, "stderr": False}
    try:
        proc = await agent_start(socket_path, argv, env=env, cwd=cwd, uid=uid, gid=gid, groups=groups,
                                 stdin=stdin if stdin is not None else False, env_id=env_id, background=False,
                                 connect_deadline_s=connect_deadline_s)
    except ProcessStartError as e:  # as a shell says it: on stderr, with exit status 127 / 126
        text = f"weenv: {e}\n".encode()
        if on_output is not None:
            r = on_output("stderr", text)
            if inspect.isawaitable(r):
                await r
        return ExecResult(exit_code=127 if e.not_found else 126, stderr=text,
                               duration_s=time.perf_counter() - started, command_not_found=e.not_found)
    timed_out = False
    async with proc:

        async def pump(deadline: float) -> None:
            with trio.move_on_at(deadline):
                async for ev in proc:
                    if ev.stream is not None and ev.data_b64 is not None:
                        name, body = ev.stream, ev.data_b64
                        sink = out if name == "stdout" else err
                        room = max_output_bytes - len(sink)
                        if len(body) > room:
                            trunc[name] = True
                        if room > 0:
                            sink.extend(body[:room])
                        if on_output is not None:
                            r = on_output(name, body)
                            if inspect.isawaitable(r):
                                await r

        await pump(math.inf if timeout_s is None else trio.current_time() + timeout_s)
        if proc.end is None:  # timed out: kill the command's whole session, then take its exit status
            timed_out = True
            await proc.signal(signal.SIGKILL)
            await pump(trio.current_time() + kill_grace_s)
    code = proc.end.exit_code if proc.end is not None else 137
    return ExecResult(exit_code=code, stdout=bytes(out), stderr=bytes(err), timed_out=timed_out,
                           duration_s=time.perf_counter() - started, stdout_truncated=trunc["stdout"],
                           stderr_truncated=trunc["stderr"], command_not_found=False)
