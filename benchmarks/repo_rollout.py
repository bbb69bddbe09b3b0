"""A real-repo rollout: episodes of a real Python project's own test suite, weenv vs Docker.

    python -m benchmarks.repo_rollout [--quick] [--episodes 96] [--concurrency 32]

The project is toolz 1.1.0: its wheel, from this machine's PyPI mirror, carries the package's own
tests (``toolz/tests``: 181 tests, ~4 s of CPU a run here). It becomes a git repository (the package and the
wheels of pytest and its dependencies, one commit) over the Debian bookworm minbase + python3 +
pip base (the corpus base ``make corpus-inputs`` fetches). The setup is ``pip install --no-index``
of pytest from the repository's wheels. Both sides start from one ``docker-registry`` on
127.0.0.1, reached through a counting proxy (``benchmarks/_throttle.py``, unthrottled):

- **weenv**: the base published once as an ``os`` group; ``weenv package`` makes the task group
  (repository + what the setup wrote) over it. The episodes run on a fresh daemon (empty store and
  chunk cache), which pulls lazily through the proxy as the first envs start.
- **Docker**: the same base tar ``docker import``-ed; a Dockerfile ``FROM`` it ``COPY``-ies the same
  repository and ``RUN``-s the same setup (``docker build --network none``); pushed. The episodes run
  on the same dockerd with its images removed: ``docker pull`` through the proxy comes first, inside
  the timed wall, as weenv's lazy pulls are. Each container gets ``--memory 1g`` (the plan's max).

An episode is what an SWE-style harness does, through each side's Python client (docker-py for
Docker, as the SWE-bench harness uses): create from the task (``containers.run(... detach=True)`` /
``Client.create``), apply a patch (one of three, in turn: a comment, a bug in ``last`` and one in
``merge_sorted``, each failing a test; ``put_archive`` / ``write_file``), run the tests
(``python3 -m pytest -q -p no:cacheprovider toolz/tests`` under a timer), read the result, destroy.
``--concurrency`` episodes are in flight at once. Both sides must report the same test counts for
the same patch.

Reported: episodes per minute over the whole run (wall, pulls included); env overhead as a share
of episode time (episode time minus the test command's own wall time, measured inside: that also
counts the command's interpreter start, before its timer), and the share of the env's own
operations (create, patch, destroy), with each phase's median; bytes pulled through the proxy.
Goals (issue 32): ≥ 2x Docker's episodes per minute, ≤ 5 % of episode time on the env. Quick: 8
episodes, 4 at once (a smoke run, not a measurement).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weenv.testing import BadEntry, DaemonHandle, HostUnsupported, cache_root, cached, check_tree, debian_tar
from weenv.testing import start_dockerd, start_registry, stop_dockerd, stop_registry, teardown_private_daemon

from ._daemon import bench_daemon
from ._throttle import ThrottleProxy
from ._util import Report, arg_parser, median, percentile

PROJECT = "toolz==1.1.0"
TEST_PINS = ("pytest==9.1.1",)  # with its dependencies, as pip resolves them for this Python
BASE_INCLUDE = ("python3", "python3-pip")
SETUP = "python3 -m pip install -q --no-index --find-links wheels --break-system-packages pytest && rm -rf wheels"
TARGET = "toolz/itertoolz.py"
# The test command, timed inside the env: its own wall time is what the env did not cost.
TEST_CMD = ("python3", "-c", "import subprocess, sys, time; t = time.monotonic(); "
            "r = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'toolz/tests'], "
            "capture_output=True, text=True); print(r.stdout[-400:]); print('WALL', time.monotonic() - t); "
            "sys.exit(r.returncode)")
GOAL_VS_DOCKER = 2.0
MEMORY_MAX = "1g"  # both sides: the plan's memory max, Docker's --memory (a runaway patch must not eat the node)
GOAL_OVERHEAD = 0.05
PLAN = ('name = "toolz-base"\n\n[[groups]]\nname = "os"\nref = "{ref}"\nclass = "os"\n\n'
        '[resources]\npids = 256\ndisk = "512MiB"\n\n[resources.cpu]\nmin = 0.05\nmax = 2.0\n\n'
        '[resources.memory]\nmin = "64MiB"\nmax = "1GiB"\n')


def wheels() -> Path:
    """The project's wheel and pytest's (with its dependencies), downloaded once into the fixture cache."""
    pins = (PROJECT, *TEST_PINS)
    name = "repo-rollout-wheels-" + "-".join(p.replace("==", "-") for p in pins)

    def build(out: Path) -> None:
        out.mkdir()
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
                        "3.11", "--dest", str(out), *pins], check=True, timeout=600)

    def check(p: Path) -> None:
        check_tree(p, ())
        for pin in pins:
            prefix = pin.partition("==")[0].replace("-", "_") + "-" + pin.partition("==")[2] + "-"
            if not any(n.startswith(prefix) and n.endswith(".whl") for n in os.listdir(p)):
                raise BadEntry(f"{p}: no wheel for {pin}")

    return cached(name, build, check)


def make_repo(path: Path, wheel_dir: Path) -> str:
    """The project as a git repository: its package (with its tests) and the test wheels; the commit."""
    project = PROJECT.partition("==")[0]
    (whl,) = [w for w in wheel_dir.iterdir() if w.name.startswith(f"{project}-")]
    path.mkdir(parents=True)
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if ".dist-info/" not in n:
                z.extract(n, path)
    (path / "wheels").mkdir()
    for w in wheel_dir.iterdir():
        if not w.name.startswith(f"{project}-"):
            shutil.copy2(w, path / "wheels" / w.name)
    env = {**os.environ, "GIT_AUTHOR_DATE": "2024-01-01T00:00:00", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00"}
    for args in (["init", "-q"], ["config", "user.email", "bench@weenv.invalid"], ["config", "user.name", "bench"],
                 ["add", "-A"], ["commit", "-q", "-m", PROJECT]):
        subprocess.run(["git", "-C", str(path), *args], check=True, env=env, capture_output=True)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def patches(source: str) -> list[tuple[str, str]]:
    """(name, patched TARGET): a harmless change and two bugs the project's tests catch."""
    out = [("comment", source + "\n# patched by the benchmark\n")]
    for name, old, new in (("bug in last", "    return tail(1, seq)[0]", "    return tail(2, seq)[0]"),
                           ("bug in merge_sorted", "def merge_sorted(*seqs, **kwargs):",
                            "def merge_sorted(*seqs, **kwargs):\n    seqs = seqs[:1]")):
        if old not in source:
            raise SystemExit(f"{TARGET} of {PROJECT} has no {old!r}: the benchmark's patches need updating")
        out.append((name, source.replace(old, new, 1)))
    return out


