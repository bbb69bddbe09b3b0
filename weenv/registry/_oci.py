"""OCI media types, annotation keys and canonical JSON, shared by the stores, publish, pull and export."""

from __future__ import annotations

import hashlib
import json
from typing import Any

MANIFEST_V1 = "application/vnd.oci.image.manifest.v1+json"
INDEX_V1 = "application/vnd.oci.image.index.v1+json"
CONFIG_V1 = "application/vnd.oci.image.config.v1+json"
EMPTY_V1 = "application/vnd.oci.empty.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_TAR_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"

MANIFEST_TYPES = (MANIFEST_V1, DOCKER_MANIFEST_V2)
INDEX_TYPES = (INDEX_V1, DOCKER_MANIFEST_LIST)
ACCEPT_MANIFESTS = ", ".join((MANIFEST_V1, INDEX_V1, DOCKER_MANIFEST_V2, DOCKER_MANIFEST_LIST))

GROUP_ARTIFACT_TYPE = "application/vnd.weenv.group.v1"
ANN_GROUP = "dev.weenv.group"
ANN_CLASS = "dev.weenv.class"
ANN_REPO = "dev.weenv.repo"
ANN_IMAGE_CONFIG = "dev.weenv.image.config"
ANN_REF_NAME = "org.opencontainers.image.ref.name"
ANN_SOURCE = "org.opencontainers.image.source"
ANN_CREATED = "org.opencontainers.image.created"

EMPTY_JSON = b"{}"
EMPTY_DIGEST = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"

GROUP_CLASSES = ("os", "toolchain", "harness", "evaluator", "task")


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON (sorted keys, no spaces): the same content always has the same digest."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def descriptor_json(media_type: str, digest: str, size: int, annotations: dict[str, str] | None = None,
                    artifact_type: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"mediaType": media_type, "digest": digest, "size": size}
    if artifact_type:
        d["artifactType"] = artifact_type
    if annotations:
        d["annotations"] = dict(annotations)
    return d
