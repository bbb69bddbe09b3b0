"""Placement over generated cluster states: checked against the daemon's own admission function.

Each generated node is what a daemon's monitor sees (NodeView, policy, the mins of its envs); its
report is made the way the agent makes it (``capacity_from_top`` of a /v1/top-shaped answer), and
every decision is checked with ``weenv.provision.elastic._policy.admit``, the function the node's daemon
runs on create.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weenv.cluster import (
    Capacity,
    ClusterView,
    LayerHeld,
    NodeReport,
    PlacementError,
    PlacementRequest,
    SnapshotHeld,
    capacity_from_top,
    place,
    place_group,
    rank,
    with_pending,
)
from weenv.provision.elastic._policy import EnvLimits, NodeView, PolicyConfig, admit

MiB = 1 << 20
GiB = 1 << 30
DIGESTS = [f"sha256:{i:064x}" for i in range(6)]


class SimNode:
    """A node as its daemon sees it: NodeView + policy + the limits of the envs it runs."""

    def __init__(self, name, view, cfg, envs, layers, snapshots, accepting, used=0.0):
        self.name, self.view, self.cfg, self.envs = name, view, cfg, list(envs)
        self.layers, self.snapshots, self.accepting = layers, snapshots, accepting
        self.used = used  # the CPU its envs use now, in cores (spread over them)

    def top(self):
        return {
            "node": {"cpu_cores": self.view.cpu_cores, "memory_total_bytes": self.view.memory_total_bytes,
                     "memory_available_bytes": self.view.memory_available_bytes,
                     "memory_headroom_bytes": self.view.memory_headroom_bytes(self.cfg)},
            "policy": {"node_memory_reserve_bytes": self.cfg.node_memory_reserve_bytes,
                       "cpu_min_overcommit": self.cfg.cpu_min_overcommit},
            "envs": {f"e{i}": {"cpu": {"min_cores": lim.cpu_min_cores, "used_cores": self.used / len(self.envs)},
                               "memory": {"min_bytes": lim.memory_min_bytes}} for i, lim in enumerate(self.envs)},
            "admission": {"admitted": len(self.envs), "refused": 0},
        }

    def report(self):
        return NodeReport(node=self.name, accepting=self.accepting, capacity=capacity_from_top(self.top()),
                          layers=self.layers, snapshots=self.snapshots)

    def admits(self, req, extra=()):
        lim = limits_of(req)
        return self.accepting and bool(admit(lim, self.view, [*self.envs, *extra], self.cfg))


def limits_of(req):
    return EnvLimits(cpu_min_cores=req.cpu_min_cores, cpu_max_cores=max(req.cpu_min_cores, 2.0),
                     memory_min_bytes=req.memory_min_bytes, memory_max_bytes=req.memory_max_bytes)


env_limits = st.builds(
    lambda cpu, mem: EnvLimits(cpu_min_cores=cpu, cpu_max_cores=2.0, memory_min_bytes=mem, memory_max_bytes=4 * GiB),
    st.sampled_from([0.05, 0.1, 0.25, 0.5, 1.0]), st.integers(16, 2048).map(lambda m: m * MiB))


@st.composite
def sim_nodes(draw, name):
    total = draw(st.integers(1, 64)) * GiB
    cfg = PolicyConfig(node_memory_reserve_bytes=draw(st.sampled_from([0, 256 * MiB, 512 * MiB])),
                       cpu_min_overcommit=draw(st.sampled_from([1.0, 1.5, 4.0])))
    view = NodeView(cpu_cores=draw(st.sampled_from([1.0, 2.0, 8.0, 64.0])), memory_total_bytes=total,
                    memory_available_bytes=draw(st.integers(0, total)),
                    memory_promised_bytes=draw(st.integers(0, 4 * GiB)))
    envs = draw(st.lists(env_limits, max_size=12))
    layers = [LayerHeld(digest=d, size_bytes=draw(st.integers(1, 500)) * MiB, where="envlet")
              for d in draw(st.lists(st.sampled_from(DIGESTS), unique=True, max_size=4))]
    snaps = [SnapshotHeld(id="snap-a", layers=[(DIGESTS[5], 10 * MiB)])] if draw(st.booleans()) else []
    used = draw(st.floats(0.0, view.cpu_cores)) if envs else 0.0
    return SimNode(name, view, cfg, envs, layers, snaps, draw(st.booleans() | st.just(True)), used)


clusters = st.integers(1, 8).flatmap(lambda n: st.tuples(*[sim_nodes(f"n{i}") for i in range(n)]))
requests = st.builds(
    lambda cpu, mn, mx, layers, snap, local: PlacementRequest(
        layers=tuple((d, 100 * MiB) for d in layers), cpu_min_cores=cpu, memory_min_bytes=mn,
        memory_max_bytes=max(mn, mx), snapshot="snap-a" if snap else None, snapshot_home="n0" if snap else None,
        snapshot_local=snap and local),
    st.sampled_from([0.05, 0.25, 1.0, 3.0]), st.sampled_from([1, 16, 64, 256, 1024, 4096]).map(lambda m: m * MiB),
    st.integers(1, 64).map(lambda g: g * GiB // 4), st.lists(st.sampled_from(DIGESTS), max_size=4),
    st.booleans(), st.booleans())


@settings(max_examples=400, deadline=None)
@given(clusters, requests)
def test_ranks_exactly_the_nodes_whose_daemon_admits(cluster, req):
    ranked = place([n.report() for n in cluster], req)
    chosen = {c.node for c in ranked}
    for n in cluster:
        allowed = n.admits(req) and (not req.snapshot_local or n.name == req.snapshot_home)
        assert (n.name in chosen) == allowed, (n.name, n.admits(req))


@settings(max_examples=300, deadline=None)
@given(clusters, requests, st.sampled_from([0.0, 0.1, 0.25, 1.0]))
def test_order_load_band_then_cache_bytes_then_home_then_least_loaded(cluster, req, band):
    ranked = place([n.report() for n in cluster], req, band=band)
    if not ranked:
        return
    by_name = {n.name: n for n in cluster}
    for c in ranked:  # busy: the larger of the committed and in-use shares; load: plus 1 % per env
        n = by_name[c.node]
        cores = n.report().capacity.cpu_cores
        assert c.envs == len(n.envs)
        assert c.busy == pytest.approx(max(c.committed_share, n.used / cores))
        assert c.load == pytest.approx(c.busy + 0.01 * len(n.envs))
    least = min(c.busy for c in ranked)
    in_band = [c for c in ranked if c.busy <= least + band + 1e-9]
    rest = ranked[len(in_band):]
    # the nodes within the band of the least busy come first, and only they compete on cache
    assert all(c.busy > least + band + 1e-9 for c in rest)
    keys = [(-c.cached_bytes if (c.cached_bytes or c.home) else 1, not c.home, c.load, c.node)
            for c in in_band]
    assert keys == sorted(keys)
    assert [(c.load, c.node) for c in rest] == sorted((c.load, c.node) for c in rest)
    for c in ranked:  # cached bytes: the plan's bytes (its sizes) of the layers the node holds, each once
        held = {x.digest for x in by_name[c.node].layers} | {d for s in by_name[c.node].snapshots for d, _ in s.layers}
        assert c.cached_bytes == sum(size for d, size in dict(reversed(req.layers)).items() if d in held)


@settings(max_examples=300, deadline=None)
@given(clusters, requests, st.integers(1, 40))
def test_a_group_never_exceeds_any_nodes_minimums(cluster, req, n):
    by_name = {x.name: x for x in cluster}
    try:
        nodes = place_group(ClusterView([x.report() for x in cluster]), req, n)
    except PlacementError as e:
        assert "node" in str(e)
        return
    assert len(nodes) == n
    placed: dict[str, list[EnvLimits]] = {}
    for name in nodes:  # each env is admitted by its daemon next to the ones placed before it
        assert by_name[name].admits(req, placed.get(name, [])), name
        placed.setdefault(name, []).append(limits_of(req))
    # the best node is filled before the next one is used: nodes appear in rank order, each in one run
    runs = [name for i, name in enumerate(nodes) if i == 0 or nodes[i - 1] != name]
    assert len(runs) == len(set(runs))
    order = [c.node for c in place([x.report() for x in cluster], req)]
    assert runs == [x for x in order if x in runs]


def node(name, *, cpu=2.0, committed_cpu=0.0, mem=8 * GiB, committed_mem=0, headroom=None, layers=(), snaps=(),
         accepting=True, envs=0, used=0.0):
    return NodeReport(node=name, accepting=accepting, layers=list(layers), snapshots=list(snaps), capacity=Capacity(
        cpu_cores=cpu, cpu_committed_cores=committed_cpu, memory_total_bytes=mem + 512 * MiB,
        memory_guaranteed_bytes=mem, memory_committed_bytes=committed_mem,
        memory_headroom_bytes=mem - committed_mem if headroom is None else headroom, envs=envs, cpu_used_cores=used))


REQ = PlacementRequest(layers=((DIGESTS[0], 300 * MiB), (DIGESTS[1], 50 * MiB)), cpu_min_cores=0.25,
                       memory_min_bytes=256 * MiB, memory_max_bytes=1 * GiB)


def test_cache_affinity_beats_a_less_committed_node_within_the_load_band():
    held = [LayerHeld(digest=DIGESTS[0], size_bytes=300 * MiB, where="tree")]
    ranked = place([node("a"), node("b", committed_cpu=0.4, layers=held), node("c")], REQ)  # 20 % committed
    assert [c.node for c in ranked] == ["b", "a", "c"] and ranked[0].cached_bytes == 300 * MiB


def test_cache_affinity_never_piles_envs_past_the_load_band():
    # the benchmark's pile-up: every env went to the one node with the plan cached, however loaded
    held = [LayerHeld(digest=DIGESTS[0], size_bytes=300 * MiB, where="tree")]
    nodes = [node("a"), node("b", committed_cpu=1.5, layers=held), node("c", committed_cpu=0.2)]
    assert [c.node for c in place(nodes, REQ)] == ["a", "c", "b"]  # b is 75 % committed, a 0 %
    assert [c.node for c in place(nodes, REQ, band=1.0)] == ["b", "a", "c"]  # a band of all: cache first
    assert [c.node for c in place(nodes, REQ, band=0.1)] == ["a", "c", "b"]


def test_a_bad_band_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("WEENV_PLACEMENT_BAND", "lots")
    with pytest.raises(PlacementError, match="WEENV_PLACEMENT_BAND='lots'"):
        place([node("a", layers=[LayerHeld(digest=DIGESTS[0], size_bytes=1, where="tree")])], REQ)


def test_snapshot_home_breaks_a_tie_of_cached_bytes_and_a_local_snapshot_stays_home():
    req = PlacementRequest(cpu_min_cores=0.25, memory_min_bytes=64 * MiB, memory_max_bytes=GiB,
                           snapshot="snap-x", snapshot_home="c")
    assert [c.node for c in place([node("a"), node("b"), node("c", committed_cpu=0.4)], req)][0] == "c"
    local = PlacementRequest(cpu_min_cores=0.25, memory_min_bytes=64 * MiB, memory_max_bytes=GiB,
                             snapshot="snap-x", snapshot_home="c", snapshot_local=True)
    assert [c.node for c in place([node("a"), node("b"), node("c")], local)] == ["c"]
    with pytest.raises(PlacementError, match="local to node c .*publish"):
        place_group(ClusterView([node("a"), node("c", committed_cpu=2.0)]), local, 1)


def test_a_group_spreads_only_when_the_best_node_is_full():
    view = ClusterView([node("a", cpu=1.0), node("b", cpu=2.0, layers=[
        LayerHeld(digest=DIGESTS[0], size_bytes=300 * MiB, where="envlet")])])
    assert place_group(view, REQ, 8) == ["b"] * 8
    assert place_group(view, REQ, 10) == ["b"] * 8 + ["a"] * 2
    with pytest.raises(PlacementError, match="only 12 of 13"):
        place_group(view, REQ, 13)


def test_refusals_say_why():
    with pytest.raises(PlacementError) as e:
        place_group(ClusterView([node("a", accepting=False), node("b", mem=512 * MiB),
                                 node("c", committed_cpu=2.0)]), REQ, 1)
    msg = str(e.value)
    assert "not accepting" in msg and "memory max above" in msg and "cpu mins already guaranteed" in msg


def test_duplicate_node_names_are_refused():
    with pytest.raises(PlacementError, match="unique"):
        ClusterView([node("a"), node("a")])


# ---------------------------------------------------------------------------- small envs spread

SMALL = PlacementRequest(layers=((DIGESTS[0], 300 * MiB), (DIGESTS[1], 50 * MiB)), cpu_min_cores=0.02,
                         memory_min_bytes=16 * MiB, memory_max_bytes=128 * MiB)  # the benchmark's envs
HELD = [LayerHeld(digest=DIGESTS[0], size_bytes=300 * MiB, where="envlet"),
        LayerHeld(digest=DIGESTS[1], size_bytes=50 * MiB, where="envlet")]


def test_a_burst_of_small_envs_spreads_over_equally_cached_nodes():
    # 12 creates at once (slime's rollout, E2B clients): none is in a report yet when the next is
    # placed. Counted as pending, they spread 4/4/4; without, every one went to node "a"
    reports = [node(n, layers=HELD) for n in "abc"]
    pending: dict[str, list[PlacementRequest]] = {n: [] for n in "abc"}
    placed = []
    for _ in range(12):
        view = ClusterView([with_pending(r, pending[r.node]) for r in reports])
        best = rank(view, SMALL, limit=1)[0]
        assert best.cached_bytes == 350 * MiB
        pending[best.node].append(SMALL)
        placed.append(best.node)
    assert placed[:3] == ["a", "b", "c"] and {n: placed.count(n) for n in "abc"} == {"a": 4, "b": 4, "c": 4}


def test_env_count_and_cpu_in_use_break_ties_of_committed_share():
    # the same committed share (0.2 cores of 2): 1 % per env, and the CPU the envs use now, tell them apart
    nodes = [node("a", committed_cpu=0.2, layers=HELD, envs=10), node("b", committed_cpu=0.2, layers=HELD, envs=1),
             node("c", committed_cpu=0.2, layers=HELD, envs=4)]
    assert [c.node for c in place(nodes, SMALL)] == ["b", "c", "a"]
    busy = [node("a", committed_cpu=0.2, layers=HELD, envs=2, used=1.6), node("b", committed_cpu=0.2, layers=HELD, envs=2),
            node("c", committed_cpu=0.4, layers=HELD, envs=2)]
    ranked = place(busy, SMALL)
    assert [c.node for c in ranked] == ["b", "c", "a"]  # a's envs use 80 % of its CPU
    assert ranked[2].load == pytest.approx(0.8 + 0.02) and ranked[0].committed_share == pytest.approx(0.1)


def test_cache_affinity_still_wins_over_env_count_and_cpu_in_use_only_past_the_band():
    nodes = [node("a", envs=0), node("b", layers=HELD, envs=40), node("c", layers=HELD[:1], envs=0)]
    assert [c.node for c in place(nodes, SMALL)] == ["b", "c", "a"]  # the env count is no load band
    busy = [node("a"), node("b", layers=HELD, envs=4, used=0.8)]  # its envs use 40 % of it: past the band
    assert [c.node for c in place(busy, SMALL)] == ["a", "b"]
    assert [c.node for c in place(busy, SMALL, band=1.0)] == ["b", "a"]


def test_nodes_holding_the_same_layers_tie_on_cache_bytes_whatever_size_they_report():
    # a layer tree's bytes on disk are not its blob's size: the plan's sizes are what is compared
    trees = [LayerHeld(digest=DIGESTS[0], size_bytes=900 * MiB, where="tree"),
             LayerHeld(digest=DIGESTS[1], size_bytes=70 * MiB, where="tree")]
    ranked = place([node("a", layers=trees, envs=3), node("b", layers=HELD), node("c", layers=HELD, envs=1)], SMALL)
    assert [c.node for c in ranked] == ["b", "c", "a"] and {c.cached_bytes for c in ranked} == {350 * MiB}


def test_pending_envs_count_their_mins_and_layers():
    r = node("a", committed_cpu=0.5, committed_mem=GiB, envs=3, layers=HELD[:1])
    got = with_pending(r, [SMALL, SMALL])
    c = got.capacity
    assert c.envs == 5 and c.cpu_committed_cores == pytest.approx(0.54)
    assert c.memory_committed_bytes == GiB + 32 * MiB and c.memory_headroom_bytes == r.capacity.memory_headroom_bytes - 32 * MiB
    assert sorted(x.digest for x in got.layers) == [DIGESTS[0], DIGESTS[1]]  # each layer once
    assert with_pending(r, []) is r


@settings(max_examples=200, deadline=None)
@given(clusters, requests, st.integers(1, 30))
def test_a_burst_placed_with_pending_never_exceeds_any_nodes_minimums(cluster, req, n):
    # each create placed on reports that do not show the ones before it, only their pending entries
    by_name = {x.name: x for x in cluster}
    reports = [x.report() for x in cluster]
    pending: dict[str, list[PlacementRequest]] = {x.name: [] for x in cluster}
    for _ in range(n):
        ranked = rank(ClusterView([with_pending(r, pending[r.node]) for r in reports]), req, limit=1)
        if not ranked:
            break
        name = ranked[0].node
        assert by_name[name].admits(req, [limits_of(q) for q in pending[name]]), name
        pending[name].append(req)


# ---------------------------------------------------------------------------- locks as the codec reads them

LOCK_TOML = f"""# weenv plan lock: every group pinned to digests. Made by `weenv plan lock`; do not edit.
lock_version = 1
name = "task"

