"""``weenv publish``: build a tree into a layer, push the blob only if missing, tag a group manifest.

Republishing an unchanged tree must cost almost nothing: a stat fingerprint of the source (paths,
modes, owners, sizes, mtime/ctime in ns, inode numbers) keys a small cache of earlier builds
(``$WEENV_HOME/cache/publish``). On a hit whose blob the target already has, nothing is rebuilt or
uploaded, and the tag is left alone when the manifest would differ only in its creation time.
ctime changes on every content, mode, owner or xattr change, so a stale hit needs a file rewritten
to the same size within the same nanosecond timestamps, which we accept (git's index does the same).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from .. import __version__, layerfmt
from .._atomic import atomic_writer
from ._errors import ArtifactError, IntegrityError, NotFoundError, RefError, StoreError, mapped_errors
from ._group import group_manifest, open_store, parse_manifest, require_tag, same_group_content, weenv_home
from ._oci import (
    ANN_CLASS,
    ANN_CREATED,
    ANN_GROUP,
    ANN_SOURCE,
    EMPTY_DIGEST,
    EMPTY_JSON,
    GROUP_CLASSES,
    MANIFEST_V1,
)
from ._ref import Ref, parse_ref
from ._store import Store

PublishProgress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: stage is "scan", "build", "upload" or "manifest"; bytes for uploads."""


@dataclass(frozen=True)
class PublishResult:
    ref: str
    digest: str  # manifest digest
    toc_digest: str
    size: int  # layer blob bytes
    uploaded_bytes: int
    layer_digest: str
    rebuilt: bool = True  # False when the fingerprint cache made the build unnecessary
    manifest_pushed: bool = True  # False when the tag already named identical content

    def to_json(self) -> dict[str, object]:
        return {"ref": self.ref, "digest": self.digest, "toc_digest": self.toc_digest, "size": self.size,
                "uploaded_bytes": self.uploaded_bytes, "layer_digest": self.layer_digest}


def _now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_class(group_class: str) -> None:
    if group_class not in GROUP_CLASSES:
        raise RefError(f"unknown group class {group_class!r}; use one of {', '.join(GROUP_CLASSES)}")


# ------------------------------------------------------------------------------- fingerprint


def source_fingerprint(src: str, build_params: dict[str, object]) -> str:
    """sha256 over the stat data of every entry under ``src`` (or of the tar file) and the build parameters."""
    h = hashlib.sha256()
    h.update(json.dumps({"weenv": __version__, "format": layerfmt.FORMAT_VERSION, **build_params},
                        sort_keys=True).encode())

    def add(rel: str, st: os.stat_result, extra: str = "") -> None:
        h.update(
            f"{rel}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0"
            f"{st.st_ino}\0{st.st_dev}\0{st.st_rdev}\0{st.st_nlink}\0{extra}\n".encode("utf-8", "surrogateescape")
        )

    root_st = os.lstat(src)
    add(".", root_st, os.path.abspath(src))
    if not stat.S_ISDIR(root_st.st_mode):
        return "sha256:" + h.hexdigest()
    stack = [(src, "")]
    while stack:
        d, rel = stack.pop()
        with os.scandir(d) as it:
            ents = sorted(it, key=lambda e: e.name)
        for e in ents:
            st = e.stat(follow_symlinks=False)
            add(rel + e.name, st)
            if stat.S_ISDIR(st.st_mode):
                stack.append((e.path, rel + e.name + "/"))
    return "sha256:" + h.hexdigest()


def _cache_dir() -> str:
    return os.path.join(weenv_home(), "cache", "publish")


def _cache_get(key: str) -> dict[str, object] | None:
    try:
        with open(os.path.join(_cache_dir(), key.split(":", 1)[1] + ".json"), encoding="utf-8") as f:
            entry = json.load(f)
        return entry if isinstance(entry, dict) and {"digest", "size", "toc_digest"} <= entry.keys() else None
    except (OSError, ValueError):
        return None


def _cache_put(key: str, digest: str, size: int, toc_digest: str) -> None:
    try:
        d = _cache_dir()
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, key.split(":", 1)[1] + ".json")
        with atomic_writer(path, mode=None, fsync=False, encoding="utf-8") as f:
            json.dump({"digest": digest, "size": size, "toc_digest": toc_digest}, f)
    except OSError:
        pass  # the cache only saves time


# ------------------------------------------------------------------------------- publish


def _tmp_dir() -> str:
    d = os.path.join(weenv_home(), "tmp")
    try:
        os.makedirs(d, exist_ok=True)
        return d
    except OSError:
        return tempfile.gettempdir()


