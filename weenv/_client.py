"""The Python client of the weenv daemon: sync (:class:`Client`) and async (:class:`AsyncClient`).

Both talk HTTP to ``$WEENV_HOME/run/weenv.sock`` with httpx; the async client works under asyncio
and trio. With ``autostart`` (the default) a missing daemon is started in the background.

Given a URL instead of a socket path (``Client("http://host:3000", token=...)``, or
``$WEENV_HOST`` / ``$WEENV_TOKEN``), they talk to ``weenv serve`` over TCP, sending the token as
``Authorization: Bearer``; a remote daemon is never autostarted.

    with weenv.Client() as client, client.create("plan.lock") as env:
        print(env.exec("echo hello").stdout)
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec

from . import _home
from . import _wire as wire


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


class ExecResult(wire.ExecResult, frozen=True):
    """The outcome of one command (the daemon's :class:`weenv._wire.ExecResult`), with ``ok`` and
    ``text``. ``exit_code`` is 128+N for signal N (137 after a timeout)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")


_exec_decoder = msgspec.json.Decoder(ExecResult)


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        err = resp.json()["error"]
        kind, message = err.get("kind", "error"), err.get("message", resp.text)
    except (ValueError, KeyError, TypeError):
        kind, message = "error", resp.text or resp.reason_phrase
    cls = EnvNotFoundError if kind == "env_not_found" else ApiError
    raise cls(resp.status_code, kind, message)


def _plan_body(plan_or_lock: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """A create request: a path to a plan/lock file, a snapshot id, a dict, or a weenv.plan.Plan."""
    from .plan import Plan, plan_to_builtins

    body: dict[str, Any]
    if isinstance(plan_or_lock, Plan):
        body = {"plan": plan_to_builtins(plan_or_lock)}
    elif isinstance(plan_or_lock, dict):
        body = {"plan": plan_or_lock}
    elif isinstance(plan_or_lock, (str, Path)):
        s = str(plan_or_lock)
        if s.startswith("snap-") and not os.path.exists(s):
            body = {"snapshot": s}
        else:
            try:
                text = Path(s).read_text(encoding="utf-8")
            except OSError as e:
                raise WeenvError(f"cannot read plan {s}: {e.strerror}") from None
            except UnicodeDecodeError as e:  # binary garbage: say which file, as the plan reader would
                raise WeenvError(f"{s}: not UTF-8 text (byte {e.start}): not a plan or lock") from None
            fmt = "json" if s.endswith(".json") or text.lstrip().startswith("{") else "toml"
            body = {"plan_text": text, "format": fmt, "source": s}
    else:
        raise TypeError(f"create() takes a plan path, a snapshot id, a dict or a Plan, not {type(plan_or_lock).__name__}")
    clean = {k: v for k, v in overrides.items() if v is not None}
    if clean:
        body["overrides"] = clean
    return body


def _exec_body(cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, user: str | None,
               stdin: bytes | str | None, timeout_s: float | None, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"argv": list(cmd)} if not isinstance(cmd, str) else {"cmd": cmd}
    if env:
        body["env"] = env
    if cwd:
        body["cwd"] = cwd
    if user:
        body["user"] = user
    if stdin is not None:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        body["stdin_b64"] = base64.b64encode(data).decode()
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    if stream:
        body["stream"] = True
    return body


def _exec_timeout(timeout_s: float | None) -> httpx.Timeout:
    """An exec answers when the command ends: wait for its own timeout (and the kill), or for ever."""
    return httpx.Timeout(None if timeout_s is None else timeout_s + 60.0, connect=10.0)


def _stream_line(line: str, on_output: Callable[[str, bytes], Any] | None) -> ExecResult | None:
    if not line.strip():
        return None
    msg = json.loads(line)
    if "stream" in msg:
        if on_output is not None:
            on_output(msg["stream"], base64.b64decode(msg["data_b64"]))
        return None
    if "error" in msg:
        err = msg["error"]
        cls = EnvNotFoundError if err.get("kind") == "env_not_found" else ApiError
        raise cls(err.get("status", 500), err.get("kind", "error"), err.get("message", ""))
    return msgspec.convert(msg["result"], ExecResult)


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def _target(socket_path_or_url: str | None, cluster: str | None = None) -> str:
    """What a client talks to: the argument, else ``$WEENV_HOST``, else the node's daemon socket.
    A Ray cluster (``cluster=`` its address, or a ``ray://`` URL): the gateway it registered."""
    if cluster is not None or (socket_path_or_url or "").startswith("ray://"):
        from .cluster._gateway import lookup

        return lookup(cluster if cluster is not None else socket_path_or_url)
    return socket_path_or_url or os.environ.get("WEENV_HOST") or _home.daemon_socket()


def _http_options(target: str, token: str | None) -> dict[str, Any]:
    """httpx client options for a socket path (the local daemon) or a ``weenv serve`` URL."""
    if not _is_url(target):
        return {"base_url": "http://weenv"}
    token = token or os.environ.get("WEENV_TOKEN")
    return {"base_url": target.rstrip("/"), "headers": {"Authorization": f"Bearer {token}"} if token else {}}


def _daemon_answers(socket_path: str) -> bool:
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), timeout=2.0) as c:
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
        if _daemon_answers(socket_path):
            return  # another client started it while we waited for the lock
        log = open(os.path.join(home, "daemon.log"), "ab")
        try:
            subprocess.Popen([sys.executable, "-m", "weenv", "daemon"], stdin=subprocess.DEVNULL, stdout=log,
                             stderr=log, start_new_session=True, env={**os.environ, "WEENV_HOME": home})
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if _daemon_answers(socket_path):
                return
            time.sleep(0.05)
    raise DaemonUnavailableError(f"the weenv daemon did not start within {timeout_s:g} s (see {home}/daemon.log)")


