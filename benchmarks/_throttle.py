"""A loopback TCP proxy that limits bandwidth and adds latency, so registry benchmarks see a network.

All connections share one token bucket for the registry→client direction (a link, not a per-flow
limit); every client→registry write is delayed by ``latency_s`` (so each request pays one added
round trip).
"""

from __future__ import annotations

import select
import socket
import threading
import time


class TokenBucket:
    def __init__(self, rate_bytes_s: float, burst_bytes: int):
        self.rate = rate_bytes_s
        self.burst = burst_bytes
        self.tokens = float(burst_bytes)
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
                self.last = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
            time.sleep(wait)


class ThrottleProxy:
    """``rate_bytes_s=None`` relays at full speed (still through one extra hop, like the others)."""

    def __init__(self, upstream: str, *, rate_bytes_s: float | None = None, latency_s: float = 0.0):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.latency_s = latency_s
        self.bucket = TokenBucket(rate_bytes_s, max(65536, int(rate_bytes_s / 200))) if rate_bytes_s else None
        self.bytes_down = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.host = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            r, _, _ = select.select([self._sock], [], [], 0.1)
            if not r:
                continue
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = threading.Thread(target=self._pump_up, args=(client, upstream), daemon=True)
        t.start()
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                if self.bucket is not None:
                    self.bucket.take(len(data))
                client.sendall(data)
                with self._lock:
                    self.bytes_down += len(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _pump_up(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                with self._lock:
                    self.requests += 1
                if self.latency_s:
                    time.sleep(self.latency_s)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            try:
                upstream.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_down = 0
            self.requests = 0

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)

    def __enter__(self) -> "ThrottleProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
