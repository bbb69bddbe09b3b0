"""Image intake (issue 28) against a real producer: images that Debian's dockerd built from
Dockerfiles and pushed to the test registry (tests/fixtures_docker.py), converted per layer.

- a corpus on one base: each layer is converted and uploaded once per store, whatever image brings it;
- the "hard" image (whiteouts, an opaque dir, hard links, setuid/setgid, a file capability, a device
  node, a 1 GiB sparse file, a 255-byte name, a 1,000-char path) becomes the tree Docker makes of it;
- the security rules: layers record setuid bits, capabilities and device nodes as the image has them;
  envs get them through nodev, unprivileged mounts;
- conversion streams: a layer is read once and written once, in bounded memory and disk;
- envs start from corpus images through the real daemon.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest

import weenv.registry as R
from tests.fixtures_docker import DEEP_DIRS, INIT_LAYER_PATHS, LONG_NAME, Corpus, Dockerd
from tests.layertrees import chardev, d, f, fifo, hard, make_tar, sym
from weenv import layerfmt
from weenv.envlet import LayerTree
from weenv.envlet._extract import _first_device
from weenv.layerfmt._build import build_tar_stream
from weenv.layerfmt._errors import StreamOrderError
from weenv.layerfmt._source import iter_tar_stream
from weenv.registry import _convert
from weenv.registry._image import open_image_source, squash
from weenv.registry._oci import EMPTY_DIGEST

pytestmark = pytest.mark.integration

CAP_NET_BIND_V2 = bytes.fromhex("0100000200200000000000000000000000000000")  # what the hard Dockerfile sets


# ------------------------------------------------------------------------------------- helpers


def _registry_blobs(storage_dir: str) -> dict[str, int]:
    """Every blob docker-registry holds (layers, configs and manifests alike): digest -> size."""
    out = {}
    root = os.path.join(storage_dir, "docker", "registry", "v2", "blobs", "sha256")
    for dirpath, _, files in os.walk(root):
        if "data" in files:
            out["sha256:" + os.path.basename(dirpath)] = os.path.getsize(os.path.join(dirpath, "data"))
    return out


class Converted:
    """The corpus converted into one store, with what each conversion added to the registry."""

    def __init__(self, corpus: Corpus, storage_dir: str, store: str):
        self.store = store
        self.images: dict[str, R.ConvertedImage] = {}
        self.added: dict[str, dict[str, int]] = {}
        self.seconds: dict[str, float] = {}
        self.passes: list[bool] = []  # per layer pass: spooled (the fallback) or streamed
        one_pass = _convert._convert_pass

        def recorded(*args, spooled: bool, **kwargs):  # type: ignore[no-untyped-def]
            self.passes.append(spooled)
            return one_pass(*args, spooled=spooled, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_convert, "_convert_pass", recorded)
            for ref in [corpus.base, *(t.ref for t in corpus.tasks), corpus.hard]:
                before = _registry_blobs(storage_dir)
                t0 = time.perf_counter()
                self.images[ref] = R.convert_image(ref, base=store)
                self.seconds[ref] = time.perf_counter() - t0
                after = _registry_blobs(storage_dir)
                self.added[ref] = {k: v for k, v in after.items() if k not in before}


@pytest.fixture(scope="module")
def converted(docker_corpus: Corpus, registry) -> Converted:  # type: ignore[no-untyped-def]
    return Converted(docker_corpus, registry.storage_dir, f"{registry.host}/weenv/")


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def tree_of_dir(root: str) -> dict[str, tuple]:
    """path -> (kind, mode, uid, gid, mtime (non-dirs), size, content sha256 / target / device, xattrs),
    plus the hardlink groups, of an extracted tree (content hashed in pieces: the sparse GiB stays on disk)."""
    out: dict[str, tuple] = {}
    inodes: dict[tuple[int, int], list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            m = st.st_mode
            what: object = None
            if stat.S_ISREG(m):
                what = _sha256_file(p)
                if st.st_nlink > 1:
                    inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
            elif stat.S_ISLNK(m):
                what = os.readlink(p)
            elif stat.S_ISCHR(m) or stat.S_ISBLK(m):
                what = (os.major(st.st_rdev), os.minor(st.st_rdev))
            xattrs = {k: os.getxattr(p, k, follow_symlinks=False) for k in os.listxattr(p, follow_symlinks=False)}
            out[rel] = (stat.S_IFMT(m), stat.S_IMODE(m), st.st_uid, st.st_gid,
                        None if stat.S_ISDIR(m) else int(st.st_mtime), st.st_size if stat.S_ISREG(m) else 0,
                        what, tuple(sorted(xattrs.items())))
    return {"entries": out, "hardlinks": sorted(sorted(g) for g in inodes.values() if len(g) > 1)}  # type: ignore[dict-item]


_TAR_KIND = {tarfile.REGTYPE: stat.S_IFREG, tarfile.AREGTYPE: stat.S_IFREG, tarfile.DIRTYPE: stat.S_IFDIR,
             tarfile.SYMTYPE: stat.S_IFLNK, tarfile.CHRTYPE: stat.S_IFCHR, tarfile.BLKTYPE: stat.S_IFBLK,
             tarfile.FIFOTYPE: stat.S_IFIFO}


def tree_of_tar(stream: io.BufferedIOBase) -> dict[str, tuple]:
    """The same description, read from a tar stream (``docker export``), without extracting it."""
    out: dict[str, tuple] = {}
    groups: dict[str, list[str]] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tf:
        for ti in tf:
            rel = os.path.normpath(ti.name)
            if rel == ".":
                continue
            xattrs = tuple(sorted((k[len("SCHILY.xattr."):], v.encode("utf-8", "surrogateescape"))
                                  for k, v in ti.pax_headers.items() if k.startswith("SCHILY.xattr.")))
            if ti.islnk():
                target = os.path.normpath(ti.linkname)
                out[rel] = out[target]
                groups.setdefault(target, [target]).append(rel)
                continue
            kind = _TAR_KIND[ti.type]
            what: object = None
            if ti.isreg():
                h = hashlib.sha256()
                src = tf.extractfile(ti)
                assert src is not None
                while chunk := src.read(4 << 20):
                    h.update(chunk)
                what = h.hexdigest()
            elif ti.issym():
                what = ti.linkname
            elif ti.ischr() or ti.isblk():
                what = (ti.devmajor, ti.devminor)
            out[rel] = (kind, ti.mode & 0o7777, ti.uid, ti.gid, None if ti.isdir() else int(ti.mtime),
                        ti.size if ti.isreg() else 0, what, xattrs)
    return {"entries": out, "hardlinks": sorted(sorted(g) for g in groups.values())}  # type: ignore[dict-item]


def _from_docker_init(path: str) -> bool:
    return path in INIT_LAYER_PATHS or path.split("/", 1)[0] in ("proc", "sys") or \
        path.startswith(("dev/pts/", "dev/shm/"))


def extract_image(layers: list[R.ConvertedLayer], dest: str) -> str:
    """Apply the image's groups bottom to top as an OCI runtime would: a group's whiteouts remove
    what is below, then GNU tar extracts the group's blob (a plain tar+zstd stream) over it."""
    os.makedirs(dest)
    for x in layers:
        info = x.group
        blob = dest + ".blob"
        with R.open_store(info.registry) as s, open(blob, "wb") as fh:
            for chunk in s.iter_blob(info.repo, info.layer_digest, info.layer_size):
                fh.write(chunk)
        with layerfmt.FileReader.open(blob) as reader:
            entries = layerfmt.Layer.open(reader).entries
        for e in entries:
            parent = os.path.join(dest, os.path.dirname(e.path))
            if e.type == "whiteout":
                gone = os.path.join(parent, os.path.basename(e.path)[len(layerfmt.WHITEOUT_PREFIX):])
                if os.path.isdir(gone) and not os.path.islink(gone):
                    shutil.rmtree(gone)
                elif os.path.lexists(gone):
                    os.unlink(gone)
            elif e.type == "opaque" and os.path.isdir(parent):
                for name in os.listdir(parent):
                    p = os.path.join(parent, name)
                    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        subprocess.run(["tar", "--zstd", "-xpf", blob, "-C", dest, "--numeric-owner", "--xattrs",
                        "--xattrs-include=*", "--exclude=.wh.*"], check=True, capture_output=True)
        os.unlink(blob)
    return dest


