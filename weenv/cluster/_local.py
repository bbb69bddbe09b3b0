"""A Ray cluster of several weenv nodes on one machine, pinned to 127.0.0.1 (tests, benchmarks, trying it out).

Each node is a raylet of ``ray.cluster_utils.Cluster`` whose environment carries its own
``$WEENV_HOME`` and cgroup root, so the node agents find (and start) their daemons exactly as on
real nodes. :meth:`LocalCluster.stop` kills the envs, stops every daemon and envlet, unmounts,
removes the cgroup roots and Ray's processes, and returns what it could not clean.

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
from dataclasses import dataclass, field
from typing import Any

from .._proc import wait_gone
from ._errors import ClusterError


def stop_node(home: str, cgroup_root: str) -> list[str]:
    """Kill a node's envs, stop its daemon and envlet, unmount, remove its cgroups: what was left."""
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
            c._request("POST", "/v1/daemon/stop", json={"kill_envs": True})
    except Exception:
        pass
    if pid is not None and not wait_gone(pid, 20.0):
        os.kill(pid, signal.SIGKILL)
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
            for i in range(1, self.nodes):
                self.ray_cluster.add_node(**node_args(i))
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
