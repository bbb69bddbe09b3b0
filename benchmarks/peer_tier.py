"""K nodes cold-starting the same image at once: registry bytes and time to first output, peer tier on vs off.

K envlets on 127.0.0.1 (own caches and FUSE mounts: simulated nodes) register the same layer
through one registry behind the 100 MB/s + 1 ms throttle (a link shared by all of them, like a
registry's egress), then all run the command chrooted on their mount at the same moment.
``peer off``: tiers memory,disk,registry (every node fetches everything itself);
``peer on``: memory,disk,peer,registry, each node's peer table naming the others as holders of the
layer (what the node reports say), so each region is fetched once by its rendezvous owner and served
to the rest over loopback;
``floor``: K nodes whose disk caches (L2) already hold every chunk of the layer, started at the same
moment — what no fetching tier can beat on this machine (K envlets and K commands sharing its cores).
Same run, interleaved, ``--rounds`` rounds (the p50 of each round, then the median over rounds):
K = 1, 2, 4, 8 (quick: 1, 2 on busybox, one round).

Goals: registry bytes ≈ 1x the bytes one node reads (not K x); p50 time to first output at K = 8 no
worse than a single node's (the issue's goal, reported as met or not); and, at every K, peer on no
slower than peer off — with the floor beside both, so what is left to win is visible.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from weenv.envlet import EnvletProcess, StoreSpec
from weenv.testing import cache_root, start_registry, stop_registry

from ._throttle import ThrottleProxy
from ._util import Report, arg_parser, median
from .envlet_lazy_start import PY_CMD, SH_CMD, layer_file, run_until_output, source_image

TOKEN = "peer-tier-benchmark-token"


MODES = ("off", "on", "floor")


def warm_cache(tmp: Path, proxy: ThrottleProxy, g) -> Path:
    """A disk cache (L2) holding every chunk of the layer: one node reads every file once."""
    d = Path(tempfile.mkdtemp(dir=tmp, prefix="warm-"))
    p = EnvletProcess(str(d / "mnt"), str(d / "cache"), str(d / "ctl.sock")).start()
    try:
        info = p.client.register(StoreSpec("registry", registry=proxy.host, insecure=True), g.layer_digest,
                                 g.layer_size, g.toc_digest, repo=g.repo, prefetch=False)
        for root, _, files in os.walk(info.path):
            for name in files:
                path = os.path.join(root, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as f:
                        while f.read(1 << 20):
                            pass
        deadline = time.monotonic() + 30  # the write-back to L2 runs in the background: until it settles
        last = -1
        while (written := p.client.stats()["l2_bytes_written"]) != last and time.monotonic() < deadline:
            last = written
            time.sleep(0.5)
    finally:
        p.stop()
        p.kill()
    (d / "cache" / "envlet.log").unlink(missing_ok=True)
    return d / "cache"


def cold_start(tmp: Path, proxy: ThrottleProxy, g, cmd: list[str], k: int, mode: str,
               warm: Path | None = None) -> dict:
    peer = mode == "on"
    base = Path(tempfile.mkdtemp(dir=tmp, prefix=f"k{k}-{mode}-"))
    token = base / "token"
    token.write_text(TOKEN)
    nodes: list[EnvletProcess] = []
    try:
        for i in range(k):
            d = base / f"n{i}"
            if mode == "floor":
                assert warm is not None
                shutil.copytree(warm, d / "cache")
            p = EnvletProcess(str(d / "mnt"), str(d / "cache"), str(d / "ctl.sock"),
                              tiers=["memory", "disk", "peer", "registry"] if peer else None)
            if peer:
                p.args += ["--tier-option", "peer.listen=127.0.0.1:0", "--tier-option", f"peer.token_file={token}"]
            nodes.append(p.start())
        paths = []
        for p in nodes:
            info = p.client.register(StoreSpec("registry", registry=proxy.host, insecure=True), g.layer_digest,
                                     g.layer_size, g.toc_digest, repo=g.repo, prefetch=False)
            paths.append(info.path)
        if peer:
            addrs = [p.client.stats()["peer"]["server"]["address"] for p in nodes]
            for p, me in zip(nodes, addrs):
                p.client.set_peers({a: [g.layer_digest] for a in addrs if a != me})
        proxy.reset_counters()  # what the reads cost, not the registrations (each reads the TOC once)
        times: list[float] = [0.0] * k
        errors: list[BaseException] = []
        go = threading.Barrier(k + 1)

        def run(i: int) -> None:
            go.wait()
            try:
                times[i] = run_until_output(paths[i], cmd)
            except BaseException as e:  # noqa: BLE001 - reported after the join
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        go.wait()
        for t in threads:
            t.join(600)
        if errors:
            raise errors[0]
        stats = [p.client.stats() for p in nodes]
        return {"times": times, "registry_bytes": proxy.bytes_down,
                "peer_bytes": sum(s["peer_bytes"] for s in stats),
                "read_bytes": sum(s["tiers"]["registry"]["hit_bytes"] + s["tiers"].get("peer", {}).get("hit_bytes", 0)
                                  for s in stats) / k,
                "served_fetches": sum(s["peer_served_fetches"] for s in stats),
                "peer_errors": sum(s["peer_errors"] + s["peer_timeouts"] + s["peer_corrupt"] for s in stats)}
    finally:
        for p in nodes:
            p.stop()
            p.kill()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every K and mode (default 3; quick 1)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    report = Report("peer_tier", "K nodes cold-starting one image: peer tier on vs off", args.quick)
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as t:
        tmp = Path(t)
        source_tar, label = source_image(tmp, args.quick)
        cmd, ks = (SH_CMD, (1, 2)) if args.quick else (PY_CMD, (1, 2, 4, 8))
        lf = layer_file(source_tar)
        reg = start_registry(str(tmp / "registry"))
        try:
            from weenv.registry import publish_layer_file, resolve_group

            ref = f"{reg.host}/bench/peer:v1"
            publish_layer_file(str(lf), ref, group="os", group_class="os")
            g = resolve_group(ref)
            report.notes.append(f"{label}: layer {g.layer_size / 1e6:.1f} MB compressed; command {' '.join(cmd)!r}; "
                                "registry behind one 100 MB/s + 1 ms link shared by all nodes; "
                                f"{rounds} round(s), modes interleaved; time = median over rounds of each round's p50")
            with ThrottleProxy(reg.host, rate_bytes_s=100e6, latency_s=0.001) as proxy:
                warm = warm_cache(tmp, proxy, g)
                runs: dict[tuple[int, str], list[dict]] = {}
                for _ in range(rounds):
                    for k in ks:
                        for mode in MODES:
                            runs.setdefault((k, mode), []).append(cold_start(tmp, proxy, g, cmd, k, mode, warm))
                _report(report, runs, ks)
        finally:
            stop_registry(reg)
    report.print()
    print("results:", report.save())


def _report(report: Report, runs: dict[tuple[int, str], list[dict]], ks: tuple[int, ...]) -> None:
    def p50(k: int, mode: str) -> float:
        return median([median(r["times"]) for r in runs[(k, mode)]])

    single = p50(1, "off")
    one_node_bytes = median([r["registry_bytes"] for r in runs[(1, "off")]])
    label = {"off": "peer off", "on": "peer on", "floor": "floor (all chunks on local disk)"}
    for k in ks:
        off, on, floor = p50(k, "off"), p50(k, "on"), p50(k, "floor")
        for mode in MODES:
            rs = runs[(k, mode)]
            report.series[f"K={k}|{label[mode]}|seconds"] = [t for r in rs for t in r["times"]]
        report.add(f"K={k}, peer off: p50 time to first output", off, "s",
                   p99=max(t for r in runs[(k, "off")] for t in r["times"]),
                   baseline=single, baseline_label="one node, peer off")
        report.add(f"K={k}, floor: p50 time to first output", floor, "s",
                   p99=max(t for r in runs[(k, "floor")] for t in r["times"]),
                   baseline=single, baseline_label="one node, peer off",
                   note="K nodes, every chunk already in L2: CPU and FUSE only")
        on_p99 = max(t for r in runs[(k, "on")] for t in r["times"])
        report.add(f"K={k}, peer on: p50 vs peer off", on, "s", p99=on_p99, baseline=off,
                   baseline_label="peer off, same K", goal="≤ peer off (10 % noise)", ok=on <= off * 1.1)
        report.add(f"K={k}, peer on: p50 vs floor", on, "s", p99=on_p99, baseline=floor,
                   baseline_label="floor, same K")
        if k == ks[-1]:
            report.add(f"K={k}, peer on: p50 vs one node", on, "s", p99=on_p99, baseline=single,
                       baseline_label="one node, peer off", goal=f"≤ one node's at K={k} (issue goal)",
                       ok=on <= single * 1.1)
        for mode in ("off", "on"):
            rb = median([r["registry_bytes"] for r in runs[(k, mode)]])
            x = rb / one_node_bytes if one_node_bytes else 0.0
            report.add(f"K={k}, {label[mode]}: registry bytes", rb / 1e6, "MB",
                       baseline=one_node_bytes / 1e6, baseline_label="one node's cold start",
                       goal="≈1x, not Kx" if mode == "on" else None, ok=(x <= 1.3) if mode == "on" else None)
            r = runs[(k, mode)][-1]
            report.notes.append(f"K={k}, {label[mode]}: registry {x:.2f}x one node's bytes; "
                                f"{r['peer_bytes'] / 1e6:.1f} MB between peers, "
                                f"{r['served_fetches']} chunks fetched by owners for peers, "
                                f"{r['peer_errors']} peer failures (last round)")
        report.notes.append(f"K={k}: p50 peer on {on:.2f} s, peer off {off:.2f} s, floor {floor:.2f} s, one node "
                            f"{single:.2f} s: on/off {on / off:.2f}x, on/floor {on / floor:.2f}x, "
                            f"floor/one node {floor / single:.2f}x")


if __name__ == "__main__":
    main()