# ================================================================================ processes


def _process_body(cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, user: str | None, stdin: bool,
                  pty: tuple[int, int] | None, tag: str | None, buffer_bytes: int | None) -> bytes:
    argv, shell = (None, cmd) if isinstance(cmd, str) else (list(cmd), None)
    try:
        return wire.encode_request(wire.ProcessStartRequest, argv=argv, cmd=shell, env=env or None, cwd=cwd, user=user,
                                   stdin=stdin or None, tag=tag, buffer_bytes=buffer_bytes,
                                   pty={"rows": pty[0], "cols": pty[1]} if pty is not None else None)
    except msgspec.ValidationError as e:
        raise WeenvError(f"spawn: {e}") from None


_STREAM_WAIT = httpx.Timeout(None, connect=10.0)  # a process may stay silent for as long as it likes
_event_decoder = msgspec.json.Decoder(wire.ProcessEvent)


def _event(line: str) -> wire.ProcessEvent | None:
    """One NDJSON line of a process stream (None for blank lines); raises the ``error`` line."""
    if not line.strip():
        return None
    ev = _event_decoder.decode(line)
    if ev.error is not None:
        cls = EnvNotFoundError if ev.error.kind == "env_not_found" else ApiError
        raise cls(ev.error.status or 500, ev.error.kind, ev.error.message)
    return ev


def _signal_value(sig: int | str) -> int | str:
    return int(sig) if isinstance(sig, int) else sig


