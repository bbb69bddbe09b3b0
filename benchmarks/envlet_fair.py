"""Fair file serving: another env's 100 cold reads under a neighbour's lookup storm vs alone.

    python -m benchmarks.envlet_fair [--quick]

Real processes in two test cgroups (envs ``storm`` and ``reader`` to the envlet) against a real
envlet mount: ``reader`` reads 100 never-read 4 KiB files, alone and while ``storm`` (2 processes)
stats random missing names as fast as it can. The same run does it with the envlet's fairness off
(``--no-fair``: what it did before) and on, both envlets up at once and the trials alternating
between them, so both see the same machine; the goal is a storm costing the reader ≤1.3x.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
from pathlib import Path

from weenv import layerfmt
from weenv.envlet import EnvletProcess, StoreSpec
from weenv.testing import cache_root
from weenv.testing._envletfair import StormResult, TwoCgroups, fair_layer_tar, measure_storm

from ._util import Report, arg_parser


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    trials = 5 if args.quick else 15
    report = Report("envlet_fair", "Fair file serving: cold reads under a neighbour's lookup storm", args.quick)
    base = cache_root() if cache_root().exists() else None
    with tempfile.TemporaryDirectory(dir=base) as t:
        tmp = Path(t)
        blob = tmp / "layer.weenv"
        with open(blob, "wb") as f:
            res = layerfmt.build_layer(io.BytesIO(fair_layer_tar(sets=4 * trials)), f)
        digest = "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()
        groups = TwoCgroups()
        envlets: list[EnvletProcess] = []
        try:
            dirs = {}
            for k, fair in enumerate((False, True)):  # both up at once, trials alternate: same noise for both
                env = EnvletProcess(str(tmp / f"mnt{k}"), str(tmp / f"cache{k}"), str(tmp / f"ctl{k}.sock"),
                                    cache_size_bytes=1 << 30, memory_cache_size_bytes=256 << 20, fair=fair,
                                    env_cgroup=groups.root)
                envlets.append(env.start())
                info = env.client.register(StoreSpec("file", path=str(blob)), digest, res.size, res.toc_digest)
                dirs[fair] = info.path
            results = {False: StormResult(), True: StormResult()}
            for t in range(trials):
                for k, fair in enumerate((False, True)):
                    r = measure_storm(groups, dirs[fair], 1, first_set=2 * (2 * t + k))
                    acc = results[fair]
                    acc.alone_s += r.alone_s
                    acc.storm_s += r.storm_s
                    acc.lookups += r.lookups
                    acc.storm_wall_s += r.storm_wall_s
            for k, fair in enumerate((False, True)):
                r = results[fair]
                envs = envlets[k].client.stats()["envs"]
                label = "fair" if fair else "no-fair (before)"
                alone, storm = sorted(r.alone_s)[len(r.alone_s) // 2], sorted(r.storm_s)[len(r.storm_s) // 2]
                report.add(f"{label}: 100 cold reads under the storm", storm * 1000, "ms", baseline=alone * 1000,
                           baseline_label="alone")
                report.add(f"{label}: what the storm costs them", r.ratio, "x", goal="≤1.3x" if fair else None,
                           ok=(r.ratio <= 1.3) if fair else None, note=f"median of {trials} pairs")
                st, rd = envs.get("storm", {}), envs.get("reader", {})
                report.notes.append(
                    f"{label}: storm {r.lookups_per_s:,.0f} lookups/s; per env: storm "
                    f"{st.get('requests', {}).get('lookup', 0)} lookups, {st.get('busy_s', 0):.2f} s busy, "
                    f"{st.get('delayed', 0)} delayed ({st.get('delayed_s', 0):.2f} s); reader "
                    f"{rd.get('requests', {}).get('read', 0)} reads, {rd.get('busy_s', 0) * 1000:.1f} ms busy, "
                    f"{rd.get('delayed', 0)} delayed")
            report.notes.append(f"storm cost to the reader (median of {trials}): {results[False].ratio:.2f}x before "
                                f"(no-fair), {results[True].ratio:.2f}x with fairness")
        finally:
            for env in envlets:
                env.stop()
            groups.close()
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