def publish(
    src: str,
    ref: str,
    *,
    group: str | None = None,
    group_class: str = "harness",
    source: str | None = None,
    progress: PublishProgress | None = None,
    chunk_size: int = layerfmt.DEFAULT_CHUNK_SIZE,
    level: int = 3,
    prefetch: list[str] | None = None,
    use_cache: bool = True,
    annotations: dict[str, str] | None = None,
) -> PublishResult:
    """Build ``src`` (directory or tar) into a layer and publish it as group ``ref``."""
    _check_class(group_class)
    r = parse_ref(ref)
    require_tag(r, "publish")
    if not os.path.exists(src):
        raise NotFoundError(f"publish source does not exist: {src}")
    params = {"chunk_size": chunk_size, "level": level, "prefetch": list(prefetch or [])}
    if progress:
        progress("scan", 0, 0)
    with mapped_errors(f"scan {src}"):
        key = source_fingerprint(src, params) if use_cache else None
    store = open_store(r.registry)
    try:
        hit = _cache_get(key) if key else None
        if hit is not None and store.has_blob(r.repo, str(hit["digest"])):
            return _publish_blob(
                store, r, str(hit["digest"]), int(hit["size"]), str(hit["toc_digest"]), None,
                group=group, group_class=group_class, source=source, progress=progress,
                annotations=annotations, rebuilt=False,
            )
        if progress:
            progress("build", 0, 0)
        fd, tmp = tempfile.mkstemp(prefix="weenv-publish-", suffix=".layer", dir=_tmp_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                built = layerfmt.build_layer(src, f, chunk_size=chunk_size, level=level, prefetch=prefetch or ())
            if key:
                _cache_put(key, built.digest, built.size, built.toc_digest)
            return _publish_blob(store, r, built.digest, built.size, built.toc_digest, tmp, group=group,
                                 group_class=group_class, source=source, progress=progress, annotations=annotations)
        finally:
            os.unlink(tmp)
    finally:
        store.close()


def publish_layer_file(
    path: str,
    ref: str,
    *,
    group: str | None = None,
    group_class: str = "harness",
    source: str | None = None,
    progress: PublishProgress | None = None,
    annotations: dict[str, str] | None = None,
    digest: str | None = None,
    store: Store | None = None,
) -> PublishResult:
    """Publish an already-built weenv layer file as group ``ref`` (for commit, build and package).

    ``digest`` may be passed when the builder reported it (saves hashing the file); it is still
    checked by the store on upload.
    """
    _check_class(group_class)
    r = parse_ref(ref)
    require_tag(r, "publish")
    with mapped_errors(f"read layer {path}"):
        with layerfmt.FileReader.open(path) as reader:
            try:
                lay = layerfmt.Layer.open(reader)
            except layerfmt.LayerError as e:
                raise ArtifactError(f"{path} is not a weenv layer: {e}") from None
            size = reader.size
            if digest is None:
                h = hashlib.sha256()
                for off in range(0, size, 8 << 20):
                    h.update(reader.read_at(off, min(8 << 20, size - off)))
                digest = "sha256:" + h.hexdigest()
    own = store is None
    store = store or open_store(r.registry)
    try:
        return _publish_blob(store, r, digest, size, lay.toc_digest, path, group=group, group_class=group_class,
                             source=source, progress=progress, annotations=annotations)
    finally:
        if own:
            store.close()


def _publish_blob(
    store: Store,
    r: Ref,
    digest: str,
    size: int,
    toc_digest: str,
    path: str | None,
    *,
    group: str | None,
    group_class: str,
    source: str | None,
    progress: PublishProgress | None,
    annotations: dict[str, str] | None,
    rebuilt: bool = True,
) -> PublishResult:
    tag = require_tag(r, "publish")
    uploaded = 0
    if not store.has_blob(r.repo, digest):
        if path is None:
            raise StoreError(f"{r}: blob {digest} vanished from the store while publishing")
        done = [0]

        def on_bytes(n: int) -> None:
            done[0] += n
            if progress:
                progress("upload", done[0], size)

        if progress:
            progress("upload", 0, size)
        uploaded = store.put_blob(r.repo, digest, path, size, progress=on_bytes)
    elif progress:
        progress("upload", size, size)
    if not store.has_blob(r.repo, EMPTY_DIGEST):
        store.put_blob_bytes(r.repo, EMPTY_JSON)
    ann = dict(annotations or {})
    ann[ANN_GROUP] = group or r.repo.rsplit("/", 1)[-1]
    ann[ANN_CLASS] = group_class
    if source:
        ann[ANN_SOURCE] = source
    ann[ANN_CREATED] = _now_rfc3339()
    data = group_manifest(digest, size, toc_digest, ann)
    if progress:
        progress("manifest", 0, 1)
    existing = _existing_manifest(store, r.repo, tag)
    if existing is not None and same_group_content(existing[1], json.loads(data)):
        manifest_digest, pushed = existing[0], False
    else:
        manifest_digest, pushed = store.put_manifest(r.repo, data, MANIFEST_V1, tag), True
    if progress:
        progress("manifest", 1, 1)
    return PublishResult(ref=str(r), digest=manifest_digest, toc_digest=toc_digest, size=size,
                         uploaded_bytes=uploaded, layer_digest=digest, rebuilt=rebuilt, manifest_pushed=pushed)


def _existing_manifest(store: Store, repo: str, tag: str) -> tuple[str, dict[str, object]] | None:
    from ._oci import sha256_digest

    try:
        data, media_type = store.get_manifest(repo, tag)
    except NotFoundError:
        return None
    except IntegrityError:
        return None  # overwrite a damaged manifest
    try:
        return sha256_digest(data), parse_manifest(data, media_type, f"{repo}:{tag}")
    except ArtifactError:
        return None
