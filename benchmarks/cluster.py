"""Cluster placement: decision time at 1,000 simulated nodes; registry bytes of cache-aware vs round-robin.

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
"""

from __future__ import annotations

import random
import time

from weenv.cluster import Capacity, ClusterView, LayerHeld, NodeReport, PlacementRequest, place_group, rank

from ._util import Report, arg_parser, median, percentile

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
            memory_headroom_bytes=8 * GiB - 256 * MiB * len(live[i]))) for i in range(nodes)]
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
    report.notes.append("bytes are a model of the node caches (a layer's bytes are pulled once per node); start "
                        "latency and gateway overhead need the gateway (weenv cluster serve), not built yet")
    report.print()
    report.save()


if __name__ == "__main__":
    main()
