"""A real Ray cluster of 3 nodes on 127.0.0.1, each with its own weenv daemon, $WEENV_HOME and cgroup
root; the cluster's store is the loopback docker-registry.

The nodes are ``ray.cluster_utils.Cluster`` raylets; each node's environment carries its home
(``env_vars={"WEENV_HOME": ...}``, as ``WEENV_HOME=/tmp/n2 ray start`` would), so the agents find
their daemons exactly as on real nodes. The tests run in file order on one cluster (module
fixture); the teardown stops every daemon, envlet, mount, cgroup and Ray process they made.
"""

from __future__ import annotations

import os

# Ray resolves "127.0.0.1" to the machine's external address for drivers on Linux unless told this
# is a single-host cluster; its raylets get node_ip_address=127.0.0.1 below. Set before Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.fixtures_common import require_command, require_fuse, require_root  # noqa: E402

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "cluster-test-token"
PUBLISHED: dict[str, str] = {}  # the published snapshot, for the restarted client's test


def _publish_plans(host: str, work: Path) -> tuple[dict, dict]:
    """Two plan locks on the shared registry: busybox, and busybox + a task group."""
    from weenv.plan import load_plan, lock_plan, plan_to_builtins
    from weenv.registry import publish, resolve_group
    from weenv.testing import busybox_tree

    src = busybox_tree(work / "src-busybox")
    publish(str(src), f"{host}/ct/os:test", group="os", group_class="os")
    task = work / "src-task"
    (task / "task").mkdir(parents=True)
    (task / "task" / "data.bin").write_bytes(os.urandom(256 << 10))
    publish(str(task), f"{host}/ct/task:one", group="task", group_class="task")
    res = ('[resources]\npids = 128\ndisk = "32MiB"\n\n[resources.cpu]\nmin = 0.05\nmax = 0.5\n\n'
           '[resources.memory]\nmin = "32MiB"\nmax = "256MiB"\n')
    plans = []
    for name, groups in (("bb", [("os", f"{host}/ct/os:test", "os")]),
                         ("bt", [("os", f"{host}/ct/os:test", "os"), ("task", f"{host}/ct/task:one", "task")])):
        text = f'name = "{name}"\n\n' + "".join(
            f'[[groups]]\nname = "{g}"\nref = "{r}"\nclass = "{c}"\n\n' for g, r, c in groups) + res
        path = work / f"{name}.toml"
        path.write_text(text)
        plans.append(plan_to_builtins(lock_plan(load_plan(str(path)), resolve_group)))
    return plans[0], plans[1]


class RayWeenv:
    def __init__(self, ray_cluster, cluster, homes, roots, plan_bb, plan_bt, registry_host):
        self.ray_cluster, self.cluster, self.homes, self.roots = ray_cluster, cluster, homes, roots
        self.plan_bb, self.plan_bt, self.registry_host = plan_bb, plan_bt, registry_host
        port = ray_cluster.ray_client_port
        self.ray_client = f"ray://127.0.0.1:{port}" if port else None  # the head's Ray client server

    def node_names(self):
        return sorted(self.cluster.clients)


@pytest.fixture(scope="module")
def rw(registry, tmp_path_factory):
    require_root()
    require_fuse()
    require_command("crun")
    import weenv.cluster as wc
    from weenv.cluster import LocalCluster
    from weenv.cluster._local import home_processes

    t0 = time.monotonic()
    plan_bb, plan_bt = _publish_plans(registry.host, tmp_path_factory.mktemp("cluster-plans"))
    local = LocalCluster(nodes=3, ray_client_port=_free_port() if _has_ray_client() else None)
    cluster = None
    try:
        local.start()
        cluster = wc.connect(token=TOKEN, store=f"{registry.host}/ct/snaps", report_interval_s=0.5,
                             call_timeout_s=5.0, failure_threshold=3, wait_s=120,
                             agent_options={"peer_listen": "127.0.0.1:0"})  # every envlet with the peer tier
        cluster.wait_ready(60, nodes=3)
        print(f"cluster of 3 nodes up in {time.monotonic() - t0:.1f} s")
        yield RayWeenv(local, cluster, local.homes, local.cgroup_roots, plan_bb, plan_bt, registry.host)
    finally:
        if cluster is not None:
            cluster.close()
        t1 = time.monotonic()
        left = local.stop()
        print(f"teardown: {time.monotonic() - t1:.1f} s")
        assert not left, f"the cluster tests left: {left}"
        # no daemon (or envlet) of the nodes' homes outlives their Ray cluster (issue 26 item 5)
        assert not home_processes(local.homes), home_processes(local.homes)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_ray_client() -> bool:
    try:
        import grpc  # noqa: F401  (ray[client])
    except ImportError:
        return False
    return True


def _ray_pids() -> set[int]:
    import psutil

    me = psutil.Process()
    return {p.pid for p in me.children(recursive=True)}


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1: a v6 socket bound to the v4 loopback
    return (mapped or addr).is_loopback


def test_one_agent_per_node_each_with_its_own_home_daemon_and_cgroup_root(rw):
    import psutil

    hellos = {name: rw.cluster.clients[name].hello() for name in rw.node_names()}
    assert len(hellos) == 3
    assert sorted(h["home"] for h in hellos.values()) == sorted(rw.homes)
    assert sorted(h["cgroup_root"] for h in hellos.values()) == sorted(rw.roots)
    assert len({h["daemon_pid"] for h in hellos.values()}) == 3 and all(h["started_daemon"] for h in hellos.values())
    assert all(h["token_required"] for h in hellos.values())
    for name in rw.node_names():
        rep = rw.cluster.report(name)
        assert rep.healthy and rep.accepting and rep.capacity.cpu_cores > 0, rep.problem
        assert rep.daemon_address == f"unix://{rep.home}/run/weenv.sock"
    # every listening socket of the Ray processes and daemons this test started is on loopback
    pids = _ray_pids() | {h["daemon_pid"] for h in hellos.values()}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert listening
    outside = [(c.pid, c.laddr) for c in listening if not _loopback(c.laddr.ip)]
    print(f"{len(listening)} listening sockets of the cluster's processes: "
          f"{sorted({c.laddr.ip for c in listening})}")
    assert not outside, outside


def test_a_call_without_the_token_is_refused(rw):
    from weenv.cluster import ClusterAuthError, NodeClient

    name = rw.node_names()[0]
    stranger = NodeClient(name, rw.cluster.clients[name].actor, "not-the-token")
    with pytest.raises(ClusterAuthError):
        stranger.call("GET", "/v1/envs")


def test_env_ids_name_their_node_and_creates_spread(rw):
    c = rw.cluster
    warm = [c.create(rw.plan_bb, node=name) for name in rw.node_names()]  # every node caches the plan
    for env in warm:
        assert env.id.startswith(env.node + "-"), env.id
        env.kill()
    from weenv.cluster import request_for

    envs, seen = [], []
    for _ in range(3):
        seen.append([(x.node, x.cached_bytes, round(x.committed_share, 4))
                     for x in c.rank(request_for(rw.plan_bb))])
        envs.append(c.create(rw.plan_bb))
    try:
        assert sorted(e.node for e in envs) == rw.node_names(), seen  # equal caches: least committed first
        for e in envs:
            assert e.exec("echo hi from $(hostname)").stdout.decode().strip() == f"hi from {e.id}"
    finally:
        for e in envs:
            e.kill()


def test_an_env_whose_plan_is_cached_on_b_lands_on_b(rw):
    c = rw.cluster
    b = rw.node_names()[1]
    first = c.create(rw.plan_bt, node=b)  # b now has the task layer too
    busy = c.create(rw.plan_bb, node=b)  # and is the most committed node
    first.kill()
    try:
        rep = c.report(b)
        task_digest = rw.plan_bt["groups"][1]["layer_digest"]
        assert task_digest in {x.digest for x in rep.layers}
        # what is asked: cached bytes win among nodes in the load band. CPU the envs just spent
        # starting (the last 200 ms tick, in b's report) can put b out of the band for a moment on
        # a loaded machine, and that is placement working: wait (bounded) for the nodes to be idle
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            c.refresh()
            if all(c.report(n).capacity.cpu_used_cores < 0.1 for n in rw.node_names()):
                break
            time.sleep(0.2)
        print("idle wait:", round(15 - (deadline - time.monotonic()), 2), "s;",
              {n: round(c.report(n).capacity.cpu_used_cores, 3) for n in rw.node_names()})
        env = c.create(rw.plan_bt)
        assert env.node == b, {n: c.report(n).capacity for n in rw.node_names()}
        assert env.exec("wc -c < /task/data.bin").stdout.decode().strip() == str(256 << 10)
        env.write_file("/root/in.txt", b"through the agent\n", mode=0o600)
        assert env.read_file("/root/in.txt") == b"through the agent\n"
        assert env.exec("stat -c %a /root/in.txt").stdout.decode().strip() == "600"
        env.kill()
    finally:
        busy.kill()


