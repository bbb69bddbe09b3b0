"""Layer groups as OCI artifacts: the manifest we write, and resolving any REF to a group.

A group is an OCI image manifest with ``artifactType: application/vnd.weenv.group.v1``, the OCI
empty config (``{}``) and exactly one layer of media type ``layerfmt.MEDIA_TYPE`` (a weenv
tail-TOC layer, itself a valid tar+zstd OCI layer). A plain single-layer image whose layer is a
weenv layer is accepted too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .. import layerfmt
from ._errors import ArtifactError, RefError
from ._oci import (
    ANN_CLASS,
    ANN_CREATED,
    ANN_GROUP,
    ANN_IMAGE_CONFIG,
    CONFIG_V1,
    DOCKER_CONFIG,
    EMPTY_DIGEST,
    EMPTY_JSON,
    EMPTY_V1,
    GROUP_ARTIFACT_TYPE,
    INDEX_TYPES,
    MANIFEST_TYPES,
    MANIFEST_V1,
    canonical_json,
    descriptor_json,
)
from ._ref import Ref, parse_ref
from ._store import BlobReader, Store

_LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


def weenv_home() -> str:
    return os.environ.get("WEENV_HOME") or "/var/lib/weenv"


def local_store_path() -> str:
    return os.path.join(weenv_home(), "store")


def _host(registry: str) -> str:
    if registry.startswith("["):
        return registry[: registry.index("]") + 1]
    return registry.rsplit(":", 1)[0] if ":" in registry else registry


def insecure_by_default(registry: str) -> bool:
    """Plain http for loopback registries and those listed in WEENV_INSECURE_REGISTRIES (comma-separated)."""
    host = _host(registry)
    if host in _LOCAL_HOSTS or host.startswith("127."):
        return True
    listed = {h.strip() for h in os.environ.get("WEENV_INSECURE_REGISTRIES", "").split(",") if h.strip()}
    return registry in listed or host in listed


def open_store(registry: str | None, *, insecure: bool | None = None) -> Store:
    """The store for a REF's registry: None is the embedded layout store at ``$WEENV_HOME/store``."""
    if registry is None:
        from ._layout import LayoutStore

        return LayoutStore(local_store_path())
    from ._remote import RemoteStore

    if insecure is None:
        insecure = insecure_by_default(registry)
    return RemoteStore(registry, insecure=insecure)


@dataclass(frozen=True)
class GroupInfo:
    """A resolved layer group: where its one weenv layer is and what it is."""

    ref: str
    registry: str | None
    repo: str
    manifest_digest: str
    layer_digest: str
    layer_size: int
    toc_digest: str
    group: str
    group_class: str
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def pinned_ref(self) -> str:
        """``[host/]repo@sha256:…`` of the manifest: what a plan lock records."""
        return str(Ref(self.registry, self.repo, None, self.manifest_digest))


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an OCI image config a plan uses (kept from ``weenv pull``)."""

    env: list[str] = field(default_factory=list)
    working_dir: str = ""
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)

    def to_annotation(self) -> str:
        return canonical_json({"Env": self.env, "WorkingDir": self.working_dir, "User": self.user,
                               "Entrypoint": self.entrypoint, "Cmd": self.cmd}).decode()

    @classmethod
    def from_oci(cls, config: dict[str, Any] | None) -> "ImageConfig":
        c = config or {}

        def strs(v: Any) -> list[str]:
            return [str(x) for x in v] if isinstance(v, list) else []

        return cls(strs(c.get("Env")), str(c.get("WorkingDir") or ""), str(c.get("User") or ""),
                   strs(c.get("Entrypoint")), strs(c.get("Cmd")))


def group_manifest(layer_digest: str, layer_size: int, toc_digest: str, annotations: dict[str, str]) -> bytes:
    """The manifest bytes of a group (canonical JSON, so equal content gives an equal digest)."""
    layer_ann = {layerfmt.TOC_DIGEST_ANNOTATION: toc_digest}
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_V1,
        "artifactType": GROUP_ARTIFACT_TYPE,
        "config": descriptor_json(EMPTY_V1, EMPTY_DIGEST, len(EMPTY_JSON)),
        "layers": [descriptor_json(layerfmt.MEDIA_TYPE, layer_digest, layer_size, layer_ann)],
        "annotations": {**annotations, layerfmt.TOC_DIGEST_ANNOTATION: toc_digest},
    }
    return canonical_json(manifest)


def same_group_content(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal manifests apart from the creation time: republishing them must not move the tag."""

    def strip(m: dict[str, Any]) -> dict[str, Any]:
        m = dict(m)
        m["annotations"] = {k: v for k, v in (m.get("annotations") or {}).items() if k != ANN_CREATED}
        return m

    return strip(a) == strip(b)


def parse_manifest(data: bytes, media_type: str, where: str) -> dict[str, Any]:
    try:
        m = json.loads(data)
    except ValueError as e:
        raise ArtifactError(f"{where}: manifest is not JSON: {e}") from None
    if not isinstance(m, dict):
        raise ArtifactError(f"{where}: manifest is not a JSON object")
    mt = m.get("mediaType") or media_type
    if mt in INDEX_TYPES or "manifests" in m:
        raise ArtifactError(f"{where}: is an image index (multi-platform); import it with `weenv pull`")
    if mt not in MANIFEST_TYPES:
        raise ArtifactError(f"{where}: unsupported manifest media type {mt!r}")
    if not isinstance(m.get("layers"), list):
        raise ArtifactError(f"{where}: manifest has no layers list")
    return m


