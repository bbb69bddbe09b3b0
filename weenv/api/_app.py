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
from functools import partial
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

from .._routes import PathError, split_path
from ._backend import Backend, NodeBackend
from ._common import ENVD_PORT, ApiState, HttpError, daemon_errors, key_of, log, owner_id, state_of
from ._e2b_requests import ImageRouting
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
    from ._docker import is_docker_path

    if is_docker_path(path):
        return "docker"
    if path == "/metrics":
        return "metrics"
    if path == "/v1" or path.startswith("/v1/"):
        return "v1"
    return "e2b"


def _refusal(surface: str, status: int, kind: str, message: str) -> Response:
    if surface == "v1":
        body: Any = {"error": {"kind": kind, "message": message}}
    elif surface == "docker":
        body = {"message": message}  # Docker's error shape
    elif surface == "envd":
        # a Connect error body (a string code) that REST clients read as {"message": ...} too
        body = {"code": "unauthenticated" if status == 401 else "not_found", "message": message}
    elif surface == "metrics":
        return Response(message + "\n", status, media_type="text/plain")
    else:
        body = {"code": status, "message": message}
    return Response(msgspec.json.encode(body), status, media_type="application/json")


PORT_REFUSED_STATUS = 502
HEALTH_TIMEOUT_S = 5.0


def _port_refusal(env_id: str, port: int) -> str:
    """One answer for every port request that cannot go through, whatever the reason."""
    return (f"sandbox {env_id[:128]!r} has no open port {port} this request may reach (no such sandbox, "
            "nothing listens there, or its ports need X-Access-Token or e2b-traffic-access-token)")


async def _health(state: ApiState) -> Response:
    """The server's health: 200 when every daemon behind it answers ``/v1/ping``, else 503 naming
    which do not (``weenv serve`` is no use without its daemon)."""
    answers = []
    for client in state.backend.daemons():
        try:
            with anyio.fail_after(HEALTH_TIMEOUT_S):
                resp = await client.send_route("ping")
                await resp.aread()
                await resp.aclose()
            answers.append(resp.status_code < 400)
        except Exception:  # a daemon that does not answer, whatever the way (a timeout too)
            answers.append(False)
    ok = bool(answers) and all(answers)
    body = {"status": "ok" if ok else "degraded",
            "daemon": "answers" if ok else f"{answers.count(False)} of {len(answers)} daemons do not answer"}
    return Response(msgspec.json.encode(body), 200 if ok else 503, media_type="application/json")


