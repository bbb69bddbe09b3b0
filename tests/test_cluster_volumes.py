"""Volumes in the cluster (issue 29 item 17): node-local, so a create that mounts one is pinned to its
node, volumes of two nodes are refused, volume calls go to the volume's node and new volumes spread.
Pure placement over reports, and a :class:`~weenv.cluster.Cluster` over fake nodes (no Ray); the
real thing through the gateway is in tests/test_cluster_ray.py."""

from __future__ import annotations

import msgspec
import pytest

from weenv._wire import HttpError
from weenv.cluster import (
    Capacity,
    Cluster,
    ClusterView,
    LayerHeld,
    NodeReport,
    NodeState,
    PlacementError,
    SnapshotHeld,
    VolumeConflictError,
    VolumeHeld,
    VolumeNotFoundError,
    place_group,
    place_volume,
    rank,
    request_for,
    volume_home,
    volume_nodes,
)
from weenv.cluster._backend import ClusterBackend
from weenv.cluster._placement import with_overrides
from weenv.cluster._report import volumes_from
from weenv.plan import Lock, plan_from_builtins, plan_to_builtins

MiB = 1 << 20
GiB = 1 << 30
LAYER = ("sha256:" + "1" * 64, 300 * MiB)
VA, VB = "vol-" + "a" * 12, "vol-" + "b" * 12


def _lock(volumes=()):
    return plan_to_builtins(plan_from_builtins({
        "lock_version": 1, "name": "p", "groups": [{
            "name": "os", "ref": "127.0.0.1:5000/ct/os:t", "class": "os", "digest": "sha256:" + "7" * 64,
            "layer_digest": LAYER[0], "layer_size": LAYER[1], "toc_digest": "sha256:" + "9" * 64,
            "registry": "127.0.0.1:5000", "repo": "ct/os"}],
        "resources": {"cpu": {"min": 0.5}, "memory": {"min": 64 * MiB, "max": 256 * MiB}},
        "volumes": [{"name": v, "path": f"/v{i}"} for i, v in enumerate(volumes)]}, Lock))


def report(name, *, volumes=(), cached=False, committed=0.0, envs=0, seq=1, snapshots=()):
    return NodeReport(node=name, seq=seq, volumes=[VolumeHeld(id=i, name=n) for i, n in volumes],
                      layers=[LayerHeld(digest=LAYER[0], size_bytes=LAYER[1], where="envlet")] if cached else [],
                      snapshots=list(snapshots),
                      capacity=Capacity(cpu_cores=2.0, cpu_committed_cores=committed, memory_total_bytes=9 * GiB,
                                        memory_guaranteed_bytes=8 * GiB, memory_headroom_bytes=8 * GiB, envs=envs))


def test_a_create_that_mounts_a_volume_is_pinned_to_the_volumes_node():
    # a holds the plan's layers and is idle: without its volume the env goes there
    view = ClusterView([report("a", cached=True), report("b"), report("c", volumes=[(VA, "work")], committed=1.0)])
    assert [c.node for c in rank(view, request_for(_lock()))][0] == "a"
    for req in (request_for(_lock([VA])), request_for(_lock(["work"])),  # by id, or by its name on the node
                with_overrides(request_for(_lock()), {"volumes": [{"name": VA, "path": "/data"}]})):
        assert req.volumes in ((VA,), ("work",))
        assert [c.node for c in rank(view, req)] == ["c"]
        assert place_group(view, req, 2) == ["c", "c"]  # every env of it, even past the band
    with pytest.raises(ValueError, match="volumes"):
        with_overrides(request_for(_lock()), {"volumes": [{"path": "/x"}]})


