"""OCI and Docker images as weenv layer groups, one group per image layer, converted once per store.

An image is a stack of layers, and images made from the same base share the base's layers byte
for byte (the same *diff id*: the sha256 of the uncompressed layer tar, in the image config's
``rootfs.diff_ids``). So each layer is converted on its own, into a weenv group whose tag is its
diff id (``<base>oci-layers:sha256-<hex>`` in the store the conversion writes to: the embedded
store, or a registry the cluster's nodes read). Before a layer is downloaded, that tag is looked
up: a base layer that 2,000 task images share is converted and uploaded once per store, and no
node converts what another already put there. Whiteouts and opaque directories of a layer stay
OCI whiteouts in its group (the overlay of the groups applies them, as the image's own overlay
would); the bottom layer's are dropped (nothing is below it).

Squashing an image into fewer groups (``weenv pull --groups``, weenv/registry/_image.py) is an
explicit choice: it makes groups no other image shares.

:func:`image_lock` turns a converted image into a lock: one group per layer (classes ``os`` for
all but a named split), with the image config as the plan's defaults (env, workdir, user).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import threading
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import zstandard

from .. import layerfmt
from ..layerfmt._build import build_tar_stream
from ..layerfmt._errors import StreamOrderError
from ._errors import ArtifactError, IntegrityError, NotFoundError, RefError, mapped_errors
from ._group import GroupInfo, ImageConfig, open_store, resolve_group_in
from ._image import DockerArchiveSource, ImageSource, LayerRef, _HashingReader, open_image_source, squash
from ._oci import ANN_IMAGE_CONFIG
from ._publish import _tmp_dir, publish_layer_file
from ._ref import parse_ref
from ._store import Store

__all__ = ["ConvertedImage", "ConvertedLayer", "LAYER_REPO", "convert_image", "converted_ref", "image_lock",
           "is_image_ref", "lock_for_image", "plan_name_for"]

LAYER_REPO = "oci-layers"
ANN_DIFF_ID = "dev.weenv.import.diff_id"
ANN_SOURCE_IMAGE = "dev.weenv.import.image"

Progress = Callable[[str, int, int], None]
"""``progress(label, done, total)`` in bytes; label e.g. ``"layer 2/7"``."""


@dataclass(frozen=True)
class ConvertedLayer:
    index: int
    diff_id: str
    ref: str
    """Where its group is: ``[registry/]repo:sha256-<hex>``."""
    group: GroupInfo
    converted: bool
    """False: the store had it already (converted by this or another node, from any image)."""
    bytes_read: int = 0


@dataclass(frozen=True)
class ConvertedImage:
    image: str
    layers: list[ConvertedLayer]
    config: ImageConfig
    raw_config: dict[str, Any] = field(default_factory=dict)

    @property
    def converted(self) -> int:
        return sum(1 for x in self.layers if x.converted)


def converted_ref(diff_id: str, base: str = "") -> str:
    """The tag layer ``diff_id`` is kept at. ``base``: ``host[:port]/prefix/`` of a registry (the
    cluster's store), or ``""`` for the embedded store."""
    alg, _, hexd = diff_id.partition(":")
    if alg != "sha256" or len(hexd) != 64:
        raise ArtifactError(f"not a layer diff id: {diff_id!r}")
    return f"{base}{LAYER_REPO}:sha256-{hexd}"


def _lookup(store: Store, ref: str) -> GroupInfo | None:
    try:
        return resolve_group_in(store, parse_ref(ref))
    except NotFoundError:
        return None


class _Gunzip:
    """gzip members one after another (zero padding between them allowed, as gzip(1) does), read in
    pieces of at most ``n`` bytes whatever the ratio (a GiB of zeros is a MiB of gzip). zlib's own
    decompressor: :mod:`gzip` adds a buffer and a Python-side CRC to it, and the sha256 of the result
    is checked against the diff id anyway."""

    def __init__(self, src: io.BufferedReader, piece: int):
        self._src, self._piece = src, piece
        self._d: Any = None
        self._in = b""
        self._capped = False  # the last call stopped at its limit: zlib may hold more output

    def read(self, n: int) -> bytes:
        while True:
            if not self._in and not self._capped:
                self._in = self._src.read(self._piece)
                if not self._in:
                    if self._d is not None:
                        raise EOFError("the gzip stream ends inside a member")
                    return b""
            if self._d is None:
                self._in = self._in.lstrip(b"\0")
                if not self._in:
                    continue
                self._d = zlib.decompressobj(31)
            out = self._d.decompress(self._in, n)
            self._capped = len(out) == n
            if self._d.eof:
                self._in, self._d, self._capped = self._d.unused_data, None, False  # the next member
            else:
                self._in = self._d.unconsumed_tail
            if out:
                return out


class _LayerStream(io.RawIOBase):
    """A layer blob read as its uncompressed tar stream, in one pass: the blob's bytes go into its
    sha256 (:class:`~._image._HashingReader`), are decompressed by their first bytes (gzip, zstd frames, or a plain tar
    as it is) in pieces of at most ``piece`` bytes, and the result goes into the diff id's sha256."""

    def __init__(self, f: BinaryIO, on_blob: Callable[[int], None] | None, *, piece: int = 1 << 20):
        self.blob = _HashingReader(f, on_blob)
        self.tar_sha = hashlib.sha256()
        self._piece = piece
        src = io.BufferedReader(self.blob, piece)
        head = src.peek(4)[:4]
        if head[:2] == b"\x1f\x8b":
            self._read: Callable[[int], bytes] = _Gunzip(src, piece).read
        elif head == b"\x28\xb5\x2f\xfd":
            self._read = zstandard.ZstdDecompressor().stream_reader(src, read_size=piece, read_across_frames=True).read
        else:
            self._read = src.read
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if not self._out:
            out = self._read(self._piece)
            if not out:
                return 0
            self.tar_sha.update(out)
            self._out = memoryview(out)
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def finish(self) -> None:
        """Read what the tar reader left: the digests cover the whole stream and the whole blob."""
        self._out = memoryview(b"")
        while out := self._read(self._piece):
            self.tar_sha.update(out)
        while self.blob.read(self._piece):
            pass


def _diff_ids(src: ImageSource) -> list[str | None]:
    ids = (src.config.get("rootfs") or {}).get("diff_ids") if isinstance(src.config, dict) else None
    if isinstance(ids, list) and len(ids) == len(src.layers) and all(isinstance(x, str) for x in ids):
        return list(ids)
    return [None] * len(src.layers)


def _convert_one(src: ImageSource, i: int, layer: LayerRef, image: str, store: Store, base: str, cfg: ImageConfig,
                 progress: Progress | None) -> tuple[str, str, GroupInfo, int]:
    """Read layer ``i`` once (its blob digest checked, its diff id computed), build its group and
    publish it at its diff id's tag. Returns (diff id, ref, group, bytes read).

    The layer streams: download, decompression and the build are one pass, in the tar's own order,
    and the group's blob is the only copy on disk (a temp file, published from there). A tar that a
    single pass cannot write in its order (:class:`~weenv.layerfmt._errors.StreamOrderError`, which
    no mainstream builder produces) is read a second time with its files spooled to disk."""
    where = f"{image}: layer {i + 1}/{len(src.layers)}"
    try:
        return _convert_pass(src, i, layer, where, store, base, cfg, progress, spooled=False)
    except StreamOrderError:
        return _convert_pass(src, i, layer, where, store, base, cfg, progress, spooled=True)


def _convert_pass(src: ImageSource, i: int, layer: LayerRef, where: str, store: Store, base: str, cfg: ImageConfig,
                  progress: Progress | None, *, spooled: bool) -> tuple[str, str, GroupInfo, int]:
    label = where.rpartition(": ")[2]
    tmp = _tmp_dir()
    done = [0]

    def on_blob(n: int) -> None:
        done[0] += n
        if progress:
            progress(label, done[0], layer.size)

    fd, out_path = tempfile.mkstemp(prefix="weenv-convert-", suffix=".layer", dir=tmp)
    try:
        tree: list[layerfmt.SourceEntry] = []
        with ExitStack() as stack, mapped_errors(f"{where}: read"):
            f = stack.enter_context(src.open_layer(layer))
            tar = _LayerStream(f, on_blob)
            tar_stream: Any = io.BufferedReader(tar, 1 << 20)
            with os.fdopen(fd, "wb") as out:
                try:
                    if spooled:
                        entries, spool = layerfmt.scan_tar(tar_stream, spool_dir=tmp)
                        stack.enter_context(spool)
                        tree = squash([entries], bottom=i == 0)
                        built = layerfmt.build_entries(tree, out)
                    else:
                        built = build_tar_stream(tar_stream, out, drop_whiteouts=i == 0, on_entry=tree.append)
                except StreamOrderError:
                    raise
                except layerfmt.LayerError as e:
                    raise ArtifactError(f"{where} is not a usable tar layer: {e}") from None
                except (EOFError, zlib.error, zstandard.ZstdError) as e:
                    raise ArtifactError(f"{where} does not decompress: {e}") from None
            try:
                tar.finish()
            except (EOFError, zlib.error, zstandard.ZstdError) as e:
                raise ArtifactError(f"{where} does not decompress: {e}") from None
        blob_digest = "sha256:" + tar.blob.hash.hexdigest()
        if not isinstance(src, DockerArchiveSource) and blob_digest != layer.digest:
            raise IntegrityError(f"{where} hashes to {blob_digest}, the manifest says {layer.digest}")
        diff_id = "sha256:" + tar.tar_sha.hexdigest()
        ref = converted_ref(diff_id, base)
        held = _lookup(store, ref)  # converted meanwhile (another pull of an image with this layer)
        if held is not None:
            return diff_id, ref, held, tar.blob.count
        _verify(tree, out_path, where)
        del tree
        ann = {ANN_DIFF_ID: diff_id, ANN_SOURCE_IMAGE: src.description, ANN_IMAGE_CONFIG: cfg.to_annotation()}
        pub = publish_layer_file(out_path, ref, group=f"layer-{diff_id[7:19]}", group_class="os",
                                 source=src.description, annotations=ann, digest=built.digest, store=store)
    finally:
        os.unlink(out_path)
    group = _lookup(store, ref)
    if group is None:
        raise ArtifactError(f"{where} was published at {ref} but cannot be read back ({pub.digest})")
    return diff_id, ref, group, tar.blob.count


def _verify(tree: list[layerfmt.SourceEntry], path: str, where: str) -> None:
    """The built layer holds exactly the source's entries, each with its type, mode, owner, size,
    target and xattrs (read back from the file's own TOC)."""
    with layerfmt.FileReader.open(path) as reader:
        layer = layerfmt.Layer.open(reader)
        built = {e.path: e for e in layer.entries}
    if len(built) != len(tree):
        extra = sorted(set(built) - {e.path for e in tree})[:5]
        raise IntegrityError(f"{where}: the converted layer has {len(built)} entries, its source {len(tree)}"
                             + (f" (not in the source: {extra})" if extra else ""))
    for src in tree:
        got = built.get(src.path)
        if got is None:
            raise IntegrityError(f"{where}: {src.path!r} is missing from the converted layer")
        same = (got.type == src.type or (src.type == "file" and got.type == "hardlink")) and \
            (src.type in ("whiteout", "opaque") or (got.mode & 0o7777, got.uid, got.gid) ==
             (src.mode & 0o7777, src.uid, src.gid))
        if src.type == "file" and got.type == "file" and got.size != src.size:
            same = False
        if src.type == "symlink" and got.link != src.link:
            same = False
        if src.type not in ("whiteout", "opaque") and dict(got.xattrs) != dict(src.xattrs):
            same = False
        if not same:
            raise IntegrityError(f"{where}: {src.path!r} differs in the converted layer ({got} vs {src})")


def convert_image(image: str, *, base: str = "", progress: Progress | None = None) -> ConvertedImage:
    """Every layer of ``image`` (a registry REF, ``oci:DIR[:TAG]``, ``docker-archive:FILE``) as a group
    in the store ``base`` names (``""``: the embedded store), converting only the layers the store
    does not hold yet (looked up by the diff id the image config names, before any download)."""
    with ExitStack() as stack:
        with mapped_errors(f"open image {image}"):
            src = open_image_source(image)
        stack.callback(src.close)
        inner = src.config.get("config") if isinstance(src.config, dict) else None
        cfg = ImageConfig.from_oci(inner)
        store = open_store(parse_ref(converted_ref("sha256:" + "0" * 64, base)).registry)  # one connection for all
        stack.callback(store.close)
        out = []
        for i, (layer, diff_id) in enumerate(zip(src.layers, _diff_ids(src))):
            held = _lookup(store, converted_ref(diff_id, base)) if diff_id else None
            if held is not None:
                out.append(ConvertedLayer(i, diff_id, converted_ref(diff_id, base), held, False))  # type: ignore[arg-type]
                continue
            got_id, ref, group, n = _convert_one(src, i, layer, image, store, base, cfg, progress)
            if diff_id and got_id != diff_id:
                raise IntegrityError(f"{image}: layer {i + 1} is {got_id} uncompressed, the config says {diff_id}")
            out.append(ConvertedLayer(i, got_id, ref, group, True, n))
        return ConvertedImage(image, out, cfg, src.config if isinstance(src.config, dict) else {})


def is_image_ref(text: str) -> bool:
    """Whether ``text`` names an OCI or Docker image rather than a plan file or a weenv group:
    ``oci:DIR``, ``docker-archive:FILE``, ``docker://REF``, or a REF naming a registry host
    (``host[:port]/repo:tag``)."""
    if text.startswith(("oci:", "docker-archive:", "docker://")):
        return True
    try:
        return parse_ref(text).registry is not None
    except RefError:
        return False


def plan_name_for(image: str) -> str:
    """A plan name (``[a-z0-9-]``, at most 63) from an image reference: its last path part, no tag."""
    import re

    tail = image.rsplit("/", 1)[-1]
    tail = tail.split("@", 1)[0].rsplit(":", 1)[0] if not image.startswith(("oci:", "docker-archive:")) else \
        os.path.basename(image.split(":", 1)[1].rstrip("/")).split(".")[0]
    name = re.sub(r"[^a-z0-9-]+", "-", tail.lower()).strip("-")[:63].strip("-")
    return name or "image"


def image_lock(converted: ConvertedImage, *, name: str | None = None, classes: dict[int, str] | None = None) -> Any:
    """A lock of one group per layer of ``converted`` (bottom first; class ``os`` unless ``classes``
    maps a layer index to another), with the image config's env, workdir and user as defaults and its
    command, exposed ports and labels in the plan's ``[image]`` table."""
    from ..plan import Group, Plan, apply_image_defaults, lock_plan, plan_defaults_from_image

    groups = [Group(name=f"layer{x.index}", ref=f"{x.ref}@{x.group.manifest_digest}",
                    group_class=(classes or {}).get(x.index, "os")) for x in converted.layers]
    plan = Plan(name=name or plan_name_for(converted.image), groups=groups)
    by_ref = {f"{x.ref}@{x.group.manifest_digest}": x.group for x in converted.layers}
    lock = lock_plan(plan, lambda ref: by_ref[ref])
    defaults = plan_defaults_from_image(converted.raw_config or converted.config, source=converted.image)
    return apply_image_defaults(lock, defaults)


def store_base(store: str | None) -> str:
    """The ``base`` conversions go to: ``store`` (``host[:port]/prefix``), else ``$WEENV_IMAGE_STORE``,
    else ``""`` (the embedded store)."""
    base = os.environ.get("WEENV_IMAGE_STORE", "") if store is None else store
    return base + "/" if base and not base.endswith("/") else base


_converting: dict[str, Any] = {}
_converting_lock = threading.Lock()


def lock_for_image(image: str, *, base: str | None = None, progress: Progress | None = None) -> Any:
    """The lock an env of ``image`` starts from, its layers converted first where the store lacks
    them (``base``: where conversions go, default ``$WEENV_IMAGE_STORE`` or the embedded store).
    Concurrent calls for one image convert it once. Blocks: a worker thread's call."""
    base = store_base(base)
    with _converting_lock:
        lock = _converting.setdefault(image, threading.Lock())
    with lock:
        return image_lock(convert_image(image, base=base, progress=progress))
