"""The node agent: one Ray actor per Ray node, in front of that node's weenv daemon.

It runs on its node (hard node affinity), so everything it touches is local: it starts the
node's daemon or attaches to the one that answers on ``$WEENV_HOME/run/weenv.sock`` (the home is
the Ray node's own environment: ``WEENV_HOME=/tmp/n2 ray start --address …``), forwards API calls
to it, and keeps a fresh :class:`~weenv.cluster.NodeReport` (refreshed every ``report_interval_s``
by a thread of its own, so a report call never waits on the daemon).

Every call but :meth:`NodeAgent.hello` carries the cluster token; the agent compares it (as a
SHA-256 digest, in constant time) with the node's own (``$WEENV_CLUSTER_TOKEN`` or
``$WEENV_HOME/cluster.token``) or, without one, the token of whoever created the agent.

This module imports Ray only inside :func:`agent_class` and the runtime-context lookup: the class
itself is a plain object (Ray wraps it), and unit tests drive it without a cluster.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

import httpx
import msgspec

from .. import _home
from .._atomic import atomic_writer
from .._tls import uds_transport
from ._errors import ClusterAuthError, ClusterError
from ._report import Capacity, LayerHeld, NodeReport, capacity_from_top, envs_from, snapshots_from, volumes_from

log = logging.getLogger("weenv.cluster")

ANN_SNAPSHOT_LOCK = "dev.weenv.snapshot.lock"  # on a published snapshot's top manifest: the lock to start it (_published.py)
AGENT_NAMESPACE = "weenv"
_MAX_SEEN = 4096


def agent_name(ray_node_id: str) -> str:
    """The agent's Ray actor name: one per Ray node, named from its id (get-or-create)."""
    return f"weenv-agent-{ray_node_id[:16]}"


def node_name_for(ray_node_id: str) -> str:
    """The node's short name (env ids start with it): ``n`` + the first 8 hex digits of its Ray id."""
    return "n" + ray_node_id[:8].lower()


def token_digest(token: str | None) -> str | None:
    return None if not token else hashlib.sha256(token.encode()).hexdigest()


def _node_token(home: str) -> str | None:
    token = os.environ.get("WEENV_CLUSTER_TOKEN", "").strip()
    if token:
        return token
    try:
        with open(os.path.join(home, "cluster.token")) as f:
            return f.read().strip() or None
    except OSError:
        return None


