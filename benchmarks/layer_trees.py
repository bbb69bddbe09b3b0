"""N envs starting Python at once on a warm node: group layers served by the envlet (FUSE) vs the
same layers kept as local trees (what the daemon does for hot layers, weenv/provision/envs/_trees.py).

    python -m benchmarks.layer_trees [--quick] [--envs 16]

Both sides are N overlay mounts over the Debian bookworm minbase + python3 layer, everything warm
(envlet L1/L2 and page caches): lower = the envlet's directory for the layer, or the tree the
envlet writes out of it (``EnvletClient.extract``, as the daemon has it done; timed from a cold
cache, next to ``cp -a`` of the mount). Each round starts N ``chroot ROOT python3 -c 'import …'``
at once and waits for all; the envlet's CPU time per round is reported too. --quick uses busybox
and ``sh -c`` (a smoke run).
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from weenv import layerfmt
from weenv.envlet import EnvletProcess, StoreSpec
from weenv.testing import busybox_tree, cache_root, debian_tar

from ._util import Report, arg_parser, median

PY = "python3 -c 'import json, asyncio, sqlite3, email.mime.text, http.client, unittest'"
SH = "for f in /bin/*; do [ -e $f ]; done; ls /etc >/dev/null"


def _overlays(base: Path, lower: str, tag: str, n: int, mounts: list[str]) -> list[str]:
    roots = []
    for i in range(n):
        d = base / f"{tag}{i}"
        for sub in ("u", "w", "m"):
            (d / sub).mkdir(parents=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={d / 'u'},workdir={d / 'w'}", str(d / "m")], check=True)
        mounts.append(str(d / "m"))
        roots.append(str(d / "m"))
    return roots


def _round(roots: list[str], cmd: str) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["chroot", r, "sh", "-c", cmd]) for r in roots]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{cmd!r} failed in {p.args[1]}")
    return time.perf_counter() - t0


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument("--envs", type=int, default=16)
    args = p.parse_args()
    n = 4 if args.quick else args.envs
    rounds = 2 if args.quick else 5
    report = Report("layer_trees", "Hot layers as local trees vs served by the envlet", args.quick)
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as t:
        tmp = Path(t)
        if args.quick:
            src: str = str(busybox_tree(tmp / "bb"))
            cmd, label = SH, "busybox, sh"
        else:
            src, cmd, label = str(debian_tar(include=("python3",))), PY, "Debian minbase + python3, python3 imports"
        blob = tmp / "layer"
        with open(blob, "wb") as f:
            res = layerfmt.build_layer(src, f)
        digest = "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()
        env = EnvletProcess(str(tmp / "mnt"), str(tmp / "cache"), str(tmp / "ctl.sock"))
        env.start()
        mounts: list[str] = []
        try:
            info = env.client.register(StoreSpec("file", path=str(blob)), digest, res.size, res.toc_digest)
            envlet = psutil.Process(env.client.ping()["pid"])
            t0 = time.perf_counter()
            env.client.extract(info.name, str(tmp / "tree"))  # cold: the layer is fetched on the way
            extract_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            subprocess.run(["cp", "-a", "--", info.path, str(tmp / "tree-cp")], check=True)  # warm by now
            copy_s = time.perf_counter() - t0
            fuse_roots = _overlays(tmp, info.path, "f", n, mounts)
            tree_roots = _overlays(tmp, str(tmp / "tree"), "t", n, mounts)
            _round(fuse_roots, cmd)  # first round: overlay dentries, envlet L1, page caches
            _round(tree_roots, cmd)
            fuse_s, tree_s, cpu_s = [], [], []
            for _ in range(rounds):  # interleaved, so noise hits both alike
                c0 = envlet.cpu_times()
                fuse_s.append(_round(fuse_roots, cmd))
                c1 = envlet.cpu_times()
                cpu_s.append(c1.user + c1.system - c0.user - c0.system)
                tree_s.append(_round(tree_roots, cmd))
            fm, tm = median(fuse_s), median(tree_s)
            report.add(f"{n} envs starting at once, wall time of the round", tm, "s", baseline=fm,
                       baseline_label="envlet lowers (FUSE)", goal="faster than the envlet", ok=tm < fm)
            report.add("envlet CPU per round (envlet lowers)", median(cpu_s), "s of CPU")
            report.add("making the tree: envlet extract, from a cold cache", extract_s, "s", baseline=copy_s,
                       baseline_label="cp -a of the mount, warm cache")
            report.notes.append(f"{label}; layer {res.size / 1e6:.1f} MB compressed; rounds: envlet "
                                f"{', '.join(f'{x:.2f}' for x in fuse_s)} s, trees {', '.join(f'{x:.2f}' for x in tree_s)} s")
        finally:
            for m in reversed(mounts):
                subprocess.run(["umount", m], check=False)
            env.stop()
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
