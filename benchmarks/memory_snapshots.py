"""Memory snapshots of a gVisor env holding ~100 MiB: park, resume, commit and fork ×3 with memory,
vs a cold start that rebuilds the same state, and vs bare runsc checkpoint/restore (the floor).

    python -m benchmarks.memory_snapshots [--quick] [--mib N]

The env's state: a busybox ``sh`` counting in its memory, and N MiB (default 100) held in the
Sentry's memory: up to 56 MiB of random bytes in /dev/shm (incompressible), the rest in a
process's heap (compressible). Measured
through the daemon, from the client's call to its answer; "answering" adds an exec that reads
the counter out of the restored process (out of a fork's copies at once). The floor is the same state in a sandbox the gVisor
runtime runs in this process (no daemon, no cgroup): ``runsc checkpoint`` and ``runsc restore``.

Goals (issue 31): memory snapshot ≤400 ms, resume ≤300 ms, fork with memory ≤1 s to all
answering; a parked env holds ≤10 % of its memory; 4 memory commits 1 s apart store ≤1.5x one
image (their chunks deduplicated in the store).
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import shutil
import tempfile
import time
from pathlib import Path

import trio

from ._daemon import bench_daemon
from ._util import Report, arg_parser, median

# Counts without starting a process: runsc (20221219) checkpoints and restores slower the more
# processes an env has run (an env whose counter ran `sleep 0.05` 400 times parked in 1.15 s, one
# that slept once in 0.14 s), so a counter that forks would measure its own age, not 100 MiB.
COUNTER = ('mkfifo /tmp/tick; exec 3<>/tmp/tick; i=0; trap "echo \\$i > /tmp/v" USR1; '
           'while :; do i=$((i+1)); read -t 0.05 _ <&3; done')


def fill(mib: int) -> list[str]:
    """Up to 56 MiB of random bytes in /dev/shm (its size is 64 MiB), the rest in the heap of an
    ``awk`` waiting on a FIFO (a string of spaces: compressible); then the counter (its pid is the
    output). Every background process has its own stdio: one still holding the exec's (a host
    file under gVisor) cannot be restored (docs/snapshots.md, "Memory")."""
    shm, rest = min(mib, 56), max(0, mib - 56)
    held = (f"mkfifo /tmp/hold; awk 'BEGIN{{s=sprintf(\"%{rest << 20}s\",\"x\"); getline l < \"/tmp/hold\"}}' "
            "</dev/null >/dev/null 2>&1 &\n" if rest else "")
    return ["sh", "-c", f"dd if=/dev/urandom of=/dev/shm/blob bs=1M count={shm} 2>/dev/null || exit 1\n{held}"
                        f"sh -c '{COUNTER}' </dev/null >/dev/null 2>&1 &\necho $!"]


def answer(env, pid: int) -> int:
    r = env.exec(["sh", "-c", f"rm -f /tmp/v; kill -USR1 {pid}; for _ in $(seq 200); do [ -s /tmp/v ] && "
                              "exec cat /tmp/v; sleep 0.01; done; exit 8"])
    assert r.exit_code == 0, r
    return int(r.stdout)


def answer_all(envs, pid: int) -> None:  # type: ignore[no-untyped-def]
    """Every env's counter read at once (a fork's copies are driven side by side): asked one after
    another, four answers took ~0.55 s of a fork ×4 here, the exec and the counter's 50 ms tick
    four times over."""
    with concurrent.futures.ThreadPoolExecutor(len(envs)) as pool:
        for value in pool.map(lambda e: answer(e, pid), envs):
            assert value >= 0


def cgroup_memory(env_id: str) -> int:
    for pattern in (f"/sys/fs/cgroup/**/{env_id}/memory.current", f"/sys/fs/cgroup/memory/**/{env_id}/memory.usage_in_bytes"):
        for path in glob.glob(pattern, recursive=True):
            with open(path) as f:
                return int(f.read())
    return 0


def floor(mib: int, repeat: int, fork_n: int = 4) -> tuple[list[float], list[float], int, list[float], list[float]]:
    """Bare runsc checkpoint and restore of the same state, through the gVisor runtime alone; and
    ``fork_n`` restores of one image at once, each with its own id, bundle and rootfs copy (what a
    fork's children cost at least), alone and after the checkpoint they restore from (what a fork
    costs at least: the source's own restore is left out)."""
    from weenv.provision.runtime._gvisor import GvisorRuntime
    from weenv.provision.runtime._runtime import prepare_bundle
    from weenv.testing._images import busybox_tree

    work = tempfile.mkdtemp(prefix="weenv-bench-memfloor-")
    checkpoints, restores, size, parallel, forks = [], [], 0, [], []

    async def main() -> None:
        nonlocal size
        rt = GvisorRuntime(os.path.join(work, "run"))
        rootfs = str(busybox_tree(Path(work) / "rootfs"))
        bundle, env_id = os.path.join(work, "bundle"), f"memfloor-{os.getpid()}"
        os.mkdir(bundle)
        spec = prepare_bundle(bundle, env_id=env_id, rootfs=rootfs, host=rt.host)
        await rt.create(env_id, bundle, rootfs, spec)
        await rt.start(env_id)
        try:
            r = await rt.exec(env_id, fill(mib), timeout_s=120)
            assert r.exit_code == 0, r
            for i in range(repeat):
                image = os.path.join(work, f"image-{i}")
                os.mkdir(image)
                t0 = time.perf_counter()
                await rt.checkpoint(env_id, image)
                checkpoints.append(time.perf_counter() - t0)
                size = os.path.getsize(os.path.join(image, "checkpoint.img"))
                t0 = time.perf_counter()
                await rt.restore(env_id, bundle, rootfs, spec, image)
                restores.append(time.perf_counter() - t0)
                shutil.rmtree(image)
            copies = []
            for i in range(fork_n):
                cid, cbundle = f"{env_id}-c{i}", os.path.join(work, f"bundle-c{i}")
                crootfs = shutil.copytree(rootfs, os.path.join(work, f"rootfs-c{i}"), symlinks=True)
                os.mkdir(cbundle)
                copies.append((cid, cbundle, crootfs, prepare_bundle(cbundle, env_id=cid, rootfs=crootfs, host=rt.host)))
            for _ in range(max(1, repeat - 2)):
                image = os.path.join(work, "image-par")
                os.mkdir(image)
                t_ckpt = time.perf_counter()
                await rt.checkpoint(env_id, image)
                t0 = time.perf_counter()
                async with trio.open_nursery() as n:
                    for cid, cbundle, crootfs, cspec in copies:
                        n.start_soon(rt.restore, cid, cbundle, crootfs, cspec, image)
                parallel.append(time.perf_counter() - t0)
                forks.append(time.perf_counter() - t_ckpt)
                for cid, *_ in copies:
                    await rt.delete(cid)
                    await rt.wait_deleted(cid)
                await rt.restore(env_id, bundle, rootfs, spec, image)
                shutil.rmtree(image)
        finally:
            await rt.delete(env_id)
            await rt.wait_deleted(env_id)

    try:
        trio.run(main)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return checkpoints, restores, size, parallel, forks


def main() -> None:
    ap = arg_parser(__doc__ or "")
    ap.add_argument("--mib", type=int, default=None, help="MiB of state in the env (default 100; 16 with --quick)")
    args = ap.parse_args()
    mib = args.mib or (16 if args.quick else 100)
    repeat = 2 if args.quick else 5
    report = Report("memory_snapshots", f"Memory snapshots (gVisor, {mib} MiB in use)", args.quick)
    f_ckpt, f_rest, image_bytes, f_par, f_fork = floor(mib, repeat)
    parks, resumes, answered, commits, forks, forks4, cold, held, from_store = [], [], [], [], [], [], [], [], []
    aged: dict[str, float] = {}
    with bench_daemon("memsnap") as d, d.client() as c:
        lock = os.path.join(d.home, "gvisor.lock.toml")
        with open(d.plan_lock) as f, open(lock, "w") as out:
            out.write('runtime = "gvisor"\n' + f.read())
        with c.create(lock) as warm:  # layers cached, the platform probed
            warm.exec(["true"])
        for _ in range(repeat):  # the baseline: a cold start that rebuilds the state
            t0 = time.perf_counter()
            with c.create(lock) as env:
                pid = int(env.exec(fill(mib), timeout_s=120).stdout)
                answer(env, pid)
                cold.append(time.perf_counter() - t0)
        with c.create(lock) as env:
            pid = int(env.exec(fill(mib), timeout_s=120).stdout)
            for _ in range(repeat):
                before = cgroup_memory(env.id)
                t0 = time.perf_counter()
                env.pause(memory="park")
                parks.append(time.perf_counter() - t0)
                held.append((before, cgroup_memory(env.id)))
                time.sleep(0.5)
                t0 = time.perf_counter()
                env.resume()
                resumes.append(time.perf_counter() - t0)
                answer(env, pid)
                answered.append(time.perf_counter() - t0)
            snaps = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                snaps.append(env.commit(memory=True))
                commits.append(time.perf_counter() - t0)
                time.sleep(1)  # the "4 snapshots of the same env, 1 s apart"
            stored = c.snapshot(snaps[-1]).memory or {}
            mems = [c.snapshot(s).memory or {} for s in snaps[:4]]  # the 4 snapshots 1 s apart
            for _ in range(repeat):  # an env from a memory snapshot: its image written out of the chunks
                t0 = time.perf_counter()
                with c.create(snaps[-1]) as other:
                    answer(other, pid)
                    from_store.append(time.perf_counter() - t0)
            for _ in range(max(1, repeat - 2)):
                t0 = time.perf_counter()
                kids = env.fork(3, memory=True)
                answer_all(kids, pid)
                forks.append(time.perf_counter() - t0)
                snaps.append(kids[0].info["snapshot"])
                for k in kids:
                    k.kill()
            for _ in range(max(1, repeat - 2)):  # the fork ×4
                t0 = time.perf_counter()
                kids = env.fork(4, memory=True)
                answer_all(kids, pid)
                forks4.append(time.perf_counter() - t0)
                snaps.append(kids[0].info["snapshot"])
                for k in kids:
                    k.kill()
            for s in set(snaps):
                c.delete_snapshot(s)
        with c.create(lock) as env:  # runsc's cost of an env's past: park before and after 400 short processes
            pid = int(env.exec(fill(mib), timeout_s=120).stdout)
            for label in ("young", "aged"):
                if label == "aged":
                    env.exec(["sh", "-c", "i=0; while [ $i -lt 400 ]; do /bin/true; i=$((i+1)); done"], timeout_s=120)
                t0 = time.perf_counter()
                env.pause(memory="park")
                aged[label] = time.perf_counter() - t0
                env.resume()
                answer(env, pid)
    cold_ms = median(cold) * 1000
    report.add("park (checkpoint to disk, memory freed)", median(parks) * 1000, "ms", baseline=median(f_ckpt) * 1000,
               baseline_label="bare runsc checkpoint", goal="≤400 ms", ok=median(parks) <= 0.4)
    report.add("resume (restore of a parked env)", median(resumes) * 1000, "ms", baseline=median(f_rest) * 1000,
               baseline_label="bare runsc restore", goal="≤300 ms", ok=median(resumes) <= 0.3)
    report.add("resume to the process answering", median(answered) * 1000, "ms", baseline=cold_ms,
               baseline_label="cold start + rebuilding the state")
    report.add("commit with memory (checkpoint, restore, image sealed in the store)", median(commits) * 1000, "ms",
               baseline=cold_ms, baseline_label="cold start + rebuilding the state")
    report.add("fork ×3 with memory, to all three answering", median(forks) * 1000, "ms", baseline=cold_ms * 3,
               baseline_label="3 cold starts + rebuilding the state, one after another", goal="≤1 s (×4 in the issue)",
               ok=median(forks) <= 1.0)
    report.add("fork ×4 with memory, to all four answering", median(forks4) * 1000, "ms",
               baseline=median(f_fork) * 1000,
               baseline_label="bare runsc checkpoint, then 4 restores of its image at once (no answers)",
               goal="≤1 s", ok=median(forks4) <= 1.0)
    report.add("floor: 4 bare runsc restores of one image at once", median(f_par) * 1000, "ms")
    report.add("park of an env that has run 400 more short processes", aged["aged"] * 1000, "ms",
               baseline=aged["young"] * 1000, baseline_label="park of the same env before them",
               note="runsc 20221219 checkpoints slower the more processes an env has run (not a weenv goal)")
    before = median([b for b, _ in held]) / 2**20
    after = median([a for _, a in held]) / 2**20
    report.add("env cgroup memory while parked", after, "MiB", baseline=before, baseline_label="before the park",
               goal="≤10 % of before", ok=after <= before * 0.1)
    stored_bytes = sum(m["size"] for m in mems)
    one_image = median([m["image_bytes"] for m in mems])
    report.add(f"store bytes of {len(mems)} memory commits 1 s apart (deduplicated chunks)", stored_bytes / 2**20,
               "MiB", baseline=one_image / 2**20, baseline_label="one checkpoint image as runsc wrote it",
               goal="≤1.5x one image", ok=stored_bytes <= 1.5 * one_image,
               note="packs " + ", ".join(f"{m['size'] / 2**20:.1f}" for m in mems) + " MiB")
    report.add("env from a memory snapshot to the process answering (image written out of its chunks)",
               median(from_store) * 1000, "ms", baseline=median(answered) * 1000,
               baseline_label="resume of a parked env to the process answering")
    report.notes.append(f"checkpoint image of the floor sandbox: {image_bytes / 2**20:.1f} MiB; the last memory "
                        f"commit's own pack {stored.get('size', 0) / 2**20:.1f} MiB (of a "
                        f"{stored.get('image_bytes', 0) / 2**20:.1f} MiB image, the rest in "
                        f"{len(stored.get('packs', []))} earlier packs); facts {stored.get('facts')}")
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
