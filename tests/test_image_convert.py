"""Images as plans (issue 28): per-layer conversion keyed by diff id, once per store; the image
config in the lock; ``weenv pull`` default, ``-o LOCK`` and explicit squashing. Real tools only:
umoci made the layers, skopeo copies them, the registry is Debian's docker-registry."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

import weenv.plan as wp
import weenv.registry as R
from tests.fixtures_common import require_command
from tests.test_registry_image import assert_same_tree, run
from weenv import layerfmt
from weenv.cli import main

pytestmark = pytest.mark.integration


def group_types(ref: str) -> dict[str, str]:
    with R.open_layer_ref(ref) as reader:
        lay = layerfmt.Layer.open(reader)
        lay.verify()
        return {e.path: e.type for e in lay.entries}


def test_layers_convert_once_and_keep_their_whiteouts(busybox_oci, weenv_home) -> None:  # type: ignore[no-untyped-def]
    config = json.loads(run("skopeo", "inspect", "--config", f"oci:{busybox_oci}:bb").stdout)
    diff_ids = config["rootfs"]["diff_ids"]
    first = R.convert_image(f"oci:{busybox_oci}:bb")
    assert [x.diff_id for x in first.layers] == diff_ids and first.converted == 3
    assert [x.ref for x in first.layers] == [f"oci-layers:sha256-{d[7:]}" for d in diff_ids]
    bottom, middle, top = (group_types(x.ref) for x in first.layers)
    assert not [p for p, t in bottom.items() if t in ("whiteout", "opaque")]  # nothing below the bottom
    assert middle["var/lib/x/.wh.gone"] == "whiteout" and "tmp/.wh.cache" in middle
    assert top["tmp/cache"] == "dir" and top["tmp/cache/fresh"] == "file"
    info = R.resolve_group(first.layers[1].ref)
    assert info.annotations["dev.weenv.import.diff_id"] == diff_ids[1]
    # the second conversion reads nothing: every layer is found by its diff id before any download
    again = R.convert_image(f"oci:{busybox_oci}:bb")
    assert again.converted == 0 and [x.group.manifest_digest for x in again.layers] == \
        [x.group.manifest_digest for x in first.layers]
    assert all(x.bytes_read == 0 for x in again.layers)


def test_an_image_on_a_shared_base_converts_only_its_own_layer(busybox_oci, registry, weenv_home,
                                                              tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_command("umoci")
    derived = str(tmp_path / "derived")
    shutil.copytree(busybox_oci, derived)
    bundle = str(tmp_path / "bundle")
    run("umoci", "unpack", "--image", f"{derived}:bb", bundle)
    with open(os.path.join(bundle, "rootfs", "srv", "task.txt"), "w") as f:
        f.write("task 7\n")
    run("umoci", "repack", "--image", f"{derived}:bb", bundle)
    run("umoci", "config", "--image", f"{derived}:bb", "--config.label=task=7", "--config.exposedports=8080/tcp")
    # both images pushed to the registry (what a corpus looks like), converted into it
    for src, tag in ((busybox_oci, "base"), (derived, "task7")):
        run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{src}:bb", f"docker://{registry.host}/corpus:{tag}")
    store = f"{registry.host}/weenv/"
    base = R.convert_image(f"{registry.host}/corpus:base", base=store)
    task = R.convert_image(f"{registry.host}/corpus:task7", base=store)
    assert base.converted == 3 and task.converted == 1 and [x.converted for x in task.layers] == \
        [False, False, False, True]
    assert [x.ref for x in task.layers[:3]] == [x.ref for x in base.layers]
    assert task.layers[3].ref.startswith(f"{registry.host}/weenv/oci-layers:sha256-")
    assert group_types(task.layers[3].ref)["srv/task.txt"] == "file"
    # the lock: one group per layer, the image config as defaults and the [image] table
    lock = R.image_lock(task)
    assert isinstance(lock, wp.Lock) and lock.name == "corpus"
    assert [g.name for g in lock.groups] == ["layer0", "layer1", "layer2", "layer3"]
    assert [g.digest for g in lock.groups] == [x.group.manifest_digest for x in task.layers]
    assert lock.env["FOO"] == "bar" and lock.workdir == "/srv" and lock.user == "1000:1000"
    assert lock.image is not None and lock.image.entrypoint == ["/bin/busybox"] and lock.image.cmd == ["/bin/sh"]
    assert lock.image.ports == ["8080/tcp"] and lock.image.labels == {"task": "7"}
    assert lock.image.source == f"{registry.host}/corpus:task7"
    text = wp.dump_plan(lock, "toml")
    assert wp.load_text(text, fmt="toml") == lock  # the lock round-trips through its file


def test_a_layer_that_does_not_match_its_diff_id_is_refused(busybox_oci, weenv_home,
                                                           tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = str(tmp_path / "bad")
    shutil.copytree(busybox_oci, bad)
    index = json.load(open(os.path.join(bad, "index.json")))
    manifest_path = os.path.join(bad, "blobs", "sha256", index["manifests"][0]["digest"][7:])
    manifest = json.load(open(manifest_path))
    config_path = os.path.join(bad, "blobs", "sha256", manifest["config"]["digest"][7:])
    config = json.load(open(config_path))
    config["rootfs"]["diff_ids"][2] = "sha256:" + "0" * 64
    _rewrite_blob(bad, config_path, config, manifest, "config", manifest_path, index)
    with pytest.raises(R.IntegrityError, match=r"layer 3 is sha256:[0-9a-f]{64} uncompressed, the config says "
                       r"sha256:0000"):
        R.convert_image(f"oci:{bad}:bb")
    # nothing was tagged at the claimed diff id
    with pytest.raises(R.NotFoundError):
        R.resolve_group("oci-layers:sha256-" + "0" * 64)


def _rewrite_blob(layout, path, doc, manifest, key, manifest_path, index) -> None:  # type: ignore[no-untyped-def]
    import hashlib

    data = json.dumps(doc).encode()
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(layout, "blobs", "sha256", digest), "wb") as f:
        f.write(data)
    manifest[key] = {**manifest[key], "digest": f"sha256:{digest}", "size": len(data)}
    mdata = json.dumps(manifest).encode()
    mdigest = hashlib.sha256(mdata).hexdigest()
    with open(os.path.join(layout, "blobs", "sha256", mdigest), "wb") as f:
        f.write(mdata)
    index["manifests"][0] = {**index["manifests"][0], "digest": f"sha256:{mdigest}", "size": len(mdata)}
    with open(os.path.join(layout, "index.json"), "w") as f:
        json.dump(index, f)


def test_pull_cli_converts_per_layer_and_writes_the_lock(busybox_oci, busybox_reference, weenv_home,
                                                         tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    out = str(tmp_path / "bb.lock.toml")
    res = runner.invoke(main, ["pull", f"oci:{busybox_oci}:bb", "-o", out, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [x["converted"] for x in doc["layers"]] == [True, True, True] and doc["lock"] == out
    lock = wp.load_lock(out)
    assert [g.ref.split("@")[0] for g in lock.groups] == [x["ref"] for x in doc["layers"]]
    res = runner.invoke(main, ["pull", f"oci:{busybox_oci}:bb"])
    assert res.exit_code == 0, res.output
    assert "0 of 3 layers converted" in res.output
    # squashing is explicit, and still gives the image's tree
    res = runner.invoke(main, ["pull", f"oci:{busybox_oci}:bb", "--squash", "--name", "bbsq:v1"])
    assert res.exit_code == 0, res.output
    from tests.test_registry_image import extract_group

    assert_same_tree(busybox_reference, extract_group("bbsq:v1", str(tmp_path / "sq")))
    res = runner.invoke(main, ["pull", f"oci:{busybox_oci}:bb", "--name", "x:v1"])
    assert res.exit_code != 0 and "--name names the squashed group" in res.output
    res = runner.invoke(main, ["pull", f"oci:{busybox_oci}:bb", "--squash", "--groups", "os=0-2"])
    assert res.exit_code != 0 and "--squash and --groups" in res.output


def test_image_refs_are_recognised() -> None:
    from weenv._calls import plan_body
    from weenv.registry import is_image_ref

    for ref in ("oci:/x:tag", "docker-archive:/a.tar", "docker://127.0.0.1:5000/a:b", "127.0.0.1:5000/corpus:t1",
                "registry.example/ns/img@sha256:" + "a" * 64):
        assert is_image_ref(ref), ref
    for text in ("plan.toml", "bb:v1", "snap-123", "./x.lock.json"):
        assert not is_image_ref(text), text
    assert plan_body("docker://127.0.0.1:5000/a:b", {}) == {"image": "127.0.0.1:5000/a:b"}


def test_bad_image_references_fail_clearly(weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(R.RegistryError, match="no-such-dir"):
        R.convert_image(f"oci:{tmp_path}/no-such-dir:bb")
    archive = tmp_path / "junk.tar"
    archive.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(R.RegistryError, match="junk.tar"):
        R.convert_image(f"docker-archive:{archive}")
    from weenv.registry._convert import converted_ref

    with pytest.raises(R.ArtifactError, match="not a layer diff id: 'md5:abc'"):
        converted_ref("md5:abc")


def test_an_image_starts_as_an_env_and_a_second_start_converts_nothing(daemon, busybox_oci,
                                                                        tmp_path) -> None:  # type: ignore[no-untyped-def]
    image = f"oci:{busybox_oci}:bb"
    store = os.path.join(daemon.home, "store")
    with daemon.client() as c:
        env = c.create(image, ttl_s=300)
        try:
            assert env.exec(["cat", "/etc/new", "/tmp/cache/fresh"]).stdout == b"new\nfresh\n"
            r = env.exec(["sh", "-c", "ls -A /var/lib/x; ls -A /tmp/cache; echo $FOO; pwd; id -u"])
            assert r.stdout == b"fresh\nbar\n/srv\n1000\n", r  # whiteouts applied; the config's env, workdir, user
            assert env.exec(["cat", "/etc/motd.hard"]).stdout == b"hi\n"
        finally:
            env.kill()
        before = _store_files(store)
        again = c.create(image, ttl_s=300)
        try:
            assert again.exec(["cat", "/etc/new"]).stdout == b"new\n"
        finally:
            again.kill()
        assert _store_files(store) == before  # nothing converted or stored the second time
    # an image that is not there: a clear error, no env
    with daemon.client() as c, pytest.raises(Exception, match="nope"):
        c.create(f"oci:{busybox_oci}:nope")


def _store_files(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}