# ------------------------------------------------------------------------------------- the corpus


def test_a_corpus_converts_each_shared_layer_once_per_store(converted: Converted, docker_corpus: Corpus,
                                                            dockerd: Dockerd, registry) -> None:  # type: ignore[no-untyped-def]
    c = docker_corpus
    base = converted.images[c.base]
    a1, a2, b1 = (converted.images[t.ref] for t in c.tasks)
    hard_img = converted.images[c.hard]
    # the layers are Docker's: the diff ids its own image store records, bottom first
    for ref, img in converted.images.items():
        assert [x.diff_id for x in img.layers] == c.diff_ids(dockerd, ref), ref
    assert [x.converted for x in base.layers] == [True]
    assert [x.converted for x in a1.layers] == [False, True, True, True]  # env COPY, pip install, repo
    assert [x.converted for x in a2.layers] == [False, False, False, True]  # the same repo at another commit
    assert [x.converted for x in b1.layers] == [False, True, True, True]  # another repo's env
    assert [x.converted for x in hard_img.layers] == [False, True, True, True]
    assert converted.passes == [False] * 11  # every converted layer streamed: Docker's tars need no spool
    assert {x.layers[0].ref for x in converted.images.values()} == {base.layers[0].ref}
    assert [x.ref for x in a2.layers[:3]] == [x.ref for x in a1.layers[:3]]
    assert len({a1.layers[3].ref, a2.layers[3].ref, b1.layers[3].ref}) == 3
    # what reached the registry: exactly the converted layers' blobs and their manifests
    for ref, img in converted.images.items():
        new = [x for x in img.layers if x.converted]
        layer_blobs = {x.group.layer_digest: x.group.layer_size for x in new}
        manifests = {x.group.manifest_digest for x in new}
        added = converted.added[ref]
        assert layer_blobs.items() <= added.items(), ref
        assert set(added) <= set(layer_blobs) | manifests | {EMPTY_DIGEST}, (ref, added)
        assert all(x.bytes_read == 0 for x in img.layers if not x.converted)  # held layers are not downloaded
    uploaded = {ref: sum(v for k, v in added.items() if k in {x.group.layer_digest for x in converted.images[ref].layers})
                for ref, added in converted.added.items()}
    total = {ref: sum(x.group.layer_size for x in img.layers) for ref, img in converted.images.items()}
    print("\nseconds per image conversion:", {ref.rsplit("/", 1)[1]: round(t, 2) for ref, t in converted.seconds.items()})
    print("bytes uploaded per image conversion (of the image's converted size):",
          {ref.rsplit("/", 1)[1]: f"{uploaded[ref]:,} of {total[ref]:,}" for ref in uploaded})
    assert uploaded[c.tasks[1].ref] < 0.001 * total[c.tasks[1].ref]  # the second commit: its repo layer only
    # mmdebstrap writes ./dev before ./: the root still comes first, with its own mode
    with R.open_layer_ref(base.layers[0].ref) as reader:
        first = layerfmt.Layer.open(reader).entries[0]
    assert (first.path, first.type, first.mode) == (".", "dir", 0o755)
    # converting again downloads and uploads nothing
    before = _registry_blobs(registry.storage_dir)
    again = R.convert_image(c.tasks[0].ref, base=converted.store)
    assert again.converted == 0 and all(x.bytes_read == 0 for x in again.layers)
    assert [x.group.manifest_digest for x in again.layers] == [x.group.manifest_digest for x in a1.layers]
    assert _registry_blobs(registry.storage_dir) == before