class Process:
    """A process handle in an env (synchronous): what :meth:`Env.spawn` and :meth:`Env.connect`
    return. It runs on when this handle is closed or the client goes away; the output nobody read
    is kept (a bounded amount) for the next :meth:`Env.connect`.

    ``events()`` yields :class:`weenv._wire.ProcessEvent` (``stream`` + ``data_b64`` bytes,
    ``dropped``, finally ``end``). ``with`` detaches on exit."""

    def __init__(self, env: "Env", pid: int, stream: Any = None, response: httpx.Response | None = None):
        self.env, self.pid = env, pid
        self.end: wire.ProcessEnd | None = None
        self._cm, self._resp = stream, response
        self._lines = response.iter_lines() if response is not None else None

    def __repr__(self) -> str:
        return f"<weenv.Process {self.pid} in {self.env.id}>"

    def _url(self, what: str = "") -> str:
        return f"/v1/envs/{self.env.id}/processes/{self.pid}{what}"

    def events(self) -> Iterator[wire.ProcessEvent]:
        """Its events until it ends (attaching first if this handle is not attached)."""
        if self._lines is None:
            self._attach()
        assert self._lines is not None
        try:
            for line in self._lines:
                ev = _event(line)
                if ev is None or ev.start is not None:
                    continue
                if ev.end is not None:
                    self.end = ev.end
                    for _rest in self._lines:  # read to the body's end (the daemon sends nothing after the
                        break  # end): httpx then keeps the connection for the next request, not closes it
                yield ev
                if ev.end is not None:
                    return
        except httpx.TransportError as e:
            raise DaemonUnavailableError(f"weenv daemon at {self.env.client.socket_path}: {e}") from None
        finally:
            if self.end is not None:
                self.detach()
        if self.end is None:
            self.detach()
            raise ApiError(500, "stream", f"the stream of process {self.pid} was cut (it may still run: connect again)")

    def _attach(self) -> None:
        cm = self.env.client._stream("GET", self._url("/stream"), timeout=_STREAM_WAIT)
        resp = cm.__enter__()
        if resp.status_code >= 400:
            resp.read()
            cm.__exit__(None, None, None)
            _raise_for(resp)
        self._cm, self._resp, self._lines = cm, resp, resp.iter_lines()

    def send_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        payload = data.encode() if isinstance(data, str) else data
        for i in range(0, max(len(payload), 1), wire.MAX_STDIN_CHUNK_BYTES):
            last = i + wire.MAX_STDIN_CHUNK_BYTES >= len(payload)
            body = wire.encode(wire.StdinRequest(data_b64=payload[i : i + wire.MAX_STDIN_CHUNK_BYTES], close=close and last))
            self.env.client._request("POST", self._url("/stdin"), content=body)

    def close_stdin(self) -> None:
        self.send_stdin(b"", close=True)

    def signal(self, sig: int | str = 15) -> None:
        """Signal its whole session: a number or a name (``"SIGTERM"``, ``"KILL"``)."""
        self.env.client._request("POST", self._url("/signal"), json={"signal": _signal_value(sig)})

    def kill(self) -> None:
        self.signal(9)

    def resize(self, rows: int, cols: int) -> None:
        self.env.client._request("POST", self._url("/resize"), json={"rows": rows, "cols": cols})

    def info(self) -> wire.ProcessInfo:
        return msgspec.convert(self.env.client._request("GET", self._url()).json(), wire.ProcessInfo)

    def wait(self, timeout_s: float | None = None) -> wire.ProcessEnd | None:
        """How it ended (None if ``timeout_s`` came first). An attached handle reads (and drops)
        the rest of its output; otherwise the output stays for the next reader."""
        if self._lines is not None and timeout_s is None:
            for _ev in self.events():
                pass
            return self.end
        body = {"timeout_s": timeout_s} if timeout_s is not None else {}
        wait = httpx.Timeout(None if timeout_s is None else timeout_s + 30.0, connect=10.0)
        data = self.env.client._request("POST", self._url("/wait"), json=body, timeout=wait).content
        self.end = wire.decode(data, wire.ProcessWait).end
        return self.end

    def detach(self) -> None:
        """Stop following it (it runs on)."""
        cm, self._cm, self._resp, self._lines = self._cm, None, None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def __enter__(self) -> "Process":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


class AsyncProcess:
    """A process handle in an env (async): as :class:`Process`, with ``async for ev in proc.events()``."""

    def __init__(self, env: "AsyncEnv", pid: int, stream: Any = None, response: httpx.Response | None = None):
        self.env, self.pid = env, pid
        self.end: wire.ProcessEnd | None = None
        self._cm, self._resp = stream, response
        self._lines = response.aiter_lines() if response is not None else None

    def __repr__(self) -> str:
        return f"<weenv.AsyncProcess {self.pid} in {self.env.id}>"

    def _url(self, what: str = "") -> str:
        return f"/v1/envs/{self.env.id}/processes/{self.pid}{what}"

    async def events(self) -> AsyncIterator[wire.ProcessEvent]:
        if self._lines is None:
            await self._attach()
        assert self._lines is not None
        try:
            async for line in self._lines:
                ev = _event(line)
                if ev is None or ev.start is not None:
                    continue
                if ev.end is not None:
                    self.end = ev.end
                    async for _rest in self._lines:  # as Process.events: to the body's end, the connection kept
                        break
                yield ev
                if ev.end is not None:
                    return
        except httpx.TransportError as e:
            raise DaemonUnavailableError(f"weenv daemon at {self.env.client.socket_path}: {e}") from None
        finally:
            if self.end is not None:
                with _shielded():
                    await self.detach()
        if self.end is None:
            await self.detach()
            raise ApiError(500, "stream", f"the stream of process {self.pid} was cut (it may still run: connect again)")

    async def _attach(self) -> None:
        await self.env.client._ensure()
        cm = self.env.client._http.stream("GET", self._url("/stream"), timeout=_STREAM_WAIT)
        resp = await cm.__aenter__()
        if resp.status_code >= 400:
            await resp.aread()
            await cm.__aexit__(None, None, None)
            _raise_for(resp)
        self._cm, self._resp, self._lines = cm, resp, resp.aiter_lines()

    async def send_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        payload = data.encode() if isinstance(data, str) else data
        for i in range(0, max(len(payload), 1), wire.MAX_STDIN_CHUNK_BYTES):
            last = i + wire.MAX_STDIN_CHUNK_BYTES >= len(payload)
            body = wire.encode(wire.StdinRequest(data_b64=payload[i : i + wire.MAX_STDIN_CHUNK_BYTES], close=close and last))
            await self.env.client._request("POST", self._url("/stdin"), content=body)

    async def close_stdin(self) -> None:
        await self.send_stdin(b"", close=True)

    async def signal(self, sig: int | str = 15) -> None:
        await self.env.client._request("POST", self._url("/signal"), json={"signal": _signal_value(sig)})

    async def kill(self) -> None:
        await self.signal(9)

    async def resize(self, rows: int, cols: int) -> None:
        await self.env.client._request("POST", self._url("/resize"), json={"rows": rows, "cols": cols})

    async def info(self) -> wire.ProcessInfo:
        return msgspec.convert((await self.env.client._request("GET", self._url())).json(), wire.ProcessInfo)

    async def wait(self, timeout_s: float | None = None) -> wire.ProcessEnd | None:
        if self._lines is not None and timeout_s is None:
            async for _ev in self.events():
                pass
            return self.end
        body = {"timeout_s": timeout_s} if timeout_s is not None else {}
        wait = httpx.Timeout(None if timeout_s is None else timeout_s + 30.0, connect=10.0)
        data = (await self.env.client._request("POST", self._url("/wait"), json=body, timeout=wait)).content
        self.end = wire.decode(data, wire.ProcessWait).end
        return self.end

    async def detach(self) -> None:
        cm, self._cm, self._resp, self._lines = self._cm, None, None, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def __aenter__(self) -> "AsyncProcess":
        return self

    async def __aexit__(self, *exc: object) -> None:
        with _shielded():
            await self.detach()


