"""Soak: N env lifecycles, C at a time, on one private daemon; then nothing may be left behind.

Each lifecycle is create → exec → files write/read → pause/resume → commit → fork (one child, which
reads the parent's file) → kill, on a busybox plan or a Debian bookworm minbase + python3 plan, through
the Python client (``weenv.Client``) or through the unmodified E2B SDK against ``weenv serve`` on
127.0.0.1 (every fourth lifecycle). At the end every snapshot is deleted, ``gc`` runs, and the
campaign asserts: 0 failed lifecycles; no mount under the home but the envlet's and what was there
before; no cgroup under the daemon's cgroup root; no crun container; no process in an env cgroup and
no new child of the daemon; no weenv veth or netns; no snapshot record or snapshot tree; home bytes
(outside the envlet cache, the layer trees and the embedded store, which have their own bounds)
grown by less than ``DISK_BOUND``; daemon RSS and FD counts after warm-up grown by less than
``RSS_BOUND`` / ``FD_BOUND`` at the end.

``--quick`` (CI): 64 lifecycles, 8 at a time; the Debian plan only if the fixture cache already holds
its tar (else Debian minbase if cached, else busybox alone). Full (``make soak``): 1,000 lifecycles,
32 at a time, the Debian + python3 tar built if missing; then the fault matrix and fuzz targets run
(pytest, junit) and docs/reliability.md is rendered from benchmarks/results/reliability/*.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as _dt
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weenv.provision.cgroups._warm import SCRATCH_PREFIX

from ._util import _commit, machine, median, percentile

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "reliability"  # not *.json of results/: docs/benchmarks.md skips it
DOCS = ROOT / "docs" / "reliability.md"

RSS_BOUND = 64 << 20  # daemon VmRSS growth from warm-up to the end
FD_BOUND = 16  # daemon open fds growth from warm-up to the end
DISK_BOUND = 64 << 20  # home bytes growth outside the bounded caches
E2B_EVERY = 4  # every 4th lifecycle goes through the E2B SDK
# 32 lifecycles at a time hold up to 64 envs (each parent and its fork child): their guaranteed minimums
# must fit the node (2 cores: 64 x 0.025), or admission refuses them, as it should
RESOURCES = {'disk = "64MiB"': 'disk = "256MiB"', 'min = "64MiB"': 'min = "32MiB"', "min = 0.05": "min = 0.025"}


# ------------------------------------------------------------------------------- node state

def _rss_fds(pid: int) -> tuple[int, int]:
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def _mounts_under(prefix: str) -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f if line.split()[4].startswith(prefix + "/")}


def _cgroups(root: str) -> list[str]:
    """Groups left under weenv's parent ``root``, but the daemon's two scratch groups (cgroups/_warm.py),
    which it keeps while it runs (their parked process is the daemon's, by design)."""
    out = []
    for hier in ("memory", "cpu", "pids", "freezer", "cpuacct", "unified"):
        for dirpath, dirnames, _ in os.walk(f"/sys/fs/cgroup/{hier}"):
            if os.path.basename(dirpath) == root:
                out += [f"{dirpath}/{d}" for d in dirnames if not d.startswith(SCRATCH_PREFIX)]
                dirnames[:] = []
    return out


def _env_pids(root: str) -> list[str]:
    """Processes in a cgroup below ``root`` (env inits, agents, what they started): "PID CMDLINE CGROUP"."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cgroup") as f:
                groups = [line.split(":", 2)[2].strip() for line in f if f"/{root}/" in line]
            if groups and not any(f"/{root}/{SCRATCH_PREFIX}" in g for g in groups):
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
                with open(f"/proc/{p}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                out.append(f"{p} ({state}, parent {ppid}) {cmd} {groups[0]}")
        except OSError:
            pass
    return out


def _dying(line: str) -> bool:
    """Whether an ``_env_pids`` line is a process already dead: exiting (X), or a zombie (Z) whose parent is
    pid 1 or none (the kernel or init reaps it; nothing of weenv's holds it)."""
    return "(X, " in line or "(Z, parent 1)" in line or "(Z, parent 0)" in line


def _movers(root: str) -> set[int]:
    """The daemon's parked process of its scratch groups (at most one: cgroups/_warm.py)."""
    out = set()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cgroup") as f:
                    if f"/{root}/{SCRATCH_PREFIX}" in f.read():
                        out.add(int(p))
            except OSError:
                pass
    return out


def _children(pid: int) -> set[int]:
    out = set()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(p))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _du(path: str, skip: tuple[str, ...] = ()) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip
                       and not os.path.ismount(os.path.join(dirpath, d))]
        for n in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


