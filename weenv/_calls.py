"""What the sync and async clients send and how they read the answers, without I/O.

Each daemon call is a :class:`Call` (route name, path parameters, query, body, timeout, the
``_wire`` type its answer decodes to), built by one function here; weenv/_client.py and
weenv/_aclient.py run it on their connection and :func:`decode` the answer. NDJSON stream lines
(an exec's frames, a process's events) are read by :func:`exec_line` and :func:`process_event`.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from . import _wire as wire
from . import _wire_volumes as vw
from ._connection import DaemonUnavailableError, WeenvError, error_for
from ._routes import check_segment


class ExecResult(wire.ExecResult, frozen=True):
    """The outcome of one command (the daemon's :class:`weenv._wire.ExecResult`), with ``ok`` and
    ``text``. ``exit_code`` is 128+N for signal N (137 after a timeout)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")


STREAM_WAIT = httpx.Timeout(None, connect=10.0)
"""For a process stream: a process may stay silent for as long as it likes."""
_DEFAULT: Any = object()


@dataclass(frozen=True)
class Call:
    route: str
    params: dict[str, Any] = field(default_factory=dict)
    query: Any = None
    json: Any = None
    content: Any = None
    timeout: Any = _DEFAULT
    answer: Any = None
    """The ``_wire`` type the answer's JSON decodes to; None: the raw bytes; ``...``: nothing."""

    def kw(self) -> dict[str, Any]:
        out = {"query": self.query, "json": self.json, "content": self.content}
        if self.timeout is not _DEFAULT:
            out["timeout"] = self.timeout
        return out


def decode(call: Call, resp: httpx.Response) -> Any:
    if call.answer is ...:
        return None
    if call.answer is None:
        return resp.content
    try:
        return msgspec.json.decode(resp.content, type=call.answer)
    except msgspec.ValidationError as e:  # a daemon of another version: say so, not a KeyError later
        raise WeenvError(f"the daemon's answer to {call.route} is not what this client reads: {e}") from None


class ProcessHandle:
    """What a sync and an async process handle keep: the env, the pid, the open stream (if
    attached) and how it ended (``end``, once it did)."""

    def __init__(self, env: Any, pid: int, stream: Any = None, lines: Any = None):
        self.env, self.pid = env, pid
        self.end: wire.ProcessEnd | None = None
        self._cm, self._lines = stream, lines

    def __repr__(self) -> str:
        return f"<weenv.{type(self).__name__} {self.pid} in {self.env.id}>"


class EnvHandle:
    """What a sync and an async env keep: the client, its info (``_wire.EnvInfo``; a dict is read
    as one), its id, the children of ``fork(keep=False)`` that go with it."""

    def __init__(self, client: Any, info: wire.EnvInfo | dict[str, Any]):
        self.client = client
        self.info: wire.EnvInfo = info if isinstance(info, wire.EnvInfo) else wire.decode(
            wire.encode(info), wire.EnvInfo)
        self.id: str = seg(self.info.id, "env id")
        self.forks: list[Any] = []

    def __repr__(self) -> str:
        return f"<weenv.{type(self).__name__} {self.id}>"


def seg(value: str, what: str) -> str:
    """``value`` as one path segment (an id), or WeenvError: a client never sends a path it did not mean."""
    try:
        return check_segment(value, what)
    except ValueError as e:
        raise WeenvError(str(e)) from None


# ------------------------------------------------------------------------------- client calls


def plan_body(plan_or_lock: Any, overrides: dict[str, Any]) -> dict[str, Any]:
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
        elif not os.path.exists(s) and _is_image_ref(s):
            body = {"image": s[len("docker://"):] if s.startswith("docker://") else s}
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


def _is_image_ref(text: str) -> bool:
    from .registry import is_image_ref

    return is_image_ref(text)


def create(plan_or_lock: Any, *, name: str | None = None, ttl_s: float | None = None,
           cpu: str | float | None = None, memory: str | int | None = None, env: dict[str, str] | None = None,
           workdir: str | None = None, user: str | None = None, network: str | None = None,
           volumes: list[dict[str, Any]] | None = None) -> Call:
    body = plan_body(plan_or_lock, dict(name=name, ttl_s=ttl_s, cpu=None if cpu is None else str(cpu),
                                        memory=None if memory is None else str(memory), env=env, workdir=workdir,
                                        user=user, network=network, volumes=volumes or None))
    return Call("env_create", json=body, answer=wire.EnvInfo)


def env(env_id: str) -> dict[str, str]:
    return {"id": seg(env_id, "env id")}


def ping() -> Call:
    return Call("ping", answer=wire.Ping)


def env_show(env_id: str) -> Call:
    return Call("env_show", env(env_id), answer=wire.EnvInfo)


def env_metrics(env_id: str, start: float | None, end: float | None) -> Call:
    query = {k: repr(float(v)) for k, v in (("start", start), ("end", end)) if v is not None}
    return Call("env_metrics", env(env_id), query=query, answer=list[dict[str, float]])


def env_list() -> Call:
    return Call("env_list", answer=list[wire.EnvInfo])


def gc() -> Call:
    return Call("gc", answer=wire.GcReport)


def top() -> Call:
    return Call("top", answer=wire.Top)


def snapshot_list() -> Call:
    return Call("snapshot_list", answer=list[wire.SnapshotInfo])


def snapshot_pull(ref: str) -> Call:
    return Call("snapshot_pull", json={"ref": ref}, answer=wire.SnapshotDetail)


def snapshot_show(snapshot_id: str) -> Call:
    return Call("snapshot_show", {"id": seg(snapshot_id, "snapshot id")}, answer=wire.SnapshotDetail)


def snapshot_delete(snapshot_id: str) -> Call:
    return Call("snapshot_delete", {"id": seg(snapshot_id, "snapshot id")}, answer=wire.SnapshotRemoved)


def volume_create(name: str | None, size_bytes: int | None) -> Call:
    body = {k: v for k, v in (("name", name), ("size_bytes", size_bytes)) if v is not None}
    return Call("volume_create", json=body, answer=vw.VolumeInfo)


def volume_list() -> Call:
    return Call("volume_list", answer=list[vw.VolumeInfo])


def volume_show(ref: str) -> Call:
    return Call("volume_show", {"id": seg(ref, "volume id or name")}, answer=vw.VolumeInfo)


def volume_delete(ref: str) -> Call:
    return Call("volume_delete", {"id": seg(ref, "volume id or name")}, answer=vw.VolumeRemoved)


def volume_read(ref: str, path: str) -> Call:
    return Call("volume_files_get", {"id": seg(ref, "volume id or name")}, query={"path": path}, answer=None)


def volume_write(ref: str, path: str, data: bytes | str, mode: int | None = None) -> Call:
    content = data.encode() if isinstance(data, str) else data
    query = {"path": path, **({"mode": f"{mode:o}"} if mode is not None else {})}
    return Call("volume_files_put", {"id": seg(ref, "volume id or name")}, content=content, query=query,
                answer=wire.FileInfo)


def volume_list_dir(ref: str, path: str) -> Call:
    return Call("volume_files_get", {"id": seg(ref, "volume id or name")}, query={"path": path, "op": "list"},
                answer=list[wire.FileInfo])


def daemon_stop(kill_envs: bool) -> Call:
    return Call("daemon_stop", json={"kill_envs": kill_envs}, answer=wire.StopResponse)


def exec_body(cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, user: str | None,
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


def exec_(env_id: str, cmd: str | list[str], *, env: dict[str, str] | None, cwd: str | None, user: str | None,
          stdin: bytes | str | None, timeout_s: float | None, stream: bool) -> Call:
    # an exec answers when its command ends: wait for its own timeout (and the kill), or for ever
    wait = httpx.Timeout(None if timeout_s is None else timeout_s + 60.0, connect=10.0)
    return Call("env_exec", {"id": seg(env_id, "env id")}, json=exec_body(cmd, env, cwd, user, stdin, timeout_s, stream),
                timeout=wait, answer=ExecResult)


def exec_line(line: str, on_output: Callable[[str, bytes], Any] | None) -> ExecResult | None:
    """One NDJSON frame of a streamed exec: output goes to ``on_output``; the result is returned;
    an error frame is raised."""
    if not line.strip():
        return None
    frame = _exec_frame.decode(line)
    if frame.stream is not None:
        if on_output is not None:
            on_output(frame.stream, frame.data_b64 or b"")
        return None
    if frame.error is not None:
        raise error_for(frame.error.status or 500, frame.error.kind, frame.error.message)
    if frame.result is None:
        raise WeenvError(f"an exec frame with nothing in it: {line[:200]!r}")
    return frame.result


class _ExecFrame(wire.ResponseBody, kw_only=True):
    """:class:`weenv._wire.ExecFrame`, its result read as the client's :class:`ExecResult`."""

    stream: str | None = None
    data_b64: bytes | None = None
    result: ExecResult | None = None
    error: wire.ErrorInfo | None = None


_exec_frame = msgspec.json.Decoder(_ExecFrame)


def process_body(cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, user: str | None, stdin: bool,
                 pty: tuple[int, int] | None, tag: str | None, buffer_bytes: int | None) -> bytes:
    argv, shell = (None, cmd) if isinstance(cmd, str) else (list(cmd), None)
    try:
        return wire.encode_request(wire.ProcessStartRequest, argv=argv, cmd=shell, env=env or None, cwd=cwd, user=user,
                                   stdin=stdin or None, tag=tag, buffer_bytes=buffer_bytes,
                                   pty={"rows": pty[0], "cols": pty[1]} if pty is not None else None)
    except msgspec.ValidationError as e:
        raise WeenvError(f"spawn: {e}") from None


def spawn(env_id: str, cmd: str | list[str], *, env: dict[str, str] | None, cwd: str | None, user: str | None,
          stdin: bool, pty: tuple[int, int] | None, tag: str | None, buffer_bytes: int | None) -> Call:
    return Call("process_start", {"id": seg(env_id, "env id")},
                content=process_body(cmd, env, cwd, user, stdin, pty, tag, buffer_bytes), timeout=STREAM_WAIT)


def process(env_id: str, pid: int) -> dict[str, Any]:
    return {"id": seg(env_id, "env id"), "pid": int(pid)}


def process_stream(env_id: str, pid: int) -> Call:
    return Call("process_stream", process(env_id, pid), timeout=STREAM_WAIT)


def process_list(env_id: str) -> Call:
    return Call("process_list", env(env_id), answer=list[wire.ProcessInfo])


def process_show(env_id: str, pid: int) -> Call:
    return Call("process_show", process(env_id, pid), answer=wire.ProcessInfo)


def stdin_calls(env_id: str, pid: int, data: bytes | str, close: bool) -> list[Call]:
    """Stdin, in pieces each of which fits one request body."""
    payload = data.encode() if isinstance(data, str) else data
    out = []
    for i in range(0, max(len(payload), 1), wire.MAX_STDIN_CHUNK_BYTES):
        last = i + wire.MAX_STDIN_CHUNK_BYTES >= len(payload)
        body = wire.encode(wire.StdinRequest(data_b64=payload[i : i + wire.MAX_STDIN_CHUNK_BYTES], close=close and last))
        out.append(Call("process_stdin", process(env_id, pid), content=body, answer=wire.Done))
    return out


def signal(env_id: str, pid: int, sig: int | str) -> Call:
    return Call("process_signal", process(env_id, pid), json={"signal": int(sig) if isinstance(sig, int) else sig},
                answer=wire.Done)


def resize(env_id: str, pid: int, rows: int, cols: int) -> Call:
    return Call("process_resize", process(env_id, pid), json={"rows": rows, "cols": cols}, answer=wire.Done)


def wait(env_id: str, pid: int, timeout_s: float | None) -> Call:
    body = {"timeout_s": timeout_s} if timeout_s is not None else {}
    return Call("process_wait", process(env_id, pid), json=body, answer=wire.ProcessWait,
                timeout=httpx.Timeout(None if timeout_s is None else timeout_s + 30.0, connect=10.0))


def process_event(line: str) -> wire.ProcessEvent | None:
    """One NDJSON line of a process stream (None for blank lines); raises the ``error`` line."""
    if not line.strip():
        return None
    ev = _event_decoder.decode(line)
    if ev.error is not None:
        raise error_for(ev.error.status or 500, ev.error.kind, ev.error.message)
    return ev


_event_decoder = msgspec.json.Decoder(wire.ProcessEvent)


def started_pid(ev: wire.ProcessEvent | None) -> int | None:
    return ev.start.pid if ev is not None and ev.start is not None else None


def stream_cut(pid: int) -> WeenvError:
    from ._connection import ApiError

    return ApiError(500, "stream", f"the stream of process {pid} was cut (it may still run: connect again)")


def transport_lost(target: str, e: Exception) -> DaemonUnavailableError:
    return DaemonUnavailableError(f"weenv daemon at {target}: {e}")


def files_read(env_id: str, path: str, user: str | None) -> Call:
    return Call("files_get", env(env_id), query={"path": path, **({"user": user} if user else {})}, answer=None)


def files_write(env_id: str, path: str, data: bytes | str, mode: int, user: str | None,
                xattrs: dict[str, str] | None = None) -> Call:
    content = data.encode() if isinstance(data, str) else data
    extra = {"xattrs": msgspec.json.encode(xattrs).decode()} if xattrs else {}
    return Call("files_put", env(env_id), content=content,
                query={"path": path, "mode": f"{mode:o}", **({"user": user} if user else {}), **extra},
                answer=wire.PathDone)


def archive_put(env_id: str, path: str, data: Any) -> Call:
    content = data.read() if hasattr(data, "read") else data
    return Call("archive_put", env(env_id), content=content, query={"path": path}, answer=wire.PathDone,
                timeout=httpx.Timeout(None, connect=10.0))


def archive_get(env_id: str, path: str) -> Call:
    return Call("archive_get", env(env_id), query={"path": path}, answer=None,
                timeout=httpx.Timeout(None, connect=10.0))


def files_list(env_id: str, path: str, xattrs: bool = False) -> Call:
    query = {"path": path, "op": "list", **({"xattrs": "true"} if xattrs else {})}
    return Call("files_get", env(env_id), query=query, answer=list[wire.FileInfo])


def files_stat(env_id: str, path: str, xattrs: bool = False) -> Call:
    query = {"path": path, "op": "stat", **({"xattrs": "true"} if xattrs else {})}
    return Call("files_get", env(env_id), query=query, answer=wire.FileInfo)


def files_mkdir(env_id: str, path: str, mode: int, user: str | None = None) -> Call:
    return Call("files_mkdir", env(env_id), query={"path": path, "mode": f"{mode:o}", **({"user": user} if user else {})},
                answer=wire.PathDone)


def files_move(env_id: str, path: str, to: str) -> Call:
    return Call("files_move", env(env_id), query={"path": path, "to": to}, answer=wire.FileInfo)


def files_remove(env_id: str, path: str, recursive: bool) -> Call:
    return Call("files_delete", env(env_id), query={"path": path, "recursive": "1" if recursive else "0"},
                answer=wire.PathDone)


def pause(env_id: str, memory: bool | str = True, park_after_s: float | None = None) -> Call:
    if memory not in (True, False, "park"):
        raise ValueError(f"pause memory={memory!r}: True (freeze), False (end its processes) or 'park'")
    query = {"memory": "park"} if memory == "park" else None if memory else {"memory": "false"}
    if park_after_s is not None:
        if memory is not True:
            raise ValueError(f"pause park_after_s: only with a freeze (memory=True), not memory={memory!r}")
        if not park_after_s >= 0:
            raise ValueError(f"pause park_after_s={park_after_s!r}: a number of seconds >= 0 (math.inf: never)")
        query = {"park_after_s": repr(float(park_after_s))}
    return Call("env_pause", env(env_id), query=query, answer=wire.EnvStatus)


def resume(env_id: str) -> Call:
    return Call("env_resume", env(env_id), answer=wire.EnvStatus)


def set_ttl(env_id: str, ttl_s: float | None) -> Call:
    return Call("env_ttl", env(env_id), json={"ttl_s": ttl_s}, answer=wire.EnvInfo)


def network(env_id: str) -> Call:
    return Call("network_show", env(env_id), answer=wire.NetworkInfo)


def set_network(env_id: str, allow: list[str], deny: list[str], remove: list[str]) -> Call:
    return Call("network_change", env(env_id), json={"allow": list(allow), "deny": list(deny), "remove": list(remove)},
                answer=wire.NetworkInfo)


def commit(env_id: str, ref: str | None, memory: bool = False) -> Call:
    return Call("env_commit", env(env_id), json={"ref": ref, **({"memory": True} if memory else {})},
                answer=wire.CommitResponse)


def fork(env_id: str, n: int, memory: bool = False) -> Call:
    return Call("env_fork", env(env_id), json={"n": n, **({"memory": True} if memory else {})},
                answer=wire.ForkResponse)


def kill(env_id: str) -> Call:
    return Call("env_kill", env(env_id), answer=wire.EnvStatus)