def test_volumes_of_two_nodes_and_a_name_on_two_nodes_are_conflicts_and_an_unknown_one_is_not_found():
    view = ClusterView([report("a", volumes=[(VA, "work")]), report("b", volumes=[(VB, "work")]), report("c")])
    assert volume_home(volume_nodes(view, [VA])) == "a"
    with pytest.raises(VolumeConflictError, match=r"volumes of 2 nodes .*'vol-a+' on node a; 'vol-b+' on node b"):
        volume_home(volume_nodes(view, [VA, VB]))
    with pytest.raises(VolumeConflictError, match="nodes a, b each have a volume of that name.*by its id"):
        volume_home(volume_nodes(view, ["work"]))
    with pytest.raises(VolumeNotFoundError, match="'vol-c+' not found"):
        volume_home(volume_nodes(view, [VA, "vol-" + "c" * 12]))
    both = request_for(_lock([VA, VB]))
    assert rank(view, both) == []
    with pytest.raises(PlacementError, match="which no one node holds"):
        place_group(view, both, 1)


def test_the_volumes_node_full_or_lost_is_a_clear_refusal():
    full = ClusterView([report("a"), report("b", volumes=[(VA, VA)], committed=2.0)])
    req = request_for(_lock([VA]))
    assert rank(full, req) == []  # a has room, but not the volume
    with pytest.raises(PlacementError, match=r"volume 'vol-a+' of node b, where alone it can start .*"
                                             r"cpu mins already guaranteed: 1, not the volumes. node: 1"):
        place_group(full, req, 1)
    # the volume's node lost: not in the view of usable reports; the caller's look-up named it
    lost = ClusterView([report("a")])
    pinned = msgspec.structs.replace(req, volume_home="b")
    assert rank(lost, pinned) == []
    with pytest.raises(PlacementError, match="node b is not usable: lost"):
        place_group(lost, pinned, 1)


def test_a_local_snapshot_of_one_node_and_a_volume_of_another_start_nowhere():
    snap = SnapshotHeld(id="snap-x", layers=[LAYER])
    view = ClusterView([report("a", snapshots=[snap]), report("b", volumes=[(VA, VA)])])
    req = request_for(_lock([VA]), snapshot="snap-x", snapshot_home="a", snapshot_local=True)
    assert rank(view, req) == []
    same = ClusterView([report("a", snapshots=[snap], volumes=[(VA, VA)]), report("b")])
    assert [c.node for c in rank(same, req)] == ["a"]


def test_new_volumes_spread_over_the_nodes_within_the_load_band():
    view = ClusterView([report("a", volumes=[(VA, VA)]), report("b"), report("c", committed=1.9)])
    assert place_volume(view) == ["b", "a", "c"]  # c is past the band; a has one already
    assert place_volume(ClusterView([report("a", volumes=[(VA, VA)]), report("b", volumes=[(VB, VB)])])) == ["a", "b"]
    assert place_volume(ClusterView([])) == []


def test_the_agents_report_reads_the_daemons_volume_list():
    assert volumes_from([{"id": VA, "name": "work", "size_bytes": 1}, {"id": VB, "name": ""}]) == [
        VolumeHeld(id=VA, name="work"), VolumeHeld(id=VB, name=VB)]
    rep = msgspec.json.decode(msgspec.json.encode(report("a", volumes=[(VA, "w")])), type=NodeReport)
    assert rep.volumes == [VolumeHeld(id=VA, name="w")]  # carried through Ray as any report field


# -- a Cluster over fake nodes ----------------------------------------------------------------------


class Handle:
    def __init__(self, name):
        self.name = name

    def start_report(self):
        raise AssertionError("not polled")


class FakeNode:
    """A node's daemon API as the cluster calls it: creates, volume calls, volume look-ups."""

    def __init__(self, cluster, name, volumes=()):
        self.cluster, self.name, self.volumes, self.calls = cluster, name, dict(volumes), []

    def request(self, method, path, *, timeout_s=None, **kw):
        self.calls.append((method, path))
        ref = path.rsplit("/", 1)[-1]
        for vid, name in self.volumes.items():
            if ref in (vid, name):
                return 200, "application/json", msgspec.json.encode({"id": vid, "name": name})
        return 404, "application/json", b'{"error": {"kind": "volume_not_found", "message": "no"}}'

    def call(self, method, path, *, json=None, **kw):
        self.calls.append((method, path))
        if (method, path) == ("POST", "/v1/envs"):
            return {"id": f"{self.name}-p-{len(self.calls)}"}
        if (method, path) == ("POST", "/v1/volumes"):
            vid = f"vol-{len(self.volumes):012x}"
            self.volumes[vid] = (json or {}).get("name") or vid
            return {"id": vid, "name": self.volumes[vid], "size_bytes": 1 << 30}
        if method == "GET" and path.startswith("/v1/volumes/"):
            return {"id": path.rsplit("/", 1)[-1]}
        raise AssertionError((method, path))

    def report(self, timeout_s=10.0):
        return self.cluster.reconciler.nodes[self.name].report