def _veths() -> list[str]:
    from weenv.testing import weenv_links

    return weenv_links("weenv")


# ------------------------------------------------------------------------------- plans

def _debian_tar(quick: bool) -> tuple[str, Path | None, tuple[str, ...]]:
    from weenv.testing import check_debian_tar, debian_tar, debian_tar_name, find

    for include in (("python3",), ()):
        if find(debian_tar_name(include=include), lambda p, i=include: check_debian_tar(p, i)):
            return ("debian+python3" if include else "debian"), debian_tar(include=include), include
        if not quick and include:
            try:
                return "debian+python3", debian_tar(include=include), include
            except Exception as e:  # no Debian mirror: busybox alone, said in the result
                print(f"soak: Debian + python3 tar could not be built: {e}", file=sys.stderr)
    return "none", None, ()


def _publish_debian(home: str, tar: Path, name: str) -> str:
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import publish, resolve_group
    from weenv.testing._daemon import weenv_home

    with weenv_home(home):
        publish(str(tar), "debian:soak", group="os", group_class="os")
        plan = os.path.join(home, f"{name}.toml")
        with open(plan, "w") as f:
            f.write(f'name = "{name}"\n\n[[groups]]\nname = "os"\nref = "debian:soak"\nclass = "os"\n\n'
                    '[resources]\npids = 256\ndisk = "256MiB"\n\n[resources.cpu]\nmin = 0.025\nmax = 1.0\n\n'
                    '[resources.memory]\nmin = "32MiB"\nmax = "512MiB"\n')
        lock = os.path.join(home, f"{name}.lock.toml")
        write_plan(lock_plan(load_plan(plan), resolve_group), lock)
    return lock


# ------------------------------------------------------------------------------- lifecycles

@dataclass
class Kind:
    name: str  # "busybox" | "debian+python3" | "debian"
    lock: str
    template: str  # the E2B template name
    probe: str  # a shell command whose stdout is "42"


def _python_lifecycle(client: Any, kind: Kind, i: int) -> None:
    data = f"soak {i} {kind.name}\n".encode() * 64
    env = client.create(kind.lock, ttl_s=600)
    try:
        r = env.exec(["sh", "-c", kind.probe])
        assert r.exit_code == 0 and r.stdout.strip() == b"42", f"exec: {r}"
        env.write_file("/tmp/soak.txt", data)
        assert env.read_file("/tmp/soak.txt") == data, "read back differs"
        env.pause()
        env.resume()
        r = env.exec(["cat", "/tmp/soak.txt"])
        assert r.exit_code == 0 and r.stdout == data, "exec after resume"
        snap = env.commit()
        try:
            children = env.fork(1)
            try:
                assert children[0].read_file("/tmp/soak.txt") == data, "fork child lost the parent's file"
            finally:
                for ch in children:
                    ch.kill()
        finally:
            client.delete_snapshot(snap)
    finally:
        env.kill()


def _e2b_lifecycle(kind: Kind, i: int) -> None:
    import e2b

    data = f"soak {i} {kind.name} e2b\n" * 64
    sbx = e2b.Sandbox.create(kind.template, timeout=600)
    try:
        r = sbx.commands.run(kind.probe)
        assert r.exit_code == 0 and r.stdout.strip() == "42", f"commands.run: {r}"
        sbx.files.write("/tmp/soak.txt", data)
        assert sbx.files.read("/tmp/soak.txt") == data, "read back differs"
        assert sbx.pause() is True
        sbx = e2b.Sandbox.connect(sbx.sandbox_id)
        assert sbx.files.read("/tmp/soak.txt") == data, "read after resume"
        snap = sbx.create_snapshot()
        try:
            children = sbx.fork(count=1)
            try:
                for ch in children:
                    assert not isinstance(ch, Exception), ch
                    assert ch.files.read("/tmp/soak.txt") == data, "fork child lost the parent's file"
            finally:
                for ch in children:
                    if not isinstance(ch, Exception):
                        ch.kill()
        finally:
            e2b.Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        sbx.kill()