def _path_problem(scope: Scope, surface: str) -> str | None:
    """Why the request's path cannot be read one way only (weenv/_routes.py), or None. Read from
    the path as it came (``raw_path``): routes match its segments, each decoded once."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, (bytes, bytearray)) else \
        urllib.parse.quote(scope["path"], safe="/")
    path = path.split("?", 1)[0]
    if path == "/":
        return None
    slash_ok_from = 1 if surface == "e2b" and path.startswith("/templates/") else None  # namespace/name:tag
    try:
        split_path(path, slash_ok_from=slash_ok_from)
    except PathError as e:
        return e.message
    return None


class Gate:
    """Classify the request, check its credential, time and count its answer."""

    def __init__(self, control: ASGIApp, envd: ASGIApp, state: ApiState, docker: ASGIApp | None = None):
        self.control, self.envd, self.state, self.docker = control, envd, state, docker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.control(scope, receive, send)
            return
        headers = Headers(scope=scope)
        on_docker_socket = scope.get("weenv.docker_socket") is not None  # every path there is Docker's
        target = None if on_docker_socket else sandbox_target(headers, self.state.domain)
        path = scope["path"]
        m = _PROXY_PATH.match(path) if target is None and not on_docker_socket else None
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
        surface = "docker" if on_docker_socket else "envd" if target is not None else _surface(scope["path"])
        if target is None and not on_docker_socket and scope["path"] == "/health" and \
                scope.get("method") in ("GET", "HEAD"):
            await (await _health(self.state))(scope, receive, send)  # no key: what a load balancer asks
            return
        problem = _path_problem(scope, surface)
        if problem is not None:
            self.state.metrics.requests.labels(surface, scope.get("method", "?"), "400").inc()
            await _refusal(surface, 400, "bad_path", problem)(scope, receive, send)
            return
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
                await self._wake(target[0])
                await self.envd(scope, receive, timed_send)
            elif surface == "docker" and self.docker is not None:
                await self.docker(scope, receive, timed_send)
            else:
                await self.control(scope, receive, timed_send)
        finally:
            self.state.metrics.requests.labels(surface, scope.get("method", "WS"), str(status_box[0] or 500)).inc()

    def _check(self, scope: Scope, headers: Headers, surface: str, target: tuple[str, int] | None) -> Response | None:
        client = scope.get("client") or ("?", 0)
        socket_key = scope.get("weenv.docker_socket")
        if socket_key is not None:  # who reaches the socket (its file's mode says who) is its configured key
            key = next((k for k in self.state.keys.list() if k.name == socket_key), None)
            if key is None:
                return _refusal("docker", 401, "unauthorized", f"the Docker socket's key {socket_key!r} was revoked")
            scope["weenv.key"] = key
            return None
        if target is not None:
            env_id, port = target
            signed = None if self._env_token_ok(env_id, headers.get("x-access-token")) else self._signed(scope, env_id)
            if signed == "expired":
                self._failed(surface, "expired_signature", client, scope["path"])
                return _refusal("e2b", 401, "unauthorized", "signature is already expired")  # E2B's own answer
            if signed is not None and signed != "ok":
                reason = "missing_token" if not headers.get("x-access-token") else "wrong_token"
                self._failed(surface, reason, client, scope["path"])
                return _refusal(surface, 401, "unauthorized", f"missing or wrong X-Access-Token for sandbox {env_id}")
            scope["weenv.env"] = env_id
            return None
        if surface == "e2b" and scope.get("method") == "PUT" and not headers.get("x-api-key"):
            from ._e2b_templates import upload_signer  # a template upload link, signed for its owner key

            signer = upload_signer(self.state, scope)
            if signer is not None:
                scope["weenv.key"] = signer
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
            hint = "Authorization: Bearer KEY" if surface in ("v1", "metrics", "docker") else "X-API-Key: KEY"
            return _refusal(surface, 401, "unauthorized", f"{'no' if not presented else 'unknown'} API key: send "
                            f"{hint} (keys: `weenv token create`)")
        scope["weenv.key"] = key
        return None

    def _env_owner(self, env_id: str) -> str | None:
        """The live owner key id of a well-formed env id ("" for an env with no API record), or None."""
        if not _ENV_ID.match(env_id):
            return None
        owners = self.state.owners
        return owner_id(self.state, owners.env(env_id) or owners.gone(env_id))

    def _env_token_ok(self, env_id: str, presented: str | None) -> bool:
        """``presented`` is the env's access token, and the key that owns the env still exists."""
        owner = self._env_owner(env_id) if presented else None
        return owner is not None and self.state.tokens.verify(env_id, owner, presented)

    def _may_reach_port(self, env_id: str, headers: Headers) -> bool:
        """A port of an env answers its access token, its traffic token, or anyone when its owner
        made its ports public (E2B's default; a ``/v1`` create's ``public_traffic: true``)."""
        owner = self._env_owner(env_id)
        if owner is None:
            return False
        rec = self.state.owners.env(env_id) or {}
        if rec.get("public_traffic", "on_timeout" in rec) is True:
            return True  # "on_timeout": an E2B sandbox recorded before public_traffic was (public by default)
        if self.state.tokens.verify(env_id, owner, headers.get("x-access-token")):
            return True
        return self.state.tokens.verify_traffic(env_id, owner, headers.get("e2b-traffic-access-token"))

    async def _port(self, scope: Scope, receive: Receive, send: Send, headers: Headers, target: tuple[str, int],
                    path: str) -> None:
        """A request for an env port (not envd). Whatever stops it (no such env, a closed port,
        a missing or wrong token, an env on the node's own network) gets the same answer, so the
        port proxy tells nobody which env ids exist."""
        from ._proxy import Tunnel, TunnelError, proxy_http, proxy_websocket

        env_id, port = target
        started = time.perf_counter()
        status = 101 if scope["type"] == "websocket" else 0

        async def refuse(why: str) -> None:
            nonlocal status
            status = PORT_REFUSED_STATUS
            log.info("port request for %s:%s refused: %s", env_id[:128], port, why)
            message = _port_refusal(env_id, port)
            if scope["type"] == "websocket":
                await receive()
                await send({"type": "websocket.close", "code": 1011, "reason": message[:120]})
            else:
                await _refusal("e2b", PORT_REFUSED_STATUS, "", message)(scope, receive, send)

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.state.metrics.latency.labels("port").observe(time.perf_counter() - started)
            await send(message)

        try:
            if not 1 <= port <= 65535 or not self._may_reach_port(env_id, headers):
                if headers.get("x-access-token") or headers.get("e2b-traffic-access-token"):
                    self._failed("port", "wrong_token", scope.get("client") or ("?", 0), scope["path"])
                await refuse("no such env, or no credential that opens its ports")
                return
            await self._wake(env_id)
            try:
                tunnel = await Tunnel.open(self.state.backend.for_env(env_id), env_id, port)
            except (TunnelError, HttpError) as e:  # HttpError: the backend's (a cluster's env on a lost node: 410)
                if isinstance(e, HttpError) or e.status == 503:
                    # the node's condition (its daemon does not answer, the env's node was lost), told
                    # to a caller who may reach the env's ports: no secret of which envs exist
                    status = e.status
                    await _refusal("e2b", e.status, "", e.message)(scope, receive, send)
                    return
                await refuse(e.message)  # a closed port, an env on the node's network
                return
            try:
                mask = (self.state.owners.env(env_id) or {}).get("mask_request_host")
                # E2B's network.mask_request_host: the Host the env's server sees, ${PORT} its port
                host = mask.replace("${PORT}", str(port)) if mask else headers.get("host") or f"127.0.0.1:{port}"
                if scope["type"] == "websocket":
                    await proxy_websocket(scope, receive, send, tunnel, path, host)
                else:
                    await proxy_http(scope, receive, timed_send, tunnel, path, host)
            finally:
                await tunnel.aclose()
        finally:
            self.state.metrics.requests.labels("port", scope.get("method", "WS"), str(status or 500)).inc()

    async def _wake(self, env_id: str) -> None:
        """A request for a sandbox its timeout paused with ``auto_resume``: resumed first (E2B's lifecycle)."""
        from ._e2b import wake

        try:
            await wake(self.state, env_id)
        except HttpError as e:
            log.warning("waking sandbox %s on its traffic: %s", env_id[:128], e.message)

    def _signed(self, scope: Scope, env_id: str) -> str:
        """A ``/files`` URL signed as the SDK's ``download_url``/``upload_url`` sign them: sha256 of
        ``path:operation:user:token[:expiration]`` (E2B's v1 signature). ``"ok"``, ``"expired"`` (the
        signature is right, its time is up) or ``"no"``."""
        if scope["path"] != "/files" or scope["method"] not in ("GET", "POST"):
            return "no"
        q = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if not q.get("signature") or "path" not in q:
            return "no"
        expiration = q.get("signature_expiration")
        if expiration is not None and not expiration.lstrip("-").isdigit():
            return "no"
        operation = "read" if scope["method"] == "GET" else "write"
        owner = self._env_owner(env_id)
        if owner is None:
            return "no"
        raw = f"{q['path']}:{operation}:{q.get('username', '')}:{self.state.tokens.mint(env_id, owner)}"
        if expiration is not None:
            raw += f":{expiration}"
        expected = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()
        if not hmac.compare_digest(expected, q["signature"]):
            return "no"
        return "expired" if expiration is not None and int(expiration) < time.time() else "ok"

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
    from ._native import daemon_metrics

    async with daemon_errors():
        parts = [state.metrics.text(), await daemon_metrics(state)]
    return Response(b"".join(parts), 200, media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(backend: Backend | None = None, *, domain: str | None = None, home: str | None = None,
               registries: frozenset[str] | set[str] | list[str] | None = None,
               image_routing: ImageRouting | None = None) -> ASGIApp:
    """The whole API as one ASGI app (``home``: where keys, templates and owners live; default
    $WEENV_HOME/api; ``registries``: ``host[:port]`` a non-admin key's plans may read from, beside
    the embedded store; default ``$WEENV_REGISTRIES``; ``image_routing``: creates whose metadata
    names an image start it)."""
    from . import _docker, _e2b, _e2b_templates, _e2b_volumes, _envd, _keys, _native, _reaper, _tenant
    from ._quota import Quotas

    keys, owners = KeyStore(home), OwnerTable(home)
    state = ApiState(backend=backend or NodeBackend(), keys=keys, owners=owners,
                     templates=TemplateStore(home), tokens=AccessTokens(home), metrics=ApiMetrics(), domain=domain,
                     quotas=Quotas(keys, owners),
                     registries=frozenset(registries) if registries is not None else _tenant.registries_from_env(),
                     image_routing=image_routing)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_e2b.pause_reaper, state)
            tg.start_soon(_reaper.housekeeping, state)
            state.tasks = tg
            yield
            state.tasks = None
            tg.cancel_scope.cancel()
        await state.backend.aclose()
        await anyio.to_thread.run_sync(owners.flush)

    control = Starlette(routes=[Route("/metrics", _metrics, methods=["GET"]), *_keys.routes(), *_native.routes(),
                                *_e2b_templates.routes(), *_e2b.routes()],
                        exception_handlers={HttpError: _control_error, StarletteHTTPException: _control_error},
                        lifespan=lifespan)
    envd = Starlette(routes=_envd.routes(),
                     exception_handlers={HttpError: _envd_error, StarletteHTTPException: _envd_error})
    control.state.api = envd.state.api = state
    docker = _docker.create_docker_app(state)
    gate = _e2b_volumes.ContentGate(Gate(control, envd, state, docker), state, control)  # /volumes, /volumecontent
    gate.state = state  # type: ignore[attr-defined]
    return gate


