"""Unit tests of the registry's I/O-free parts: refs, auth decisions, retry policy, error mapping, squash."""

from __future__ import annotations

import base64
import errno
import json

import httpx
import pytest
import requests

import weenv.registry as R
from weenv import layerfmt
from weenv.registry._auth import (
    Authenticator,
    Credentials,
    Denied,
    FetchToken,
    UseHeader,
    credentials_from_docker_config,
    load_credentials,
    parse_www_authenticate,
    scope_for,
)
from weenv.registry._errors import _lower_error_types, mapped_errors
from weenv.registry._image import parse_groups_spec, squash
from weenv.registry._retry import GiveUp, Retry, RetryPolicy, parse_retry_after

D = "sha256:" + "ab" * 32


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------------------------- refs


@pytest.mark.parametrize("text,registry,repo,tag,digest", [
    ("harness:v3", None, "harness", "v3", None),
    ("team/harness:v3", None, "team/harness", "v3", None),
    ("team/harness", None, "team/harness", "latest", None),
    ("127.0.0.1:5000/team/harness:v1", "127.0.0.1:5000", "team/harness", "v1", None),
    (f"127.0.0.1:5000/team/harness@{D}", "127.0.0.1:5000", "team/harness", None, D),
    (f"reg.example.com/a/b:t@{D}", "reg.example.com", "a/b", "t", D),
    ("localhost/x", "localhost", "x", "latest", None),
    ("localhost:5000/x:1.0-rc_1", "localhost:5000", "x", "1.0-rc_1", None),
    (f"harness@{D}", None, "harness", None, D),
])
def test_parse_ref_forms(text: str, registry: str | None, repo: str, tag: str | None, digest: str | None) -> None:
    r = R.parse_ref(text)
    assert (r.registry, r.repo, r.tag, r.digest) == (registry, repo, tag, digest)
    assert R.parse_ref(str(r)) == r


@pytest.mark.parametrize("bad", ["", "Upper/case:tag", "a b", "repo:bad tag", "repo@sha256:xyz", "repo:", "/abs",
                                 "a//b", "127.0.0.1:5000/", "repo:" + "t" * 200])
def test_parse_ref_rejects_with_ref_error(bad: str) -> None:
    with pytest.raises(R.RefError) as e:
        R.parse_ref(bad)
    assert "REF" in str(e.value)


def test_ref_reference_prefers_digest() -> None:
    assert R.parse_ref(f"a:t@{D}").reference == D
    assert R.parse_ref("a:t").reference == "t"


# ------------------------------------------------------------------------------------- challenges


def test_parse_www_authenticate_bearer_with_commas_in_quotes() -> None:
    h = 'Bearer realm="https://auth.example.com/token",service="registry.example.com",scope="repository:a/b:pull,push"'
    (c,) = parse_www_authenticate(h)
    assert c.scheme == "bearer"
    assert c.params == {"realm": "https://auth.example.com/token", "service": "registry.example.com",
                        "scope": "repository:a/b:pull,push"}


def test_parse_www_authenticate_several_challenges_and_escapes() -> None:
    cs = parse_www_authenticate('Basic realm="weenv \\"test\\"", Bearer realm="r", error=invalid_token')
    assert [c.scheme for c in cs] == ["basic", "bearer"]
    assert cs[0].params["realm"] == 'weenv "test"'
    assert cs[1].params == {"realm": "r", "error": "invalid_token"}


def test_parse_www_authenticate_garbage_is_empty() -> None:
    assert parse_www_authenticate("") == []
    assert parse_www_authenticate('=,"') == []


# ------------------------------------------------------------------------------------- credentials


def _auth_b64(user: str, pw: str) -> str:
    return base64.b64encode(f"{user}:{pw}".encode()).decode()