# ------------------------------------------------------------------------------- weenv serve

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_serve(d: Any, templates: dict[str, str]) -> tuple[subprocess.Popen, dict[str, str]]:
    import httpx

    from weenv.api import KeyStore, TemplateStore

    api_dir = os.path.join(d.home, "api")
    key = KeyStore(api_dir).create("soak", admin=False)
    for name, lock in templates.items():
        TemplateStore(api_dir).set(name, lock)
    port = _free_port()
    log = open(os.path.join(d.home, "serve.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "weenv", "serve", "--listen", f"127.0.0.1:{port}",
                             "--socket", d.socket, "--domain", "weenv.test"], env=d.env_vars(),
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weenv serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code < 500:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("weenv serve did not answer within 30 s")
        time.sleep(0.05)
    return proc, {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key, "E2B_DOMAIN": "weenv.test"}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------- the soak

@dataclass
class Soak:
    n: int
    concurrency: int
    e2b: bool
    kinds: list[Kind] = field(default_factory=list)
    durations: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_soak(n: int, concurrency: int, quick: bool, use_e2b: bool = True) -> dict[str, Any]:
    from weenv.envlet import EnvletClient
    from weenv.testing import DaemonHandle, busybox_plan, teardown_private_daemon

    t_setup = time.monotonic()
    home = tempfile.mkdtemp(prefix="weenv-soak-")
    _, bb_lock = busybox_plan(home, "soak")
    with open(bb_lock) as f:
        text = f.read()
    for old, new in RESOURCES.items():
        text = text.replace(old, new)
    with open(bb_lock, "w") as f:
        f.write(text)
    kinds = [Kind("busybox", bb_lock, "bb", "echo $((6*7))")]
    deb_label, deb_tar, include = _debian_tar(quick)
    if deb_tar is not None:
        lock = _publish_debian(home, deb_tar, "soakdeb")
        probe = "python3 -c 'print(6*7)'" if include else "echo $((6*7))"
        kinds.append(Kind(deb_label, lock, "deb", probe))
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-soak-{os.getpid()}", bb_lock, "",
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    serve = None
    notes: list[str] = []
    checks: dict[str, Any] = {}
    samples: dict[str, tuple[int, int]] = {}
    s = Soak(n, concurrency, use_e2b, kinds)
    try:
        if use_e2b:
            try:
                import e2b  # noqa: F401

                serve, e2b_env = _start_serve(d, {k.template: k.lock for k in kinds})
                os.environ.update(e2b_env)  # the SDK reads its target from the environment
            except Exception as e:
                s.e2b = False
                notes.append(f"E2B half left out: {e}")
        pid = d.proc.pid
        envlet_pid = EnvletClient(os.path.join(home, "run", "envlet.sock")).ping()["pid"]
        base_mounts = _mounts_under(home)
        base_children = _children(pid)
        base_veths = set(_veths())
        samples["start"] = _rss_fds(pid)
        setup_s = time.monotonic() - t_setup
        clients = threading.local()
        curve: list[tuple[int, int, int]] = []  # (lifecycles done, daemon RSS, fds) under load

        def one(i: int) -> None:
            kind = kinds[i % len(kinds)]
            via = "e2b" if s.e2b and i % E2B_EVERY == E2B_EVERY - 1 else "python"
            t0 = time.monotonic()
            try:
                if via == "e2b":
                    _e2b_lifecycle(kind, i)
                else:
                    if not hasattr(clients, "c"):
                        clients.c = d.client(timeout_s=120)
                    _python_lifecycle(clients.c, kind, i)
            except Exception as e:
                with s.lock:
                    s.failures.append(f"#{i} {kind.name} via {via}: {type(e).__name__}: {e}"[:400])
                    if len(s.failures) <= 3:
                        traceback.print_exc()
            finally:
                with s.lock:
                    s.durations.setdefault(f"{kind.name} via {via}", []).append(time.monotonic() - t0)
                    s.done += 1
                    if s.done % max(1, n // 10) == 0:
                        curve.append((s.done, *_rss_fds(pid)))
                        print(f"soak: {s.done}/{n} lifecycles, {len(s.failures)} failed, daemon RSS "
                              f"{curve[-1][1] >> 20} MiB, {curve[-1][2]} fds", flush=True)

        t0 = time.monotonic()
        warm = min(n, 2 * concurrency)  # warm-up: pools, caches, trees, the allocator's arenas
        with cf.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(warm)))
            time.sleep(1.0)
            samples["warm"] = _rss_fds(pid)  # at rest, like the end sample
            list(pool.map(one, range(warm, n)))
        wall_s = time.monotonic() - t0

        with d.client() as c:  # what the lifecycles made is gone; gc takes the fork snapshots
            left_envs = [e["id"] for e in c.list()]
            c.gc()
            left_snaps = [x["id"] for x in c.snapshots()]
        time.sleep(1.0)  # the monitor's and the ttl loop's last tick
        # a process that is exiting (X) or a zombie whose parent is gone or pid 1 (Z) is dead and waits for
        # the kernel or init to finish with it: not a leak (counted). Wait until only live ones are left.
        live_pids: list[str] = []
        for _ in range(50):
            pids = _env_pids(d.cgroup_root)
            live_pids = [p for p in pids if not _dying(p)]
            if len(live_pids) == len(pids):
                break
            time.sleep(0.1)
        if len(pids) > len(live_pids):
            notes.append(f"{len(pids) - len(live_pids)} dead env processes were still being reaped")
        samples["end"] = _rss_fds(pid)
        trees_dir = os.path.join(home, "snapshot-trees")
        skip = tuple(os.path.join(home, p) for p in ("envlet", "layer-trees", "store"))
        checks = {
            "failed lifecycles": s.failures,
            "envs left": left_envs,
            "snapshots left": left_snaps,
            "mounts left": sorted(_mounts_under(home) - base_mounts),
            "cgroups left": _cgroups(d.cgroup_root),
            "containers left": os.listdir(os.path.join(home, "run", "crun"))
            if os.path.isdir(os.path.join(home, "run", "crun")) else [],
            "env processes left": live_pids,
            "daemon children added": sorted(_children(pid) - base_children - {envlet_pid} - _movers(d.cgroup_root)),
            "veths/netns added": sorted(set(_veths()) - base_veths),
            "snapshot trees left": [n for n in (os.listdir(trees_dir) if os.path.isdir(trees_dir) else [])
                                    if n != ".id-base"],  # the trees' owner marker (weenv/provision/runtime/_idmap.py)
        }
        disk = {"home_other_bytes": _du(home, skip), "envlet_cache_bytes": _du(os.path.join(home, "envlet")),
                "layer_trees_bytes": _du(os.path.join(home, "layer-trees")),
                "store_bytes": _du(os.path.join(home, "store"))}
    finally:
        if serve is not None:
            _stop(serve)
        left = teardown_private_daemon(d)
        if left:
            notes.append(f"teardown found: {left}")
    rss_growth = samples["end"][0] - samples["warm"][0]
    fd_growth = samples["end"][1] - samples["warm"][1]
    all_d = [x for v in s.durations.values() for x in v]
    result = {
        "lifecycles": n, "concurrency": concurrency, "e2b": s.e2b, "plans": [k.name for k in kinds],
        "wall_s": wall_s, "setup_s": setup_s, "lifecycles_per_s": n / wall_s if wall_s else None,
        "lifecycle_s": {"median": median(all_d), "p99": percentile(all_d, 99)},
        "per_kind": {k: {"n": len(v), "median_s": median(v), "p99_s": percentile(v, 99)}
                     for k, v in sorted(s.durations.items())},
        "samples": {k: {"rss_bytes": v[0], "fds": v[1]} for k, v in samples.items()},
        "rss_curve": curve,
        "rss_growth_bytes": rss_growth, "fd_growth": fd_growth, "disk": disk,
        "bounds": {"rss_growth_bytes": RSS_BOUND, "fd_growth": FD_BOUND, "home_other_bytes": DISK_BOUND},
        "checks": {k: v[:20] for k, v in checks.items()},
        "notes": notes,
    }
    result["ok"] = (not any(checks.values()) and rss_growth < RSS_BOUND and fd_growth < FD_BOUND
                    and disk["home_other_bytes"] < DISK_BOUND)
    return result


