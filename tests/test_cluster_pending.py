"""Concurrent creates on a Cluster see each other: each is counted on its node (``Cluster.place`` /
``reserve`` / ``settle``) until that node's report lists the env. Fake node clients, no Ray."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from weenv.cluster import Capacity, Cluster, EnvHeld, LayerHeld, NodeReport, NodeState
from weenv.plan import Lock, plan_from_builtins, plan_to_builtins

MiB = 1 << 20
GiB = 1 << 30
LAYERS = [("sha256:" + "1" * 64, 300 * MiB), ("sha256:" + "2" * 64, 50 * MiB)]
LOCK = plan_to_builtins(plan_from_builtins({  # as the cluster sends it: the plan codec's builtins
    "lock_version": 1, "name": "p", "groups": [
        {"name": f"g{i}", "ref": f"127.0.0.1:5000/ct/g{i}:t", "class": "os" if i == 0 else "task",
         "digest": "sha256:" + f"{i + 7}" * 64, "layer_digest": d, "layer_size": s, "toc_digest": "sha256:" + "9" * 64,
         "registry": "127.0.0.1:5000", "repo": f"ct/g{i}"} for i, (d, s) in enumerate(LAYERS)],
    "resources": {"cpu": {"min": 0.02}, "memory": {"min": 16 * MiB, "max": 128 * MiB}}}, Lock))


def report(name: str, seq: int = 1, envs: tuple[str, ...] = ()) -> NodeReport:
    return NodeReport(node=name, seq=seq, envs=[EnvHeld(id=e, status="running") for e in envs],
                      layers=[LayerHeld(digest=d, size_bytes=s, where="envlet") for d, s in LAYERS],
                      capacity=Capacity(cpu_cores=2.0, memory_total_bytes=9 * GiB, memory_guaranteed_bytes=8 * GiB,
                                        memory_headroom_bytes=8 * GiB, envs=len(envs)))


class Handle:
    def __init__(self, name: str):
        self.name = name

    def start_report(self):  # never polled: the test sets the reports
        raise AssertionError("not polled")


class SlowNode:
    """A node whose creates take a while and whose report lags behind them (as during a burst)."""

    def __init__(self, cluster: Cluster, name: str):
        self.cluster, self.name, self.made = cluster, name, []
        self._lock = threading.Lock()

    def call(self, method, path, *, json=None, **kw):
        assert (method, path) == ("POST", "/v1/envs") and json == {"plan": LOCK}
        time.sleep(0.05)
        with self._lock:
            self.made.append(f"{self.name}-p-{len(self.made)}")
            return {"id": self.made[-1]}

    def report(self, timeout_s=10.0):
        return self.cluster.reconciler.nodes[self.name].report  # not newer: the envs are not in it yet


def make_cluster() -> tuple[Cluster, dict[str, SlowNode]]:
    cluster = Cluster(token=None)
    nodes = {}
    for name in "abc":
        entry = cluster.reconciler.add(Handle(name))
        entry.state, entry.report = NodeState.HEALTHY, report(name)
        nodes[name] = cluster.clients[name] = SlowNode(cluster, name)  # type: ignore[assignment]
    return cluster, nodes


def test_a_burst_of_concurrent_creates_spreads_over_equally_cached_nodes():
    cluster, nodes = make_cluster()
    with ThreadPoolExecutor(12) as pool:
        envs = list(pool.map(lambda _: cluster.create(LOCK), range(12)))
    counts = {n: sum(e.node == n for e in envs) for n in "abc"}
    assert counts == {"a": 4, "b": 4, "c": 4}, counts  # without pending creates: 12 on "a"
    assert len(cluster._pending) == 12  # done, not yet in any report: still counted
    for name, node in nodes.items():  # the nodes report their envs: nothing pending any more
        cluster.reconciler.nodes[name].report = report(name, seq=2, envs=tuple(node.made))
    view = cluster.current_view()
    assert not cluster._pending and [n.envs for n in view.nodes] == [4, 4, 4]


def test_a_failed_create_stops_counting_and_an_unseen_one_expires(monkeypatch):
    import weenv.cluster._cluster as cc

    cluster, _ = make_cluster()
    nodes, ticket = cluster.place(cc.request_for(LOCK))
    assert nodes[0] == "a" and cluster.place(cc.request_for(LOCK))[0][0] == "b"  # a holds one pending
    cluster.settle(ticket, None)  # that create failed
    assert [n.envs for n in cluster.current_view().nodes] == [0, 1, 0]
    monkeypatch.setattr(cc, "PENDING_TTL_S", 0.0)
    assert [n.envs for n in cluster.current_view().nodes] == [0, 0, 0] and not cluster._pending


def test_an_env_killed_before_any_report_listed_it_stops_counting():
    cluster, nodes = make_cluster()
    envs = [cluster.create(LOCK) for _ in range(3)]  # the slow nodes' reports never show them
    assert len(cluster._pending) == 3
    envs[0].cluster._forget(envs[0].id)  # what ClusterEnv.kill does once the daemon killed it
    assert [n.envs for n in cluster.current_view().nodes] == [0, 1, 1]


def test_the_report_fetched_right_after_a_create_settles_it():
    cluster, nodes = make_cluster()

    class Reporting(SlowNode):
        def report(self, timeout_s=10.0):  # the agent's report after the create lists the env
            old = self.cluster.reconciler.nodes[self.name].report
            return report(self.name, seq=old.seq + 1, envs=tuple(self.made))

    cluster.clients["a"] = Reporting(cluster, "a")  # type: ignore[assignment]
    env = cluster.create(LOCK)
    assert env.node == "a" and not cluster._pending