def test_the_hard_image_converts_to_the_tree_docker_makes(converted: Converted, docker_corpus: Corpus,
                                                          dockerd: Dockerd, tmp_path) -> None:  # type: ignore[no-untyped-def]
    layers = converted.images[docker_corpus.hard].layers
    ours = tree_of_dir(extract_image(layers, str(tmp_path / "tree")))
    export = dockerd.export(docker_corpus.hard)
    assert export.stdout is not None
    docker = tree_of_tar(export.stdout)  # type: ignore[arg-type]
    assert export.wait() == 0, export.stderr.read() if export.stderr else ""
    for tree in (ours, docker):  # what Docker's init layer adds to every container it exports
        for p in [p for p in tree["entries"] if _from_docker_init(p)]:
            del tree["entries"][p]
    eo, ed = ours["entries"], docker["entries"]
    assert len(eo) > 8000  # the whole Debian tree: compared entry by entry below
    assert sorted(set(eo) - set(ed))[:10] == [] and sorted(set(ed) - set(eo))[:10] == []
    diff = [(p, eo[p], ed[p]) for p in eo if eo[p] != ed[p]]
    assert not diff, diff[:5]
    assert ours["hardlinks"] == docker["hardlinks"]
    # and that tree is the hard one (so the comparison above compared something)
    deep = "hard/deep/" + "/".join(DEEP_DIRS) + "/leaf"
    assert len(deep) > 1000 and eo[deep][0] == stat.S_IFREG
    assert eo[f"hard/{LONG_NAME}"][0] == stat.S_IFREG
    assert ["hard/h1", "hard/h3"] in ours["hardlinks"] and "hard/h2" in eo  # h2 keeps the lower inode
    assert not [p for p in eo if p.startswith(("hard/gone", "hard/file-deleted"))]
    assert [p for p in eo if p.startswith("hard/opq/")] == ["hard/opq/new"]  # opaque: "old" is gone
    assert sorted(p for p in eo if p.startswith("hard/later/")) == ["hard/later/new"]
    assert eo["hard/suid"][:4] == (stat.S_IFREG, 0o4755, 0, 0) and eo["hard/sgid"][:4] == (stat.S_IFREG, 0o2711, 1000, 1000)
    assert eo["hard/sparse"][5] == 1 << 30 and eo["hard/null"][0] == stat.S_IFCHR and eo["hard/null"][6] == (1, 3)
    assert eo["hard/fifo"][0] == stat.S_IFIFO and eo["hard/sym"][6] == "../usr/bin/true"
    assert dict(eo["usr/bin/true"][7]) == {"security.capability": CAP_NET_BIND_V2}
    assert dict(eo["hard/suid"][7]) == {}  # Docker keeps no user.* xattr in its layers: neither can we