# ------------------------------------------------------------------------------- the fault and fuzz runs

# fault -> (promise, tests that check it). Tests of other files are cited, not duplicated.
FAULTS: list[tuple[str, str, list[str]]] = [
    ("registry down (process killed)", "uncached reads EIO within the envlet deadline; reads work again once "
     "the registry is back", ["tests/test_envlet.py::test_registry_killed_mid_read_gives_eio_within_the_deadline_then_recovers"]),
    ("registry slow (10 s per answer)", "reads EIO within the deadline (2 s, not 10 s), cached data still "
     "served, then full speed",
     ["tests/test_faults.py::test_registry_slow_10s",
      "tests/test_registry_remote.py::test_slow_answers_time_out_within_the_deadline"]),
    ("registry hung (SIGSTOP)", "EIO within the deadline, reads resume after SIGCONT",
     ["tests/test_envlet_deadline.py::test_a_sigstopped_registry_gives_eio_within_the_deadline_and_reads_resume_after_sigcont"]),
    ("5xx storm", "a short storm is retried away; a long one is EIO within the deadline; reads recover",
     ["tests/test_faults.py::test_5xx_storm", "tests/test_registry_remote.py::test_reads_fail_clearly_when_500s_persist"]),
    ("Range answered with 200", "right bytes (the stream is skipped), or ProtocolError past the skip bound",
     ["tests/test_faults.py::test_range_answered_with_200_through_the_envlet",
      "tests/test_registry_remote.py::test_range_answered_with_200_is_stream_skipped_or_refused"]),
    ("broken 416 (docker-registry's: a Content-Length it never sends)", "BlobRangeError at once, the "
     "connection pool still works", ["tests/test_store_conformance.py::test_blob_roundtrip_and_ranges"]),
    ("truncated body (a clean close mid-body)", "retried; never short data; EIO / RegistryError within the "
     "deadline if it persists", ["tests/test_faults.py::test_truncated_body_through_the_envlet",
                                 "tests/test_faults.py::test_truncated_body_at_the_store"]),
    ("corrupt chunk in L2 (flipped bytes in a pack file)", "detected, dropped, read again from the store",
     ["tests/test_envlet.py::test_l2_stays_within_its_bound_and_a_corrupted_l2_file_is_detected",
      "tests/test_envlet_units.py::test_an_l2_record_with_flipped_bytes_and_a_recomputed_crc32_is_dropped_not_served"]),
    ("corrupt chunk in the registry", "EIO, never served, not cached",
     ["tests/test_envlet.py::test_a_corrupted_blob_chunk_is_never_served",
      "tests/test_envlet_units.py::test_store_errors_and_corrupt_bytes_fail_the_read_and_are_not_cached"]),
    ("envlet SIGKILL while envs read", "back within 10 s (0.5-2.4 s measured); trees keep working; FUSE lowers fail "
     "clearly; no stale mount",
     ["tests/test_envlet_restart.py::test_a_sigkilled_envlet_comes_back_and_running_envs_see_trees_work_and_fuse_lowers_fail_clearly",
      "tests/test_envlet.py::test_envlet_sigkill_then_restart_clears_the_stale_mount_and_restores_layers"]),
    ("envlet SIGSTOP", "the daemon kills an envlet silent for its deadline: reads in envs fail (ECONNABORTED) "
     "instead of hanging, a new envlet serves new envs",
     ["tests/test_faults.py::test_a_sigstopped_envlet_never_hangs_reads_forever"]),
    ("daemon SIGKILL with envs running", "restart re-adopts them; exec, files work",
     ["tests/test_daemon.py::test_daemon_sigkill_then_restart_readopts_live_envs",
      "tests/test_network.py::test_daemon_sigkill_restart_readopts_with_rules_intact",
      "tests/test_processes.py::test_background_processes_survive_a_daemon_restart"]),
    ("daemon SIGKILL during create / commit / fork", "after restart: whole envs or none, whole snapshots or none; "
     "nothing half-made left once killed and collected",
     ["tests/test_faults.py::test_daemon_sigkill_during"]),
    ("node disk full: envlet cache (L2 on a 1 MiB tmpfs)", "reads still served right, only what was stored is counted",
     ["tests/test_faults.py::test_a_full_cache_disk_still_serves_reads",
      "tests/test_envlet_units.py::test_l2_on_a_full_disk_counts_only_what_it_stored"]),
    ("node disk full: store and snapshot trees (home on a filled tmpfs)", "commit fails naming the full disk, "
     "the env runs on, nothing half-written; with room the commit works",
     ["tests/test_faults.py::test_commit_on_a_full_home_fails_clearly_and_leaves_nothing",
      "tests/test_layer_trees.py::test_a_queued_copy_becomes_a_tree_and_one_without_room_is_dropped_and_retried_later"]),
    ("node full (admission) during a fork", "503 not_admitted (E2B: 429), the parent runs on, no child left",
     ["tests/test_faults.py::test_a_fork_on_a_full_node_is_a_refusal_not_a_failure"]),
    ("env upper full", "ENOSPC inside the env only",
     ["tests/test_daemon.py::test_upper_dir_is_bounded_and_a_full_disk_only_fails_inside"]),
    ("memory pressure on the node", "admission refuses then grants; OOM kills inside the env within a bounded wait",
     ["tests/test_memory_bounds.py::test_monitor_on_a_full_node_oom_kills_inside_the_env_within_the_wait",
      "tests/test_monitor.py::test_node_without_headroom_refuses_then_grants",
      "tests/test_containment.py::test_memory_bomb_on_a_full_node_is_oom_killed_after_a_bounded_wait"]),
    ("wall-clock jump", "TTLs count monotonic time: a jump of the wall clock neither expires nor keeps envs",
     ["tests/test_faults.py::test_a_wall_clock_jump_neither_expires_nor_keeps_envs"]),
]


