"""The daemon's HTTP API bodies: one msgspec Struct per request body, query string and answer.

The daemon decodes every request here, at its boundary, so a handler only ever sees typed,
bounded values; a bad body is a 400 naming the place (``at $.timeout_s``, ``at $.argv[2]``).
The clients encode their requests with the same Structs and decode the answers with them.

Schema evolution rules (the daemon and a client may be of different versions):

- Requests (:class:`RequestBody`) are strict: an unknown field is an error, never ignored, so a
  misspelt option cannot silently do nothing. A new request field must have a default that keeps
  the old behaviour; a client must not send it to an older daemon.
- Answers (:class:`ResponseBody`) are lenient: a client ignores fields it does not know, so the
  daemon may add answer fields at any time. It never removes or retypes one.
- Numbers are bounded (no NaN or infinity: JSON cannot carry NaN, and every float has an upper
  bound, so ``1e999`` is refused). Strings that reach the env's kernel (argv, env, cwd) must not
  hold NUL bytes.

Limits: a JSON body is at most :data:`MAX_JSON_BODY_BYTES`; a file upload (``PUT .../files``) at
most :data:`MAX_UPLOAD_BYTES`, streamed to the env's disk as it arrives.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

MAX_JSON_BODY_BYTES = 1 << 20
MAX_UPLOAD_BYTES = 256 << 20
MAX_EXEC_TIMEOUT_S = 7 * 86400.0
MAX_TTL_S = 366 * 86400.0
MAX_ARGS = 4096  # what weenv-agent takes (its MAX_ARGS)
MAX_FORK = 1024
MAX_PTY_SIDE = 65535
MAX_PROCESS_BUFFER_BYTES = 16 << 20  # what weenv-agent keeps at most (its MAX_BUFFER)
MAX_STDIN_CHUNK_BYTES = 512 << 10  # base64 of it stays under MAX_JSON_BODY_BYTES

T = TypeVar("T")

# -- value types ------------------------------------------------------------------------------

NoNul = Annotated[str, Meta(pattern=r"^[^\x00]*$")]
"""A string the kernel can take (argv, env values, paths): no NUL byte."""
EnvName = Annotated[str, Meta(pattern=r"^[^\x00=]+$")]
"""An environment variable name: not empty, no ``=``, no NUL."""
Path = Annotated[str, Meta(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
TimeoutS = Annotated[float, Meta(gt=0, le=MAX_EXEC_TIMEOUT_S)]
TtlS = Annotated[float, Meta(gt=0, le=MAX_TTL_S)]
Cores = Annotated[float, Meta(gt=0, le=4096)]
Bytes = Annotated[int, Meta(gt=0, le=1 << 60)]
OctalMode = Annotated[str, Meta(pattern=r"^[0-7]{1,4}$")]
"""A file mode as octal digits (``644``), as ``chmod`` takes it."""


class RequestBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Base of what clients send: unknown fields are refused."""


class ResponseBody(msgspec.Struct, kw_only=True):
    """Base of what the daemon answers: clients ignore fields they do not know."""


# -- requests ---------------------------------------------------------------------------------


class ExecRequest(RequestBody):
    """``POST /v1/envs/{id}/exec``: give ``argv`` or ``cmd`` (run by ``/bin/sh -c``)."""

    argv: Annotated[list[NoNul], Meta(min_length=1, max_length=MAX_ARGS)] | None = None
    cmd: NoNul | None = None
    env: dict[EnvName, NoNul] | None = None
    """Merged over the env's own environment."""
    cwd: Path | None = None
    user: Name | None = None
    """A user name or ``uid[:gid]`` from the env's own account files."""
    stdin_b64: bytes | None = None
    """Standard input, base64 on the wire (bytes in Python)."""
    timeout_s: TimeoutS | None = None
    """SIGKILL the command's whole session after this long (the result says ``timed_out``)."""
    stream: bool = False
    """Answer with NDJSON :class:`ExecFrame` lines as output comes, instead of one :class:`ExecResult`."""

    def __post_init__(self) -> None:
        if (self.argv is None) == (self.cmd is None):
            raise ValueError("give exactly one of 'argv' (a non-empty list of strings) or 'cmd' (a string)")

    def command(self) -> list[str]:
        return list(self.argv) if self.argv is not None else ["/bin/sh", "-c", self.cmd or ""]


