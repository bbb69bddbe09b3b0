"""The daemon's side of the in-env agent: its listening socket, its key, and who may answer on it.

Unit tests run on plain Unix sockets in tmp_path (a Python stand-in plays the agent); the
integration test at the end drives the real daemon.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading

import pytest
import trio

from weenv._unixsock import bind_unix
from weenv.provision.runtime._agent import AGENT_KEY_BYTES, agent_exec, agent_key_path, agent_listener
from weenv.provision._errors import ContainerError

_HDR = struct.Struct(">cI")


def _umask_now() -> int:
    """The process umask, read without setting it (os.umask would change it for every thread)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise AssertionError("no Umask line in /proc/self/status")


def _daemon_umask(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)


# -- the listening socket --------------------------------------------------------------------


def test_concurrent_listeners_never_touch_the_process_umask(tmp_path):
    # Promise: binding agent sockets from many worker threads at once leaves the umask alone, at
    # every moment (a sampler thread reads it from /proc all along), and every socket is 0600.
    before = _umask_now()
    seen: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.add(_umask_now())

    def bind_many(i: int) -> None:
        for j in range(40):
            path = str(tmp_path / f"{i}-{j}.sock")
            agent_listener(path).close()
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(agent_key_path(path)).st_mode) == 0o600

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [threading.Thread(target=bind_many, args=(i,)) for i in range(8)]
    try:
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        stop.set()
        sampler.join()
    assert seen == {before} and _umask_now() == before, f"umask seen: {sorted(map(oct, seen))}"


def test_bind_unix_gives_the_mode_at_once_and_replaces_a_stale_socket(tmp_path):
    path = str(tmp_path / "api.sock")
    old = bind_unix(path, 0o600)
    old.close()  # a stale socket file stays behind, as after a crash
    sock = bind_unix(path, 0o660)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660 and stat.S_ISSOCK(os.stat(path).st_mode)
        assert os.listdir(tmp_path) == ["api.sock"]  # no private bind directory left behind
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(path)
            conn, _ = sock.accept()
            conn.close()
    finally:
        sock.close()
    with pytest.raises(OSError, match="cannot bind a Unix socket for .*too long"):
        bind_unix(str(tmp_path / ("x" * 120)))


# -- the key ---------------------------------------------------------------------------------


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise ConnectionError("peer closed")
        data += got
    return data


def _recv_frame(conn: socket.socket) -> tuple[bytes, bytes]:
    kind, n = _HDR.unpack(_recv_exact(conn, 5))
    return kind, _recv_exact(conn, n)


def _frame(kind: bytes, body: bytes = b"") -> bytes:
    return _HDR.pack(kind, len(body)) + body


def _fake_agent(listener: socket.socket, hello: bytes | None, answers: int) -> threading.Thread:
    """Accepts ``answers`` connections after the key connection; each gets ``hello`` (if any) and
    a forged result, the way a hijacker that stole the socket would answer."""

    def run() -> None:
        for _ in range(answers):
            conn, _ = listener.accept()
            with conn:
                if hello is not None:
                    conn.sendall(_frame(b"H", hello))
                try:
                    _recv_frame(conn)
                    conn.sendall(_frame(b"O", b"HIJACKED: 42 passed\n") + _frame(b"X", b"0"))
                except OSError:
                    pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


async def _exec(path: str):  # type: ignore[no-untyped-def]
    return await agent_exec(path, ["sh", "-c", "echo REAL; exit 3"], env=[], cwd="/", uid=0, gid=0, groups=(),
                            stdin=None, timeout_s=5, on_output=None, max_output_bytes=1 << 20, env_id="env-x",
                            connect_deadline_s=2)


def test_the_key_waits_in_the_socket_for_the_agent(tmp_path):
    path = str(tmp_path / "agent.sock")
    listener = agent_listener(path)
    try:
        first, _ = listener.accept()  # what the agent does first
        with first:
            kind, body = _recv_frame(first)
            assert first.recv(1) == b""  # the daemon closed its end: one frame, then EOF
        with open(agent_key_path(path), "rb") as f:
            assert (kind, body) == (b"K", f.read()) and len(body) == AGENT_KEY_BYTES
    finally:
        listener.close()


@pytest.mark.parametrize("hello", [None, b"H" * AGENT_KEY_BYTES, b""], ids=["no-hello", "wrong-key", "empty-key"])
def test_an_answer_without_the_key_is_refused(tmp_path, hello):
    # Promise: whatever holds the agent's listening socket but not the key (a hijacker that got it
    # with pidfd_getfd, say) cannot hand the daemon an exit code or output.
    path = str(tmp_path / "agent.sock")
    listener = agent_listener(path)
    try:
        listener.accept()[0].close()  # the key connection
        impostor = _fake_agent(listener, hello, answers=1)
        with pytest.raises(ContainerError, match="agent key|did not identify"):
            trio.run(_exec, path)
        impostor.join(5)
    finally:
        listener.close()


def test_an_answer_with_the_key_is_taken(tmp_path):
    # Control for the test above: the same stand-in, given the key, is believed.
    path = str(tmp_path / "agent.sock")
    listener = agent_listener(path)
    try:
        first, _ = listener.accept()
        key = _recv_frame(first)[1]
        first.close()
        _fake_agent(listener, key, answers=1).join(0)
        r = trio.run(_exec, path)
        assert (r.exit_code, r.stdout) == (0, b"HIJACKED: 42 passed\n")
    finally:
        listener.close()


# -- on the real daemon ----------------------------------------------------------------------


@pytest.mark.integration
def test_a_burst_of_creates_leaves_the_umask_and_non_root_envs_work(daemon):
    # Issue 14 item 2: concurrent env starts left the daemon at umask 0177, after which every new
    # env's / was drw------- and a non-root user got exit 126.
    with daemon.client() as c:
        pid = c.ping()["pid"]
    before = _daemon_umask(pid)

    async def burst() -> list[str]:
        ids: list[str] = []
        async with daemon.async_client() as c:

            async def one() -> None:
                env = await c.create(daemon.plan_lock)
                ids.append(env.id)

            async with trio.open_nursery() as n:
                for _ in range(32):
                    n.start_soon(one)
        return ids

    def kill(ids: list[str]) -> None:
        with daemon.client() as c:
            for env_id in ids:
                c.get(env_id).kill()

    for _ in range(2):  # the race is a matter of luck: two bursts catch it more often than one
        ids = trio.run(burst)
        try:
            assert len(ids) == 32
            assert _daemon_umask(pid) == before, f"daemon umask {oct(_daemon_umask(pid))}, was {oct(before)}"
        finally:
            kill(ids)  # 32 cpu mins of 0.05 fill most of this node: make room for the next round
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        r = env.exec(["sh", "-c", "ls / >/dev/null && stat -c %a / && id -u"], user="user")
        assert (r.exit_code, r.stdout.split()[-1]) == (0, b"1000"), r
        assert int(r.stdout.split()[0], 8) & 0o005 == 0o005, r.stdout  # / is readable and searchable
