"""Hot group layers kept as local directories: the copy, its use by new envs (no FUSE), the disk
budget, and a daemon restart finding them again; the bookkeeping in unit tests."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import time

import pytest
import trio

from weenv.provision.envs._trees import LayerTrees

from .fixtures_daemon import DaemonHandle, busybox_plan, teardown_private_daemon, wait_for
from .test_snapshots import overlay_lowers, tree_in_env


def _task_tar(path: str) -> None:
    """A group over busybox with a whiteout (/bin/vi), an opaque dir (/home) and new files."""
    with tarfile.open(path, "w") as t:
        def add(name: str, data: bytes | None = None, mode: int = 0o644) -> None:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                t.addfile(info)
            else:
                info.size, info.mode = len(data), mode
                t.addfile(info, io.BytesIO(data))
        add("bin")
        add("bin/.wh.vi", b"")
        add("home")
        add("home/.wh..wh..opq", b"")
        add("home/new")
        add("home/new/x", b"x\n")
        add("data")
        add("data/a", b"one\n", 0o600)


@pytest.mark.integration
def test_a_hot_layer_becomes_a_tree_that_new_envs_stack_without_the_envlet(tmp_path, monkeypatch):
    from weenv.envlet import EnvletClient
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import publish, resolve_group

    home = tempfile.mkdtemp(prefix="weenv-trees-")
    busybox_plan(home, "bb")
    _task_tar(str(tmp_path / "task.tar"))
    monkeypatch.setenv("WEENV_HOME", home)
    publish(str(tmp_path / "task.tar"), "task:test", group="task", group_class="task")
    plan = os.path.join(home, "two.toml")
    with open(plan, "w") as f:
        f.write('name = "two"\n[[groups]]\nname = "os"\nref = "busybox:test"\nclass = "os"\n'
                '[[groups]]\nname = "task"\nref = "task:test"\nclass = "task"\n')
    lock = os.path.join(home, "two.lock.toml")
    write_plan(lock_plan(load_plan(plan), resolve_group), lock)
    monkeypatch.setenv("WEENV_LAYER_TREES_AFTER", "1")
    d = DaemonHandle(home, os.path.join(home, "run", "weenv.sock"), f"weenv-trees-{os.getpid()}", lock, plan,
                     os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.start()
    trees = os.path.join(home, "layer-trees")
    try:
        with d.client() as c:
            first = c.create(lock)  # through the envlet: this start queues both layers' copies
            assert all(p.startswith(os.path.join(home, "envlet")) for p in overlay_lowers(d, first.id))
            want = tree_in_env(first)
            assert wait_for(lambda: c.top()["layer_trees"]["trees"] == 2, timeout_s=60), d.log()[-2000:]
            second = c.create(lock)
            lowers = overlay_lowers(d, second.id)
            assert len(lowers) == 2 and all(p.startswith(trees + "/") for p in lowers)
            refs = [x.refcount for x in EnvletClient(os.path.join(home, "run", "envlet.sock")).list()]
            assert refs == [1, 1]  # the first env's references only: the second one did not register
            assert tree_in_env(second) == want  # the same tree: whiteout, opaque dir, modes, contents
            assert second.exec(["ls", "/bin/vi"]).exit_code != 0 and second.exec(["ls", "/home"]).stdout == b"new\n"
            assert second.exec(["cat", "/data/a"]).stdout == b"one\n"
            second.exec(["sh", "-c", "echo two > /data/a; rm /bin/ls"])  # the env writes its own upper
            assert first.exec(["cat", "/data/a"]).stdout == b"one\n" and first.exec(["ls", "/bin/ls"]).exit_code == 0
            st = c.top()["layer_trees"]
            assert st["copies"] == 2 and 0 < st["bytes"] <= st["budget_bytes"]
            # an env on trees does not need the envlet at all
            first.kill()
            assert second.exec(["cat", "/data/a"]).stdout == b"two\n"
            second.kill()
            c.gc()
        # a restarted daemon finds the trees again
        d.stop()
        d.start()
        with d.client() as c:
            assert c.top()["layer_trees"]["trees"] == 2
            with c.create(lock) as third:
                assert all(p.startswith(trees + "/") for p in overlay_lowers(d, third.id))
                assert third.exec(["cat", "/data/a"]).stdout == b"one\n"
    finally:
        left = teardown_private_daemon(d)
        assert not left, left


# ----------------------------------------------------------------------------------- bookkeeping


def _fake_tree(root: str, key: str, size: int) -> None:
    os.makedirs(os.path.join(root, key, "etc"))
    with open(os.path.join(root, key + ".size"), "w") as f:
        f.write(str(size))


def test_trees_are_found_at_start_and_leftovers_of_cut_copies_are_removed(tmp_path):
    root = str(tmp_path / "t")
    os.makedirs(root)
    _fake_tree(root, "sha256-aa", 100)
    os.makedirs(os.path.join(root, ".tmp-sha256-bb", "x"))  # a copy cut short
    os.makedirs(os.path.join(root, "sha256-cc"))  # renamed but its size was never written
    with open(os.path.join(root, "sha256-dd.size"), "w") as f:  # a size without its tree
        f.write("5")
    t = LayerTrees(root, after=2, budget_bytes=1000)
    assert set(t.trees) == {"sha256-aa"} and sorted(os.listdir(root)) == ["sha256-aa", "sha256-aa.size"]
    assert t.path("sha256:aa") == os.path.join(root, "sha256-aa") and t.path("sha256:bb") is None


def test_copies_are_queued_on_the_nth_start_once_and_never_for_a_layer_above_the_budget(tmp_path):
    t = LayerTrees(str(tmp_path / "t"), after=2, budget_bytes=1000)
    calls = []

    def reg() -> tuple[str, str]:
        calls.append("register")
        return "n", "/nonexistent"

    t.note_start("sha256:aa", 10, reg, lambda n: None)
    assert t.stats()["queued"] == 0
    t.note_start("sha256:aa", 10, reg, lambda n: None)
    t.note_start("sha256:aa", 10, reg, lambda n: None)
    assert t.stats()["queued"] == 1  # queued once
    for _ in range(3):
        t.note_start("sha256:big", 5000, reg, lambda n: None)
    assert t.stats()["queued"] == 1
    capped = LayerTrees(str(tmp_path / "capped"), after=1, budget_bytes=1 << 30, max_layer_bytes=100)
    capped.note_start("sha256:cc", 101, reg, lambda n: None)  # a copy would pull all of it: stays lazy
    assert capped.stats()["queued"] == 0
    off = LayerTrees(str(tmp_path / "off"), after=0, budget_bytes=1000)
    for _ in range(5):
        off.note_start("sha256:aa", 10, reg, lambda n: None)
    assert off.stats()["queued"] == 0 and calls == []


def test_eviction_takes_least_recently_used_trees_that_no_env_stacks(tmp_path):
    root = str(tmp_path / "t")
    os.makedirs(root)
    for key in ("sha256-a", "sha256-b", "sha256-c"):
        _fake_tree(root, key, 300)
    t = LayerTrees(root, after=1, budget_bytes=1000)
    t.path("sha256:a")
    time.sleep(0.01)
    t.path("sha256:b")
    time.sleep(0.01)
    t.path("sha256:c")  # a is the least recently used, then b
    assert trio.run(lambda: t.evict(100, in_use=set())) == []  # 900 + 100 fit the 1000 bytes
    # 900 + 200 do not: one tree goes, and a is stacked by a live env, so b (the next oldest) goes
    removed = trio.run(lambda: t.evict(200, in_use={"sha256:a"}))
    assert removed == ["sha256-b"] and set(t.trees) == {"sha256-a", "sha256-c"}
    assert not os.path.exists(os.path.join(root, "sha256-b")) and not os.path.exists(os.path.join(root, "sha256-b.size"))
    removed = trio.run(lambda: t.evict(900, in_use={"sha256:a"}))
    assert removed == ["sha256-c"] and set(t.trees) == {"sha256-a"}  # a stays even over the budget
    assert t.stats()["evictions"] == 2


def test_a_queued_copy_becomes_a_tree_and_one_without_room_is_dropped_and_retried_later(tmp_path):
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "f").write_bytes(b"x" * 50_000)
    (src / "etc" / "link").symlink_to("f")
    t = LayerTrees(str(tmp_path / "t"), after=1, budget_bytes=100_000)  # room for one such tree (~60 kB)
    events = []

    def register() -> tuple[str, str]:
        events.append("register")
        return "layer-a", str(src)

    def unregister(name: str) -> None:
        events.append(f"unregister {name}")

    stacked: set[str] = set()

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(t.run, lambda: stacked)
            t.note_start("sha256:aa", 1000, register, unregister)
            while t.stats()["queued"]:
                await trio.sleep(0.01)
            assert t.pins == {}  # the envlet reference was held during the copy only
            stacked.add("sha256:aa")  # a live env stacks it: it cannot be evicted
            t.note_start("sha256:bb", 1000, register, unregister)  # would need room it cannot get
            while t.stats()["queued"]:
                await trio.sleep(0.01)
            t.note_start("sha256:bb", 1000, register, unregister)  # too early to retry: not queued
            assert t.stats()["queued"] == 0
            n.cancel_scope.cancel()

    trio.run(main)
    tree = t.path("sha256:aa")
    assert tree is not None and os.readlink(os.path.join(tree, "etc", "link")) == "f"
    assert (open(os.path.join(tree, "etc", "f"), "rb").read()) == b"x" * 50_000
    assert t.stats()["copies"] == 1 and t.path("sha256:bb") is None
    assert sorted(os.listdir(tmp_path / "t")) == ["sha256-aa", "sha256-aa.size"]  # the second copy is gone
    assert events == ["register", "unregister layer-a", "register", "unregister layer-a"]


def test_a_failed_copy_leaves_nothing_and_is_not_retried_at_once(tmp_path):
    t = LayerTrees(str(tmp_path / "t"), after=1, budget_bytes=1 << 20)
    released = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(t.run, set)
            t.note_start("sha256:aa", 10, lambda: ("layer-a", str(tmp_path / "missing")), released.append)
            while t.stats()["queued"]:
                await trio.sleep(0.01)
            t.note_start("sha256:aa", 10, lambda: ("layer-a", str(tmp_path / "missing")), released.append)
            assert t.stats()["queued"] == 0  # a failing layer is not copied again at every start
            n.cancel_scope.cancel()

    trio.run(main)
    assert released == ["layer-a"] and t.trees == {} and os.listdir(tmp_path / "t") == [] and t.pins == {}