# what the campaign found (each fixed, with its regression test): shown under the tables, and beside the
# fuzz target that found it
FOUND: list[tuple[str, str, str]] = [
    ("soak", "a fork whose children the node could not admit answered 500 start_failed (E2B: SandboxException), "
     "not 503 not_admitted (E2B: 429)", "tests/test_faults.py::test_a_fork_on_a_full_node_is_a_refusal_not_a_failure"),
    ("fault: envlet SIGSTOP", "reads and exec in envs blocked for as long as the envlet was stopped (the supervisor "
     "started a second envlet that never came up); now a silent envlet is killed after its deadline",
     "tests/test_faults.py::test_a_sigstopped_envlet_never_hangs_reads_forever"),
    ("fault: daemon SIGKILL mid-commit/fork", "the env stayed frozen (re-adopted as paused though nobody paused "
     "it), and a .commit-* temp blob stayed in the store past gc", "tests/test_faults.py::test_daemon_sigkill_during"),
    ("fault: full disk", "a commit on a full disk failed with 'ExceptionGroup: Exceptions from Trio nursery "
     "(1 sub-exception)'; now it names ENOSPC and $WEENV_HOME",
     "tests/test_faults.py::test_commit_on_a_full_home_fails_clearly_and_leaves_nothing"),
    ("fault: wall-clock jump", "TTLs counted wall time: a jump of an hour ahead killed every env with a TTL, one "
     "back kept them", "tests/test_faults.py::test_a_wall_clock_jump_neither_expires_nor_keeps_envs"),
    ("fuzz: Connect server-stream requests", "a Connect-Timeout-Ms of a latin-1 '²' (isdigit, not int) or of 400 "
     "digits (a float overflow) was a 500",
     "tests/test_fuzz_api.py::test_a_connect_timeout_that_is_not_10_ascii_digits_is_ignored_not_a_500"),
    ("CI: a neighbour's storm stopped", "the envlet slept in a read of /dev/fuse with nothing to read (a "
     "withdrawn FUSE INTERRUPT; pyfuse3 reads blocking, GIL held) until the next request: its control socket "
     "gave no answer for 120 s; now a watcher process wakes the read after 0.1 s",
     "tests/test_envlet_wake.py::test_the_envlet_answers_its_control_socket_after_every_storm_and_its_watcher_ends_with_it"),
    ("CI: a layer unregistered", "the layer's directory was still there after its last unregister answered (the "
     "kernel was told to forget it from pyfuse3's queue, after the answer); now the notice is sent first",
     "tests/test_envlet.py::test_a_layer_is_gone_from_the_mount_when_its_last_unregister_returns"),
    ("loaded full run: egress name refresh", "an env torn down while its moved names were re-pinned made the "
     "re-pin's nft fail, which ended the refresh loop and the daemon's nursery; now one lock per env, and a "
     "failed re-pin is logged",
     "tests/test_network.py::test_an_env_torn_down_while_its_names_are_re_pinned_leaves_the_refresh_loop_running"),
]