def test_converted_layers_keep_setuid_capabilities_and_devices_as_the_image_has_them(
        converted: Converted, docker_corpus: Corpus) -> None:
    """The rules in place act when a layer is served, not when it is stored (weenv pull's squashed
    layers are built the same way: see test_a_stream_build_holds_what_the_spooled_build_holds): a layer
    records setuid/setgid bits, ``security.capability`` and device nodes exactly as its source tar has
    them; the envlet serves it nodev, owners and v2 capabilities are mapped into the envs' user
    namespace (weenv/provision/runtime/_idmap.py), and a layer that ships a device node is never made
    into a tree on the host's disk (weenv/envlet/_extract.py). The env side is in
    test_corpus_images_start_through_the_daemon."""
    top = converted.images[docker_corpus.hard].layers[3]
    image = open_image_source(docker_corpus.hard)
    try:
        # Docker pushes gzip; tarfile's own "r|gz" takes ~45 s to skip a GiB of zeros (it re-slices its buffer)
        with image.open_layer(image.layers[3]) as fh, tarfile.open(fileobj=gzip.GzipFile(fileobj=fh), mode="r|") as tf:
            source = {os.path.normpath(ti.name): ti for ti in tf}
    finally:
        image.close()
    kinds = {tarfile.REGTYPE: "file", tarfile.CHRTYPE: "char", tarfile.FIFOTYPE: "fifo"}
    with R.open_layer_ref(top.ref) as reader:
        lay = layerfmt.Layer.open(reader)
        ours = {e.path: e for e in lay.entries}
        assert _first_device(LayerTree(lay.columns)) == "hard/null"  # so no tree: it stays on the nodev mount
    for path in ("hard/suid", "hard/sgid", "hard/null", "usr/bin/true", "hard/fifo"):
        s, o = source[path], ours[path]
        xattrs = {k[len("SCHILY.xattr."):]: v.encode("utf-8", "surrogateescape") for k, v in s.pax_headers.items()
                  if k.startswith("SCHILY.xattr.")}
        assert (o.type, o.mode, o.uid, o.gid, o.devmajor, o.devminor, dict(o.xattrs)) == \
            (kinds[s.type], s.mode & 0o7777, s.uid, s.gid, s.devmajor, s.devminor, xattrs), path
    assert (ours["hard/suid"].mode, ours["hard/sgid"].mode, ours["hard/null"].type, ours["hard/null"].devmajor) == \
        (0o4755, 0o2711, "char", 1)
    assert ours["usr/bin/true"].xattrs == {"security.capability": CAP_NET_BIND_V2}


