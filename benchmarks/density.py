"""Density: N concurrent rollout-like envs through the daemon, static vs elastic memory sizing.

    python -m benchmarks.density [--quick] [--node-memory 2GiB] [--cycles 2] [--think-s 60] [--hold-s 1]

The workload (``weenv/testing/_rollout.py``, a static binary run by one ``exec`` per env) repeats
``--cycles`` times: think (sleep U[0.5, 1.5] x ``--think-s``: the model generating), a CPU burst
(about 0.1 s: compiling, running tests), a transient allocation of U[200, 400] MiB written page by
page and held ``--hold-s`` (a test suite's peak), freed. Every env gets its own seed (think times
and allocation sizes) and starts at a random phase of the first cycle, so peaks overlap the way
independent rollouts do. Its peak, with the process around it, fits in 448 MiB: the declared max.

Why memory-bound. The node here is a 2-core VM with 24 GiB. CPU is sized the same way in both
runs (1 core per env, admission's CPU overcommit lifted) so that the only difference is memory
sizing, and the CPU a cycle needs (~0.3 s: the burst and first-touching the pages) is small
against its length. The "node" is a memory cgroup capped at ``--node-memory`` (default 2 GiB)
holding the daemon, the envlet and every env: the monitor reads its RAM and headroom
from that cap (``CgroupBackend.node_memory``), the kernel enforces it hierarchically, and the
machine's other 22 GiB stay for the other work on this VM. A smaller node also keeps the number of
envs, hence the CPU, within 2 cores; the ratios are what carry over.

(a) static: memory min = max = 448 MiB. Admission grants each env its max, so the node holds
    floor((RAM - reserve) / 448 MiB) envs; one more is refused (503).
(b) elastic: min 8 MiB (an idle env uses about 1 MiB), max 448 MiB; the monitor doubles a limit
    when usage nears it (or at once, from the kernel's OOM notification, when a task stalls at
    it) and halves it after the allocation is freed. A burst starts only when the node can cover it up to max (burst
    reservations), so at most (RAM - reserve - mins) / 448 MiB envs burst at once and the others
    wait their turn at their min. Daemon flags for a dense node: ``--hold 0.5`` (a freed burst's
    reservation returns after half a second) and ``--memory-headroom 8MiB`` (a halved limit keeps
    8 MiB above usage, not 64).

For each sizing: the largest N (elastic: searched around the 10x-overcommit N) with zero OOM kills,
every run complete, and mean completion time ≤ 10 % above the workload alone. An env's completion
is compared with its own think time plus the active time of the workload alone (same binary, N=1),
so envs with longer random think times are not counted as slower. Overcommit = N x max / RAM.
Plots: docs/benchmarks/quota_over_time.png (one env's quotas under a bursty load) and
docs/benchmarks/density.png.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weenv.testing import parse_rollout_result, rollout_binary

from ._util import Report, arg_parser, percentile

MIB = 1 << 20
GIB = 1 << 30
MAX_BYTES = 448 * MIB
ELASTIC_MIN_BYTES = 8 * MIB


def parse_size(text: str) -> int:
    from weenv.cli._common import parse_size as _parse

    return _parse(text)


@dataclass
class Workload:
    cycles: int
    think_ms: float
    burst_miters: float = 60.0
    alloc_min_mb: int = 200
    alloc_max_mb: int = 400
    hold_ms: float = 2000.0

    def argv(self, seed: int) -> list[str]:
        return ["rollout", "run", str(self.cycles), str(self.think_ms), str(self.burst_miters),
                str(self.alloc_min_mb), str(self.alloc_max_mb), str(self.hold_ms), str(seed)]

    @property
    def cycle_s(self) -> float:
        return (self.think_ms + self.hold_ms) / 1000 + 0.4

    def describe(self) -> str:
        return (f"{self.cycles} cycles of think U[{self.think_ms / 2000:g}, {self.think_ms * 1.5 / 1000:g}] s, "
                f"{self.burst_miters:g} M-iteration CPU burst, {self.alloc_min_mb}-{self.alloc_max_mb} MiB "
                f"written and held {self.hold_ms / 1000:g} s")


# ------------------------------------------------------------------------------------------ node


def _own_cgroup(controller: str) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return path.rstrip("/")
    raise RuntimeError(f"no {controller} cgroup in /proc/self/cgroup")


class Node:
    """A memory cgroup capped at ``memory_bytes`` with a private weenv daemon (and its envlet)
    inside, a busybox+rollout image published to its embedded store and a locked plan."""

    def __init__(self, memory_bytes: int, daemon_flags: list[str]):
        self.memory_bytes = memory_bytes
        self.daemon_flags = daemon_flags
        self.name = f"weenv-density-{os.getpid()}"
        self.cgroup = f"/sys/fs/cgroup/memory{_own_cgroup('memory')}/{self.name}"
        self.cgroup_root = "weenv-density"
        self.home = tempfile.mkdtemp(prefix="weenv-density-")
        self.socket = os.path.join(self.home, "run", "weenv.sock")
        self.lock = ""
        self.proc: subprocess.Popen | None = None

    def _join(self) -> None:
        fd = os.open(f"{self.cgroup}/cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def start(self) -> None:
        os.mkdir(self.cgroup)
        with open(f"{self.cgroup}/memory.limit_in_bytes", "w") as f:
            f.write(str(self.memory_bytes))
        self.lock = self._publish()
        log = open(os.path.join(self.home, "daemon.log"), "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weenv", "daemon", "--cgroup-root", self.cgroup_root, *self.daemon_flags],
            env={**os.environ, "WEENV_HOME": self.home}, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, preexec_fn=self._join,
        )
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited: {self.log()[-2000:]}")
            try:
                with self.client() as c:
                    c.ping()
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError(f"the daemon did not answer: {self.log()[-2000:]}")

    def _publish(self) -> str:
        from weenv.plan import load_plan, lock_plan, write_plan
        from weenv.registry import publish, resolve_group

        from weenv.testing import busybox_tree
        from weenv.testing._daemon import weenv_home

        src = busybox_tree(Path(self.home) / "src")
        shutil.copy(rollout_binary(), src / "usr" / "bin" / "rollout")
        os.chmod(src / "usr" / "bin" / "rollout", 0o755)
        with weenv_home(self.home):
            publish(str(src), "rollout:bench", group="os", group_class="os")
            plan = os.path.join(self.home, "rollout.toml")
            with open(plan, "w") as f:
                f.write('name = "ro"\n\n[[groups]]\nname = "os"\nref = "rollout:bench"\nclass = "os"\n\n'
                        '[resources]\npids = 64\ndisk = "16MiB"\n')
            lock = os.path.join(self.home, "rollout.lock.toml")
            write_plan(lock_plan(load_plan(plan), resolve_group), lock)
        return lock

    def client(self, timeout_s: float = 600.0):  # type: ignore[no-untyped-def]
        import weenv

        return weenv.Client(self.socket, autostart=False, timeout_s=timeout_s)

    def log(self) -> str:
        try:
            return Path(self.home, "daemon.log").read_text(errors="replace")
        except OSError:
            return ""

    def usage_bytes(self) -> int:
        with open(f"{self.cgroup}/memory.usage_in_bytes") as f:
            return int(f.read())

    def node_oom_kills(self) -> int:
        with open(f"{self.cgroup}/memory.oom_control") as f:
            return int(dict(line.split() for line in f).get("oom_kill", 0))

    def stop(self) -> None:
        try:
            with self.client(60) as c:
                kill_all(c)
                c.gc()
        except Exception:
            pass
        envlet_pid = None
        try:
            from weenv.envlet import EnvletClient

            envlet_pid = EnvletClient(os.path.join(self.home, "run", "envlet.sock")).ping()["pid"]
        except Exception:
            pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if envlet_pid:
            try:
                os.kill(envlet_pid, signal.SIGTERM)
                for _ in range(100):
                    os.kill(envlet_pid, 0)
                    time.sleep(0.05)
            except ProcessLookupError:
                pass
        subprocess.run(["fusermount3", "-u", "-z", os.path.join(self.home, "envlet", "mnt")], capture_output=True)
        # weenv's parent groups are placed by the daemon's own cgroups: remove them from in there.
        subprocess.run([sys.executable, "-c", "import sys; from weenv.provision.cgroups import detect_backend; "
                        "sys.exit(0 if detect_backend(sys.argv[1]).remove_parent() else 1)", self.cgroup_root],
                       preexec_fn=self._join, capture_output=True)
        for _ in range(50):
            try:
                os.rmdir(self.cgroup)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        shutil.rmtree(self.home, ignore_errors=True)


def kill_all(c: Any) -> None:
    ids = [e["id"] for e in c.list()]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: c.get(i).kill(), ids))


# ------------------------------------------------------------------------------------------ runs


@dataclass
class Run:
    sizing: str
    n: int
    memory: str
    created: int = 0
    refused: int = 0
    refusal: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    oom_kills: int = 0
    memory_refusals: int = 0
    memory_up: int = 0
    memory_down: int = 0
    fast_steps: int = 0
    peak_usage_bytes: int = 0
    peak_limits_bytes: int = 0
    slowdowns: list[float] = field(default_factory=list)
    series: dict[str, list] = field(default_factory=dict)
    wall_s: float = 0.0

    def mean_of(self, key: str) -> float:
        xs = [r[key] / r["cycles"] for r in self.results if key in r]
        return sum(xs) / len(xs) if xs else float("nan")

    @property
    def mean_slowdown(self) -> float:
        return sum(self.slowdowns) / len(self.slowdowns) if self.slowdowns else float("inf")

    def holds(self, limit: float) -> bool:
        return (self.refused == 0 and not self.failures and self.oom_kills == 0 and len(self.results) == self.n
                and self.mean_slowdown <= limit)


def create_envs(node: Node, n: int, memory: str, *, parallel: bool, tag: str,
                stop_at_refusal: bool = False) -> tuple[list[str], int, str]:
    """Start ``n`` envs; returns (ids, refused, first refusal message)."""
    import weenv

    ids: list[str] = []
    refused = 0
    message = ""
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal refused, message
        with node.client(120) as c:
            try:
                env = c.create(node.lock, cpu="1", memory=memory, name=f"{tag}{i}")
            except weenv.ApiError as e:
                if e.status != 503:
                    raise
                with lock:
                    refused += 1
                    message = message or str(e)
                return
        with lock:
            ids.append(env.id)

    if parallel:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(one, range(n)))
    else:
        for i in range(n):
            one(i)
            if refused and stop_at_refusal:
                break
    return ids, refused, message


def _drive(ids: list[str], one: Any, sampler: Any, done: threading.Event) -> list[dict[str, Any]]:
    """``one(id)`` for every env at once while ``sampler`` runs in a thread until all are back."""
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
            return list(pool.map(one, ids))
    finally:
        done.set()
        thread.join()


def _tally(r: Run, outs: list[dict[str, Any]], base_active_ms: float | None) -> None:
    """The workload's answers into ``r``: failures (an exit 137 not from a timeout: the OOM killer),
    results, and each env's slowdown against its own think time plus the active time alone."""
    for o in outs:
        if o["exit_code"] != 0:
            why = "timed out" if o["timed_out"] else f"exit {o['exit_code']}"
            r.failures.append(f"{o['env']}: {why} {o['stderr']}")
            if o["exit_code"] == 137 and not o["timed_out"]:
                r.oom_kills = max(r.oom_kills, 1)  # SIGKILL not from us: the OOM killer
            continue
        r.results.append(o)
        if base_active_ms is not None:
            r.slowdowns.append(o["total_ms"] / (o["think_ms"] + base_active_ms))


