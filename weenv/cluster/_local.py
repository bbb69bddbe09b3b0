"""A Ray cluster of several weenv nodes on one machine, pinned to 127.0.0.1 (tests, benchmarks, trying it out).

Each node is a raylet of ``ray.cluster_utils.Cluster`` whose environment carries its own
``$WEENV_HOME`` and cgroup root, so the node agents find (and start) their daemons exactly as on
real nodes. :meth:`LocalCluster.stop` kills the envs, stops every daemon and envlet, unmounts,
removes the cgroup roots and Ray's processes, and returns what it could not clean: a weenv process
of a node's home still running after all that (found by its ``$WEENV_HOME`` or its arguments,
:func:`home_processes`) is one of those, and is killed.

Ray resolves "127.0.0.1" to the machine's external address for drivers unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is in the environment before Ray is imported: callers set
it (the tests do at import) — :meth:`LocalCluster.start` refuses to run without it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._proc import gone, wait_gone
from ._errors import ClusterError


def _weenv_argv(argv: list[str]) -> bool:
    """``python -m weenv …`` or the ``weenv`` console script."""
    return any((a == "weenv" and i > 0 and argv[i - 1] == "-m") or os.path.basename(a) == "weenv"
               for i, a in enumerate(argv[:3]))


def home_processes(homes: Iterable[str]) -> list[tuple[int, str, str]]:
    """The weenv processes (daemons, envlets, anything ``python -m weenv``) of these homes that still
    run: ``(pid, home, command line)``. A process belongs to a home when its ``$WEENV_HOME`` is that
    home or one of its arguments is a path inside it; other homes' processes (other tests, the
    machine's own daemon) are never listed."""
    wanted = [os.path.abspath(h) for h in homes if h]
    out: list[tuple[int, str, str]] = []
    if not wanted:
        return out
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            if not _weenv_argv(argv):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env_home = next((v[len(b"WEENV_HOME="):].decode(errors="replace") for v in f.read().split(b"\0")
                                 if v.startswith(b"WEENV_HOME=")), None)
        except OSError:  # gone meanwhile
            continue
        for home in wanted:
            if (env_home is not None and os.path.abspath(env_home) == home) or \
                    any(a == home or a.startswith(home + "/") for a in argv):
                if not gone(pid):
                    out.append((pid, home, " ".join(argv)))
                break
    return out


def _kill(pids: Iterable[int], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL for what still runs after ``timeout_s``."""
    pids = list(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if all(wait_gone(pid, timeout_s) for pid in pids):
            return


def stop_node(home: str, cgroup_root: str) -> list[str]:
    """Kill a node's envs, stop its daemon and envlet, unmount, remove its cgroups: what was left.
    A daemon that does not answer on its socket is found by its home and killed."""
    import weenv
    from weenv.envlet import EnvletClient
    from weenv.provision.cgroups import detect_backend

    sock = os.path.join(home, "run", "weenv.sock")
    pid = None
    try:
        with weenv.Client(sock, autostart=False, timeout_s=60) as c:
            pid = c.ping()["pid"]
            for e in c.list():
                try:
                    c.get(e["id"]).kill()
                except Exception:
                    pass
            c.gc()
            c.stop_daemon(kill_envs=True)
    except Exception:
        pass
    if pid is not None and not wait_gone(pid, 20.0):
        os.kill(pid, signal.SIGKILL)
    _kill(p for p, _, cmd in home_processes([home]) if " daemon" in cmd)  # one that did not answer
    try:
        epid = int(EnvletClient(os.path.join(home, "run", "envlet.sock")).ping()["pid"])
        os.kill(epid, signal.SIGTERM)
        wait_gone(epid, 10.0)
    except Exception:
        pass
    subprocess.run(["fusermount3", "-u", "-z", os.path.join(home, "envlet", "mnt")], capture_output=True)
    left = []
    with open("/proc/self/mountinfo") as f:
        left += [f"mount {line.split()[4]}" for line in f if line.split()[4].startswith(home)]
    try:
        detect_backend(cgroup_root).remove_parent()
    except Exception:
        pass
    for hier in ("memory", "cpu", "pids", "freezer", "cpuacct"):
        for dirpath, _, _ in os.walk(f"/sys/fs/cgroup/{hier}"):
            if os.path.basename(dirpath) == cgroup_root:
                left.append(f"cgroup {dirpath}")
    return left


@dataclass
class LocalCluster:
    nodes: int = 3
    cpus_per_node: int = 1
    ray_client_port: int | None = None  # serve Ray client (ray://127.0.0.1:PORT) from the head; needs ray[client]
    base: str = ""
    homes: list[str] = field(default_factory=list)
    cgroup_roots: list[str] = field(default_factory=list)
    ray_cluster: Any = None
    _old_tmp: str | None = None

    def start(self) -> "LocalCluster":
        if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
            raise ClusterError("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing Ray: without it Ray "
                               "resolves 127.0.0.1 to the machine's external address")
        import ray
        from ray.cluster_utils import Cluster as RayCluster

        self.base = tempfile.mkdtemp(prefix="wct-")
        tag = secrets.token_hex(3)
        self.homes = [os.path.join(self.base, f"n{i}") for i in range(self.nodes)]
        self.cgroup_roots = [f"weenv-ct{tag}-{i}" for i in range(self.nodes)]
        self._old_tmp = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.base  # Ray's session files and address file, not /tmp/ray

        def node_args(i: int) -> dict[str, Any]:
            return {"node_ip_address": "127.0.0.1", "num_cpus": self.cpus_per_node, "object_store_memory": 80 << 20,
                    "env_vars": {"WEENV_HOME": self.homes[i], "WEENV_CGROUP_ROOT": self.cgroup_roots[i],
                                 "WEENV_AUTOSTART": "0"}}

        head = {**node_args(0), "include_dashboard": False}
        if self.ray_client_port is not None:
            from ._cluster import require_ray_client

            require_ray_client("LocalCluster(ray_client_port=...)")
            head["ray_client_server_port"] = self.ray_client_port  # on node_ip_address: 127.0.0.1
        try:
            self.ray_cluster = RayCluster(initialize_head=True, head_node_args=head)
            for i in range(1, self.nodes):  # the worker nodes start side by side
                self.ray_cluster.add_node(wait=False, **node_args(i))
            self.ray_cluster.wait_for_nodes(timeout=120)
            ray.init(address=self.ray_cluster.address, _node_ip_address="127.0.0.1", namespace="weenv",
                     include_dashboard=False, log_to_driver=False)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> list[str]:
        left: list[str] = []
        for home, root in zip(self.homes, self.cgroup_roots):
            left += stop_node(home, root)
        try:
            import ray

            ray.shutdown()
        except Exception:
            pass
        if self.ray_cluster is not None:
            self.ray_cluster.shutdown()
            self.ray_cluster = None
        stray = home_processes(self.homes)  # nothing of weenv may outlive the Ray cluster (issue 26 item 5)
        left += [f"process {pid} of home {home} outlived Ray: {cmd}" for pid, home, cmd in stray]
        _kill(pid for pid, _, _ in stray)
        if self._old_tmp is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._old_tmp
        if self.base:
            shutil.rmtree(self.base, ignore_errors=True)
        return left

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