class PtySize(RequestBody):
    """A pseudo-terminal's size in characters."""

    rows: Annotated[int, Meta(ge=1, le=MAX_PTY_SIDE)] = 24
    cols: Annotated[int, Meta(ge=1, le=MAX_PTY_SIDE)] = 80


class ProcessStartRequest(RequestBody):
    """``POST /v1/envs/{id}/processes``: start a command that outlives this request (a process
    handle, docs/architecture.md "Processes"). Give ``argv`` or ``cmd`` (run by ``/bin/sh -c``)."""

    argv: Annotated[list[NoNul], Meta(min_length=1, max_length=MAX_ARGS)] | None = None
    cmd: NoNul | None = None
    env: dict[EnvName, NoNul] | None = None
    cwd: Path | None = None
    user: Name | None = None
    stdin: bool = False
    """Keep the command's stdin open for ``POST .../stdin`` (else it reads /dev/null)."""
    pty: PtySize | None = None
    """Run it on a pseudo-terminal of this size (stdin, stdout and stderr are the terminal)."""
    tag: Annotated[str, Meta(max_length=256, pattern=r"^[^\x00]*$")] | None = None
    """A label listed with the process."""
    buffer_bytes: Annotated[int, Meta(ge=4096, le=MAX_PROCESS_BUFFER_BYTES)] | None = None
    """Output kept while nobody is connected (newest first dropped oldest; default 1 MiB)."""
    stream: bool = True
    """Answer with NDJSON :class:`ProcessEvent` lines until the process ends or the client goes
    away (the process runs on); false: answer the :class:`ProcessInfo` at once."""

    def __post_init__(self) -> None:
        if (self.argv is None) == (self.cmd is None):
            raise ValueError("give exactly one of 'argv' (a non-empty list of strings) or 'cmd' (a string)")

    def command(self) -> list[str]:
        return list(self.argv) if self.argv is not None else ["/bin/sh", "-c", self.cmd or ""]


class StdinRequest(RequestBody):
    """``POST /v1/envs/{id}/processes/{pid}/stdin``: bytes for the process's stdin, then maybe its end."""

    data_b64: Annotated[bytes, Meta(max_length=MAX_STDIN_CHUNK_BYTES)] = b""
    close: bool = False
    """Close stdin after ``data_b64`` (on a pty: send ^D)."""


class SignalRequest(RequestBody):
    """``POST /v1/envs/{id}/processes/{pid}/signal``: a signal for the process's whole session."""

    signal: Annotated[int, Meta(ge=1, le=64)] | Annotated[str, Meta(pattern=r"^(SIG)?[A-Z0-9+-]{2,12}$")] = 15
    """A number or a name (``SIGTERM``, ``TERM``, ``KILL``)."""


class WaitRequest(RequestBody):
    """``POST /v1/envs/{id}/processes/{pid}/wait``: answers when the process ends, or at ``timeout_s``."""

    timeout_s: TimeoutS | None = None


class Overrides(RequestBody):
    """Values that replace the plan's (see :func:`weenv.plan.apply_overrides`)."""

    name: Name | None = None
    ttl_s: TtlS | None = None
    cpu: Cores | Annotated[str, Meta(max_length=64)] | None = None
    """Cores: ``0.5``, ``"0.5"`` or a range ``"0.25-2"``."""
    memory: Bytes | Annotated[str, Meta(max_length=64)] | None = None
    """Bytes, ``"1GiB"`` or a range ``"512MiB-2GiB"``."""
    env: dict[EnvName, NoNul] | None = None
    workdir: Path | None = None
    user: Name | None = None
    network: Annotated[str, Meta(max_length=64)] | None = None

    def given(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}


