"""Integration tests against a real docker-registry: publish/resolve/range, idempotency, auth, faults."""

from __future__ import annotations

import base64
import json
import os
import time
import uuid

import pytest

import weenv.registry as R
from tests.fixtures_registry import Fault
from weenv import layerfmt

pytestmark = pytest.mark.integration


def _tree(tmp_path, big_bytes: int = 3 << 20) -> str:  # type: ignore[no-untyped-def]
    src = tmp_path / "tree"
    (src / "bin").mkdir(parents=True)
    (src / "etc").mkdir()
    (src / "etc" / "motd").write_text("hello from weenv\n")
    (src / "bin" / "tool").write_bytes(os.urandom(big_bytes))
    os.symlink("tool", src / "bin" / "alias")
    return str(src)


def _repo() -> str:
    return f"it/{uuid.uuid4().hex[:10]}"


def test_publish_resolve_range_roundtrip(registry, weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = _tree(tmp_path)
    ref = f"{registry.host}/{_repo()}:v1"
    res = R.publish(src, ref, group="harness", group_class="harness", source="git@example:repo@abc123")
    assert res.uploaded_bytes == res.size > 0
    info = R.resolve_group(ref)
    assert (info.manifest_digest, info.layer_digest, info.toc_digest) == (res.digest, res.layer_digest, res.toc_digest)
    assert (info.group, info.group_class, info.registry) == ("harness", "harness", registry.host)
    assert info.annotations["org.opencontainers.image.source"] == "git@example:repo@abc123"
    assert info.annotations["org.opencontainers.image.created"].endswith("Z")
    # the manifest is the agreed artifact format
    with R.open_store(registry.host) as s:
        data, mt = s.get_manifest(info.repo, info.manifest_digest)
    m = json.loads(data)
    assert mt == m["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert m["artifactType"] == "application/vnd.weenv.group.v1"
    assert m["config"] == {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                           "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"}
    (layer,) = m["layers"]
    assert layer["mediaType"] == layerfmt.MEDIA_TYPE
    assert layer["annotations"][layerfmt.TOC_DIGEST_ANNOTATION] == res.toc_digest
    assert m["annotations"][layerfmt.TOC_DIGEST_ANNOTATION] == res.toc_digest
    # Range reads through the reader: one file's bytes without the whole blob
    with R.open_layer_ref(info.pinned_ref) as reader:
        assert reader.digest == res.layer_digest
        lay = layerfmt.Layer.open(reader, expected_toc_digest=res.toc_digest)
        assert lay.read("etc/motd") == b"hello from weenv\n"
        lay.verify()
        assert lay.read("bin/tool") == open(os.path.join(src, "bin/tool"), "rb").read()


def test_republish_unchanged_uploads_nothing_and_keeps_the_tag(registry, recording_proxy, weenv_home,
                                                               tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = _tree(tmp_path)
    ref = f"{recording_proxy.host}/{_repo()}:v1"
    first = R.publish(src, ref)
    assert recording_proxy.log.count("PUT") >= 2  # blob(s) and the manifest went through the proxy
    recording_proxy.log.clear()
    time.sleep(1.1)  # a new `created` second must not move the tag
    again = R.publish(src, ref)
    assert (again.digest, again.uploaded_bytes) == (first.digest, 0)
    assert recording_proxy.log.count("PUT", "PATCH", "POST") == 0, recording_proxy.log.entries
    assert again.rebuilt is False and again.manifest_pushed is False
    # without the fingerprint cache the build is deterministic: still no upload, same digest
    recording_proxy.log.clear()
    third = R.publish(src, ref, use_cache=False)
    assert (third.digest, third.uploaded_bytes, third.rebuilt) == (first.digest, 0, True)
    assert recording_proxy.log.count("PUT", "PATCH", "POST") == 0
    # a changed tree moves the tag and uploads only the new blob
    with open(os.path.join(src, "etc", "motd"), "w") as f:
        f.write("changed\n")
    recording_proxy.log.clear()
    changed = R.publish(src, ref)
    assert changed.digest != first.digest and changed.uploaded_bytes == changed.size
    assert recording_proxy.log.count("PUT") == 2  # one blob, one manifest


def test_large_blob_uses_chunked_upload(registry, recording_proxy, weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "big"
    src.mkdir()
    (src / "rand").write_bytes(os.urandom(20 << 20))  # incompressible, above the monolithic limit
    res = R.publish(str(src), f"{recording_proxy.host}/{_repo()}:big")
    assert res.size > 16 << 20
    assert recording_proxy.log.count("PATCH") == 2
    with R.open_layer_ref(f"{registry.host}/{res.ref.split('/', 1)[1]}") as reader:
        layerfmt.Layer.open(reader).verify()


def test_basic_auth_registry(auth_registry, weenv_home, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    src = _tree(tmp_path, 1000)
    ref = f"{auth_registry.host}/{_repo()}:v1"
    with pytest.raises(R.AuthError, match="WEENV_REGISTRY_USERNAME"):
        R.publish(src, ref)
    # credentials from a docker config.json
    cfg_dir = os.environ["DOCKER_CONFIG"]
    os.makedirs(cfg_dir, exist_ok=True)
    auth = base64.b64encode(f"{auth_registry.username}:{auth_registry.password}".encode()).decode()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump({"auths": {auth_registry.host: {"auth": auth}}}, f)
    res = R.publish(src, ref)
    assert R.resolve_group(ref).manifest_digest == res.digest
    # env vars win over the config file: wrong password is refused with a clear message
    monkeypatch.setenv("WEENV_REGISTRY_USERNAME", auth_registry.username)
    monkeypatch.setenv("WEENV_REGISTRY_PASSWORD", "wrong")
    with pytest.raises(R.AuthError, match="refused"):
        R.resolve_group(ref)


def test_bearer_token_flow(registry, fault_proxy, weenv_home, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fault_proxy.server.bearer_token = "tok-123"
    fault_proxy.server.token_basic = "Basic " + base64.b64encode(b"bob:pw").decode()
    src = _tree(tmp_path, 1000)
    ref = f"{fault_proxy.host}/{_repo()}:v1"
    with pytest.raises(R.AuthError, match="token endpoint refused"):
        R.publish(src, ref)
    monkeypatch.setenv("WEENV_REGISTRY_USERNAME", "bob")
    monkeypatch.setenv("WEENV_REGISTRY_PASSWORD", "pw")
    res = R.publish(src, ref)
    assert R.resolve_group(ref).layer_digest == res.layer_digest
    scopes = [p for p, _ in fault_proxy.server.token_requests]
    assert any("pull%2Cpush" in p or "pull,push" in p for p in scopes)


# ------------------------------------------------------------------------------------- faults


@pytest.fixture
def blob_behind_proxy(registry, fault_proxy, tmp_path):  # type: ignore[no-untyped-def]
    data = os.urandom(2 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)
    from weenv.registry._oci import sha256_digest

    digest = sha256_digest(data)
    repo = _repo()
    with R.RemoteStore(registry.host, insecure=True, credentials=None) as direct:
        direct.put_blob(repo, digest, str(path), len(data))
    return repo, digest, data


def _proxy_store(proxy, deadline_s: float = 10.0, **kw) -> R.RemoteStore:  # type: ignore[no-untyped-def]
    policy = R.RetryPolicy(deadline_s=deadline_s, base_delay_s=0.01, max_delay_s=0.2,
                           request_timeout_s=kw.pop("request_timeout_s", 5.0))
    return R.RemoteStore(proxy.host, insecure=True, credentials=None, policy=policy, **kw)


def test_reads_recover_from_500s(fault_proxy, blob_behind_proxy) -> None:  # type: ignore[no-untyped-def]
    repo, digest, data = blob_behind_proxy
    fault_proxy.add_fault(Fault("status", count=3, status=500))
    with _proxy_store(fault_proxy) as s:
        assert s.read_blob(repo, digest, 1000, 5000) == data[1000:6000]
        assert s.stats.retries == 3


def test_reads_fail_clearly_when_500s_persist(fault_proxy, blob_behind_proxy) -> None:  # type: ignore[no-untyped-def]
    repo, digest, _ = blob_behind_proxy
    fault_proxy.add_fault(Fault("status", count=1000, status=503))
    with _proxy_store(fault_proxy, deadline_s=2.0) as s:
        t0 = time.monotonic()
        with pytest.raises(R.RegistryUnavailableError, match="HTTP 503") as e:
            s.read_blob(repo, digest, 0, 10)
        assert time.monotonic() - t0 < 6.0  # bounded by the deadline, not hanging
    assert digest in str(e.value) and fault_proxy.host in str(e.value)


def test_429_with_retry_after_is_honoured(fault_proxy, blob_behind_proxy) -> None:  # type: ignore[no-untyped-def]
    repo, digest, data = blob_behind_proxy
    fault_proxy.add_fault(Fault("status", count=1, status=429, retry_after="1"))
    slept: list[float] = []
    with _proxy_store(fault_proxy, sleep=lambda s: slept.append(s)) as s:
        assert s.read_blob(repo, digest, 0, 100) == data[:100]
    assert slept == [1.0]


def test_retry_after_beyond_deadline_gives_up_at_once(fault_proxy, blob_behind_proxy) -> None:  # type: ignore[no-untyped-def]
    repo, digest, _ = blob_behind_proxy
    fault_proxy.add_fault(Fault("status", count=1, status=429, retry_after="3600"))
    with _proxy_store(fault_proxy, deadline_s=5.0) as s:
        with pytest.raises(R.RegistryUnavailableError, match="Retry-After"):
            s.read_blob(repo, digest, 0, 100)


def test_reset_mid_body_is_retried(fault_proxy, blob_behind_proxy) -> None:  # type: ignore[no-untyped-def]
    repo, digest, data = blob_behind_proxy
    fault_proxy.add_fault(Fault("reset_mid_body", count=2, method="GET"))
    with _proxy_store(fault_proxy) as s:
        assert s.read_blob(repo, digest, 0, 1 << 20) == data[: 1 << 20]
        assert s.stats.retries == 2


def test_connection_closed_before_answer_is_retried(fault_proxy, blob_behind_proxy) -> None:  # type: ignore[no-untyped-def]
    repo, digest, data = blob_behind_proxy
    fault_proxy.add_fault(Fault("close_before_answer", count=1))
    with _proxy_store(fault_proxy) as s:
        assert s.read_blob(repo, digest, 7, 70) == data[7:77]


def test_range_answered_with_200_is_stream_skipped_or_refused(fault_proxy, blob_behind_proxy) -> None:  # type: ignore[no-untyped-def]
    repo, digest, data = blob_behind_proxy
    fault_proxy.add_fault(Fault("ignore_range", count=1))
    with _proxy_store(fault_proxy) as s:
        assert s.read_blob(repo, digest, 1_500_000, 4096) == data[1_500_000:1_504_096]
        assert s.stats.range_ignored == 1
    fault_proxy.add_fault(Fault("ignore_range", count=1))
    with _proxy_store(fault_proxy, max_range_skip_bytes=1 << 20) as s:
        with pytest.raises(R.ProtocolError, match="ignored the Range header"):
            s.read_blob(repo, digest, 1_500_000, 4096)


def test_slow_answers_time_out_within_the_deadline(fault_proxy, blob_behind_proxy) -> None:  # type: ignore[no-untyped-def]
    repo, digest, data = blob_behind_proxy
    fault_proxy.add_fault(Fault("slow", count=1, delay_s=1.0))
    with _proxy_store(fault_proxy, deadline_s=5.0, request_timeout_s=0.3) as s:
        assert s.read_blob(repo, digest, 0, 10) == data[:10]  # the slow one timed out, the retry was fast
        assert s.stats.retries == 1
    fault_proxy.add_fault(Fault("slow", count=1000, delay_s=0.6))
    with _proxy_store(fault_proxy, deadline_s=1.5, request_timeout_s=0.3) as s:
        t0 = time.monotonic()
        with pytest.raises(R.RegistryUnavailableError):
            s.read_blob(repo, digest, 0, 10)
        assert time.monotonic() - t0 < 5.0


def test_publish_survives_5xx_on_upload(registry, fault_proxy, weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = _tree(tmp_path, 100_000)
    fault_proxy.add_fault(Fault("status", count=1, status=503, method="PUT", path_contains="/blobs/uploads/"))
    res = R.publish(src, f"{fault_proxy.host}/{_repo()}:v1")
    assert R.resolve_group(f"{registry.host}/{res.ref.split('/', 1)[1]}").layer_digest == res.layer_digest


def test_resolve_group_rejects_non_group(registry, weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from weenv.registry._oci import MANIFEST_V1, canonical_json, descriptor_json, sha256_digest

    repo = _repo()
    with R.open_store(registry.host) as s:
        cfg = s.put_blob_bytes(repo, b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}')
        layer = s.put_blob_bytes(repo, b"\x1f\x8b not really a layer")
        m = canonical_json({"schemaVersion": 2, "mediaType": MANIFEST_V1,
                            "config": descriptor_json("application/vnd.oci.image.config.v1+json", cfg, 78),
                            "layers": [descriptor_json("application/vnd.oci.image.layer.v1.tar+gzip", layer,
                                                       len(b"\x1f\x8b not really a layer"))]})
        s.put_manifest(repo, m, MANIFEST_V1, "img")
        assert sha256_digest(m) == s.resolve(repo, "img").digest
    with pytest.raises(R.ArtifactError, match="weenv pull"):
        R.resolve_group(f"{registry.host}/{repo}:img")
    with pytest.raises(R.NotFoundError):
        R.resolve_group(f"{registry.host}/{repo}:missing")
