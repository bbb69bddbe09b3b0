"""The daemon's HTTP API bodies: one msgspec Struct per request body, query string and answer.

The daemon decodes every request here, at its boundary, so a handler only ever sees typed, bounded
values; a bad body is a 400 naming the place (``at $.timeout_s``, ``at $.argv[2]``). The clients
encode their requests with the same Structs and decode the answers with them.

Schema evolution rules (the daemon and a client may be of different versions):

- Requests (:class:`RequestBody`) are strict: an unknown field is an error, never ignored, so a
  misspelt option cannot silently do nothing. A new request field has a default that keeps the
  old behaviour, and a client does not send it to an older daemon.
- Answers (:class:`ResponseBody`) are lenient: a client ignores fields it does not know, so the
  daemon may add answer fields at any time; it never removes or retypes one.
- Numbers are bounded (no NaN or infinity: JSON cannot carry NaN, every float has an upper bound,
  so ``1e999`` is refused). Strings that reach the env's kernel (argv, env, cwd) hold no NUL byte.

Limits: a JSON body is at most :data:`MAX_JSON_BODY_BYTES`; an upload (``PUT .../files``) at most
:data:`MAX_UPLOAD_BYTES`, streamed to the env's disk as it arrives.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

MAX_JSON_BODY_BYTES = 1 << 20
MAX_UPLOAD_BYTES = 256 << 20
MAX_ARCHIVE_BYTES = 64 << 30  # a tar into an env (COPY, put_archive); its disk bounds it too
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
    """Base of what the daemon answers: clients ignore fields they do not know. Fields read as
    attributes (``info.id``); ``info["id"]`` and ``info.get("id")`` too (code from when answers were dicts)."""

    def __getitem__(self, name: str) -> Any:
        if name not in self.__struct_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default) if name in self.__struct_fields__ else default

    def __contains__(self, name: object) -> bool:
        return name in self.__struct_fields__

    def to_builtins(self) -> dict[str, Any]:
        """As JSON-ready builtins (``weenv ... --json``)."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


# -- requests ---------------------------------------------------------------------------------


class ExecRequest(RequestBody):
    """``POST /v1/envs/{id}/exec``: give ``argv`` or ``cmd`` (run by ``/bin/sh -c``)."""

    argv: Annotated[list[NoNul], Meta(min_length=1, max_length=MAX_ARGS)] | None = None
    cmd: NoNul | None = None
    env: dict[EnvName, NoNul] | None = None  # merged over the env's own environment
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
    tag: Annotated[str, Meta(max_length=256, pattern=r"^[^\x00]*$")] | None = None  # a label listed with it
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
    cpu: Cores | Annotated[str, Meta(max_length=64)] | None = None  # cores: 0.5, "0.5" or a range "0.25-2"
    memory: Bytes | Annotated[str, Meta(max_length=64)] | None = None  # bytes, "1GiB" or a range "512MiB-2GiB"
    env: dict[EnvName, NoNul] | None = None
    workdir: Path | None = None
    user: Name | None = None
    network: Annotated[str, Meta(max_length=64)] | None = None
    volumes: Annotated[list[dict[str, Any]], Meta(max_length=32)] | None = None  # [[volumes]] beside the plan's
    mounts: Annotated[list[dict[str, Any]], Meta(max_length=64)] | None = None  # [[mounts]] too (admin keys only)
    def given(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}


