"""``weenv analyze`` / ``weenv regroup`` (issue 28 item 4) on a small corpus that umoci builds
and skopeo pushes to the test registry: two families of task images over one base, each task
image's layer re-made (so no layer is shared across tasks, but most of its files are)."""

from __future__ import annotations

import json
import os
import random
import shutil
from contextlib import ExitStack

import pytest
from click.testing import CliRunner

import weenv.plan as wp
import weenv.registry as R
from tests.fixtures_common import require_command
from tests.test_registry_image import run
from weenv.cli import main
from weenv.registry._corpus import analyze, load_corpus, pieces
from weenv.registry._regroup import regroup, verify

pytestmark = pytest.mark.integration


def _task_image(base: str, work: str, tag: str, family: str, task: int) -> str:
    """base + one layer: the family's 'env' (identical files for every task of the family, but a
    new layer each time) and the task's own file."""
    layout = os.path.join(work, tag)
    shutil.copytree(base, layout)
    bundle = os.path.join(work, tag + "-b")
    run("umoci", "unpack", "--image", f"{layout}:bb", bundle)
    root = os.path.join(bundle, "rootfs")
    env = os.path.join(root, "opt", "env")
    os.makedirs(env)
    for k in range(3):  # incompressible, as installed packages nearly are: 88000 bytes each
        with open(os.path.join(env, f"lib{k}.py"), "wb") as f:
            f.write(random.Random(f"{family}{k}").randbytes(88000))
    with open(os.path.join(root, "opt", "common.txt"), "wb") as f:
        f.write(random.Random("common").randbytes(100_000))
    os.makedirs(os.path.join(root, "task"))
    with open(os.path.join(root, "task", "id"), "w") as f:
        f.write(f"{family}-{task}\n")
    run("umoci", "repack", "--image", f"{layout}:bb", bundle)
    shutil.rmtree(bundle)
    return layout


@pytest.fixture(scope="module")
def corpus(busybox_oci, registry, tmp_path_factory):
    require_command("umoci")
    require_command("skopeo")
    work = str(tmp_path_factory.mktemp("corpus"))
    refs = []
    for family in ("alpha", "beta"):
        for task in (1, 2, 3):
            layout = _task_image(busybox_oci, work, f"{family}{task}", family, task)
            ref = f"{registry.host}/rg/{family}:{task}"
            run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:bb", f"docker://{ref}")
            refs.append(ref)
    return refs


def test_analyze_finds_what_layers_hide_and_regroup_stores_it_once(corpus, registry, weenv_home, tmp_path):
    store = f"{registry.host}/rg-store{os.getpid()}/"
    with ExitStack() as stack:
        trees = load_corpus(corpus, store=store, stack=stack)
        assert [t.family for t in trees] == ["rg/alpha"] * 3 + ["rg/beta"] * 3
        got = {len(p.signature): p for p in pieces(trees) if p.bytes}
        assert got[6].tier == "all" and "opt/common.txt" in got[6].paths and "bin/busybox" in got[6].paths
        assert got[3].tier == "family" and sorted(got[3].paths) == ["opt/env/lib0.py", "opt/env/lib1.py",
                                                                     "opt/env/lib2.py"]
        rep = analyze(trees, min_group_bytes=64 << 10)
        # every task image has its own top layer: the registry keeps 3 copies of each family's files
        # (2 too many, per family) and 6 of the common file (5 too many); by content they are kept once
        saved = rep.layer_dedup_bytes - rep.file_dedup_bytes
        assert saved > 2 * 2 * 3 * 88000 + 5 * 100_000 - 30_000, (saved, rep.layer_dedup_bytes, rep.file_dedup_bytes)
        assert {r["class"] for r in rep.classes} == {"os", "harness", "task"}
        assert rep.changes and all(r["of_versions"] == 4 for r in rep.changes)  # 2 per family
        assert {r["class"] for r in rep.changes} == {"task"}  # only the task file changed between versions
        res = regroup(trees, rep.proposal, str(tmp_path / "locks"), store=store)
        assert set(res.locks) == set(corpus)
        assert res.groups == 1 + 2 + 6  # one os group, one per family, a top group per image
        assert res.stored_bytes < rep.layer_dedup_bytes
        for t in trees:
            lock = wp.load_lock(res.locks[t.name])
            assert [g.group_class for g in lock.groups] == ["os", "harness", "task"]
            assert lock.env == t.lock.env and lock.workdir == "/srv" and lock.image == t.lock.image
            verify(t, lock)  # already checked by regroup; a re-read of what it wrote
        # a re-run publishes nothing new
        again = regroup(trees, rep.proposal, str(tmp_path / "locks2"), store=store)
        assert again.uploaded_bytes == 0 and again.groups == res.groups


def test_verify_catches_a_lock_that_is_not_its_image(corpus, registry, weenv_home, tmp_path):
    store = f"{registry.host}/rg-v{os.getpid()}/"
    with ExitStack() as stack:
        trees = load_corpus(corpus[:2], store=store, stack=stack)
        rep = analyze(trees, min_group_bytes=0)
        res = regroup(trees, rep.proposal, str(tmp_path / "l"), store=store)
        other = wp.load_lock(res.locks[corpus[1]])
        with pytest.raises(R.IntegrityError, match=r"task/id"):
            verify(trees[0], other)


def test_the_commands(corpus, registry, weenv_home, tmp_path):
    pytest.importorskip("matplotlib")
    store = f"{registry.host}/rg-cli{os.getpid()}"
    runner = CliRunner()
    png = tmp_path / "corpus.png"
    res = runner.invoke(main, ["analyze", *corpus, "--store", store, "--plot", str(png), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["images"] == 6 and doc["file_dedup_bytes"] < doc["layer_dedup_bytes"]
    assert png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = runner.invoke(main, ["regroup", *corpus, "--store", store, "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "6 locks in" in res.output and "x the registry's layers" in res.output
    res = runner.invoke(main, ["analyze", "not-a-lock.toml"])
    assert res.exit_code != 0 and "not-a-lock.toml" in res.output


def test_a_regrouped_lock_starts(corpus, registry, daemon, tmp_path, monkeypatch):
    store = f"{registry.host}/rg-d{os.getpid()}/"
    monkeypatch.setenv("WEENV_HOME", daemon.home)
    with ExitStack() as stack:
        trees = load_corpus(corpus[3:5], store=store, stack=stack)
        res = regroup(trees, analyze(trees).proposal, str(tmp_path / "l"), store=store)
    with daemon.client() as c:
        env = c.create(res.locks[corpus[4]])
        try:
            r = env.exec(["sh", "-c", "cat /task/id; wc -c < /opt/env/lib1.py; cat /etc/new; ls -A /var/lib/x"])
            assert r.stdout == b"beta-2\n88000\nnew\n", r
        finally:
            env.kill()