def run(node: Node, sizing: str, n: int, memory: str, work: Workload, base_active_ms: float | None,
        *, sample_s: float = 0.25, trace_envs: int = 0) -> Run:
    r = Run(sizing, n, memory)
    # Static sizing sits at the admission bound: create one by one so that admission sees each env.
    ids, r.refused, r.refusal = create_envs(node, n, memory, parallel=n > 4 and sizing == "elastic", tag=sizing[0])
    r.created = len(ids)
    if r.refused:
        with node.client() as c:
            kill_all(c)
        return r
    rng = random.Random(n * 7919 + len(sizing))
    offsets = {env_id: (0.0 if n == 1 else rng.uniform(0, work.cycle_s)) for env_id in ids}
    seeds = {env_id: i + 1 for i, env_id in enumerate(ids)}
    done = threading.Event()
    series: dict[str, list] = {"t": [], "limits": [], "used": [], "available": [], "promised": [], "reserved": []}
    traced = ids[:trace_envs]
    for env_id in traced:
        series[f"limit|{env_id}"] = []
        series[f"used|{env_id}"] = []
    t0 = time.monotonic()

    def sampler() -> None:
        with node.client(30) as c:
            while not done.is_set():
                try:
                    top = c.top()
                except Exception:
                    time.sleep(sample_s)
                    continue
                envs = top["envs"]
                limits = sum(e["memory"]["limit_bytes"] or 0 for e in envs.values())
                used = sum(e["memory"]["used_bytes"] or 0 for e in envs.values())
                nd = top.get("node") or {}
                series["t"].append(round(time.monotonic() - t0, 3))
                series["limits"].append(limits)
                series["used"].append(used)
                series["available"].append(nd.get("memory_available_bytes"))
                series["promised"].append(nd.get("memory_promised_bytes"))
                series["reserved"].append(nd.get("memory_reserved_bytes"))
                for env_id in traced:
                    e = envs.get(env_id) or {"memory": {}}
                    series[f"limit|{env_id}"].append(e["memory"].get("limit_bytes"))
                    series[f"used|{env_id}"].append(e["memory"].get("used_bytes"))
                r.peak_usage_bytes = max(r.peak_usage_bytes, node.usage_bytes())
                r.peak_limits_bytes = max(r.peak_limits_bytes, limits)
                done.wait(sample_s)

    def one(env_id: str) -> dict[str, Any]:
        time.sleep(max(0.0, t0 + offsets[env_id] - time.monotonic()))
        timeout_s = work.cycles * work.cycle_s * 4 + 120
        with node.client(timeout_s + 30) as c:
            res = c.get(env_id).exec(work.argv(seeds[env_id]), timeout_s=timeout_s)
        out = {"env": env_id, "exit_code": res.exit_code, "stderr": res.stderr.decode(errors="replace")[-300:],
               "timed_out": res.timed_out}
        if res.exit_code == 0:
            out.update(parse_rollout_result(res.stdout.decode()))
        return out

    oom_node_before = node.node_oom_kills()
    with node.client() as c:
        fast0 = c.top()["statistics"]["fast_steps"]
    outs = _drive(ids, one, sampler, done)
    r.wall_s = time.monotonic() - t0
    with node.client() as c:
        top = c.top()
        for env_id in ids:
            m = top["envs"][env_id]["metrics"]
            r.oom_kills += m["oom_kills"]
            r.memory_refusals += m["memory_refusals"]
            r.memory_up += m["memory_up"]
            r.memory_down += m["memory_down"]
        r.fast_steps = top["statistics"]["fast_steps"] - fast0
        kill_all(c)
    r.oom_kills += node.node_oom_kills() - oom_node_before
    _tally(r, outs, base_active_ms)
    r.series = series
    time.sleep(1.0)  # let the killed envs' memory go back before the next run
    return r