def test_credentials_from_docker_config_variants() -> None:
    cfg = {"auths": {"https://reg.example.com": {"auth": _auth_b64("u", "p:with:colons")},
                     "127.0.0.1:5000": {"username": "x", "password": "y"}}}
    assert credentials_from_docker_config(cfg, "reg.example.com") == Credentials("u", "p:with:colons")
    assert credentials_from_docker_config(cfg, "127.0.0.1:5000") == Credentials("x", "y")
    assert credentials_from_docker_config(cfg, "other:1") is None
    with pytest.raises(R.AuthError, match="not base64"):
        credentials_from_docker_config({"auths": {"h": {"auth": "!!!"}}}, "h")


def test_load_credentials_env_wins_then_docker_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"h:1": {"auth": _auth_b64("file", "pw")}}}))
    env = {"DOCKER_CONFIG": str(tmp_path), "HOME": str(tmp_path / "nohome")}
    assert load_credentials("h:1", env) == Credentials("file", "pw")
    assert load_credentials("h:1", {**env, "WEENV_REGISTRY_USERNAME": "e", "WEENV_REGISTRY_PASSWORD": "p"}) == \
        Credentials("e", "p")
    assert load_credentials("other:2", env) is None
    assert "pw" not in repr(Credentials("file", "pw"))


# ------------------------------------------------------------------------------------- auth decisions


def test_basic_challenge_then_sent_up_front() -> None:
    a = Authenticator("h", Credentials("u", "p"))
    assert a.header("repository:x:pull") is None
    step = a.respond('Basic realm="r"', "repository:x:pull", retried=False)
    assert step == UseHeader("Basic " + _auth_b64("u", "p"))
    assert a.header("repository:other:pull,push") == step.authorization  # basic applies to every scope
    refused = a.respond('Basic realm="r"', "repository:x:pull", retried=True)
    assert isinstance(refused, Denied) and "'u' was refused" in refused.message


def test_basic_challenge_without_credentials_says_how_to_log_in() -> None:
    step = Authenticator("h:1", None).respond('Basic realm="r"', "repository:x:pull", retried=False)
    assert isinstance(step, Denied)
    assert "WEENV_REGISTRY_USERNAME" in step.message and "config.json" in step.message


def test_bearer_flow_caches_token_until_expiry() -> None:
    clock = FakeClock()
    a = Authenticator("h", Credentials("u", "p"), clock)
    scope = scope_for("team/x")
    step = a.respond('Bearer realm="https://a/token",service="reg"', scope, retried=False)
    assert isinstance(step, FetchToken)
    assert step.realm == "https://a/token" and step.params == {"service": "reg", "scope": scope}
    assert step.authorization == "Basic " + _auth_b64("u", "p")
    got = a.token_received(scope, 200, json.dumps({"token": "T1", "expires_in": 300}).encode())
    assert got == UseHeader("Bearer T1")
    assert a.header(scope) == "Bearer T1"
    clock.t += 294  # 300 s minus the safety margin
    assert a.header(scope) == "Bearer T1"
    clock.t += 2
    assert a.header(scope) is None


def test_bearer_push_token_serves_pull_and_refusal_stops_loop() -> None:
    a = Authenticator("h", None, FakeClock())
    push = scope_for("r", push=True)
    a.respond('Bearer realm="https://a/t"', push, retried=False)
    a.token_received(push, 200, b'{"access_token": "P"}')
    assert a.header(scope_for("r")) == "Bearer P"
    denied = a.respond('Bearer realm="https://a/t"', push, retried=True)
    assert isinstance(denied, Denied) and "anonymous" in denied.message
    assert a.header(push) is None  # the refused token is forgotten


def test_token_endpoint_answers() -> None:
    a = Authenticator("h", Credentials("u", "p"), FakeClock())
    assert isinstance(a.token_received("s", 401, b""), Denied)
    assert isinstance(a.token_received("s", 500, b""), Denied)
    assert isinstance(a.token_received("s", 200, b"not json"), Denied)
    assert isinstance(a.token_received("s", 200, b'{"token": ""}'), Denied)


