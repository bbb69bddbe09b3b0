"""A task corpus from one base, as harnesses build them (issue 28 goals): stored and fetched bytes
after ``weenv regroup``, and ``weenv build -f`` against ``docker build``, in one run.

    python -m benchmarks.corpus [--quick]

A private dockerd (weenv.testing.start_dockerd: no bridge, no iptables, no IP forwarding) builds
every task image from a Dockerfile, each on its own (``--no-cache``, as SWE-style sets are built:
one image per task, so the per-repo environment is made again for every task): the base (Debian
bookworm minbase + python3 + pip from mmdebstrap, ``docker import``-ed), a per-repo environment
(a generated tree of its repo's files, the same bytes for every task of the repo, and wheels
installed offline) and the repo at a commit. ``docker push`` puts them into a docker-registry on
127.0.0.1 behind a counting proxy.

- **stored**: the registry's own bytes (its distinct layer blobs) vs the distinct groups of the
  locks ``weenv regroup`` writes for the whole corpus (goal ≤ 0.3x);
- **fetched to start a task**: a fresh daemon starts one task from its regrouped lock and runs
  ``python3 -m task``; the bytes it read through the proxy vs the task image's compressed size
  (goal ≤ 15 %);
- **second node**: one task image, converted by the first node, started on a node with nothing of
  it while its store is behind a 100 MB/s link (a throttling proxy): weenv finds the converted
  layers, starts and lazy-loads what ``python3 -m task`` reads, vs ``docker pull`` + ``docker run``
  through the same link (goal: first output ≤ 1 s);
- **build**: ``weenv build -f`` and ``docker build`` of one task's Dockerfile with one more RUN at
  the end, after a first build of each (caches warm), with that last RUN changed: time (goal: weenv
  no slower) and bytes weenv uploads (goal: only the changed step's layer; every earlier one 0).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from weenv.testing import debian_tar, start_dockerd, start_registry, stop_dockerd, stop_registry

from ._daemon import bench_daemon
from ._throttle import ThrottleProxy
from ._util import Report, arg_parser

GEN = r'''
import os, random, sys
root, seed, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
rnd = random.Random(seed)
done, i = 0, 0
while done < total:
    size = min(total - done, rnd.choice([2 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]))
    d = os.path.join(root, f"pkg{i // 40:02}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"m{i:04}.py"), "wb") as f:
        f.write(rnd.randbytes(size // 2) + (b"# padding line of a module\n" * (size // 54 + 1))[: size - size // 2])
    done += size
    i += 1
'''

DOCKERFILE = """\
FROM {base}
COPY gen.py /tmp/gen.py
RUN python3 /tmp/gen.py /opt/env {repo} {env_bytes} && rm /tmp/gen.py
COPY repo/ /work/repo/
WORKDIR /work/repo
ENV TASK={task}
CMD ["python3", "-m", "task"]
"""


def _repo(path: Path, repo: str, commit: int) -> None:
    pkg = path / "task"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'REPO = "{repo}"\nCOMMIT = {commit}\n')
    (pkg / "__main__.py").write_text("import task\nprint(task.REPO, task.COMMIT)\n")
    for k in range(commit + 1):
        (pkg / f"step_{k}.py").write_text("".join(f"def f{i}(x):\n    return x * {i + k}\n" for i in range(200)))


def _layers(ref: str) -> list[tuple[str, int]]:
    raw = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--raw", f"docker://{ref}"], check=True,
                         capture_output=True, text=True).stdout
    return [(x["digest"], int(x["size"])) for x in json.loads(raw)["layers"]]


def build_corpus(docker, registry_host: str, work: Path, repos: int, commits: int, env_bytes: int) -> list[str]:
    base = "weenv-bench/base:1"
    docker.cli("import", str(debian_tar(include=("python3", "python3-pip"))), base)
    refs = []
    for r in range(repos):
        for c in range(commits):
            ctx = work / f"r{r}c{c}"
            ctx.mkdir(parents=True)
            (ctx / "gen.py").write_text(GEN)
            _repo(ctx / "repo", f"repo{r}", c)
            (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=base, repo=f"repo{r}", env_bytes=env_bytes,
                                                              task=f"repo{r}-{c}"))
            ref = f"{registry_host}/corpus/repo{r}:c{c}"
            docker.cli("build", "-q", "--no-cache", "--network", "none", "-t", ref, str(ctx))
            docker.cli("push", ref)
            refs.append(ref)
    return refs


def measure_corpus(report: Report, refs: list[str], proxy: ThrottleProxy, work: Path) -> None:
    from weenv.registry._corpus import analyze, load_corpus
    from weenv.registry._regroup import regroup

    registry_layers: dict[str, int] = {}
    image_bytes: dict[str, int] = {}
    for ref in refs:
        layers = _layers(ref)
        registry_layers.update(layers)
        image_bytes[ref] = sum(n for _, n in layers)
    store = f"{proxy.host}/weenv/"
    names = [r.replace(r.split("/", 1)[0], proxy.host, 1) for r in refs]  # through the counting proxy
    t0 = time.perf_counter()
    with ExitStack() as stack:
        trees = load_corpus(names, store=store, stack=stack)
        t_convert = time.perf_counter() - t0
        rep = analyze(trees)
        t1 = time.perf_counter()
        res = regroup(trees, rep.proposal, str(work / "locks"), store=store)
        t_regroup = time.perf_counter() - t1
    reg = sum(registry_layers.values())
    report.add("bytes stored after weenv regroup", res.stored_bytes / 1e6, "MB", baseline=reg / 1e6,
               baseline_label="registry (distinct layers)", goal="≤0.3x the registry's bytes",
               ok=res.stored_bytes <= 0.3 * reg,
               note=f"{len(refs)} images; by file {rep.file_dedup_bytes / 1e6:.1f} MB, by chunk "
                    f"{rep.chunk_dedup_bytes / 1e6:.1f} MB; {res.groups} groups; classes "
                    + ", ".join(f"{c['class']} {c['groups']}" for c in rep.classes)
                    + f"; convert {t_convert:.0f} s, regroup {t_regroup:.0f} s")
    report.add("ratio stored / registry", res.stored_bytes / reg, "x")
    # one task started cold on a fresh node, from its regrouped lock: what it reads through the proxy
    ref, name = refs[-1], names[-1]
    with bench_daemon("corpus") as d, d.client() as c:
        proxy.reset_counters()
        t0 = time.perf_counter()
        env = c.create(res.locks[name])
        r = env.exec(["python3", "-m", "task"], cwd="/work/repo")
        first = time.perf_counter() - t0
        env.kill()
        fetched = proxy.bytes_down
    assert r.exit_code == 0, r
    report.add("bytes fetched to start a task and run python3 -m task", fetched / 1e6, "MB",
               baseline=image_bytes[ref] / 1e6, baseline_label="the task image (compressed)",
               goal="≤15% of its image", ok=fetched <= 0.15 * image_bytes[ref],
               note=f"{fetched / image_bytes[ref] * 100:.1f} %; create → first output {first:.2f} s on a cold node")
    report.series["stored"] = [reg, rep.layer_dedup_bytes, rep.file_dedup_bytes, rep.chunk_dedup_bytes,
                               res.stored_bytes]
    report.series["sharing"] = [list(x) for x in rep.sharing]


def measure_second_node(report: Report, docker, registry_host: str, ref: str) -> None:
    """A pulled image started on a node that has nothing of it, its store behind a 100 MB/s link:
    weenv (find the converted layers, start, lazy-load what the command reads) vs docker pull +
    docker run through the same link."""
    from weenv.plan import write_plan
    from weenv.registry import lock_for_image

    link = ThrottleProxy(registry_host, rate_bytes_s=100e6)
    try:
        remote = ref.replace(registry_host, link.host, 1)
        weenv_t, docker_t = [], []
        for _ in range(2):
            with bench_daemon("node2") as d, d.client() as c:
                t0 = time.perf_counter()
                lock = lock_for_image(remote, base=f"{link.host}/weenv/")  # converted by the first node
                path = os.path.join(d.home, "task.lock.toml")
                write_plan(lock, path)
                env = c.create(path)
                r = env.exec(["python3", "-m", "task"], cwd="/work/repo")
                weenv_t.append(time.perf_counter() - t0)
                env.kill()
                assert r.exit_code == 0, r
            ids = docker.cli("images", "-aq").stdout.split()
            if ids:
                docker.cli("rmi", "-f", *ids, check=False)
            t0 = time.perf_counter()
            docker.cli("pull", "-q", remote)
            out = docker.cli("run", "--rm", "--network", "none", "-w", "/work/repo", remote, "python3", "-m", "task")
            docker_t.append(time.perf_counter() - t0)
            assert out.stdout.strip(), out
    finally:
        link.close()
    w, b = min(weenv_t), min(docker_t)
    report.add("second node, store at 100 MB/s: image → first output", w, "s", baseline=b,
               baseline_label="docker pull + docker run", goal="≤1 s", ok=w <= 1.0,
               note=f"weenv runs {[round(x, 2) for x in weenv_t]}, docker {[round(x, 2) for x in docker_t]}")


def measure_build(report: Report, docker, work: Path, registry_host: str, env_bytes: int) -> None:
    """Both builders, caches warm, the last RUN changed: time, and what weenv uploads."""
    from weenv.build import build_dockerfile

    ctx = work / "build"
    ctx.mkdir()
    (ctx / "gen.py").write_text(GEN)
    _repo(ctx / "repo", "repob", 0)
    base_ref = "weenv-bench/base:1"
    store = f"{registry_host}/weenv-build/"

    def dockerfile(step: str, base: str) -> None:
        (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=base, repo="repob", env_bytes=env_bytes, task="b")
                                        + f"RUN echo {step} > /work/last.txt\n")

    # weenv builds FROM the same base image, pushed to the registry (docker's is local)
    pushed = f"{registry_host}/corpus/base:1"
    docker.cli("tag", base_ref, pushed)
    docker.cli("push", pushed)
    times: dict[str, list[float]] = {"docker": [], "weenv": []}
    uploads = []
    with bench_daemon("build") as d:
        old = os.environ.get("WEENV_HOME")
        os.environ["WEENV_HOME"] = d.home  # the build's client shares the daemon's store
        try:
            with d.client() as c:
                for step in ("one", "two", "three"):
                    dockerfile(step, base_ref)
                    t0 = time.perf_counter()
                    docker.cli("build", "-q", "--network", "none", "-t", "bench/build:x", str(ctx))
                    times["docker"].append(time.perf_counter() - t0)
                    dockerfile(step, pushed)
                    t0 = time.perf_counter()
                    res = build_dockerfile(str(ctx / "Dockerfile"), str(ctx), output=str(work / "b.lock.toml"),
                                           store=store, client=c)
                    times["weenv"].append(time.perf_counter() - t0)
                    uploads.append((res.uploaded_bytes, res.lock.groups[-1].layer_size,
                                    sum(1 for s in res.steps if s.cached), len(res.steps)))
        finally:
            if old is None:
                del os.environ["WEENV_HOME"]
            else:
                os.environ["WEENV_HOME"] = old
    w, b = min(times["weenv"][1:]), min(times["docker"][1:])
    report.add("weenv build -f, last RUN changed (caches warm)", w, "s", baseline=b, baseline_label="docker build",
               goal="no slower than docker build", ok=w <= b,
               note=f"first builds: weenv {times['weenv'][0]:.1f} s, docker {times['docker'][0]:.1f} s; "
                    f"weenv runs {[round(x, 2) for x in times['weenv']]}, docker {[round(x, 2) for x in times['docker']]}")
    up, last, cached, steps = uploads[-1]
    report.add("bytes weenv build uploads when the last RUN changed", up / 1e3, "kB", baseline=last / 1e3,
               baseline_label="the changed step's layer", goal="only the changed layer (0 for every earlier step)",
               ok=up <= last and cached == steps - 1, note=f"{cached} of {steps} steps from the cache")


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    report = Report("corpus", "Task corpus: regrouped bytes, fetched bytes, Dockerfile builds", args.quick)
    repos, commits, env_bytes = (2, 2, 2 << 20) if args.quick else (8, 5, 40 << 20)
    work = Path(tempfile.mkdtemp(prefix="weenv-bench-corpus-"))
    reg = start_registry(str(work / "registry"))
    proxy = ThrottleProxy(reg.host)
    docker = start_dockerd()
    old_home = os.environ.get("WEENV_HOME")
    os.environ["WEENV_HOME"] = str(work / "home")
    try:
        t0 = time.perf_counter()
        refs = build_corpus(docker, reg.host, work / "ctx", repos, commits, env_bytes)
        report.notes.append(f"{len(refs)} task images built and pushed by docker in {time.perf_counter() - t0:.0f} s")
        measure_corpus(report, refs, proxy, work)
        measure_build(report, docker, work, reg.host, env_bytes)
        measure_second_node(report, docker, reg.host, refs[0])  # last: it removes every docker image
    finally:
        if old_home is None:
            os.environ.pop("WEENV_HOME", None)
        else:
            os.environ["WEENV_HOME"] = old_home
        left = stop_dockerd(docker)
        proxy.close()
        stop_registry(reg)
        shutil.rmtree(work, ignore_errors=True)
        if left:
            print("dockerd left:", left, file=sys.stderr)
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
