"""Container runtime start and exec latency against a bare ``crun run`` of the same rootfs.

    python -m benchmarks.start_crun [--quick] [--n N] [--alternative]

Measured in one run on a busybox rootfs (already on disk, no overlay, no envlet):

- baseline: ``crun run`` of a stock ``crun spec`` (echo, no terminal), spawned the way any
  caller on this host must (in a private mount namespace when the host is hybrid), to exit
  (:class:`BareCrun`; benchmarks/start.py runs it in weenv's user namespace mapping too);
- weenv: ``create`` + ``start`` + first ``exec`` (echo) through :class:`CrunRuntime` with the full
  spec (seccomp, masked paths, /etc files, nodev root, cgroups) until the output is back;
- exec round trip of ``echo`` in a running env.

With ``--alternative`` on a hybrid host with controllers in cgroup2 it also measures the
alternative to the per-create private mount namespace (those controllers bound to cgroup v1
once), restoring the host after.
The env-level goal (whole warm start <= 50 ms p50, <= 2.5x bare crun) is benchmarks/start.py's;
this one shows what the runtime layer spends of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import trio

from weenv.provision.runtime._hostcheck import bind_unified_controllers_to_v1, detect_host, private_mount_ns_recipe
from weenv.provision.runtime._hostcheck import unbind_v1_controllers
from weenv.provision.runtime._ns import in_fresh_thread
from weenv.provision.runtime._runtime import CrunRuntime, prepare_bundle
from weenv.provision.cgroups import detect_backend

from ._util import Report, arg_parser, median, percentile

BUSYBOX = next((p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.exists(p)), None)


def make_rootfs(root: str) -> None:
    for d in ("bin", "etc", "proc", "sys", "dev", "tmp", "root"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    shutil.copy2(BUSYBOX, os.path.join(root, "bin/busybox"))
    for applet in subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split():
        if applet != "busybox":
            os.symlink("busybox", os.path.join(root, "bin", applet))
    with open(os.path.join(root, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\n")
    with open(os.path.join(root, "etc/group"), "w") as f:
        f.write("root:x:0:\n")
    os.chmod(os.path.join(root, "tmp"), 0o1777)


class BareCrun:
    """``crun run`` (create, start, wait, delete) of ``echo hi`` in a stock ``crun spec`` config on a
    read-only copy of ``rootfs``, spawned the way any caller on this host must (from a thread in a
    private mount namespace when the host is hybrid; no fork of this process). ``idmap``: in a user
    namespace mapping ids 0..65535 onto that host range (as weenv's envs run by default), the copy
    owned by the range and the root named relative to the bundle; crun is then ``crun``'s stock
    binary (which copies itself on every start, unlike weenv's sealed copy: ``crun`` names another).

    stdin is an empty pipe, never /dev/null: crun 1.8 fchowns its std streams to the user
    namespace's root (crun #1845), which would hand the host's /dev/null to the range."""

    def __init__(self, work: str, rootfs: str, host, *, idmap=None, crun: str = "crun"):  # type: ignore[no-untyped-def]
        self.bundle = os.path.join(work, "bare")
        os.makedirs(self.bundle)
        subprocess.run(["crun", "spec"], cwd=self.bundle, check=True)
        with open(os.path.join(self.bundle, "config.json")) as f:
            spec = json.load(f)
        spec["process"]["terminal"] = False
        spec["process"]["args"] = ["echo", "hi"]
        spec["linux"].pop("resources", None)
        root = rootfs
        if idmap is not None:
            root = os.path.join(self.bundle, "rootfs")
            shutil.copytree(rootfs, root, symlinks=True)
            for dirpath, dirnames, filenames in os.walk(root):
                for name in [".", *dirnames, *filenames]:
                    path = os.path.join(dirpath, name)
                    st = os.lstat(path)
                    os.lchown(path, idmap.host(st.st_uid), idmap.host(st.st_gid))
            os.chown(self.bundle, 0, idmap.base)
            os.chmod(self.bundle, 0o710)  # the range's root walks into the bundle only
            spec["linux"]["namespaces"].append({"type": "user"})
            mapping = [{"containerID": 0, "hostID": idmap.base, "size": idmap.count}]
            spec["linux"]["uidMappings"] = mapping
            spec["linux"]["gidMappings"] = [dict(m) for m in mapping]
            root = "rootfs"
        spec["root"] = {"path": root, "readonly": True}
        with open(os.path.join(self.bundle, "config.json"), "w") as f:
            json.dump(spec, f)
        self.state = os.path.join(work, "bare-state")
        self.crun = crun
        self.pre = private_mount_ns_recipe(host.unified_mount) if host.crun_needs_private_mount_ns else None
        self.runs = 0

    def run_once(self) -> float:
        """Seconds from spawning ``crun run`` to its exit, its output checked."""
        self.runs += 1
        name = f"bare{self.runs}"

        def spawn() -> tuple[float, subprocess.CompletedProcess]:
            if self.pre is not None:
                self.pre()
            r, w = os.pipe2(os.O_CLOEXEC)
            os.close(w)
            try:
                t0 = time.perf_counter()
                done = subprocess.run(
                    [self.crun, "--root", self.state, "--cgroup-manager=disabled", "run", "--bundle", self.bundle, name],
                    stdin=r, capture_output=True, cwd=self.bundle,
                )  # fmt: skip
                return time.perf_counter() - t0, done
            finally:
                os.close(r)

        took, done = in_fresh_thread(spawn)  # type: ignore[misc]
        if done.stdout != b"hi\n":
            raise SystemExit(f"bare crun run failed: {done.returncode} {done.stderr!r}")
        return took


def bare_crun_run(work: str, rootfs: str, n: int, host, *, idmap=None) -> list[float]:  # type: ignore[no-untyped-def]
    """``n`` runs of :class:`BareCrun`, in seconds."""
    bare = BareCrun(work, rootfs, host, idmap=idmap)
    return [bare.run_once() for _ in range(n)]


async def weenv_runs(work: str, rootfs: str, n: int, host, tag: str) -> dict[str, list[float]]:
    runtime = CrunRuntime(os.path.join(work, f"run-{tag}"), host=host)
    backend = detect_backend(f"weenv-bench-{os.getpid()}-{tag}")
    times: dict[str, list[float]] = {"create": [], "start": [], "first_exec": [], "total": [], "exec": [], "delete": []}
    try:
        for i in range(n):
            env_id = f"{tag}{i}"
            bundle = os.path.join(work, f"bundle-{env_id}")
            os.makedirs(bundle)
            group = backend.create(env_id)
            procs = group.procs_paths()
            spec = prepare_bundle(bundle, env_id=env_id, rootfs=rootfs, host=host)
            t0 = time.perf_counter()
            await runtime.create(env_id, bundle, rootfs, spec, procs)
            t1 = time.perf_counter()
            await runtime.start(env_id)
            t2 = time.perf_counter()
            r = await runtime.exec(env_id, ["echo", "hi"], cgroup_procs=procs)
            t3 = time.perf_counter()
            if r.stdout != b"hi\n":
                raise SystemExit(f"exec failed: {r}")
            times["create"].append(t1 - t0)
            times["start"].append(t2 - t1)
            times["first_exec"].append(t3 - t2)
            times["total"].append(t3 - t0)
            if i < max(3, n // 4):  # exec round trips on a few running envs
                for _ in range(8):
                    e0 = time.perf_counter()
                    await runtime.exec(env_id, ["echo", "hi"], cgroup_procs=procs)
                    times["exec"].append(time.perf_counter() - e0)
            d0 = time.perf_counter()
            await runtime.delete(env_id)
            times["delete"].append(time.perf_counter() - d0)
            group.kill_all()
            group.remove(timeout_s=5.0)
            shutil.rmtree(bundle)
    finally:
        for st in await runtime.list():
            await runtime.delete(st.id)
        for name in backend.list():
            g = backend.open(name)
            g.kill_all()
            g.remove(timeout_s=5.0)
        backend.remove_parent()
    return times


def main() -> None:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=None, help="envs per measurement (default 100, quick 10)")
    p.add_argument("--alternative", action="store_true", help="also measure the cgroup-v1 binding alternative")
    args = p.parse_args()
    n = args.n or (10 if args.quick else 100)
    if os.geteuid() != 0 or BUSYBOX is None or shutil.which("crun") is None:
        sys.exit("needs root, crun and busybox-static")
    host = detect_host()
    host.require_init()
    report = Report("start_crun", "Runtime layer: crun start and exec", args.quick)
    report.notes.append(f"host cgroups: {host.cgroup_mode}, cgroup2 controllers {list(host.unified_controllers)}; "
                        f"private mount ns per create: {host.crun_needs_private_mount_ns}")  # fmt: skip
    work = tempfile.mkdtemp(prefix="weenv-bench-crun-")
    try:
        rootfs = os.path.join(work, "rootfs")
        make_rootfs(rootfs)
        bare = bare_crun_run(work, rootfs, n, host)
        times = trio.run(weenv_runs, work, rootfs, n, host, "w")
        b50, b99 = median(bare) * 1e3, percentile(bare, 99) * 1e3
        report.add("bare crun run (echo)", b50, "ms", p99=b99)
        t50 = median(times["total"]) * 1e3
        report.add("create+start+first exec", t50, "ms", p99=percentile(times["total"], 99) * 1e3,
                   baseline=b50, baseline_label="bare crun run", note="ratio = bare/weenv")  # fmt: skip
        for k in ("create", "start", "first_exec", "delete"):
            report.add(f"  {k}", median(times[k]) * 1e3, "ms", p99=percentile(times[k], 99) * 1e3)
        report.add("exec round trip (echo)", median(times["exec"]) * 1e3, "ms", p99=percentile(times["exec"], 99) * 1e3,
                   baseline=b50, baseline_label="bare crun run")  # fmt: skip
        print(f"weenv create+start+first exec / bare crun run = {t50 / b50:.2f}x (p50)")
        print(f"exec round trip / bare crun run = {median(times['exec']) * 1e3 / b50:.2f}x (p50)")
        if host.crun_needs_private_mount_ns and args.alternative:
            made = bind_unified_controllers_to_v1(host, os.path.join(work, "cgroup-v1"))
            try:
                alt_host = detect_host()
                alt = trio.run(weenv_runs, work, rootfs, n, alt_host, "a")
            finally:
                unbind_v1_controllers(made)
            a50 = median(alt["total"]) * 1e3
            report.add("alt: create+start+first exec, cgroup2 controllers bound to v1", a50, "ms",
                       p99=percentile(alt["total"], 99) * 1e3, baseline=t50, baseline_label="weenv with recipe")  # fmt: skip
            report.add("alt:   create", median(alt["create"]) * 1e3, "ms", p99=percentile(alt["create"], 99) * 1e3,
                       baseline=median(times["create"]) * 1e3, baseline_label="create with recipe")  # fmt: skip
            print(f"alternative (no per-create mount namespace) / recipe = {a50 / t50:.2f}x (p50)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.print()
    print("saved", report.save())


if __name__ == "__main__":
    main()