def test_unsupported_or_missing_challenge() -> None:
    a = Authenticator("h", None)
    assert isinstance(a.respond(None, "s", retried=False), Denied)
    assert isinstance(a.respond('Negotiate abc', "s", retried=False), Denied)
    assert isinstance(a.respond('Bearer service="x"', "s", retried=False), Denied)  # no realm


# ------------------------------------------------------------------------------------- retry policy


def test_backoff_grows_is_jittered_and_capped() -> None:
    p = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0)
    assert p.backoff_s(1, 0.0) == pytest.approx(0.05)
    assert p.backoff_s(1, 0.999) == pytest.approx(0.0999, abs=1e-4)
    assert p.backoff_s(3, 0.0) == pytest.approx(0.2)
    assert p.backoff_s(10, 1.0) == pytest.approx(1.0)


def test_decide_retries_5xx_and_429_but_not_4xx() -> None:
    p = RetryPolicy(max_attempts=3, deadline_s=10)
    assert isinstance(p.decide(attempt=1, started_s=0, now_s=0, status=503), Retry)
    assert isinstance(p.decide(attempt=1, started_s=0, now_s=0, status=429), Retry)
    assert isinstance(p.decide(attempt=1, started_s=0, now_s=0, error="ConnectError"), Retry)
    assert isinstance(p.decide(attempt=1, started_s=0, now_s=0, status=404), GiveUp)
    g = p.decide(attempt=3, started_s=0, now_s=0, status=500)
    assert isinstance(g, GiveUp) and "after 3 attempts" in g.reason


def test_decide_honours_retry_after_within_deadline() -> None:
    p = RetryPolicy(deadline_s=10, base_delay_s=0.01)
    d = p.decide(attempt=1, started_s=0, now_s=1, status=429, retry_after_s=2.0)
    assert isinstance(d, Retry) and d.delay_s == 2.0
    g = p.decide(attempt=1, started_s=0, now_s=5, status=429, retry_after_s=30.0)
    assert isinstance(g, GiveUp) and "Retry-After" in g.reason


def test_decide_gives_up_at_deadline_with_fake_clock() -> None:
    p = RetryPolicy(deadline_s=2.0, base_delay_s=0.5, max_delay_s=10, max_attempts=100)
    clock = FakeClock(0.0)
    attempt = 0
    while True:
        attempt += 1
        d = p.decide(attempt=attempt, started_s=0.0, now_s=clock.t, status=503, jitter=0.0)
        if isinstance(d, GiveUp):
            break
        clock.t += d.delay_s
    assert "deadline" in d.reason
    assert clock.t < 2.0
    assert p.timeout_s(0.0, 1.5) == pytest.approx(0.5)


def test_parse_retry_after_forms() -> None:
    assert parse_retry_after("3", 0) == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 1445412470.0) == pytest.approx(10.0)
    assert parse_retry_after("soon", 0) is None
    assert parse_retry_after(None, 0) is None


# ------------------------------------------------------------------------------------- error mapping


def _lower_error_samples() -> list[BaseException]:
    req = httpx.Request("GET", "http://h/")
    resp = httpx.Response(500, request=req)
    return [
        httpx.ConnectError("refused", request=req), httpx.ReadTimeout("slow", request=req),
        httpx.RemoteProtocolError("peer closed", request=req), httpx.ReadError("reset", request=req),
        httpx.HTTPStatusError("500", request=req, response=resp), httpx.InvalidURL("bad"),
        httpx.TooManyRedirects("loop", request=req), httpx.DecodingError("gzip", request=req),
        requests.ConnectionError("refused"), requests.Timeout("slow"), requests.HTTPError("500"),
        requests.exceptions.ChunkedEncodingError("broken"), requests.exceptions.InvalidURL("bad"),
        OSError(errno.EIO, "I/O error"), FileNotFoundError(errno.ENOENT, "No such file", "/x"),
        PermissionError(errno.EACCES, "denied", "/y"), json.JSONDecodeError("bad", "{", 0),
    ]


