"""Cluster placement: decision time at 1,000 simulated nodes; cache-aware vs round-robin on a live cluster.

    python -m benchmarks.cluster [--quick]

Goals (issue 19): placement ≤ 1 ms at 1,000 nodes; cache-aware placement pulls ≤ 0.5x the
registry bytes of round-robin.

- Decision time: :func:`weenv.cluster.rank` over a :class:`~weenv.cluster.ClusterView` of 1,000
  generated node reports (built once per batch of reports, as the cluster client does; its build
  time is reported too), and :func:`~weenv.cluster.place_group` of 8 forks.
- Bytes: 3 simulated nodes, 4 plans (3 layers each, a shared base), 96 envs arriving in one
  random order, each living for 12 arrivals; both placements see the same arrivals. A node pulls a
  layer's bytes the first time an env on it uses the layer (then it stays in its cache). This is a
  model of the node caches (no daemons run), so it measures the placement rule, not start latency.
- Live: a real Ray cluster of 3 weenv nodes on 127.0.0.1 (weenv.cluster.LocalCluster) and the
  loopback docker-registry as the store; 4 plans (busybox + a task group of random bytes each); the
  same arrivals (96, quick 24) placed round-robin, then cache-aware, each on fresh nodes; an env is
  killed 12 arrivals after its own. Per env: create -> first output of a command that reads the
  task's data; registry bytes = what the nodes' envlets fetched. Also the node agent's overhead per
  exec (Ray actor call + forwarding) against the daemon's Unix socket directly.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only (docs/cluster.md)

import collections  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from weenv.cluster import (  # noqa: E402
    Capacity,
    ClusterView,
    LayerHeld,
    NodeReport,
    PlacementRequest,
    place_group,
    rank,
    with_pending,
)

from ._util import Report, arg_parser, median, percentile  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def digest(i: int) -> str:
    return f"sha256:{i:064x}"


def random_reports(n: int, rng: random.Random, layer_pool: int = 200) -> list[NodeReport]:
    out = []
    for i in range(n):
        cores = rng.choice([8.0, 16.0, 32.0, 64.0])
        mem = rng.choice([32, 64, 128, 256]) * GiB
        layers = [LayerHeld(digest=digest(rng.randrange(layer_pool)), size_bytes=rng.randrange(1, 800) * MiB,
                            where="envlet") for _ in range(rng.randrange(0, 30))]
        out.append(NodeReport(node=f"n{i:05d}", accepting=rng.random() > 0.02, layers=layers, capacity=Capacity(
            cpu_cores=cores, cpu_committed_cores=rng.random() * cores, memory_total_bytes=mem + GiB,
            memory_guaranteed_bytes=mem, memory_committed_bytes=int(rng.random() * mem),
            memory_headroom_bytes=int(rng.random() * mem))))
    return out


def decision_times(n_nodes: int, repeat: int, rng: random.Random) -> tuple[list[float], list[float], list[float]]:
    reports = random_reports(n_nodes, rng)
    builds, ranks, groups = [], [], []
    for _ in range(max(3, repeat // 50)):
        t0 = time.perf_counter()
        view = ClusterView(reports)
        builds.append(time.perf_counter() - t0)
    for k in range(repeat):
        req = PlacementRequest(layers=tuple((digest(rng.randrange(200)), 300 * MiB) for _ in range(4)),
                               cpu_min_cores=0.25, memory_min_bytes=256 * MiB, memory_max_bytes=2 * GiB,
                               snapshot_home=f"n{k % n_nodes:05d}")
        t0 = time.perf_counter()
        rank(view, req)
        ranks.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        place_group(view, req, 8)
        groups.append(time.perf_counter() - t0)
    return builds, ranks, groups


def simulate(policy: str, arrivals: list[int], plans: list[list[tuple[str, int]]], nodes: int = 3,
             lifetime: int = 12) -> int:
    """Registry bytes pulled by ``nodes`` node caches for ``arrivals`` (plan index per env)."""
    caches: list[dict[str, int]] = [{} for _ in range(nodes)]
    live: list[list[tuple[int, int]]] = [[] for _ in range(nodes)]  # (plan, departs at)
    pulled = 0
    rr = 0
    for t, p in enumerate(arrivals):
        for q in live:
            q[:] = [e for e in q if e[1] > t]
        reports = [NodeReport(node=f"n{i}", layers=[LayerHeld(digest=d, size_bytes=s, where="seen")
                                                    for d, s in caches[i].items()], capacity=Capacity(
            cpu_cores=8.0, cpu_committed_cores=0.25 * len(live[i]), memory_total_bytes=9 * GiB,
            memory_guaranteed_bytes=8 * GiB, memory_committed_bytes=256 * MiB * len(live[i]),
            memory_headroom_bytes=8 * GiB - 256 * MiB * len(live[i]), envs=len(live[i]))) for i in range(nodes)]
        if policy == "round-robin":
            i, rr = rr % nodes, rr + 1
        else:
            req = PlacementRequest(layers=tuple(plans[p]), cpu_min_cores=0.25, memory_min_bytes=256 * MiB,
                                   memory_max_bytes=GiB)
            i = int(rank(ClusterView(reports), req, limit=1)[0].node[1:])
        for d, s in plans[p]:
            if d not in caches[i]:
                pulled += s
                caches[i][d] = s
        live[i].append((p, t + lifetime))
    return pulled


def burst_model(n: int, *, pending: bool, nodes: int = 3) -> dict[str, int]:
    """Where ``n`` small envs created at once land on ``nodes`` nodes that all hold the plan: every
    create is placed before any report shows the others; ``pending``: the cluster counts the creates
    it has in flight (weenv.cluster.with_pending), as it does; without, as before it did."""
    layers = ((digest(2000), 150 * MiB), (digest(2001), 50 * MiB))
    held = [LayerHeld(digest=d, size_bytes=s, where="envlet") for d, s in layers]
    reports = [NodeReport(node=f"n{i}", layers=held, capacity=Capacity(
        cpu_cores=2.0, memory_total_bytes=24 * GiB, memory_guaranteed_bytes=23 * GiB,
        memory_headroom_bytes=20 * GiB)) for i in range(nodes)]
    req = PlacementRequest(layers=layers, cpu_min_cores=0.02, memory_min_bytes=16 * MiB, memory_max_bytes=128 * MiB)
    placed: dict[str, list[PlacementRequest]] = {r.node: [] for r in reports}
    for _ in range(n):
        view = ClusterView([with_pending(r, placed[r.node]) if pending else r for r in reports])
        placed[rank(view, req, limit=1)[0].node].append(req)
    return {k: len(v) for k, v in placed.items()}


def _plans(host: str, work: Path, task_bytes: int) -> list[dict]:
    from weenv.plan import load_plan, lock_plan, plan_to_builtins
    from weenv.registry import publish, resolve_group
    from weenv.testing import busybox_tree

    publish(str(busybox_tree(work / "busybox")), f"{host}/bench/os:1", group="os", group_class="os")
    plans = []
    for k in range(4):
        task = work / f"task{k}"
        (task / "task").mkdir(parents=True)
        (task / "task" / "data.bin").write_bytes(os.urandom(task_bytes))
        publish(str(task), f"{host}/bench/task{k}:1", group="task", group_class="task")
        path = work / f"p{k}.toml"
        path.write_text(f'name = "p{k}"\n\n[[groups]]\nname = "os"\nref = "{host}/bench/os:1"\nclass = "os"\n\n'
                        f'[[groups]]\nname = "task"\nref = "{host}/bench/task{k}:1"\nclass = "task"\n\n'
                        '[resources]\npids = 64\ndisk = "16MiB"\n\n[resources.cpu]\nmin = 0.02\nmax = 0.5\n\n'
                        '[resources.memory]\nmin = "16MiB"\nmax = "128MiB"\n')
        plans.append(plan_to_builtins(lock_plan(load_plan(str(path)), resolve_group)))
    return plans


def _gateway_overhead(cluster, env_id: str, node_api: str) -> tuple[list[float], list[float]]:
    """exec through the gateway (weenv cluster serve's app, in a thread of this process) against the
    same exec sent straight to the node's daemon API (its TCP listener, the cluster token)."""
    import socket
    import tempfile
    import threading

    import trio

    import weenv
    from weenv.api import KeyStore
    from weenv.cluster._gateway import serve_gateway

    home = tempfile.mkdtemp(prefix="weenv-bench-gateway-")
    key = KeyStore(home).create("bench", admin=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    held: dict = {}

    async def main() -> None:
        held["token"] = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            held["scope"] = scope
            await serve_gateway(cluster, "bench", f"127.0.0.1:{port}", home=home)

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    gw = weenv.Client(f"http://127.0.0.1:{port}", token=key)
    deadline = time.monotonic() + 30
    while True:
        try:
            gw.ping()
            break
        except weenv.WeenvError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    node = weenv.Client(node_api, token="bench")
    via_gw, direct = [], []
    try:
        genv, nenv = gw.get(env_id), node.get(env_id)
        for _ in range(5):
            genv.exec("true"), nenv.exec("true")
        for _ in range(50):
            t0 = time.perf_counter()
            genv.exec("true")
            t1 = time.perf_counter()
            nenv.exec("true")
            direct.append(time.perf_counter() - t1)
            via_gw.append(t1 - t0)
    finally:
        gw.close()
        node.close()
        trio.from_thread.run_sync(held["scope"].cancel, trio_token=held["token"])
        thread.join(10)
        shutil.rmtree(home, ignore_errors=True)
    return via_gw, direct


def _burst(cluster, plan: dict, names: list[str], n: int) -> dict[str, int]:
    """``n`` creates of one small plan at once (threads, as slime's rollout makes them), once every
    node holds the plan (one env of it started and killed on each): where they land."""
    from concurrent.futures import ThreadPoolExecutor

    for name in names:
        cluster.create(plan, node=name).kill()
    cluster.refresh()
    from weenv.cluster import request_for

    ranked = cluster.rank(request_for(plan))
    print("burst: ranked before it", [(c.node, c.cached_bytes >> 10, round(c.load, 3)) for c in ranked])
    with ThreadPoolExecutor(n) as pool:
        envs = list(pool.map(lambda _: cluster.create(plan), range(n)))
    spread = collections.Counter(e.node for e in envs)
    for e in envs:
        e.kill()
    return {name: spread.get(name, 0) for name in names}


def _live_run(policy: str, plans: list[dict], arrivals: list[int], lifetime: int) -> dict:
    import weenv.cluster as wc

    out: dict = {"start_s": [], "nodes": collections.Counter()}
    with wc.LocalCluster(nodes=3) as local:
        cluster = wc.connect(token="bench", report_interval_s=0.5, wait_s=120)
        try:
            cluster.wait_ready(60, nodes=3)
            names = sorted(cluster.clients)
            alive: collections.deque = collections.deque()
            for i, p in enumerate(arrivals):
                t0 = time.perf_counter()
                env = cluster.create(plans[p], node=names[i % 3] if policy == "round-robin" else None)
                res = env.exec("wc -c < /task/data.bin")
                out["start_s"].append(time.perf_counter() - t0)
                assert res.exit_code == 0, res
                out["nodes"][env.node] += 1
                alive.append(env)
                if len(alive) > lifetime:
                    alive.popleft().kill()
            if policy == "cache-aware":  # the agent's hop against the daemon's socket, same env
                import weenv

                env = alive[-1]
                report = cluster.report(env.node)
                direct = weenv.Client(report.home + "/run/weenv.sock", autostart=False)
                via, own = [], []
                for _ in range(30):
                    t0 = time.perf_counter()
                    env.exec("true")
                    via.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    direct.get(env.id).exec("true")
                    own.append(time.perf_counter() - t0)
                direct.close()
                out["agent_exec_s"], out["direct_exec_s"] = via, own
                out["gateway_exec_s"], out["node_api_exec_s"] = _gateway_overhead(cluster, env.id, report.node_api)
            while alive:
                alive.popleft().kill()
            cluster.refresh()
            out["bytes"] = sum(cluster.report(n).store_bytes_fetched for n in names)
            if policy == "cache-aware":  # after the bytes count: it starts the plan on every node
                out["burst"] = _burst(cluster, plans[0], names, 12)
        finally:
            cluster.close()
    return out


def live(report: Report, quick: bool) -> None:
    from weenv.testing import HostUnsupported, require_fuse, require_tool, start_registry, stop_registry

    try:
        require_fuse()
        require_tool("crun")
        require_tool("docker-registry")
        import ray  # noqa: F401
    except (HostUnsupported, ImportError) as e:
        report.notes.append(f"live cluster part skipped: {e}")
        return
    work = Path(tempfile.mkdtemp(prefix="weenv-bench-cluster-"))
    reg = start_registry(str(work / "registry"))
    try:
        plans = _plans(reg.host, work, (1 if quick else 4) << 20)
        n = 24 if quick else 96
        rng = random.Random(7)
        arrivals = [k % 4 for k in range(n)]
        rng.shuffle(arrivals)
        runs = {policy: _live_run(policy, plans, arrivals, 12) for policy in ("round-robin", "cache-aware")}
    finally:
        stop_registry(reg)
        shutil.rmtree(work, ignore_errors=True)
    rr, aware = runs["round-robin"], runs["cache-aware"]
    report.add(f"live: registry bytes pulled, {n} envs of 4 plans on 3 nodes", aware["bytes"] / MiB, "MiB",
               baseline=rr["bytes"] / MiB, baseline_label="round-robin", goal="≤ 0.5x round-robin",
               ok=aware["bytes"] <= 0.5 * rr["bytes"])
    p50, rr50 = median(aware["start_s"]) * 1e3, median(rr["start_s"]) * 1e3
    report.add("live: create -> first output, cache-aware", p50, "ms", p99=percentile(aware["start_s"], 99) * 1e3,
               baseline=rr50, baseline_label="round-robin p50", goal="p50 no worse than round-robin",
               ok=p50 <= rr50 * 1.1)
    via, own = median(aware["agent_exec_s"]) * 1e3, median(aware["direct_exec_s"]) * 1e3
    report.add("live: exec through the node agent (Ray hop) over the daemon socket", via - own, "ms",
               note=f"{via:.2f} ms vs {own:.2f} ms direct")
    gw, node = median(aware["gateway_exec_s"]) * 1e3, median(aware["node_api_exec_s"]) * 1e3
    report.add("live: gateway overhead per exec (weenv cluster serve vs the node's daemon API)", gw - node, "ms",
               goal="≤ 2 ms", ok=gw - node <= 2.0, note=f"{gw:.2f} ms via the gateway vs {node:.2f} ms direct")
    report.notes.append(f"envs per node: cache-aware {dict(aware['nodes'])}, round-robin {dict(rr['nodes'])}")
    burst = sorted(aware["burst"].values(), reverse=True)
    report.add("live: a burst of 12 small envs at once on 3 nodes holding the plan, most on one node",
               burst[0], "envs", goal="spread (≤ 6 on one node)", ok=burst[0] <= 6,
               note="envs per node " + "/".join(map(str, burst)))


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    rng = random.Random(19)
    report = Report("cluster", "Cluster placement", args.quick)
    repeat = 200 if args.quick else 2000
    builds, ranks, groups = decision_times(1000, repeat, rng)
    p50, p99 = median(ranks) * 1e3, percentile(ranks, 99) * 1e3
    report.add("placement decision, 1,000 nodes (rank)", p50, "ms", p99=p99, goal="≤ 1 ms", ok=p50 <= 1.0)
    report.add("placement of a group of 8 forks, 1,000 nodes", median(groups) * 1e3, "ms",
               p99=percentile(groups, 99) * 1e3, goal="≤ 1 ms", ok=median(groups) * 1e3 <= 1.0)
    report.add("view build from 1,000 reports (once per batch of reports)", median(builds) * 1e3, "ms")

    base = [(digest(1000), 150 * MiB)]
    plans = [base + [(digest(1001 + 2 * k), 400 * MiB), (digest(1002 + 2 * k), 50 * MiB)] for k in range(4)]
    arrivals = [k % 4 for k in range(96)]
    rng.shuffle(arrivals)
    aware = simulate("cache-aware", arrivals, plans)
    rr = simulate("round-robin", arrivals, plans)
    report.add("registry bytes pulled, 96 envs of 4 plans on 3 nodes (model)", aware / MiB, "MiB",
               baseline=rr / MiB, baseline_label="round-robin", goal="≤ 0.5x round-robin", ok=aware <= 0.5 * rr)
    report.notes.append("the 'model' row counts a layer's bytes once per node that uses it")
    for n in (12, 24):
        now, before = burst_model(n, pending=True), burst_model(n, pending=False)
        report.add(f"a burst of {n} small envs on 3 equally cached nodes (model), most on one node",
                   max(now.values()), "envs", baseline=max(before.values()), baseline_label="without pending creates",
                   note="/".join(map(str, now.values())) + " vs " + "/".join(map(str, before.values())))
    live(report, args.quick)
    report.print()
    report.save()


if __name__ == "__main__":
    main()
