"""Starting and stopping an envlet as its own process (the daemon and the tests use this)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from ._control import EnvletClient
from ._errors import EnvletUnavailableError
from ._server import clear_stale_mount


class EnvletProcess:
    """One envlet process. It runs in its own session, so the caller dying does not take it along."""

    def __init__(self, mountpoint: str, cache_dir: str, control_socket: str, *, cache_size_bytes: int = 10 << 30,
                 memory_cache_size_bytes: int = 256 << 20, deadline_s: float = 30.0, state_file: str | None = None,
                 log_path: str | None = None, readahead_bytes: int | None = None, neighbor_bytes: int | None = None,
                 metrics_port: int | None = None, tiers: "Sequence[str] | None" = None, id_base: int = 0,
                 fair: bool | None = None, fair_share_cores: float | None = None, env_cgroup: str | None = None,
                 tier_options: "dict[str, str] | None" = None):
        self.mountpoint = mountpoint
        self.cache_dir = cache_dir
        self.control_socket = control_socket
        self.args = [
            "--mountpoint", mountpoint, "--cache-dir", cache_dir, "--control-socket", control_socket,
            "--cache-size", str(cache_size_bytes), "--memory-cache-size", str(memory_cache_size_bytes),
            "--deadline", str(deadline_s),
        ]
        if state_file:
            self.args += ["--state-file", state_file]
        if readahead_bytes is not None:
            self.args += ["--readahead", str(readahead_bytes)]
        if neighbor_bytes is not None:
            self.args += ["--neighbors", str(neighbor_bytes)]
        if metrics_port:
            self.args += ["--metrics-port", str(metrics_port)]
        if tiers is not None:
            self.args += ["--tiers", ",".join(tiers)]
        for key, value in (tier_options or {}).items():
            self.args += ["--tier-option", f"{key}={value}"]
        if id_base:
            self.args += ["--id-base", str(id_base)]
        if fair is not None:
            self.args += ["--fair" if fair else "--no-fair"]
        if fair_share_cores is not None:
            self.args += ["--fair-share", str(fair_share_cores)]
        if env_cgroup is not None:
            self.args += ["--env-cgroup", env_cgroup]
        self.log_path = log_path or os.path.join(cache_dir, "envlet.log")
        self.proc: subprocess.Popen | None = None
        self.client = EnvletClient(control_socket)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 20.0) -> "EnvletProcess":
        os.makedirs(self.cache_dir, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weenv", "envlet", "serve", *self.args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        finally:
            log.close()
        try:
            self.client.wait_ready(timeout_s, pid=self.proc.pid)
        except EnvletUnavailableError:
            self.kill()
            raise EnvletUnavailableError(f"envlet did not start; last log lines:\n{self.log_tail()}") from None
        return self

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (the envlet unmounts), then SIGKILL and a lazy unmount if it does not exit in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self.proc = None
        clear_stale_mount(self.mountpoint)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the mount is left stale on purpose until someone clears it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "EnvletProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        clear_stale_mount(self.mountpoint)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.path.ismount(self.mountpoint):
            time.sleep(0.05)