def test_every_lower_error_is_mapped() -> None:
    samples = _lower_error_samples()
    for base in _lower_error_types():  # every declared lower family has a sample
        assert any(isinstance(s, base) for s in samples), base
    for exc in samples:
        with pytest.raises(R.RegistryError) as info:
            with mapped_errors("op on host/repo"):
                raise exc
        assert "op on host/repo" in str(info.value)
        assert info.value.__cause__ is exc


def test_error_mapping_kinds() -> None:
    req = httpx.Request("GET", "http://h/")
    with pytest.raises(R.RegistryUnavailableError):
        with mapped_errors("x"):
            raise httpx.ConnectTimeout("t", request=req)
    with pytest.raises(R.NotFoundError):
        with mapped_errors("x"):
            raise FileNotFoundError(errno.ENOENT, "nope", "/f")
    with pytest.raises(R.StoreError):
        with mapped_errors("x"):
            raise PermissionError(errno.EACCES, "denied", "/f")
    with pytest.raises(R.RefError):  # our own errors pass through untouched
        with mapped_errors("x"):
            raise R.RefError("bad")


def test_error_tree() -> None:
    for cls in (R.RefError, R.NotFoundError, R.AuthError, R.RegistryUnavailableError, R.ProtocolError,
                R.IntegrityError, R.ArtifactError, R.StoreError, R.BlobRangeError):
        assert issubclass(cls, R.RegistryError)
    assert issubclass(R.BlobRangeError, R.ProtocolError)


# ------------------------------------------------------------------------------------- groups, squash


def test_groups_spec() -> None:
    gs = parse_groups_spec("os=0-2,toolchain=3,app:harness=4-", 6)
    assert [(g.name, g.group_class, g.first, g.last) for g in gs] == [
        ("os", "os", 0, 2), ("toolchain", "toolchain", 3, 3), ("app", "harness", 4, 5)]
    assert [(g.name, g.first, g.last) for g in parse_groups_spec(None, 3)] == [("os", 0, 2)]
    for bad in ("os=1-2", "os=0-1", "os=0-9", "os=0,os=1-2", "os=0,x:nope=1-2", "???"):
        with pytest.raises(R.RefError):
            parse_groups_spec(bad, 3)


def E(path: str, type: str = "file", **kw) -> layerfmt.SourceEntry:  # type: ignore[no-untyped-def]
    return layerfmt.SourceEntry(path, type, **kw)


def _tree(entries: list[layerfmt.SourceEntry]) -> dict[str, str]:
    return {e.path: e.type for e in entries}


def test_squash_applies_whiteouts_and_opaques_in_order() -> None:
    l0 = [E(".", "dir"), E("a", "dir"), E("a/x"), E("a/y"), E("b", "dir"), E("b/z"), E("c")]
    l1 = [E("a/.wh.x", "whiteout"), E("b/.wh..wh..opq", "opaque"), E("b/new"), E(".wh.c", "whiteout"), E("d")]
    l2 = [E("c")]  # re-created after its whiteout
    bottom = squash([l0, l1, l2], bottom=True)
    assert _tree(bottom) == {".": "dir", "a": "dir", "a/y": "file", "b": "dir", "b/new": "file",
                             "d": "file", "c": "file"}


def test_squash_upper_group_keeps_whiteouts_for_lower_groups() -> None:
    l1 = [E("etc/.wh.old", "whiteout"), E("var/.wh..wh..opq", "opaque"), E(".wh.tmp", "whiteout")]
    l2 = [E("tmp", "dir"), E("tmp/f")]  # a directory re-created after its whiteout becomes opaque
    out = _tree(squash([l1, l2], bottom=False))
    assert out == {"etc/.wh.old": "whiteout", "var/.wh..wh..opq": "opaque", "tmp": "dir", "tmp/f": "file",
                   "tmp/.wh..wh..opq": "opaque"}


