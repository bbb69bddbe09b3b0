"""The remote store: an OCI distribution registry over HTTP(S).

httpx (HTTP/1.1, keep-alive pool) carries Range reads, HEADs, manifests and tags; oras-py carries
blob uploads (its upload-session protocol: POST, then PUT or PATCH…PUT with the digest), with
its single I/O method ``do_request`` routed through the same auth, retry and timeout policy as
everything else. docs/registry.md says why manifests go through httpx rather than oras.

Every exchange has a timeout cut to what remains of the operation's deadline; 429/5xx and
transport failures are retried with jittered backoff (see :mod:`._retry`); 401 challenges are
answered through :class:`._auth.Authenticator`. Redirects (blob storage) are followed for blob
reads; httpx drops ``Authorization`` when the redirect leaves the registry's origin.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from .._tls import default_tls_context
from ._auth import Authenticator, Credentials, Denied, FetchToken, UseHeader, load_credentials, scope_for
from ._errors import (
    AuthError,
    BlobRangeError,
    IntegrityError,
    NotFoundError,
    ProtocolError,
    RegistryError,
    RegistryUnavailableError,
    StoreError,
    mapped_errors,
)
from ._oci import ACCEPT_MANIFESTS, sha256_digest
from ._ref import check_digest, is_digest
from ._retry import GiveUp, RetryPolicy, default_jitter, parse_retry_after
from ._store import Descriptor, ProgressFn, Store

T = TypeVar("T")

MONOLITHIC_UPLOAD_MAX_BYTES = 16 << 20  # above this, PATCH chunks so memory stays bounded
UPLOAD_CHUNK_BYTES = 16 << 20
MAX_RANGE_SKIP_BYTES = 64 << 20  # a Range answered by 200 is stream-skipped up to here, then refused
UPLOAD_ATTEMPTS = 3  # whole upload sessions (POST … PUT) tried before giving up
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_SESSION_METHODS = frozenset({"PATCH", "PUT"})  # requests inside an upload session: never resent alone


@dataclass
class RemoteStats:
    """Counters tests and benchmarks assert on."""

    requests: int = 0
    retries: int = 0
    auth_rounds: int = 0
    range_ignored: int = 0
    uploaded_bytes: int = 0
    by_method: dict[str, int] = field(default_factory=dict)


class _Transient(Exception):
    """A failure inside a response handler that deserves a retry (short body, reset mid-body)."""


def _quote_repo(repo: str) -> str:
    return quote(repo, safe="/")


class RemoteStore(Store):
    """A :class:`Store` over a registry at ``registry`` (``host[:port]``)."""

    def __init__(
        self,
        registry: str,
        *,
        insecure: bool = False,
        credentials: Credentials | None = None,
        policy: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        pool_connections: int = 16,
        max_range_skip_bytes: int = MAX_RANGE_SKIP_BYTES,
        transport: httpx.BaseTransport | None = None,
    ):
        self.registry = registry
        self.scheme = "http" if insecure else "https"
        self.base_url = f"{self.scheme}://{registry}"
        self.policy = policy or RetryPolicy()
        self.max_range_skip_bytes = max_range_skip_bytes
        self.stats = RemoteStats()
        self._clock, self._sleep = clock, sleep
        self._jitter = default_jitter()
        if credentials is None:
            credentials = load_credentials(registry)
        self.auth = Authenticator(registry, credentials, clock)
        self._auth_lock = threading.Lock()
        limits = httpx.Limits(max_connections=pool_connections, max_keepalive_connections=pool_connections,
                              keepalive_expiry=30.0)
        self._http = httpx.Client(http1=True, http2=False, limits=limits, transport=transport,
                                  verify=default_tls_context(),  # one per process (weenv/_tls.py)
                                  timeout=httpx.Timeout(self.policy.request_timeout_s, connect=self.policy.connect_timeout_s),
                                  headers={"User-Agent": "weenv"}, trust_env=False)
        self._oras: Any = None
        self._op = threading.local()  # the running operation's deadline, for reads of response bodies

    def __repr__(self) -> str:
        return f"RemoteStore({self.base_url!r})"

    def close(self) -> None:
        self._http.close()
        if self._oras is not None:
            self._oras.session.close()

    # ------------------------------------------------------------------ the one request loop

    def _count(self, method: str) -> None:
        self.stats.requests += 1
        self.stats.by_method[method] = self.stats.by_method.get(method, 0) + 1

    def _fetch_token(self, step: FetchToken, started: float, where: str) -> None:
        headers = {"Authorization": step.authorization} if step.authorization else {}
        timeout = self.policy.timeout_s(started, self._clock())
        with mapped_errors(f"{where}: token request to {step.realm}"):
            self._count("GET")
            r = self._http.get(step.realm, params=step.params, headers=headers, timeout=timeout, follow_redirects=True)
        self.stats.auth_rounds += 1
        result = self.auth.token_received(step.scope, r.status_code, r.content)
        if isinstance(result, Denied):
            raise AuthError(f"{where}: {result.message}")

    def _answer_challenge(self, response_headers: Any, scope: str, retried: bool, started: float, where: str) -> None:
        with self._auth_lock:
            step = self.auth.respond(response_headers.get("www-authenticate"), scope, retried=retried)
            if isinstance(step, Denied):
                raise AuthError(f"{where}: {step.message}")
            if isinstance(step, FetchToken):
                self._fetch_token(step, started, where)
            else:
                assert isinstance(step, UseHeader)
                self.stats.auth_rounds += 1

    def _backoff(self, where: str, attempt: int, started: float, *, status: int | None = None,
                 error: str | None = None, retry_after: str | None = None) -> None:
        decision = self.policy.decide(
            attempt=attempt, started_s=started, now_s=self._clock(), status=status, error=error,
            retry_after_s=parse_retry_after(retry_after, time.time()), jitter=self._jitter(),
        )
        if isinstance(decision, GiveUp):
            raise RegistryUnavailableError(f"{where}: {decision.reason}")
        self.stats.retries += 1
        self._sleep(decision.delay_s)

    def _call(
        self,
        method: str,
        path: str,
        scope: str,
        handle: Callable[[httpx.Response], T],
        *,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
        follow_redirects: bool = False,
        where: str,
    ) -> T:
        """Send with auth, timeouts and retries; ``handle`` reads the (streamed) response.

        ``handle`` sees every non-401 answer that is not a retryable 429/5xx; it may raise
        :class:`_Transient` (or let an httpx transport error escape) to retry.
        """
        url = path if path.startswith(("http://", "https://")) else self.base_url + path
        started = self._clock()
        self._op.deadline_at, self._op.where = started + self.policy.deadline_s, where
        attempt = 0
        auth_retried = False
        while True:
            attempt += 1
            h = dict(headers or {})
            auth = self.auth.header(scope)
            if auth:
                h["Authorization"] = auth
            timeout = self.policy.timeout_s(started, self._clock())
            try:
                req = self._http.build_request(
                    method, url, headers=h, content=content,
                    timeout=httpx.Timeout(timeout, connect=min(timeout, self.policy.connect_timeout_s)),
                )
                self._count(method)
                resp = self._http.send(req, stream=True, follow_redirects=follow_redirects)
                try:
                    status = resp.status_code
                    if status == 401:
                        resp.close()
                        self._answer_challenge(resp.headers, scope, auth_retried, started, where)
                        auth_retried = True
                        attempt -= 1  # answering a challenge is not a failure
                        continue
                    if status == 403:
                        raise AuthError(f"{where}: access denied (HTTP 403){_error_detail(resp)}")
                    if status in _RETRY_STATUS:
                        retry_after = resp.headers.get("retry-after")
                        resp.close()
                        self._backoff(where, attempt, started, status=status, retry_after=retry_after)
                        continue
                    return handle(resp)
                finally:
                    resp.close()
            except _Transient as e:
                self._backoff(where, attempt, started, error=str(e))
            except httpx.TransportError as e:
                self._backoff(where, attempt, started, error=f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            except httpx.InvalidURL as e:
                raise ProtocolError(f"{where}: invalid URL {url!r}: {e}") from None

    def _check_deadline(self, received: int) -> None:
        deadline_at = getattr(self._op, "deadline_at", None)
        if deadline_at is not None and self._clock() >= deadline_at:
            raise RegistryUnavailableError(
                f"{self._op.where}: deadline of {self.policy.deadline_s:.1f}s reached while reading the body "
                f"({received} bytes received)")

    def _read_body(self, resp: httpx.Response) -> bytes:
        """The whole body, within the operation's deadline.

        httpx's read timeout bounds each socket read, not the body: a server that trickles bytes
        would hold a read for ever. The clock is checked after every socket read, so
        the body ends at the deadline, late by at most one read's timeout (itself cut to what
        remained of the deadline when the request went out).
        """
        out = bytearray()
        for part in resp.iter_bytes():  # no chunk size: one part per socket read, not buffered up
            out += part
            self._check_deadline(len(out))
        return bytes(out)

    # ------------------------------------------------------------------ Store

    def _where(self, repo: str, what: str) -> str:
        return f"{self.registry}/{repo}: {what}"

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str]:
        where = self._where(repo, f"GET manifest {reference}")

        def handle(resp: httpx.Response) -> tuple[bytes, str]:
            if resp.status_code == 404:
                raise NotFoundError(f"{where}: not found{_error_detail(resp)}")
            if resp.status_code != 200:
                raise ProtocolError(f"{where}: unexpected HTTP {resp.status_code}{_error_detail(resp)}")
            data = self._read_body(resp)
            expected = reference if is_digest(reference) else resp.headers.get("docker-content-digest")
            if expected and expected.startswith("sha256:") and sha256_digest(data) != expected:
                raise IntegrityError(f"{where}: manifest bytes hash to {sha256_digest(data)}, expected {expected}")
            media_type = resp.headers.get("content-type", "").split(";")[0].strip()
            if not media_type:
                media_type = _json_media_type(data)
            return data, media_type

        return self._call("GET", f"/v2/{_quote_repo(repo)}/manifests/{reference}", scope_for(repo), handle,
                          headers={"Accept": ACCEPT_MANIFESTS}, where=where)

    def resolve(self, repo: str, reference: str) -> Descriptor:
        data, media_type = self.get_manifest(repo, reference)
        digest = sha256_digest(data)
        return Descriptor(media_type, digest, len(data), {}, _json_field(data, "artifactType"))

    def put_manifest(self, repo: str, data: bytes, media_type: str, tag: str | None = None) -> str:
        digest = sha256_digest(data)
        where = self._where(repo, f"PUT manifest {tag or digest}")

        def handle(resp: httpx.Response) -> str:
            if resp.status_code not in (200, 201):
                if resp.status_code == 404:
                    raise NotFoundError(f"{where}: registry refused: {resp.status_code}{_error_detail(resp)}")
                raise ProtocolError(f"{where}: registry refused the manifest: HTTP {resp.status_code}{_error_detail(resp)}")
            got = resp.headers.get("docker-content-digest")
            if got and got != digest:
                raise IntegrityError(f"{where}: registry stored {got}, we sent {digest}")
            return digest

        return self._call("PUT", f"/v2/{_quote_repo(repo)}/manifests/{tag or digest}", scope_for(repo, push=True),
                          handle, headers={"Content-Type": media_type}, content=data, where=where)

    def has_blob(self, repo: str, digest: str) -> bool:
        check_digest(digest)
        where = self._where(repo, f"HEAD blob {digest}")

        def handle(resp: httpx.Response) -> bool:
            if resp.status_code == 200:
                return True
            if resp.status_code == 404:
                return False
            raise ProtocolError(f"{where}: unexpected HTTP {resp.status_code}")

        return self._call("HEAD", f"/v2/{_quote_repo(repo)}/blobs/{digest}", scope_for(repo), handle,
                          follow_redirects=True, where=where)

    def blob_size(self, repo: str, digest: str) -> int:
        check_digest(digest)
        where = self._where(repo, f"HEAD blob {digest}")

        def handle(resp: httpx.Response) -> int:
            if resp.status_code == 404:
                raise NotFoundError(f"{where}: not found")
            if resp.status_code != 200 or not resp.headers.get("content-length", "").isdigit():
                raise ProtocolError(f"{where}: HTTP {resp.status_code} without a Content-Length")
            return int(resp.headers["content-length"])

        return self._call("HEAD", f"/v2/{_quote_repo(repo)}/blobs/{digest}", scope_for(repo), handle,
                          follow_redirects=True, where=where)

    def read_blob(self, repo: str, digest: str, offset: int, length: int) -> bytes:
        check_digest(digest)
        where = self._where(repo, f"GET blob {digest} bytes {offset}..{offset + length}")
        if offset < 0 or length < 0:
            raise BlobRangeError(f"{where}: negative offset or length")
        if length == 0:
            return b""
        last = offset + length - 1

        def handle(resp: httpx.Response) -> bytes:
            status = resp.status_code
            if status == 206:
                start = _content_range_start(resp.headers.get("content-range"))
                if start is not None and start != offset:
                    raise ProtocolError(f"{where}: registry answered bytes from {start}")
                data = self._read_body(resp)
                if len(data) != length:
                    if start is None and len(data) < length:
                        raise BlobRangeError(f"{where}: only {len(data)} bytes exist there")
                    raise _Transient(f"short body: {len(data)} of {length} bytes")
                return data
            if status == 200:
                return self._skip_to_range(resp, offset, length, where)
            if status == 416:
                # docker-registry's 416 carries a Content-Length it never sends: never read the body
                raise BlobRangeError(f"{where}: range not satisfiable (HTTP 416): the blob is shorter")
            if status == 404:
                raise NotFoundError(f"{where}: blob not found{_error_detail(resp)}")
            raise ProtocolError(f"{where}: unexpected HTTP {status}{_error_detail(resp)}")

        return self._call("GET", f"/v2/{_quote_repo(repo)}/blobs/{digest}", scope_for(repo), handle,
                          headers={"Range": f"bytes={offset}-{last}", "Accept-Encoding": "identity"},
                          follow_redirects=True, where=where)

    def _skip_to_range(self, resp: httpx.Response, offset: int, length: int, where: str) -> bytes:
        """A Range answered with the whole blob: stream past ``offset`` (bounded), keep ``length`` bytes."""
        self.stats.range_ignored += 1
        if offset > self.max_range_skip_bytes:
            raise ProtocolError(
                f"{where}: the registry ignored the Range header (HTTP 200 with the whole blob); refusing to "
                f"stream past {offset} bytes (limit {self.max_range_skip_bytes}) — fix the registry or its proxy"
            )
        out = bytearray()
        pos = 0
        for part in resp.iter_raw():  # one part per socket read: the deadline is checked after each
            self._check_deadline(pos)
            end = pos + len(part)
            if end > offset:
                out += part[max(0, offset - pos) : offset + length - pos]
                if len(out) >= length:
                    break
            pos = end
        if len(out) < length:
            total = resp.headers.get("content-length")
            if total is not None and total.isdigit() and int(total) < offset + length:
                raise BlobRangeError(f"{where}: the blob has only {total} bytes")
            raise _Transient(f"body ended after {pos} bytes while skipping to the range")
        return bytes(out)

    def iter_blob(self, repo: str, digest: str, size: int, chunk_bytes: int = 8 << 20):  # type: ignore[no-untyped-def]
        # Ranged pieces rather than one long GET: a reset costs one piece, and each piece retries.
        yield from super().iter_blob(repo, digest, size, chunk_bytes)

    def list_tags(self, repo: str) -> list[str]:
        where = self._where(repo, "list tags")
        tags: list[str] = []
        path: str | None = f"/v2/{_quote_repo(repo)}/tags/list"
        while path:
            def handle(resp: httpx.Response) -> str | None:
                if resp.status_code == 404:
                    return None  # NAME_UNKNOWN: a repository with no tags
                if resp.status_code != 200:
                    raise ProtocolError(f"{where}: unexpected HTTP {resp.status_code}{_error_detail(resp)}")
                body = self._read_body(resp)
                with mapped_errors(where):
                    page = json.loads(body) if body else {}
                tags.extend(t for t in (page.get("tags") or []) if isinstance(t, str))
                link = resp.links.get("next", {}).get("url")
                return link

            path = self._call("GET", path, scope_for(repo), handle, where=where)
        return sorted(set(tags))

    def delete_manifest(self, repo: str, tag: str) -> bool:
        try:
            digest = self.resolve(repo, tag).digest
        except NotFoundError:
            return False
        where = self._where(repo, f"DELETE manifest {tag} ({digest})")

        def handle(resp: httpx.Response) -> bool:
            if resp.status_code in (200, 202):
                return True
            if resp.status_code == 404:
                return False  # gone since we resolved it
            if resp.status_code == 405:
                raise StoreError(f"{where}: this registry does not allow deletes (HTTP 405{_error_detail(resp)}); "
                                 "docker-registry needs storage.delete.enabled: true")
            raise ProtocolError(f"{where}: unexpected HTTP {resp.status_code}{_error_detail(resp)}")

        return self._call("DELETE", f"/v2/{_quote_repo(repo)}/manifests/{digest}", scope_for(repo, delete=True),
                          handle, where=where)

    def put_blob(self, repo: str, digest: str, path: str, size: int, *, progress: ProgressFn | None = None) -> int:
        check_digest(digest)
        if self.has_blob(repo, digest):
            return 0
        where = self._where(repo, f"upload blob {digest} ({size} bytes)")
        actual = os.path.getsize(path)
        if actual != size:
            raise IntegrityError(f"{where}: {path} has {actual} bytes, expected {size}")
        uploader = self._uploader()
        layer = {"mediaType": "application/octet-stream", "digest": digest, "size": size}
        container = uploader.get_container(repo)
        started = self._clock()
        for attempt in range(1, UPLOAD_ATTEMPTS + 1):
            sent = [0]

            def counted(n: int) -> None:
                sent[0] += n
                if progress is not None:
                    progress(n)

            uploader.begin(repo, where, counted)
            try:
                with mapped_errors(where):
                    if size <= MONOLITHIC_UPLOAD_MAX_BYTES:
                        resp = uploader.put_upload(path, container, layer)
                    else:
                        resp = uploader.chunked_upload(path, container, layer, chunk_size=UPLOAD_CHUNK_BYTES)
                break
            except RegistryUnavailableError as e:
                if progress is not None and sent[0]:
                    progress(-sent[0])  # the bar goes back: the next session resends everything
                if attempt == UPLOAD_ATTEMPTS or self.policy.expired(started, self._clock()):
                    raise
                self._backoff(where, attempt, started, error=str(e))
            except ValueError as e:  # oras reports refused upload steps as ValueError
                raise ProtocolError(f"{where}: {e}") from None
            finally:
                uploader.end()
        if resp.status_code == 400 and "DIGEST_INVALID" in resp.text:
            raise IntegrityError(f"{where}: the registry computed another digest for {path}")
        if resp.status_code not in (200, 201, 204):
            raise ProtocolError(f"{where}: upload not accepted: HTTP {resp.status_code} {resp.text[:200]}")
        got = resp.headers.get("docker-content-digest")
        if got and got != digest:
            raise IntegrityError(f"{where}: registry stored {got}")
        self.stats.uploaded_bytes += size
        return size

    def _uploader(self) -> Any:
        if self._oras is None:
            self._oras = _make_oras_uploader(self)
        return self._oras


# ---------------------------------------------------------------------------- oras bridge


def _make_oras_uploader(store: RemoteStore) -> Any:
    """An oras-py client whose every request goes through the store's auth/retry/timeout policy."""
    import oras.provider
    import requests

    class _Uploader(oras.provider.Registry):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(hostname=store.registry, insecure=store.scheme == "http")
            self.session.trust_env = False
            self._local = threading.local()

        def begin(self, repo: str, where: str, progress: ProgressFn | None) -> None:
            self._local.ctx = (repo, where, progress)

        def end(self) -> None:
            self._local.ctx = None

        def do_request(self, url: str, method: str = "GET", data: Any = None, headers: dict | None = None,
                       json: Any = None, stream: bool = False) -> requests.Response:
            repo, where, progress = self._local.ctx
            scope = scope_for(repo, push=True)
            started = store._clock()
            attempt = 0
            auth_retried = False
            while True:
                attempt += 1
                h = dict(headers or {})
                auth = store.auth.header(scope)
                if auth:
                    h["Authorization"] = auth
                timeout = store.policy.timeout_s(started, store._clock())
                try:
                    store._count(method)
                    r = self.session.request(method, url, data=data, json=json, headers=h, stream=stream,
                                             timeout=(min(timeout, store.policy.connect_timeout_s), timeout),
                                             allow_redirects=method in ("GET", "HEAD"))
                except (requests.ConnectionError, requests.Timeout) as e:
                    if method in _SESSION_METHODS:  # the upload session's state is unknown: restart it
                        raise RegistryUnavailableError(f"{where}: {method} failed: {type(e).__name__}") from None
                    store._backoff(where, attempt, started, error=f"{type(e).__name__}")
                    continue
                if r.status_code == 401:
                    store._answer_challenge(r.headers, scope, auth_retried, started, where)
                    auth_retried = True
                    attempt -= 1
                    continue
                if r.status_code == 403:
                    raise AuthError(f"{where}: access denied (HTTP 403) on {method}")
                if r.status_code in _RETRY_STATUS:
                    if method in _SESSION_METHODS:
                        raise RegistryUnavailableError(f"{where}: HTTP {r.status_code} on {method}")
                    store._backoff(where, attempt, started, status=r.status_code,
                                   retry_after=r.headers.get("retry-after"))
                    continue
                if progress is not None and method in ("PUT", "PATCH") and isinstance(data, (bytes, bytearray)) \
                        and r.status_code in (201, 202, 204):
                    progress(len(data))
                return r

    return _Uploader()


# ---------------------------------------------------------------------------- helpers


def _content_range_start(value: str | None) -> int | None:
    if not value or not value.startswith("bytes "):
        return None
    try:
        return int(value[6:].split("-", 1)[0])
    except ValueError:
        return None


def _error_detail(resp: httpx.Response) -> str:
    """The registry's own error codes (``{"errors":[{"code":…,"message":…}]}``), when it sent some."""
    try:
        body = resp.read()
    except (httpx.HTTPError, RegistryError):
        return ""
    if not body or len(body) > 64 << 10:
        return ""
    try:
        import json

        errors = json.loads(body).get("errors") or []
        return ": " + "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
    except (ValueError, AttributeError):
        return ""


def _json_field(data: bytes, name: str) -> str | None:
    import json

    try:
        v = json.loads(data).get(name)
    except (ValueError, AttributeError):
        return None
    return v if isinstance(v, str) else None


def _json_media_type(data: bytes) -> str:
    mt = _json_field(data, "mediaType")
    if mt is None:
        raise ProtocolError("manifest without Content-Type or mediaType")
    return mt
