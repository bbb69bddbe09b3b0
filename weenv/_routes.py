"""The daemon's API as data: every route's method and path template, and the one way a path is read.

Authorization and routing must see the same request. So every server that routes a weenv path
(the daemon's own, on its Unix socket; ``weenv serve``'s ``/v1``, which authorizes and then calls
the daemon) reads it with :func:`split_path` and matches it with :func:`match`, and every caller
builds one with :meth:`RouteSpec.path`:

- the path is split at ``/`` as it came on the wire, and each segment is percent-decoded
  **once**; routes are matched on the decoded segments;
- a decoded segment holding ``/``, ``?``, ``#``, ``%``, a backslash, a NUL or another control
  character, or one that is empty, ``.`` or ``..``, is refused (:class:`PathError`, a 400): it
  could only mean one thing to one reader and another to the next;
- a path is built from a template and parameters that each match :data:`SEGMENT`, so what a
  server decodes is exactly what the caller meant.

No I/O here. :data:`DAEMON_ROUTES` lists every route the daemon serves; the daemon registers
exactly these (a test pins it) and ``/v1`` gives each an access rule (weenv/api/_native.py).
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field

__all__ = ["DAEMON_ROUTES", "PathError", "RouteSpec", "SEGMENT", "by_name", "check_segment", "match",
           "split_path"]

SEGMENT = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")
"""What a path parameter may hold: ids, pids, ports and names are all of this shape."""

_FORBIDDEN = re.compile(r"[/?#%\\\x00-\x1f\x7f]")
MAX_SEGMENTS = 16


class PathError(ValueError):
    """A request path that cannot be read one way only; ``segment`` is its index (0-based), or -1."""

    def __init__(self, message: str, segment: int = -1):
        super().__init__(message)
        self.message, self.segment = message, segment


def split_path(raw: str, *, slash_ok_from: int | None = None) -> tuple[str, ...]:
    """The decoded segments of ``raw`` (a request target's path as sent, without the query).

    ``/v1/envs/e-1/exec`` -> ``("v1", "envs", "e-1", "exec")``. Raises :class:`PathError`.
    ``slash_ok_from``: segments from this index on may hold an encoded ``/`` (E2B's template
    names, ``namespace/name:tag``, are one segment), still nothing else of the forbidden."""
    if not raw.startswith("/"):
        raise PathError(f"path {raw[:200]!r} does not start with '/'")
    if "?" in raw or "#" in raw:
        raise PathError(f"path {raw[:200]!r}: '?' or '#' inside the path (send the query after the path)")
    parts = raw[1:].split("/")
    if len(parts) > MAX_SEGMENTS:
        raise PathError(f"path has {len(parts)} segments (at most {MAX_SEGMENTS})")
    out = []
    for i, part in enumerate(parts):
        try:
            text = urllib.parse.unquote(part, errors="strict")
        except UnicodeDecodeError:
            raise PathError(f"path segment {i + 1} ({part[:100]!r}) is not UTF-8 once decoded", i) from None
        if text in ("", ".", ".."):
            raise PathError(f"path segment {i + 1} is {text!r}: empty, '.' and '..' segments are not allowed", i)
        bad = _FORBIDDEN.search(text.replace("/", "") if slash_ok_from is not None and i >= slash_ok_from else text)
        if bad is not None:
            raise PathError(f"path segment {i + 1} ({part[:100]!r}) holds {bad.group()!r} once decoded: "
                            "an encoded '/', '?', '#', '%' or control character is not allowed", i)
        out.append(text)
    return tuple(out)


def check_segment(value: str, what: str = "path parameter") -> str:
    """``value`` if it can be a path segment as it is (:data:`SEGMENT`); ValueError otherwise."""
    if not isinstance(value, str) or not SEGMENT.match(value) or value in (".", ".."):
        raise ValueError(f"{what} {value!r} is not a valid id (letters, digits, '_', '.' and '-')")
    return value


@dataclass(frozen=True)
class RouteSpec:
    """One route: ``method``, ``template`` (``/v1/envs/{id}/exec``) and a ``name`` to refer to it by."""

    name: str
    method: str
    template: str
    segments: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.template.strip("/").split("/")))

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(s[1:-1] for s in self.segments if s.startswith("{"))

    def match(self, segments: tuple[str, ...]) -> dict[str, str] | None:
        """The parameters when ``segments`` (decoded) fit this template, else None."""
        if len(segments) != len(self.segments):
            return None
        params = {}
        for want, got in zip(self.segments, segments):
            if want.startswith("{"):
                params[want[1:-1]] = got
            elif want != got:
                return None
        return params

    def path(self, **params: object) -> str:
        """The path of this route for ``params`` (each checked against :data:`SEGMENT`, then quoted)."""
        if set(params) != set(self.params):
            raise ValueError(f"route {self.name}: parameters {sorted(params)} given, {sorted(self.params)} wanted")
        out = []
        for s in self.segments:
            if s.startswith("{"):
                value = check_segment(str(params[s[1:-1]]), s[1:-1])
                out.append(urllib.parse.quote(value, safe=""))
            else:
                out.append(s)
        return "/" + "/".join(out)


def _r(name: str, method: str, template: str) -> RouteSpec:
    return RouteSpec(name, method, template)


DAEMON_ROUTES: tuple[RouteSpec, ...] = (
    _r("ping", "GET", "/v1/ping"),
    _r("daemon_stop", "POST", "/v1/daemon/stop"),
    _r("env_create", "POST", "/v1/envs"),
    _r("env_list", "GET", "/v1/envs"),
    _r("env_show", "GET", "/v1/envs/{id}"),
    _r("env_kill", "DELETE", "/v1/envs/{id}"),
    _r("env_commit", "POST", "/v1/envs/{id}/commit"),
    _r("env_fork", "POST", "/v1/envs/{id}/fork"),
    _r("env_pause", "POST", "/v1/envs/{id}/pause"),
    _r("env_resume", "POST", "/v1/envs/{id}/resume"),
    _r("env_ttl", "POST", "/v1/envs/{id}/ttl"),
    _r("env_metrics", "GET", "/v1/envs/{id}/metrics"),
    _r("env_exec", "POST", "/v1/envs/{id}/exec"),
    _r("process_start", "POST", "/v1/envs/{id}/processes"),
    _r("process_list", "GET", "/v1/envs/{id}/processes"),
    _r("process_show", "GET", "/v1/envs/{id}/processes/{pid}"),
    _r("process_stream", "GET", "/v1/envs/{id}/processes/{pid}/stream"),
    _r("process_stdin", "POST", "/v1/envs/{id}/processes/{pid}/stdin"),
    _r("process_signal", "POST", "/v1/envs/{id}/processes/{pid}/signal"),
    _r("process_resize", "POST", "/v1/envs/{id}/processes/{pid}/resize"),
    _r("process_wait", "POST", "/v1/envs/{id}/processes/{pid}/wait"),
    _r("port_tunnel", "POST", "/v1/envs/{id}/ports/{port}"),
    _r("files_get", "GET", "/v1/envs/{id}/files"),
    _r("files_put", "PUT", "/v1/envs/{id}/files"),
    _r("files_mkdir", "POST", "/v1/envs/{id}/files/mkdir"),
    _r("files_move", "POST", "/v1/envs/{id}/files/move"),
    _r("files_delete", "DELETE", "/v1/envs/{id}/files"),
    _r("archive_get", "GET", "/v1/envs/{id}/archive"),
    _r("archive_put", "PUT", "/v1/envs/{id}/archive"),
    _r("network_show", "GET", "/v1/envs/{id}/network"),
    _r("network_change", "POST", "/v1/envs/{id}/network"),
    _r("snapshot_list", "GET", "/v1/snapshots"),
    _r("snapshot_pull", "POST", "/v1/snapshots"),
    _r("snapshot_show", "GET", "/v1/snapshots/{id}"),
    _r("snapshot_delete", "DELETE", "/v1/snapshots/{id}"),
    _r("volume_create", "POST", "/v1/volumes"),
    _r("volume_list", "GET", "/v1/volumes"),
    _r("volume_show", "GET", "/v1/volumes/{id}"),
    _r("volume_delete", "DELETE", "/v1/volumes/{id}"),
    _r("volume_files_get", "GET", "/v1/volumes/{id}/files"),
    _r("volume_files_put", "PUT", "/v1/volumes/{id}/files"),
    _r("volume_files_mkdir", "POST", "/v1/volumes/{id}/files/mkdir"),
    _r("volume_files_chattr", "POST", "/v1/volumes/{id}/files/chattr"),
    _r("volume_files_delete", "DELETE", "/v1/volumes/{id}/files"),
    _r("gc", "POST", "/v1/gc"),
    _r("top", "GET", "/v1/top"),
    _r("metrics", "GET", "/v1/metrics"),
)

_BY_NAME = {r.name: r for r in DAEMON_ROUTES}


def by_name(name: str) -> RouteSpec:
    return _BY_NAME[name]


def match(routes: tuple[RouteSpec, ...] | list[RouteSpec], method: str,
          segments: tuple[str, ...]) -> tuple[RouteSpec, dict[str, str]] | tuple[None, bool]:
    """``(route, params)`` for the route ``method segments`` names; ``(None, True)`` when a route has
    that path but another method (a 405), ``(None, False)`` when none has it (a 404)."""
    other_method = False
    for route in routes:
        params = route.match(segments)
        if params is None:
            continue
        if route.method != method:
            other_method = True
            continue
        return route, params
    return None, other_method
