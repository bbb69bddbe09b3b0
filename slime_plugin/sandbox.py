"""A weenv env behind slime's ``Sandbox`` protocol (``slime/agent/sandbox.py``).

    async with WeenvSandbox(plan="task.lock") as sb:
        code, out, err = await sb.exec("pytest -q", timeout=600)

It talks to the local weenv daemon through :class:`weenv.AsyncClient` (httpx over the daemon's
Unix socket), so nothing blocks slime's asyncio loop. Every call has a deadline of its own
(``op_timeout_s``, plus the command's timeout for ``exec``), so a daemon that stops answering
becomes a :class:`~slime_plugin.SandboxError`, never a hang.

Behaviour matched to slime's E2B backend, which agent code is written against:

- ``exec`` returns ``(exit_code, stdout, stderr)`` and raises only with ``check=True`` (a
  :class:`~slime_plugin.CommandFailedError`, which is also a ``RuntimeError``). A command past its
  ``timeout`` is killed: its exit code is what weenv reports (137) and stderr ends with a
  ``[weenv: command timed out …]`` line. ``timeout <= 0`` means no limit. ``idempotent`` is
  accepted and ignored: the daemon is local and nothing is retried.
- ``read_file`` of a missing file returns ``""``; other failures raise.
- ``write_file`` takes ``str``, ``bytes`` or a host :class:`~pathlib.Path` (read off the loop).
- ``__aexit__`` kills the env and only logs if that fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import weenv

from ._errors import CapacityError, CommandFailedError, SandboxError, SandboxNotStartedError, SnapshotUnavailableError

logger = logging.getLogger(__name__)

ExecResult = tuple[int, str, str]
FileContent = str | bytes | Path

# Statuses with which a daemon without snapshot support answers commit/fork.
_UNSUPPORTED_STATUSES = (404, 405, 501)
_background: set[asyncio.Task] = set()


async def kill_env_quietly(env: Any, *, timeout_s: float = 60.0) -> bool:
    """Kill ``env`` even if the caller is being cancelled; log, never raise. True if it is gone."""

    async def kill() -> None:
        async with asyncio.timeout(timeout_s):
            await env.kill()

    task = asyncio.ensure_future(kill())
    _background.add(task)
    task.add_done_callback(_background.discard)
    try:
        await asyncio.shield(task)
        return True
    except asyncio.CancelledError:
        raise  # the shielded kill runs on to completion in the background
    except Exception as e:  # noqa: BLE001 - teardown must not mask the caller's outcome
        logger.warning("[weenv] kill %s failed: %s: %s", getattr(env, "id", "?"), type(e).__name__, e)
        return False


class WeenvSandbox:
    """slime's ``Sandbox`` over one weenv env. Give exactly one of ``plan`` and ``snapshot``.

    ``plan``: a plan or lock path, a dict, or a :class:`weenv.plan.Plan`. ``snapshot``: a snapshot
    id. ``client``: a shared :class:`weenv.AsyncClient` (default: a private one on
    ``socket_path``, closed on exit). The other options are passed to ``create``."""

    def __init__(
        self,
        *,
        plan: Any = None,
        snapshot: str | None = None,
        client: Any = None,
        socket_path: str | None = None,
        autostart: bool = True,
        name: str | None = None,
        ttl_s: float | None = None,
        cpu: float | str | None = None,
        memory: int | str | None = None,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        op_timeout_s: float = 300.0,
    ) -> None:
        if (plan is None) == (snapshot is None):
            raise TypeError("WeenvSandbox needs exactly one of plan= and snapshot=")
        self.source = plan if plan is not None else snapshot
        self.create_options = dict(name=name, ttl_s=ttl_s, cpu=cpu, memory=memory, env=env, workdir=workdir, user=user)
        self.op_timeout_s = op_timeout_s
        self.sandbox_id = ""
        self._client = client
        self._socket_path = socket_path
        self._autostart = autostart
        self._owns_client = client is None
        self._env: Any = None
        self._closed = False

    @classmethod
    def from_env(cls, env: Any, *, op_timeout_s: float = 300.0) -> WeenvSandbox:
        """Wrap an already running :class:`weenv.AsyncEnv`; ``__aexit__`` kills it."""
        sb = cls(snapshot=env.id, client=env.client, op_timeout_s=op_timeout_s)
        sb.source = None  # already created: __aenter__ has nothing to do
        sb._env = env
        sb.sandbox_id = env.id
        return sb

    @property
    def env(self) -> Any:
        """The underlying :class:`weenv.AsyncEnv`."""
        if self._env is None or self._closed:
            raise SandboxNotStartedError("use the sandbox inside `async with`", sandbox_id=self.sandbox_id)
        return self._env

    @property
    def closed(self) -> bool:
        """True once :meth:`close` (or ``__aexit__``) ran."""
        return self._closed

    @contextlib.contextmanager
    def _translate(self, operation: str) -> Iterator[None]:
        """The one place where weenv client and host errors become :class:`SandboxError`."""
        try:
            yield
        except SandboxError:
            raise
        except weenv.EnvNotFoundError as e:
            raise SandboxError(f"the env is gone: {e}", sandbox_id=self.sandbox_id, operation=operation) from e
        except weenv.ApiError as e:
            if e.status == 503 and e.kind == "not_admitted":
                raise CapacityError(f"the node is full: {e.detail}", sandbox_id=self.sandbox_id,
                                    operation=operation) from e
            if operation in ("commit", "fork") and e.status in _UNSUPPORTED_STATUSES:
                raise SnapshotUnavailableError(f"the daemon cannot {operation} ({e.status} {e.detail})",
                                               sandbox_id=self.sandbox_id, operation=operation) from e
            raise SandboxError(f"daemon refused ({e.status} {e.kind}): {e.detail}",
                               sandbox_id=self.sandbox_id, operation=operation) from e
        except weenv.WeenvError as e:
            raise SandboxError(str(e), sandbox_id=self.sandbox_id, operation=operation) from e
        except TimeoutError as e:
            raise SandboxError("the weenv daemon did not answer in time", sandbox_id=self.sandbox_id,
                               operation=operation) from e
        except OSError as e:
            raise SandboxError(f"{type(e).__name__}: {e}", sandbox_id=self.sandbox_id, operation=operation) from e

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> WeenvSandbox:
        if self._env is not None:
            return self
        with self._translate("create"):
            if self._client is None:
                # No HTTP-level deadline: every call below has its own, sized to the operation.
                self._client = weenv.AsyncClient(self._socket_path, timeout_s=None, autostart=self._autostart)
            async with asyncio.timeout(self.op_timeout_s):
                self._env = await self._client.create(self.source, **self.create_options)
        self.sandbox_id = self._env.id
        return self

    async def __aexit__(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        await self.close()

    async def close(self) -> None:
        """Kill the env (idempotent) and close a private client."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._env is not None:
                await kill_env_quietly(self._env, timeout_s=self.op_timeout_s)
        finally:
            if self._owns_client and self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.aclose()

    # -- the Sandbox protocol -------------------------------------------------------------------

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
        idempotent: bool = True,
    ) -> ExecResult:
        result = await self.run(cmd, user=user, env=env, timeout_s=timeout if timeout and timeout > 0 else None)
        stdout = result.stdout.decode("utf-8", "replace")
        stderr = result.stderr.decode("utf-8", "replace")
        if result.timed_out:
            if stderr and not stderr.endswith("\n"):
                stderr += "\n"
            stderr += f"[weenv: command timed out after {timeout} s and was killed]\n"
        if check and (result.exit_code != 0 or result.timed_out):
            raise CommandFailedError(cmd if isinstance(cmd, str) else " ".join(cmd), result.exit_code, stdout,
                                     stderr, sandbox_id=self.sandbox_id)
        return result.exit_code, stdout, stderr

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root",
                         mode: int = 0o644) -> None:
        with self._translate("write_file"):
            if isinstance(content, Path):
                content = await asyncio.to_thread(content.read_bytes)
            async with asyncio.timeout(self.op_timeout_s):
                await self.env.write_file(sandbox_path, content, mode=mode, user=user)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        return (await self.read_bytes(sandbox_path, user=user, missing_ok=True)).decode("utf-8", "replace")

    # -- beyond the protocol --------------------------------------------------------------------

    async def run(
        self,
        cmd: str | list[str],
        *,
        user: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Run a command and return weenv's :class:`weenv.ExecResult` (bytes, ``timed_out``,
        ``duration_s``). A str runs via ``/bin/sh -c``; a list is argv."""
        with self._translate("exec"):
            deadline = None if timeout_s is None else timeout_s + self.op_timeout_s
            async with asyncio.timeout(deadline):
                return await self.env.exec(cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s)

    async def read_bytes(self, sandbox_path: str, *, user: str | None = None, missing_ok: bool = False) -> bytes:
        """The file's bytes; ``b""`` for a missing file when ``missing_ok``."""
        try:
            with self._translate("read_file"):
                async with asyncio.timeout(self.op_timeout_s):
                    return await self.env.read_file(sandbox_path, user=user)
        except SandboxError as e:
            cause = e.__cause__
            if missing_ok and isinstance(cause, weenv.ApiError) and cause.kind == "file_not_found":
                return b""
            raise

    async def commit(self) -> str:
        """Seal the env's filesystem into a snapshot and return its id."""
        with self._translate("commit"):
            async with asyncio.timeout(self.op_timeout_s):
                return await self.env.commit()

    async def fork(self, n: int) -> list[WeenvSandbox]:
        """``n`` started children of this env's current filesystem, each a sandbox of its own."""
        with self._translate("fork"):
            async with asyncio.timeout(self.op_timeout_s):
                children = await self.env.fork(n)
        return [WeenvSandbox.from_env(child, op_timeout_s=self.op_timeout_s) for child in children]

    def __repr__(self) -> str:
        return f"<WeenvSandbox {self.sandbox_id or '(not started)'}>"