def test_squash_dir_replaced_by_file_drops_children_and_rekeys_hardlinks() -> None:
    l0 = [E("d", "dir"), E("d/a"), E("h1", link_key=("tar", "h1")), E("h2", link_key=("tar", "h1"))]
    l1 = [E("d"), E("k1", link_key=("tar", "h1"))]
    out = squash([l0, l1], bottom=True)
    assert _tree(out) == {"d": "file", "h1": "file", "h2": "file", "k1": "file"}
    keys = {e.path: e.link_key for e in out}
    assert keys["h1"] == keys["h2"] != keys["k1"]


# ------------------------------------------------------------------------------------- public surface


def test_public_api_is_pinned() -> None:
    expected = {
        "parse_ref", "Ref", "open_store", "resolve_group", "GroupInfo", "publish", "publish_layer_file",
        "PublishResult", "open_layer_ref", "image_config", "ImageConfig", "pull", "PullResult", "PulledGroup",
        "export_oci", "ExportResult", "parse_groups_spec", "Store", "Descriptor", "BlobReader", "LayoutStore",
        "RemoteStore", "RetryPolicy", "local_store_path", "GROUP_ARTIFACT_TYPE", "GROUP_CLASSES",
        "RegistryError", "RefError", "NotFoundError", "AuthError", "RegistryUnavailableError", "ProtocolError",
        "BlobRangeError", "IntegrityError", "ArtifactError", "StoreError", "mapped_errors",
        "ConvertedImage", "ConvertedLayer", "convert_image", "image_lock", "is_image_ref", "lock_for_image",
    }
    assert set(R.__all__) == expected
    fields = set(R.GroupInfo.__dataclass_fields__)
    assert {"ref", "registry", "repo", "manifest_digest", "layer_digest", "layer_size", "toc_digest", "group",
            "group_class", "annotations"} <= fields


def test_open_store_picks_scheme(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WEENV_HOME", str(tmp_path))
    monkeypatch.setenv("WEENV_INSECURE_REGISTRIES", "reg.internal:5000")
    with R.open_store(None) as s:
        assert isinstance(s, R.LayoutStore) and s.root == str(tmp_path / "store")
    cases = {"127.0.0.1:5000": "http", "localhost:1": "http", "reg.internal:5000": "http", "reg.example.com": "https"}
    for host, scheme in cases.items():
        with R.open_store(host) as s:
            assert isinstance(s, R.RemoteStore) and s.scheme == scheme, host
    with R.open_store("127.0.0.1:5000", insecure=False) as s:
        assert s.scheme == "https"


def test_a_registry_that_refuses_deletes_gets_a_clear_error_naming_the_setting() -> None:
    # docker-registry without storage.delete.enabled answers DELETE with 405 UNSUPPORTED
    import httpx

    manifest = b'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}'
    seen = []

    def handle(req: httpx.Request) -> httpx.Response:
        seen.append((req.method, req.url.path))
        if req.method == "GET":
            return httpx.Response(200, content=manifest,
                                  headers={"content-type": "application/vnd.oci.image.manifest.v1+json"})
        return httpx.Response(405, json={"errors": [{"code": "UNSUPPORTED", "message": "The operation is unsupported."}]})

    store = R.RemoteStore("reg.test:5000", insecure=True, credentials=None, transport=httpx.MockTransport(handle))
    with store, pytest.raises(R.StoreError, match=r"reg\.test:5000/snaps: DELETE manifest snap-1 .*"
                                                  r"does not allow deletes.*storage\.delete\.enabled"):
        store.delete_manifest("snaps", "snap-1")
    digest = "sha256:" + __import__("hashlib").sha256(manifest).hexdigest()
    assert seen == [("GET", "/v2/snaps/manifests/snap-1"), ("DELETE", f"/v2/snaps/manifests/{digest}")]
