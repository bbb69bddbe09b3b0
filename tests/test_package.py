"""``weenv package`` on the real daemon and a real docker-registry: single tasks, batches, checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weenv import layerfmt

from .fixtures_daemon import leftovers

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------------------------ helpers


class GitRepo:
    """A small git repository made in the test."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True)
        self.git("init", "-q", "-b", "main")
        self.git("config", "user.email", "test@weenv.invalid")
        self.git("config", "user.name", "weenv test")

    def git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    def write(self, rel: str, text: str, mode: int = 0o644) -> None:
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        os.chmod(p, mode)

    def commit(self, message: str, *force_add: str) -> str:
        self.git("add", "-A")
        for rel in force_add:
            self.git("add", "-f", rel)
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD")


def two_commit_repo(path: Path) -> tuple[GitRepo, str, str]:
    repo = GitRepo(path)
    repo.write("a.txt", "version one\n")
    repo.write("bin/tool.sh", "#!/bin/sh\necho tool says $1\n", 0o755)
    repo.write(".gitignore", "*.log\nbuild/\n")
    repo.write("debug.log", "tracked although ignored\n")
    repo.write("build/out.txt", "tracked although ignored\n")
    (path / "link").symlink_to("a.txt")
    c1 = repo.commit("one", "debug.log", "build/out.txt")
    repo.write("a.txt", "version two\n")
    repo.write("b.txt", "added in two\n")
    c2 = repo.commit("two")
    return repo, c1, c2


@pytest.fixture
def home(daemon, monkeypatch):
    """In-process package() calls share the daemon's $WEENV_HOME (store, caches)."""
    monkeypatch.setenv("WEENV_HOME", daemon.home)
    return daemon.home


