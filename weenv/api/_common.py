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

from .._client import ApiError as DaemonError
from .._client import DaemonUnavailableError
from ._backend import Backend
from ._metrics import ApiMetrics
from ._store import AccessTokens, ApiKey, KeyStore, OwnerTable, TemplateStore

log = logging.getLogger("weenv.api")

ENVD_PORT = 49983
ENVD_VERSION = "0.6.1"
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


class HttpError(Exception):
    """An answer other than success: ``status``, a machine ``kind`` and a message for people."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def state_of(request: Request) -> ApiState:
    return request.app.state.api  # type: ignore[no-any-return]


def key_of(request: Request) -> ApiKey:
    return request.scope["weenv.key"]  # type: ignore[no-any-return]


_KIND_STATUS = {"not_admitted": 429}  # the node is full: E2B's "too many sandboxes" is a 429


@asynccontextmanager
async def daemon_errors() -> AsyncIterator[None]:
    """The daemon's errors as :class:`HttpError`, keeping its status and kind (one place for all routes)."""
    try:
        yield
    except DaemonUnavailableError as e:
        log.error("the daemon does not answer: %s", e)  # its socket path is the operator's business
        raise HttpError(503, "daemon_unavailable", "the node's weenv daemon does not answer") from None
    except DaemonError as e:
        raise HttpError(_KIND_STATUS.get(e.kind, e.status), e.kind, e.detail) from None


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
    if not key.admin and rec.get("owner") != key.name:
        raise HttpError(404, "env_not_found", f"sandbox {env_id!r} not found")
    return rec


def owned_snapshot(state: ApiState, key: ApiKey, snap_id: str) -> dict[str, Any] | None:
    rec = state.owners.snapshot(snap_id)
    if rec is not None and (key.admin or rec.get("owner") == key.name):
        return rec
    return None


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