def trace_quotas(node: Node, seconds_per_sample: float = 0.05) -> dict[str, list]:
    """One env, CPU 0.25-1 core and memory 8-448 MiB, under bursts: its quotas over time."""
    work = Workload(cycles=3, think_ms=2500, burst_miters=500, hold_ms=1500)
    with node.client() as c:
        env = c.create(node.lock, cpu="0.25-1", memory=f"{ELASTIC_MIN_BYTES // MIB}MiB-{MAX_BYTES // MIB}MiB",
                       name="trace")
        series: dict[str, list] = {k: [] for k in ("t", "cpu_quota", "cpu_used", "mem_limit", "mem_used")}
        done = threading.Event()
        result: dict[str, Any] = {}

        def worker() -> None:
            with node.client() as c2:
                result["r"] = c2.get(env.id).exec(work.argv(3), timeout_s=120)
            done.set()

        t0 = time.monotonic()

        def sample() -> None:
            e = c.top()["envs"][env.id]
            series["t"].append(round(time.monotonic() - t0, 3))
            series["cpu_quota"].append(e["cpu"]["quota_cores"])
            series["cpu_used"].append(e["cpu"]["used_cores"])
            series["mem_limit"].append(e["memory"]["limit_bytes"])
            series["mem_used"].append(e["memory"]["used_bytes"])

        th = threading.Thread(target=worker)
        th.start()
        while not done.is_set():
            sample()
            done.wait(seconds_per_sample)
        th.join()
        t_end = time.monotonic() - t0
        while time.monotonic() - t0 < t_end + 6:  # the quotas coming back down after the last burst
            sample()
            time.sleep(seconds_per_sample * 2)
        series["metrics"] = [c.top()["envs"][env.id]["metrics"]]
        env.kill()
    series["exit_code"] = [result["r"].exit_code]
    return series