def test_a_layer_read_on_node_a_is_fetched_from_a_by_node_b_not_from_the_registry(rw, tmp_path):
    """Issue 20: the cluster gives every envlet its peer table out of the node reports."""
    from weenv.envlet import EnvletClient
    from weenv.plan import load_plan, lock_plan, plan_to_builtins
    from weenv.registry import publish, resolve_group

    c = rw.cluster
    a, b = rw.node_names()[0], rw.node_names()[2]
    src = tmp_path / "src"
    (src / "task").mkdir(parents=True)
    (src / "task" / "data.bin").write_bytes(os.urandom(3 << 20))  # a layer no node has seen
    publish(str(src), f"{rw.registry_host}/ct/peer:one", group="task", group_class="task")
    text = (f'name = "pt"\n\n[[groups]]\nname = "os"\nref = "{rw.registry_host}/ct/os:test"\nclass = "os"\n\n'
            f'[[groups]]\nname = "task"\nref = "{rw.registry_host}/ct/peer:one"\nclass = "task"\n\n'
            '[resources]\npids = 128\ndisk = "32MiB"\n\n[resources.cpu]\nmin = 0.05\nmax = 0.5\n\n'
            '[resources.memory]\nmin = "32MiB"\nmax = "256MiB"\n')
    (tmp_path / "pt.toml").write_text(text)
    plan = plan_to_builtins(lock_plan(load_plan(str(tmp_path / "pt.toml")), resolve_group))
    digest = plan["groups"][1]["layer_digest"]
    on_a = c.create(plan, node=a)
    try:
        assert on_a.exec("md5sum /task/data.bin").exit_code == 0  # every chunk now in a's disk cache
        a_addr = c.report(a).peer_address
        assert a_addr.startswith("127.0.0.1:"), c.report(a)
        b_envlet = EnvletClient(os.path.join(c.report(b).home, "run", "envlet.sock"))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # a's next report names the layer; then b's table does
            peers = b_envlet.stats()["peer"]["tier"]["peers"]
            if a_addr in peers and digest in {x.digest for x in c.report(a).layers} and peers[a_addr]["layers"] >= 2:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"b's envlet never got a's layers: {b_envlet.stats()['peer']}")
        on_b = c.create(plan, node=b)
        try:
            want = on_a.exec("md5sum /task/data.bin").stdout
            assert on_b.exec("md5sum /task/data.bin").stdout == want
            tiers = b_envlet.stats()["layer_tiers"][digest]  # while registered: per layer digest
        finally:
            on_b.kill()
        print("node b, layer tiers of the new layer:", tiers)
        assert tiers.get("peer", {}).get("bytes", 0) >= 1 << 20, tiers
        assert tiers.get("registry", {}).get("bytes", 0) == 0, tiers
    finally:
        on_a.kill()


def test_a_fork_of_a_snapshot_held_on_node_a(rw):
    c = rw.cluster
    a = rw.node_names()[0]
    src = c.create(rw.plan_bb, node=a)
    try:
        src.exec("echo state-of-a > /root/state")
        snap = src.commit()
        assert snap.startswith("snap-")
        rw.cluster.refresh()
        assert any(s.id == snap and s.ref is None for s in c.report(a).snapshots)  # node-local
        child = c.create(snapshot=snap)
        assert child.node == a  # a node-local snapshot starts only at home
        assert child.exec("cat /root/state").stdout.decode() == "state-of-a\n"
        child.kill()
        kids = src.fork(2)
        assert [k.node for k in kids] == [a, a]
        assert all(k.exec("cat /root/state").stdout.decode() == "state-of-a\n" for k in kids)
        for k in kids:
            k.kill()
    finally:
        src.kill()


def test_a_published_snapshot_forked_onto_node_c(rw):
    from weenv.cluster import load_published

    c = rw.cluster
    a, _, node_c = rw.node_names()
    src = c.create(rw.plan_bb, node=a)
    try:
        src.exec("echo published-state > /root/state")
        ref = src.commit(publish=True)
        assert ref.startswith(f"{rw.registry_host}/ct/snaps:snap-")
        lock = load_published(ref)  # any client reads it from the store
        assert lock["groups"][-1]["registry"] == rw.registry_host
        snap = ref.rsplit(":", 1)[1]
        assert any(s.id == snap and s.ref == ref for s in c.report(a).snapshots)  # the home says it is published
        PUBLISHED["snapshot"] = snap
        child = c.create(snapshot=ref, node=node_c)
        assert child.node == node_c
        assert child.exec("cat /root/state").stdout.decode() == "published-state\n"
        top = lock["groups"][-1]["layer_digest"]
        assert any(x.digest == top and x.where == "envlet" for x in c.report(node_c).layers)  # lazily, by its envlet
        child.kill()
    finally:
        src.kill()


def test_deleting_a_published_snapshot_removes_it_from_its_home_and_from_the_store(rw):
    from weenv.cluster import ClusterError
    from weenv.registry import NotFoundError, open_store, parse_ref

    c = rw.cluster
    a, b, _ = rw.node_names()
    src = c.create(rw.plan_bb, node=a)
    child = None
    try:
        src.exec("echo doomed > /root/state")
        ref = src.commit(publish=True)
        snap = ref.rsplit(":", 1)[1]
        child = c.create(snapshot=ref, node=b)
        c.delete_snapshot(snap)
        assert _held_on(rw, snap) == []
        r = parse_ref(ref)
        with open_store(r.registry) as store:
            with pytest.raises(NotFoundError):
                store.resolve(r.repo, r.tag)
            assert [t for t in store.list_tags(r.repo) if t.startswith(snap)] == []  # its layers' tags too
        with pytest.raises((ClusterError, NotFoundError)):
            c.create(snapshot=ref, node=b)
        assert child.exec("cat /root/state").stdout == b"doomed\n"  # started from it: reads on
    finally:
        if child is not None:
            child.kill()
        src.kill()


def test_a_group_of_forks_spreads_when_the_home_node_cannot_take_them_all(rw):
    c = rw.cluster
    a = rw.node_names()[0]
    src = c.create(rw.plan_bb, node=a, overrides={"cpu": "0.9-1"})  # a node (2 cores) guarantees two of these
    kids = []
    try:
        src.exec("echo group-state > /root/state")
        kids = src.fork(3)
        nodes = [k.node for k in kids]
        # the home admits one more only, so the group spreads through the store; the home (45 %
        # committed) is past the load band of the empty nodes, so they come first
        assert nodes.count(a) <= 1 and len(set(nodes)) >= 2, nodes
        assert all(k.exec("cat /root/state").stdout.decode() == "group-state\n" for k in kids)
    finally:
        for k in kids:
            k.kill()
        src.kill()


def test_a_restarted_gateway_rebuilds_routing_from_node_reports(rw):
    import weenv.cluster as wc

    envs = [rw.cluster.create(rw.plan_bb, node=name) for name in rw.node_names()]
    try:
        fresh = wc.Cluster(token=TOKEN, report_interval_s=0.5).start()  # finds the same agents by name
        try:
            fresh.wait_ready(30, nodes=3)
            routes = fresh.routes()
            if "snapshot" in PUBLISHED:  # by its id too: a fresh client finds its ref in the home's report
                snap = PUBLISHED["snapshot"]
                home = next(r.node for r in fresh.reconciler.reports() if any(x.id == snap for x in r.snapshots))
                moved = fresh.create(snapshot=snap, node=next(n for n in rw.node_names() if n != home))
                assert moved.exec("cat /root/state").stdout == b"published-state\n"
                moved.kill()
            for e in envs:
                assert routes[e.id] == e.node
                assert fresh.get(e.id).exec("echo ok").stdout == b"ok\n"
        finally:
            fresh.close()
    finally:
        for e in envs:
            e.kill()