def _started(resp: httpx.Response, lines: Iterator[str]) -> int:
    for line in lines:
        ev = _event(line)
        if ev is not None and ev.start is not None:
            return ev.start.pid
    raise ApiError(500, "stream", "the process stream ended before its start")

async def _astarted(lines: AsyncIterator[str]) -> int:
    async for line in lines:
        ev = _event(line)
        if ev is not None and ev.start is not None:
            return ev.start.pid
    raise ApiError(500, "stream", "the process stream ended before its start")


# ================================================================================ sync


class Env:
    """A running env (synchronous). Use it as a context manager to kill it on exit, together with
    the envs it forked (but those forked with ``keep=True``)."""

    def __init__(self, client: "Client", info: dict[str, Any]):
        self.client = client
        self.info = info
        self.id: str = info["id"]
        self.forks: list[Env] = []  # children of fork(keep=False): they go when this env's `with` ends

    def __repr__(self) -> str:
        return f"<weenv.Env {self.id}>"

    def exec(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | str | None = None, timeout_s: float | None = None,
             on_output: Callable[[str, bytes], Any] | None = None) -> ExecResult:
        """Run a command (a str runs via /bin/sh -c). ``on_output(stream, data)`` streams output as it comes."""
        body = _exec_body(cmd, env, cwd, user, stdin, timeout_s, on_output is not None)
        url = f"/v1/envs/{self.id}/exec"
        wait = _exec_timeout(timeout_s)
        if on_output is None:
            resp = self.client._request("POST", url, json=body, timeout=wait)
            return _exec_decoder.decode(resp.content)
        with self.client._stream("POST", url, json=body, timeout=wait) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            for line in resp.iter_lines():
                result = _stream_line(line, on_output)
                if result is not None:
                    return result
        raise ApiError(500, "stream", "exec stream ended without a result")

    def spawn(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
              user: str | None = None, stdin: bool = False, pty: tuple[int, int] | None = None,
              tag: str | None = None, buffer_bytes: int | None = None) -> Process:
        """Start a background process (a str runs via /bin/sh -c) and return its handle, attached
        to its output. It outlives the handle and this client. ``stdin`` keeps its stdin open for
        :meth:`Process.send_stdin`; ``pty=(rows, cols)`` runs it on a pseudo-terminal."""
        body = _process_body(cmd, env, cwd, user, stdin, pty, tag, buffer_bytes)
        cm = self.client._stream("POST", f"/v1/envs/{self.id}/processes", content=body, timeout=_STREAM_WAIT)
        resp = cm.__enter__()
        try:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            lines = resp.iter_lines()
            pid = _started(resp, lines)
        except BaseException:
            cm.__exit__(None, None, None)
            raise
        proc = Process(self, pid, cm, resp)
        proc._lines = lines
        return proc

    def connect(self, pid: int) -> Process:
        """Attach to a process started by weenv: first the output kept since its last reader."""
        proc = Process(self, pid)
        proc._attach()
        assert proc._lines is not None
        _started(proc._resp, proc._lines)  # type: ignore[arg-type]
        return proc

    def processes(self) -> list[wire.ProcessInfo]:
        """The env's processes started by weenv (running, and recently finished background ones)."""
        return msgspec.convert(self.client._request("GET", f"/v1/envs/{self.id}/processes").json(), list[wire.ProcessInfo])

    def process(self, pid: int) -> Process:
        """A handle on process ``pid``, not attached (``events()`` attaches)."""
        return Process(self, pid)

    def read_file(self, path: str, *, user: str | None = None) -> bytes:
        return self.client._request("GET", f"/v1/envs/{self.id}/files",
                                    params={"path": path, **({"user": user} if user else {})}).content

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, user: str | None = None) -> None:
        content = data.encode() if isinstance(data, str) else data
        self.client._request("PUT", f"/v1/envs/{self.id}/files", content=content,
                             params={"path": path, "mode": f"{mode:o}", **({"user": user} if user else {})})

    def list_dir(self, path: str) -> list[dict[str, Any]]:
        return self.client._request("GET", f"/v1/envs/{self.id}/files", params={"path": path, "op": "list"}).json()

    def stat(self, path: str) -> dict[str, Any]:
        return self.client._request("GET", f"/v1/envs/{self.id}/files", params={"path": path, "op": "stat"}).json()

    def mkdir(self, path: str, *, mode: int = 0o755) -> None:
        self.client._request("POST", f"/v1/envs/{self.id}/files/mkdir", params={"path": path, "mode": f"{mode:o}"})

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self.client._request("DELETE", f"/v1/envs/{self.id}/files",
                             params={"path": path, "recursive": "1" if recursive else "0"})

    def pause(self) -> None:
        self.client._request("POST", f"/v1/envs/{self.id}/pause")

    def resume(self) -> None:
        self.client._request("POST", f"/v1/envs/{self.id}/resume")

    def set_timeout(self, ttl_s: float | None) -> None:
        self.client._request("POST", f"/v1/envs/{self.id}/ttl", json={"ttl_s": ttl_s})

    def network(self) -> dict[str, Any]:
        """An egress env's addresses, policy, pinned names and accounting (docs/network.md)."""
        return self.client._request("GET", f"/v1/envs/{self.id}/network").json()

    def set_network(self, *, allow: list[str] = [], deny: list[str] = [],  # noqa: B006 (never mutated)
                    remove: list[str] = []) -> dict[str, Any]:  # noqa: B006
        """Change a running egress env's policy: new connections follow it when this returns."""
        body = {"allow": list(allow), "deny": list(deny), "remove": list(remove)}
        return self.client._request("POST", f"/v1/envs/{self.id}/network", json=body).json()

    def refresh(self) -> dict[str, Any]:
        self.info = self.client._request("GET", f"/v1/envs/{self.id}").json()
        return self.info

    def commit(self, *, ref: str | None = None) -> str:
        """Seal the env's filesystem into a snapshot; returns its id."""
        return self.client._request("POST", f"/v1/envs/{self.id}/commit", json={"ref": ref}).json()["snapshot"]

    def fork(self, n: int, *, keep: bool = False) -> list["Env"]:
        """Commit once and start ``n`` independent children from that state.

        The children are killed when this env's ``with`` block ends, unless ``keep``; the snapshot
        the fork made is collected by ``gc`` once no env started from it is left."""
        data = self.client._request("POST", f"/v1/envs/{self.id}/fork", json={"n": n}).json()
        children = [Env(self.client, info) for info in data["envs"]]
        if not keep:
            self.forks.extend(children)
        return children

    def kill(self) -> None:
        """Kill this env (its forks live on: they are independent envs)."""
        try:
            self.client._request("DELETE", f"/v1/envs/{self.id}")
        except EnvNotFoundError:
            pass

    def _kill_with_forks(self) -> None:
        forks, self.forks = self.forks, []
        errors: list[WeenvError] = []
        for child in forks:
            try:
                child._kill_with_forks()
            except WeenvError as e:  # the others still go
                errors.append(e)
        self.kill()
        if errors:
            raise errors[0]

    def __enter__(self) -> "Env":
        return self

    def __exit__(self, *exc: object) -> None:
        self._kill_with_forks()


