"""``weenv serve`` on a node where no daemon runs (after ``weenv daemon stop``, or a reboot): it
starts the daemon, as every other command does, and its ``/health`` says whether the daemon
behind it answers (issue 26 item 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from weenv.api import KeyStore, TemplateStore
from weenv.testing import DaemonHandle, busybox_plan, teardown_private_daemon

from .fixtures_api import _free_port
from .fixtures_common import require_command, require_fuse

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


class _Started:
    """The daemon ``weenv serve`` started: not ours to wait on, so it is stopped with the CLI."""

    def __init__(self, home: str):
        self.home = home

    def poll(self) -> int | None:
        return None if os.path.exists(os.path.join(self.home, "run", "weenv.sock")) else 0

    def send_signal(self, sig: int) -> None:
        subprocess.run([sys.executable, "-m", "weenv", "daemon", "stop", "--kill-envs"], capture_output=True,
                       env={**os.environ, "WEENV_HOME": self.home}, timeout=60)

    def wait(self, timeout: float | None = None) -> int:
        return 0


@pytest.fixture
def no_daemon() -> Iterator[DaemonHandle]:
    """A home with a busybox template and API keys, and no daemon running."""
    require_fuse()
    require_command("crun")
    home = tempfile.mkdtemp(prefix="weenv-serve-daemon-")
    plan, lock = busybox_plan(home)
    handle = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-test-{os.getpid()}-serve", lock, plan,
                          os.path.join(home, "daemon.log"), _Started(home))  # type: ignore[arg-type]
    TemplateStore(os.path.join(home, "api")).set("bb", lock)
    try:
        yield handle
    finally:
        assert not teardown_private_daemon(handle)


def test_serve_starts_the_daemon_and_its_health_says_whether_the_daemon_answers(no_daemon: DaemonHandle) -> None:
    root = KeyStore(os.path.join(no_daemon.home, "api")).create("root", admin=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(no_daemon.home, "serve.log"), "ab")
    env = {**os.environ, "WEENV_HOME": no_daemon.home, "WEENV_AUTOSTART": "1",
           "WEENV_CGROUP_ROOT": no_daemon.cgroup_root}
    proc = subprocess.Popen([sys.executable, "-m", "weenv", "serve", "--listen", f"127.0.0.1:{port}"], env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, open(os.path.join(no_daemon.home, "serve.log")).read()[-3000:]
            try:
                r = httpx.get(url + "/health", timeout=5)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "weenv serve did not come up with its daemon: " + \
                open(os.path.join(no_daemon.home, "serve.log")).read()[-3000:] + \
                (open(no_daemon.log_path).read()[-3000:] if os.path.exists(no_daemon.log_path) else "no daemon log")
            time.sleep(0.1)
        assert r.json() == {"status": "ok", "daemon": "answers"}
        sbx = e2b.Sandbox.create("bb", timeout=60, api_key=root, api_url=url, sandbox_url=url)
        assert sbx.commands.run("echo up").stdout == "up\n"
        sbx.kill()
        subprocess.run([sys.executable, "-m", "weenv", "daemon", "stop", "--kill-envs"], check=True,
                       capture_output=True, env=env, timeout=60)
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["daemon"] == "1 of 1 daemons do not answer"
    finally:
        proc.terminate()
        proc.wait(20)


def test_serve_refuses_to_start_without_a_daemon_it_may_not_start(no_daemon: DaemonHandle) -> None:
    env = {**os.environ, "WEENV_HOME": no_daemon.home, "WEENV_AUTOSTART": "0"}
    out = subprocess.run([sys.executable, "-m", "weenv", "serve", "--listen", f"127.0.0.1:{_free_port()}"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "WEENV_AUTOSTART=0" in out.stderr and "weenv daemon" in out.stderr
