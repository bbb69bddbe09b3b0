"""``weenv serve`` on 127.0.0.1 (a random port) in front of the session's real daemon, with three
API keys (alice, bob, and an admin) and the template ``bb`` (the busybox lock)."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from weenv.testing import DaemonHandle


@dataclass
class Served:
    url: str
    home: str
    keys: dict[str, str]
    daemon: DaemonHandle
    log_path: str
    proc: subprocess.Popen  # type: ignore[type-arg]

    def e2b_env(self, key: str = "alice") -> dict[str, str]:
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.keys[key],
                "E2B_DOMAIN": "weenv.test"}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def weenv_serve(weenv_daemon: DaemonHandle) -> Iterator[Served]:
    from weenv.api import KeyStore, TemplateStore

    api_dir = os.path.join(weenv_daemon.home, "api")
    store = KeyStore(api_dir)
    keys = {}
    for name, admin in (("alice", False), ("bob", False), ("root", True)):
        if any(k.name == name for k in store.list()):
            store.revoke(name)
        keys[name] = store.create(name, admin=admin)
    TemplateStore(api_dir).set("bb", weenv_daemon.plan_lock)
    served = start_serve(weenv_daemon, keys)
    try:
        yield served
    finally:
        stop_serve(served)


def start_serve(weenv_daemon: DaemonHandle, keys: dict[str, str], *, tls: tuple[str, str] | None = None,
                ca: str | None = None, args: list[str] | None = None, env: dict[str, str] | None = None) -> Served:
    """A ``weenv serve`` process on a free port of 127.0.0.1, once it answers (``tls``: cert and key
    files, ``ca``: what signed the cert; ``args``: more options; ``env``: more variables)."""
    port = _free_port()
    log_path = os.path.join(weenv_daemon.home, "serve.log")
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "weenv", "serve", "--listen", f"127.0.0.1:{port}",
                             "--socket", weenv_daemon.socket, "--domain", "weenv.test",
                             *(["--tls-cert", tls[0], "--tls-key", tls[1]] if tls else []), *(args or [])],
                            env={**weenv_daemon.env_vars(), **(env or {})}, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=log, start_new_session=True)
    log.close()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    served = Served(url, weenv_daemon.home, keys, weenv_daemon, log_path, proc)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weenv serve exited with {proc.returncode}:\n{served.log()[-3000:]}")
        try:
            if httpx.get(url + "/v1/ping", headers={"Authorization": f"Bearer {keys['root']}"}, timeout=2,
                         verify=ssl.create_default_context(cafile=ca or tls[0]) if tls else True).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"weenv serve did not answer within 30 s:\n{served.log()[-3000:]}")
        time.sleep(0.05)
    return served


def stop_serve(served: Served) -> None:
    served.proc.send_signal(signal.SIGINT)
    try:
        served.proc.wait(10)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait()


@pytest.fixture
def served(weenv_serve: Served, daemon: DaemonHandle, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The server, with the E2B SDK's environment pointed at it (as alice); envs cleaned after the test."""
    for k, v in weenv_serve.e2b_env().items():
        monkeypatch.setenv(k, v)
    yield weenv_serve
