"""A real registry for tests and benchmarks: Debian's docker-registry on 127.0.0.1, plus loopback proxies.

- :func:`start_registry` / :func:`stop_registry`: a registry process (open, or with htpasswd basic
  auth); :class:`RegistryProcess` has ``.host`` ("127.0.0.1:PORT"), ``.url``, ``.storage_dir``.
- :func:`start_proxy` / :func:`stop_proxy`: a proxy in front of a registry that records
  ``(method, path, status)`` and applies the faults a caller schedules
  (``proxy.add_fault(Fault(...))``): 500s, 429 + Retry-After, reset mid-body, a body cut short by a
  clean close, Range answered with 200, slow answers; or that acts as a Bearer-token registry.

Processes are stopped by PID.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ._host import HostUnsupported, require_tool

REGISTRY_BIN = "/usr/bin/docker-registry"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RegistryProcess:
    host: str
    url: str
    storage_dir: str
    log_path: str
    pid: int
    username: str | None = None
    password: str | None = None

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def _write_htpasswd(path: str, username: str, password: str) -> None:
    # docker-registry accepts bcrypt entries only; glibc's crypt(3) makes them (no extra package needed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))  # cost 4: fast checks
    if not hashed or not hashed.startswith("$2"):
        raise HostUnsupported("this libc's crypt(3) cannot make bcrypt hashes for htpasswd")
    with open(path, "w") as f:
        f.write(f"{username}:{hashed}\n")


def start_registry(workdir: str, *, htpasswd: tuple[str, str] | None = None) -> RegistryProcess:
    """Debian's docker-registry on a free 127.0.0.1 port, storing under ``workdir``; stop it with
    :func:`stop_registry`. ``htpasswd=(user, password)`` turns on basic auth."""
    require_tool("docker-registry")
    port = _free_port()
    storage = os.path.join(workdir, "storage")
    os.makedirs(storage)
    auth = ""
    if htpasswd:
        path = os.path.join(workdir, "htpasswd")
        _write_htpasswd(path, *htpasswd)
        auth = f"auth:\n  htpasswd:\n    realm: weenv-test\n    path: {path}\n"
    config = os.path.join(workdir, "config.yml")
    with open(config, "w") as f:
        f.write(
            "version: 0.1\n"
            "log:\n  level: info\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
            "  redirect:\n    disable: true\n"
            f"http:\n  addr: 127.0.0.1:{port}\n"
            + auth
        )
    log_path = os.path.join(workdir, "registry.log")
    logf = open(log_path, "wb")
    proc = subprocess.Popen([REGISTRY_BIN, "serve", config], stdout=logf, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    logf.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited with {proc.returncode}: {open(log_path).read()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        os.kill(proc.pid, signal.SIGKILL)
        raise RuntimeError("docker-registry did not start listening within 15 s")
    reg = RegistryProcess(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}", storage, log_path, proc.pid)
    if htpasswd:
        reg.username, reg.password = htpasswd
    reg._proc = proc  # type: ignore[attr-defined]
    return reg


def stop_registry(reg: RegistryProcess) -> None:
    """SIGTERM the registry (by its PID), SIGKILL after 10 s."""
    proc: subprocess.Popen = reg._proc  # type: ignore[attr-defined]
    if proc.poll() is None:
        os.kill(reg.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(reg.pid, signal.SIGKILL)
            proc.wait()


# ------------------------------------------------------------------------------------- proxies


@dataclass
class Fault:
    """One scheduled misbehaviour, applied to the next ``count`` requests that match."""

    kind: str  # "status" | "reset_mid_body" | "truncate_body" | "ignore_range" | "slow" | "close_before_answer"
    count: int = 1
    status: int = 500
    retry_after: str | None = None
    delay_s: float = 0.0
    method: str | None = None  # only requests with this method
    path_contains: str | None = None  # only paths containing this


@dataclass
class ProxyLog:
    entries: list[tuple[str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, method: str, path: str, status: int) -> None:
        with self.lock:
            self.entries.append((method, path, status))

    def count(self, *methods: str) -> int:
        with self.lock:
            return sum(1 for m, _, _ in self.entries if m in methods)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_ProxyServer"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _take_fault(self) -> Fault | None:
        with self.server.fault_lock:
            for f in self.server.faults:
                if f.count <= 0:
                    continue
                if f.method and f.method != self.command:
                    continue
                if f.path_contains and f.path_contains not in self.path:
                    continue
                f.count -= 1
                return f
        return None

    def _reset(self) -> None:
        # SO_LINGER 0 makes close() send RST: the client sees "connection reset", not a clean EOF
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True

    def _json_answer(self, status: int, payload: bytes, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        self.server.log.add(self.command, self.path, status)

    def _bearer_gate(self) -> bool:
        """With ``server.bearer_token`` set, act as a token-auth registry; True when answered here."""
        token = self.server.bearer_token
        if token is None:
            return False
        if self.path.startswith("/token"):
            self.server.token_requests.append((self.path, self.headers.get("Authorization")))
            if self.server.token_basic and self.headers.get("Authorization") != self.server.token_basic:
                self._json_answer(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]}')
            else:
                self._json_answer(200, ('{"token": "%s", "expires_in": 300}' % token).encode())
            return True
        if self.headers.get("Authorization") != f"Bearer {token}":
            realm = f"{self.server.url}/token"
            self._json_answer(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"token needed"}]}',
                              {"WWW-Authenticate": f'Bearer realm="{realm}",service="weenv-test"'})
            return True
        return False

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if self._bearer_gate():
            return
        fault = self._take_fault()
        if fault and fault.kind == "slow":
            time.sleep(fault.delay_s)
        if fault and fault.kind == "close_before_answer":
            self._reset()
            self.server.log.add(self.command, self.path, 0)
            return
        if fault and fault.kind == "status":
            payload = b'{"errors":[{"code":"UNAVAILABLE","message":"injected"}]}'
            self.send_response(fault.status)
            if fault.retry_after is not None:
                self.send_header("Retry-After", fault.retry_after)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            self.server.log.add(self.command, self.path, fault.status)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP and k.lower() != "host"}
        if self.server.bearer_token is not None:
            headers.pop("Authorization", None)
        if fault and fault.kind == "ignore_range":
            headers = {k: v for k, v in headers.items() if k.lower() != "range"}
        conn = http.client.HTTPConnection(self.server.upstream_host, self.server.upstream_port, timeout=30)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            self.server.log.add(self.command, self.path, resp.status)
            self.send_response_only(resp.status, resp.reason)
            resp_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
            has_length = any(k.lower() == "content-length" for k, _ in resp_headers)
            for k, v in resp_headers:
                if k.lower() == "location" and v.startswith(self.server.upstream_url):
                    v = self.server.url + v[len(self.server.upstream_url):]
                self.send_header(k, v)
            if not has_length and self.command != "HEAD" and resp.status not in (204, 304):
                self.close_connection = True
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command == "HEAD":
                return
            sent = 0
            while True:
                chunk = resp.read(64 << 10)
                if not chunk:
                    break
                if fault and fault.kind == "reset_mid_body" and sent + len(chunk) > 0:
                    half = chunk[: max(1, len(chunk) // 2)]
                    self.wfile.write(half)
                    self.wfile.flush()
                    self._reset()
                    return
                if fault and fault.kind == "truncate_body":  # half the body, then a clean close (FIN)
                    self.wfile.write(chunk[: max(1, len(chunk) // 2)])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(chunk)
                sent += len(chunk)
        finally:
            conn.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _handle


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients hang up mid-answer on purpose here (timeouts, injected resets)

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.upstream_url = f"http://{upstream}"
        self.host = f"127.0.0.1:{self.server_address[1]}"
        self.url = f"http://{self.host}"
        self.log = ProxyLog()
        self.faults: list[Fault] = []
        self.fault_lock = threading.Lock()
        self.bearer_token: str | None = None  # set to require Bearer auth (served by /token)
        self.token_basic: str | None = None  # if set, /token demands this Authorization value
        self.token_requests: list[tuple[str, str | None]] = []


@dataclass
class Proxy:
    host: str
    url: str
    log: ProxyLog
    faults: list[Fault]
    server: _ProxyServer

    def add_fault(self, fault: Fault) -> Fault:
        with self.server.fault_lock:
            self.faults.append(fault)
        return fault


def start_proxy(upstream_host: str) -> Proxy:
    """A proxy on a free 127.0.0.1 port in front of ``upstream_host`` ("HOST:PORT"), served by a thread."""
    server = _ProxyServer(upstream_host)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return Proxy(server.host, server.url, server.log, server.faults, server)


def stop_proxy(proxy: Proxy) -> None:
    proxy.server.shutdown()
    proxy.server.server_close()