class CreateRequest(RequestBody):
    """``POST /v1/envs``: give exactly one of ``plan``, ``plan_text``, ``snapshot`` or ``image``."""

    plan: dict[str, Any] | None = None
    """A plan or lock (a lock has ``lock_version``) as an object; validated as a plan file is."""
    plan_text: str | None = None  # a plan or lock document, in ``format``
    format: Literal["toml", "json"] = "toml"
    source: Annotated[str, Meta(max_length=4096)] | None = None  # names the document in error messages
    snapshot: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    image: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    """An image REF, ``oci:DIR[:TAG]`` or ``docker-archive:FILE``, converted once (docs/images.md)."""
    overrides: Overrides | None = None
    restricted: bool = False
    """Set by ``weenv serve`` for non-admin keys (a tenant's env, its forks too): its network never opens the
    node, loopback, link-local, the egress range or node addresses (nor DNS answers in them); no host network."""
    env_id: Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")] | None = None  # as new_env_id makes
    """Its id, kept: the cluster gateway's, moving a parked env (``weenv serve`` refuses it; one in use: 409)."""

    def __post_init__(self) -> None:
        given = [f for f in ("plan", "plan_text", "snapshot", "image") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'plan', 'plan_text', 'snapshot' (an id) or 'image' (a REF)")


class CommitRequest(RequestBody):
    """``POST /v1/envs/{id}/commit``."""
    ref: Annotated[str, Meta(min_length=1, max_length=512)] | None = None  # also tag the layer under this reference
    memory: bool = False  # also checkpoint its processes (gVisor envs; docs/snapshots.md, "Memory")


class SnapshotPullRequest(RequestBody):  # POST /v1/snapshots: record the snapshot published at ref (memory pulled)
    ref: Annotated[str, Meta(min_length=1, max_length=512)]


class ForkRequest(RequestBody):
    """``POST /v1/envs/{id}/fork``: commit once, start ``n`` children."""
    n: Annotated[int, Meta(ge=1, le=MAX_FORK)] = 1
    memory: bool = False  # the children restore the parent's processes (a memory snapshot), not boot afresh


class TtlRequest(RequestBody):
    """``POST /v1/envs/{id}/ttl``: the env is killed ``ttl_s`` from now; null: never."""

    ttl_s: TtlS | None = None


class Empty(RequestBody):
    """Routes that take no body (``{}`` or nothing)."""


class StopRequest(RequestBody):
    """``POST /v1/daemon/stop``: pooled envs are killed, the others too with ``kill_envs``."""

    kill_envs: bool = False


class FilesQuery(RequestBody):
    """``GET /v1/envs/{id}/files?path=&op=&user=&xattrs=``."""

    path: Path
    op: Literal["read", "list", "stat"] = "read"
    user: Name | None = None
    xattrs: Literal["true", "false"] = "false"  # stat, list: each entry's user.* extended attributes too


class FilesWriteQuery(RequestBody):
    """``PUT /v1/envs/{id}/files?path=&mode=&user=`` (the body is the content) and
    ``POST /v1/envs/{id}/files/mkdir?path=&mode=&user=``."""

    path: Path
    mode: OctalMode | None = None
    user: Name | None = None
    xattrs: Annotated[str, Meta(max_length=65536)] | None = None  # a write: JSON {NAME: value}, set as user.NAME

    def mode_bits(self, default: int) -> int:
        return default if self.mode is None else int(self.mode, 8)


class FilesRemoveQuery(RequestBody):
    """``DELETE /v1/envs/{id}/files?path=&recursive=``."""

    path: Path
    recursive: Literal["0", "1"] = "0"


class FilesMoveQuery(RequestBody):
    """``POST /v1/envs/{id}/files/move?path=&to=``: rename a path in the env."""

    path: Path
    to: Path


class ArchiveQuery(RequestBody):
    """``PUT /v1/envs/{id}/archive?path=DIR`` (the body a tar) and ``GET ...?path=PATH`` (a tar of it)."""

    path: Path


class NoQuery(RequestBody):
    """Routes that take no query parameters."""


# -- error kinds ------------------------------------------------------------------------------

KIND_STATUS: dict[str, int] = {
    "bad_request": 400, "bad_path": 400, "bad_plan": 400, "file_error": 400, "command_not_found": 400,
    "cannot_start": 400, "unauthorized": 401, "forbidden": 403,
    "not_found": 404, "no_route": 404, "env_not_found": 404, "snapshot_not_found": 404, "file_not_found": 404,
    "process_not_found": 404, "template_not_found": 404, "key_not_found": 404, "volume_not_found": 404,
    "method_not_allowed": 405, "wrong_state": 409, "memory_unavailable": 409, "process_state": 409,
    "process_exited": 409, "conflict": 409, "volume_in_use": 409, "volume_conflict": 409,
    "env_lost": 410, "too_large": 413, "unsupported_media": 415, "quota_exceeded": 429,
    "internal": 500, "failed": 500, "start_failed": 500, "template_unreadable": 500, "not_supported": 501,
    "registry": 502, "store_error": 502, "env_not_running": 502, "daemon_error": 502,
    "not_admitted": 503, "daemon_unavailable": 503, "node_lost": 503,
}
"""Every error answer names a kind; this is the HTTP status each kind travels with, on the daemon's
API and on ``weenv serve`` alike (tests/test_kinds.py checks every place that raises one)."""

API_STATUS: dict[str, int] = {"not_admitted": 429}
"""Where ``weenv serve`` answers a daemon's kind with another status: a full node is E2B's "too
many sandboxes", a 429 (the SDK's RateLimitException)."""


class HttpError(Exception):
    """An error answer: ``status``, a machine ``kind`` (:data:`KIND_STATUS`) and a message for
    people. The daemon's server answers it as ``{"error": {"kind", "message"}}``, ``weenv serve``
    in the shape of the surface asked."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message

    @classmethod
    def of(cls, kind: str, message: str) -> "HttpError":
        """The error of ``kind``, with the status the table gives it."""
        return cls(KIND_STATUS[kind], kind, message)


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
    name: str = ""
    status: str = ""
    created_s: float = 0.0
    expires_s: float | None = None
    init_pid: int | None = None
    snapshot: str | None = None
    parent: str | None = None
    groups: list[str | None] = []
    rootfs: str = ""
    error: str | None = None
    timings_ms: dict[str, float] = {}
    resources: dict[str, Any] | None = None  # the monitor's view (quotas, usage); in GET /v1/envs[/{id}]
    network: dict[str, Any] | None = None  # an egress env's addresses, policy, pins, accounting (docs/network.md)
    restricted: bool = False  # a tenant's env (a non-admin API key's): its egress never opens the node
    user: str | None = None  # its plan's user and working directory (exec's defaults; no user: root)
    workdir: str | None = None
    volumes: list[str] = []  # the ids of the volumes it mounts
    parked: bool = False  # paused with its memory on disk (pause memory=park): resume restores it
    cold: bool = False  # paused without processes in RAM (parked, or memory=false): resume admits it again
    park_at_s: float | None = None  # frozen: when the daemon parks it (pause park_after_s, daemon --park-after)
    not_parked_because: str = ""  # a pause asked to be parked later, and why it will not be (crun; a failed park)
    access_token: str | None = None  # ``weenv serve`` only, to the env's owner: its access token (envd; its ports)
    traffic_token: str | None = None  # ``weenv serve`` only, ports not public: the token that opens them (only them)


class GcReport(ResponseBody):
    """``POST /v1/gc``: what was removed, by kind."""

    envs: list[str] = []
    containers: list[Any] = []
    cgroups: list[Any] = []
    mounts: list[Any] = []
    dirs: list[Any] = []
    layers: list[Any] = []
    pooled: Any = None
    network: Any = None
    snapshots: list[Any] = []
    trees: Any = None
    temps: Any = None


class Top(ResponseBody):
    """``GET /v1/top``: the elastic monitor's view of the node and of every env (docs/elastic.md)."""

    interval_ms: float = 0
    ticks: int = 0
    wall_s: float = 0.0
    node: dict[str, Any] | None = None
    envs: dict[str, dict[str, Any]] = {}
    totals: dict[str, Any] = {}
    policy: dict[str, Any] = {}
    statistics: dict[str, Any] = {}
    layer_trees: dict[str, Any] | None = None
    network: dict[str, Any] = {}
    admission: dict[str, Any] = {}


class NetworkInfo(ResponseBody):
    """``GET|POST /v1/envs/{id}/network``: an egress env's addresses, policy, pinned names and accounting
    (docs/network.md); ``mode`` is ``not egress`` for the others."""

    mode: str = "egress"
    address: str | None = None
    gateway: str | None = None
    netns: str | None = None
    veth: str | None = None
    allow: list[str] = []
    deny: list[str] = []
    dns: str | None = None
    bandwidth_bps: int | None = None
    restricted: bool = False
    policy: dict[str, Any] = {}
    resolved: dict[str, list[str]] = {}
    counters: dict[str, Any] = {}
    dns_dropped: dict[str, Any] | None = None


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
    fork: bool = False  # made by fork: gc collects it once no env started from it is left
    memory: dict[str, Any] | None = None  # a memory snapshot's image (digest, size, toc_digest, image_bytes, facts)


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
    xattrs: dict[str, str] | None = None  # its user.* extended attributes, prefix dropped (when asked)


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
    """One NDJSON line of a streamed exec: output (``stream`` + ``data_b64``), then one last line with
    ``result`` or ``error``."""

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
    """A request body for ``cls`` (``None`` fields left out), checked as the daemon will check it:
    building a Struct validates nothing and NaN encodes as ``null`` (``ttl_s=nan`` would clear the
    TTL); ``msgspec.convert`` refuses it with the location. Raises msgspec.ValidationError."""
    return encode(msgspec.convert({k: v for k, v in fields.items() if v is not None}, cls))


def decode(data: bytes, cls: type[T]) -> T:
    """``data`` (JSON) as ``cls``; msgspec.DecodeError / ValidationError name the place."""
    dec = _decoders.get(cls)
    if dec is None:
        dec = _decoders[cls] = msgspec.json.Decoder(cls)
    return dec.decode(data)