def parse_result(text: str) -> dict[str, Any]:
    """Test counts and the inner wall time from what TEST_CMD printed."""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", text)}
    wall = re.search(r"WALL ([\d.]+)", text)
    return {"counts": counts, "inner_s": float(wall.group(1)) if wall else None}


PHASES = ("create", "patch", "exec", "destroy")


def _phases(t: list[float]) -> dict[str, float]:
    """Seconds per episode phase from the timestamps taken between them (an episode that failed
    part-way has fewer)."""
    return {name: b - a for name, a, b in zip(PHASES, t, t[1:])}


def _tar_of(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mode = len(data), 0o644
        t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def run_episodes(one: Any, n: int, concurrency: int) -> tuple[float, list[dict[str, Any]]]:
    """``one(i)`` for i < n, ``concurrency`` at once: (wall seconds, the episodes' records)."""
    t0 = time.perf_counter()

    def timed(i: int) -> dict[str, Any]:
        rec = one(i)
        rec["done_s"] = time.perf_counter() - t0  # for the throughput curve
        return rec

    with ThreadPoolExecutor(concurrency) as pool:
        records = list(pool.map(timed, range(n)))
    return time.perf_counter() - t0, records


# --------------------------------------------------------------------------------------------- weenv


def weenv_side(work: Path, proxy: ThrottleProxy, reg_host: str, task_lock: str, patched: list[tuple[str, str]],
               n: int, concurrency: int) -> tuple[float, list[dict[str, Any]], int]:
    """The episodes on a fresh daemon whose lock names the proxy: (wall, records, bytes pulled)."""
    lock = work / "task-via-proxy.lock.toml"
    lock.write_text(Path(task_lock).read_text().replace(reg_host, proxy.host))
    home = tempfile.mkdtemp(dir=work, prefix="home-")
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-bench-repo-{os.getpid()}",
                     str(lock), str(lock), os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    try:
        def one(i: int) -> dict[str, Any]:
            name, text = patched[i % len(patched)]
            with d.client(timeout_s=900) as c:  # one client per episode, as one harness worker each
                t = [time.perf_counter()]
                env = c.create(str(lock))
                t.append(time.perf_counter())
                try:
                    env.write_file(f"/repo/{TARGET}", text.encode())
                    t.append(time.perf_counter())
                    r = env.exec(list(TEST_CMD), cwd="/repo", timeout_s=600)
                    t.append(time.perf_counter())
                finally:
                    env.kill()
                t.append(time.perf_counter())
            rec = {"patch": name, "seconds": t[-1] - t[0], "exit_code": r.exit_code, "phases": _phases(t),
                   **parse_result(r.stdout.decode(errors="replace"))}
            if rec["inner_s"] is None:
                rec["error"] = (r.stdout + r.stderr).decode(errors="replace")[-500:]
            return rec

        proxy.reset_counters()
        wall, records = run_episodes(one, n, concurrency)
        return wall, records, proxy.bytes_down
    finally:
        left = teardown_private_daemon(d)
        if left:
            print(f"weenv rollout left: {left}", file=sys.stderr)


# --------------------------------------------------------------------------------------------- docker


class DockerSide:
    """A private dockerd with the task image built from a Dockerfile and pushed; ``run`` pulls it
    through the proxy (inside the timed wall) and runs the episodes with docker-py."""

    def __init__(self, work: Path, base_tar: Path, repo: Path, reg_host: str) -> None:
        self.d = start_dockerd()
        try:
            self.version = self.d.cli("version", "--format", "{{.Server.Version}}").stdout.strip()
            self.reg_host = reg_host
            self.ref = f"{reg_host}/bench/toolz-docker:1"
            with open(base_tar, "rb") as f:
                subprocess.run([*self._cli(), "import", "-", "weenv-bench/base:1"], stdin=f, env=self._env(),
                               check=True, capture_output=True, timeout=600)
            ctx = work / "docker-ctx"
            ctx.mkdir()
            shutil.copytree(repo, ctx / "repo", ignore=shutil.ignore_patterns(".git"))
            (ctx / "Dockerfile").write_text(f"FROM weenv-bench/base:1\nCOPY repo /repo\nWORKDIR /repo\n"
                                            f"RUN {SETUP}\n")
            t0 = time.perf_counter()
            self.d.cli("build", "--network", "none", "-q", "-t", self.ref, str(ctx), timeout_s=900)
            self.d.cli("push", self.ref, timeout_s=900)
            self.build_s = time.perf_counter() - t0
            self.d.cli("rmi", self.ref, "weenv-bench/base:1")
            self.d.cli("image", "prune", "-a", "-f", check=False)
        except BaseException:
            stop_dockerd(self.d)
            raise

    def _cli(self) -> list[str]:
        from weenv.testing._docker import DOCKER

        return [DOCKER, "-H", f"unix://{self.d.sock}"]

    def _env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_CONFIG": os.path.join(self.d.root, "config")}

    def run(self, proxy: ThrottleProxy, patched: list[tuple[str, str]], n: int,
            concurrency: int) -> tuple[float, list[dict[str, Any]], int]:
        import docker

        def connect() -> Any:
            return docker.DockerClient(base_url=f"unix://{self.d.sock}", version="1.41", timeout=900)

        client = connect()
        ref = self.ref.replace(self.reg_host, proxy.host)
        archives = [_tar_of(os.path.basename(TARGET), text.encode()) for _, text in patched]
        lock = threading.Lock()
        pulled = [False]
        local = threading.local()  # one docker-py client per worker thread, as harness workers have
        clients = [client]
        try:
            def one(i: int) -> dict[str, Any]:
                name = patched[i % len(patched)][0]
                if not hasattr(local, "client"):
                    local.client = connect()
                    with lock:
                        clients.append(local.client)
                t = [time.perf_counter()]
                ct = local.client.containers.run(ref, "sleep infinity", detach=True, network_mode="none",
                                                mem_limit=MEMORY_MAX, memswap_limit=MEMORY_MAX)
                t.append(time.perf_counter())
                try:
                    ct.put_archive(f"/repo/{os.path.dirname(TARGET)}", archives[i % len(patched)])
                    t.append(time.perf_counter())
                    code, out = ct.exec_run(list(TEST_CMD), workdir="/repo")
                    t.append(time.perf_counter())
                finally:
                    ct.remove(force=True)
                t.append(time.perf_counter())
                rec = {"patch": name, "seconds": t[-1] - t[0], "exit_code": code, "phases": _phases(t),
                       **parse_result(out.decode(errors="replace"))}
                if rec["inner_s"] is None:
                    rec["error"] = out.decode(errors="replace")[-500:]
                return rec

            def pull_then(i: int) -> dict[str, Any]:
                with lock:  # the image is pulled once per node, by the first episode, before any runs
                    if not pulled[0]:
                        client.images.pull(ref)
                        pulled[0] = True
                return one(i)

            proxy.reset_counters()
            wall, records = run_episodes(pull_then, n, concurrency)
            return wall, records, proxy.bytes_down
        finally:
            for ct in client.containers.list(all=True):
                ct.remove(force=True)
            for cl in clients:
                cl.close()

    def close(self) -> list[str]:
        return stop_dockerd(self.d)


# ----------------------------------------------------------------------------------------------- main


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r.get("inner_s") is not None]
    overhead = [(r["seconds"] - r["inner_s"]) / r["seconds"] for r in ok]
    return {"ok": len(ok), "failed": len(records) - len(ok), "episode_s": [r["seconds"] for r in ok],
            "overhead": overhead, "errors": [r["error"] for r in records if "error" in r][:2],
            "counts": {r["patch"]: r["counts"] for r in ok}}


