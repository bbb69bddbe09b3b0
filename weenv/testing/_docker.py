"""A private Docker (Debian's dockerd, docker.io 20.10) for tests and benchmarks: an image
producer and the baseline every intake benchmark measures against.

:func:`start_dockerd` starts ``dockerd`` with a private ``--data-root``, ``--exec-root``, pidfile,
trust key, config file, cgroup parent and ``unix://`` socket; no bridge, no iptables, no IP
forwarding, no masquerade: it never touches the host's network. ``Dockerd.cli(*args)`` runs
Debian's CLI (``/usr/bin/docker``; ``/usr/local/bin/docker`` may be a newer one) against that
socket. :func:`stop_dockerd` removes its containers, stops it by PID and removes its mounts,
cgroups, files and the empty state dirs it made in /run; it returns what it could not remove.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from ._host import HostUnsupported

DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"  # Debian's CLI, the daemon's own version


@dataclass
class Dockerd:
    """A running private dockerd; ``root`` holds everything it writes."""

    root: str
    proc: subprocess.Popen
    cgroup_parent: str
    made_run_dirs: list[str] = field(default_factory=list)  # /run dirs dockerd/containerd make, absent before

    @property
    def sock(self) -> str:
        return os.path.join(self.root, "docker.sock")

    @property
    def log_path(self) -> str:
        return os.path.join(self.root, "dockerd.log")

    def cli(self, *args: str, check: bool = True, timeout_s: float = 900, cwd: str | None = None,
            stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
        env = {**os.environ, "DOCKER_CONFIG": os.path.join(self.root, "config"), "DOCKER_BUILDKIT": "0"}
        for k in ("DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"):
            env.pop(k, None)
        p = subprocess.run([DOCKER, "-H", f"unix://{self.sock}", *args], env=env, cwd=cwd, stdout=stdout,
                           stderr=subprocess.PIPE, text=True, timeout=timeout_s)
        if check and p.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed ({p.returncode}): {p.stderr[-3000:]}")
        return p

    def export(self, image: str) -> subprocess.Popen:
        """``docker create`` + ``docker export``: the image's tree as Docker itself lays it out, as a
        tar stream (``.stdout``); the caller waits for the process (the container is removed with
        dockerd's other containers at the end)."""
        cid = self.cli("create", image, "/bin/true").stdout.strip()
        env = {**os.environ, "DOCKER_CONFIG": os.path.join(self.root, "config")}
        return subprocess.Popen([DOCKER, "-H", f"unix://{self.sock}", "export", cid], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def _cgroup_hierarchies() -> list[str]:
    base = "/sys/fs/cgroup"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    if os.path.exists(os.path.join(base, "cgroup.controllers")):
        return [base]  # cgroup v2
    return [os.path.join(base, n) for n in names if os.path.isdir(os.path.join(base, n))
            and not os.path.islink(os.path.join(base, n))]


def _mounts_under(root: str) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].encode().decode("unicode_escape")  # \040 and friends
            if target == root or target.startswith(root + "/"):
                out.append(target)
    return out


def _session_pids(sid: int) -> list[int]:
    """Processes in session ``sid`` (dockerd's: it and the containerd it starts)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            pids.append(int(name))
    return pids


def start_dockerd(timeout_s: float = 60) -> Dockerd:
    """Start a private dockerd; :class:`HostUnsupported` when docker.io is missing or dockerd cannot
    run on this host (it exits at start: the reason is its log's last lines)."""
    if os.geteuid() != 0:
        raise HostUnsupported(f"needs root to run dockerd: this host runs the tests as uid {os.geteuid()}")
    for path in (DOCKERD, DOCKER):
        if not os.access(path, os.X_OK):
            raise HostUnsupported(f"needs Debian's docker.io ({path} is missing; apt-get install docker.io)")
    root = tempfile.mkdtemp(prefix="weenv-dockerd-")
    made = [d for d in ("/run/docker", "/run/containerd") if not os.path.exists(d)]
    with open(os.path.join(root, "daemon.json"), "w") as f:
        # not the host's /etc/docker/daemon.json; the trust key dockerd would write to /etc/docker
        json.dump({"deprecated-key-path": os.path.join(root, "key.json")}, f)
    os.makedirs(os.path.join(root, "config"))
    cgroup_parent = f"weenv-dockerd-{os.getpid()}-{os.path.basename(root)[-8:]}"
    cmd = [DOCKERD, "--iptables=false", "--ip6tables=false", "--bridge=none", "--ip-forward=false",
           "--ip-masq=false", "--userland-proxy=false",
           f"--data-root={root}/data", f"--exec-root={root}/exec", f"--pidfile={root}/dockerd.pid",
           f"--config-file={root}/daemon.json",
           f"--cgroup-parent=/{cgroup_parent}", "-H", f"unix://{root}/docker.sock"]
    log = open(os.path.join(root, "dockerd.log"), "wb")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    d = Dockerd(root, proc, cgroup_parent, made)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = d.log()[-1500:]
            stop_dockerd(d)
            raise HostUnsupported(f"dockerd cannot run on this host (exit {proc.returncode}): {tail}")
        if os.path.exists(d.sock) and d.cli("version", "--format", "{{.Server.Version}}", check=False,
                                            timeout_s=10).returncode == 0:
            return d
        if time.monotonic() > deadline:
            tail = d.log()[-1500:]
            stop_dockerd(d)
            raise AssertionError(f"dockerd did not answer within {timeout_s} s: {tail}")
        time.sleep(0.2)


def stop_dockerd(d: Dockerd) -> list[str]:
    """Remove containers, stop dockerd by PID, remove what it made; returns what could not be removed."""
    if d.proc.poll() is None:
        ids = d.cli("ps", "-aq", check=False, timeout_s=30).stdout.split()
        if ids:
            d.cli("rm", "-f", *ids, check=False, timeout_s=120)
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait(timeout=30)
    left: list[str] = []
    for _ in range(50):  # the containerd dockerd started stops with it
        pids = _session_pids(d.proc.pid)
        if not pids:
            break
        time.sleep(0.1)
    for pid in _session_pids(d.proc.pid):
        left.append(f"process {pid}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left += remove_private_state(d.root, d.cgroup_parent, d.made_run_dirs)
    return left


def remove_private_state(root: str, cgroup_parent: str, made_run_dirs: list[str]) -> list[str]:
    """What a private container engine (dockerd, podman) left once it stopped: mounts under ``root``
    unmounted (the engine unmounts its own: one still there is a leak), its cgroup parent removed,
    the run directories it made removed if empty (another engine may use them meanwhile), ``root``
    removed. What could not go, as lines."""
    left = []
    for target in sorted(_mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
        left.append(f"mount {target}")
    for hier in _cgroup_hierarchies():
        top = os.path.join(hier, cgroup_parent)
        if not os.path.isdir(top):
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda x: -len(x[0])):
            try:
                os.rmdir(dirpath)
            except OSError as e:
                left.append(f"cgroup {dirpath}: {e.strerror}")
    for made in made_run_dirs:
        for dirpath, _, _ in sorted(os.walk(made), key=lambda x: -len(x[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    subprocess.run(["rm", "-rf", "--one-file-system", root], capture_output=True)
    if os.path.exists(root):
        left.append(f"directory {root}")
    return left


__all__ = ["DOCKER", "DOCKERD", "Dockerd", "remove_private_state", "start_dockerd", "stop_dockerd"]