def test_a_slime_rollout_step_spreads_its_groups_over_the_cluster(rw, fake_sglang, tmp_path):
    """Two groups of 3 samples (fork per group) through slime_plugin with a cluster address: each
    group's leader is placed, its snapshot published, the followers start from it."""
    import asyncio
    import json

    from slime_plugin import _state as plugin_state
    from slime_plugin import rollout as plugin_rollout
    from weenv.testing import Sample, sampling_params, slime_args, turns

    lock = tmp_path / "bb.lock.json"
    lock.write_text(json.dumps(rw.plan_bb))
    fake_sglang.reply = turns(["<bash>cat /task/seed && hostname</bash>", "<answer>ok</answer>"])
    fake_sglang.latency_s = 0.3  # the samples' envs live at the same time
    # each env guarantees 0.9 cores: a node (2 cores) admits two, so six envs need all three nodes
    args = slime_args(fake_sglang, weenv_cluster="auto", weenv_cluster_token=TOKEN, weenv_cpu="0.9-1",
                      weenv_cluster_store=f"{rw.registry_host}/ct/snaps", weenv_plan=str(lock), n_samples_per_prompt=3,
                      weenv_setup=["mkdir -p /task && echo seeded > /task/seed"],
                      weenv_evaluator={"command": "grep -q seeded /task/seed"})
    samples = [Sample(index=i, group_index=i // 3, prompt="p") for i in range(6)]
    before = {n: rw.cluster.report(n).capacity.admitted for n in rw.node_names()}

    async def main():
        try:
            await asyncio.gather(*(plugin_rollout.generate(args, x, sampling_params()) for x in samples))
            return plugin_rollout.statistics()
        finally:
            await plugin_state.close_loop_states()

    try:
        stats = asyncio.run(main())
    finally:
        for cluster in plugin_state._clusters.values():
            cluster.close()
        plugin_state._clusters.clear()
    for x in samples:
        assert x.status is Sample.Status.COMPLETED, x.metadata.get("abort_reason")
        assert x.reward == 1.0 and "seeded" in x.response
    assert stats["group_leaders"] == 2 and stats["commits"] == 2 and stats["created_from_snapshot"] == 6
    rw.cluster.refresh()
    used = [n for n in rw.node_names() if rw.cluster.report(n).capacity.admitted > before[n]]
    print("envs admitted per node:", {n: rw.cluster.report(n).capacity.admitted - before[n] for n in rw.node_names()})
    assert len(used) == 3
    for n in rw.node_names():  # reports taken now: refresh() reads each agent's last one (up to a tick old)
        rw.cluster.refresh_node(n)
    assert not rw.cluster.routes()  # every env of the step is gone


IMAGE_ROUTING = ["--image-metadata-key", "image", "--image-size-key", "size", "--image-size", "sm=0.5:96MiB",
                 "--image-size", "lg=1:192MiB"]
"""Creates whose metadata names an image start it (slime's E2BSandbox), sized by ``size``."""


class Gateway:
    """``weenv cluster serve`` as its own process (what runs on a head node), with its API keys."""

    def __init__(self, rw, home: Path):
        import socket

        from weenv.api import KeyStore, TemplateStore

        self.rw, self.home = rw, home
        api = home / "api"
        self.keys = {"alice": KeyStore(str(api)).create("alice"), "root": KeyStore(str(api)).create("root", admin=True)}
        lock = home / "bb.lock.json"
        lock.write_text(__import__("json").dumps(rw.plan_bb))
        TemplateStore(str(api)).set("bb", str(lock))
        big = home / "bb-big.lock.json"  # two fill a node's 2 cores (E2B creates take no cpu override)
        plan_big = __import__("copy").deepcopy(rw.plan_bb)
        plan_big.setdefault("resources", {})["cpu"] = {"min": 0.9, "max": 1.0}
        big.write_text(__import__("json").dumps(plan_big))
        TemplateStore(str(api)).set("bb-big", str(big))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.address = rw.ray_cluster.ray_cluster.address
        self.proc = None

    def start(self) -> None:
        import subprocess
        import sys

        import httpx

        log = open(self.home / "gateway.log", "ab")
        env = {**os.environ, "WEENV_HOME": str(self.home), "WEENV_CLUSTER_TOKEN": TOKEN}
        self.proc = subprocess.Popen([sys.executable, "-m", "weenv", "cluster", "serve", "--ray-address", self.address,
                                      "--listen", f"127.0.0.1:{self.port}", "--node-ip", "127.0.0.1",
                                      "--domain", "weenv.test", "--report-interval", "0.5",
                                      "--store", f"{self.rw.registry_host}/ct/snaps",
                                      *IMAGE_ROUTING], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"the gateway exited: {self.log()[-3000:]}"
            try:
                r = httpx.get(self.url + "/v1/envs", headers={"Authorization": f"Bearer {self.keys['root']}"}, timeout=5)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the gateway did not answer within 60 s: {self.log()[-3000:]}"
            time.sleep(0.1)

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return (self.home / "gateway.log").read_text(errors="replace")

    def client(self, key: str = "alice"):
        from weenv.cluster import client

        return client(self.address, token=self.keys[key])


@pytest.fixture(scope="module")
def gw(rw, tmp_path_factory):
    g = Gateway(rw, tmp_path_factory.mktemp("gateway"))
    g.start()
    try:
        yield g
    finally:
        g.stop()


def test_node_daemons_on_the_cluster_network_refuse_calls_without_the_cluster_token(rw):
    import httpx

    for name in rw.node_names():
        url = rw.cluster.report(name).node_api
        assert url.startswith("http://127.0.0.1:"), url
        assert httpx.get(url + "/v1/envs", timeout=5).status_code == 401
        wrong = httpx.get(url + "/v1/envs", headers={"Authorization": "Bearer not-the-token"}, timeout=5)
        assert wrong.status_code == 401 and "cluster token" in wrong.json()["error"]["message"]
        assert httpx.get(url + "/v1/envs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5).status_code == 200


def test_the_gateway_places_creates_and_routes_exec_files_and_kill_by_env_id(rw, gw):
    import weenv
    from weenv.cluster import node_of

    client = gw.client()
    assert client.socket_path == gw.url  # found through the Ray cluster's KV store
    # 0.9 cores guaranteed each: past the load band of one node, so placement spreads them
    envs = [client.create(rw.plan_bb, cpu="0.9-1") for _ in range(3)]
    try:
        nodes = [node_of(e.id) for e in envs]
        print("gateway creates on", nodes)
        assert sorted(nodes) == rw.node_names()
        rw.cluster.refresh()  # the test's own client: its routes come from the nodes' reports
        for i, e in enumerate(envs):
            e.write_file("/root/who", f"env{i}\n")
            assert e.exec("cat /root/who").stdout == f"env{i}\n".encode()
            assert e.read_file("/root/who") == f"env{i}\n".encode()
            assert rw.cluster.routes()[e.id] == node_of(e.id)
        # per exec: through the gateway vs straight to the node's daemon API
        direct = weenv.Client(rw.cluster.report(nodes[0]).node_api, token=TOKEN).get(envs[0].id)
        t_gw, t_direct = [], []
        for _ in range(30):
            t0 = time.perf_counter()
            envs[0].exec("true")
            t1 = time.perf_counter()
            direct.exec("true")
            t_direct.append(time.perf_counter() - t1)
            t_gw.append(t1 - t0)
        t_gw.sort(), t_direct.sort()
        print(f"exec p50 via gateway {t_gw[15] * 1e3:.2f} ms, direct {t_direct[15] * 1e3:.2f} ms")
        # the command line against the gateway: weenv --host URL --token KEY
        import subprocess
        import sys

        cli = [sys.executable, "-m", "weenv", "--host", gw.url, "--token", gw.keys["alice"]]
        out = subprocess.run([*cli, "exec", envs[2].id, "--", "cat", "/root/who"], capture_output=True, timeout=60)
        assert out.returncode == 0 and out.stdout == b"env2\n", out.stderr
        listed = subprocess.run([*cli, "ps", "--json"], capture_output=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert {e.id for e in envs} <= {x["id"] for x in __import__("json").loads(listed.stdout)}
    finally:
        for e in envs:
            e.kill()
    with pytest.raises(weenv.EnvNotFoundError):
        client.get(envs[0].id)


def test_the_gateway_reads_a_path_once_and_refuses_encoded_separators(rw, gw):
    """Issue 25 items 1 and 2 through the gateway's route to a node: a path decoded twice (by the
    gateway, then by the node's daemon) reached another key's env and the admin routes."""
    import httpx

    import weenv

    root, alice = gw.keys["root"], gw.keys["alice"]
    with weenv.Client(gw.url, token=root) as c:
        theirs = c.create(rw.plan_bb)
        try:
            for method, path in (("POST", f"/v1/envs%252F{theirs.id}%252Fexec"),
                                 ("POST", f"/v1/envs%2F{theirs.id}%2Fexec"), ("POST", "/v1/%2567c"),
                                 ("GET", "/v1/%2574op"), ("GET", "/v1/%256detrics"), ("POST", "/v1/daemon%252Fstop"),
                                 ("GET", "/v1/envs%3F"), ("GET", "/v1/top%23"), ("GET", "/v1/snapshots%3Fx")):
                url = httpx.URL(gw.url).copy_with(raw_path=path.encode())
                r = httpx.request(method, url, headers={"Authorization": f"Bearer {alice}"}, timeout=30,
                                  json={"cmd": "touch /tmp/pwned"})
                assert r.status_code == 400 and r.json()["error"]["kind"] == "bad_path", (path, r.text)
            assert theirs.exec("test -e /tmp/pwned").exit_code != 0
            with weenv.Client(gw.url, token=alice) as a:
                assert theirs.id not in [e["id"] for e in a.list()]
            assert theirs.id in [e["id"] for e in c.list()]  # the daemons behind the gateway still run
        finally:
            theirs.kill()


def test_a_toml_lock_from_weenv_plan_lock_starts_through_the_gateway(rw, gw, tmp_path, monkeypatch):
    """Issue 26 item 3: `weenv plan lock` writes sizes as strings (min = "32MiB"); `weenv up` of that
    lock through the gateway was a 500 (placement read the sizes with int()). The lock file the real
    CLI wrote, by weenv.Client, by `weenv --host URL --token KEY up LOCK --json`, and as an E2B
    template; a lock the codec refuses is a 400 bad_plan naming the file."""
    import json
    import subprocess
    import sys

    import weenv
    from weenv.api import TemplateStore
    from weenv.cluster import node_of

    try:
        import e2b
    except ImportError:
        e2b = None
    plan = tmp_path / "tl.toml"
    plan.write_text(f'name = "tl"\n\n[[groups]]\nname = "os"\nref = "{rw.registry_host}/ct/os:test"\nclass = "os"\n\n'
                    '[resources]\npids = 128\ndisk = "32MiB"\n\n[resources.cpu]\nmin = 0.05\nmax = 0.5\n\n'
                    '[resources.memory]\nmin = "32MiB"\nmax = "256MiB"\n')
    home = {**os.environ, "WEENV_HOME": str(tmp_path / "home")}
    made = subprocess.run([sys.executable, "-m", "weenv", "plan", "lock", str(plan)], capture_output=True, env=home,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    lock = tmp_path / "tl.lock"
    text = lock.read_text()
    assert 'min = "32MiB"' in text and 'max = "256MiB"' in text and 'disk = "32MiB"' in text, text
    cli = [sys.executable, "-m", "weenv", "--host", gw.url, "--token", gw.keys["alice"]]
    envs = []
    with weenv.Client(gw.url, token=gw.keys["alice"]) as c:
        try:
            env = c.create(str(lock))
            envs.append(env.id)
            assert node_of(env.id) in rw.node_names()
            assert env.exec("echo from the toml lock").stdout == b"from the toml lock\n"
            up = subprocess.run([*cli, "up", str(lock), "--json"], capture_output=True, timeout=120)
            assert up.returncode == 0, up.stderr
            info = json.loads(up.stdout)
            envs.append(info["id"])
            assert info["id"].startswith(tuple(n + "-tl-" for n in rw.node_names())), info
            ran = subprocess.run([*cli, "exec", info["id"], "--", "sh", "-c", "echo up $((6 * 7))"], capture_output=True,
                                 timeout=60)
            assert ran.returncode == 0 and ran.stdout == b"up 42\n", ran.stderr
            if e2b is not None:  # E2B's create sends a template's lock file as its TOML text
                TemplateStore(str(gw.home / "api")).set("tl-toml", str(lock))
                _e2b_through(gw, monkeypatch)
                sbx = e2b.Sandbox.create("tl-toml", timeout=120)
                envs.append(sbx.sandbox_id)
                out = sbx.commands.run("echo e2b from the toml lock")
                assert out.exit_code == 0 and out.stdout == "e2b from the toml lock\n"
        finally:
            for env_id in envs:
                c.get(env_id).kill()
        bad = tmp_path / "bad.lock"
        bad.write_text(text.replace('min = "32MiB"', 'min = "lots"'))
        with pytest.raises(weenv.ApiError) as refused:
            c.create(str(bad))
        assert refused.value.status == 400 and refused.value.kind == "bad_plan", refused.value
        assert f"{bad}: resources.memory.min" in str(refused.value)


def test_an_image_ref_starts_through_the_gateway_converted_once_for_the_cluster(rw, gw, busybox_oci):
    """Issue 28 item 2: the gateway converts an image's layers once, into the cluster's store; a
    start on another node lazy-loads the same groups and converts nothing."""
    import subprocess

    import weenv
    import weenv.registry as R
    from weenv.cluster import node_of

    image = f"{rw.registry_host}/corpus/bb:1"
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{busybox_oci}:bb", f"docker://{image}"],
                   check=True, capture_output=True, timeout=120)
    store = f"{rw.registry_host}/ct/snaps/"
    envs = []
    with weenv.Client(gw.url, token=gw.keys["alice"]) as c:
        try:
            first = c.create(image, ttl_s=300)
            envs.append(first)
            assert first.exec(["sh", "-c", "cat /etc/new; echo $FOO; pwd"]).stdout == b"new\nbar\n/srv\n"
            converted = R.convert_image(image, base=store)  # what the gateway left in the store
            assert converted.converted == 0 and all(x.ref.startswith(store + "oci-layers:") for x in converted.layers)
            other = next(n for n in rw.node_names() if n != node_of(first.id))
            second = rw.cluster.create(image, node=other)
            envs.append(second)
            assert node_of(second.id) == other and second.exec("cat /etc/motd.hard").stdout == b"hi\n"
        finally:
            for e in envs:
                e.kill()


def _e2b_through(gw, monkeypatch) -> None:
    """The unmodified E2B SDK pointed at the gateway, as alice."""
    monkeypatch.setenv("E2B_API_URL", gw.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", gw.url)
    monkeypatch.setenv("E2B_API_KEY", gw.keys["alice"])
    monkeypatch.setenv("E2B_DOMAIN", "weenv.test")


def test_the_e2b_sdk_through_the_gateway(rw, gw, monkeypatch):
    e2b = pytest.importorskip("e2b")
    from weenv.cluster import node_of

    _e2b_through(gw, monkeypatch)
    sbx = e2b.Sandbox.create("bb", timeout=120)
    try:
        assert node_of(sbx.sandbox_id) in rw.node_names()
        sbx.files.write("/root/x.txt", "hello cluster")
        assert sbx.files.read("/root/x.txt") == "hello cluster"
        out = sbx.commands.run("cat /root/x.txt && hostname")
        assert out.exit_code == 0 and out.stdout.startswith("hello cluster")
        assert e2b.Sandbox.get_info(sbx.sandbox_id).sandbox_id == sbx.sandbox_id
    finally:
        sbx.kill()
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.get_info(sbx.sandbox_id)


def test_images_routed_by_metadata_through_the_gateway(rw, gw, busybox_oci, monkeypatch):
    """Issue 29 item 16: ``AsyncSandbox.create(timeout, metadata={KEY: image})`` with no template
    (what slime's E2BSandbox sends) starts that image on a node, sized by the size key."""
    import asyncio
    import subprocess

    e2b = pytest.importorskip("e2b")
    from weenv.cluster import node_of

    image = f"{rw.registry_host}/routed/bb:1"
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{busybox_oci}:bb", f"docker://{image}"],
                   check=True, capture_output=True, timeout=120)
    _e2b_through(gw, monkeypatch)

    async def main() -> None:
        sbx = await e2b.AsyncSandbox.create(timeout=120, metadata={"image": image, "size": "lg"})
        try:
            assert node_of(sbx.sandbox_id) in rw.node_names()
            out = await sbx.commands.run("cat /etc/new; echo $FOO", user="root")
            assert out.stdout == "new\nbar\n", out
            info = await sbx.get_info()
            assert info.template_id == image and info.memory_mb == 192 and info.metadata["size"] == "lg"
        finally:
            await sbx.kill()

    asyncio.run(main())


def _wait_http(url: str, headers: dict[str, str]):
    import httpx

    deadline = time.monotonic() + 15
    while True:
        r = httpx.get(url, headers=headers, timeout=10)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)  # the server in the env is not listening yet


def test_env_ports_through_the_gateway_reach_servers_in_envs_on_every_node(rw, gw, monkeypatch):
    # E2B's get_host(port) and /proxy/{id}/{port}/: the gateway opens the daemon's port tunnel on the
    # env's node through that node's daemon API (cluster token), not its own node's socket
    e2b = pytest.importorskip("e2b")
    import httpx

    from weenv.cluster import node_of

    _e2b_through(gw, monkeypatch)
    for name in rw.node_names():  # every node holds the plan: then small envs spread by env count
        rw.cluster.create(rw.plan_bb, node=name).kill()
    time.sleep(2.0)  # the gateway's reconciler (0.5 s reports) sees the nodes' new reports
    boxes = []
    try:
        for _ in range(3):
            boxes.append(e2b.Sandbox.create("bb", timeout=120))
        nodes = [node_of(b.sandbox_id) for b in boxes]
        print("sandboxes with a server on", nodes)
        # small envs on nodes that all hold the plan: one each (the env count breaks the tie)
        assert sorted(nodes) == rw.node_names(), [x for x in gw.log().splitlines() if "create: best nodes" in x]
        for sbx, node in zip(boxes, nodes):
            sbx.files.write("/tmp/www/index.html", f"hello from {node}\n")
            sbx.commands.run("busybox httpd -f -p 127.0.0.1:8000 -h /tmp/www", background=True).disconnect()
        for sbx, node in zip(boxes, nodes):
            host = sbx.get_host(8000)
            assert host == f"8000-{sbx.sandbox_id}.weenv.test"
            r = _wait_http(gw.url + "/index.html", {"Host": host})
            assert r.status_code == 200 and r.text == f"hello from {node}\n", (r.status_code, r.text)
            assert httpx.get(gw.url + "/nope.html", headers={"Host": host}, timeout=10).status_code == 404  # its server
            r = httpx.get(f"{gw.url}/proxy/{sbx.sandbox_id}/8000/index.html", timeout=10)
            assert r.status_code == 200 and r.text == f"hello from {node}\n"
            r = httpx.get(gw.url + "/", headers={"Host": sbx.get_host(8001)}, timeout=10)
            assert r.status_code == 502 and "no open port 8001" in r.json()["message"], r.text
        r = httpx.get(gw.url + "/", headers={"Host": f"8000-{nodes[0]}-bb-00000000.weenv.test"}, timeout=10)
        assert r.status_code == 502 and "no open port 8000" in r.json()["message"]  # no such sandbox: as a closed port
    finally:
        for b in boxes:
            b.kill()


def test_the_gateway_restarted_mid_run_keeps_routing_every_env(rw, gw):
    from weenv.cluster import node_of

    client = gw.client()
    envs = [client.create(rw.plan_bb, cpu="0.9-1") for _ in range(3)]
    try:
        gw.stop()
        gw.start()  # a new process: its routing is rebuilt from the node reports (and the env ids)
        again = gw.client()
        for e in envs:
            got = again.get(e.id)
            assert got.exec("echo routed").stdout == b"routed\n", node_of(e.id)
    finally:
        for e in envs:
            e.kill()


def _outside_the_cluster(code: str) -> str:
    """Run ``code`` in a fresh Python (a process that is not a Ray driver): its stdout."""
    import subprocess
    import sys

    for attempt in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
        # Ray's own client server could not start the server it runs per client (seen once in CI
        # under load; its log goes with the cluster): Ray's infrastructure, not weenv: try again
        if out.returncode == 0 or "Starting Ray client server failed" not in out.stderr or attempt == 2:
            break
        print(f"Ray's client server failed to start a server for this client (attempt {attempt + 1}); again")
        time.sleep(2)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_client_outside_the_cluster_finds_the_gateway_through_a_ray_client_address(rw, gw):
    if rw.ray_client is None:
        pytest.skip("Ray's client (ray[client], grpcio) is not installed")
    import psutil

    env = gw.client().create(rw.plan_bb)
    try:
        out = _outside_the_cluster(
            "import weenv, weenv.cluster\n"
            f"c = weenv.cluster.client({rw.ray_client!r}, token={gw.keys['alice']!r})\n"
            f"print(c.target, c.get({env.id!r}).exec('echo via ray client').stdout.decode().strip())\n"
            "try:\n"
            f"    weenv.Client({rw.ray_client!r})\n"
            "except weenv.WeenvError as e:\n"
            "    print('refused:', 'weenv.cluster' in str(e))\n")
        assert out.splitlines() == [f"{gw.url} via ray client", "refused: True"], out
    finally:
        env.kill()
    # the head's Ray client server (and the per-client servers it spawned) listen on loopback only
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
                 and c.pid in _ray_pids()]
    assert int(rw.ray_client.rsplit(":", 1)[1]) in {c.laddr.port for c in listening}
    assert not [(c.pid, c.laddr) for c in listening if not _loopback(c.laddr.ip)]


def test_weenv_cluster_serve_joins_through_a_ray_client_address(rw, gw):
    if rw.ray_client is None:
        pytest.skip("Ray's client (ray[client], grpcio) is not installed")
    from weenv.cluster import node_of

    client = gw.client()
    before = client.create(rw.plan_bb)
    gw.stop()
    address = gw.address
    gw.address = rw.ray_client  # the gateway as a Ray client, from outside the cluster
    try:
        gw.start()
        assert "for 3 nodes (ray://127.0.0.1:" in gw.log()
        via = gw.client()  # found in the KV store, through the Ray driver of this test
        assert via.get(before.id).exec("echo routed").stdout == b"routed\n"
        envs = [via.create(rw.plan_bb, cpu="0.9-1") for _ in range(3)]
        try:
            assert sorted(node_of(e.id) for e in envs) == rw.node_names()  # placed from its reports
            assert all(e.exec("echo ok").stdout == b"ok\n" for e in envs)
        finally:
            for e in envs:
                e.kill()
    finally:
        gw.stop()
        gw.address = address
        gw.start()  # first: the module's other tests need their gateway back, whatever failed here
        before.kill()


def _one_env_per_node(rw, client):
    """Three envs through the gateway, one on each node (0.9 cores guaranteed each: placement spreads them)."""
    from weenv.cluster import node_of

    envs = [client.create(rw.plan_bb, cpu="0.9-1") for _ in range(3)]
    by_node = {node_of(e.id): e for e in envs}
    if sorted(by_node) != rw.node_names():
        for e in envs:
            e.kill()
        pytest.fail(f"the gateway did not put one env on each node: {[e.id for e in envs]}")
    return by_node


def _held_on(rw, snap: str) -> list[str]:
    """The nodes whose daemon API (asked directly, with the cluster token) knows snapshot ``snap``."""
    import weenv

    held = []
    for name in rw.node_names():
        try:
            weenv.Client(rw.cluster.report(name).node_api, token=TOKEN).snapshot(snap)
        except weenv.ApiError as e:
            assert e.status == 404, (name, e)
            continue
        held.append(name)
    return held


def test_a_snapshot_made_outside_the_gateway_is_found_before_its_home_reports_it(rw, gw):
    # committed on each node's own daemon API (not through the gateway, nor through the agent, which
    # would report at once): no report names the snapshot yet, so the gateway must ask the nodes.
    # Two of the three homes are not the node the gateway sends unknown snapshots to by default.
    import weenv
    from weenv.cluster import node_of

    client = gw.client()
    root = gw.client("root")
    envs = _one_env_per_node(rw, client)
    try:
        for home, e in envs.items():
            e.exec(f"echo made-on-{home} > /root/state")
            direct = weenv.Client(rw.cluster.report(home).node_api, token=TOKEN)
            snap = direct.get(e.id).commit()
            assert root.snapshot(snap)["id"] == snap  # GET /v1/snapshots/{id} through the gateway
            child = root.create(snap)
            try:
                assert node_of(child.id) == home
                assert child.exec("cat /root/state").stdout == f"made-on-{home}\n".encode()
            finally:
                child.kill()
            root.delete_snapshot(snap)
            assert _held_on(rw, snap) == []
        with pytest.raises(weenv.ApiError) as nowhere:  # asked every node: none holds it
            root.snapshot("snap-000000000000")
        assert nowhere.value.status == 404
    finally:
        for e in envs.values():
            e.kill()


def test_snapshot_only_calls_through_the_gateway_go_to_the_snapshots_home_node(rw, gw, monkeypatch):
    # one snapshot on each node: at least two of them are not on the node the gateway lists first,
    # and every other node's daemon answers 404 for them, so a call sent anywhere but home fails
    e2b = pytest.importorskip("e2b")
    import weenv
    from weenv.cluster import node_of

    _e2b_through(gw, monkeypatch)
    client = gw.client()
    envs = _one_env_per_node(rw, client)
    try:
        native, sdk = {}, {}
        for node, e in envs.items():
            e.exec(f"echo state-of-{node} > /root/state")
            native[node] = e.commit()  # POST /v1/envs/{id}/commit: routed by env id
            sdk[node] = e2b.Sandbox.create_snapshot(e.id).snapshot_id  # POST /sandboxes/{id}/snapshots
        for node in envs:
            assert _held_on(rw, native[node]) == [node] and _held_on(rw, sdk[node]) == [node]
        listed = {s.snapshot_id for s in e2b.Sandbox.list_snapshots().next_items()}  # gathered from every node
        assert set(sdk.values()) <= listed, listed
        assert set(native.values()) | set(sdk.values()) <= {s["id"] for s in client.snapshots()}
        for home in envs:
            # weenv.Client: GET /v1/snapshots/{id}, a create from it, DELETE /v1/snapshots/{id}
            snap = native[home]
            assert client.snapshot(snap)["id"] == snap
            child = client.create(snap)
            try:
                assert node_of(child.id) == home  # a node-local snapshot starts at home
                assert child.exec("cat /root/state").stdout == f"state-of-{home}\n".encode()
            finally:
                child.kill()
            client.delete_snapshot(snap)
            assert _held_on(rw, snap) == []
            with pytest.raises(weenv.ApiError) as gone:
                client.snapshot(snap)
            assert gone.value.status == 404
            with pytest.raises(weenv.ApiError) as gone:  # its home's report may still list it: its daemon says
                client.create(snap)
            assert (gone.value.status, gone.value.kind) == (404, "snapshot_not_found"), gone.value
            # the E2B SDK: Sandbox.create(snapshot id), delete_snapshot (DELETE /templates/{id})
            snap = sdk[home]
            sbx = e2b.Sandbox.create(snap, timeout=120)
            try:
                assert node_of(sbx.sandbox_id) == home
                assert sbx.files.read("/root/state") == f"state-of-{home}\n"
            finally:
                sbx.kill()
            assert e2b.Sandbox.delete_snapshot(snap) is True
            assert _held_on(rw, snap) == []
            assert e2b.Sandbox.delete_snapshot(snap) is False
        root = gw.client("root")
        with pytest.raises(weenv.ApiError) as nowhere:  # an admin key skips the owner check: no node holds it
            root.create("snap-000000000000")
        assert (nowhere.value.status, nowhere.value.kind) == (404, "snapshot_not_found"), nowhere.value
        assert "no node holds snapshot 'snap-000000000000'" in str(nowhere.value)
        for bad, answer in ((f"{rw.registry_host}/ct/snaps:snap-000000000000", (404, "snapshot_not_found")),
                            (f"{rw.registry_host}/ct/os:test", (400, "bad_request"))):  # not a snapshot's
            with pytest.raises(weenv.ApiError) as refused:
                root.connection.request("env_create", json={"snapshot": bad})
            assert (refused.value.status, refused.value.kind) == answer and bad in str(refused.value), refused.value
        # a published snapshot starts on any node: off its home (past the load band of the empty
        # nodes, with its 0.9-core env) from its published lock, its layers through the store
        home = rw.node_names()[-1]
        for node in [n for n in envs if n != home]:
            envs.pop(node).kill()
        snap = envs[home].commit()
        rw.cluster.refresh()  # the test's own client finds its home in the reports
        ref = rw.cluster.publish(snap)["ref"]
        box, by_ref = None, None
        try:
            # until the gateway's reconciler (0.5 s polls) sees the home's report naming the ref, a
            # create from the id can only go to the home: retry (bounded) until it lands elsewhere
            deadline = time.monotonic() + 20
            while True:
                box = e2b.Sandbox.create(snap, timeout=120)  # by id, as E2B names it
                if node_of(box.sandbox_id) != home or time.monotonic() > deadline:
                    break
                box.kill()
                box = None
                time.sleep(0.5)
            assert node_of(box.sandbox_id) != home
            assert box.files.read("/root/state") == f"state-of-{home}\n"
            by_ref = root.get(root.connection.request("env_create", json={"snapshot": ref}).json()["id"])  # admin: a ref
            assert node_of(by_ref.id) != home
            assert by_ref.exec("cat /root/state").stdout == f"state-of-{home}\n".encode()
            # a DELETE through the gateway removes the home's copy and the published one
            from weenv.registry import NotFoundError, open_store, parse_ref

            client.delete_snapshot(snap)
            assert _held_on(rw, snap) == []
            r = parse_ref(ref)
            with open_store(r.registry) as store:
                assert [t for t in store.list_tags(r.repo) if t.startswith(r.tag)] == []  # its layers' too
                with pytest.raises(NotFoundError):
                    store.resolve(r.repo, r.tag)
            with pytest.raises(weenv.ApiError) as gone:
                root.connection.request("env_create", json={"snapshot": ref})
            assert (gone.value.status, gone.value.kind) == (404, "snapshot_not_found"), gone.value
            # envs started from it read on (its blobs stay): a file never read before, too
            assert by_ref.exec("cat /root/state /bin/busybox | wc -c").exit_code == 0
            assert box.files.read("/root/state") == f"state-of-{home}\n"
        finally:
            if box is not None:
                box.kill()
            if by_ref is not None:
                by_ref.kill()
    finally:
        for e in envs.values():
            e.kill()


def _volume_held_on(rw, ref: str) -> list[str]:
    """The nodes whose daemon API (asked directly, with the cluster token) knows volume ``ref``."""
    import weenv

    held = []
    for name in rw.node_names():
        try:
            weenv.Client(rw.cluster.report(name).node_api, token=TOKEN).volume(ref)
        except weenv.ApiError as e:
            assert e.status == 404, (name, e)
            continue
        held.append(name)
    return held


def _require_volumes() -> None:
    from weenv.provision.envs._volumes import host_support

    why = host_support()
    if why is not None:
        pytest.skip(f"volumes: {why}")


def test_e2b_sandboxes_through_the_gateway_land_on_their_volumes_node(rw, gw, monkeypatch):
    """Issue 29 item 17: volumes are node-local. A volume made through the gateway (E2B's
    ``Volume.create``) is on one node; its content calls go there; two 0.9-core sandboxes mounting it
    both start there (past the load band of an idle node: placed as any other, the second would land
    elsewhere and get 404 volume_not_found); a sandbox mounting volumes of two nodes is a 409."""
    e2b = pytest.importorskip("e2b")
    from weenv.cluster import node_of

    _require_volumes()
    _e2b_through(gw, monkeypatch)
    monkeypatch.setenv("E2B_VOLUME_API_URL", gw.url)  # the content API: the same listener
    vols, boxes = [], []
    try:
        vols.append(e2b.Volume.create("cvol-work"))
        vol = vols[0]
        home, = _volume_held_on(rw, vol.volume_id)
        vol.write_file("/seed.txt", "seeded through the gateway")  # /volumecontent: routed to its node
        assert vol.read_file("/seed.txt") == "seeded through the gateway"
        for path in ("/data", "/mnt/w"):
            boxes.append(e2b.Sandbox.create("bb-big", timeout=120, volume_mounts={path: vol}))
            assert node_of(boxes[-1].sandbox_id) == home, (home, boxes[-1].sandbox_id)
            out = boxes[-1].commands.run(f"cat {path}/seed.txt")
            assert out.stdout == "seeded through the gateway", out
        boxes[0].commands.run("echo from-box > /data/box.txt")
        assert vol.read_file("/box.txt") == "from-box\n"
        assert e2b.Volume.get_info(vol.volume_id).name == "cvol-work"
        assert vol.volume_id in {v.volume_id for v in e2b.Volume.list()}  # gathered from every node
        # its node is busy now (1.8 cores guaranteed): the next volume goes to another node
        vols.append(e2b.Volume.create("cvol-other"))
        other, = _volume_held_on(rw, vols[1].volume_id)
        assert other != home
        with pytest.raises(e2b.SandboxException) as two:
            e2b.Sandbox.create("bb", timeout=120, volume_mounts={"/a": vol, "/b": vols[1]})
        assert str(two.value).startswith("409: ") and "volumes of 2 nodes" in str(two.value), two.value
        box = e2b.Sandbox.create("bb", timeout=120, volume_mounts={"/b": "cvol-other"})  # by its name
        boxes.append(box)
        assert node_of(box.sandbox_id) == other
    finally:
        for box in boxes:
            box.kill()
        for v in vols:
            assert e2b.Volume.destroy(v.volume_id) is True  # routed to its node
    assert all(_volume_held_on(rw, v.volume_id) == [] for v in vols)


def test_volume_calls_through_the_gateway_go_to_the_volumes_node_even_before_it_reports_it(rw, gw):
    # a volume made on each node's own daemon API (not through the gateway, nor through the agent,
    # which would report at once): the gateway finds it by asking the nodes, routes its calls there
    # and places the envs that mount it there
    import weenv
    from weenv.cluster import node_of

    _require_volumes()
    root = gw.client("root")  # the volumes are the node's, not a key's: an admin key may use them
    made = {}
    try:
        for name in rw.node_names():
            direct = weenv.Client(rw.cluster.report(name).node_api, token=TOKEN)
            made[name] = direct.create_volume(f"direct-{name}", size_bytes=32 << 20).id
            assert root.volume(made[name]).id == made[name]  # GET /v1/volumes/{id} through the gateway
            root.write_volume_file(made[name], "/who", f"on-{name}\n")
            env = root.create(rw.plan_bb, volumes=[{"name": made[name], "path": "/v"}])
            try:
                assert node_of(env.id) == name
                assert env.exec("cat /v/who").stdout == f"on-{name}\n".encode()
            finally:
                env.kill()
            assert root.read_volume_file(f"direct-{name}", "/who") == f"on-{name}\n".encode()  # by its name
        with pytest.raises(weenv.ApiError) as two:
            root.create(rw.plan_bb, volumes=[{"name": v, "path": f"/v{i}"} for i, v in enumerate(made.values())])
        assert (two.value.status, two.value.kind) == (409, "volume_conflict"), two.value
        with pytest.raises(weenv.ApiError) as nowhere:
            root.volume("vol-000000000000")
        assert (nowhere.value.status, nowhere.value.kind) == (404, "volume_not_found"), nowhere.value
        # /v1 creates through the gateway: a new name for the cluster, on the node placement picks
        alice = gw.client()
        mine = alice.create_volume("alices", size_bytes=32 << 20)
        made["alice"] = mine.id
        assert _volume_held_on(rw, mine.id) != []
        with pytest.raises(weenv.ApiError) as taken:
            alice.create_volume("direct-" + rw.node_names()[0])
        assert taken.value.status == 409, taken.value
        assert mine.id in {v.id for v in alice.volumes()} and made[rw.node_names()[0]] not in {
            v.id for v in alice.volumes()}  # a key lists its own only
    finally:
        for vol_id in made.values():
            root.delete_volume(vol_id)
    assert all(_volume_held_on(rw, v) == [] for v in made.values())


def test_a_fork_through_the_gateway_spreads_when_the_envs_node_cannot_take_every_child(rw, gw):
    import weenv
    from weenv.cluster import node_of

    client = gw.client()
    src = client.create(rw.plan_bb, cpu="0.9-1")  # a node (2 cores) guarantees two of these
    home, kids = node_of(src.id), []
    try:
        src.exec("echo fork-state > /root/state")
        kids = src.fork(1, keep=True)  # the home admits one more: the node's own fork
        assert [node_of(k.id) for k in kids] == [home]
        t0 = time.monotonic()
        kids += src.fork(3, keep=True)  # the home is full: the node alone refuses the fork
        print(f"gateway fork of 3 spread in {time.monotonic() - t0:.1f} s:", [k.id for k in kids[1:]])
        nodes = [node_of(k.id) for k in kids[1:]]
        assert len(nodes) == 3 and home not in nodes and len(set(nodes)) == 2, (home, nodes)
        for k in kids:  # routed by the gateway to each child's node
            assert k.exec("cat /root/state").stdout == b"fork-state\n", k.id
            assert client.get(k.id).id == k.id
        # more children than the cluster guarantees: a 503 saying how many fit and why, none left
        # behind: no child, and no snapshot of the refused fork on any node
        root = gw.client("root")  # sees every key's snapshots (the spread commits with the cluster's)
        snaps = {s["id"] for s in root.snapshots()}
        from weenv.registry import open_store

        with open_store(rw.registry_host) as store:
            published = store.list_tags("ct/snaps")
        t0 = time.monotonic()
        with pytest.raises(weenv.ApiError) as err:
            src.fork(9, keep=True)
        print(f"gateway fork of 9 refused in {time.monotonic() - t0:.1f} s: {err.value}")
        assert err.value.status == 503 and "only" in str(err.value) and "of 9" in str(err.value), err.value
        rw.cluster.refresh()
        assert {e["id"] for e in client.list()} == {src.id, *(k.id for k in kids)}
        assert {s["id"] for s in root.snapshots()} == snaps
        with open_store(rw.registry_host) as store:
            assert store.list_tags("ct/snaps") == published  # nor a published copy
    finally:
        for k in kids:
            k.kill()
        src.kill()


def test_an_e2b_fork_through_the_gateway_spreads_when_the_sandboxs_node_is_full(rw, gw, monkeypatch):
    # the SDK's Sandbox.fork (POST /sandboxes/{id}/fork) reaches the node through the gateway's node
    # transport, which spreads a fork the node refuses for room, as for /v1 forks
    e2b = pytest.importorskip("e2b")
    from weenv.cluster import node_of

    _e2b_through(gw, monkeypatch)
    sbx = e2b.Sandbox.create("bb-big", timeout=120)
    home, children = node_of(sbx.sandbox_id), []
    try:
        sbx.files.write("/root/state", "e2b-fork-state\n")
        children = sbx.fork(count=3)  # the home guarantees one more 0.9-core child at most
        assert len(children) == 3 and not any(isinstance(c, Exception) for c in children), children
        nodes = [node_of(c.sandbox_id) for c in children]
        assert len([n for n in nodes if n != home]) >= 2, (home, nodes)
        listed = {s.sandbox_id for s in e2b.Sandbox.list().next_items()}
        for child in children:  # each owned by alice, reached through the gateway at its own node
            assert child.sandbox_id in listed
            assert child.files.read("/root/state") == "e2b-fork-state\n"
            assert child.commands.run("hostname").stdout.strip() == child.sandbox_id
    finally:
        for child in children:
            if not isinstance(child, Exception):
                child.kill()
        sbx.kill()


def _gvisor_lock(rw, work: Path, cpu_min: float) -> dict:
    """A gVisor lock of the cluster's busybox group (any node reads it), guaranteeing ``cpu_min`` cores."""
    from weenv.plan import load_plan, lock_plan, plan_to_builtins
    from weenv.registry import resolve_group

    plan = work / "gv.toml"
    plan.write_text(f'name = "gv"\nruntime = "gvisor"\n\n[[groups]]\nname = "os"\nref = "{rw.registry_host}/ct/os:test"\n'
                    f'class = "os"\n\n[resources]\npids = 256\ndisk = "64MiB"\n\n[resources.cpu]\nmin = {cpu_min}\n'
                    'max = 1.0\n\n[resources.memory]\nmin = "64MiB"\nmax = "512MiB"\n')
    return plan_to_builtins(lock_plan(load_plan(str(plan)), resolve_group))


def _listed_on(rw, env_id: str) -> list[str]:
    """The nodes whose daemon (asked directly, with the cluster token) lists env ``env_id``."""
    import weenv

    out = []
    for name in rw.node_names():
        with weenv.Client(rw.cluster.report(name).node_api, token=TOKEN) as c:
            if any(e.id == env_id for e in c.list()):
                out.append(name)
    return out


def _gateway_sees_the_room(rw) -> None:
    """Envs killed past the gateway (``rw.cluster``): the gateway's reports (every 0.5 s) see their
    room again before the next test places 0.9-core envs one per node."""
    rw.cluster.refresh()
    time.sleep(2.0)


def test_a_parked_env_whose_node_filled_up_resumes_on_another_node_with_its_processes(rw, gw, tmp_path):
    """Issue 31: a parked gVisor env (its memory on disk, its room given back) whose node took other
    envs meanwhile resumes through the gateway on a node that has room: same id, its counter process
    with the same pid and a count that went on from where it was parked, its files, its owner and
    its TTL; no copy left on the old node, no snapshot left on any node or in the store."""
    import httpx

    import weenv
    from tests.fixtures_runtime import runsc_skip_reason
    from tests.test_memory_snapshots import pids, read_counter, start_counter
    from weenv.registry import open_store

    reason = runsc_skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    # an env id is the node's to give: no client sets one, an admin's key neither
    r = httpx.post(gw.url + "/v1/envs", json={"plan": rw.plan_bb, "env_id": "n0-bb-00000000"},
                   headers={"Authorization": f"Bearer {gw.keys['root']}"}, timeout=30)
    assert r.status_code == 400 and "$.env_id" in r.text, r.text
    client, root = gw.client(), gw.client("root")
    env = client.create(_gvisor_lock(rw, tmp_path, 0.9))
    fillers, others = [], []
    try:
        (home,) = _listed_on(rw, env.id)
        env.exec("echo parked-state > /root/state")
        pid = start_counter(env)
        time.sleep(0.3)
        before = read_counter(env, pid)
        env.set_timeout(900)
        expires = client.get(env.id).info.expires_s
        env.pause(memory="park")
        assert client.get(env.id).info.parked
        # a node's daemon refuses an id it has (only the gateway's moves give one)
        with pytest.raises(Exception, match="already"):
            rw.cluster.node(home).call("POST", "/v1/envs", json={"plan": rw.plan_bb, "env_id": env.id})
        for _ in range(3):  # its node takes 0.9-core envs until it has no room for the parked one
            try:
                fillers.append(rw.cluster.create(rw.plan_bb, node=home, overrides={"cpu": "0.9-1"}))
            except Exception as e:  # refused: full
                print(f"node {home} full after {len(fillers)} fillers: {e}")
                break
        assert fillers, f"node {home} took no 0.9-core env after the parked one gave its room back"
        snaps = {s["id"] for s in root.snapshots()}
        with open_store(rw.registry_host) as store:
            published = store.list_tags("ct/snaps")
        # no node has room: a 503 saying so, and the env still parked on its node, nothing left over
        others = []
        for name in rw.node_names():
            for _ in range(3 if name != home else 0):
                try:
                    others.append(rw.cluster.create(rw.plan_bb, node=name, overrides={"cpu": "0.9-1"}))
                except Exception:
                    break
        time.sleep(1.5)  # the gateway's view has the fillers (reports every 0.5 s)
        with pytest.raises(weenv.ApiError) as err:
            env.resume()
        print(f"resume with every node full: {err.value}")
        assert err.value.status == 503 and home in str(err.value), err.value
        assert _listed_on(rw, env.id) == [home] and client.get(env.id).info.parked
        assert {s["id"] for s in root.snapshots()} == snaps
        with open_store(rw.registry_host) as store:
            assert store.list_tags("ct/snaps") == published
        while others:
            others.pop().kill()
        t0 = time.monotonic()
        env.resume()
        print(f"resume of {env.id} on another node: {(time.monotonic() - t0) * 1000:.0f} ms;",
              *[ln for ln in gw.log().splitlines() if f"env {env.id} moved" in ln][-1:])
        where = _listed_on(rw, env.id)
        assert len(where) == 1 and where[0] != home, (home, where)
        moved = client.get(env.id)  # the gateway routes it to its new node; alice still owns it
        print("restore steps on the new node (ms):", moved.info.timings_ms)
        assert moved.info.status == "running" and not moved.info.parked
        assert abs(moved.info.expires_s - expires) < 30, (moved.info.expires_s, expires)
        assert pid in pids(moved)
        assert read_counter(moved, pid) > before  # counted on from where it was parked
        assert moved.exec("cat /root/state").stdout == b"parked-state\n"
        assert moved.exec("hostname").stdout.strip().decode() == env.id
        assert [e.id for e in client.list()].count(env.id) == 1
        assert {s["id"] for s in root.snapshots()} == snaps  # the move's snapshots went
        with open_store(rw.registry_host) as store:
            assert store.list_tags("ct/snaps") == published  # and its published copy
        # parked again on the new node, it resumes there (it has room)
        moved.pause(memory="park")
        t0 = time.monotonic()
        moved.resume()
        print(f"resume of {env.id} parked on its new node: {(time.monotonic() - t0) * 1000:.0f} ms")
        assert _listed_on(rw, env.id) == where and pid in pids(moved)
    finally:
        for f in fillers + others:
            f.kill()
        try:
            env.kill()
        except weenv.ApiError:
            pass
        _gateway_sees_the_room(rw)
    assert not _listed_on(rw, env.id)


def test_an_e2b_connect_resumes_a_parked_sandbox_on_another_node_when_its_node_is_full(rw, gw, tmp_path, monkeypatch):
    """Issue 31 through the unmodified SDK: ``pause()`` parks a gVisor sandbox, its node fills up,
    ``Sandbox.connect`` resumes it elsewhere: same sandbox id, a background process's pid and
    its file, reached through the gateway at its new node. (Commands go through weenv's API as the
    same key: the SDK's commands need process handles, which gVisor envs do not have.)"""
    import json

    from tests.test_memory_snapshots import pids, start_counter

    e2b = pytest.importorskip("e2b")
    from tests.fixtures_runtime import runsc_skip_reason
    from weenv.api import TemplateStore

    reason = runsc_skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    lock = gw.home / "gv-big.lock.json"
    lock.write_text(json.dumps(_gvisor_lock(rw, tmp_path, 0.9)))
    TemplateStore(str(gw.home / "api")).set("gv-big", str(lock))
    _e2b_through(gw, monkeypatch)
    sbx = e2b.Sandbox.create("gv-big", timeout=300)
    fillers = []
    try:
        (home,) = _listed_on(rw, sbx.sandbox_id)
        sbx.files.write("/root/state", "e2b-parked\n")
        client = gw.client()
        pid = start_counter(client.get(sbx.sandbox_id))
        sbx.pause()
        assert e2b.Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        for _ in range(3):
            try:
                fillers.append(rw.cluster.create(rw.plan_bb, node=home, overrides={"cpu": "0.9-1"}))
            except Exception:
                break
        assert fillers, f"node {home} took no 0.9-core env after the parked sandbox gave its room back"
        t0 = time.monotonic()
        again = e2b.Sandbox.connect(sbx.sandbox_id, timeout=300)
        print(f"E2B connect of {sbx.sandbox_id} on another node: {(time.monotonic() - t0) * 1000:.0f} ms")
        where = _listed_on(rw, sbx.sandbox_id)
        assert len(where) == 1 and where[0] != home, (home, where)
        assert again.sandbox_id == sbx.sandbox_id
        assert again.files.read("/root/state") == "e2b-parked\n"
        moved = client.get(sbx.sandbox_id)
        assert pid in pids(moved)
        assert moved.exec("hostname").stdout.strip().decode() == sbx.sandbox_id
    finally:
        for f in fillers:
            f.kill()
        sbx.kill()
        _gateway_sees_the_room(rw)


def test_a_killed_node_agent_loses_its_envs_and_creates_avoid_it(rw, gw):
    import weenv
    from weenv.cluster import EnvLostError, NodeState, node_of

    c = rw.cluster
    a, b, node_c = rw.node_names()
    on_b = c.create(rw.plan_bb, node=b)
    on_a = c.create(rw.plan_bb, node=a)
    client = gw.client()
    via_gw = [client.create(rw.plan_bb, cpu="0.9-1") for _ in range(3)]  # one on each node
    gw_on_b = next(e for e in via_gw if node_of(e.id) == b)
    told = []
    c.on_envs_lost(told.extend)
    ray.kill(c.clients[b].actor, no_restart=True)
    deadline = time.monotonic() + 30
    while c.reconciler.nodes[b].state is not NodeState.LOST and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.reconciler.nodes[b].state is NodeState.LOST, c.nodes()
    with pytest.raises(EnvLostError, match=f"env {on_b.id} is lost: its node {b} was lost"):
        on_b.exec("true")
    assert on_b.id in c.lost_envs() and on_b.id in [e.env_id for e in told]
    news = [c.create(rw.plan_bb) for _ in range(3)]
    deadline = time.monotonic() + 30  # the gateway's own reconciler marks b lost too
    while time.monotonic() < deadline:
        try:
            gw_on_b.exec("true")
        except weenv.ApiError as e:
            if e.status == 410:
                break
        time.sleep(0.2)
    with pytest.raises(weenv.ApiError, match=f"env {gw_on_b.id} is lost: its node {b} was lost") as lost:
        gw_on_b.exec("true")
    assert lost.value.status == 410 and lost.value.kind == "env_lost"
    import httpx

    port = httpx.get(f"{gw.url}/proxy/{gw_on_b.id}/8000/", timeout=10)  # its ports, with no token: as any refusal
    assert port.status_code == 502 and "no open port 8000" in port.text, port.text
    port = httpx.get(f"{gw.url}/proxy/{gw_on_b.id}/8000/", timeout=10,  # with its token: why
                     headers={"X-Access-Token": gw_on_b.info["access_token"]})
    assert port.status_code == 410 and f"its node {b} was lost" in port.text, port.text
    gw_news = []
    try:
        gw_news = [client.create(rw.plan_bb) for _ in range(3)]
        assert b not in {node_of(e.id) for e in gw_news}
        assert b not in {e.node for e in news}
        assert on_a.exec("echo alive").stdout.decode() == "alive\n"  # the rest of the cluster unaffected
        for e in via_gw:
            if e is not gw_on_b:
                assert e.exec("echo alive").stdout == b"alive\n"
        assert all(c.reconciler.nodes[n].state is NodeState.HEALTHY for n in (a, node_c))
    finally:
        for e in news + [on_a]:
            e.kill()
        for e in gw_news + [x for x in via_gw if x is not gw_on_b]:
            e.kill()


def test_stop_node_takes_a_node_down_with_its_daemon_and_envs(rw, gw):
    """Issue 26 item 5: node daemons outlive their agent (and `ray stop`) by design; `weenv cluster
    stop-node NODE --kill-envs` is how an operator takes one down: its envs killed, its daemon and
    envlet gone, the node lost to the cluster and to the gateway; a new client does not start the
    daemon again. Run last: the node stays down for the module's cluster."""
    import json
    import subprocess
    import sys

    import weenv
    import weenv.cluster as wc
    from weenv._proc import gone
    from weenv.cluster import EnvLostError, NodeState, node_of
    from weenv.cluster._local import home_processes
    from weenv.envlet import EnvletClient

    c = rw.cluster
    up = [n for n in rw.node_names() if c.reconciler.nodes[n].state is NodeState.HEALTHY]
    assert len(up) >= 2, c.nodes()
    target, other = up[0], up[1]
    home = c.report(target).home
    envs = [c.create(rw.plan_bb, node=target) for _ in range(2)]
    kept = c.create(rw.plan_bb, node=other)
    root = weenv.Client(gw.url, token=gw.keys["root"])
    try:
        via_gw = root.get(envs[0].id)  # the gateway routes to it by its id
        assert via_gw.exec("echo before").stdout == b"before\n"
        init_pids = [e.refresh()["init_pid"] for e in envs]
        daemon_pid = c.clients[target].hello()["daemon_pid"]
        envlet_pid = EnvletClient(os.path.join(home, "run", "envlet.sock")).ping()["pid"]
        assert all(init_pids) and {daemon_pid, envlet_pid} <= {p for p, _, _ in home_processes([home])}
        cmd = [sys.executable, "-m", "weenv", "cluster", "stop-node", target, "--ray-address",
               rw.ray_cluster.ray_cluster.address, "--node-ip", "127.0.0.1"]
        env = {**os.environ, "WEENV_CLUSTER_TOKEN": TOKEN}
        vague = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
        assert vague.returncode == 2 and b"--kill-envs" in vague.stderr and b"--keep-envs" in vague.stderr
        t0 = time.monotonic()
        out = subprocess.run([*cmd, "--kill-envs", "--json"], capture_output=True, env=env, timeout=300)
        print(f"stop-node took {time.monotonic() - t0:.1f} s")
        assert out.returncode == 0, out.stderr.decode()[-3000:]
        rec, = json.loads(out.stdout)
        assert rec["node"] == target and rec["home"] == home and rec["down"] and rec["daemon_stopped"], rec
        assert rec["daemon_pid"] == daemon_pid and {e.id for e in envs} <= set(rec["envs"]), rec  # and any left
        assert rec["envlet_pid"] is None and rec["envs_left"] == [], rec
        # its processes: the daemon, the envlet and the envs' inits are gone, and nothing of its home runs
        assert gone(daemon_pid) and gone(envlet_pid) and all(gone(p) for p in init_pids)
        assert home_processes([home]) == []
        # lost to the cluster (the reason says it was taken down) and to the gateway (410)
        deadline = time.monotonic() + 30
        while c.reconciler.nodes[target].state is not NodeState.LOST and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.reconciler.nodes[target].state is NodeState.LOST, c.nodes()
        assert "taken down" in c.reconciler.nodes[target].lost_reason
        with pytest.raises(EnvLostError, match=f"its node {target} was lost \\(taken down"):
            envs[1].exec("true")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                via_gw.exec("true")
            except weenv.ApiError as e:
                if e.status == 410:
                    break
            time.sleep(0.2)
        with pytest.raises(weenv.ApiError, match=f"its node {target} was lost") as lost:
            via_gw.exec("true")
        assert lost.value.status == 410 and lost.value.kind == "env_lost"
        # creates avoid it, here and through the gateway; the other nodes are untouched
        fresh_env = c.create(rw.plan_bb)
        gw_env = root.create(rw.plan_bb)
        try:
            assert fresh_env.node != target and node_of(gw_env.id) != target
            assert kept.exec("echo still").stdout == b"still\n"
        finally:
            fresh_env.kill()
            gw_env.kill()
        # a new client (a restarted gateway) finds the agent down: the node is lost, no daemon restarted
        fresh = wc.Cluster(token=TOKEN, report_interval_s=0.5).start()
        try:
            fresh.wait_ready(60)
            assert fresh.reconciler.nodes[target].state is NodeState.LOST, fresh.nodes()
            assert "taken down" in fresh.reconciler.nodes[target].lost_reason
        finally:
            fresh.close()
        assert home_processes([home]) == []
        again = subprocess.run([*cmd, "--kill-envs"], capture_output=True, env=env, timeout=120)
        assert again.returncode == 0 and b"its daemon was not running" in again.stdout, again
    finally:
        kept.kill()
        root.close()