def _junit(path: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        cls = tc.get("classname", "")
        name = tc.get("name", "")
        base = name.split("[", 1)[0]
        key = cls.replace(".", "/") + ".py::" + base
        status = "passed"
        if tc.find("failure") is not None or tc.find("error") is not None:
            status = "failed"
        elif tc.find("skipped") is not None:
            status = "skipped"
        prev = out.get(key)
        t = float(tc.get("time", 0) or 0)
        if prev is None:
            out[key] = {"status": status, "time_s": t, "cases": 1}
        else:
            prev["cases"] += 1
            prev["time_s"] += t
            if status == "failed" or prev["status"] == "skipped":
                prev["status"] = status
    return out


# hypothesis targets of other files (they keep no counts: their max_examples budget is shown)
EXISTING_FUZZ: list[tuple[str, str, int]] = [
    ("plan and lock readers: binary garbage", "tests/test_plan_fuzz.py::test_binary_garbage_gives_typed_errors_naming_the_file", 300),
    ("plan and lock readers: mutated locks", "tests/test_plan_fuzz.py::test_mutated_locks_give_typed_errors_naming_the_file", 300),
    ("plan and lock readers: odd tokens", "tests/test_plan_fuzz.py::test_locks_with_odd_tokens_give_typed_errors_naming_the_file", 300),
    ("plan and lock readers: any value in any field", "tests/test_plan_fuzz.py::test_any_value_in_any_field_gives_a_located_error", 300),
    ("plan and lock readers: random documents", "tests/test_plan_fuzz.py::test_random_documents_give_typed_errors", 300),
    ("daemon API: exec bodies", "tests/test_api_bodies.py::test_fuzzed_exec_bodies_get_4xx_never_500", 250),
    ("daemon API: create bodies", "tests/test_api_bodies.py::test_fuzzed_create_bodies_get_4xx_never_500", 250),
    ("layer footer/TOC/chunks: flipped and cut bytes", "tests/test_layerfmt.py::test_fuzz_open_and_read_only_raise_typed_errors", 300),
    ("layer TOC: forged", "tests/test_layerfmt.py::test_fuzz_forged_tocs_only_raise_typed_errors", 200),
    ("layer tar paths: tar conversion of mutated tars", "tests/test_layerfmt.py::test_fuzz_tar_conversion_only_raises_typed_errors", 200),
    ("tar headers: fast path vs tarfile", "tests/test_layerfmt.py::test_fast_tar_headers_are_byte_identical_to_tarfile", 300),
]


def run_tests(fuzz_stats: str) -> dict[str, Any]:
    """The fault matrix's tests and the fuzz targets, in one pytest run; results by test."""
    tests = sorted({t.split("[")[0] for _, _, ts in FAULTS for t in ts})
    fuzz = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_fuzz_*.py"))
    fuzz += sorted({t for _, t, _ in EXISTING_FUZZ})
    junit = os.path.join(tempfile.mkdtemp(prefix="weenv-soak-junit-"), "junit.xml")
    env = {**os.environ, "WEENV_FUZZ_STATS": fuzz_stats, "WEENV_FUZZ_EXAMPLES": "1000", "WEENV_ATHERIS_S": "120"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                        *tests, *fuzz], cwd=ROOT, env=env)
    return {"exit": p.returncode, "took_s": time.monotonic() - t0,
            "tests": _junit(junit) if os.path.exists(junit) else {}}


