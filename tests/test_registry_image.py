"""Image import (`weenv pull`) and export, checked with the real tools: umoci, skopeo, tar, a registry."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile

import pytest

import weenv.registry as R
from tests.fixtures_common import require_command, require_root
from tests.fixtures_registry import umoci_unpack
from weenv import layerfmt
from weenv.registry._oci import CONFIG_V1, INDEX_V1, LAYER_TAR, MANIFEST_V1, canonical_json, descriptor_json
from weenv.testing import debian_tar

pytestmark = pytest.mark.integration


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p


def snapshot(root: str) -> dict[str, tuple]:
    """What extraction must reproduce: type, mode, owner, content/target, and hardlink groups."""
    out: dict[str, tuple] = {}
    inodes: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            extra: object = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    extra = hashlib.sha256(f.read()).hexdigest()
                if st.st_nlink > 1:
                    first = inodes.setdefault((st.st_dev, st.st_ino), rel)
                    extra = (extra, "link-group", first if first != rel else None)
            elif stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                extra = (os.major(st.st_rdev), os.minor(st.st_rdev))
            out[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, extra)
    return out


def _normalize_links(snap: dict[str, tuple]) -> dict[str, tuple]:
    # which member of a hardlink group is "first" depends on walk order: compare the groups instead
    groups: dict[str, set[str]] = {}
    out = {}
    for rel, (kind, mode, uid, gid, extra) in snap.items():
        if isinstance(extra, tuple) and len(extra) == 3 and extra[1] == "link-group":
            groups.setdefault(extra[2] or rel, set()).add(rel)
            extra = (extra[0], "hardlinked")
        out[rel] = (kind, mode, uid, gid, extra)
    sets = sorted(sorted(g) for g in groups.values())
    return {"entries": out, "hardlink_groups": sets}  # type: ignore[return-value]


def assert_same_tree(a: str, b: str) -> None:
    sa, sb = _normalize_links(snapshot(a)), _normalize_links(snapshot(b))
    ea, eb = sa["entries"], sb["entries"]  # type: ignore[index]
    only_a, only_b = sorted(set(ea) - set(eb)), sorted(set(eb) - set(ea))
    assert not only_a and not only_b, f"only in {a}: {only_a[:10]}; only in {b}: {only_b[:10]}"
    diff = [k for k in ea if ea[k] != eb[k]]
    assert not diff, [(k, ea[k], eb[k]) for k in diff[:5]]
    assert sa["hardlink_groups"] == sb["hardlink_groups"]  # type: ignore[index]


# ------------------------------------------------------------------------------------- busybox image


def extract_group(ref: str, dest: str) -> str:
    """Extract a group's layer with GNU tar (it is a valid tar+zstd stream)."""
    info = R.resolve_group(ref)
    blob = os.path.join(dest + ".blob")
    with R.open_store(info.registry) as s, open(blob, "wb") as f:
        for chunk in s.iter_blob(info.repo, info.layer_digest, info.layer_size):
            f.write(chunk)
    os.makedirs(dest)
    run("tar", "--zstd", "--numeric-owner", "-xpf", blob, "-C", dest)
    return dest