def cpu_reaction_s(trace: dict[str, list]) -> float | None:
    """From the start of the first CPU burst (the last sample before the quota first rose in
    which the env used next to nothing) to the quota at its max."""
    t, quota, used = trace["t"], trace["cpu_quota"], trace["cpu_used"]
    first_up = next((i for i, q in enumerate(quota) if q is not None and q > quota[0]), None)
    if first_up is None:
        return None
    start = next((t[i] for i in range(first_up, -1, -1) if used[i] is not None and used[i] < 0.05), t[0])
    top = next((t[i] for i in range(first_up, len(t)) if quota[i] == 1.0), None)
    return None if top is None else top - start


# ------------------------------------------------------------------------------------------ docker


class DockerNode:
    """The same node for Docker: a memory cgroup capped at ``memory_bytes`` under the private
    dockerd's own cgroup parent; every container is placed in it (``--cgroup-parent``) with Docker's
    static limits, ``--memory M --memory-swap M --cpus 1 --network none``. dockerd, containerd and
    the shims stay outside the cap (weenv's daemon and envlet are inside theirs)."""

    def __init__(self, peer: Any, memory_bytes: int):
        self.peer = peer
        self.memory_bytes = memory_bytes
        self.parent = f"/{peer.d.cgroup_parent}/density"
        self.cgroup = f"/sys/fs/cgroup/memory{self.parent}"
        os.makedirs(self.cgroup, exist_ok=True)  # removed with dockerd's cgroup parent (stop_dockerd)
        with open(f"{self.cgroup}/memory.limit_in_bytes", "w") as f:
            f.write(str(memory_bytes))

    def usage_bytes(self) -> int:
        with open(f"{self.cgroup}/memory.usage_in_bytes") as f:
            return int(f.read())

    def node_oom_kills(self) -> int:
        with open(f"{self.cgroup}/memory.oom_control") as f:
            return int(dict(line.split() for line in f).get("oom_kill", 0))

    def create(self, n: int) -> list[str]:
        from ._peers import IMAGE

        def one(i: int) -> str:
            return self.peer.cli("run", "-d", "--network", "none", "--memory", str(MAX_BYTES), "--memory-swap",
                                 str(MAX_BYTES), "--cpus", "1", "--cgroup-parent", self.parent,
                                 "--name", f"density-{os.getpid()}-{i}", IMAGE, "sleep", "1000000").stdout.strip()

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            return list(pool.map(one, range(n)))

    def remove(self, ids: list[str]) -> None:
        for i in range(0, len(ids), 32):
            self.peer.cli("rm", "-f", *ids[i:i + 32], check=False, timeout_s=300)


