"""Deadlines end to end: a hung registry (SIGSTOP: connections accepted, never answered) turns a
read into EIO within the envlet's deadline, total across retries, connects, reads and the kernel's
own retry of a failed read-ahead; the same holds for the remote store alone (a socket server that
accepts and never answers)."""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time

import pytest

from weenv.envlet import StoreSpec

from .layertrees import f, make_tree

pytestmark = pytest.mark.integration

DEADLINE_S = 2.0
SLACK_S = 1.0  # thread hand-offs, the FUSE round trip, a loaded 2-core machine


def test_a_sigstopped_registry_gives_eio_within_the_deadline_and_reads_resume_after_sigcont(
        tmp_path, envlet_factory, weenv_home):
    from weenv.registry import publish, resolve_group

    from .fixtures_registry import start_registry, stop_registry

    reg = start_registry(str(tmp_path / "reg"))
    stopped = False
    try:
        data = os.urandom(6_000_000)
        src = make_tree(tmp_path / "src", f("big", data), f("other", os.urandom(200_000)))
        publish(str(src), f"{reg.host}/envlet/hang:v1", group="hang", group_class="task")
        g = resolve_group(f"{reg.host}/envlet/hang:v1")
        e = envlet_factory(deadline_s=DEADLINE_S, readahead_bytes=0)
        info = e.client.register(StoreSpec("registry", registry=reg.host, insecure=True), g.layer_digest,
                                 g.layer_size, g.toc_digest, repo=g.repo)
        with open(os.path.join(info.path, "big"), "rb") as fh:
            assert fh.read(1_000_000) == data[:1_000_000]  # a keep-alive connection is open
            os.kill(reg.pid, signal.SIGSTOP)
            stopped = True
            for where in (3_000_000, 5_000_000):  # twice: the second read must not wait longer
                t0 = time.monotonic()
                with pytest.raises(OSError) as ei:
                    fh.seek(where)
                    fh.read(100_000)
                elapsed = time.monotonic() - t0
                assert ei.value.errno == errno.EIO
                assert elapsed < DEADLINE_S + SLACK_S, f"EIO after {elapsed:.1f} s, the deadline is {DEADLINE_S} s"
        os.kill(reg.pid, signal.SIGCONT)
        stopped = False
        with open(os.path.join(info.path, "big"), "rb") as fh:
            fh.seek(3_000_000)
            assert fh.read(100_000) == data[3_000_000:3_100_000]
        assert e.alive()
    finally:
        if stopped:
            os.kill(reg.pid, signal.SIGCONT)
        stop_registry(reg)


class _SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers; with ``trickle_s``, answers every
    request with a 206 of 100 bytes sent one byte every ``trickle_s`` seconds (each socket read
    is quick, the whole body is not)."""

    def __init__(self, trickle_s: float | None = None) -> None:
        self.trickle_s = trickle_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.host = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            if self.trickle_s is not None:
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n"
                         b"Content-Range: bytes 0-99/1000\r\n\r\n")
            for _ in range(100):
                if self._stop.wait(self.trickle_s):
                    return
                conn.sendall(b"x")
        except OSError:
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self._conns:
            c.close()
        self.sock.close()


@pytest.mark.parametrize("op", ["read_blob", "get_manifest", "blob_size"])
def test_the_remote_store_deadline_is_the_total_across_attempts(op):
    from weenv.registry import RegistryUnavailableError, RemoteStore, RetryPolicy

    server = _SilentServer()
    policy = RetryPolicy(deadline_s=DEADLINE_S)  # per-request timeouts (30 s, 5 s) above the deadline
    store = RemoteStore(server.host, insecure=True, policy=policy)
    digest = "sha256:" + "ab" * 32
    calls = {"read_blob": lambda: store.read_blob("r", digest, 0, 10),
             "get_manifest": lambda: store.get_manifest("r", "v1"),
             "blob_size": lambda: store.blob_size("r", digest)}
    try:
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailableError, match="deadline"):
            calls[op]()
        elapsed = time.monotonic() - t0
        assert elapsed < DEADLINE_S + 0.5, f"{op} gave up after {elapsed:.2f} s, the deadline is {DEADLINE_S} s"
        assert server.accepted >= 1
    finally:
        store.close()
        server.close()


def test_a_body_trickled_byte_by_byte_still_ends_at_the_deadline():
    # every socket read returns within its timeout; only a clock over the whole body stops it
    from weenv.registry import RegistryUnavailableError, RemoteStore, RetryPolicy

    server = _SilentServer(trickle_s=0.1)
    store = RemoteStore(server.host, insecure=True, policy=RetryPolicy(deadline_s=DEADLINE_S))
    try:
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailableError, match="deadline"):
            store.read_blob("r", "sha256:" + "ab" * 32, 0, 100)
        elapsed = time.monotonic() - t0
        assert elapsed < DEADLINE_S + 0.5, f"gave up after {elapsed:.2f} s (10 s of body), the deadline is {DEADLINE_S} s"
    finally:
        store.close()
        server.close()
