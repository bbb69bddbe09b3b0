"""The embedded OCI layout store: on-disk format, atomicity, concurrent publishers (processes)."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

import weenv.registry as R
from weenv import layerfmt
from weenv.registry._oci import MANIFEST_V1


def _publisher(home: str, src: str, worker: int, rounds: int, out: "multiprocessing.Queue[object]") -> None:
    os.environ["WEENV_HOME"] = home
    try:
        done = []
        for i in range(rounds):
            # every worker publishes the same shared tree and one of its own
            shared = R.publish(src, f"team/shared:w{worker}-{i}", use_cache=False)
            own_dir = os.path.join(home, f"own-{worker}-{i}")
            os.makedirs(own_dir, exist_ok=True)
            with open(os.path.join(own_dir, "id"), "w") as f:
                f.write(f"{worker}/{i}\n")
            own = R.publish(own_dir, f"team/w{worker}:r{i}", use_cache=False)
            done.append((shared.layer_digest, own.digest))
        out.put(("ok", worker, done))
    except BaseException as e:  # report, don't hang the parent
        out.put(("error", worker, repr(e)))


@pytest.mark.integration
def test_concurrent_publishers_lose_nothing(weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "tree"
    src.mkdir()
    (src / "data").write_bytes(os.urandom(200_000))
    workers, rounds = 4, 5
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue[object] = ctx.Queue()
    procs = [ctx.Process(target=_publisher, args=(weenv_home, str(src), w, rounds, q)) for w in range(workers)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors
    store = R.LayoutStore(os.path.join(weenv_home, "store"))
    assert store.list_tags("team/shared") == sorted(f"w{w}-{i}" for w in range(workers) for i in range(rounds))
    shared_digests = {d for _, _, done in results for d, _ in done}
    assert len(shared_digests) == 1  # deterministic build: one blob for the shared tree
    for w in range(workers):
        assert store.list_tags(f"team/w{w}") == [f"r{i}" for i in range(rounds)]
        for i in range(rounds):
            info = R.resolve_group(f"team/w{w}:r{i}")
            with R.open_layer_ref(f"team/w{w}:r{i}") as reader:
                assert layerfmt.Layer.open(reader).read("id") == f"{w}/{i}\n".encode()
            assert info.group == f"w{w}"
    # no temp files left behind, and the layout is what OCI tools expect
    root = store.root
    assert not [n for n in os.listdir(os.path.join(root, "blobs", "sha256")) if ".tmp" in n]
    assert json.load(open(os.path.join(root, "oci-layout"))) == {"imageLayoutVersion": "1.0.0"}
    index = json.load(open(os.path.join(root, "index.json")))
    assert index["schemaVersion"] == 2
    assert all("dev.weenv.repo" in m["annotations"] for m in index["manifests"])


def test_layout_store_blob_files_are_content_addressed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = R.LayoutStore(str(tmp_path / "s"))
    digest = s.put_blob_bytes("r", b"hello")
    assert open(s.blob_path(digest), "rb").read() == b"hello"
    with pytest.raises(R.RefError):
        s.blob_path("sha256:../../etc/passwd")
    # a tag in one repo does not leak into another, and the index names both
    m = b'{"mediaType":"%s","schemaVersion":2}' % MANIFEST_V1.encode()
    s.put_manifest("a/one", m, MANIFEST_V1, "t")
    s.put_manifest("b/two", m, MANIFEST_V1, "t")
    assert s.list_repos() == ["a/one", "b/two"]
    assert s.resolve("a/one", "t").digest == s.resolve("b/two", "t").digest


def test_corrupt_index_is_a_store_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = R.LayoutStore(str(tmp_path / "s"))
    with open(os.path.join(s.root, "index.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(R.StoreError, match="index.json"):
        s.list_tags("x")


def test_local_refs_use_weenv_home(weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "t"
    src.mkdir()
    (src / "f").write_text("x")
    res = R.publish(str(src), "harness:v3", group_class="harness")
    assert os.path.isdir(os.path.join(weenv_home, "store", "blobs", "sha256"))
    info = R.resolve_group(f"harness@{res.digest}")
    assert info.registry is None and info.layer_digest == res.layer_digest
    assert R.image_config("harness:v3") == R.ImageConfig()