class Client:
    """Synchronous client of the local weenv daemon (a socket path), or of ``weenv serve`` (a URL)."""

    def __init__(self, socket_path: str | None = None, *, token: str | None = None, timeout_s: float = 300.0,
                 autostart: bool = True, cluster: str | None = None):
        self.socket_path = _target(socket_path, cluster)
        self.autostart = autostart and not _is_url(self.socket_path)
        transport = None if _is_url(self.socket_path) else httpx.HTTPTransport(uds=self.socket_path)
        self._http = httpx.Client(transport=transport, timeout=timeout_s, **_http_options(self.socket_path, token))
        self._started = False

    def _ensure(self) -> None:
        if self._started:
            return
        try:
            self._http.get("/v1/ping", timeout=5.0)
        except httpx.TransportError:
            if not self.autostart:
                raise DaemonUnavailableError(f"the weenv daemon is not running ({self.socket_path})") from None
            start_daemon(self.socket_path)
        self._started = True

    def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        self._ensure()
        try:
            resp = self._http.request(method, url, **kw)
        except httpx.TransportError as e:
            raise DaemonUnavailableError(f"weenv daemon at {self.socket_path}: {e}") from None
        _raise_for(resp)
        return resp

    def _stream(self, method: str, url: str, **kw: Any):  # type: ignore[no-untyped-def]
        self._ensure()
        return self._http.stream(method, url, **kw)

    def ping(self) -> dict[str, Any]:
        return self._request("GET", "/v1/ping").json()

    def create(self, plan_or_lock: Any, *, name: str | None = None, ttl_s: float | None = None,
               cpu: str | float | None = None, memory: str | int | None = None, env: dict[str, str] | None = None,
               workdir: str | None = None, user: str | None = None, network: str | None = None) -> Env:
        """Start an env from a plan or lock (path, dict or Plan) or a snapshot id.

        ``network="host"`` (the node's network, with egress) is for trusted build steps only."""
        body = _plan_body(plan_or_lock, dict(name=name, ttl_s=ttl_s, cpu=None if cpu is None else str(cpu),
                                             memory=None if memory is None else str(memory), env=env, workdir=workdir,
                                             user=user, network=network))
        return Env(self, self._request("POST", "/v1/envs", json=body).json())

    def get(self, env_id: str) -> Env:
        return Env(self, self._request("GET", f"/v1/envs/{env_id}").json())

    def list(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/envs").json()

    def gc(self) -> dict[str, Any]:
        return self._request("POST", "/v1/gc").json()

    def top(self) -> dict[str, Any]:
        return self._request("GET", "/v1/top").json()

    def snapshots(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/snapshots").json()

    def snapshot(self, snapshot_id: str) -> dict[str, Any]:
        """One snapshot: its layers, its plan lock (``lock``), where it came from."""
        return self._request("GET", f"/v1/snapshots/{snapshot_id}").json()

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._request("DELETE", f"/v1/snapshots/{snapshot_id}")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ================================================================================ async


class AsyncEnv:
    """A running env (async: asyncio or trio). ``async with`` kills it on exit, together with the
    envs it forked (but those forked with ``keep=True``)."""

    def __init__(self, client: "AsyncClient", info: dict[str, Any]):
        self.client = client
        self.info = info
        self.id: str = info["id"]
        self.forks: list[AsyncEnv] = []  # children of fork(keep=False): they go when `async with` ends

    def __repr__(self) -> str:
        return f"<weenv.AsyncEnv {self.id}>"

    async def exec(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                   user: str | None = None, stdin: bytes | str | None = None, timeout_s: float | None = None,
                   on_output: Callable[[str, bytes], Any] | None = None) -> ExecResult:
        body = _exec_body(cmd, env, cwd, user, stdin, timeout_s, on_output is not None)
        url = f"/v1/envs/{self.id}/exec"
        wait = _exec_timeout(timeout_s)
        if on_output is None:
            resp = await self.client._request("POST", url, json=body, timeout=wait)
            return _exec_decoder.decode(resp.content)
        await self.client._ensure()
        async with self.client._http.stream("POST", url, json=body, timeout=wait) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            async for line in resp.aiter_lines():
                result = _stream_line(line, on_output)
                if result is not None:
                    return result
        raise ApiError(500, "stream", "exec stream ended without a result")

    async def spawn(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                    user: str | None = None, stdin: bool = False, pty: tuple[int, int] | None = None,
                    tag: str | None = None, buffer_bytes: int | None = None) -> AsyncProcess:
        """As :meth:`Env.spawn`."""
        body = _process_body(cmd, env, cwd, user, stdin, pty, tag, buffer_bytes)
        await self.client._ensure()
        cm = self.client._http.stream("POST", f"/v1/envs/{self.id}/processes", content=body, timeout=_STREAM_WAIT)
        resp = await cm.__aenter__()
        try:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            lines = resp.aiter_lines()
            pid = await _astarted(lines)
        except BaseException:
            with _shielded():
                await cm.__aexit__(None, None, None)
            raise
        proc = AsyncProcess(self, pid, cm, resp)
        proc._lines = lines
        return proc

    async def connect(self, pid: int) -> AsyncProcess:
        proc = AsyncProcess(self, pid)
        await proc._attach()
        assert proc._lines is not None
        await _astarted(proc._lines)
        return proc

    async def processes(self) -> list[wire.ProcessInfo]:
        resp = await self.client._request("GET", f"/v1/envs/{self.id}/processes")
        return msgspec.convert(resp.json(), list[wire.ProcessInfo])

    def process(self, pid: int) -> AsyncProcess:
        return AsyncProcess(self, pid)

    async def read_file(self, path: str, *, user: str | None = None) -> bytes:
        resp = await self.client._request("GET", f"/v1/envs/{self.id}/files",
                                          params={"path": path, **({"user": user} if user else {})})
        return resp.content

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, user: str | None = None) -> None:
        content = data.encode() if isinstance(data, str) else data
        await self.client._request("PUT", f"/v1/envs/{self.id}/files", content=content,
                                   params={"path": path, "mode": f"{mode:o}", **({"user": user} if user else {})})

    async def list_dir(self, path: str) -> list[dict[str, Any]]:
        return (await self.client._request("GET", f"/v1/envs/{self.id}/files", params={"path": path, "op": "list"})).json()

    async def mkdir(self, path: str, *, mode: int = 0o755) -> None:
        await self.client._request("POST", f"/v1/envs/{self.id}/files/mkdir", params={"path": path, "mode": f"{mode:o}"})

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self.client._request("DELETE", f"/v1/envs/{self.id}/files",
                                   params={"path": path, "recursive": "1" if recursive else "0"})

    async def pause(self) -> None:
        await self.client._request("POST", f"/v1/envs/{self.id}/pause")

    async def resume(self) -> None:
        await self.client._request("POST", f"/v1/envs/{self.id}/resume")

    async def set_timeout(self, ttl_s: float | None) -> None:
        await self.client._request("POST", f"/v1/envs/{self.id}/ttl", json={"ttl_s": ttl_s})

    async def network(self) -> dict[str, Any]:
        """An egress env's addresses, policy, pinned names and accounting (docs/network.md)."""
        return (await self.client._request("GET", f"/v1/envs/{self.id}/network")).json()

    async def set_network(self, *, allow: list[str] = [], deny: list[str] = [],  # noqa: B006 (never mutated)
                          remove: list[str] = []) -> dict[str, Any]:  # noqa: B006
        """Change a running egress env's policy: new connections follow it when this returns."""
        body = {"allow": list(allow), "deny": list(deny), "remove": list(remove)}
        return (await self.client._request("POST", f"/v1/envs/{self.id}/network", json=body)).json()

    async def commit(self, *, ref: str | None = None) -> str:
        return (await self.client._request("POST", f"/v1/envs/{self.id}/commit", json={"ref": ref})).json()["snapshot"]

    async def fork(self, n: int, *, keep: bool = False) -> list["AsyncEnv"]:
        """As :meth:`Env.fork`: the children go when this env's ``async with`` ends, unless ``keep``."""
        data = (await self.client._request("POST", f"/v1/envs/{self.id}/fork", json={"n": n})).json()
        children = [AsyncEnv(self.client, info) for info in data["envs"]]
        if not keep:
            self.forks.extend(children)
        return children

    async def kill(self) -> None:
        """Kill this env (its forks live on: they are independent envs)."""
        try:
            await self.client._request("DELETE", f"/v1/envs/{self.id}")
        except EnvNotFoundError:
            pass

    async def _kill_with_forks(self) -> None:
        import anyio  # httpx's own async layer: task groups under asyncio and trio alike

        forks, self.forks = self.forks, []
        errors: list[WeenvError] = []

        async def kill(child: AsyncEnv) -> None:
            try:
                await child._kill_with_forks()
            except WeenvError as e:  # the others still go
                errors.append(e)

        async with anyio.create_task_group() as tg:
            for child in forks:
                tg.start_soon(kill, child)
        await self.kill()
        if errors:
            raise errors[0]

    async def __aenter__(self) -> "AsyncEnv":
        return self

    async def __aexit__(self, *exc: object) -> None:
        with _shielded():
            await self._kill_with_forks()


def _shielded() -> Any:
    """A cancel scope that lets cleanup finish when the task is being cancelled (asyncio or trio)."""
    import anyio

    return anyio.CancelScope(shield=True)


class _EnvStart:
    """What :meth:`AsyncClient.create` returns: ``await`` it for the :class:`AsyncEnv`, or use it
    as ``async with client.create(...) as env:`` to kill the env (and its forks) on exit."""

    def __init__(self, coro: Any):
        self._coro = coro
        self._env: AsyncEnv | None = None

    def __await__(self) -> Any:
        return self._coro.__await__()

    async def __aenter__(self) -> AsyncEnv:
        self._env = await self._coro
        return self._env

    async def __aexit__(self, *exc: object) -> None:
        if self._env is not None:
            await self._env.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"AsyncClient.create() returns no env yet: write `env = await client.create(...)` "
                             f"or `async with client.create(...) as env:` before `env.{name}`")