def make_cluster(reported, unreported=None):
    """Nodes a, b, c: ``reported`` {node: [(id, name)]} in their reports; ``unreported`` made since."""
    cluster = Cluster(token=None)
    nodes = {}
    for name in "abc":
        entry = cluster.reconciler.add(Handle(name))
        entry.state, entry.report = NodeState.HEALTHY, report(name, volumes=reported.get(name, ()))
        held = [*reported.get(name, ()), *(unreported or {}).get(name, ())]
        nodes[name] = cluster.clients[name] = FakeNode(cluster, name, held)  # type: ignore[assignment]
    cluster._refresh_one = lambda name, fresh=False: None  # type: ignore[method-assign]
    return cluster, nodes


def test_cluster_create_lands_on_the_volumes_node_and_refuses_volumes_of_two_nodes():
    cluster, nodes = make_cluster({"b": [(VA, "work")], "c": [(VB, VB)]})
    env = cluster.create(_lock(), volumes=[{"name": "work", "path": "/data"}])
    assert env.node == "b"
    assert cluster.create(_lock([VB])).node == "c"
    with pytest.raises(VolumeConflictError, match="volumes of 2 nodes"):
        cluster.create(_lock([VB]), volumes=[{"name": VA, "path": "/data"}])
    with pytest.raises(VolumeConflictError, match="not of node a"):
        cluster.create(_lock([VA]), node="a")
    with pytest.raises(VolumeNotFoundError):
        cluster.create(_lock(["nowhere"]))
    assert [m for m, p in nodes["a"].calls if p == "/v1/envs"] == []


def test_a_volume_no_report_lists_yet_is_found_by_asking_the_nodes():
    cluster, nodes = make_cluster({}, unreported={"c": [(VA, VA)]})
    assert cluster.volume_node(VA) == "c"
    assert ("GET", f"/v1/volumes/{VA}") in nodes["c"].calls
    assert cluster.volume(VA)["node"] == "c"  # then routed there (kept) without asking again
    asked = sum(p == f"/v1/volumes/{VA}" for n in nodes.values() for _, p in n.calls)
    assert cluster.create(_lock([VA])).node == "c"
    assert sum(p == f"/v1/volumes/{VA}" for n in nodes.values() for _, p in n.calls) == asked
    with pytest.raises(VolumeNotFoundError):
        cluster.volume_node("vol-" + "9" * 12)  # every node asked, none holds it


def test_new_volumes_spread_and_take_names_the_cluster_does_not_have():
    cluster, nodes = make_cluster({"a": [(VA, "work")]})
    made = cluster.create_volume("data")
    assert made["node"] == "b" and cluster.volume_node("data") == "b"
    assert cluster.create_volume(node="a")["node"] == "a"
    with pytest.raises(VolumeConflictError, match="'work' exists already .*node a"):
        cluster.create_volume("work")


def test_the_gateways_create_body_is_pinned_or_refused_with_404_and_409():
    cluster, _ = make_cluster({"b": [(VA, VA)], "c": [(VB, VB)]})
    backend = ClusterBackend(cluster, "tok")
    body = {"plan": _lock(), "overrides": {"volumes": [{"name": VA, "path": "/data"}]}}
    assert backend.request_for_body(body).volume_home == "b"
    with pytest.raises(HttpError) as two:
        backend.request_for_body({"plan": _lock([VB]), **{k: v for k, v in body.items() if k != "plan"}})
    assert (two.value.status, two.value.kind) == (409, "volume_conflict") and "2 nodes" in two.value.message
    with pytest.raises(HttpError) as none:
        backend.request_for_body({"plan": _lock(["gone"])})
    assert (none.value.status, none.value.kind) == (404, "volume_not_found")
