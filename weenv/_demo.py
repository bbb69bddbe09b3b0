"""``weenv demo``: the main job end to end on the embedded default store.

Builds and publishes three layer groups by change rate (os, harness, task), locks a plan over
them, starts an env through the daemon, runs an agent-like episode (tests fail, a fix is written,
tests pass), forks the fixed state four ways, prints timings, and cleans up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import _home

BUSYBOX_APPLETS = ("sh", "ls", "cat", "echo", "sleep", "mkdir", "rm", "cp", "mv", "true", "false", "env", "id",
                   "touch", "ps", "head", "tail", "wc", "grep", "sed", "test", "[", "expr", "printf", "hostname",
                   "uname", "find", "sort", "diff", "md5sum", "tr", "cut", "date", "basename", "dirname", "seq")
DEBIAN_MEMBERS = ("etc/os-release", "etc/debian_version", "usr/bin/dpkg")  # as weenv/testing/_images.py checks


def _busybox_os(root: Path) -> str:
    for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root", "usr/bin"):
        (root / d).mkdir(parents=True, exist_ok=True)
    busybox = shutil.which("busybox") or "/bin/busybox"
    shutil.copy2(busybox, root / "bin" / "busybox")
    for a in BUSYBOX_APPLETS:
        (root / "bin" / a).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\nagent:x:1000:\n")
    (root / "etc" / "os-release").write_text('PRETTY_NAME="busybox (weenv demo os group)"\n')
    os.chmod(root / "tmp", 0o1777)
    return "busybox"


def _os_source(work: Path) -> tuple[str, str]:
    """A cached Debian minbase tar when the fixture cache has a valid one (made by the tests or
    benchmarks), else busybox."""
    from .testing import BadEntry, cache_root, check_tar

    for tar in sorted(cache_root().glob("debian-bookworm-minbase-*.tar")):
        if "python3" in tar.name:
            continue
        try:
            check_tar(tar, DEBIAN_MEMBERS)
        except BadEntry:
            continue  # half-built or damaged: the demo runs on busybox instead
        return str(tar), "Debian bookworm minbase (cached mmdebstrap tar)"
    root = work / "os"
    _busybox_os(root)
    return str(root), "busybox (static)"


def _harness(root: Path) -> None:
    tools = root / "opt" / "harness"
    tools.mkdir(parents=True)
    (tools / "run-tests").write_text("#!/bin/sh\n# the evaluator: run the task's checks, print a verdict\n"
                                     "cd /task && sh ./test.sh && echo PASS || { echo FAIL; exit 1; }\n")
    os.chmod(tools / "run-tests", 0o755)


def _task(root: Path) -> None:
    task = root / "task"
    task.mkdir(parents=True)
    (task / "add.sh").write_text("#!/bin/sh\n# bug: subtracts instead of adding\necho $(($1 - $2))\n")
    (task / "test.sh").write_text('#!/bin/sh\n[ "$(sh ./add.sh 2 3)" = "5" ] || { echo "add 2 3 != 5"; exit 1; }\n')


def run_demo(console: Console | None = None, *, keep: bool = False) -> dict[str, float]:
    from ._client import Client
    from .plan import load_plan, lock_plan, write_plan
    from .registry import publish, resolve_group

    c = console or Console()
    timings: dict[str, float] = {}
    home = _home.home()
    c.print(f"[bold]weenv demo[/] — WEENV_HOME={home} (embedded store at {_home.store_dir()})")
    work = Path(tempfile.mkdtemp(prefix="weenv-demo-"))
    try:
        os_src, os_label = _os_source(work)
        _harness(work / "harness")
        _task(work / "task")
        table = Table("group", "class", "source", "layer", "uploaded", "seconds")
        for name, cls, src, label in (("os", "os", os_src, os_label),
                                      ("harness", "harness", str(work / "harness"), "agent tool scripts"),
                                      ("task", "task", str(work / "task"), "a repo with a failing test")):
            t0 = time.perf_counter()
            res = publish(src, f"demo/{name}:v1", group=name, group_class=cls)
            dt = time.perf_counter() - t0
            timings[f"publish {name}"] = dt
            table.add_row(name, cls, label, f"{res.size / 1e6:.2f} MB", f"{res.uploaded_bytes / 1e6:.2f} MB", f"{dt:.2f}")
        c.print(table)
        plan_path = work / "demo.toml"
        plan_path.write_text(
            'name = "demo"\nworkdir = "/task"\n\n'
            '[[groups]]\nname = "os"\nref = "demo/os:v1"\nclass = "os"\n\n'
            '[[groups]]\nname = "harness"\nref = "demo/harness:v1"\nclass = "harness"\n\n'
            '[[groups]]\nname = "task"\nref = "demo/task:v1"\nclass = "task"\n\n'
            '[resources]\npids = 256\ndisk = "256MiB"\n[resources.cpu]\nmin = 0.1\nmax = 1.0\n'
            '[resources.memory]\nmin = "64MiB"\nmax = "512MiB"\n')
        lock_path = work / "demo.lock.toml"
        write_plan(lock_plan(load_plan(str(plan_path)), resolve_group), str(lock_path))
        c.print(f"plan locked: {lock_path} (3 groups pinned to digests)")
        with Client() as client:
            t0 = time.perf_counter()
            client.ping()
            timings["daemon ready"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            env = client.create(str(lock_path))
            timings["create env"] = time.perf_counter() - t0
            c.print(f"env [bold]{env.id}[/] running ({timings['create env'] * 1000:.0f} ms; "
                    f"daemon steps {env.info.get('timings_ms')})")
            t0 = time.perf_counter()
            first = env.exec("cat /etc/os-release | head -1; uname -r")
            timings["first exec"] = time.perf_counter() - t0
            c.print(f"$ cat /etc/os-release  →  {first.text.strip()}")
            r = env.exec(["/opt/harness/run-tests"])
            c.print(f"$ run-tests  →  exit {r.exit_code}: {r.text.strip()}")
            env.write_file("/task/add.sh", "#!/bin/sh\necho $(($1 + $2))\n")
            r = env.exec(["/opt/harness/run-tests"])
            c.print(f"(the agent writes a fix)\n$ run-tests  →  exit {r.exit_code}: {r.text.strip()}")
            t0 = time.perf_counter()
            kids = env.fork(4)
            timings["fork x4"] = time.perf_counter() - t0
            outs = [k.exec(["sh", "./add.sh", str(i), "10"]).text.strip() for i, k in enumerate(kids)]
            c.print(f"forked 4 children from the fixed state in {timings['fork x4'] * 1000:.0f} ms: add.sh gives {outs}")
            t0 = time.perf_counter()
            for _ in range(20):
                env.exec(["true"])
            timings["exec round trip"] = (time.perf_counter() - t0) / 20
            snaps = {k.info.get("snapshot") for k in kids}
            if not keep:
                for k in [*kids, env]:
                    k.kill()
                for s in snaps:
                    if s:
                        client.delete_snapshot(s)
                gc = client.gc()
                c.print(f"cleaned up: envs killed, snapshots deleted, gc {gc}")
        t = Table("step", "time")
        for k, v in timings.items():
            t.add_row(k, f"{v * 1000:.1f} ms" if v < 10 else f"{v:.1f} s")
        c.print(t)
        how = ("them and the envs --keep left with [bold]weenv daemon stop --kill-envs[/]" if keep
               else "them with [bold]weenv daemon stop[/]")
        c.print(f"The daemon and the envlet keep running for the next weenv command: stop {how} "
                "([bold]weenv daemon status[/] shows what runs).")
        return timings
    finally:
        shutil.rmtree(work, ignore_errors=True)