def bound_note(docker_share: float) -> str:
    """What the env can gain at most when the tests' own time is the same on both sides."""
    return (f"bound: with the tests' own time the same on both sides, an env that cost nothing would run "
            f"{1 / (1 - docker_share):.2f}x Docker's episodes/min (1 / (1 - its {100 * docker_share:.1f} % overhead "
            "share)); the 2x goal needs episodes whose env share is larger than the tests' (more cores or "
            "shorter suites)")


def main() -> None:
    ap = arg_parser(__doc__ or "")
    ap.add_argument("--episodes", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    args = ap.parse_args()
    n = args.episodes or (8 if args.quick else 96)
    conc = args.concurrency or (4 if args.quick else 32)
    report = Report("repo_rollout", f"Real-repo rollout: {PROJECT}'s test suite, {conc} episodes at a time, "
                                    "weenv vs Docker", args.quick)
    base_tar = debian_tar(include=BASE_INCLUDE)
    wheel_dir = wheels()
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as t:
        work = Path(t)
        os.chmod(work, 0o755)  # the envs' user namespace range walks into the homes below
        repo = work / "repo"
        commit = make_repo(repo, wheel_dir)
        patched = patches((repo / TARGET).read_text())
        reg = start_registry(str(work / "registry"))
        docker_side: DockerSide | None = None
        results: dict[str, tuple[float, list[dict[str, Any]], int]] = {}
        try:
            from weenv.build import package
            from weenv.plan import load_plan, lock_plan, write_plan
            from weenv.registry import publish, resolve_group

            with bench_daemon("repo-pkg") as pd:
                old_home = os.environ.get("WEENV_HOME")
                os.environ["WEENV_HOME"] = pd.home
                try:
                    t0 = time.perf_counter()
                    publish(str(base_tar), f"{reg.host}/bench/os:base", group="os", group_class="os")
                    plan = work / "base.toml"
                    plan.write_text(PLAN.format(ref=f"{reg.host}/bench/os:base"))
                    base_lock = work / "base.lock.toml"
                    write_plan(lock_plan(load_plan(str(plan)), resolve_group), str(base_lock))
                    pkg = package(str(repo), base=str(base_lock), ref=f"{reg.host}/bench/tasks:toolz", commit=commit,
                                  setup=[SETUP], lock_out=str(work / "toolz.lock.toml"))
                    weenv_build_s = time.perf_counter() - t0
                finally:
                    if old_home is None:
                        os.environ.pop("WEENV_HOME", None)
                    else:
                        os.environ["WEENV_HOME"] = old_home
            report.notes.append(f"weenv: base published and the task packaged in {weenv_build_s:.1f} s; task "
                                f"group {pkg.layer_size / 1e6:.1f} MB ({pkg.uploaded_bytes / 1e6:.1f} MB uploaded)")
            try:
                docker_side = DockerSide(work, base_tar, repo, reg.host)
                report.peers["docker"] = {"version": docker_side.version,
                                          "how": "a private dockerd (runc, overlay2), docker-py as the harness"}
                report.notes.append(f"docker: image built (docker build --network none) and pushed in "
                                    f"{docker_side.build_s:.1f} s")
            except (HostUnsupported, subprocess.CalledProcessError, AssertionError) as e:
                msg = f"docker skipped: {e}"
                print(msg, file=sys.stderr)
                report.notes.append(msg)
            with ThrottleProxy(reg.host) as proxy:
                results["weenv"] = weenv_side(work, proxy, reg.host, pkg.lock, patched, n, conc)
                if docker_side is not None:
                    results["docker"] = docker_side.run(proxy, patched, n, conc)
        finally:
            if docker_side is not None:
                left = docker_side.close()
                if left:
                    report.notes.append(f"LEAKS (docker): {left}")
            stop_registry(reg)

    sums = {k: _summary(v[1]) for k, v in results.items()}
    for k, s in sums.items():
        if s["failed"]:
            report.notes.append(f"{k}: {s['failed']} episodes gave no result: {s['errors']}")
    if "docker" in sums and sums["weenv"]["counts"] != sums["docker"]["counts"]:
        report.notes.append(f"TEST COUNTS DIFFER: weenv {sums['weenv']['counts']}, docker {sums['docker']['counts']}")
    rate = {k: 60 * sums[k]["ok"] / results[k][0] for k in results}
    d_rate = rate.get("docker")
    report.add("episodes per minute (wall, pulls included)", rate["weenv"], "episodes/min",
               baseline=d_rate, baseline_label="docker, episodes/min" if d_rate else None, higher_is_better=True,
               goal=f"≥ {GOAL_VS_DOCKER:g}x docker" if d_rate else None,
               ok=(rate["weenv"] >= GOAL_VS_DOCKER * d_rate) if d_rate else None,
               note=f"{n} episodes, {conc} at a time; weenv wall {results['weenv'][0]:.1f} s"
                    + (f", docker {results['docker'][0]:.1f} s" if d_rate else ""))
    for k in results:
        s = sums[k]
        share = median(s["overhead"]) if s["overhead"] else float("nan")
        report.add(f"{k}: env overhead share of an episode (median)", 100 * share, "%",
                   p99=100 * percentile(s["overhead"], 99) if s["overhead"] else None,
                   goal=f"≤ {100 * GOAL_OVERHEAD:g} %" if k == "weenv" else None,
                   ok=share <= GOAL_OVERHEAD if k == "weenv" else None,
                   note=f"episode p50 {median(s['episode_s']):.2f} s (create, patch, tests, result, destroy); "
                        "the tests' own wall time measured inside is subtracted (what is left includes the "
                        "test command's interpreter start, before its timer)")
        report.add(f"{k}: bytes pulled from the registry", results[k][2] / 1e6, "MB",
                   baseline=results["docker"][2] / 1e6 if d_rate and k == "weenv" else None,
                   baseline_label="docker pull" if d_rate and k == "weenv" else None)
    for k in sums:
        report.notes.append(f"{k}: test counts per patch: {json.dumps(sums[k]['counts'])}")
    phased = {k: [r for r in v[1] if r.get("inner_s") is not None and len(r.get("phases", ())) == len(PHASES)]
              for k, v in results.items()}
    for k, ok in phased.items():
        if not ok:
            continue
        # The env's own operations; "exec minus the tests" is mostly the test command's interpreter
        # starting (before its timer) on a CPU the other suites share, the same work on both sides.
        shares = [(r["phases"]["create"] + r["phases"]["patch"] + r["phases"]["destroy"]) / r["seconds"] for r in ok]
        report.add(f"{k}: env operations (create, patch, destroy) share of an episode (median)",
                   100 * median(shares), "%", p99=100 * percentile(shares, 99),
                   goal=f"≤ {100 * GOAL_OVERHEAD:g} %" if k == "weenv" else None,
                   ok=median(shares) <= GOAL_OVERHEAD if k == "weenv" else None)
        per = {p: median([r["phases"][p] for r in ok]) for p in PHASES}
        per["exec minus the tests"] = median([r["phases"]["exec"] - r["inner_s"] for r in ok])
        report.notes.append(f"{k}: episode phases, median s: "
                            + ", ".join(f"{p} {x:.3f}" for p, x in per.items()))
    if d_rate and sums["docker"]["overhead"]:
        report.notes.append(bound_note(median(sums["docker"]["overhead"])))
    report.series = {k: [r["seconds"] for r in v[1]] for k, v in results.items()}
    report.series.update({f"{k}_done_s": sorted(r["done_s"] for r in v[1] if r.get("inner_s") is not None)
                          for k, v in results.items()})
    if not report.quick:  # a smoke run must not overwrite the published plot
        from . import _plots

        report.plots = [p for p in (_plots.rollout_throughput(report.series),) if p]
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
