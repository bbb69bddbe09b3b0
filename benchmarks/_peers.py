"""Docker and podman beside weenv: each with private state, running the weenv benchmark's own busybox tree.

    with peers(tree, report) as ps:      # {"docker": Peer, "podman": Peer}, those that run here
        ps["docker"].run("echo", "hi")

- **docker**: Debian's ``dockerd`` (docker.io 20.10, runc, overlay2) started by
  :func:`weenv.testing.start_dockerd` (the recipe the tests use): private data root, exec root,
  socket and cgroup parent, ``--bridge=none --iptables=false``, no IP forwarding. The CLI is
  Debian's ``/usr/bin/docker`` against that socket.
- **podman**: Debian's ``podman`` (4.3, crun) with every state dir under one temp dir (``--root``,
  ``--runroot``, ``--tmpdir``, ``--network-config-dir``), ``--cgroup-manager=cgroupfs`` with a cgroup
  parent of its own, ``--events-backend=file``.

Both import the same tree as an image (``tar -c | X import -``): nothing comes from Docker Hub or any
registry, and every container runs with ``--network none``.

Two facts of this host that podman trips on are found by trying a run, not assumed (the way it ran
is in :attr:`Peer.how`):

- crun refuses a hybrid cgroup host whose cgroup2 mount holds controllers ("cgroups in hybrid mode
  not supported"): podman then runs in a private mount namespace without that mount, entered by the
  child before exec (the recipe weenv's runtime uses, :func:`private_mount_ns_recipe`);
- podman asks crun for RLIMIT_NOFILE/NPROC at or above the limits it was given, which needs
  CAP_SYS_RESOURCE (dropped here) ("setrlimit ... Operation not permitted"): it then runs with
  ``--ulimit nofile=1024:1024 --ulimit nproc=1024:1024``.

A peer that cannot run is left out, with the reason in the report's notes and printed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

from weenv.provision.runtime._hostcheck import detect_host, private_mount_ns_recipe
from weenv.testing import HostUnsupported, start_dockerd, stop_dockerd
from weenv.testing._docker import DOCKER, remove_private_state

from ._util import Report

IMAGE = "weenv-bench/busybox:1"
PODMAN = "/usr/bin/podman"
PODMAN_ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


class PeerUnavailable(Exception):
    """This peer cannot run on this host; the message says why."""


class Peer:
    """One container engine with a private state and the benchmark's image imported."""

    name: str
    version: str = ""
    how: str = ""
    run_args: tuple[str, ...] = ()  # what every ``run`` gets on top of ``--rm --network none``

    def cli(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess:
        raise NotImplementedError

    def run(self, *cmd: str, detach: bool = False, image: str = IMAGE) -> str:
        """``X run --rm --network none IMAGE CMD`` (``-d`` instead of ``--rm`` when ``detach``): its stdout."""
        mode = ("-d",) if detach else ("--rm",)
        return self.cli("run", *mode, "--network", "none", *self.run_args, image, *cmd).stdout

    def cli_stdin(self, *args: str, stdin) -> None:  # type: ignore[no-untyped-def]
        """``X ARGS`` reading ``stdin`` (a pipe), checked."""
        raise NotImplementedError

    def close(self) -> list[str]:
        """Stop it and remove everything it made; returns what could not be removed."""
        raise NotImplementedError


def _import(peer: Peer, tree: str) -> None:
    tar = subprocess.Popen(["tar", "-C", tree, "-c", "."], stdout=subprocess.PIPE)
    try:
        peer.cli_stdin("import", "-", IMAGE, stdin=tar.stdout)
    finally:
        tar.stdout.close()  # type: ignore[union-attr]
        tar.wait()


class DockerPeer(Peer):
    name = "docker"

    def __init__(self, tree: str) -> None:
        try:
            self.d = start_dockerd()
        except (HostUnsupported, AssertionError) as e:
            raise PeerUnavailable(str(e)) from e
        try:
            self.version = self.cli("version", "--format",
                                    "client {{.Client.Version}}, server {{.Server.Version}}").stdout.strip()
            runtime = self.cli("info", "--format", "{{.DefaultRuntime}} {{.Driver}} cgroup {{.CgroupVersion}}").stdout
            runc = versions().get("runc", "runc")
            self.how = (f"a private dockerd ({runtime.strip()}; {runc}): --data-root, --exec-root, pidfile, config "
                        "and -H unix:// socket under a temp dir, its own --cgroup-parent, --bridge=none "
                        "--iptables=false --ip-forward=false; Debian's CLI against that socket")
            _import(self, tree)
            if self.run("echo", "hi").strip() != "hi":
                raise PeerUnavailable("docker run of the imported image did not print hi")
        except BaseException:
            self.close()
            raise

    def cli(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return self.d.cli(*args, check=check, timeout_s=timeout_s)

    def cli_stdin(self, *args: str, stdin) -> None:  # type: ignore[no-untyped-def]
        env = {**os.environ, "DOCKER_CONFIG": os.path.join(self.d.root, "config")}
        subprocess.run([DOCKER, "-H", f"unix://{self.d.sock}", *args], stdin=stdin, env=env, check=True,
                       capture_output=True, timeout=300)

    def close(self) -> list[str]:
        return stop_dockerd(self.d)


class PodmanPeer(Peer):
    name = "podman"

    def __init__(self, tree: str) -> None:
        if os.geteuid() != 0:
            raise PeerUnavailable(f"runs podman rootful: this host runs benchmarks as uid {os.geteuid()}")
        if not os.access(PODMAN, os.X_OK):
            raise PeerUnavailable(f"needs Debian's podman ({PODMAN} is missing; apt-get install podman)")
        self.root = tempfile.mkdtemp(prefix="weenv-podman-")
        self.cgroup_parent = f"weenv-podman-{os.getpid()}-{os.path.basename(self.root)[-8:]}"
        self.base = [PODMAN, "--root", f"{self.root}/root", "--runroot", f"{self.root}/runroot",
                     "--tmpdir", f"{self.root}/tmp", "--network-config-dir", f"{self.root}/net",
                     "--cgroup-manager=cgroupfs", "--events-backend=file", "--storage-driver=overlay"]
        self.pre: Callable[[], None] | None = None
        # podman makes /run/containers/networks whatever its flags say: removed at the end if it made it
        self.made_run_dirs = [d for d in ("/run/containers", "/run/libpod") if not os.path.exists(d)]
        self.run_args = ("--cgroup-parent", f"/{self.cgroup_parent}")
        try:
            self.version = self.cli("version", "--format", "{{.Client.Version}}").stdout.strip()
            _import(self, tree)
            self._find_how()
        except BaseException:
            self.close()
            raise

    def _find_how(self) -> None:
        """Try a run; on each refusal this host is known for, add its way around and try again."""
        ways: list[str] = []
        host = detect_host()
        for _ in range(3):
            p = self.cli("run", "--rm", "--network", "none", *self.run_args, IMAGE, "echo", "hi", check=False)
            if p.returncode == 0 and p.stdout.strip() == "hi":
                self.how = (f"rootful podman with {versions().get('crun', 'crun')}: --root, --runroot, --tmpdir and "
                            "--network-config-dir under a temp dir, --cgroup-manager=cgroupfs with its own "
                            "--cgroup-parent, --events-backend=file, --storage-driver=overlay"
                            + ("; " + "; ".join(ways) if ways else ""))
                return
            err = p.stderr
            if "hybrid mode not supported" in err and self.pre is None and host.unified_mount:
                self.pre = private_mount_ns_recipe(host.unified_mount)
                ways.append(f"in a private mount namespace without {host.unified_mount} (crun refuses hybrid "
                            f"cgroups; cgroup2 holds {', '.join(host.unified_controllers)})")
            elif "setrlimit" in err and PODMAN_ULIMITS[0] not in self.run_args:
                self.run_args = (*self.run_args, *PODMAN_ULIMITS)
                ways.append("with " + " ".join(PODMAN_ULIMITS) + " (crun may not set podman's default rlimits "
                            "without CAP_SYS_RESOURCE)")
            else:
                raise PeerUnavailable(f"podman run fails: {err.strip()[-500:]}")
        raise PeerUnavailable(f"podman run still fails after {ways}: {err.strip()[-500:]}")

    def cli(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess:
        p = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout_s,
                           preexec_fn=self.pre, stdin=subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({p.returncode}): {p.stderr[-3000:]}")
        return p

    def cli_stdin(self, *args: str, stdin) -> None:  # type: ignore[no-untyped-def]
        subprocess.run([*self.base, *args], stdin=stdin, check=True, capture_output=True, timeout=300,
                       preexec_fn=self.pre)

    def close(self) -> list[str]:
        left: list[str] = []
        if os.path.isdir(os.path.join(self.root, "root")):
            for args in (("rm", "-af", "-t", "0"), ("rmi", "-af"), ("system", "reset", "-f")):
                p = self.cli(*args, check=False, timeout_s=120)
                if p.returncode != 0:
                    left.append(f"podman {' '.join(args)}: {p.stderr.strip()[-300:]}")
        return left + remove_private_state(self.root, self.cgroup_parent, self.made_run_dirs)


PEERS: dict[str, type[Peer]] = {"docker": DockerPeer, "podman": PodmanPeer}


@contextlib.contextmanager
def peers(tree: str, report: Report, names: tuple[str, ...] = ("docker", "podman")) -> Iterator[dict[str, Peer]]:
    """The peers that run on this host, each with ``tree`` imported as :data:`IMAGE`; the others are
    named in ``report.notes`` with why. Everything they made is removed at the end (leaks are noted)."""
    running: dict[str, Peer] = {}
    try:
        for name in names:
            try:
                running[name] = PEERS[name](tree)
            except PeerUnavailable as e:
                msg = f"{name} skipped: {e}"
                print(msg, file=sys.stderr)
                report.notes.append(msg)
        for p in running.values():
            report.peers[p.name] = {"version": p.version, "how": p.how}
            report.notes.append(f"peer {p.name} {p.version}: {p.how}")
        yield running
    finally:
        for p in running.values():
            left = p.close()
            if left:
                report.notes.append(f"LEAKS ({p.name}): {left}")
                print(f"{p.name} left: {left}", file=sys.stderr)


def versions() -> dict[str, str]:
    """The installed versions of the peers and of crun (for the docs), without starting anything."""
    out = {}
    for name, cmd in (("docker", [DOCKER, "--version"]), ("dockerd", ["/usr/sbin/dockerd", "--version"]),
                      ("podman", [PODMAN, "--version"]), ("crun", [shutil.which("crun") or "crun", "--version"]),
                      ("runc", [shutil.which("runc") or "runc", "--version"])):
        try:
            out[name] = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.splitlines()[0].strip()
        except (OSError, IndexError, subprocess.TimeoutExpired):
            out[name] = "not installed"
    return out


__all__ = ["IMAGE", "Peer", "PeerUnavailable", "peers", "versions"]