def docker_run(node: DockerNode, n: int, work: Workload, base_active_ms: float | None,
               *, sample_s: float = 0.25) -> Run:
    """:func:`run` for Docker: ``n`` containers idle first, then the workload by one ``docker exec``
    each, at the same random phases; OOM kills counted at the node's cgroup and by exit 137."""
    r = Run("docker", n, f"--memory {MAX_BYTES // MIB}m")
    ids = node.create(n)
    r.created = len(ids)
    rng = random.Random(n * 7919 + len("docker"))
    offsets = {c: (0.0 if n == 1 else rng.uniform(0, work.cycle_s)) for c in ids}
    seeds = {c: i + 1 for i, c in enumerate(ids)}
    done = threading.Event()
    t0 = time.monotonic()

    def sampler() -> None:
        while not done.is_set():
            r.peak_usage_bytes = max(r.peak_usage_bytes, node.usage_bytes())
            done.wait(sample_s)

    def one(cid: str) -> dict[str, Any]:
        time.sleep(max(0.0, t0 + offsets[cid] - time.monotonic()))
        timeout_s = work.cycles * work.cycle_s * 4 + 120
        try:
            p = node.peer.cli("exec", cid, *work.argv(seeds[cid]), check=False, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            return {"env": cid[:12], "exit_code": -1, "stderr": "", "timed_out": True}
        out = {"env": cid[:12], "exit_code": p.returncode, "stderr": p.stderr[-300:], "timed_out": False}
        if p.returncode == 0:
            out.update(parse_rollout_result(p.stdout))
        return out

    oom_before = node.node_oom_kills()
    try:
        outs = _drive(ids, one, sampler, done)
    finally:
        r.wall_s = time.monotonic() - t0
        r.oom_kills = node.node_oom_kills() - oom_before
        node.remove(ids)
    _tally(r, outs, base_active_ms)
    time.sleep(1.0)
    return r


def docker_density(node: DockerNode, work: Workload, slowdown: float, first_n: int, quick: bool,
                   log: Any) -> tuple[Run, Run | None, dict[int, Run]]:
    """The workload alone in Docker, then the largest N that holds (zero OOM kills, every run done,
    mean slowdown within the bound), searched from ``first_n`` (the N elastic weenv held): one step
    up from there (x1.25) while it holds (at most three steps), else halving until one holds, then
    one step between the last N that held and the first that did not."""
    alone = docker_run(node, 1, work, None)
    if not alone.results:
        raise RuntimeError(f"the workload alone failed in Docker: {alone.failures}")
    a = alone.results[0]
    active_ms = a["total_ms"] - a["think_ms"]
    alone.slowdowns = [1.0]
    log(f"docker alone: {a['total_ms'] / 1000:.1f} s, active {active_ms / 1000:.2f} s")
    tried: dict[int, Run] = {}

    def try_n(n: int) -> bool:
        if n not in tried:
            tried[n] = r = docker_run(node, n, work, active_ms)
            log(f"docker N={n}: holds={r.holds(slowdown)} slowdown {r.mean_slowdown:.3f} oom {r.oom_kills} "
                f"failures {len(r.failures)} peak node usage {r.peak_usage_bytes / MIB:.0f} MiB")
        return tried[n].holds(slowdown)

    n = max(1, first_n)
    if try_n(n):
        good, bad = n, 0
        for _ in range(0 if quick else 3):
            up = max(good + 1, round(good * 1.25))
            if not try_n(up):
                bad = up
                break
            good = up
    else:
        good, bad = 0, n
        while n > 1:
            n //= 2
            if try_n(n):
                good = n
                break
            bad = n
        if good and bad - good > 1 and not quick:
            mid = (good + bad) // 2
            if try_n(mid):
                good = mid
    return alone, tried.get(good), tried


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--node-memory", default=None, help="RAM of the simulated node (default 2GiB, quick 1GiB)")
    p.add_argument("--node-reserve", default="256MiB")
    p.add_argument("--cycles", type=int, default=None)
    p.add_argument("--think-s", type=float, default=None, help="mean think time per cycle (default 60, quick 5)")
    p.add_argument("--hold-s", type=float, default=None, help="how long each allocation is held (default 1, quick 0.3)")
    p.add_argument("--monitor-hold", default="0.5", help="the daemon's --hold (seconds under-used before halving)")
    p.add_argument("--slowdown", type=float, default=1.10)
    p.add_argument("--no-docker", action="store_true", help="leave out the Docker peer")
    p.add_argument("--n", default="", help="elastic N values to run (comma-separated) instead of the search")
    args = p.parse_args()
    quick = args.quick
    node_bytes = parse_size(args.node_memory or "2GiB")
    reserve = parse_size(args.node_reserve)
    work = Workload(cycles=args.cycles or (1 if quick else 2), think_ms=1000 * (args.think_s or (5 if quick else 60)),
                    hold_ms=1000 * (args.hold_s or (0.3 if quick else 1.0)))
    report = Report("density", "Density: static vs elastic memory sizing", quick)
    flags = ["--cpu-min-overcommit", "1000", "--node-reserve", args.node_reserve, "--memory-headroom", "8MiB",
             "--hold", args.monitor_hold]
    node = Node(node_bytes, flags)
    static_mem = f"{MAX_BYTES // MIB}MiB"
    elastic_mem = f"{ELASTIC_MIN_BYTES // MIB}MiB-{MAX_BYTES // MIB}MiB"
    runs: list[Run] = []
    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.0f}s] {msg}", flush=True)

    def overcommit(n: int) -> float:
        return n * MAX_BYTES / node_bytes

    try:
        node.start()
        log(f"node: {node_bytes / GIB:g} GiB memory cgroup, daemon flags {' '.join(flags)}")
        trace = None
        if not quick:
            trace = trace_quotas(node)
            log(f"quota trace: {len(trace['t'])} samples, cpu reaction {cpu_reaction_s(trace)}")
        # (0) the workload alone
        base = run(node, "static", 1, static_mem, work, None)
        if not base.results:
            raise RuntimeError(f"the workload alone failed: {base.failures or base.refusal}")
        b = base.results[0]
        base_active_ms = b["total_ms"] - b["think_ms"]
        base.slowdowns = [1.0]
        log(f"alone: {b['total_ms'] / 1000:.1f} s, active {base_active_ms / 1000:.2f} s ({b})")
        base_alloc_ms = base.mean_of("alloc_ms")
        # (a) static: as many as admission grants, then one more
        ids, refused, _ = create_envs(node, 1000, static_mem, parallel=False, tag="probe", stop_at_refusal=True)
        n_static = len(ids)
        with node.client() as c:
            kill_all(c)
        time.sleep(1)
        static = run(node, "static", n_static, static_mem, work, base_active_ms)
        runs.append(static)
        log(f"static N={n_static}: holds={static.holds(args.slowdown)} slowdown {static.mean_slowdown:.3f} "
            f"oom {static.oom_kills} failures {len(static.failures)}")
        extra = run(node, "static", n_static + 1, static_mem, work, base_active_ms)
        log(f"static N={n_static + 1}: refused {extra.refused} ({extra.refusal})")
        # (b) elastic: around the N of a 10x overcommit
        n10 = -(-10 * node_bytes // MAX_BYTES)
        if args.n:
            plan = [int(x) for x in args.n.split(",")]
        elif quick:
            plan = [max(n_static + 1, n10 // 4)]
        else:
            plan = []
        tried: dict[int, Run] = {}

        def try_n(n: int) -> Run:
            if n not in tried:
                r = run(node, "elastic", n, elastic_mem, work, base_active_ms, trace_envs=3)
                tried[n] = r
                runs.append(r)
                log(f"elastic N={n} ({overcommit(n):.1f}x): holds={r.holds(args.slowdown)} slowdown "
                    f"{r.mean_slowdown:.3f} (max {max(r.slowdowns, default=0):.3f}) oom {r.oom_kills} "
                    f"refusals {r.memory_refusals} doublings {r.memory_up} fast steps {r.fast_steps} "
                    f"peak node usage {r.peak_usage_bytes / MIB:.0f} MiB failures {len(r.failures)}; per cycle: "
                    f"alloc {r.mean_of('alloc_ms'):.0f} ms (alone {base_alloc_ms:.0f}), burst "
                    f"{r.mean_of('burst_ms'):.0f} ms (alone {base.mean_of('burst_ms'):.0f})")
            return tried[n]

        if plan:
            for n in plan:
                try_n(n)
        else:
            # Up from the 10x point while it holds; down from it until one holds.
            n = n10
            if try_n(n).holds(args.slowdown):
                for f in (1.25, 1.5, 2.0):
                    if not try_n(round(n10 * f)).holds(args.slowdown):
                        break
            else:
                for f in (0.875, 0.75, 0.625, 0.5, 0.25):
                    if try_n(max(n_static + 1, round(n10 * f))).holds(args.slowdown):
                        break
        held = [r for r in tried.values() if r.holds(args.slowdown)]
        best = max(held, key=lambda r: r.n) if held else None

        # (c) Docker with static limits on the same node, same workload and bound
        docker_best: Run | None = None
        docker_tried: dict[int, Run] = {}
        docker_alone: Run | None = None
        if not args.no_docker:
            from ._peers import peers

            with peers(str(Path(node.home) / "src"), report, names=("docker",)) as ps:
                if "docker" in ps:
                    dnode = DockerNode(ps["docker"], node_bytes)
                    docker_alone, docker_best, docker_tried = docker_density(
                        dnode, work, args.slowdown, best.n if best is not None else n10, quick, log)

        # -- report ----------------------------------------------------------------------------
        pct = (args.slowdown - 1) * 100
        report.add("the workload alone (static sizing, N=1): completion", b["total_ms"] / 1000, "s",
                   note=f"active part {base_active_ms / 1000:.2f} s: {work.describe()}")
        report.add("static sizing: largest N held", static.n if static.holds(args.slowdown) else 0, "envs",
                   note=f"min = max = {MAX_BYTES // MIB} MiB: admission grants {n_static} envs on "
                        f"{node_bytes / GIB:g} GiB (reserve {reserve // MIB} MiB); env {n_static + 1} is refused "
                        f"({extra.refused} refused, HTTP 503); slowdown {(static.mean_slowdown - 1) * 100:+.1f} %, "
                        f"{static.oom_kills} OOM kills")
        report.add("static sizing: memory overcommit", overcommit(static.n), "x (Σ max ÷ node RAM)")
        if best is not None:
            report.add("elastic sizing: largest N held", best.n, "envs", baseline=static.n,
                       baseline_label="static sizing, envs", higher_is_better=True,
                       note=f"min {ELASTIC_MIN_BYTES // MIB} MiB, max {MAX_BYTES // MIB} MiB; zero OOM kills, "
                            f"mean completion {(best.mean_slowdown - 1) * 100:+.1f} % (worst env "
                            f"{(max(best.slowdowns) - 1) * 100:+.1f} %) against the workload alone")
            report.add("elastic sizing: memory overcommit at that N", overcommit(best.n), "x (Σ max ÷ node RAM)",
                       goal="≥10x", ok=overcommit(best.n) >= 10)
            report.add("elastic: mean completion time vs alone", (best.mean_slowdown - 1) * 100, "%",
                       p99=(percentile(best.slowdowns, 99) - 1) * 100, goal=f"≤{pct:g} %",
                       ok=best.mean_slowdown <= args.slowdown)
            report.add("elastic: OOM kills at that N", best.oom_kills, "kills", goal="0", ok=best.oom_kills == 0)
            report.add("elastic: limit doublings / refusals at that N", best.memory_up, "doublings",
                       note=f"{best.memory_refusals} refusal episodes (node headroom short: the env waited), "
                            f"{best.fast_steps} steps taken between ticks on the kernel's OOM notification; "
                            f"peak node usage {best.peak_usage_bytes / MIB:.0f} MiB of {node_bytes // MIB} MiB, "
                            f"peak Σ limits {best.peak_limits_bytes / MIB:.0f} MiB")
        else:
            report.add("elastic sizing: largest N held", 0, "envs", goal="≥10x overcommit", ok=False,
                       note="no elastic N tried held: see the per-N rows")
        if docker_alone is not None:
            da = docker_alone.results[0]
            dn = docker_best.n if docker_best is not None else 0
            fit = node_bytes // MAX_BYTES
            report.add("docker, static limits, placed by its limits: envs", fit, "envs",
                       note=f"Σ --memory ≤ node RAM ({fit} x {MAX_BYTES // MIB} MiB on {node_bytes / GIB:g} GiB): what "
                            "a scheduler that honours the limits (no overcommit) places")
            report.add("docker, static limits, packed: largest N held", dn, "envs",
                       note=f"docker run --memory {MAX_BYTES // MIB}m --memory-swap {MAX_BYTES // MIB}m --cpus 1 "
                            f"--network none into a {node_bytes / GIB:g} GiB memory cgroup (the containers only: "
                            f"dockerd, containerd and the shims outside it), N past its limits; zero OOM kills and "
                            f"mean completion ≤{pct:g} % above Docker's own run alone ({da['total_ms'] / 1000:.1f} s) "
                            "in this run. Nothing in Docker holds that bound: coinciding peaks are OOM-killed")
            if best is not None:
                # Issue 32's goal: Docker sized by static limits is placed by them (a scheduler that
                # honours --memory, as Kubernetes' Guaranteed class and SWE-style harnesses do).
                report.add("elastic weenv vs docker placed by its limits: envs", best.n, "envs", baseline=fit,
                           baseline_label="docker by its limits, envs", higher_is_better=True, goal="≥5x",
                           ok=best.n >= 5 * fit)
            if best is not None and dn:
                # Packed past its limits Docker is bounded only by the RAM its coinciding peaks touch,
                # as weenv is: no scheme gets 5x there. The guard is parity, with zero kills by design.
                report.add("elastic weenv vs docker packed past its limits: envs held", best.n, "envs", baseline=dn,
                           baseline_label="docker packed, envs", higher_is_better=True, goal="≥1x",
                           ok=best.n >= dn,
                           note="both bounded by the same RAM: Docker by luck (nothing stops coinciding peaks "
                                "but the OOM killer), weenv by admission and burst reservations (zero kills)")
            for r in sorted(docker_tried.values(), key=lambda r: r.n):
                report.add(f"docker N={r.n} ({overcommit(r.n):.1f}x)", (r.mean_slowdown - 1) * 100 if r.slowdowns else 0,
                           "% slower", ok=r.holds(args.slowdown),
                           note=f"{r.oom_kills} OOM kills, {len(r.failures)} failed, peak node usage "
                                f"{r.peak_usage_bytes / MIB:.0f} MiB"
                                + (f"; first failure: {r.failures[0][:160]}" if r.failures else ""))
        for r in sorted(tried.values(), key=lambda r: r.n):
            report.add(f"elastic N={r.n} ({overcommit(r.n):.1f}x)", (r.mean_slowdown - 1) * 100 if r.slowdowns else 0,
                       "% slower", ok=r.holds(args.slowdown),
                       note=f"{r.oom_kills} OOM kills, {len(r.failures)} failed, {r.memory_refusals} refusal episodes, "
                            f"{r.memory_up} doublings, peak node usage {r.peak_usage_bytes / MIB:.0f} MiB; per cycle "
                            f"the allocation took {r.mean_of('alloc_ms'):.0f} ms (alone {base_alloc_ms:.0f} ms: the "
                            f"rest is waiting for memory), the CPU burst {r.mean_of('burst_ms'):.0f} ms (alone "
                            f"{base.mean_of('burst_ms'):.0f} ms)"
                            + (f"; first failure: {r.failures[0][:160]}" if r.failures else ""))
        if trace is not None:
            react = cpu_reaction_s(trace)
            if react is not None:
                report.add("quota trace: CPU 0.25 → 1 core after a burst starts", react, "s",
                           goal="about a second", ok=react <= 1.5,
                           note="one env, cpu 0.25-1 core, memory 8-448 MiB, bursts of CPU and memory")
        report.notes.append(
            f"Node: a memory cgroup capped at {node_bytes / GIB:g} GiB holding the daemon, the envlet and every env; "
            f"daemon flags {' '.join(flags)}. Workload per env: {work.describe()}; 1 core per env in both sizings. "
            f"Host load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (shared VM).")
        report.series = {
            "node_bytes": [node_bytes], "max_bytes": [MAX_BYTES], "slowdown_limit": [args.slowdown],
            "runs": [{"sizing": r.sizing, "n": r.n, "overcommit": overcommit(r.n), "holds": r.holds(args.slowdown),
                      "mean_slowdown": r.mean_slowdown if r.slowdowns else None,
                      "max_slowdown": max(r.slowdowns) if r.slowdowns else None, "oom_kills": r.oom_kills,
                      "refused": r.refused, "failures": len(r.failures), "memory_refusals": r.memory_refusals}
                     for r in [static, extra, *tried.values(), *docker_tried.values()]],
        }
        if best is not None:
            report.series["node_over_time"] = [best.series]
            report.series["node_over_time_n"] = [best.n]
        if trace is not None:
            report.series["quota_trace"] = [trace]
        if not report.quick:  # a smoke run must not overwrite the published plots
            from . import _plots

            report.plots = [p for p in (_plots.quota_over_time(report.series), _plots.density(report.series)) if p]
        report.print()
        print("saved", report.save())
        log("done")
    finally:
        node.stop()


if __name__ == "__main__":
    sys.exit(main())
