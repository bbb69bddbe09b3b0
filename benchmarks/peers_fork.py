"""Commit and fork of a running env vs ``docker commit`` + 8 × ``docker run`` (and podman's), same run.

    python -m benchmarks.peers_fork [--quick]

Every system starts from the same busybox tree (the weenv plan's, ``docker import``-ed / ``podman
import``-ed: benchmarks/_peers.py) and gets a running parent that has written 10 MB (5 MB random,
5 MB zeros, as benchmarks/snapshot.py writes) before the clock starts. Rounds run the systems in
random order; in each round:

- weenv: ``env.fork(8)`` of a running parent (one commit, then 8 running children: the call returns
  when they run), and ``env.commit()`` of another such parent on its own;
- docker / podman: ``X commit`` of the running parent container, then 8 × ``X run -d --network none``
  of the committed image, the 8 started at once from 8 threads (the engine's best case; one after
  the other would be slower), each returning once its container runs.

Goal (issue 32): weenv's fork ×8 ≥ 10x faster than docker commit + 8 × docker run (p50 over p50).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

from ._daemon import bench_daemon
from ._peers import Peer, peers
from ._util import Report, arg_parser, median, percentile

FORKS = 8
GOAL_VS_DOCKER = 10.0
WRITE_10MB = ("mkdir -p /data && dd if=/dev/urandom of=/data/r bs=1M count=5 2>/dev/null && "
              "dd if=/dev/zero of=/data/z bs=1M count=5 2>/dev/null && sync")


def peer_round(peer: Peer, n: int, times: dict[str, list[float]]) -> None:
    """One commit + ``n`` runs of the committed image; the containers and image removed after."""
    parent = peer.run("sleep", "1000000", detach=True).strip()
    image = f"weenv-bench/committed:{parent[:12]}"
    kids: list[str] = []
    try:
        peer.cli("exec", parent, "sh", "-c", WRITE_10MB, timeout_s=120)
        t0 = time.perf_counter()
        peer.cli("commit", parent, image, timeout_s=300)
        t1 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            kids = list(pool.map(lambda _: peer.run("sleep", "1000000", detach=True, image=image).strip(), range(n)))
        t2 = time.perf_counter()
        times["commit"].append(t1 - t0)
        times["fork"].append(t2 - t0)
        out = peer.cli("exec", kids[0], "sh", "-c", "wc -c < /data/r").stdout.strip()
        assert out == str(5 << 20), out  # the children see the parent's writes
    finally:
        peer.cli("rm", "-f", parent, *kids, check=False, timeout_s=120)
        peer.cli("rmi", "-f", image, check=False, timeout_s=120)


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    rounds = 2 if args.quick else 10
    report = Report("peers_fork", "Commit and fork ×8 vs docker / podman commit + 8 × run", args.quick)
    snaps: list[str] = []
    times: dict[str, dict[str, list[float]]] = {}
    with bench_daemon("peerfork", replace={'disk = "64MiB"': 'disk = "512MiB"'}) as d, d.client() as c, \
            peers(f"{d.home}/src-busybox", report) as ps:
        lock = d.plan_lock

        def weenv_round() -> None:
            t = times["weenv"]
            with c.create(lock) as parent, c.create(lock) as other:
                for e in (parent, other):
                    e.exec(["sh", "-c", WRITE_10MB], timeout_s=120)
                t0 = time.perf_counter()
                kids = parent.fork(FORKS)
                t["fork"].append(time.perf_counter() - t0)
                r = kids[0].exec(["sh", "-c", "wc -c < /data/r"])
                assert r.stdout.strip() == str(5 << 20).encode(), r
                snaps.append(kids[0].info["snapshot"])
                t0 = time.perf_counter()
                snaps.append(other.commit())
                t["commit"].append(time.perf_counter() - t0)

        runs = {"weenv": weenv_round, **{name: (lambda p=p, name=name: peer_round(p, FORKS, times[name]))
                                          for name, p in ps.items()}}
        for name in runs:
            times[name] = {"commit": [], "fork": []}
        for name in runs:  # warm: code paths, the image's layers in the page cache
            runs[name]()
            times[name] = {"commit": [], "fork": []}
        for _ in range(rounds):
            for name in random.sample(list(runs), len(runs)):
                runs[name]()
        for s in set(snaps):
            c.delete_snapshot(s)

    w = times["weenv"]
    wf, wc = median(w["fork"]) * 1000, median(w["commit"]) * 1000
    report.add(f"fork ×{FORKS} (call → {FORKS} running children), 10 MB diff", wf, "ms",
               p99=percentile(w["fork"], 99) * 1000)
    report.add("commit, 10 MB diff", wc, "ms", p99=percentile(w["commit"], 99) * 1000)
    lines = []
    for name in ps:
        t = times[name]
        pf, pc = median(t["fork"]) * 1000, median(t["commit"]) * 1000
        is_docker = name == "docker"
        ok = pf / wf >= GOAL_VS_DOCKER
        report.add(f"weenv fork ×{FORKS} vs {name} commit + {FORKS} × {name} run -d", wf, "ms",
                   p99=percentile(w["fork"], 99) * 1000, baseline=pf,
                   baseline_label=f"{name} commit + {FORKS} × run -d, p50",
                   goal=f"≥ {GOAL_VS_DOCKER:g}x faster ({name} p50 / weenv p50)" if is_docker else None,
                   ok=ok if is_docker else None,
                   note=f"{name} commit + {FORKS} runs p50 {pf:.0f} ms, p99 {percentile(t['fork'], 99) * 1000:.0f} ms; "
                        f"its commit alone p50 {pc:.0f} ms")
        report.add(f"weenv commit vs {name} commit (running, 10 MB diff)", wc, "ms",
                   p99=percentile(w["commit"], 99) * 1000, baseline=pc, baseline_label=f"{name} commit p50")
        if is_docker:
            lines.append(f"goal weenv fork ×{FORKS} vs docker commit + {FORKS} × docker run: {pf / wf:.2f}x "
                         f"(docker p50 {pf:.0f} ms / weenv p50 {wf:.0f} ms; ≥ {GOAL_VS_DOCKER:g}x): "
                         f"{'ok' if ok else 'MISSED'}")
    report.notes.append(f"{rounds} rounds after one warm-up each, the {len(runs)} systems ({', '.join(runs)}) in "
                        f"random order every round; the {FORKS} peer runs start at once from {FORKS} threads")
    report.notes += lines
    report.print()
    for line in lines:
        print(line)
    print("results:", report.save())


if __name__ == "__main__":
    main()