class AsyncClient:
    """Async client of the local weenv daemon or of ``weenv serve`` (httpx.AsyncClient: asyncio or trio)."""

    def __init__(self, socket_path: str | None = None, *, token: str | None = None, timeout_s: float = 300.0,
                 autostart: bool = True, cluster: str | None = None):
        self.socket_path = _target(socket_path, cluster)
        self.autostart = autostart and not _is_url(self.socket_path)
        transport = None if _is_url(self.socket_path) else httpx.AsyncHTTPTransport(uds=self.socket_path)
        self._http = httpx.AsyncClient(transport=transport, timeout=timeout_s,
                                       **_http_options(self.socket_path, token))
        self._started = False

    async def _ensure(self) -> None:
        if self._started:
            return
        try:
            await self._http.get("/v1/ping", timeout=5.0)
        except httpx.TransportError:
            if not self.autostart:
                raise DaemonUnavailableError(f"the weenv daemon is not running ({self.socket_path})") from None
            import anyio.to_thread  # httpx's own async backend layer: works under asyncio and trio

            await anyio.to_thread.run_sync(start_daemon, self.socket_path)
        self._started = True

    async def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        await self._ensure()
        try:
            resp = await self._http.request(method, url, **kw)
        except httpx.TransportError as e:
            raise DaemonUnavailableError(f"weenv daemon at {self.socket_path}: {e}") from None
        _raise_for(resp)
        return resp

    async def ping(self) -> dict[str, Any]:
        return (await self._request("GET", "/v1/ping")).json()

    def create(self, plan_or_lock: Any, *, name: str | None = None, ttl_s: float | None = None,
               cpu: str | float | None = None, memory: str | int | None = None,
               env: dict[str, str] | None = None, workdir: str | None = None, user: str | None = None,
               network: str | None = None) -> _EnvStart:
        """Start an env: ``env = await client.create(...)``, or ``async with client.create(...) as env:``
        to kill it on exit. Arguments as :meth:`Client.create`."""
        return _EnvStart(self._create(plan_or_lock, name=name, ttl_s=ttl_s, cpu=cpu, memory=memory, env=env,
                                      workdir=workdir, user=user, network=network))

    async def _create(self, plan_or_lock: Any, *, name: str | None, ttl_s: float | None, cpu: str | float | None,
                      memory: str | int | None, env: dict[str, str] | None, workdir: str | None,
                      user: str | None, network: str | None) -> AsyncEnv:
        body = _plan_body(plan_or_lock, dict(name=name, ttl_s=ttl_s, cpu=None if cpu is None else str(cpu),
                                             memory=None if memory is None else str(memory), env=env, workdir=workdir,
                                             user=user, network=network))
        return AsyncEnv(self, (await self._request("POST", "/v1/envs", json=body)).json())

    async def get(self, env_id: str) -> AsyncEnv:
        return AsyncEnv(self, (await self._request("GET", f"/v1/envs/{env_id}")).json())

    async def list(self) -> list[dict[str, Any]]:
        return (await self._request("GET", "/v1/envs")).json()

    async def gc(self) -> dict[str, Any]:
        return (await self._request("POST", "/v1/gc")).json()

    async def snapshots(self) -> list[dict[str, Any]]:
        return (await self._request("GET", "/v1/snapshots")).json()

    async def snapshot(self, snapshot_id: str) -> dict[str, Any]:
        return (await self._request("GET", f"/v1/snapshots/{snapshot_id}")).json()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._request("DELETE", f"/v1/snapshots/{snapshot_id}")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def iter_envs(client: Client) -> Iterator[Env]:
    for info in client.list():
        yield Env(client, info)
