"""Task packaging: a thin ``task`` group per repository over a shared base, vs one full image per task.

    python -m benchmarks.package [--quick]

N small git repositories (generated Python projects, one commit each) are packaged over one base
(Debian minbase + python3 when weenv/testing/_images.py has it cached, else busybox) and published to
a real docker-registry, in the same run as the baseline. Measured:

- weenv: ``weenv package --tasks`` (4 jobs): the base group is published once, then each task
  uploads only its own layer (repository + what the setup command wrote);
- baseline: for each task, a full image tar (base rootfs + repository + the setup's output, taken
  from the task layer), compressed with zstd level 3 (weenv's layer codec) and pushed as one blob;
  The baseline builds a sample of the images (every one costs the same) and scales to N;
- a re-run of the whole batch on unchanged inputs (every task a cache hit, nothing uploaded).

Bytes are blob bytes sent to the registry; wall times include building, compressing and pushing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import zstandard

from weenv.testing import check_debian_tar, debian_tar, debian_tar_name, find, start_registry, stop_registry

from ._daemon import bench_daemon
from ._util import Report, arg_parser, median

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega value result index count items "
         "total buffer parse render update config client server request handle cache token").split()


def make_repo(path: Path, seed: int, n_files: int) -> None:
    """A small Python project: ``n_files`` modules of generated functions, one commit."""
    rnd = random.Random(seed)
    (path / "pkg").mkdir(parents=True)
    (path / "pkg" / "__init__.py").write_text(f'"""Task project {seed}."""\n')
    for i in range(n_files):
        lines = [f"# module {i} of task {seed}", ""]
        for j in range(rnd.randint(8, 20)):
            a, b = rnd.sample(WORDS, 2)
            lines += [f"def {a}_{b}_{j}(x, y={rnd.randint(0, 99)}):", f"    v_{a} = x * {rnd.randint(1, 9)} + y",
                      f"    return [v_{a} + k for k in range({rnd.randint(2, 30)})]", ""]
        (path / "pkg" / f"mod_{i}.py").write_text("\n".join(lines))
    (path / "README.md").write_text(f"# task {seed}\n\n" + " ".join(rnd.choices(WORDS, k=200)) + "\n")
    (path / "tests").mkdir()
    (path / "tests" / "test_basic.py").write_text("import pkg\n\ndef test_import():\n    assert pkg\n")
    env = {**os.environ, "GIT_AUTHOR_DATE": "2024-01-01T00:00:00", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00"}
    for args in (["init", "-q"], ["config", "user.email", "bench@weenv.invalid"], ["config", "user.name", "bench"],
                 ["add", "-A"], ["commit", "-q", "-m", "task"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, env=env, capture_output=True)


def base_image() -> tuple[str, Path, str]:
    """(label, rootfs tar, setup command) of the shared base."""
    name = debian_tar_name(include=("python3",))
    if find(name, lambda p: check_debian_tar(p, ("python3",))):  # only when built: that needs mmdebstrap, network
        return "debian-minbase+python3", debian_tar(include=("python3",)), "python3 -m compileall -q pkg"
    tmp = Path(tempfile.mkdtemp(prefix="weenv-bench-bb-"))
    from weenv.testing import busybox_tree

    root = busybox_tree(tmp / "root")
    tar = tmp / "busybox.tar"
    subprocess.run(["tar", "--numeric-owner", "-cf", str(tar), "-C", str(root), "."], check=True)
    return "busybox", tar, "mkdir -p build && md5sum pkg/*.py > build/sums"


def tar_end(tar: Path) -> int:
    """Offset where the base tar's members end (its end-of-archive blocks start)."""
    with tarfile.open(tar) as tf:
        for _ in tf:
            pass
        return tf.offset