class NodeAgent:
    """One node's agent (wrapped as a Ray actor by :func:`agent_class`)."""

    def __init__(self, *, token_sha256: str | None, report_interval_s: float = 2.0, node_name: str | None = None,
                 cgroup_root: str | None = None, ray_node_id: str | None = None, start_daemon: bool = True,
                 daemon_start_timeout_s: float = 60.0, serve_tcp: bool | None = None, peer_listen: str | None = None,
                 peer_token: str | None = None):
        self.home = _home.home()
        self.ray_node_id = ray_node_id or _current_ray_node_id()
        self.node = node_name or os.environ.get("WEENV_NODE_NAME") or node_name_for(self.ray_node_id)
        self.cgroup_root = cgroup_root or os.environ.get("WEENV_CGROUP_ROOT") or f"weenv-{self.node}"
        own = token_digest(_node_token(self.home))
        self._token = own or token_sha256
        self.socket = os.path.join(self.home, "run", "weenv.sock")
        # the node's TCP API when it serves one (weenv serve; $WEENV_NODE_API_URL), else its socket
        self.api_url = os.environ.get("WEENV_NODE_API_URL") or f"unix://{self.socket}"
        self.report_interval_s = report_interval_s
        self._http = httpx.Client(transport=uds_transport(self.socket), base_url="http://weenv",
                                  timeout=httpx.Timeout(30.0, connect=5.0))
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, int] = OrderedDict()  # layers started here: digest -> size (LRU)
        self._seq = 0
        self._report: NodeReport | None = None
        self._stop = threading.Event()
        self._down = ""  # why the node was taken down (stop); from then on its report says so and stays
        self.daemon_pid = 0
        self.started_daemon = False
        self._daemon_proc: subprocess.Popen[bytes] | None = None
        # the envlet's peer tier (docs/cluster.md, "Peer chunk tier"): HOST:PORT it serves chunks on,
        # with the node's cluster token, else the one the cluster passed
        self.peer_listen = peer_listen or os.environ.get("WEENV_PEER_LISTEN") or None
        self._peer_token = _node_token(self.home) or peer_token
        if start_daemon:
            self._ensure_daemon(daemon_start_timeout_s)
        self.node_api: Any = None
        if (start_daemon if serve_tcp is None else serve_tcp) and self._token is not None:
            self._start_node_api()
        self._refresh()
        self._thread = threading.Thread(target=self._loop, name="weenv-agent-report", daemon=True)
        self._thread.start()

    def _start_node_api(self) -> None:
        """The daemon on the cluster network, for the gateway (weenv/cluster/_nodeapi.py): bound to
        ``$WEENV_NODE_API_HOST`` or the Ray node's address, ``$WEENV_NODE_API_PORT`` or any port."""
        from ._nodeapi import NodeApi

        host = os.environ.get("WEENV_NODE_API_HOST") or _current_node_ip()
        try:
            port = int(os.environ.get("WEENV_NODE_API_PORT") or 0)
        except ValueError:
            raise ClusterError(f"node {self.node}: $WEENV_NODE_API_PORT={os.environ['WEENV_NODE_API_PORT']!r} "
                               f"is not a port number") from None
        assert self._token is not None
        self.node_api = NodeApi(self.socket, self._token, host, port).start()
        log.info("node %s: daemon API on %s (cluster token required)", self.node, self.node_api.url)

    # ------------------------------------------------------------------ daemon

    def _ping(self) -> dict[str, Any] | None:
        try:
            resp = self._http.get("/v1/ping", timeout=5.0)
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def _ensure_daemon(self, timeout_s: float) -> None:
        """Attach to the daemon that answers, or start one. It is started detached (``setsid -f``:
        own session, not the agent's child), because Ray kills a worker's children when the worker
        exits: the daemon, and the envs, outlive the agent, and a new agent attaches to it."""
        ping = self._ping()
        if ping is None:
            os.makedirs(self.home, exist_ok=True)
            log_path = os.path.join(self.home, "cluster-daemon.log")
            peer_args = []
            if self.peer_listen:
                if not self._peer_token:
                    raise ClusterError(f"node {self.node}: peer_listen={self.peer_listen!r} needs a cluster token "
                                       f"($WEENV_CLUSTER_TOKEN, $WEENV_HOME/cluster.token, or the cluster's)")
                token_file = os.path.join(self.home, "peer.token")
                fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self._peer_token)
                peer_args = ["--envlet-peer-listen", self.peer_listen, "--cluster-token-file", token_file]
            with open(log_path, "ab") as out:
                self._daemon_proc = subprocess.Popen(
                    ["setsid", "-f", sys.executable, "-m", "weenv", "daemon", "--cgroup-root", self.cgroup_root,
                     "--node-name", self.node, *peer_args],
                    env={**os.environ, "WEENV_HOME": self.home}, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            self.started_daemon = True
            deadline = time.monotonic() + timeout_s
            while (ping := self._ping()) is None:
                code = self._daemon_proc.poll()
                if (code is not None and code != 0) or time.monotonic() > deadline:
                    with open(log_path, errors="replace") as f:
                        tail = f.read()[-2000:]
                    raise ClusterError(f"node {self.node}: the weenv daemon (home {self.home}) did not start: {tail}")
                time.sleep(0.1)
            log.info("node %s: started the weenv daemon (pid %s, home %s)", self.node, ping["pid"], self.home)
        self.daemon_pid = int(ping["pid"])

    # ------------------------------------------------------------------ reports

    def _loop(self) -> None:
        while not self._stop.wait(self.report_interval_s):
            if self._daemon_proc is not None:
                self._daemon_proc.poll()  # reap a daemon that stopped (it is our child)
            try:
                self._refresh()
            except Exception:  # the next round tries again; the report says what failed
                log.exception("node %s: report failed", self.node)

    def _get(self, path: str) -> Any:
        resp = self._http.get(path, timeout=10.0)
        resp.raise_for_status()
        return resp.json()

    def _note_layers(self, layers: list[tuple[str, int]]) -> None:
        with self._lock:
            for digest, size in layers:
                self._seen[digest] = size
                self._seen.move_to_end(digest)
            while len(self._seen) > _MAX_SEEN:
                self._seen.popitem(last=False)

    def _refresh(self) -> None:
        problem = ""
        healthy = True
        capacity = Capacity(cpu_cores=0.0, memory_total_bytes=0, memory_guaranteed_bytes=0, memory_headroom_bytes=0)
        envs, snaps, vols = [], [], []
        layers: dict[str, LayerHeld] = {}
        l2_capacity = None
        fetched = 0
        peer_address = ""
        try:
            ping = self._get("/v1/ping")
            self.daemon_pid = int(ping["pid"])
            top = self._get("/v1/top")
            envs = envs_from(self._get("/v1/envs"))
            published = self._published()  # what this node pushed to the cluster's store
            snaps = [msgspec.structs.replace(x, ref=published[x.id]) if x.ref is None and x.id in published else x
                     for x in snapshots_from(self._get("/v1/snapshots"))]
            vols = volumes_from(self._get("/v1/volumes"))  # node-local: creates that mount one are pinned here
            # the env count placement weighs (rule 5): envs that run or will, not pooled, stopping or failed ones
            capacity = capacity_from_top(top, envs=sum(e.status in _COUNTED for e in envs), live={e.id for e in envs})
        except (httpx.HTTPError, ValueError, KeyError, ClusterError) as e:
            healthy, problem = False, f"daemon at {self.socket}: {e}"
        try:
            from ..envlet import EnvletClient

            envlet = EnvletClient(os.path.join(self.home, "run", "envlet.sock"))
            registered = envlet.list()
            stats = envlet.stats()
            l2_capacity = stats.get("l2_capacity_bytes")
            fetched = int(stats.get("remote_bytes", 0))
            peer_address = str(((stats.get("peer") or {}).get("tier") or {}).get("address") or "")
            self._note_layers([(x.digest, x.size) for x in registered])
            for x in registered:
                layers[x.digest] = LayerHeld(digest=x.digest, size_bytes=x.size, where="envlet")
        except Exception as e:
            healthy, problem = False, problem or f"envlet: {e}"
        for sub, where in (("layer-trees", "tree"), ("snapshot-trees", "snapshot")):
            for digest, size in _trees(os.path.join(self.home, sub)):
                layers.setdefault(digest, LayerHeld(digest=digest, size_bytes=size, where=where))  # type: ignore[arg-type]
        with self._lock:
            seen = list(self._seen.items())
        budget = l2_capacity if isinstance(l2_capacity, int) else None
        for digest, size in reversed(seen):  # the newest first, within the disk cache's bound
            if budget is not None:
                budget -= size
                if budget < 0:
                    break
            layers.setdefault(digest, LayerHeld(digest=digest, size_bytes=size, where="seen"))
        with self._lock:
            if self._down:
                return  # taken down while this round ran: the down report stays the last one
            self._seq += 1
            self._report = NodeReport(
                node=self.node, ray_node_id=self.ray_node_id, seq=self._seq, taken_s=time.time(), healthy=healthy,
                accepting=healthy, problem=problem, home=self.home, daemon_address=self.api_url,
                daemon_pid=self.daemon_pid, node_api=self.node_api.url if self.node_api is not None else "",
                store_bytes_fetched=fetched, peer_address=peer_address, capacity=capacity,
                layers=list(layers.values()), snapshots=snaps, envs=envs, volumes=vols)

    # ------------------------------------------------------------------ calls (all but hello need the token)

    def _check(self, token: str | None, *, down_ok: bool = False) -> None:
        """The token check of every call but hello; and, unless ``down_ok``, that the node is not down."""
        want = self._token
        got = token_digest(token)
        # want None: an open agent, only when neither the node nor its creator set a token
        if want is not None and (got is None or not hmac.compare_digest(want, got)):
            raise ClusterAuthError(f"node {self.node}: a call without the right cluster token was refused")
        if self._down and not down_ok:
            raise ClusterError(f"node {self.node} was taken down ({self._down}): restart Ray on it to bring it back")

    def hello(self) -> dict[str, Any]:
        """Who this agent is (no token needed: it says nothing about envs)."""
        return {"node": self.node, "ray_node_id": self.ray_node_id, "home": self.home, "pid": os.getpid(),
                "cgroup_root": self.cgroup_root, "started_daemon": self.started_daemon,
                "daemon_pid": self.daemon_pid, "token_required": self._token is not None,
                "node_api": self.node_api.url if self.node_api is not None else "", "down": self._down}

    def report(self, token: str | None) -> NodeReport:
        self._check(token, down_ok=True)  # a down node's last report says it is down
        with self._lock:
            assert self._report is not None
            return self._report

    def refresh(self, token: str | None) -> NodeReport:
        """A report taken now (the gateway asks after a create it sent straight to the daemon)."""
        self._check(token, down_ok=True)
        self._refresh()
        return self.report(token)

    def set_peers(self, token: str | None, table: dict[str, list[str]]) -> dict[str, Any]:
        """Set the envlet's peer table (the cluster sends it after each report round: the other
        healthy nodes' peer addresses and layers, :func:`weenv.cluster._report.peer_tables`)."""
        self._check(token)
        from ..envlet import EnvletClient

        return EnvletClient(os.path.join(self.home, "run", "envlet.sock")).set_peers(table)

    def set_peer_serving(self, token: str | None, enabled: bool) -> dict[str, Any]:
        """Start or stop serving chunks to peers (False: the node is drained or lost)."""
        self._check(token, down_ok=True)  # a lost node's envlet, if it still runs, stops serving
        from ..envlet import EnvletClient

        return EnvletClient(os.path.join(self.home, "run", "envlet.sock")).set_peer_serving(enabled)

    def request(self, token: str | None, method: str, path: str, *, json_body: Any = None, content: bytes | None = None,
                params: dict[str, str] | None = None, timeout_s: float | None = None) -> tuple[int, str, bytes]:
        """Forward one API call to the node's daemon: ``(status, content type, body)``."""
        self._check(token)
        if not path.startswith("/v1/") or ".." in path:
            raise ClusterError(f"node {self.node}: {path!r} is not a /v1 API path")
        timeout = httpx.Timeout(timeout_s or 300.0, connect=5.0)
        resp = self._http.request(method, path, json=json_body, content=content, params=params, timeout=timeout)
        if method == "POST" and path == "/v1/envs" and resp.status_code == 201 and isinstance(json_body, dict):
            self._note_layers(_lock_layers(json_body.get("plan")))
        changes = ((method == "POST" and (path in ("/v1/envs", "/v1/volumes") or path.endswith(("/fork", "/commit"))))
                   or (method == "DELETE" and path.startswith(("/v1/envs/", "/v1/volumes/")) and path.count("/") == 3))
        if resp.status_code < 300 and changes:
            # what placement reads changed (an env more or less): the next report says so at once
            try:
                self._refresh()
            except Exception:
                log.exception("node %s: report after %s %s failed", self.node, method, path)
        return resp.status_code, resp.headers.get("content-type", ""), resp.content

    def publish_snapshot(self, token: str | None, snapshot_id: str, repo: str) -> dict[str, Any]:
        """Push every layer of a snapshot held here to ``repo`` (``host[:port]/name``, the cluster's
        store) and tag ``repo:<snapshot id>`` with the lock that starts it on any node. Reports
        name its ref from then on (kept in ``$WEENV_HOME/cluster-published.json``)."""
        self._check(token)
        rec = publish_snapshot(self._get(f"/v1/snapshots/{snapshot_id}"), repo, home=self.home, node=self.node)
        with self._lock:
            published = self._published()
            published[snapshot_id] = rec["ref"]
            with atomic_writer(self._published_path, mode=None, fsync=False, encoding="utf-8") as f:
                json.dump(published, f)
        self._refresh()
        return rec

    @property
    def _published_path(self) -> str:
        return os.path.join(self.home, "cluster-published.json")

    def _published(self) -> dict[str, str]:
        try:
            with open(self._published_path) as f:
                data = json.load(f)
            return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def stop(self, token: str | None, *, stop_daemon: bool = False, kill_envs: bool = False, timeout_s: float = 60.0,
             reason: str = "") -> dict[str, Any]:
        """Take the node out of the cluster (``weenv cluster stop-node``; docs/cluster.md, "Taking a
        node down"). Its reports stop and its node API closes; its last report says it is down
        (``NodeReport.down``), so every cluster client, a gateway too, marks it lost at its next poll,
        and every call but ``hello``, ``report`` and ``set_peer_serving`` is refused from then on.

        ``stop_daemon``: stop the node's daemon as ``weenv daemon stop`` does, waiting (``timeout_s``)
        for it to exit; ``kill_envs``: its envs first, then its envlet stops too (a daemon already
        stopped that left envs running is started again to kill them). Without ``kill_envs`` the envs
        run on, lost to the cluster: a daemon started later on the node re-adopts them.

        The agent itself stays, down: a new cluster client finds it (get-or-create) and marks the node
        lost, where a new agent would start the daemon again. Restarting Ray on the node brings it
        back as a new node (a new agent, which starts the daemon)."""
        self._check(token, down_ok=True)  # again on a down node: e.g. --kill-envs after --keep-envs
        with self._lock:
            envs = list(self._report.envs) if self._report is not None else []
            what = reason or "weenv cluster stop-node"
            self._down = what + (": stopping its daemon" if stop_daemon else "")
            self._set_down_report(envs, "taken down: " + self._down)
        self._stop.set()
        if self.node_api is not None:
            self.node_api.stop()
        answer: dict[str, Any] = {"node": self.node, "home": self.home, "ray_node_id": self.ray_node_id,
                                  "down": True, "daemon_stopped": False, "daemon_pid": self.daemon_pid}
        try:
            if stop_daemon:
                answer.update(self._stop_daemon(kill_envs, timeout_s))
        finally:
            with self._lock:
                if stop_daemon and answer["daemon_stopped"]:
                    self._down = f"{what}: daemon stopped, envs {'killed' if kill_envs else 'left running'}"
                elif stop_daemon:
                    self._down = f"{what}: its daemon did not stop"
                else:
                    self._down = f"{what}: its daemon and envs left running"
                self._set_down_report(envs, "taken down: " + self._down)
        log.info("node %s: %s", self.node, self._down)
        return answer

    def _set_down_report(self, envs: list[Any], problem: str) -> None:
        """The node's last report (with the lock held): down, not healthy, taking nothing, with the envs
        it reported before (the cluster hands them to its lost-envs listeners)."""
        base = self._report or NodeReport(node=self.node, capacity=Capacity(
            cpu_cores=0.0, memory_total_bytes=0, memory_guaranteed_bytes=0, memory_headroom_bytes=0))
        self._seq += 1
        self._report = msgspec.structs.replace(base, seq=self._seq, taken_s=time.time(), healthy=False, accepting=False,
                                               problem=problem, down=self._down, node_api="", peer_address="",
                                               envs=envs)

    def _envlet_pid(self) -> int | None:
        from ..envlet import EnvletClient, EnvletError

        try:
            return int(EnvletClient(os.path.join(self.home, "run", "envlet.sock")).ping(timeout_s=2.0)["pid"])
        except (EnvletError, KeyError, TypeError, ValueError):
            return None

    def _stop_daemon(self, kill_envs: bool, timeout_s: float) -> dict[str, Any]:
        """``weenv daemon stop [--kill-envs]`` on this node's home (weenv/cli/_daemonctl.py), from here:
        the daemon this agent would start is the one to re-adopt envs a stopped daemon left."""
        from .._proc import wait_gone

        ping = self._ping()
        if ping is None and kill_envs and (self._envlet_pid() is not None or _listdir(os.path.join(self.home, "envs"))):
            log.info("node %s: its daemon is not running but envs are left: starting it to kill them", self.node)
            self._ensure_daemon(timeout_s)  # it re-adopts them, then stops with them
            ping = self._ping()
        out: dict[str, Any] = {"daemon_stopped": ping is None, "daemon_was_running": ping is not None, "envs": [],
                               "envs_killed": kill_envs}
        if ping is not None:
            pid = int(ping["pid"])
            out["daemon_pid"] = pid
            try:
                out["envs"] = [e["id"] for e in self._get("/v1/envs")]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            try:
                resp = self._http.post("/v1/daemon/stop", json={"kill_envs": kill_envs}, timeout=timeout_s)
                if resp.status_code >= 400:
                    raise ClusterError(f"node {self.node}: its daemon refused to stop: {resp.text[:500]}")
            except httpx.HTTPError:
                pass  # it went away before its answer reached us: what was asked
            if not wait_gone(pid, timeout_s):
                raise ClusterError(f"node {self.node}: its daemon (pid {pid}) still runs {timeout_s:g} s after it was "
                                   f"asked to stop; see {os.path.join(self.home, 'cluster-daemon.log')}")
            out["daemon_stopped"] = True
        envlet = self._envlet_pid()
        if envlet is not None and kill_envs:
            wait_gone(envlet, min(timeout_s, 15.0))  # it stops once the daemon's envs are gone
            envlet = self._envlet_pid()
        out["envlet_pid"] = envlet  # None: stopped (its layers unmounted)
        out["envs_left"] = _listdir(os.path.join(self.home, "envs"))
        return out


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


_COUNTED = frozenset({"creating", "running", "paused"})


def _lock_layers(plan: Any) -> list[tuple[str, int]]:
    """The (digest, size) of a create body's plan lock, as the plan codec reads it (none for a plan
    or a lock it refuses: the daemon that admitted the create read it the same way)."""
    from ..plan import Lock, PlanError, plan_from_builtins

    if not isinstance(plan, dict) or "lock_version" not in plan:
        return []
    try:
        lock = plan_from_builtins(plan, Lock, source="the create's plan lock")
    except PlanError:
        return []
    return [(g.layer_digest, g.layer_size) for g in lock.groups]


def _trees(root: str) -> list[tuple[str, int]]:
    """Layer trees kept as directories: ``<root>/sha256-<hex>`` with their ``.size`` (or du) files."""
    out = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        if name.startswith(".") or name.endswith(".size") or not name.startswith("sha256-"):
            continue
        size = 0
        try:
            with open(os.path.join(root, name + ".size")) as f:
                size = int(f.read())
        except (OSError, ValueError):
            pass
        out.append(("sha256:" + name[len("sha256-"):], size))
    return out


def publish_snapshot(detail: dict[str, Any], repo: str, *, home: str, node: str) -> dict[str, Any]:
    """Publish a snapshot (``GET /v1/snapshots/{id}``'s answer, its layers in ``home``'s embedded
    store) as ``repo:<snapshot id>``, with its memory packs if it has them
    (:func:`weenv.registry._published.publish_snapshot`)."""
    from ..plan import Lock, plan_from_builtins, plan_to_builtins
    from ..registry import LayoutStore, parse_ref
    from ..registry._published import SnapshotNotPublishable
    from ..registry._published import publish_snapshot as publish

    snap_id = detail["id"]
    # the lock as the plan codec reads it (sizes in bytes, every default explicit)
    lock = plan_to_builtins(plan_from_builtins(detail["lock"], Lock, source=f"snapshot {snap_id} on node {node}"))
    r = parse_ref(f"{repo}:{snap_id}")
    if r.registry is None:
        raise ClusterError(f"cluster store {repo!r}: name a registry (host[:port]/repo)")
    layers = detail.get("layers", [])
    try:
        out = publish(snap_id, lock, layers, detail.get("memory"), f"{repo}:{snap_id}",
                      store=LayoutStore(os.path.join(home, "store")), source=f"weenv cluster publish {snap_id} (node {node})")
    except SnapshotNotPublishable as e:
        raise ClusterError(f"{e} (node {node})") from None
    return {"id": snap_id, "ref": out["ref"], "home": node, "lock": out["lock"],
            "layers": [(x["digest"], int(x["size"])) for x in layers]}


def load_published(ref: str) -> dict[str, Any]:
    """The lock a published snapshot starts from (read from the cluster's store)."""
    from ..registry import open_store, parse_ref
    from ..registry._group import parse_manifest

    r = parse_ref(ref)
    if r.registry is None or r.tag is None:
        raise ClusterError(f"{ref!r} is not a published snapshot ref (host[:port]/repo:snap-…)")
    with open_store(r.registry) as store:
        data, media_type = store.get_manifest(r.repo, r.tag)
    manifest = parse_manifest(data, media_type, ref)
    text = (manifest.get("annotations") or {}).get(ANN_SNAPSHOT_LOCK)
    if not text:
        raise ClusterError(f"{ref}: not a published weenv snapshot (no {ANN_SNAPSHOT_LOCK} annotation)")
    return msgspec.json.decode(text.encode())  # type: ignore[no-any-return]


def _current_ray_node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception as e:
        raise ClusterError(f"the node agent runs as a Ray actor (no Ray node id: {e})") from None


def _current_node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception as e:
        raise ClusterError(f"no Ray node address to bind the node's API to (set $WEENV_NODE_API_HOST): {e}") from None


@functools.lru_cache(maxsize=1)
def agent_class() -> Any:
    """:class:`NodeAgent` as a Ray actor class: threaded (reports and calls do not queue behind
    each other), no CPU reserved, never restarted by Ray (the cluster's reconciler decides)."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=32, max_restarts=0)(NodeAgent)