[[groups]]
name = "os"
ref = "127.0.0.1:5000/ct/os:test"
class = "os"
digest = "sha256:{'7' * 64}"
layer_digest = "{DIGESTS[0]}"
layer_size = 3145728
toc_digest = "sha256:{'8' * 64}"
registry = "127.0.0.1:5000"
repo = "ct/os"

[resources]
pids = 128
disk = "32MiB"

[resources.cpu]
min = 0.25
max = 1.0

[resources.memory]
min = "256MiB"
max = "1GiB"
"""
WANT = PlacementRequest(layers=((DIGESTS[0], 3 * MiB),), cpu_min_cores=0.25, memory_min_bytes=256 * MiB,
                        memory_max_bytes=GiB)


def test_a_toml_lock_with_human_sizes_places_as_its_json_form_and_as_the_decoded_lock():
    # what `weenv plan lock` writes: sizes as strings. Placement read them with int(): a 500 at the gateway
    import json
    import tomllib

    from weenv.cluster import request_for
    from weenv.plan import dump_plan, load_any, parse_document, plan_to_builtins

    lock = load_any(LOCK_TOML, source="task.lock")
    forms = {"tomllib": tomllib.loads(LOCK_TOML), "parse_document": parse_document(LOCK_TOML)[0], "Lock": lock,
             "plan_to_builtins": plan_to_builtins(lock), "human builtins": plan_to_builtins(lock, human_sizes=True),
             "JSON lock": json.loads(dump_plan(lock, "json"))}
    for form, doc in forms.items():
        assert request_for(doc) == WANT, form
    nodes = [node("a", mem=512 * MiB), node("b", layers=[LayerHeld(digest=DIGESTS[0], size_bytes=3 * MiB, where="tree")]),
             node("c", committed_mem=7937 * MiB)]
    assert {form: [c.node for c in place(nodes, request_for(doc))] for form, doc in forms.items()} == \
        {form: ["b"] for form in forms}  # a: max above what it gives one env; c: its memory mins taken


def test_a_lock_the_codec_refuses_is_a_plan_error_naming_the_place():
    import tomllib

    from weenv.cluster import request_for
    from weenv.plan import PlanValidationError

    doc = tomllib.loads(LOCK_TOML.replace('min = "256MiB"', 'min = "lots"'))
    with pytest.raises(PlanValidationError, match=r"^task\.lock: resources\.memory\.min: .*lots"):
        request_for(doc, source="task.lock")
    with pytest.raises(PlanValidationError, match=r"groups\[0\]\.layer_size"):
        request_for({**doc, "resources": {}, "groups": [{**doc["groups"][0], "layer_size": "3MiB"}]})


def _cluster_of(reports):
    """A Cluster (no Ray) whose nodes are HEALTHY with these reports."""
    from weenv.cluster import Cluster, NodeState

    class Handle:
        def __init__(self, name):
            self.name = name

        def start_report(self):
            raise AssertionError("not polled")

    cluster = Cluster(token=None)
    for r in reports:
        entry = cluster.reconciler.add(Handle(r.node))
        entry.state, entry.report = NodeState.HEALTHY, r
    return cluster


def test_the_gateway_places_a_toml_lock_and_answers_400_bad_plan_for_one_the_codec_refuses():
    import httpx
    import msgspec
    import trio

    from weenv._wire import HttpError
    from weenv.cluster._backend import ClusterBackend

    cluster = _cluster_of([node("a"), node("b", layers=[LayerHeld(digest=DIGESTS[0], size_bytes=1, where="tree")])])
    backend = ClusterBackend(cluster, "tok")
    body = {"plan_text": LOCK_TOML, "format": "toml", "source": "task.lock"}  # weenv.Client.create("task.lock")
    assert backend.request_for_body(body) == WANT
    assert backend.request_for_body({**body, "overrides": {"memory": "64MiB-512MiB"}}) == \
        msgspec.structs.replace(WANT, memory_min_bytes=64 * MiB, memory_max_bytes=512 * MiB)
    assert cluster.place(backend.request_for_body(body))[0] == ["b", "a"]

    async def create(doc):
        try:
            await backend.create(doc)
        except HttpError as e:
            return e.status, {"error": {"kind": e.kind, "message": e.message}}
        raise AssertionError("created")

    for doc, where in (({**body, "plan_text": LOCK_TOML.replace('"1GiB"', '"a lot"')}, "task.lock: resources.memory.max"),
                       ({**body, "plan_text": LOCK_TOML.replace("layer_size = 3145728", 'layer_size = "3MiB"')},
                        "task.lock: groups[0].layer_size"),
                       ({"plan": {**msgspec.json.decode(msgspec.json.encode(
                           __import__("tomllib").loads(LOCK_TOML))), "name": ""}}, "request body $.plan: name")):
        status, answer = trio.run(create, doc)
        assert status == 400 and answer["error"]["kind"] == "bad_plan", answer
        assert answer["error"]["message"].startswith(where), answer


def test_a_creates_cpu_and_memory_overrides_are_what_it_is_placed_by():
    """Cluster.create(overrides=...) and the gateway place an env by the minimums its node will
    admit it with (the override's), not by the plan's (issue 26 leftover: slime passes cpu)."""
    from weenv.cluster._placement import with_overrides

    req = PlacementRequest(cpu_min_cores=0.25, memory_min_bytes=256 << 20, memory_max_bytes=1 << 30)
    got = with_overrides(req, {"cpu": "1.5-2", "memory": "512MiB-2GiB", "env": {"A": "b"}})
    assert (got.cpu_min_cores, got.memory_min_bytes, got.memory_max_bytes) == (1.5, 512 << 20, 2 << 30)
    assert with_overrides(req, {"cpu": 0.5}).cpu_min_cores == 0.5 and with_overrides(req, None) is req
    with pytest.raises(ValueError, match="overrides: .*lots"):
        with_overrides(req, {"memory": "lots"})