# ------------------------------------------------------------------------------------- envs


def test_corpus_images_start_through_the_daemon(daemon, docker_corpus: Corpus) -> None:  # type: ignore[no-untyped-def]
    task = docker_corpus.tasks[0]
    with daemon.client() as c:
        env = c.create(task.ref, ttl_s=300)
        try:
            r = env.exec(["python3", "-c", "import six, idna, task; print(six.__version__, idna.__version__, task.REPO)"])
            assert r.exit_code == 0 and r.stdout == b"1.17.0 3.10 repo-a\n", r
            r = env.exec(["sh", "-c", "pwd; echo $TASK; python3 -m task"])
            assert r.stdout.decode() == f"/work/repo\nrepo-a@{task.commit[:12]}\nrepo-a 0\n", r
        finally:
            env.kill()
        env = c.create(docker_corpus.hard, ttl_s=300)
        try:
            script = textwrap.dedent("""\
                import os, stat
                for p in ("/hard/suid", "/hard/sgid"):
                    st = os.stat(p); print(p, oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid)
                st = os.stat("/hard/sparse"); print("sparse", st.st_size)
                with open("/hard/sparse", "rb") as f:
                    f.seek(512 << 20); print("zeros", f.read(4096) == bytes(4096))
                print("opq", sorted(os.listdir("/hard/opq")), "later", sorted(os.listdir("/hard/later")),
                      "gone", os.path.exists("/hard/gone"))
                print("null is", "char" if stat.S_ISCHR(os.lstat("/hard/null").st_mode) else "?")
                try:
                    open("/hard/null", "rb"); print("device opened")
                except OSError as e:
                    print("device refused", e.errno)
                """)
            r = env.exec(["python3", "-c", script])
            assert r.exit_code == 0, r
            out = r.stdout.decode().splitlines()
            assert out[:6] == ["/hard/suid 0o4755 0 0", "/hard/sgid 0o2711 1000 1000", f"sparse {1 << 30}",
                               "zeros True", "opq ['new'] later ['new'] gone False", "null is char"], out
            assert out[6].startswith("device refused"), out  # a shipped device node is inert (nodev)
        finally:
            env.kill()


# ------------------------------------------------------------------------------------- streaming


