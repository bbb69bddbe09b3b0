"""The connection to a weenv daemon (its Unix socket) or to ``weenv serve`` and the cluster gateway
(a URL): requests by route name (weenv/_routes.py), errors mapped in one place, the local daemon
started when it is not running. The clients (weenv/_client.py, weenv/_aclient.py) sit on it; so
does whatever relays a daemon's answers (weenv/api).

    conn = Connection()                                    # $WEENV_HOST, else the node's daemon socket
    info = conn.request("env_show", {"id": "bb-1a2b3c4d"}).json()
    with conn.stream("process_stream", {"id": "bb-1a2b3c4d", "pid": 2}) as resp: ...

Errors, one tree (every lower error is mapped at :func:`raise_for` or by the connection)::

    WeenvError
    ├── DaemonUnavailableError   the daemon is not running (and could not be started) or does not answer
    └── ApiError                 the daemon answered an error: ``status``, ``kind``, ``detail``
        └── EnvNotFoundError     kind ``env_not_found``

Target: a socket path, a ``http(s)://`` URL (with ``token``, sent as ``Authorization: Bearer``),
or by default ``$WEENV_HOST`` (and ``$WEENV_TOKEN``), else ``$WEENV_HOME/run/weenv.sock``. A
remote target is never autostarted. A Ray cluster's gateway is found by :mod:`weenv.cluster`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx

from . import _home
from . import _routes
from ._tls import async_uds_transport, uds_transport

__all__ = ["ApiError", "AsyncConnection", "Connection", "DaemonUnavailableError", "EnvNotFoundError",
           "WeenvError", "daemon_answers", "error_for", "is_url", "raise_for", "resolve_target", "start_daemon"]


class WeenvError(Exception):
    """Base of every error the client raises."""


class DaemonUnavailableError(WeenvError):
    """Raised when the daemon is not running (and could not be started) or does not answer."""


class ApiError(WeenvError):
    """Raised when the daemon answers with an error; ``status`` is the HTTP status, ``kind`` its error kind."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.detail = status, kind, message


class EnvNotFoundError(ApiError, LookupError):
    """Raised for an env id the daemon does not know."""


_KIND_CLASSES: dict[str, type[ApiError]] = {"env_not_found": EnvNotFoundError}


def error_for(status: int, kind: str, message: str) -> ApiError:
    """The exception for an error answer (its class chosen by ``kind``)."""
    return _KIND_CLASSES.get(kind, ApiError)(status, kind, message)


def raise_for(resp: httpx.Response) -> None:
    """Raise the :class:`ApiError` a read error answer stands for (nothing for a success)."""
    if resp.status_code < 400:
        return
    try:
        err = resp.json()["error"]
        kind, message = err.get("kind", "error"), err.get("message", resp.text)
    except (ValueError, KeyError, TypeError, AttributeError):
        kind, message = "error", resp.text or resp.reason_phrase
    raise error_for(resp.status_code, kind, message)


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def resolve_target(socket_path_or_url: str | None) -> str:
    """What a connection talks to: the argument, else ``$WEENV_HOST``, else the node's daemon socket."""
    if (socket_path_or_url or "").startswith("ray://"):
        raise WeenvError(f"{socket_path_or_url}: a Ray cluster address; find its gateway with "
                         "weenv.cluster.gateway_url(ADDRESS) (or weenv.cluster.client(ADDRESS, token=...))")
    return socket_path_or_url or os.environ.get("WEENV_HOST") or _home.daemon_socket()


def _http_options(target: str, token: str | None) -> dict[str, Any]:
    """httpx client options for a socket path (the local daemon) or a ``weenv serve`` URL."""
    if not is_url(target):
        return {"base_url": "http://weenv"}
    token = token or os.environ.get("WEENV_TOKEN")
    return {"base_url": target.rstrip("/"), "headers": {"Authorization": f"Bearer {token}"} if token else {}}


def _check_path(request: httpx.Request) -> None:
    """Every request's path reads one way only (weenv/_routes.py), whoever built it."""
    try:
        _routes.split_path(request.url.raw_path.decode("ascii").split("?", 1)[0])
    except _routes.PathError as e:
        raise WeenvError(f"refusing to send {request.method} with a path that reads more than one way: {e}") from None