def cli(daemon, *args: str, check: bool = True, cwd: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "weenv", *args], env=daemon.env_vars(), capture_output=True, text=True,
                       timeout=240, cwd=cwd)
    if check and p.returncode != 0:
        raise AssertionError(f"weenv {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def remote_base(daemon, host: str, tmp_path: Path) -> str:
    """The busybox os group published to ``host`` and a base lock that points there."""
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import publish, resolve_group

    publish(os.path.join(daemon.home, "src-busybox"), f"{host}/base/os:test", group="os", group_class="os")
    plan = tmp_path / "base.toml"
    plan.write_text(f'name = "base"\n\n[[groups]]\nname = "os"\nref = "{host}/base/os:test"\nclass = "os"\n\n'
                    '[resources]\npids = 256\ndisk = "64MiB"\n')
    lock = tmp_path / "base.lock.toml"
    write_plan(lock_plan(load_plan(str(plan)), resolve_group), str(lock))
    return str(lock)


def layer_paths(ref: str) -> dict[str, layerfmt.Entry]:
    from weenv.registry import open_layer_ref

    with open_layer_ref(ref) as reader:
        return {e.path: e for e in layerfmt.Layer.open(reader).entries}


# ------------------------------------------------------------------------------------ single


def test_package_at_a_commit_with_setup_uploads_only_the_task(daemon, home, registry, recording_proxy, tmp_path):
    repo, c1, c2 = two_commit_repo(tmp_path / "repo")
    base = remote_base(daemon, recording_proxy.host, tmp_path)
    from weenv.plan import load_lock

    base_lock = load_lock(base)
    base_blobs = {g.layer_digest for g in base_lock.groups}
    recording_proxy.log.clear()
    ref = f"{recording_proxy.host}/tasks:one"
    setup = "mkdir -p /opt/dep && ./bin/tool.sh installed > /opt/dep/marker && pwd > where && echo $GREETING > hi"
    out = json.loads(cli(daemon, "package", str(repo.path), "--base", base, "--ref", ref, "--commit", c1,
                         "--setup", setup, "--env", "GREETING=hello", "--lock-out", str(tmp_path / "one.lock.toml"),
                         "--json").stdout)
    assert {"ref", "digest", "lock", "uploaded_bytes"} <= out.keys()
    assert out["ref"] == ref and out["commit"] == c1 and out["lock"] == str(tmp_path / "one.lock.toml")
    assert not out["cached"] and [s["cached"] for s in out["steps"]] == [False]
    # only the task layer went up: its bytes, into the tasks repo; the base blob never
    assert out["uploaded_bytes"] == out["layer_size"] > 0
    writes = [(m, p) for m, p, _ in recording_proxy.log.entries if m in ("PUT", "PATCH", "POST")]
    assert writes and all(p.startswith("/v2/tasks/") for _, p in writes), writes
    assert not any(d in p for _, p in writes for d in base_blobs)
    assert out["warnings"] == []

    lock = load_lock(out["lock"])
    assert [g.name for g in lock.groups] == ["os", "task"] and lock.workdir == "/repo"
    assert lock.groups[0] == base_lock.groups[0] and lock.groups[1].digest == out["digest"]
    assert lock.groups[1].registry == recording_proxy.host and lock.env["GREETING"] == "hello"
    with daemon.client() as c, c.create(out["lock"]) as env:
        r = env.exec(["sh", "-c", "pwd; cat a.txt; ls b.txt 2>&1; cat /opt/dep/marker where hi; readlink link; "
                                  "./bin/tool.sh ok; ls .git 2>&1 | head -1; cat debug.log build/out.txt"])
        assert r.stdout.decode().splitlines() == [
            "/repo", "version one", "ls: b.txt: No such file or directory", "tool says installed", "/repo", "hello",
            "a.txt", "tool says ok", "ls: .git: No such file or directory",
            "tracked although ignored", "tracked although ignored"]
        st = env.exec(["stat", "-c", "%a %u", "/repo", "/repo/bin/tool.sh", "/repo/a.txt"]).stdout.decode().split("\n")
        assert st[:3] == ["755 0", "755 0", "644 0"]

    # unchanged repo + commit + setup: a cache hit that sends no blob and no manifest
    recording_proxy.log.clear()
    again = json.loads(cli(daemon, "package", str(repo.path), "--base", base, "--ref", ref, "--commit", c1,
                           "--setup", setup, "--env", "GREETING=hello", "--lock-out", str(tmp_path / "again.lock.toml"),
                           "--json").stdout)
    assert again["cached"] and again["uploaded_bytes"] == 0 and again["digest"] == out["digest"]
    assert recording_proxy.log.count("PUT", "PATCH", "POST") == 0, recording_proxy.log.entries

    # HEAD of a clean tree, the second commit: another task over the same base; still no base upload
    recording_proxy.log.clear()
    two = json.loads(cli(daemon, "package", str(repo.path), "--base", base, "--ref", f"{recording_proxy.host}/tasks:two",
                         "--setup", "cat a.txt > copied", "--lock-out", str(tmp_path / "two.lock.toml"),
                         "--json").stdout)
    assert two["commit"] == c2
    writes = [p for m, p, _ in recording_proxy.log.entries if m in ("PUT", "PATCH", "POST")]
    assert all(p.startswith("/v2/tasks/") for p in writes) and two["uploaded_bytes"] == two["layer_size"]
    check = cli(daemon, "package", "--check", two["lock"], "--smoke", "cat b.txt copied; ls /opt/dep 2>&1 || true")
    assert check.stdout == "added in two\nversion two\nls: /opt/dep: No such file or directory\n"
    # the setup snapshots are gone once published (the package cache covers reruns)
    with daemon.client() as c:
        assert not {s["snapshot"] for s in out["steps"] + two["steps"]} & {s["id"] for s in c.snapshots()}
        assert c.list() == []
    assert leftovers(daemon) == []


def test_gitignore_include_git_chown_and_workdir(daemon, home, registry, tmp_path):
    from weenv.build import package

    repo, c1, _ = two_commit_repo(tmp_path / "repo")
    plain = package(str(repo.path), base=daemon.plan_lock, ref=f"{registry.host}/opts:plain", commit=c1,
                    lock_out=str(tmp_path / "plain.lock.toml"))
    paths = layer_paths(plain.ref)
    assert {"repo/a.txt", "repo/debug.log", "repo/build/out.txt", "repo/link"} <= paths.keys()
    assert "repo/.gitignore" in paths and not any(p == "repo/.git" or p.startswith("repo/.git/") for p in paths)
    assert paths["repo/link"].type == "symlink" and paths["repo/link"].link == "a.txt"
    assert plain.warnings and "embedded store" in plain.warnings[0]  # a local base under a remote task

    ignored = package(str(repo.path), base=daemon.plan_lock, ref=f"{registry.host}/opts:ignored", commit=c1,
                      gitignore=True, include_git=True, chown=(1000, 1000), workdir="/home/user/src",
                      lock_out=str(tmp_path / "ignored.lock.toml"))
    paths = layer_paths(ignored.ref)
    assert "home/user/src/a.txt" in paths and "home/user/src/.gitignore" in paths
    assert "home/user/src/debug.log" not in paths and "home/user/src/build/out.txt" not in paths
    assert "home/user/src/.git/HEAD" in paths
    assert paths["home/user/src/a.txt"].uid == 1000 and paths["home/user/src"].uid == 1000
    # parents keep the base's attributes (busybox: /home/user belongs to uid 1000, /home to root)
    assert (paths["home/user"].uid, paths["home"].uid) == (1000, 0)
    with daemon.client() as c, c.create(ignored.lock) as env:
        head = env.exec(["cat", "/home/user/src/.git/HEAD"]).stdout.decode().strip()
        assert head == c1
        assert env.exec(["pwd"]).stdout == b"/home/user/src\n"


# ------------------------------------------------------------------------------------ batch


def test_batch_of_20_with_2_failures_is_resumable(daemon, home, registry, tmp_path):
    repo, c1, c2 = two_commit_repo(tmp_path / "repos" / "one")
    other = GitRepo(tmp_path / "repos" / "other")
    other.write("main.py", "print('other')\n")
    o1 = other.commit("first")
    tasks = []
    for i in range(20):
        task: dict = {"id": f"t{i:02d}", "repo": "repos/one", "commit": c1 if i % 2 else c2}
        if i % 5 == 0:
            task["setup"] = ["mkdir -p /opt", f"echo task {i} > /opt/id"]
        if i % 3 == 0:
            task.update(repo=f"file://{other.path}", commit=o1)
        tasks.append(task)
    tasks[7]["commit"] = "0" * 40  # injected failure: an unknown commit
    tasks[10]["setup"] = ["echo about to fail; echo boom >&2; exit 7"]  # injected failure: a failing setup
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    template = f"{registry.host}/batch:{{id}}"

    p = cli(daemon, "package", "--tasks", str(tasks_file), "--base", daemon.plan_lock, "--ref-template", template,
            "--jobs", "4", "--json", check=False)
    assert p.returncode == 1, p.stderr
    summary = json.loads(p.stdout)
    assert (summary["total"], summary["ok"], summary["failed"], summary["skipped"]) == (20, 18, 2, 0), \
        Path(summary["results"]).read_text()
    assert summary["failed_ids"] == ["t07", "t10"]
    assert summary["results"] == str(tmp_path / "tasks.results.jsonl")
    lines = [json.loads(x) for x in Path(summary["results"]).read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == [t["id"] for t in tasks]
    by_id = {r["id"]: r for r in lines}
    for t in tasks:
        r = by_id[t["id"]]
        assert {"id", "ref", "digest", "uploaded_bytes", "seconds", "status", "error"} <= r.keys()
        assert r["ref"] == template.format(id=t["id"])
        if t["id"] in ("t07", "t10"):
            assert r["status"] == "failed" and r["digest"] is None
        else:
            assert r["status"] == "ok" and r["error"] is None and r["digest"].startswith("sha256:")
            assert os.path.exists(r["lock"]) and r["lock"] == str(tmp_path / "locks" / f"{t['id']}.lock.toml")
    assert "unknown commit '0000000000000000000000000000000000000000'" in by_id["t07"]["error"]
    assert "exit code 7" in by_id["t10"]["error"] and "boom" in by_id["t10"]["error"]

    from weenv.registry import NotFoundError, resolve_group

    for t in tasks:
        if t["id"] in ("t07", "t10"):
            with pytest.raises(NotFoundError):
                resolve_group(template.format(id=t["id"]))
        else:
            assert resolve_group(template.format(id=t["id"])).manifest_digest == by_id[t["id"]]["digest"]
    with daemon.client() as c:
        with c.create(by_id["t15"]["lock"]) as env:  # other repo, with setup
            assert env.exec(["cat", "/opt/id", "main.py"]).stdout == b"task 15\nprint('other')\n"
        with c.create(by_id["t01"]["lock"]) as env:  # first repo at the first commit, no setup
            assert env.exec(["cat", "a.txt"]).stdout == b"version one\n"

    # rerun: the 18 are skipped, only the 2 failures run (and fail) again
    p = cli(daemon, "package", "--tasks", str(tasks_file), "--base", daemon.plan_lock, "--ref-template", template,
            "--jobs", "4", "--json", check=False)
    assert p.returncode == 1
    summary = json.loads(p.stdout)
    assert (summary["ok"], summary["failed"], summary["skipped"]) == (0, 2, 18)
    lines = [json.loads(x) for x in Path(summary["results"]).read_text().splitlines()]
    assert len(lines) == 22 and sorted(r["id"] for r in lines[20:]) == ["t07", "t10"]

    # fixed tasks: the rerun finishes the batch with exit 0, and human output names the counts
    tasks[7]["commit"] = c1
    tasks[10]["setup"] = ["true"]
    tasks_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    p = cli(daemon, "package", "--tasks", str(tasks_file), "--base", daemon.plan_lock, "--ref-template", template)
    assert "2 packaged, 0 failed, 18 skipped" in p.stdout
    with daemon.client() as c:
        assert c.list() == []
    assert leftovers(daemon) == []


# ------------------------------------------------------------------------------------ bad input


def test_bad_input_gets_clear_errors(daemon, home, tmp_path):
    from weenv.build import PackageError, TasksFileError, load_tasks, package
    from weenv.registry import NotFoundError, resolve_group

    repo, c1, _ = two_commit_repo(tmp_path / "repo")
    kw = dict(base=daemon.plan_lock, lock_out=str(tmp_path / "x.lock.toml"))
    with pytest.raises(PackageError, match="repository not found: .*/nope is not a directory"):
        package(str(tmp_path / "nope"), ref="bad:missing", **kw)
    (tmp_path / "plain").mkdir()
    with pytest.raises(PackageError, match="not a git repository"):
        package(str(tmp_path / "plain"), ref="bad:plain", **kw)
    with pytest.raises(PackageError, match="unknown commit 'deadbeef' in"):
        package(str(repo.path), ref="bad:commit", commit="deadbeef", **kw)
    repo.write("a.txt", "edited but not committed\n")
    with pytest.raises(PackageError, match="uncommitted changes \\(a.txt\\)"):
        package(str(repo.path), ref="bad:dirty", **kw)
    with pytest.raises(PackageError, match="environment variable names .*'1BAD'"):
        package(str(repo.path), ref="bad:env", commit=c1, env={"1BAD": "x"}, **kw)
    with pytest.raises(PackageError, match="workdir must be an absolute path"):
        package(str(repo.path), ref="bad:workdir", commit=c1, workdir="repo", **kw)
    with pytest.raises(PackageError) as ei:
        package(str(repo.path), ref="bad:setup", commit=c1,
                setup=["true", "echo step two output; echo the-error-tail >&2; exit 3"], **kw)
    msg = str(ei.value)
    assert "setup command 2" in msg and "exit code 3" in msg and "the-error-tail" in msg and "step two output" in msg
    with pytest.raises(NotFoundError):
        resolve_group("bad:setup")
    assert not os.path.exists(tmp_path / "x.lock.toml")

    good = json.dumps({"id": "ok", "repo": "repo"})
    for line, want in [("{not json", "not a JSON object"), ('{"id": "a b", "repo": "r"}', "\\$.id"),
                       ('{"id": "x", "repo": "r", "comit": "abc"}', "unknown field `comit`"),
                       ('{"id": "x"}', "missing required field `repo`"), (good, "duplicate task id 'ok'")]:
        f = tmp_path / "tasks.jsonl"
        f.write_text(f"{good}\n\n{line}\n")
        with pytest.raises(TasksFileError, match=f"tasks.jsonl:3: .*{want}"):
            load_tasks(str(f))
    f.write_text(f'{good}\n{{"id": 5, "repo": "r"}}\n')
    p = cli(daemon, "package", "--tasks", str(f), "--base", daemon.plan_lock, "--ref-template", "t:{id}", check=False)
    assert p.returncode == 1 and "tasks.jsonl:2: Expected `str`, got `int` - at `$.id`" in p.stderr
    f.write_text(f"{good}\n")
    p = cli(daemon, "package", "--tasks", str(f), "--base", daemon.plan_lock, "--ref-template", "t:latest", check=False)
    assert p.returncode == 1 and "must contain {id}" in p.stderr
    p = cli(daemon, "package", "--check", str(tmp_path / "missing.lock.toml"), check=False)
    assert p.returncode == 1 and "cannot check" in p.stderr
    p = cli(daemon, "package", "--check", daemon.plan_lock, "--smoke", "echo out; exit 5", check=False)
    assert p.returncode == 5 and p.stdout == "out\n" and "exited with 5" in p.stderr
    p = cli(daemon, "package", str(repo.path), "--ref", "x:y", check=False)
    assert p.returncode == 2 and "--base is required" in p.stderr
    with daemon.client() as c:
        assert c.list() == []


# ------------------------------------------------------------------------------------ units


def test_names_urls_and_results_file(tmp_path):
    from weenv.build import TaskRecord, is_git_url, plan_name, read_results

    assert plan_name("Django__django-11099") == "django-django-11099"
    assert plan_name("___") == "task" and len(plan_name("x" * 200)) == 63
    assert is_git_url("https://github.com/a/b.git") and is_git_url("git@github.com:a/b.git")
    assert is_git_url("file:///srv/repo") and not is_git_url("repos/one") and not is_git_url("/abs/path")
    f = tmp_path / "r.jsonl"
    import msgspec

    f.write_bytes(msgspec.json.encode(TaskRecord(id="a", status="failed", error="x")) + b"\n"
                  + msgspec.json.encode(TaskRecord(id="a", status="ok")) + b"\n"
                  + msgspec.json.encode(TaskRecord(id="b", status="ok")) + b"\n" + b'{"id": "c", "sta')
    got = read_results(str(f))
    assert {k: v.status for k, v in got.items()} == {"a": "ok", "b": "ok"}
    assert read_results(str(tmp_path / "none.jsonl")) == {}
