"""Escape attempts from an env's root, on the real daemon (crun, the in-env agent, v1 cgroups).

Each test states the promise it checks and fails if the attempt succeeds. The probe
(weenv/testing/escape_probe.c, static) is first run on the host against a process nothing protects, where
its attempts do succeed: a probe broken for its own reasons cannot make these tests pass.
See docs/security.md for the threat model and the layer each test covers.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from weenv.testing import PROBE_SOURCE, attempts

from .fixtures_daemon import wait_for

pytestmark = pytest.mark.integration

#: Execs checked per run in the suite; benchmarks/exec_hijack.py runs 1000 once.
HIJACK_EXECS = 100


@pytest.fixture(scope="session")
def escape_probe(tmp_path_factory) -> str:
    """The probe, built static for this session (a second or so)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc with static libc (libc6-dev) to build the escape probe")
    out = str(tmp_path_factory.mktemp("probe") / "probe")
    r = subprocess.run(["gcc", "-static", "-O1", "-o", out, PROBE_SOURCE], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot build a static probe here: {r.stderr[-500:]}")
    return out


def _forged_reply(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(5)
        c.connect(path)
        c.sendall(b"R\0\0\0\0")
        data = b""
        while b"X\0\0\0\x010" not in data:
            got = c.recv(4096)
            if not got:
                break
            data += got
        return data


def test_control_the_probe_hijacks_a_process_nothing_protects(escape_probe, tmp_path):
    # A dumpable process of the same uid holding a listening socket, as the agent was before
    # issue 16: the probe steals the socket and answers in its place.
    path = str(tmp_path / "victim.sock")
    victim = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        f"s = socket.socket(socket.AF_UNIX); s.bind({path!r}); s.listen(); print('up', flush=True); time.sleep(30)\n"
    )], stdout=subprocess.PIPE)
    try:
        assert victim.stdout.readline() == b"up\n"
        probe = subprocess.Popen([escape_probe, "hijack", str(victim.pid), "5"], stdout=subprocess.PIPE, text=True)
        try:
            lines = []
            for line in probe.stdout:
                lines.append(line)
                if line.startswith("serving"):
                    break
            got = attempts("".join(lines))
            assert got["pidfd_getfd"] == "SUCCEEDED" and got["open /proc/PID/mem read-write"] == "SUCCEEDED", lines
            assert got["read /proc/PID/fd links"] == "SUCCEEDED" and got["ptrace(PTRACE_ATTACH)"] == "SUCCEEDED", lines
            assert b"HIJACKED: 42 passed" in _forged_reply(path)
        finally:
            probe.kill()
            probe.wait()
    finally:
        victim.kill()
        victim.wait()


def test_exec_results_cannot_be_forged_by_env_root(daemon, escape_probe):
    # Promise (issue 16 item 2): env root cannot steal the agent's socket, read or write its
    # memory, ptrace it, replace it or answer in its place; every exec returns what really ran.
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        with open(escape_probe, "rb") as f:
            env.write_file("/tmp/probe", f.read(), mode=0o755)
        host_socket = os.path.join(os.path.dirname(env.info["rootfs"]), "agent.sock")
        assert os.path.exists(host_socket)
        r = env.exec(["sh", "-c", f"/tmp/probe hijack 1 60 {host_socket} >/tmp/probe.log 2>&1 &"])
        assert r.exit_code == 0, r
        assert wait_for(lambda: b"serving" in env.read_file("/tmp/probe.log"), timeout_s=10)
        forged = []
        for _ in range(HIJACK_EXECS):
            r = env.exec(["sh", "-c", "echo REAL; exit 3"])
            if (r.exit_code, r.stdout) != (3, b"REAL\n"):
                forged.append((r.exit_code, r.stdout))
        log = env.read_file("/tmp/probe.log").decode()
        assert forged == [], f"{len(forged)} of {HIJACK_EXECS} execs forged: {forged[:3]}\n{log}"
        assert "answered a connection" not in log, log
        got = attempts(log)
        # The in-env bind works but binds the env's own file system; nothing else may succeed.
        assert {k for k, v in got.items() if v == "SUCCEEDED"} <= {
            "pidfd_open", "bind the agent socket path"}, log
        # Layers: seccomp denies pidfd_getfd, ptrace and process_vm_*; the agent being undumpable
        # closes /proc/1/mem, /proc/1/fd/* and /proc/1/environ (open is not filtered: this is the
        # kernel's ptrace access check); the socket's host path does not exist inside the env.
        assert got["pidfd_getfd"] == "Operation not permitted", log
        assert got["ptrace(PTRACE_ATTACH)"] == got["process_vm_writev"] == "Operation not permitted", log
        for what in ("open /proc/PID/mem read-write", "read /proc/PID/fd links", "open /proc/PID/environ"):
            assert got[what] == "Permission denied", (what, log)
        assert got["connect to the agent socket path"] == "No such file or directory", log


def test_env_root_cannot_kill_or_stop_the_agent(daemon, escape_probe):
    # Promise: signals from inside the env neither stop the agent nor end the env (only the
    # host stops it); execs keep working after the attempt.
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        with open(escape_probe, "rb") as f:
            env.write_file("/tmp/probe", f.read(), mode=0o755)
        r = env.exec(["/tmp/probe", "kill", "1"])
        assert "stop or kill the target: failed" in r.stdout.decode(), r
        time.sleep(0.2)
        r = env.exec(["sh", "-c", "echo REAL; exit 3"])
        assert (r.exit_code, r.stdout) == (3, b"REAL\n"), r
        assert c.get(env.id).info["status"] == "running"
