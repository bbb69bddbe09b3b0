"""K nodes cold-starting the same image at once: registry bytes and time to first output, peer tier on vs off.

K envlets on 127.0.0.1 (own caches and FUSE mounts: simulated nodes) register the same layer
through one registry behind the 100 MB/s + 1 ms throttle (a link shared by all of them, like a
registry's egress), then all run the command chrooted on their mount at the same moment.
``peer off``: tiers memory,disk,registry (every node fetches everything itself);
``peer on``: memory,disk,peer,registry, each node's peer table naming the others as holders of the
layer (what the node reports say), so each region is fetched once by its rendezvous owner and served
to the rest over loopback. Same run, interleaved: K = 1, 2, 4, 8 (quick: 1, 2 on busybox).

Goals: registry bytes ≈ 1x the bytes one node reads (not K x), and p50 time to first output at K = 8
no worse than a single node's.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from weenv.envlet import EnvletProcess, StoreSpec
from weenv.testing import busybox_tree, cache_root, debian_tar, start_registry, stop_registry

from ._throttle import ThrottleProxy
from ._util import Report, arg_parser, median
from .envlet_lazy_start import PY_CMD, SH_CMD, layer_file, run_until_output

TOKEN = "peer-tier-benchmark-token"


def cold_start(tmp: Path, proxy: ThrottleProxy, g, cmd: list[str], k: int, peer: bool) -> dict:
    base = Path(tempfile.mkdtemp(dir=tmp, prefix=f"k{k}-{'on' if peer else 'off'}-"))
    token = base / "token"
    token.write_text(TOKEN)
    nodes: list[EnvletProcess] = []
    try:
        for i in range(k):
            d = base / f"n{i}"
            p = EnvletProcess(str(d / "mnt"), str(d / "cache"), str(d / "ctl.sock"),
                              tiers=["memory", "disk", "peer", "registry"] if peer else None)
            if peer:
                p.args += ["--tier-option", "peer.listen=127.0.0.1:0", "--tier-option", f"peer.token_file={token}"]
            nodes.append(p.start())
        paths = []
        for p in nodes:
            info = p.client.register(StoreSpec("registry", registry=proxy.host, insecure=True), g.layer_digest,
                                     g.layer_size, g.toc_digest, repo=g.repo)
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
    args = arg_parser(__doc__ or "").parse_args()
    report = Report("peer_tier", "K nodes cold-starting one image: peer tier on vs off", args.quick)
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as t:
        tmp = Path(t)
        if args.quick:
            root = busybox_tree(tmp / "bb")
            source_tar = tmp / "bb.tar"
            subprocess.run(["tar", "--numeric-owner", "-cf", str(source_tar), "-C", str(root), "."], check=True)
            cmd, ks, label = SH_CMD, (1, 2), "busybox"
        else:
            source_tar = debian_tar(include=("python3",))
            cmd, ks, label = PY_CMD, (1, 2, 4, 8), "Debian bookworm minbase + python3"
        lf = layer_file(source_tar)
        reg = start_registry(str(tmp / "registry"))
        try:
            from weenv.registry import publish_layer_file, resolve_group

            ref = f"{reg.host}/bench/peer:v1"
            publish_layer_file(str(lf), ref, group="os", group_class="os")
            g = resolve_group(ref)
            report.notes.append(f"{label}: layer {g.layer_size / 1e6:.1f} MB compressed; command {' '.join(cmd)!r}; "
                                "registry behind one 100 MB/s + 1 ms link shared by all nodes")
            with ThrottleProxy(reg.host, rate_bytes_s=100e6, latency_s=0.001) as proxy:
                single: float | None = None
                one_node_bytes: float | None = None
                for k in ks:
                    res = {peer: cold_start(tmp, proxy, g, cmd, k, peer) for peer in (False, True)}
                    if single is None:
                        single = median(res[False]["times"])
                        one_node_bytes = res[False]["registry_bytes"]
                    for peer, r in res.items():
                        mode = "peer on" if peer else "peer off"
                        p50 = median(r["times"])
                        report.series[f"K={k}|{mode}|seconds"] = r["times"]
                        report.add(f"K={k}, {mode}: p50 time to first output", p50, "s", p99=max(r["times"]),
                                   baseline=single, baseline_label="one node, peer off",
                                   goal="≤ one node's at K=8" if peer and k == 8 else None,
                                   ok=(p50 <= single * 1.1) if peer and k == 8 else None)
                        x = r["registry_bytes"] / one_node_bytes if one_node_bytes else 0.0
                        report.add(f"K={k}, {mode}: registry bytes", r["registry_bytes"] / 1e6, "MB",
                                   baseline=(one_node_bytes or 0) / 1e6, baseline_label="one node's cold start",
                                   goal="≈1x, not Kx" if peer else None, ok=(x <= 1.3) if peer else None)
                        report.notes.append(f"K={k}, {mode}: registry {x:.2f}x one node's bytes; "
                                            f"{r['peer_bytes'] / 1e6:.1f} MB between peers, "
                                            f"{r['served_fetches']} chunks fetched by owners for peers, "
                                            f"{r['peer_errors']} peer failures")
        finally:
            stop_registry(reg)
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