def test_pull_oci_layout_squashes_to_the_same_tree(busybox_oci, busybox_reference, weenv_home,
                                                  tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = R.pull(f"oci:{busybox_oci}:bb", name="bb:v1")
    (g,) = res.groups
    assert (g.ref, g.group, g.group_class, g.layers) == ("bb:v1", "os", "os", (0, 2))
    info = R.resolve_group("bb:v1")
    assert info.annotations["org.opencontainers.image.source"].startswith("oci:")
    with R.open_layer_ref("bb:v1") as reader:
        lay = layerfmt.Layer.open(reader)
        types = {e.path: e.type for e in lay.entries}
        assert not [p for p, t in types.items() if t in ("whiteout", "opaque")]  # bottom group: nothing to hide
        assert types["etc/motd.hard"] == "hardlink" or types["etc/motd"] == "hardlink"
        lay.verify()
    assert_same_tree(busybox_reference, extract_group("bb:v1", str(tmp_path / "x")))
    cfg = R.image_config("bb:v1")
    assert cfg == R.ImageConfig(env=cfg.env, working_dir="/srv", user="1000:1000", entrypoint=["/bin/busybox"],
                                cmd=["/bin/sh"])
    assert "FOO=bar" in cfg.env


def test_pull_groups_keep_whiteouts_and_export_roundtrips(busybox_oci, busybox_reference, weenv_home,
                                                          tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = R.pull(f"oci:{busybox_oci}:bb", name="bbg:v1", groups="os=0,app:harness=1-2")
    assert [(g.ref, g.group, g.group_class, g.layers) for g in res.groups] == [
        ("bbg/os:v1", "os", "os", (0, 0)), ("bbg/app:v1", "app", "harness", (1, 2))]
    with R.open_layer_ref("bbg/app:v1") as reader:
        types = {e.path: e.type for e in layerfmt.Layer.open(reader).entries}
    assert types["var/lib/x/.wh.gone"] == "whiteout"
    assert types["tmp/cache"] == "dir" and types["tmp/cache/.wh..wh..opq"] == "opaque"  # re-created dir
    assert "tmp/.wh.cache" not in types
    # zstd export: skopeo reads it as is; converted by skopeo to gzip, umoci unpacks the same tree
    out = str(tmp_path / "exp")
    exp = R.export_oci(["bbg/os:v1", "bbg/app:v1"], out, tag="t1")
    inspect = json.loads(run("skopeo", "inspect", f"oci:{out}:t1").stdout)
    assert inspect["Layers"] == exp.layers and len(exp.layers) == 2
    assert "FOO=bar" in inspect["Env"]
    manifest = json.loads(open(os.path.join(out, "blobs", "sha256", exp.manifest_digest[7:]), "rb").read())
    assert {d["mediaType"] for d in manifest["layers"]} == {"application/vnd.oci.image.layer.v1.tar+zstd"}
    config = json.loads(open(os.path.join(out, "blobs", "sha256", exp.config_digest[7:]), "rb").read())
    for layer_digest, diff_id in zip(exp.layers, config["rootfs"]["diff_ids"]):
        tar_bytes = subprocess.run(["zstd", "-dc", os.path.join(out, "blobs", "sha256", layer_digest[7:])],
                                   capture_output=True, check=True).stdout
        assert diff_id == "sha256:" + hashlib.sha256(tar_bytes).hexdigest()
    run("skopeo", "copy", "--dest-compress", "--dest-compress-format", "gzip", f"oci:{out}:t1",
        f"oci:{tmp_path / 'gz'}:t1")
    assert_same_tree(busybox_reference, umoci_unpack(f"{tmp_path / 'gz'}:t1", str(tmp_path / "u1")))
    # gzip export: umoci 0.4 (no zstd) unpacks it directly
    R.export_oci(["bbg/os:v1", "bbg/app:v1"], out, tag="t2", compression="gzip")
    assert_same_tree(busybox_reference, umoci_unpack(f"{out}:t2", str(tmp_path / "u2")))
    rt = json.load(open(os.path.join(tmp_path, "u2", "config.json")))
    assert rt["process"]["cwd"] == "/srv" and rt["process"]["args"] == ["/bin/busybox", "/bin/sh"]
    # both tags live in one layout
    tags = {m["annotations"]["org.opencontainers.image.ref.name"] for m in json.load(open(os.path.join(out, "index.json")))["manifests"]}
    assert tags == {"t1", "t2"}


def test_pull_docker_archive_and_registry_give_the_same_layer(busybox_oci, registry, weenv_home,
                                                              tmp_path) -> None:  # type: ignore[no-untyped-def]
    want = R.pull(f"oci:{busybox_oci}:bb", name="ref:v1").groups[0].result.layer_digest
    archive = str(tmp_path / "bb.tar")
    run("skopeo", "copy", f"oci:{busybox_oci}:bb", f"docker-archive:{archive}:busybox:1")
    got = R.pull(f"docker-archive:{archive}")
    assert got.groups[0].ref == "busybox:1"
    assert got.groups[0].result.layer_digest == want
    assert "FOO=bar" in got.config.env
    run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{busybox_oci}:bb",
        f"docker://{registry.host}/images/busybox:1")
    from_registry = R.pull(f"{registry.host}/images/busybox:1", name=f"{registry.host}/imported/bb:1")
    assert from_registry.groups[0].result.layer_digest == want
    info = R.resolve_group(f"{registry.host}/imported/bb:1")
    assert info.group_class == "os" and R.image_config(info.pinned_ref).working_dir == "/srv"


def test_a_config_is_read_once_per_digest_and_a_moved_tag_reads_its_new_one(busybox_oci, registry,
                                                                          tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every Docker API create opens the image twice (serve, daemon): the config blob comes from the
    registry once per digest; the manifest is read each time, so a tag pushed anew is seen."""
    from weenv.registry._image import open_image_source

    ref = f"{registry.host}/images/cfg-cache:1"
    run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{busybox_oci}:bb", f"docker://{ref}")
    requests, digests = [], []
    for _ in range(2):
        src = open_image_source(ref)
        requests.append(src.store.stats.requests)  # type: ignore[attr-defined]
        digests.append(src.config_digest)
        assert "FOO=bar" in src.config["config"]["Env"]
        src.close()
    assert requests == [2, 1] and digests[0] == digests[1]  # manifest + config, then the manifest alone
    moved = str(tmp_path / "oci")
    shutil.copytree(busybox_oci, moved, symlinks=True)
    run("umoci", "config", "--image", f"{moved}:bb", "--config.env", "MOVED=1")
    run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{moved}:bb", f"docker://{ref}")
    src = open_image_source(ref)
    try:
        assert src.config_digest != digests[0] and src.store.stats.requests == 2  # type: ignore[attr-defined]
        assert "MOVED=1" in src.config["config"]["Env"]
    finally:
        src.close()


def test_pull_rejects_bad_inputs(busybox_oci, weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(R.NotFoundError):
        R.pull(f"oci:{busybox_oci}:nope")
    with pytest.raises(R.NotFoundError):
        R.pull(f"oci:{tmp_path}")
    with pytest.raises(R.RefError):
        R.pull(f"oci:{busybox_oci}:bb", groups="os=0-1")
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar")
    with pytest.raises(R.ArtifactError):
        R.pull(f"docker-archive:{bad}")


# ------------------------------------------------------------------------------------- Debian minbase


def _mmdebstrap_tar() -> str:
    """The cached ``mmdebstrap --variant=minbase bookworm`` tar of the fixture cache (built once, ~30 s).

    Skips only when mmdebstrap itself fails (no Debian mirror reachable); output that is not a
    complete rootfs tar fails the test.
    """
    require_root()
    require_command("mmdebstrap")
    try:
        return str(debian_tar())
    except subprocess.CalledProcessError as e:
        pytest.skip(f"mmdebstrap could not build a Debian rootfs here: {(e.stderr or '').strip()[-500:]}")


def _write_oci_layout_from_tar(tar_path: str, layout: str) -> None:
    """Our own minimal OCI writer: one uncompressed tar layer, a config, a manifest, an index."""
    blobs = os.path.join(layout, "blobs", "sha256")
    os.makedirs(blobs)
    h = hashlib.sha256()
    with open(tar_path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    layer_digest, size = "sha256:" + h.hexdigest(), os.path.getsize(tar_path)
    os.link(tar_path, os.path.join(blobs, h.hexdigest())) if os.stat(tar_path).st_dev == os.stat(blobs).st_dev \
        else shutil.copyfile(tar_path, os.path.join(blobs, h.hexdigest()))

    def put(data: bytes) -> str:
        d = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, d), "wb") as f:
            f.write(data)
        return "sha256:" + d

    config = canonical_json({"architecture": "amd64", "os": "linux",
                             "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                                        "Cmd": ["/bin/bash"]},
                             "rootfs": {"type": "layers", "diff_ids": [layer_digest]}})
    cfg_digest = put(config)
    manifest = canonical_json({"schemaVersion": 2, "mediaType": MANIFEST_V1,
                               "config": descriptor_json(CONFIG_V1, cfg_digest, len(config)),
                               "layers": [descriptor_json(LAYER_TAR, layer_digest, size)]})
    m_digest = put(manifest)
    with open(os.path.join(layout, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "mediaType": INDEX_V1, "manifests": [
            descriptor_json(MANIFEST_V1, m_digest, len(manifest), {"org.opencontainers.image.ref.name": "bookworm"})]}, f)
    with open(os.path.join(layout, "oci-layout"), "w") as f:
        f.write('{"imageLayoutVersion":"1.0.0"}')


@pytest.mark.slow
def test_debian_minbase_import_and_export(weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    tar_path = _mmdebstrap_tar()
    layout = str(tmp_path / "deb")
    _write_oci_layout_from_tar(tar_path, layout)
    res = R.pull(f"oci:{layout}:bookworm", name="debian:bookworm")
    with R.open_layer_ref("debian:bookworm") as reader:
        lay = layerfmt.Layer.open(reader)
        assert len(lay.entries) > 5000
        assert lay.read("etc/debian_version").startswith(b"12")
    ref_tree = tmp_path / "ref"
    ref_tree.mkdir()
    run("tar", "--numeric-owner", "-xpf", tar_path, "-C", str(ref_tree))
    assert_same_tree(str(ref_tree), extract_group("debian:bookworm", str(tmp_path / "x")))
    out = str(tmp_path / "exp")
    exp = R.export_oci(["debian:bookworm"], out, tag="z")
    inspect = json.loads(run("skopeo", "inspect", f"oci:{out}:z").stdout)
    assert inspect["Layers"] == exp.layers
    assert res.config.cmd == ["/bin/bash"]
    with tarfile.open(tar_path) as tf:
        n_members = len(tf.getmembers())
    assert abs(len(lay.entries) - n_members) <= 1  # the root entry may be added