async def _acheck_path(request: httpx.Request) -> None:
    _check_path(request)


# ------------------------------------------------------------------------------- autostart


def daemon_answers(socket_path: str, timeout_s: float = 2.0) -> bool:
    """Whether a daemon answers ``/v1/ping`` on ``socket_path``."""
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=timeout_s) as c:
            return c.get("http://weenv/v1/ping").status_code == 200
    except httpx.TransportError:
        return False


def start_daemon(socket_path: str, timeout_s: float = 30.0) -> None:
    """Start ``weenv daemon`` in the background (own session, log in $WEENV_HOME) and wait for it.

    Clients starting at once start one daemon (a lock file in $WEENV_HOME/run serialises them).
    ``WEENV_AUTOSTART=0`` turns autostart off (the test suite does: it starts its daemons itself).
    """
    import fcntl

    if os.environ.get("WEENV_AUTOSTART", "1") == "0":
        raise DaemonUnavailableError(f"the weenv daemon is not running ({socket_path}) and WEENV_AUTOSTART=0")
    home = os.path.dirname(os.path.dirname(socket_path))
    os.makedirs(os.path.join(home, "run"), exist_ok=True)
    with open(os.path.join(home, "run", "autostart.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if daemon_answers(socket_path):
            return  # another client started it while we waited for the lock
        log = open(os.path.join(home, "daemon.log"), "ab")
        try:
            subprocess.Popen([sys.executable, "-m", "weenv", "daemon"], stdin=subprocess.DEVNULL, stdout=log,
                             stderr=log, start_new_session=True, env={**os.environ, "WEENV_HOME": home})
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if daemon_answers(socket_path):
                return
            time.sleep(0.05)
    raise DaemonUnavailableError(f"the weenv daemon did not start within {timeout_s:g} s (see {home}/daemon.log)")


# ------------------------------------------------------------------------------- connections

_DEFAULT: Any = object()


def _send_kw(route: str, params: Mapping[str, Any] | None, query: Any, json: Any, content: Any,
             headers: Mapping[str, str] | None, timeout: Any) -> tuple[str, str, dict[str, Any]]:
    spec = _routes.by_name(route)
    kw: dict[str, Any] = {"params": query, "json": json, "content": content, "headers": headers}
    if timeout is not _DEFAULT:
        kw["timeout"] = timeout
    return spec.method, spec.path(**dict(params or {})), {k: v for k, v in kw.items() if v is not None or k == "timeout"}


class _Base:
    def __init__(self, target: str | None, token: str | None, autostart: bool) -> None:
        self.target = resolve_target(target)
        self.remote = is_url(self.target)
        self.autostart = autostart and not self.remote
        self.token = token
        self._started = False

    @property
    def socket_path(self) -> str:
        """The target (a socket path or a URL): the name older code knows it by."""
        return self.target

    def _unavailable(self, e: Exception) -> DaemonUnavailableError:
        return DaemonUnavailableError(f"weenv daemon at {self.target}: {e}")


class Connection(_Base):
    """A synchronous connection (``httpx.Client``); ``transport`` replaces the network (tests)."""

    def __init__(self, target: str | None = None, *, token: str | None = None, timeout_s: float | None = 300.0,
                 autostart: bool = True, transport: httpx.BaseTransport | None = None):
        super().__init__(target, token, autostart)
        if transport is None and not self.remote:
            transport = uds_transport(self.target)
        self.http = httpx.Client(transport=transport, timeout=timeout_s, event_hooks={"request": [_check_path]},
                                 **_http_options(self.target, token))

    def ensure(self) -> None:
        """Once: check the daemon answers, starting it (socket targets, ``autostart``) when it does not."""
        if self._started:
            return
        try:
            self.http.get("/v1/ping", timeout=5.0)
        except httpx.TransportError:
            if not self.autostart:
                raise DaemonUnavailableError(f"the weenv daemon is not running ({self.target})") from None
            start_daemon(self.target)
        self._started = True

    def request(self, route: str, params: Mapping[str, Any] | None = None, *, query: Any = None, json: Any = None,
                content: Any = None, headers: Mapping[str, str] | None = None, timeout: Any = _DEFAULT) -> httpx.Response:
        """Route ``route`` with path ``params``; the read answer, or the ApiError it stands for."""
        method, path, kw = _send_kw(route, params, query, json, content, headers, timeout)
        self.ensure()
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise self._unavailable(e) from None
        raise_for(resp)
        return resp

    @contextlib.contextmanager
    def stream(self, route: str, params: Mapping[str, Any] | None = None, *, query: Any = None, json: Any = None,
               content: Any = None, headers: Mapping[str, str] | None = None,
               timeout: Any = _DEFAULT) -> Iterator[httpx.Response]:
        """Route ``route``, its answer open as it streams (an error answer is read and raised)."""
        method, path, kw = _send_kw(route, params, query, json, content, headers, timeout)
        self.ensure()
        try:
            with self.http.stream(method, path, **kw) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise_for(resp)
                yield resp
        except httpx.TransportError as e:
            raise self._unavailable(e) from None

    def close(self) -> None:
        self.http.close()


class AsyncConnection(_Base):
    """An async connection (``httpx.AsyncClient``: asyncio or trio)."""

    def __init__(self, target: str | None = None, *, token: str | None = None, timeout_s: float | None = 300.0,
                 autostart: bool = True, transport: httpx.AsyncBaseTransport | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(target, token, autostart)
        if transport is None and not self.remote:
            transport = async_uds_transport(self.target)
        options = _http_options(self.target, token)
        if headers:
            options["headers"] = {**options.get("headers", {}), **headers}
        self.http = httpx.AsyncClient(transport=transport, timeout=timeout_s,
                                      event_hooks={"request": [_acheck_path]}, **options)

    @property
    def authorization(self) -> str | None:
        """The ``Authorization`` header value this connection sends (a remote daemon API's token)."""
        return self.http.headers.get("authorization")

    def mark_started(self) -> None:
        """Skip the first ping (the caller knows the daemon answers: a node report says so)."""
        self._started = True

    async def ensure(self) -> None:
        if self._started:
            return
        try:
            await self.http.get("/v1/ping", timeout=5.0)
        except httpx.TransportError:
            if not self.autostart:
                raise DaemonUnavailableError(f"the weenv daemon is not running ({self.target})") from None
            import anyio.to_thread  # httpx's own async backend layer: works under asyncio and trio

            await anyio.to_thread.run_sync(start_daemon, self.target)
        self._started = True

    async def request(self, route: str, params: Mapping[str, Any] | None = None, *, query: Any = None,
                      json: Any = None, content: Any = None, headers: Mapping[str, str] | None = None,
                      timeout: Any = _DEFAULT) -> httpx.Response:
        method, path, kw = _send_kw(route, params, query, json, content, headers, timeout)
        await self.ensure()
        try:
            resp = await self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise self._unavailable(e) from None
        raise_for(resp)
        return resp

    async def send(self, route: str, params: Mapping[str, Any] | None = None, *, query: Any = None,
                   json: Any = None, content: Any = None, headers: Mapping[str, str] | None = None,
                   timeout: Any = None) -> httpx.Response:
        """Route ``route``; its answer streamed, **whatever its status** (the caller reads or closes
        it): for relaying a daemon's answer as it comes. No timeout unless given."""
        method, path, kw = _send_kw(route, params, query, json, content, headers, timeout)
        await self.ensure()
        req = self.http.build_request(method, path, **kw)
        try:
            return await self.http.send(req, stream=True)
        except httpx.TransportError as e:
            raise self._unavailable(e) from None

    @contextlib.asynccontextmanager
    async def stream(self, route: str, params: Mapping[str, Any] | None = None, *, query: Any = None,
                     json: Any = None, content: Any = None, headers: Mapping[str, str] | None = None,
                     timeout: Any = _DEFAULT) -> AsyncIterator[httpx.Response]:
        method, path, kw = _send_kw(route, params, query, json, content, headers, timeout)
        await self.ensure()
        try:
            async with self.http.stream(method, path, **kw) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise_for(resp)
                yield resp
        except httpx.TransportError as e:
            raise self._unavailable(e) from None

    async def aclose(self) -> None:
        await self.http.aclose()
