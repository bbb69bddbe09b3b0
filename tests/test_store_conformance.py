"""The store contract, run against every implementation: the local layout store, a real registry and
the in-memory fake of weenv.testing."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator

import pytest

import weenv.registry as R
from weenv.registry._oci import INDEX_V1, MANIFEST_V1, canonical_json, descriptor_json, sha256_digest
from weenv.testing import FakeStore


@pytest.fixture(params=["layout", "remote", "fake"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[R.Store]:  # type: ignore[no-untyped-def]
    if request.param == "layout":
        s: R.Store = R.LayoutStore(str(tmp_path / "store"))
    elif request.param == "fake":
        s = FakeStore()
    else:
        reg = request.getfixturevalue("registry")
        s = R.RemoteStore(reg.host, insecure=True, credentials=None)
    with s:
        yield s


@pytest.fixture
def repo() -> str:
    return f"conf/{uuid.uuid4().hex[:10]}"


def _blob(tmp_path, data: bytes) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    path = tmp_path / f"blob-{hashlib.sha256(data).hexdigest()[:8]}"
    path.write_bytes(data)
    return str(path), sha256_digest(data)


def _manifest(store: R.Store, repo: str, tmp_path, payload: bytes, note: str = "") -> bytes:  # type: ignore[no-untyped-def]
    path, digest = _blob(tmp_path, payload)
    store.put_blob(repo, digest, path, len(payload))
    store.put_blob_bytes(repo, b"{}")
    m = {"schemaVersion": 2, "mediaType": MANIFEST_V1, "artifactType": R.GROUP_ARTIFACT_TYPE,
         "config": descriptor_json("application/vnd.oci.empty.v1+json", sha256_digest(b"{}"), 2),
         "layers": [descriptor_json("application/vnd.oci.image.layer.v1.tar+zstd", digest, len(payload))],
         "annotations": {"note": note}}
    return canonical_json(m)


def test_blob_roundtrip_and_ranges(store: R.Store, repo: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(300_000)
    path, digest = _blob(tmp_path, data)
    assert not store.has_blob(repo, digest)
    seen: list[int] = []
    assert store.put_blob(repo, digest, path, len(data), progress=seen.append) == len(data)
    assert sum(seen) == len(data)
    assert store.has_blob(repo, digest)
    assert store.put_blob(repo, digest, path, len(data)) == 0  # already there: nothing uploaded
    for off, n in [(0, 1), (0, len(data)), (4096, 4096), (len(data) - 7, 7), (123_457, 65_536)]:
        assert store.read_blob(repo, digest, off, n) == data[off : off + n]
    assert store.read_blob(repo, digest, 10, 0) == b""
    assert b"".join(store.iter_blob(repo, digest, len(data), chunk_bytes=100_000)) == data
    reader = R.BlobReader(store, repo, digest, len(data))
    assert reader.read_at(len(data) - 3, 100) == data[-3:]


def test_read_outside_blob_is_a_range_error(store: R.Store, repo: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = b"x" * 1000
    path, digest = _blob(tmp_path, data)
    store.put_blob(repo, digest, path, len(data))
    with pytest.raises(R.BlobRangeError):
        store.read_blob(repo, digest, 2000, 10)
    # the broken 416 must not poison the connection pool: the next read works
    assert store.read_blob(repo, digest, 0, 4) == b"xxxx"


def test_missing_blob_and_manifest(store: R.Store, repo: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = "sha256:" + "0" * 64
    with pytest.raises(R.NotFoundError):
        store.read_blob(repo, missing, 0, 1)
    with pytest.raises(R.NotFoundError):
        store.get_manifest(repo, "nope")
    with pytest.raises(R.NotFoundError):
        store.resolve(repo, missing)
    assert store.list_tags(repo) == []


def test_put_blob_with_wrong_digest_is_refused(store: R.Store, repo: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, _ = _blob(tmp_path, b"actual bytes")
    wrong = sha256_digest(b"other bytes")
    with pytest.raises((R.IntegrityError, R.ProtocolError)):
        store.put_blob(repo, wrong, path, len(b"actual bytes"))
    assert not store.has_blob(repo, wrong)


def test_manifest_tag_digest_and_retag(store: R.Store, repo: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    m1 = _manifest(store, repo, tmp_path, b"one" * 100, "1")
    m2 = _manifest(store, repo, tmp_path, b"two" * 100, "2")
    d1 = store.put_manifest(repo, m1, MANIFEST_V1, "v1")
    assert d1 == sha256_digest(m1)
    assert store.get_manifest(repo, "v1") == (m1, MANIFEST_V1)
    assert store.get_manifest(repo, d1) == (m1, MANIFEST_V1)
    desc = store.resolve(repo, "v1")
    assert (desc.digest, desc.size, desc.media_type, desc.artifact_type) == (d1, len(m1), MANIFEST_V1,
                                                                               R.GROUP_ARTIFACT_TYPE)
    assert store.resolve(repo, d1).digest == d1
    d2 = store.put_manifest(repo, m2, MANIFEST_V1, "v1")  # retag
    assert store.resolve(repo, "v1").digest == d2
    assert store.get_manifest(repo, d1)[0] == m1  # the old manifest stays reachable by digest
    store.put_manifest(repo, m1, MANIFEST_V1, "v2")
    store.put_manifest(repo, m1, MANIFEST_V1, "a-first")
    assert store.list_tags(repo) == ["a-first", "v1", "v2"]


def test_delete_manifest_removes_its_tags_and_keeps_blobs_and_other_tags(store: R.Store, repo: str,
                                                                        tmp_path) -> None:  # type: ignore[no-untyped-def]
    m1 = _manifest(store, repo, tmp_path, b"gone" * 100, "1")
    m2 = _manifest(store, repo, tmp_path, b"kept" * 100, "2")
    store.put_manifest(repo, m1, MANIFEST_V1, "snap-a")
    store.put_manifest(repo, m1, MANIFEST_V1, "snap-a-alias")  # the same manifest: registries delete both
    store.put_manifest(repo, m2, MANIFEST_V1, "snap-b")
    assert _manifest(store, repo + "-other", tmp_path, b"gone" * 100, "1") == m1  # its blobs there too
    store.put_manifest(repo + "-other", m1, MANIFEST_V1, "snap-a")  # another repo's tag is its own
    assert store.delete_manifest(repo, "snap-a") is True
    assert store.list_tags(repo) == ["snap-b"]
    for tag in ("snap-a", "snap-a-alias"):
        with pytest.raises(R.NotFoundError):
            store.resolve(repo, tag)
    assert store.get_manifest(repo, "snap-b")[0] == m2
    assert store.get_manifest(repo + "-other", "snap-a")[0] == m1
    layer = sha256_digest(b"gone" * 100)
    assert store.has_blob(repo, layer)  # blobs stay: an env reading them by digest reads on
    assert store.read_blob(repo, layer, 0, 4) == b"gone"
    assert store.delete_manifest(repo, "snap-a") is False  # already gone
    assert store.delete_manifest(repo, "never-was") is False


def test_untagged_manifest_by_digest(store: R.Store, repo: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    m = _manifest(store, repo, tmp_path, b"untagged", "u")
    d = store.put_manifest(repo, m, MANIFEST_V1)
    assert store.get_manifest(repo, d)[0] == m
    assert store.list_tags(repo) == []


def test_repos_are_separate_namespaces_for_tags(store: R.Store, repo: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    other = repo + "-other"
    m = _manifest(store, repo, tmp_path, b"shared", "s")
    store.put_manifest(repo, m, MANIFEST_V1, "t")
    assert store.list_tags(other) == []
    with pytest.raises(R.NotFoundError):
        store.get_manifest(other, "t")


def test_index_media_type_roundtrips(store: R.Store, repo: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    m = _manifest(store, repo, tmp_path, b"child", "c")
    d = store.put_manifest(repo, m, MANIFEST_V1)
    index = canonical_json({"schemaVersion": 2, "mediaType": INDEX_V1,
                            "manifests": [descriptor_json(MANIFEST_V1, d, len(m))]})
    store.put_manifest(repo, index, INDEX_V1, "multi")
    assert store.get_manifest(repo, "multi") == (index, INDEX_V1)