class CreateRequest(RequestBody):
    """``POST /v1/envs``: give exactly one of ``plan``, ``plan_text`` or ``snapshot``."""

    plan: dict[str, Any] | None = None
    """A plan or lock (a lock has ``lock_version``) as an object; validated as a plan file is."""
    plan_text: str | None = None
    """A plan or lock document, in ``format``."""
    format: Literal["toml", "json"] = "toml"
    source: Annotated[str, Meta(max_length=4096)] | None = None
    """Names the document in error messages (the client sends the file path)."""
    snapshot: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    overrides: Overrides | None = None

    def __post_init__(self) -> None:
        given = [f for f in ("plan", "plan_text", "snapshot") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'plan' (an object), 'plan_text' (a document) or 'snapshot' (an id)")


class CommitRequest(RequestBody):
    """``POST /v1/envs/{id}/commit``."""

    ref: Annotated[str, Meta(min_length=1, max_length=512)] | None = None
    """Also tag the snapshot's layer under this reference."""


class ForkRequest(RequestBody):
    """``POST /v1/envs/{id}/fork``: commit once, start ``n`` children."""

    n: Annotated[int, Meta(ge=1, le=MAX_FORK)] = 1


class TtlRequest(RequestBody):
    """``POST /v1/envs/{id}/ttl``: the env is killed ``ttl_s`` from now; null: never."""

    ttl_s: TtlS | None = None


class Empty(RequestBody):
    """Routes that take no body (``{}`` or nothing)."""


class StopRequest(RequestBody):
    """``POST /v1/daemon/stop``: pooled envs are killed, the others too with ``kill_envs``."""

    kill_envs: bool = False


class FilesQuery(RequestBody):
    """``GET /v1/envs/{id}/files?path=&op=&user=``."""

    path: Path
    op: Literal["read", "list", "stat"] = "read"
    user: Name | None = None


class FilesWriteQuery(RequestBody):
    """``PUT /v1/envs/{id}/files?path=&mode=&user=`` (the body is the content) and
    ``POST /v1/envs/{id}/files/mkdir?path=&mode=&user=``."""

    path: Path
    mode: OctalMode | None = None
    user: Name | None = None

    def mode_bits(self, default: int) -> int:
        return default if self.mode is None else int(self.mode, 8)


class FilesRemoveQuery(RequestBody):
    """``DELETE /v1/envs/{id}/files?path=&recursive=``."""

    path: Path
    recursive: Literal["0", "1"] = "0"


class NoQuery(RequestBody):
    """Routes that take no query parameters."""


# -- answers ----------------------------------------------------------------------------------


class ErrorInfo(ResponseBody, kw_only=True, omit_defaults=True):
    kind: str
    """Machine-readable: ``bad_request``, ``too_large``, ``env_not_found``, ``wrong_state``, ..."""
    message: str
    status: int | None = None
    """Only in an exec stream, whose HTTP status was already 200."""


class ErrorBody(ResponseBody):
    """Every 4xx/5xx answer."""

    error: ErrorInfo


class Ping(ResponseBody):
    pid: int
    version: str
    envs: int
    uptime_s: float


class EnvInfo(ResponseBody):
    """One env, as ``weenv ps`` shows it."""

    id: str
    name: str
    status: str
    created_s: float
    expires_s: float | None = None
    init_pid: int | None = None
    snapshot: str | None = None
    parent: str | None = None
    groups: list[str | None] = []
    rootfs: str = ""
    error: str | None = None
    timings_ms: dict[str, float] = {}
    resources: dict[str, Any] | None = None
    """The monitor's view (quotas, usage); in ``GET /v1/envs`` and ``GET /v1/envs/{id}``."""
    network: dict[str, Any] | None = None
    """An egress env's addresses, policy, pinned names and accounting (docs/network.md); None otherwise."""


class SnapshotInfo(ResponseBody):
    id: str
    source_env: str | None = None
    created_s: float = 0.0
    layers: list[dict[str, Any]] = []
    ref: str | None = None
    plan: str | None = None
    build_key: str | None = None
    diff_bytes: int = 0
    cpu_quota_cores: float | None = None
    fork: bool = False
    """Made by fork: gc collects it once no env started from it is left."""


class SnapshotDetail(SnapshotInfo, kw_only=True):
    """``GET /v1/snapshots/{id}``: with the plan lock envs from it start on."""

    lock: dict[str, Any] = {}


class CommitResponse(SnapshotInfo, kw_only=True):
    snapshot: str


class ForkResponse(ResponseBody):
    snapshot: str
    envs: list[EnvInfo]


class StopResponse(ResponseBody):
    pid: int
    stopping: bool
    kill_envs: bool


class EnvStatus(ResponseBody):
    """Answer of kill, pause and resume."""

    id: str
    status: str


class SnapshotRemoved(ResponseBody):
    id: str
    removed_blobs: list[str] = []


class PathDone(ResponseBody):
    """Answer of a file write, mkdir or remove."""

    path: str
    size_bytes: int | None = None


class FileInfo(ResponseBody, frozen=True):
    """One directory entry (``op=list``, a list of them, or ``op=stat``), as ``lstat`` sees it (a
    symlink is reported as a symlink, with its target). The env's file API returns it, the daemon
    sends it."""

    name: str
    kind: str
    """"file", "dir", "symlink", "char", "block", "fifo" or "socket"."""
    size_bytes: int
    mode: int
    """Permission bits (``st_mode & 0o7777``)."""
    uid: int
    gid: int
    mtime_s: float
    link_target: str | None = None


class ExecResult(ResponseBody, frozen=True):
    """What one command did. ``exit_code`` is 128+N when a signal N ended it (137 after a
    timeout's SIGKILL) and 127 when the command does not exist in the env. The runtime returns
    it, the daemon sends it, the clients read it (as :class:`weenv.ExecResult`)."""

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    duration_s: float = 0.0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    command_not_found: bool = False


class ExecFrame(ResponseBody, kw_only=True, omit_defaults=True):
    """One NDJSON line of a streamed exec: output (``stream`` + ``data_b64``), then exactly one
    last line with ``result`` or ``error``."""

    stream: Literal["stdout", "stderr"] | None = None
    data_b64: bytes | None = None
    result: ExecResult | None = None
    error: ErrorInfo | None = None


class ProcessEnd(ResponseBody, kw_only=True):
    """How a process ended: ``exit_code`` is 128+N when signal N ended it (``signal`` is then N)."""

    exit_code: int
    signal: int | None = None
    status: str = ""
    """As E2B words it: ``exit status 3``, ``signal: terminated``."""


class ProcessInfo(ResponseBody, kw_only=True):
    """One process of an env started by weenv (``GET /v1/envs/{id}/processes``)."""

    pid: int
    """The pid inside the env."""
    argv: list[str] = []
    env: dict[str, str] = {}
    """The variables given at start (laid over the env's own environment)."""
    cwd: str | None = None
    tag: str | None = None
    pty: bool = False
    background: bool = True
    """False for a one-shot exec's command (it dies with its request)."""
    stdin: bool = False
    """Its stdin is open for writing."""
    running: bool = True
    end: ProcessEnd | None = None
    buffered_bytes: int = 0
    """Output kept for the next reader."""
    dropped_bytes: int = 0
    """Output lost since the last reader because the buffer was full."""


class ProcessStarted(ResponseBody):
    pid: int


class ProcessEvent(ResponseBody, kw_only=True, omit_defaults=True):
    """One NDJSON line of a process stream: first ``start``, then output (``stream`` + ``data_b64``;
    ``dropped``: bytes lost while nobody read), then exactly one of ``end`` or ``error``. A stream
    that ends without either was cut (the process may still run: connect again)."""

    start: ProcessStarted | None = None
    stream: Literal["stdout", "stderr", "pty"] | None = None
    data_b64: bytes | None = None
    dropped: int | None = None
    end: ProcessEnd | None = None
    error: ErrorInfo | None = None


class ProcessWait(ResponseBody, kw_only=True):
    """Answer of ``.../wait``: ``end`` is None when the timeout came first."""

    pid: int
    end: ProcessEnd | None = None


class Done(ResponseBody):
    """Answer of stdin, signal and resize."""

    pid: int


# -- codecs -----------------------------------------------------------------------------------

_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}
encode = msgspec.json.Encoder().encode


def encode_request(cls: type[RequestBody], /, **fields: Any) -> bytes:
    """A request body for ``cls``, checked as the daemon will check it (``None`` fields left out).

    Constructing a Struct does not validate it, and the encoder writes NaN as ``null``: a client
    that built ``TtlRequest(ttl_s=nan)`` would silently clear the TTL. Going through
    ``msgspec.convert`` refuses it here, with the location (``Expected `float` > 0.0 - at $.ttl_s``).
    Raises msgspec.ValidationError."""
    return encode(msgspec.convert({k: v for k, v in fields.items() if v is not None}, cls))


def decode(data: bytes, cls: type[T]) -> T:
    """``data`` (JSON) as ``cls``; raises msgspec.DecodeError / ValidationError with the location,
    or RecursionError for nesting deeper than the interpreter allows."""
    dec = _decoders.get(cls)
    if dec is None:
        dec = _decoders[cls] = msgspec.json.Decoder(cls)
    return dec.decode(data)