class DockerSocketApp:
    """The app as the Docker socket serves it: every request is Docker's, made as key ``key_name``
    (the socket's mode, 0660 root, says who may connect). The TCP listen's server runs the app's
    lifespan; this one answers its own."""

    def __init__(self, app: ASGIApp, key_name: str):
        self.gate = getattr(app, "app", app)  # the Gate, not ContentGate (/volumecontent is E2B's)
        self.key_name = key_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await self.gate({**scope, "weenv.docker_socket": self.key_name}, receive, send)


def docker_socket(path: str) -> Any:
    """A listening Unix socket at ``path``, mode 0660 from its first moment (owner root when run as
    root); a stale socket file there is replaced, any other file is an error."""
    import os
    import socket
    import stat

    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
        else:
            raise ValueError(f"--docker {path}: a file that is not a socket is there")
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    if os.geteuid() == 0:
        os.chown(path, 0, 0)
    sock.listen(128)
    return sock


async def serve(app: ASGIApp, listen: str = "127.0.0.1:3000", *, certfile: str | None = None,
                keyfile: str | None = None, task_status: Any = None, docker: str | None = None,
                docker_key: str = "docker-socket") -> None:
    """Serve ``app`` on ``listen`` (``host:port``; ``[v6]:port``) with hypercorn's trio worker;
    ``docker``: also the Docker API on this Unix socket path, as key ``docker_key``."""
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from ._contain import contain_connections
    from ._hijack import allow_hijack

    contain_connections()  # no request stops the server: a failing connection ends alone (docs/security.md)
    allow_hijack()  # Docker's exec streams: 101 then the raw connection
    httpx_log = logging.getLogger("httpx")
    if httpx_log.level == logging.NOTSET:  # a line per daemon request (~0.1 ms each), unless asked for
        httpx_log.setLevel(logging.WARNING)

    def config_for(bind: str) -> Config:
        config = Config()
        config.bind = [bind]
        config.accesslog = None
        config.keep_alive_timeout = 75
        config.h11_max_incomplete_size = 64 * 1024
        return config

    config = config_for(listen)
    if certfile or keyfile:
        if not (certfile and keyfile):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        config.certfile, config.keyfile = certfile, keyfile
    kw = {} if task_status is None else {"task_status": task_status}
    if docker is None:
        await hypercorn_serve(app, config, shutdown_trigger=trio.sleep_forever, **kw)  # type: ignore[arg-type]
        return
    sock = docker_socket(docker)
    try:
        stopped = trio.Event()  # hypercorn's serve ends on Ctrl-C (in the main task): the socket's then ends too
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(hypercorn_serve, DockerSocketApp(app, docker_key),  # type: ignore[arg-type]
                                       config_for(f"fd://{sock.fileno()}"), shutdown_trigger=stopped.wait))
            try:
                await hypercorn_serve(app, config, shutdown_trigger=trio.sleep_forever, **kw)  # type: ignore[arg-type]
            finally:
                stopped.set()
    finally:
        import os

        with contextlib.suppress(OSError):  # hypercorn closed it already
            sock.close()
        with contextlib.suppress(OSError):
            os.unlink(docker)