def _fuzz_rows(path: str, tests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for target, test, budget in EXISTING_FUZZ:
        got = tests.get(test)
        rows[target] = {"target": target, "test": test, "examples": f"≤{budget} (its max_examples)",
                        "duration_s": got["time_s"] if got else 0.0,
                        "findings": "" if not got or got["status"] != "failed" else "**failed**"}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                acc = rows.setdefault(r["target"], {"target": r["target"], "test": r["test"], "examples": 0,
                                                    "duration_s": 0.0, "findings": r.get("findings", "")})
                acc["examples"] += r["examples"]
                acc["duration_s"] += r["duration_s"]
    for r in rows.values():
        got = tests.get(r["test"])
        if got and got["status"] == "failed" and not r["findings"]:
            r["findings"] = "**failed**"
    return sorted(rows.values(), key=lambda r: r["target"])


# ------------------------------------------------------------------------------- docs

def _f(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"


def render(result: dict[str, Any]) -> Path:
    soak = result["soak"]
    lines = ["# Reliability", "",
             "Generated by `make soak` (`python -m benchmarks.soak`): the soak below, then the fault matrix and the fuzz "
             "targets (pytest), then this page from benchmarks/results/reliability/. "
             f"Run {result['date']}, commit {result['commit']}; machine: {result['machine'].get('cpus')} CPUs, "
             f"{(result['machine'].get('memory_bytes') or 0) / 2**30:.0f} GiB, Linux {result['machine'].get('kernel')}.",
             "", "## Load held", "",
             f"{soak['lifecycles']} env lifecycles, {soak['concurrency']} at a time, plans {', '.join(soak['plans'])}, "
             f"through the Python client{' and the E2B SDK (every ' + str(E2B_EVERY) + 'th, against `weenv serve`)' if soak['e2b'] else ''}. "
             "Each: create → exec → files write/read → pause/resume → commit → fork (the child reads the parent's "
             "file) → kill; then every snapshot deleted and gc.", "",
             "| measure | value | bound | held |", "|---|---|---|---|"]
    held = {True: "yes", False: "**no**"}
    lines.append(f"| lifecycles failed | {len(soak['checks']['failed lifecycles'])} of {soak['lifecycles']} | 0 | "
                 f"{held[not soak['checks']['failed lifecycles']]} |")
    lines.append(f"| wall time | {_f(soak['wall_s'])} s ({_f(soak['lifecycles_per_s'])} lifecycles/s) | | |")
    lines.append(f"| lifecycle time | median {_f(soak['lifecycle_s']['median'])} s, p99 {_f(soak['lifecycle_s']['p99'])} s | | |")
    for k, v in soak["per_kind"].items():
        lines.append(f"| {k} | {v['n']} lifecycles, median {_f(v['median_s'])} s, p99 {_f(v['p99_s'])} s | | |")
    for name, left in soak["checks"].items():
        if name == "failed lifecycles":
            continue
        lines.append(f"| {name} | {len(left)}{': ' + ', '.join(map(str, left[:5])) if left else ''} | 0 | {held[not left]} |")
    sm = soak["samples"]
    b = soak["bounds"]
    lines.append(f"| daemon RSS start / warm / end | {sm['start']['rss_bytes'] / 2**20:.0f} / {sm['warm']['rss_bytes'] / 2**20:.0f} / "
                 f"{sm['end']['rss_bytes'] / 2**20:.0f} MiB (+{soak['rss_growth_bytes'] / 2**20:.1f} MiB after warm-up) | "
                 f"< {b['rss_growth_bytes'] >> 20} MiB growth | {held[soak['rss_growth_bytes'] < b['rss_growth_bytes']]} |")
    lines.append(f"| daemon fds start / warm / end | {sm['start']['fds']} / {sm['warm']['fds']} / {sm['end']['fds']} "
                 f"({soak['fd_growth']:+d} after warm-up) | < {b['fd_growth']} growth | {held[soak['fd_growth'] < b['fd_growth']]} |")
    dk = soak["disk"]
    lines.append(f"| home bytes outside the caches | {dk['home_other_bytes'] / 2**20:.1f} MiB | < {b['home_other_bytes'] >> 20} MiB | "
                 f"{held[dk['home_other_bytes'] < b['home_other_bytes']]} |")
    lines.append(f"| envlet cache / layer trees / store | {dk['envlet_cache_bytes'] / 2**20:.0f} / {dk['layer_trees_bytes'] / 2**20:.0f} / "
                 f"{dk['store_bytes'] / 2**20:.0f} MiB | their own bounds (20 GiB / 16 GiB / published groups) | |")
    lines += [""] + [f"- {n}" for n in soak.get("notes", [])] + [""]
    tests = result.get("tests", {}).get("tests", {})
    lines += ["## Faults survived", "",
              "Each fault is injected into a running system by an automated test; the table names the tests.", "",
              "| fault | promise | measured | tests |", "|---|---|---|---|"]
    for fault, promise, names in FAULTS:
        got = [tests.get(t.split("[")[0]) for t in names]
        if all(g and g["status"] == "passed" for g in got):
            measured = f"held ({sum(g['time_s'] for g in got):.1f} s of tests)"  # type: ignore[index]
        elif any(g and g["status"] == "failed" for g in got):
            measured = "**failed**"
        elif not tests:
            measured = "not run"
        else:
            measured = "skipped here"
        lines.append(f"| {fault} | {promise} | {measured} | " + "<br>".join(f"`{t}`" for t in names) + " |")
    lines += ["", "## Inputs fuzzed", "", "Hypothesis targets (and atheris where noted): only typed errors, no crash, "
              "no hang, bounded memory.", "", "| target | test | examples | duration | findings |", "|---|---|---|---|---|"]
    for r in result.get("fuzz", []):
        found = [what for where, what, _ in FOUND if where.startswith("fuzz: ") and r["target"].startswith(where[6:])]
        findings = r["findings"] or ("fixed: " + "; ".join(found) if found else "none")
        lines.append(f"| {r['target']} | `{r['test']}` | {r['examples']} | {r['duration_s']:.1f} s | {findings} |")
    lines += ["", "## Found and fixed by this campaign", "", "| found by | what | regression test |", "|---|---|---|"]
    lines += [f"| {where} | {what} | `{test}` |" for where, what, test in FOUND]
    curve = soak.get("rss_curve") or []
    if curve:
        lines += ["", "Daemon RSS under load, every 10 % of the lifecycles: "
                  + ", ".join(f"{n}: {rss >> 20} MiB" for n, rss, _ in curve) + "."]
    DOCS.write_text("\n".join(lines) + "\n")
    return DOCS


# ------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 lifecycles, 8 at a time; no fault/fuzz run, no docs")
    ap.add_argument("--lifecycles", type=int)
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--no-e2b", action="store_true", help="only the Python client")
    ap.add_argument("--no-tests", action="store_true", help="skip the fault matrix and fuzz run")
    ap.add_argument("--docs-only", action="store_true", help="render docs/reliability.md from the last full result")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    full_path = RESULTS / "soak.json"
    if args.docs_only:
        print(render(json.loads(full_path.read_text())))
        return
    n = args.lifecycles or (64 if args.quick else 1000)
    c = args.concurrency or (8 if args.quick else 32)
    soak = run_soak(n, c, args.quick, use_e2b=not args.no_e2b)
    result: dict[str, Any] = {"soak": soak, "machine": machine(), "commit": _commit(),
                              "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if not args.quick and not args.no_tests:
        stats = os.path.join(tempfile.mkdtemp(prefix="weenv-fuzz-"), "stats.jsonl")
        result["tests"] = run_tests(stats)
        result["fuzz"] = _fuzz_rows(stats, result["tests"]["tests"])
    path = RESULTS / ("soak.quick.json" if args.quick else "soak.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in soak.items() if k not in ("per_kind",)}, indent=1))
    if not args.quick:
        print(render(result))
    failed_tests = result.get("tests", {}).get("exit", 0) not in (0,)
    if not soak["ok"] or failed_tests:
        print("soak: FAILED (see checks above)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