def _layer_view(blob: bytes) -> dict[str, tuple]:
    lay = layerfmt.Layer.open(layerfmt.BytesReader(blob))
    lay.verify()
    holder = {}
    out = {}
    for e in lay.entries:
        if e.type == "hardlink":
            holder[e.path] = e.link
    for e in lay.entries:
        src = out.get(holder[e.path]) if e.type == "hardlink" else None
        out[e.path] = src if src is not None else (e.type, e.mode, e.uid, e.gid, e.mtime, e.size, e.digest, e.link,
                                                   e.devmajor, e.devminor, tuple(sorted(e.xattrs.items())))
    groups: dict[str, set[str]] = {}
    for p, t in holder.items():
        groups.setdefault(t, {t}).add(p)
    return {"entries": out, "links": sorted(sorted(g) for g in groups.values())}  # type: ignore[dict-item]


STREAM_TREE = (
    d("etc"), f("etc/hosts", b"127.0.0.1 localhost\n"), hard("etc/hosts.link", "etc/hosts"),
    d("usr"), d("usr/bin"), f("usr/bin/tool", b"#!/bin/sh\n" * 300_000, mode=0o4755),  # 3 MB: several chunks
    sym("usr/bin/t", "tool"), fifo("run-fifo"), chardev("null", 1, 3, mode=0o666),
    f("x.attr", b"x", xattrs={"security.capability": CAP_NET_BIND_V2, "user.k": b"v"}),
    d("gone"), f("gone/.wh.file", b""), f(".wh.old", b""), d("opq"), f("opq/.wh..wh..opq", b""), f("opq/new", b"n"),
    d("later", mode=0o700), f("empty", b""),
)


@pytest.mark.parametrize("bottom", [True, False])
def test_a_stream_build_holds_what_the_spooled_build_holds(bottom: bool) -> None:
    tar = make_tar(d("."), *STREAM_TREE)
    entries, spool = layerfmt.scan_tar(io.BytesIO(tar))
    with spool:
        spooled = io.BytesIO()
        layerfmt.build_entries(squash([entries], bottom=bottom), spooled)
    streamed = io.BytesIO()
    seen: list[str] = []
    res = build_tar_stream(io.BytesIO(tar), streamed, drop_whiteouts=bottom, on_entry=lambda e: seen.append(e.path))
    a, b = _layer_view(spooled.getvalue()), _layer_view(streamed.getvalue())
    assert a == b
    assert ("gone/.wh.file" in b["entries"]) is (not bottom) and b["links"] == [["etc/hosts", "etc/hosts.link"]]
    lay = layerfmt.Layer.open(layerfmt.BytesReader(streamed.getvalue()))
    assert [e.path for e in lay.entries] == seen and res.entries == len(seen)  # the tar's order, not sorted
    assert seen[:3] == [".", "etc", "etc/hosts"] and seen.index("usr/bin/tool") < seen.index("gone")


def test_a_late_root_is_moved_first_and_orders_a_single_pass_cannot_write_raise() -> None:
    late_root = make_tar(d("dev"), chardev("dev/null", 1, 3), d(".", mode=0o700), f("a", b"a"))
    lay = layerfmt.Layer.open(layerfmt.BytesReader(_stream(late_root)))
    assert [(e.path, e.mode) for e in lay.entries][:3] == [(".", 0o700), ("dev", 0o755), ("dev/null", 0o644)]
    cases = {
        "comes twice": make_tar(f("a", b"1"), f("a", b"2")),
        "after file contents": make_tar(f("a", b"1"), d(".")),
        "has not come before": make_tar(hard("b", "a"), f("a", b"1")),
        "this layer also has": make_tar(d("x"), f(".wh.x", b"")),
        "after a whiteout of it": make_tar(f(".wh.x", b""), d("x")),
        "opaque directory after whiteouts": make_tar(d("o"), f("o/.wh.y", b""), f("o/.wh..wh..opq", b"")),
    }
    for message, tar in cases.items():
        with pytest.raises(StreamOrderError, match=message):
            _stream(tar)
    # a bottom layer drops its whiteouts: nothing to clash with
    assert "x" in {e.path for e in iter_tar_stream(io.BytesIO(cases["this layer also has"]), drop_whiteouts=True)}
    with pytest.raises(layerfmt.LayerInputError, match="corrupt tar stream"):
        _stream(make_tar(f("a", b"x" * 5000))[:2048])


