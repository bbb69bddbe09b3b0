"""Importing OCI/Docker images as layer groups (``weenv pull``) and exporting groups as an OCI image.

Import: the image's layers (from a registry, an OCI layout ``oci:DIR[:TAG]`` or a ``docker save``
archive ``docker-archive:FILE``) are read in order and squashed into groups: by default one ``os``
group for the whole image; ``--groups`` maps layer ranges to named groups. Squashing applies each
layer's whiteouts to the layers below it within the group; whiteouts that may hide content of a
lower group are kept as OCI whiteouts (a path re-created after a whiteout becomes an opaque
directory, or simply replaces a file). The image config (Env, WorkingDir, User, Entrypoint, Cmd)
is kept in the ``dev.weenv.image.config`` annotation of every group.

Export: groups (bottom first) become a standard OCI image: our blobs are valid tar+zstd layers
as they are, so they are copied byte for byte; the config gets the diff_ids (sha256 of each
uncompressed tar stream) and the kept image config.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import platform
import re
import tarfile
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import zstandard

from .. import layerfmt
from .._atomic import AtomicFile, atomic_write
from ._errors import ArtifactError, IntegrityError, NotFoundError, RefError, mapped_errors
from ._group import ImageConfig, image_config, open_store, resolve_group_in
from ._oci import (
    ANN_IMAGE_CONFIG,
    ANN_REF_NAME,
    CONFIG_V1,
    DOCKER_LAYER_GZIP,
    DOCKER_LAYER_TAR,
    GROUP_CLASSES,
    INDEX_TYPES,
    INDEX_V1,
    LAYER_TAR,
    LAYER_TAR_GZIP,
    LAYER_TAR_ZSTD,
    MANIFEST_TYPES,
    MANIFEST_V1,
    canonical_json,
    descriptor_json,
    sha256_digest,
)
from ._publish import PublishResult, _tmp_dir, publish_layer_file
from ._ref import Ref, check_digest, parse_ref
from ._store import Store

PullProgress = Callable[[str, int, int], None]
"""``progress(label, done, total)``: label is e.g. ``"layer 2/7"``; done/total in bytes."""

_LAYER_TYPES = (LAYER_TAR, LAYER_TAR_GZIP, LAYER_TAR_ZSTD, DOCKER_LAYER_GZIP, DOCKER_LAYER_TAR,
                "application/vnd.docker.image.rootfs.diff.tar.zstd")
_WH = layerfmt.WHITEOUT_PREFIX


# ------------------------------------------------------------------------------------ sources


@dataclass
class LayerRef:
    digest: str
    size: int
    media_type: str


class ImageSource:
    """An image to import: its layers (bottom first), config and a way to stream each layer."""

    name: str  # suggested local name (repo[:tag])
    description: str  # what `org.opencontainers.image.source` records
    layers: list[LayerRef]
    config: dict[str, Any]
    config_digest: str = ""  # the manifest's config descriptor's digest, where there is one

    def open_layer(self, layer: LayerRef) -> BinaryIO:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _platform_arch() -> str:
    m = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(m, m)


def _pick_platform(index: dict[str, Any], where: str) -> dict[str, Any]:
    manifests = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
    arch = _platform_arch()
    for m in manifests:
        p = m.get("platform") or {}
        if p.get("os", "linux") == "linux" and p.get("architecture") == arch:
            return m
    real = [m for m in manifests if (m.get("platform") or {}).get("os") != "unknown"]  # skip attestations
    if len(real) == 1:
        return real[0]
    raise ArtifactError(f"{where}: image index has no linux/{arch} manifest")


def _layers_from_manifest(m: dict[str, Any], where: str) -> list[LayerRef]:
    out = []
    for i, d in enumerate(m.get("layers") or []):
        mt = d.get("mediaType", "")
        if mt not in _LAYER_TYPES:
            raise ArtifactError(f"{where}: layer {i} has unsupported media type {mt!r}")
        out.append(LayerRef(check_digest(str(d["digest"])), int(d["size"]), mt))
    return out


class _StoreStream(io.RawIOBase):
    """A blob of a store as a sequential stream (ranged reads: bounded memory, retried pieces)."""

    def __init__(self, store: Store, repo: str, layer: LayerRef):
        self._it = store.iter_blob(repo, layer.digest, layer.size, 4 << 20)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if not self._buf:
            self._buf = next(self._it, b"")
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


CONFIG_CACHE_ENTRIES = 256
CONFIG_CACHE_MAX_BLOB_BYTES = 1 << 20
_configs: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
_configs_lock = threading.Lock()


def _config_blob(store: Store, ref: Ref, digest: str, size: int, where: str) -> bytes:
    """An image's config blob, checked against its digest, and kept in this process (the last
    :data:`CONFIG_CACHE_ENTRIES`, per registry, repository and digest) for the next source of that
    image: the manifest is read afresh every time, so a tag that moved names another digest and is
    read anew. Every Docker API create of an image opens two sources (serve's config read, the
    daemon's ``lock_for_image``): one round trip each fewer."""
    key = (ref.registry or "", ref.repo, digest)
    with _configs_lock:
        raw = _configs.get(key)
        if raw is not None:
            _configs.move_to_end(key)
            return raw
    raw = b"".join(store.iter_blob(ref.repo, digest, size))
    if sha256_digest(raw) != digest:
        raise IntegrityError(f"{where}: config blob does not match {digest}")
    if len(raw) <= CONFIG_CACHE_MAX_BLOB_BYTES:
        with _configs_lock:
            _configs[key] = raw
            while len(_configs) > CONFIG_CACHE_ENTRIES:
                _configs.popitem(last=False)
    return raw


class StoreImageSource(ImageSource):
    def __init__(self, ref: Ref):
        self.ref = ref
        self.store = open_store(ref.registry)
        where = str(ref)
        data, mt = self.store.get_manifest(ref.repo, ref.reference)
        m = json.loads(data)
        if m.get("mediaType", mt) in INDEX_TYPES or "manifests" in m:
            chosen = _pick_platform(m, where)
            data, mt = self.store.get_manifest(ref.repo, chosen["digest"])
            m = json.loads(data)
        if m.get("mediaType", mt) not in MANIFEST_TYPES:
            raise ArtifactError(f"{where}: unsupported manifest media type {m.get('mediaType', mt)!r}")
        self.layers = _layers_from_manifest(m, where)
        cfg = m.get("config") or {}
        self.config = {}
        if cfg.get("digest") and int(cfg.get("size", 0)) > 0:
            raw = _config_blob(self.store, ref, str(cfg["digest"]), int(cfg["size"]), where)
            self.config_digest = cfg["digest"]
            try:
                self.config = json.loads(raw)
            except ValueError:
                self.config = {}  # artifacts (empty config) import as plain trees
        self.name = f"{ref.repo.rsplit('/', 1)[-1]}:{ref.tag or 'latest'}"
        self.description = str(ref)

    def open_layer(self, layer: LayerRef) -> BinaryIO:
        return io.BufferedReader(_StoreStream(self.store, self.ref.repo, layer), 1 << 20)

    def close(self) -> None:
        self.store.close()


class OciDirSource(ImageSource):
    """``oci:DIR[:TAG]``: a standard OCI image layout (skopeo, umoci, buildah write these)."""

    def __init__(self, spec: str):
        rest = spec[len("oci:"):]
        path, tag = rest, None
        if ":" in rest and not os.path.isdir(rest):
            path, tag = rest.rsplit(":", 1)
        self.root = path
        where = f"oci:{path}"
        try:
            with open(os.path.join(path, "index.json"), "rb") as f:
                index = json.load(f)
        except FileNotFoundError:
            raise NotFoundError(f"{where}: no index.json (not an OCI image layout)") from None
        except ValueError as e:
            raise ArtifactError(f"{where}: index.json is not JSON: {e}") from None
        entries = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
        if tag is not None:
            entries = [m for m in entries if (m.get("annotations") or {}).get(ANN_REF_NAME) == tag]
            if not entries:
                raise NotFoundError(f"{where}: no manifest tagged {tag!r} in index.json")
        if len(entries) != 1:
            raise ArtifactError(f"{where}: index.json has {len(entries)} manifests; name one as oci:DIR:TAG")
        m = self._json(entries[0]["digest"])
        if m.get("mediaType", entries[0].get("mediaType")) in INDEX_TYPES or "manifests" in m:
            m = self._json(_pick_platform(m, where)["digest"])
        self.layers = _layers_from_manifest(m, where)
        cfg = m.get("config") or {}
        self.config = self._json(cfg["digest"]) if cfg.get("digest") else {}
        self.name = f"{os.path.basename(os.path.normpath(path)) or 'image'}:{tag or 'latest'}"
        self.description = f"oci:{os.path.abspath(path)}" + (f":{tag}" if tag else "")

    def _blob_path(self, digest: str) -> str:
        alg, _, hexd = digest.partition(":")
        if not re.fullmatch(r"[a-z0-9]+", alg) or not re.fullmatch(r"[0-9a-f]+", hexd):
            raise ArtifactError(f"oci:{self.root}: bad digest {digest!r}")
        return os.path.join(self.root, "blobs", alg, hexd)

    def _json(self, digest: str) -> dict[str, Any]:
        try:
            with open(self._blob_path(digest), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise NotFoundError(f"oci:{self.root}: missing blob {digest}") from None
        if sha256_digest(data) != digest:
            raise IntegrityError(f"oci:{self.root}: blob {digest} does not match its digest")
        return json.loads(data)

    def open_layer(self, layer: LayerRef) -> BinaryIO:
        try:
            return open(self._blob_path(layer.digest), "rb")
        except FileNotFoundError:
            raise NotFoundError(f"oci:{self.root}: missing layer blob {layer.digest}") from None


class DockerArchiveSource(ImageSource):
    """``docker-archive:FILE``: the tar written by ``docker save`` (manifest.json + config + layers)."""

    def __init__(self, spec: str):
        self.path = spec[len("docker-archive:"):]
        where = f"docker-archive:{self.path}"
        try:
            self.tar = tarfile.open(self.path, "r:")
        except FileNotFoundError:
            raise NotFoundError(f"{where}: no such file") from None
        except tarfile.TarError as e:
            raise ArtifactError(f"{where}: not a tar archive: {e}") from None
        try:
            manifest = json.loads(self._read("manifest.json"))
        except KeyError:
            raise ArtifactError(f"{where}: no manifest.json (not a docker save archive)") from None
        if not isinstance(manifest, list) or len(manifest) != 1:
            raise ArtifactError(f"{where}: manifest.json must describe exactly one image")
        entry = manifest[0]
        self.config = json.loads(self._read(entry["Config"]))
        self._members = list(entry["Layers"])
        self.layers = []
        for name in self._members:
            info = self.tar.getmember(name)
            self.layers.append(LayerRef("sha256:" + "0" * 64, info.size, DOCKER_LAYER_TAR))
        tags = entry.get("RepoTags") or []
        base = tags[0].rsplit("/", 1)[-1] if tags else os.path.basename(self.path).split(".")[0] + ":latest"
        self.name = base if ":" in base else base + ":latest"
        self.description = f"docker-archive:{os.path.abspath(self.path)}"

    def _read(self, name: str) -> bytes:
        f = self.tar.extractfile(name)
        if f is None:
            raise KeyError(name)
        return f.read()

    def open_layer(self, layer: LayerRef) -> BinaryIO:
        f = self.tar.extractfile(self._members[self.layers.index(layer)])
        assert f is not None
        return f  # type: ignore[return-value]

    def close(self) -> None:
        self.tar.close()


def open_image_source(image: str) -> ImageSource:
    if image.startswith("oci:"):
        return OciDirSource(image)
    if image.startswith("docker-archive:"):
        return DockerArchiveSource(image)
    if image.startswith("docker://"):
        image = image[len("docker://"):]
    return StoreImageSource(parse_ref(image))


# ------------------------------------------------------------------------------------ groups


@dataclass(frozen=True)
class GroupSpec:
    name: str
    group_class: str
    first: int  # layer index, inclusive
    last: int  # inclusive


_SPEC = re.compile(r"^([a-z0-9][a-z0-9._-]*)(?::([a-z]+))?=(\d+)?(?:(-)(\d+)?)?$")


def parse_groups_spec(spec: str | None, n_layers: int) -> list[GroupSpec]:
    """``os=0-3,toolchain=4-5,harness=6-`` (0-based, inclusive) → group specs covering every layer in order.

    ``NAME:CLASS=…`` sets the class; otherwise it is NAME when NAME is a class, else ``os`` for the
    first group and ``toolchain`` after it.
    """
    if n_layers == 0:
        raise ArtifactError("the image has no layers")
    if not spec:
        return [GroupSpec("os", "os", 0, n_layers - 1)]
    out: list[GroupSpec] = []
    expected = 0
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        m = _SPEC.match(part)
        if not m:
            raise RefError(f"--groups: cannot parse {part!r} (use NAME[:CLASS]=FIRST-LAST, e.g. os=0-3,harness=4-)")
        name, cls, a, dash, b = m.groups()
        first = int(a) if a is not None else expected
        last = (int(b) if b is not None else n_layers - 1) if dash else first
        if first != expected:
            raise RefError(f"--groups: {part!r} starts at layer {first}, expected {expected} (ranges must cover every layer in order)")
        if last < first or last >= n_layers:
            raise RefError(f"--groups: {part!r} is outside layers 0-{n_layers - 1}")
        cls = cls or (name if name in GROUP_CLASSES else ("os" if not out else "toolchain"))
        if cls not in GROUP_CLASSES:
            raise RefError(f"--groups: unknown class {cls!r} in {part!r}; use one of {', '.join(GROUP_CLASSES)}")
        if any(g.name == name for g in out):
            raise RefError(f"--groups: group {name!r} named twice")
        out.append(GroupSpec(name, cls, first, last))
        expected = last + 1
    if expected != n_layers:
        raise RefError(f"--groups: layers {expected}-{n_layers - 1} are not in any group")
    return out


# ------------------------------------------------------------------------------------ squash


def _parent(path: str) -> str:
    return path.rpartition("/")[0] if "/" in path else "."


def _join(parent: str, name: str) -> str:
    return name if parent == "." else f"{parent}/{name}"


def _drop_below(merged: dict[str, layerfmt.SourceEntry], path: str, *, include_self: bool) -> None:
    prefix = "" if path == "." else path + "/"
    for p in [p for p in merged if (p.startswith(prefix) and p != path) or (include_self and p == path)]:
        if p != ".":
            del merged[p]


def squash(layers: list[list[layerfmt.SourceEntry]], *, bottom: bool) -> list[layerfmt.SourceEntry]:
    """Merge tar layers (bottom first) into one tree, applying whiteouts as extraction would.

    With ``bottom`` false the result keeps whiteouts and opaque markers that may hide content of
    lower groups.
    """
    merged: dict[str, layerfmt.SourceEntry] = {}
    for idx, entries in enumerate(layers):
        for e in entries:
            if e.link_key is not None:
                e.link_key = (idx, e.link_key)  # hardlink identity is per layer
        for e in entries:
            if e.type == "whiteout":
                parent, name = _parent(e.path), e.path.rpartition("/")[2]
                _drop_below(merged, _join(parent, name[len(_WH):]), include_self=True)
                merged[e.path] = e
            elif e.type == "opaque":
                _drop_below(merged, _parent(e.path), include_self=False)
                merged[e.path] = e
        for e in entries:
            if e.type in ("whiteout", "opaque"):
                continue
            old = merged.get(e.path)
            if old is not None and old.type == "dir" and e.type != "dir":
                _drop_below(merged, e.path, include_self=False)
            wh = _join(_parent(e.path), _WH + e.path.rpartition("/")[2]) if e.path != "." else None
            if wh is not None and wh in merged:
                del merged[wh]  # re-created after a whiteout: present again
                if e.type == "dir":
                    opq = _join(e.path, layerfmt.OPAQUE_NAME)
                    merged[opq] = layerfmt.SourceEntry(opq, "opaque", mode=0, mtime=e.mtime)
            merged[e.path] = e
    out = list(merged.values())
    if bottom:
        out = [e for e in out if e.type not in ("whiteout", "opaque")]
    return out


# ------------------------------------------------------------------------------------ pull


@dataclass(frozen=True)
class PulledGroup:
    ref: str
    group: str
    group_class: str
    layers: tuple[int, int]
    result: PublishResult


@dataclass(frozen=True)
class PullResult:
    image: str
    groups: list[PulledGroup]
    config: ImageConfig


class _HashingReader(io.RawIOBase):
    def __init__(self, f: BinaryIO, on_bytes: Callable[[int], None] | None):
        self._f, self._on = f, on_bytes
        self.hash = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        self.hash.update(data)
        self.count += n
        if self._on and n:
            self._on(n)
        return n

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def _group_refs(name: str, groups: list[GroupSpec]) -> list[str]:
    r = parse_ref(name)
    if r.digest:
        raise RefError(f"--name needs a tag, not a digest: {name}")
    if len(groups) == 1:
        return [str(r)]
    return [str(Ref(r.registry, f"{r.repo}/{g.name}", r.tag)) for g in groups]


def pull(
    image: str,
    *,
    name: str | None = None,
    groups: str | None = None,
    progress: PullProgress | None = None,
) -> PullResult:
    """Import ``image`` (registry REF, ``oci:DIR[:TAG]`` or ``docker-archive:FILE``) as layer groups.

    With one group the group is stored at ``name`` (default: the image's name in the embedded
    store); with several, group G is stored at ``<name repo>/G:<tag>``.
    """
    with ExitStack() as stack:
        with mapped_errors(f"open image {image}"):
            src = open_image_source(image)
        stack.callback(src.close)
        specs = parse_groups_spec(groups, len(src.layers))
        refs = _group_refs(name or src.name, specs)
        cfg = ImageConfig.from_oci(src.config.get("config") if isinstance(src.config, dict) else None)
        diff_ids = (src.config.get("rootfs") or {}).get("diff_ids") if isinstance(src.config, dict) else None
        tmp = _tmp_dir()
        results = []
        for spec, ref in zip(specs, refs):
            layer_entries = []
            with ExitStack() as spools:
                for i in range(spec.first, spec.last + 1):
                    layer = src.layers[i]
                    label = f"layer {i + 1}/{len(src.layers)}"
                    done = [0]

                    def on_bytes(n: int, label: str = label, total: int = layer.size) -> None:
                        done[0] += n
                        if progress:
                            progress(label, done[0], total)

                    with mapped_errors(f"{image}: read {label}"):
                        f = src.open_layer(layer)
                        with f:
                            hashing = _HashingReader(f, on_bytes)
                            buffered = io.BufferedReader(hashing, 1 << 20)
                            try:
                                entries, spool = layerfmt.scan_tar(buffered, spool_dir=tmp)  # type: ignore[arg-type]
                            except layerfmt.LayerError as e:
                                raise ArtifactError(f"{image}: {label} is not a usable tar layer: {e}") from None
                            spools.enter_context(spool)
                            while buffered.read(1 << 20):
                                pass
                    got = "sha256:" + hashing.hash.hexdigest()
                    if not isinstance(src, DockerArchiveSource) and got != layer.digest:
                        raise IntegrityError(f"{image}: {label} hashes to {got}, manifest says {layer.digest}")
                    if progress:
                        progress(label, layer.size, layer.size)
                    layer_entries.append(entries)
                tree = squash(layer_entries, bottom=spec.first == 0)
                fd, out_path = tempfile.mkstemp(prefix="weenv-pull-", suffix=".layer", dir=tmp)
                try:
                    with os.fdopen(fd, "wb") as out:
                        try:
                            built = layerfmt.build_entries(tree, out)
                        except layerfmt.LayerError as e:
                            raise ArtifactError(f"{image}: layers {spec.first}-{spec.last} cannot form a layer: {e}") from None
                    ann = {ANN_IMAGE_CONFIG: cfg.to_annotation(), "dev.weenv.import.layers": f"{spec.first}-{spec.last}"}
                    if isinstance(diff_ids, list) and len(diff_ids) == len(src.layers):
                        ann["dev.weenv.import.diff_ids"] = ",".join(diff_ids[spec.first : spec.last + 1])
                    res = publish_layer_file(out_path, ref, group=spec.name, group_class=spec.group_class,
                                             source=src.description, annotations=ann, digest=built.digest)
                finally:
                    os.unlink(out_path)
            results.append(PulledGroup(ref, spec.name, spec.group_class, (spec.first, spec.last), res))
        return PullResult(image, results, cfg)


# ------------------------------------------------------------------------------------ export


@dataclass(frozen=True)
class ExportResult:
    oci_dir: str
    tag: str
    manifest_digest: str
    config_digest: str
    layers: list[str] = field(default_factory=list)  # layer digests, bottom first


class _IterStream(io.RawIOBase):
    """A read-only stream over an iterator of byte chunks."""

    def __init__(self, chunks: Iterator[bytes]):
        self._it, self._buf = chunks, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            nxt = next(self._it, None)
            if nxt is None:
                return 0
            self._buf = memoryview(nxt)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _diff_id(chunks: Iterator[bytes], tar_sink: Callable[[bytes], object] | None = None) -> str:
    """sha256 of the uncompressed tar stream (skippable frames, our TOC and footer, add nothing).

    ``tar_sink`` also receives the tar bytes (to recompress them).
    """
    h = hashlib.sha256()
    src = io.BufferedReader(_IterStream(chunks), 4 << 20)
    reader = zstandard.ZstdDecompressor().stream_reader(src, read_across_frames=True, read_size=1 << 20)
    try:
        while True:
            out = reader.read(4 << 20)
            if not out:
                break
            h.update(out)
            if tar_sink is not None:
                tar_sink(out)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"layer is not a zstd stream: {e}") from None
    return "sha256:" + h.hexdigest()


class _HashingWriter:
    def __init__(self, f: BinaryIO):
        self.f, self.hash, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _export_layer(store: Store, r: Ref, info: Any, blobs: str, compression: str,
                  on_bytes: Callable[[int], None]) -> tuple[dict[str, Any], str]:
    """Copy (zstd) or transcode (gzip) one group's layer into ``blobs``; return its descriptor and diff_id."""
    import gzip

    chunks = store.iter_blob(r.repo, info.layer_digest, info.layer_size)
    final = os.path.join(blobs, info.layer_digest.split(":", 1)[1])
    ann = {layerfmt.TOC_DIGEST_ANNOTATION: info.toc_digest}
    # the name is the digest of what is written (a gzip transcode has its own): chosen at commit
    with AtomicFile(final, mode=None, fsync=False) as out:
        hw = _HashingWriter(out.file)
        src_hash = hashlib.sha256()

        def counted() -> Iterator[bytes]:
            for c in chunks:
                src_hash.update(c)
                on_bytes(len(c))
                yield c

        if compression == "zstd":
            def tee() -> Iterator[bytes]:
                for c in counted():
                    hw.write(c)
                    yield c

            diff_id = _diff_id(tee())
        else:
            # mtime=0 and no file name: the same tree always gives the same gzip bytes; level 1: this is a
            # compatibility path where speed matters more than size
            with gzip.GzipFile(filename="", mode="wb", fileobj=hw, compresslevel=1, mtime=0) as gz:  # type: ignore[arg-type]
                diff_id = _diff_id(counted(), gz.write)
        if "sha256:" + src_hash.hexdigest() != info.layer_digest:
            raise IntegrityError(f"{r}: layer bytes do not match {info.layer_digest}")
        digest = "sha256:" + hw.hash.hexdigest()
        out.commit(os.path.join(blobs, digest.split(":", 1)[1]))
    media_type = LAYER_TAR_ZSTD if compression == "zstd" else LAYER_TAR_GZIP
    return descriptor_json(media_type, digest, hw.size, ann if compression == "zstd" else None), diff_id


EXPORT_COMPRESSIONS = ("zstd", "gzip")


def export_oci(refs: list[str], oci_dir: str, *, tag: str = "latest", config: ImageConfig | None = None,
               compression: str = "zstd", progress: PullProgress | None = None) -> ExportResult:
    """Write groups ``refs`` (bottom first) as one OCI image tagged ``tag`` in layout ``oci_dir``.

    ``zstd`` copies our blobs as they are (tar+zstd layers, TOC annotations kept); ``gzip``
    recompresses the same tar streams for tools without zstd support (Debian 12's umoci 0.4.7).
    """
    if not refs:
        raise RefError("export needs at least one group")
    if compression not in EXPORT_COMPRESSIONS:
        raise RefError(f"unknown layer compression {compression!r}; use zstd or gzip")
    blobs = os.path.join(oci_dir, "blobs", "sha256")
    with mapped_errors(f"export to {oci_dir}"):
        os.makedirs(blobs, exist_ok=True)
        layers, diff_ids, history = [], [], []
        top_config = ImageConfig()
        for i, ref in enumerate(refs):
            r = parse_ref(ref)
            store = open_store(r.registry)
            try:
                info = resolve_group_in(store, r)
                label = f"group {i + 1}/{len(refs)}"
                done = [0]

                def on_bytes(n: int, label: str = label, total: int = info.layer_size) -> None:
                    done[0] += n
                    if progress:
                        progress(label, done[0], total)

                desc, diff_id = _export_layer(store, r, info, blobs, compression, on_bytes)
                layers.append(desc)
                diff_ids.append(diff_id)
                kept = image_config(str(r.with_digest(info.manifest_digest)))
                if kept != ImageConfig():
                    top_config = kept  # the topmost group that carries an image config wins
                history.append({"created_by": f"weenv group {info.group} ({info.group_class}) from {ref}"})
            finally:
                store.close()
        chosen = config if config is not None else top_config
        img_cfg: dict[str, Any] = {}
        if chosen.env:
            img_cfg["Env"] = chosen.env
        if chosen.working_dir:
            img_cfg["WorkingDir"] = chosen.working_dir
        if chosen.user:
            img_cfg["User"] = chosen.user
        if chosen.entrypoint:
            img_cfg["Entrypoint"] = chosen.entrypoint
        if chosen.cmd:
            img_cfg["Cmd"] = chosen.cmd
        created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        config_doc = {
            "created": created, "architecture": _platform_arch(), "os": "linux", "config": img_cfg,
            "rootfs": {"type": "layers", "diff_ids": diff_ids}, "history": history,
        }
        config_bytes = canonical_json(config_doc)
        config_digest = sha256_digest(config_bytes)
        atomic_write(os.path.join(blobs, config_digest.split(":", 1)[1]), config_bytes, mode=None, fsync=False)
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_V1,
                    "config": descriptor_json(CONFIG_V1, config_digest, len(config_bytes)), "layers": layers}
        manifest_bytes = canonical_json(manifest)
        manifest_digest = sha256_digest(manifest_bytes)
        atomic_write(os.path.join(blobs, manifest_digest.split(":", 1)[1]), manifest_bytes, mode=None, fsync=False)
        index_path = os.path.join(oci_dir, "index.json")
        entries: list[dict[str, Any]] = []
        if os.path.exists(index_path):
            with open(index_path, "rb") as f:
                old = json.load(f)
            entries = [m for m in old.get("manifests") or []
                       if (m.get("annotations") or {}).get(ANN_REF_NAME) != tag]
        entries.append(descriptor_json(MANIFEST_V1, manifest_digest, len(manifest_bytes), {ANN_REF_NAME: tag}))
        atomic_write(index_path, json.dumps({"schemaVersion": 2, "mediaType": INDEX_V1, "manifests": entries},
                                            indent=1).encode(), mode=None, fsync=False)
        atomic_write(os.path.join(oci_dir, "oci-layout"), b'{"imageLayoutVersion":"1.0.0"}', mode=None, fsync=False)
    return ExportResult(oci_dir, tag, manifest_digest, config_digest, [d["digest"] for d in layers])

