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
from collections.abc import Sequence

import trio

from .._unixsock import bind_unix
from ._errors import ContainerError

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
        tmp = f"{agent_key_path(path)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, key)
        finally:
            os.close(fd)
        os.replace(tmp, agent_key_path(path))
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
    """Run one command through the agent; returns an ExecResult (exit 137 and timed_out at the timeout)."""
    from ._runtime import ExecResult

    fields: list[str] = []
    for a in argv:
        fields += ["arg", a]
    for e in env:
        fields += ["env", e]
    fields += ["cwd", cwd, "uid", str(uid), "gid", str(gid), "stdin", "1" if stdin is not None else "0"]
    for g in groups:
        fields += ["group", str(g)]
    if any("\0" in f for f in fields):
        raise ContainerError("argv, env and cwd must not contain NUL bytes", env_id=env_id)
    request = b"".join(f.encode("utf-8", "surrogateescape") + b"\0" for f in fields)
    started = time.perf_counter()
    out, err = bytearray(), bytearray()
    trunc = {"stdout": False, "stderr": False}
    timed_out = False
    not_found = False
    code: int | None = None
    key = _read_key(socket_path)
    stream = await _connect(socket_path, connect_deadline_s)
    async with stream:
        buf = bytearray()
        if key is not None:
            await _check_agent(stream, buf, key, connect_deadline_s, env_id)
        msg = _frame(b"R", request)
        if stdin is not None:
            for i in range(0, len(stdin), 1 << 20):
                msg += _frame(b"I", stdin[i : i + (1 << 20)])
            msg += _frame(b"E")
        await stream.send_all(msg)

        async def pump(deadline: float) -> None:
            nonlocal code, not_found
            with trio.move_on_at(deadline):
                while True:
                    frame = await _read_frame(stream, buf)
                    if frame is None:
                        raise ContainerError("the env's agent closed the connection (did the env stop?)", env_id=env_id)
                    kind, body = frame
                    if kind in (b"O", b"e"):
                        name = "stdout" if kind == b"O" else "stderr"
                        sink = out if kind == b"O" else err
                        room = max_output_bytes - len(sink)
                        if len(body) > room:
                            trunc[name] = True
                        if room > 0:
                            sink.extend(body[:room])
                        if on_output is not None:
                            r = on_output(name, body)
                            if inspect.isawaitable(r):
                                await r
                    elif kind == b"F":  # payload "errno*10+stage stage-name"
                        number = body.decode("utf-8", "replace").partition(" ")[0]
                        n, stage = divmod(int(number), 10) if number.isdigit() else (0, 0)
                        why = os.strerror(n) if n else "unknown error"
                        if stage == 3 and n in (errno.ENOENT, errno.ENOTDIR):
                            not_found = True
                            text = f"weenv: command not found in env {env_id}: {argv[0]}\n"
                        elif stage == 2:
                            text = f"weenv: cannot change to directory {cwd!r} in env {env_id}: {why}\n"
                        elif stage == 1:
                            text = f"weenv: cannot switch to uid {uid} gid {gid} in env {env_id}: {why}\n"
                        else:
                            text = f"weenv: cannot run {argv[0]!r} in env {env_id}: {why}\n"
                        err.extend(text.encode())
                        if on_output is not None:
                            r = on_output("stderr", text.encode())
                            if inspect.isawaitable(r):
                                await r
                    elif kind == b"X":
                        code = int(body or b"255")
                        return

        deadline = math.inf if timeout_s is None else trio.current_time() + timeout_s
        await pump(deadline)
        if code is None:  # timed out: kill the command's whole session, then take its exit status
            timed_out = True
            await stream.send_all(_frame(b"K", str(int(signal.SIGKILL)).encode()))
            await pump(trio.current_time() + kill_grace_s)
            if code is None:
                code = 137
    return ExecResult(exit_code=code, stdout=bytes(out), stderr=bytes(err), timed_out=timed_out,
                      duration_s=time.perf_counter() - started, stdout_truncated=trunc["stdout"],
                      stderr_truncated=trunc["stderr"], command_not_found=not_found)