def _stream(tar: bytes) -> bytes:
    out = io.BytesIO()
    build_tar_stream(io.BytesIO(tar), out)
    return out.getvalue()


def test_a_layer_a_single_pass_cannot_write_is_converted_from_a_spool(weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """GNU tar's --append writes a path twice (the later one wins on extraction); umoci adds that tar
    as a layer verbatim. Conversion reads it a second time, spooled, and keeps the later file."""
    for tool in ("umoci", "tar"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "conf").write_text("first\n")
    layer_tar = tmp_path / "layer.tar"
    subprocess.run(["tar", "--numeric-owner", "-cf", str(layer_tar), "-C", str(src), "."], check=True)
    (src / "etc" / "conf").write_text("second, appended\n")
    subprocess.run(["tar", "--numeric-owner", "-rf", str(layer_tar), "-C", str(src), "./etc/conf"], check=True)
    with pytest.raises(StreamOrderError):
        _stream(layer_tar.read_bytes())
    layout = str(tmp_path / "oci")
    subprocess.run(["umoci", "init", "--layout", layout], check=True)
    subprocess.run(["umoci", "new", "--image", f"{layout}:t"], check=True)
    subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:t", str(layer_tar)], check=True)
    got = R.convert_image(f"oci:{layout}:t")
    assert got.converted == 1
    with R.open_layer_ref(got.layers[0].ref) as reader:
        lay = layerfmt.Layer.open(reader)
        (conf,) = [e for e in lay.entries if e.path == "etc/conf"]
        assert lay.read("etc/conf") == b"second, appended\n", conf


def test_conversion_streams_a_sparse_gigabyte_in_bounded_memory_and_disk(converted: Converted, docker_corpus: Corpus,
                                                                         tmp_path) -> None:
    """The hard image's top layer is a GiB of tar content (the sparse file, as zeros). Converted in a
    child process into a private embedded store, the temp files never hold more than the largest
    converted layer (its blob, written once: a spool of the tar content would add the GiB, and the
    base's 235 MB), and memory stays far below the GiB."""
    home = tmp_path / "home"
    probe = textwrap.dedent(f"""\
        import json, os, sys, threading, time
        import weenv.registry as R
        def hwm_bytes():  # VmHWM: this process's own peak (ru_maxrss carries the forking parent's over exec)
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
        tmp = os.path.join(os.environ["WEENV_HOME"], "tmp")
        peak = [0]
        stop = threading.Event()
        def watch():
            while not stop.is_set():
                used = 0
                for fd in os.listdir("/proc/self/fd"):
                    try:
                        if os.readlink(f"/proc/self/fd/{{fd}}").startswith(tmp):
                            used += os.stat(f"/proc/self/fd/{{fd}}").st_blocks * 512
                    except OSError:
                        pass
                peak[0] = max(peak[0], used)
                time.sleep(0.01)
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        img = R.convert_image({docker_corpus.hard!r})
        stop.set()
        t.join()
        print(json.dumps({{"peak_tmp_bytes": peak[0], "peak_rss_bytes": hwm_bytes(),
                          "converted": img.converted, "read": [x.bytes_read for x in img.layers],
                          "blobs": [x.group.layer_size for x in img.layers]}}))
        """)
    env = {**os.environ, "WEENV_HOME": str(home), "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    print("\nconversion of the hard image:", got)
    assert got["converted"] == 4
    assert got["read"][3] < 2 << 20 and got["blobs"][3] < 1 << 20  # a GiB of zeros: a MiB of gzip, less of zstd
    assert got["peak_tmp_bytes"] <= max(got["blobs"]) + (4 << 20), got
    assert got["peak_rss_bytes"] < 400 << 20, got
