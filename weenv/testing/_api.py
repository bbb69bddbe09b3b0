"""A daemon client whose daemon is a script, for unit tests of the API server (weenv/api) without a
daemon: :class:`ScriptedDaemon` is a real :class:`weenv.AsyncClient` on a real connection whose
transport answers from ``answers``; put it behind the app with
``create_app(NodeBackend(client=ScriptedDaemon({...})))``.
"""

from __future__ import annotations

from typing import Any

import httpx

from .._aclient import AsyncClient
from .._connection import ApiError, AsyncConnection, EnvNotFoundError


class ScriptedDaemon(AsyncClient):
    """Answers ``{(method, path): answer}``: a JSON value (200), or an :class:`weenv.ApiError` to
    answer as the daemon does; every other call is a 404 ``env_not_found``. Request bodies are
    read (as a daemon reads them). ``calls`` records ``(method, path)`` of every request;
    override :meth:`answer` to compute answers."""

    def __init__(self, answers: dict[tuple[str, str], Any] | None = None):
        self.answers: dict[tuple[str, str], Any] = dict(answers or {})
        self.calls: list[tuple[str, str]] = []
        conn = AsyncConnection("/nonexistent.sock", autostart=False, timeout_s=None,
                               transport=httpx.MockTransport(self._handle))
        conn.mark_started()
        super().__init__(connection=conn)

    def answer(self, request: httpx.Request) -> Any:
        return self.answers.get((request.method, request.url.path))

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        self.calls.append((request.method, request.url.path))
        answer = self.answer(request)
        if answer is None:
            answer = EnvNotFoundError(404, "env_not_found", f"no {request.url.path}")
        if isinstance(answer, ApiError):
            return httpx.Response(answer.status, json={"error": {"kind": answer.kind, "message": answer.detail}})
        if isinstance(answer, httpx.Response):
            return answer
        return httpx.Response(200, json=answer)
