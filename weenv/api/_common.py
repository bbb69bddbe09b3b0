"""What every part of the API server shares: its state, its errors, and translating the daemon's."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from starlette.requests import Request

from .._connection import ApiError as DaemonError
from .._connection import DaemonUnavailableError
from .._wire import API_STATUS, HttpError
from ._backend import Backend
from ._metrics import ApiMetrics
from ._store import AccessTokens, ApiKey, KeyStore, OwnerTable, TemplateStore, may_use, owns

log = logging.getLogger("weenv.api")

ENVD_PORT = 49983
ENVD_VERSION = "0.6.4"
"""What envd version the SDK is told: 0.6.1 turns on what weenv serves (default user, octet-stream
uploads, recursive watch) and keeps off what it does not (file metadata, entries in watch events),
which the SDK then refuses with a clear TemplateException instead of weenv silently ignoring it."""


@dataclass
class ApiState:
    backend: Backend
    keys: KeyStore
    owners: OwnerTable
    templates: TemplateStore
    tokens: AccessTokens
    metrics: ApiMetrics
    domain: str | None = None
    watchers: dict[str, Any] = field(default_factory=dict)
    tasks: Any = None
    """The server's task group (its lifespan), for work that outlives a request: command deadlines."""
    kill_timers: dict[tuple[str, int], Any] = field(default_factory=dict)
    """(env id, pid) -> the cancel scope of that command's deadline timer."""
    quotas: Any = None
    """Per-key limits (weenv/api/_quota.py)."""
    registries: frozenset[str] = frozenset()
    """Registries a non-admin key's refs may name (``weenv serve --registry``), beside the embedded store."""
    image_routing: Any = None
    """Images named by a create's metadata (:class:`weenv.api.ImageRouting`), or None."""
    docker: Any = None
    """The Docker API's containers and exec instances (weenv/api/_docker_containers.py), made on first use."""
    template_builds: Any = None
    """Templates built through the E2B SDK (:class:`weenv.api._e2b_templates.Builds`), made on first use."""

    def envs_gone(self, env_ids: list[str]) -> None:
        """The envs are gone: their API records (the owners kept a while), watchers and timers."""
        self.owners.forget_envs(env_ids)
        for env_id in env_ids:
            self.forget_env(env_id)

    def forget_env(self, env_id: str) -> None:
        """An env is gone: what the server kept for it goes too (its watchers, command timers)."""
        for wid in [wid for wid, w in self.watchers.items() if getattr(w, "env_id", None) == env_id]:
            del self.watchers[wid]
        for k in [k for k in self.kill_timers if k[0] == env_id]:
            self.kill_timers.pop(k).cancel()




def state_of(request: Request) -> ApiState:
    return request.app.state.api  # type: ignore[no-any-return]


def key_of(request: Request) -> ApiKey:
    return request.scope["weenv.key"]  # type: ignore[no-any-return]




@asynccontextmanager
async def daemon_errors() -> AsyncIterator[None]:
    """The daemon's errors as :class:`HttpError`, keeping its status and kind (one place for all routes)."""
    try:
        yield
    except DaemonUnavailableError as e:
        log.error("the daemon does not answer: %s", e)  # its socket path is the operator's business
        raise HttpError(503, "daemon_unavailable", "the node's weenv daemon does not answer") from None
    except DaemonError as e:
        raise HttpError(API_STATUS.get(e.kind, e.status), e.kind, e.detail) from None


_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def owned(state: ApiState, key: ApiKey, env_id: str) -> dict[str, Any]:
    """The env's API record if ``key`` may use it; a 404 otherwise (another key's env does not exist)."""
    if not _ID.match(env_id) or ".." in env_id:
        raise HttpError(404, "env_not_found", f"sandbox {env_id!r} not found")
    rec = state.owners.env(env_id)
    if rec is None:
        if key.admin:
            return {"owner": None}
        raise HttpError(404, "env_not_found", f"sandbox {env_id!r} not found")
    if not may_use(key, rec):
        raise HttpError(404, "env_not_found", f"sandbox {env_id!r} not found")
    return rec


def owned_snapshot(state: ApiState, key: ApiKey, snap_id: str) -> dict[str, Any] | None:
    rec = state.owners.snapshot(snap_id)
    if rec is not None and may_use(key, rec):
        return rec
    return None


def owner_id(state: ApiState, rec: dict[str, Any] | None) -> str | None:
    """The id of the live key that owns an env (``rec``: its API record), ``""`` for an env made on
    the node's socket (no record: only admin keys reach it), None when its key was revoked."""
    if rec is None or rec.get("owner") is None and rec.get("owner_id") is None:
        return ""
    if rec.get("owner_id") is not None:
        return str(rec["owner_id"]) if state.keys.live(str(rec["owner_id"])) is not None else None
    for key in state.keys.list():  # a record from before key ids: its name, if that key is older
        if owns(key, rec):
            return key.id
    return None


def env_token(state: ApiState, env_id: str, rec: dict[str, Any] | None) -> str:
    """The env's access token (``envdAccessToken``), bound to its owner key."""
    return state.tokens.mint(env_id, owner_id(state, rec) or "")


def traffic_token(state: ApiState, env_id: str, rec: dict[str, Any] | None) -> str:
    return state.tokens.mint_traffic(env_id, owner_id(state, rec) or "")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` (never buffered past it)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, "too_large", f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def relay(resp: httpx.Response) -> AsyncIterator[bytes]:
    """A daemon answer's body as it comes; the daemon connection is released however the client
    goes (a disconnect cancels the response task, and a BackgroundTask would then not run)."""
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await resp.aclose()