def group_from_manifest(store: Store, r: Ref, digest: str, m: dict[str, Any], where: str) -> GroupInfo:
    layers = m["layers"]
    ann = {str(k): str(v) for k, v in (m.get("annotations") or {}).items()}
    is_group = m.get("artifactType") == GROUP_ARTIFACT_TYPE
    if len(layers) != 1:
        kind = "weenv group" if is_group else "image"
        raise ArtifactError(
            f"{where}: {kind} has {len(layers)} layers; a group has exactly one (import images with `weenv pull`)"
        )
    layer = layers[0]
    if not isinstance(layer, dict) or layer.get("mediaType") != layerfmt.MEDIA_TYPE:
        raise ArtifactError(
            f"{where}: layer media type {layer.get('mediaType') if isinstance(layer, dict) else None!r} is not "
            f"{layerfmt.MEDIA_TYPE!r}; import images with `weenv pull`"
        )
    try:
        layer_digest, layer_size = str(layer["digest"]), int(layer["size"])
    except (KeyError, TypeError, ValueError):
        raise ArtifactError(f"{where}: layer descriptor without digest/size") from None
    toc = (layer.get("annotations") or {}).get(layerfmt.TOC_DIGEST_ANNOTATION) or ann.get(layerfmt.TOC_DIGEST_ANNOTATION)
    if not toc:
        # a tar+zstd layer without our annotation: it is ours only if its tail is a weenv footer
        try:
            lay = layerfmt.Layer.open(BlobReader(store, r.repo, layer_digest, layer_size), tail_read=4096)
        except layerfmt.LayerError as e:
            raise ArtifactError(f"{where}: layer {layer_digest} is not a weenv layer ({e}); use `weenv pull`") from None
        toc = lay.toc_digest
    return GroupInfo(
        ref=str(r), registry=r.registry, repo=r.repo, manifest_digest=digest, layer_digest=layer_digest,
        layer_size=layer_size, toc_digest=toc, group=ann.get(ANN_GROUP) or r.repo.rsplit("/", 1)[-1],
        group_class=ann.get(ANN_CLASS) or "os", annotations=ann,
    )


@contextmanager
def _store_for(ref: str | Ref) -> Iterator[tuple[Ref, Store]]:
    r = parse_ref(ref) if isinstance(ref, str) else ref
    store = open_store(r.registry)
    try:
        yield r, store
    finally:
        store.close()


def resolve_group_in(store: Store, r: Ref) -> GroupInfo:
    where = str(r)
    data, media_type = store.get_manifest(r.repo, r.reference)
    from ._oci import sha256_digest

    return group_from_manifest(store, r, sha256_digest(data), parse_manifest(data, media_type, where), where)


def resolve_group(ref: str) -> GroupInfo:
    """Resolve a REF (tag or ``@sha256:…``) to its group; ArtifactError if it is not a weenv group."""
    with _store_for(ref) as (r, store):
        return resolve_group_in(store, r)


class LayerRefReader(BlobReader):
    """A :class:`BlobReader` that owns its store; ``group`` says what it reads."""

    def __init__(self, store: Store, info: GroupInfo):
        super().__init__(store, info.repo, info.layer_digest, info.layer_size)
        self.group = info

    def close(self) -> None:
        self.store.close()


@contextmanager
def open_layer_ref(ref: str) -> Iterator[LayerRefReader]:
    """A random-access reader (``size``, ``read_at``, ``digest``) over a group's layer, by Range reads."""
    r = parse_ref(ref)
    store = open_store(r.registry)
    try:
        info = resolve_group_in(store, r)
        yield LayerRefReader(store, info)
    finally:
        store.close()


def image_config(ref: str) -> ImageConfig:
    """The image config kept for a group imported by ``weenv pull`` (empty for groups built from trees)."""
    with _store_for(ref) as (r, store):
        data, media_type = store.get_manifest(r.repo, r.reference)
        m = parse_manifest(data, media_type, str(r))
        raw = (m.get("annotations") or {}).get(ANN_IMAGE_CONFIG)
        if raw:
            try:
                return ImageConfig.from_oci(json.loads(raw))
            except ValueError:
                raise ArtifactError(f"{r}: annotation {ANN_IMAGE_CONFIG} is not JSON") from None
        cfg = m.get("config") or {}
        if cfg.get("mediaType") in (CONFIG_V1, DOCKER_CONFIG):
            size = int(cfg.get("size", 0))
            body = b"".join(store.iter_blob(r.repo, cfg["digest"], size))
            try:
                return ImageConfig.from_oci(json.loads(body).get("config"))
            except (ValueError, AttributeError):
                raise ArtifactError(f"{r}: image config blob is not JSON") from None
        return ImageConfig()


def require_tag(r: Ref, what: str) -> str:
    if r.digest and not r.tag:
        raise RefError(f"{what} needs a tag, not a digest: {r}")
    return r.tag or "latest"

