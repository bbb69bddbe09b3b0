"""The ASGI app of ``weenv serve`` and how it is served (hypercorn's trio worker).

One app, three surfaces, told apart per request before anything else runs:

- **envd** (E2B's data plane): a request naming a sandbox, by the ``E2b-Sandbox-Id`` /
  ``E2b-Sandbox-Port`` headers (what the SDK sends to ``E2B_SANDBOX_URL``) or by a host name
  ``{port}-{sandbox_id}.{domain}`` (``--domain``). Needs the env's ``X-Access-Token``.
- **/v1** (weenv's own API, proxied to the daemon) and **/metrics**: ``Authorization: Bearer KEY``.
- everything else: E2B's control plane, ``X-API-Key: KEY``.

:class:`Gate` (pure ASGI, outermost: each surface is its own Starlette app inside it) classifies, checks the
credential with constant-time comparisons, counts and logs refusals, times every answer, and
puts the caller (``weenv.key``) or the target env (``weenv.env``) into the scope.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import re
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import anyio

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._backend import Backend, NodeBackend
from ._common import ENVD_PORT, ApiState, HttpError, daemon_errors, key_of, log, state_of
from ._metrics import ApiMetrics
from ._store import AccessTokens, KeyStore, OwnerTable, TemplateStore

__all__ = ["Gate", "create_app", "serve"]

_HOST_ROUTE = re.compile(r"^(\d{1,5})-([A-Za-z0-9][A-Za-z0-9_.-]{0,127})$")
_PROXY_PATH = re.compile(r"^/proxy/([A-Za-z0-9][A-Za-z0-9_.-]{0,127})/(\d{1,5})(/.*)?$")
_ENV_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def sandbox_target(headers: Headers, domain: str | None) -> tuple[str, int] | None:
    """``(env id, port)`` when the request is for a sandbox (E2B's two ways of naming one)."""
    sid = headers.get("e2b-sandbox-id")
    if sid:
        try:
            port = int(headers.get("e2b-sandbox-port") or ENVD_PORT)
        except ValueError:
            port = -1
        return sid, port
    if domain:
        host = (headers.get("host") or "").rsplit(":", 1)[0] if "]" not in (headers.get("host") or "") else ""
        suffix = "." + domain
        if host.lower().endswith(suffix.lower()):
            m = _HOST_ROUTE.match(host[: -len(suffix)])
            if m:
                return m.group(2), int(m.group(1))
    return None


def _surface(path: str) -> str:
    if path == "/metrics":
        return "metrics"
    if path == "/v1" or path.startswith("/v1/"):
        return "v1"
    return "e2b"


def _refusal(surface: str, status: int, kind: str, message: str) -> Response:
    if surface == "v1":
        body: Any = {"error": {"kind": kind, "message": message}}
    elif surface == "envd":
        # a Connect error body (a string code) that REST clients read as {"message": ...} too
        body = {"code": "unauthenticated" if status == 401 else "not_found", "message": message}
    elif surface == "metrics":
        return Response(message + "\n", status, media_type="text/plain")
    else:
        body = {"code": status, "message": message}
    return Response(msgspec.json.encode(body), status, media_type="application/json")


class Gate:
    """Classify the request, check its credential, time and count its answer."""

    def __init__(self, control: ASGIApp, envd: ASGIApp, state: ApiState):
        self.control, self.envd, self.state = control, envd, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.control(scope, receive, send)
            return
        headers = Headers(scope=scope)
        target = sandbox_target(headers, self.state.domain)
        path = scope["path"]
        m = _PROXY_PATH.match(path) if target is None else None
        if m is not None:
            target, path = (m.group(1), int(m.group(2))), m.group(3) or "/"
        elif target is not None:
            path = scope.get("raw_path", path.encode()).decode("latin-1").split("?", 1)[0] or path
        if target is not None and target[1] != ENVD_PORT:
            await self._port(scope, receive, send, headers, target, path)
            return
        if scope["type"] == "websocket":  # only env ports speak WebSocket
            await receive()
            await send({"type": "websocket.close", "code": 1008, "reason": "no WebSocket routes but env ports"})
            return
        surface = "envd" if target is not None else _surface(scope["path"])
        started = time.perf_counter()
        status_box = [0]

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                self.state.metrics.latency.labels(surface).observe(time.perf_counter() - started)
            await send(message)

        try:
            refusal = self._check(scope, headers, surface, target)
            if refusal is not None:
                await refusal(scope, receive, timed_send)
            elif target is not None:
                await self.envd(scope, receive, timed_send)
            else:
                await self.control(scope, receive, timed_send)
        finally:
            self.state.metrics.requests.labels(surface, scope.get("method", "WS"), str(status_box[0] or 500)).inc()

    def _check(self, scope: Scope, headers: Headers, surface: str, target: tuple[str, int] | None) -> Response | None:
        client = scope.get("client") or ("?", 0)
        if target is not None:
            env_id, port = target
            if not self.state.tokens.verify(env_id, headers.get("x-access-token")) and \
                    not self._signed(scope, env_id):
                reason = "missing_token" if not headers.get("x-access-token") else "wrong_token"
                self._failed(surface, reason, client, scope["path"])
                return _refusal(surface, 401, "unauthorized", f"missing or wrong X-Access-Token for sandbox {env_id}")
            scope["weenv.env"] = env_id
            return None
        presented = None
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            presented = auth[7:].strip()
        presented = presented or headers.get("x-api-key")
        key = self.state.keys.verify(presented)
        if key is None:
            reason = "missing_key" if not presented else "wrong_key"
            self._failed(surface, reason, client, scope["path"])
            hint = "Authorization: Bearer KEY" if surface in ("v1", "metrics") else "X-API-Key: KEY"
            return _refusal(surface, 401, "unauthorized", f"{'no' if not presented else 'unknown'} API key: send "
                            f"{hint} (keys: `weenv token create`)")
        scope["weenv.key"] = key
        return None

    async def _port(self, scope: Scope, receive: Receive, send: Send, headers: Headers, target: tuple[str, int],
                    path: str) -> None:
        """A request for an env port (not envd): public unless the env was made with public traffic
        off, then it needs the env's traffic token (``e2b-traffic-access-token``)."""
        from ._proxy import Tunnel, TunnelError, proxy_http, proxy_websocket

        env_id, port = target
        started = time.perf_counter()
        status = 101 if scope["type"] == "websocket" else 0

        async def refuse(code: int, message: str) -> None:
            nonlocal status
            status = code
            if scope["type"] == "websocket":
                await receive()
                await send({"type": "websocket.close", "code": 1008 if code in (401, 404) else 1011,
                            "reason": message[:120]})
            else:
                await _refusal("e2b", code, "", message)(scope, receive, send)

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.state.metrics.latency.labels("port").observe(time.perf_counter() - started)
            await send(message)

        try:
            rec = self.state.owners.env(env_id) if _ENV_ID.match(env_id) else None
            if rec is None or not 1 <= port <= 65535:
                await refuse(404, f"sandbox {env_id!r} not found" if rec is None else f"port {port} is not a port")
                return
            if rec.get("public_traffic") is False and \
                    not self.state.tokens.verify_traffic(env_id, headers.get("e2b-traffic-access-token")):
                self._failed("port", "missing_traffic_token" if not headers.get("e2b-traffic-access-token")
                             else "wrong_traffic_token", scope.get("client") or ("?", 0), scope["path"])
                await refuse(403, f"sandbox {env_id} takes traffic only with its e2b-traffic-access-token")
                return
            try:
                tunnel = await Tunnel.open(self.state.backend.for_env(env_id), env_id, port)
            except (TunnelError, HttpError) as e:  # HttpError: the backend's (a cluster's env on a lost node: 410)
                await refuse(e.status, e.message)
                return
            try:
                host = headers.get("host") or f"127.0.0.1:{port}"
                if scope["type"] == "websocket":
                    await proxy_websocket(scope, receive, send, tunnel, path, host)
                else:
                    await proxy_http(scope, receive, timed_send, tunnel, path, host)
            finally:
                await tunnel.aclose()
        finally:
            self.state.metrics.requests.labels("port", scope.get("method", "WS"), str(status or 500)).inc()

    def _signed(self, scope: Scope, env_id: str) -> bool:
        """A ``/files`` URL signed as the SDK's ``download_url``/``upload_url`` sign them: sha256 of
        ``path:operation:user:token[:expiration]``, unexpired (E2B's v1 signature)."""
        if scope["path"] != "/files" or scope["method"] not in ("GET", "POST"):
            return False
        q = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if not q.get("signature") or "path" not in q:
            return False
        expiration = q.get("signature_expiration")
        if expiration is not None and (not expiration.isdigit() or int(expiration) < time.time()):
            return False
        operation = "read" if scope["method"] == "GET" else "write"
        raw = f"{q['path']}:{operation}:{q.get('username', '')}:{self.state.tokens.mint(env_id)}"
        if expiration is not None:
            raw += f":{expiration}"
        expected = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()
        return hmac.compare_digest(expected, q["signature"])

    def _failed(self, surface: str, reason: str, client: tuple[str, int], path: str) -> None:
        self.state.metrics.auth_failures.labels(surface, reason).inc()
        log.warning("refused %s request from %s:%s to %s: %s", surface, client[0], client[1], path, reason)


def _as_http_error(request: Request, exc: Exception) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    assert isinstance(exc, StarletteHTTPException)  # routing: no such path (404), wrong method (405)
    what = "not a route weenv serve has" if exc.status_code == 404 else str(exc.detail)
    return HttpError(exc.status_code, "not_found" if exc.status_code == 404 else "bad_request",
                     f"{request.method} {request.url.path}: {what}")


async def _control_error(request: Request, exc: Exception) -> Response:
    e = _as_http_error(request, exc)
    return _refusal(_surface(request.url.path), e.status, e.kind, e.message)


async def _envd_error(request: Request, exc: Exception) -> Response:
    """envd's REST errors: ``{"code": status, "message": ...}`` (Connect calls answer their own)."""
    e = _as_http_error(request, exc)
    return Response(msgspec.json.encode({"code": e.status, "message": e.message}), e.status,
                    media_type="application/json")


async def _metrics(request: Request) -> Response:
    state = state_of(request)
    if not key_of(request).admin:
        raise HttpError(403, "forbidden", "/metrics needs an admin key (`weenv token create --admin`)")
    parts = [state.metrics.text()]
    for client in state.backend.all():
        async with daemon_errors():
            parts.append((await client._request("GET", "/v1/metrics")).content)
    return Response(b"".join(parts), 200, media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(backend: Backend | None = None, *, domain: str | None = None, home: str | None = None) -> ASGIApp:
    """The whole API as one ASGI app (``home``: where keys, templates and owners live; default $WEENV_HOME/api)."""
    from . import _e2b, _envd, _native

    state = ApiState(backend=backend or NodeBackend(), keys=KeyStore(home), owners=OwnerTable(home),
                     templates=TemplateStore(home), tokens=AccessTokens(home), metrics=ApiMetrics(), domain=domain)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_e2b.pause_reaper, state)
            state.tasks = tg
            yield
            state.tasks = None
            tg.cancel_scope.cancel()
        await state.backend.aclose()

    control = Starlette(routes=[Route("/metrics", _metrics, methods=["GET"]), *_native.routes(), *_e2b.routes()],
                        exception_handlers={HttpError: _control_error, StarletteHTTPException: _control_error},
                        lifespan=lifespan)
    envd = Starlette(routes=_envd.routes(),
                     exception_handlers={HttpError: _envd_error, StarletteHTTPException: _envd_error})
    control.state.api = envd.state.api = state
    gate = Gate(control, envd, state)
    gate.state = state  # type: ignore[attr-defined]
    return gate


async def serve(app: ASGIApp, listen: str = "127.0.0.1:3000", *, certfile: str | None = None,
                keyfile: str | None = None, task_status: Any = None) -> None:
    """Serve ``app`` on ``listen`` (``host:port``; ``[v6]:port``) with hypercorn's trio worker."""
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    httpx_log = logging.getLogger("httpx")
    if httpx_log.level == logging.NOTSET:  # a line per daemon request (~0.1 ms each), unless asked for
        httpx_log.setLevel(logging.WARNING)
    config = Config()
    config.bind = [listen]
    config.accesslog = None
    config.keep_alive_timeout = 75
    config.h11_max_incomplete_size = 64 * 1024
    if certfile or keyfile:
        if not (certfile and keyfile):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        config.certfile, config.keyfile = certfile, keyfile
    kw = {} if task_status is None else {"task_status": task_status}
    await hypercorn_serve(app, config, shutdown_trigger=trio.sleep_forever, **kw)  # type: ignore[arg-type]