def full_image_push(store, repo: str, base_tar: Path, base_end: int, task_layer: str, tmp: str) -> int:
    """Baseline for one task: one tar of the base rootfs followed by the task's content (the weenv task
    layer, itself a tar+zstd stream: repository + setup output), zstd -3, pushed as one blob."""
    out = os.path.join(tmp, "image.tar.zst")
    h = hashlib.sha256()

    class Hashing(io.RawIOBase):
        def __init__(self, f):  # type: ignore[no-untyped-def]
            self.f = f

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:  # type: ignore[no-untyped-def]
            h.update(b)
            return self.f.write(b)

    with open(out, "wb") as raw:
        cctx = zstandard.ZstdCompressor(level=3, threads=-1)
        with cctx.stream_writer(Hashing(raw), closefd=False) as z:
            with open(base_tar, "rb") as f:
                left = base_end
                while left:
                    chunk = f.read(min(left, 4 << 20))
                    left -= len(chunk)
                    z.write(chunk)
            with open(task_layer, "rb") as f:  # its end-of-archive blocks end the image tar
                reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
                shutil.copyfileobj(reader, z, 4 << 20)
    size = os.path.getsize(out)
    sent = store.put_blob(repo, "sha256:" + h.hexdigest(), out, size)
    os.unlink(out)
    return sent


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    n_tasks = 6 if args.quick else 100
    # Full images cost the same for every task (the whole base is re-compressed and re-pushed), so
    # the baseline builds and pushes a sample of them and scales the total linearly.
    sample = 2 if args.quick else 20
    jobs = 4
    report = Report("package", f"Task packaging: {n_tasks} tasks, group per task vs image per task", args.quick)
    label, base_tar, setup = base_image()
    report.notes.append(f"base: {label} ({base_tar.stat().st_size / 1e6:.0f} MB tar); setup command: {setup!r}")
    work = tempfile.mkdtemp(prefix="weenv-bench-package-")
    reg = start_registry(os.path.join(work, "registry"))
    old_home = os.environ.get("WEENV_HOME")
    try:
        with bench_daemon("package", replace={'disk = "64MiB"': 'disk = "1GiB"', 'max = "512MiB"': 'max = "2GiB"'}) as d:
            os.environ["WEENV_HOME"] = d.home
            from weenv.build import package_tasks
            from weenv.plan import load_plan, lock_plan, write_plan
            from weenv.registry import LayoutStore, RemoteStore, publish, resolve_group

            repos = Path(work) / "repos"
            for i in range(n_tasks):
                make_repo(repos / f"task{i:03d}", i, n_files=12)
            tasks = Path(work) / "tasks.jsonl"
            tasks.write_text("".join(json.dumps({"id": f"task{i:03d}", "repo": f"repos/task{i:03d}",
                                                 "setup": [setup]}) + "\n" for i in range(n_tasks)))

            # ---- weenv: publish the base once, then package every task
            t0 = time.perf_counter()
            base_pub = publish(str(base_tar), f"{reg.host}/bench/os:base", group="os", group_class="os")
            base_s = time.perf_counter() - t0
            plan = Path(work) / "base.toml"
            plan.write_text(f'name = "base"\n[[groups]]\nname = "os"\nref = "{reg.host}/bench/os:base"\nclass = "os"\n'
                            '[resources]\ndisk = "1GiB"\n[resources.memory]\nmax = "2GiB"\n')
            lock = Path(work) / "base.lock.toml"
            write_plan(lock_plan(load_plan(str(plan)), resolve_group), str(lock))
            t0 = time.perf_counter()
            res = package_tasks(str(tasks), base=str(lock), ref_template=f"{reg.host}/bench/tasks:{{id}}", jobs=jobs)
            batch_s = time.perf_counter() - t0
            if res.failed:
                raise SystemExit(f"{res.failed} tasks failed:\n{Path(res.results).read_text()[-3000:]}")
            records = [json.loads(x) for x in Path(res.results).read_text().splitlines()]
            per_task = [r["uploaded_bytes"] for r in records]
            weenv_bytes = base_pub.uploaded_bytes + res.uploaded_bytes
            weenv_s = base_s + batch_s

            # ---- rerun: unchanged inputs, every task a cache hit
            (Path(res.results)).unlink()
            t0 = time.perf_counter()
            again = package_tasks(str(tasks), base=str(lock), ref_template=f"{reg.host}/bench/tasks:{{id}}", jobs=jobs)
            rerun_s = time.perf_counter() - t0

            # ---- baseline: one full image per task, pushed as one blob
            base_end = tar_end(base_tar)
            local = LayoutStore(os.path.join(d.home, "store"))
            layers = {r["id"]: local.blob_path(resolve_group(r["ref"]).layer_digest) for r in records}
            store = RemoteStore(reg.host, insecure=True)
            full_bytes = []
            t0 = time.perf_counter()
            try:
                for i in range(sample):
                    full_bytes.append(full_image_push(store, f"full/task{i:03d}", base_tar, base_end,
                                                      layers[f"task{i:03d}"], work))
            finally:
                store.close()
            full_sample_s = time.perf_counter() - t0
            full_s = full_sample_s * n_tasks / sample
            full_total = sum(full_bytes) * n_tasks / sample

        report.add(f"bytes uploaded, {n_tasks} tasks (base once + task groups)", weenv_bytes / 1e6, "MB",
                   baseline=full_total / 1e6, baseline_label="full image per task",
                   note=f"base group {base_pub.uploaded_bytes / 1e6:.1f} MB once; task groups "
                        f"{res.uploaded_bytes / 1e6:.2f} MB in all")
        report.add("bytes uploaded per task (median)", median(per_task) / 1e3, "kB",
                   baseline=median(full_bytes) / 1e3, baseline_label="full image per task")
        report.add(f"wall time, {n_tasks} tasks ({jobs} jobs; base publish included)", weenv_s, "s",
                   baseline=full_s, baseline_label="build + push full images (sequential)",
                   note=f"base publish {base_s:.1f} s, batch {batch_s:.1f} s "
                        f"({batch_s / n_tasks:.2f} s per task)")
        report.add("re-package unchanged batch (all cache hits)", rerun_s, "s", baseline=batch_s,
                   baseline_label="first packaging", note=f"uploaded {again.uploaded_bytes} bytes")
        report.notes.append(f"baseline measured on {sample} of the {n_tasks} tasks ({full_sample_s:.1f} s, "
                            f"{sum(full_bytes) / 1e6:.0f} MB) and scaled linearly")
        report.notes.append("baseline images hold exactly the base plus each task's content (the task layer "
                            "re-compressed into one tar), and its time does not include running the setup command; "
                            "each image is one blob, so tasks share nothing (a layered image would share an "
                            "unchanged base layer)")
    finally:
        if old_home is None:
            os.environ.pop("WEENV_HOME", None)
        else:
            os.environ["WEENV_HOME"] = old_home
        stop_registry(reg)
        shutil.rmtree(work, ignore_errors=True)
        if label == "busybox":
            shutil.rmtree(base_tar.parent, ignore_errors=True)
    report.print()
    print("results:", report.save())


if __name__ == "__main__":
    main()
