"""The Docker Engine API on ``weenv serve``: what docker-py (and SWE-bench-style harnesses) call.

Served on the TCP listen under the API key (``Authorization: Bearer KEY``, docs/docker.md) and on
``--docker unix:///PATH`` (the socket acts as one configured key). A request is a Docker request
when it comes on that socket, or when its path starts with a version prefix (``/v1.45/...``) or
with one of Docker's own top-level names (:data:`UNVERSIONED`). Its path is read once
(:func:`parse`): the version prefix taken off, the rest split into decoded segments, each of
which is then matched against :data:`ROUTES` (data: method, segments, handler); the same
segments name the container or exec instance that is authorized and used. A Docker route that
weenv does not serve answers 501 naming it; every error is Docker's shape ``{"message": ...}``.

The routes live in weenv/api/_docker_create.py, _docker_containers.py and _docker_lifecycle.py
(containers), _docker_attach.py (attach, resize), _docker_images.py (list, inspect, pull, tag,
remove), _docker_commit.py (commit, export), _docker_build.py (``/build``), _docker_events.py,
weenv/api/_docker_archive.py (``put_archive`` / ``get_archive``) and weenv/api/_docker_exec.py
(exec; the hijacked connection both use is weenv/api/_hijack.py); this module has the
system routes, the framing of Docker's multiplexed streams (:func:`frame`), the errors and the dispatch.
"""

from __future__ import annotations

import os
import platform
import re
import struct
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__ as weenv_version
from ._common import HttpError, log, state_of

__all__ = ["API_VERSION", "MIN_API_VERSION", "ROUTES", "STDERR", "STDOUT", "create_docker_app", "frame",
           "is_docker_path", "parse"]

API_VERSION = "1.45"
"""The newest Docker Engine API version served (docker-py 7's default is 1.45)."""
MIN_API_VERSION = "1.24"
STDIN, STDOUT, STDERR = 0, 1, 2
_FRAME_HEADER = struct.Struct(">BxxxL")
UNVERSIONED = frozenset({"_ping", "version", "info", "events", "containers", "exec", "images", "build", "commit",
                         "networks", "system", "plugins", "swarm", "nodes", "services", "tasks", "secrets",
                         "configs", "session", "distribution", "auth", "grpc"})
"""Docker's top-level names that mean Docker on the TCP listen without a version prefix (not
``/volumes``: that is E2B's there; on the Docker socket every path is Docker's)."""
_VERSION = re.compile(r"^v(\d{1,3})\.(\d{1,3})$")
_NAMES = {STDOUT: "stdout", STDERR: "stderr"}


def frame(stream: int, data: bytes) -> bytes:
    """One frame of Docker's multiplexed stream (a non-TTY container's logs, an exec's output):
    the stream (0 stdin, 1 stdout, 2 stderr), three zero bytes, the big-endian length, the data
    (moby ``pkg/stdcopy``; docker-py ``docker/utils/socket.py`` reads it)."""
    return _FRAME_HEADER.pack(stream, len(data)) + data


def is_docker_path(path: str) -> bool:
    """Whether a request path on the TCP listen is Docker's (see the module docstring)."""
    first = path[1:].split("/", 1)[0]
    return bool(_VERSION.match(first)) or first in UNVERSIONED


def _version_tuple(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def docker_error(status: int, message: str) -> Response:
    return Response(msgspec.json.encode({"message": message}), status, media_type="application/json")


def not_supported(what: str) -> HttpError:
    return HttpError(501, "not_supported", f"weenv's Docker API does not support {what} (docs/docker.md)")


def parse(raw_path: str) -> tuple[tuple[int, int] | None, tuple[str, ...]]:
    """``(version or None, segments)`` of a Docker request path as it came (not decoded): each
    segment decoded once; an encoded ``/`` in a segment, and empty, ``.`` or ``..`` segments are
    a 400 (ids never hold them, and nothing is re-joined into a path)."""
    parts = raw_path.split("?", 1)[0][1:].split("/")
    version = None
    m = _VERSION.match(parts[0]) if parts else None
    if m:
        version = (int(m.group(1)), int(m.group(2)))
        parts = parts[1:]
        if version > _version_tuple(API_VERSION):
            raise HttpError(400, "bad_request", f"client version {m.group(1)}.{m.group(2)} is too new. Maximum "
                            f"supported API version is {API_VERSION}")
        if version < _version_tuple(MIN_API_VERSION):
            raise HttpError(400, "bad_request", f"client version {m.group(1)}.{m.group(2)} is too old. Minimum "
                            f"supported API version is {MIN_API_VERSION}, please upgrade your client to a newer "
                            "version")
    out = []
    for i, part in enumerate(parts):
        try:
            text = urllib.parse.unquote(part, errors="strict")
        except UnicodeDecodeError:
            raise HttpError(400, "bad_request", f"path segment {i + 1} is not UTF-8 once decoded") from None
        if text in ("", ".", "..") or "/" in text or "\x00" in text:
            raise HttpError(400, "bad_request", f"path segment {i + 1} ({part[:100]!r}): an empty, '.', '..' or "
                            "encoded '/' segment is not allowed")
        out.append(text)
    return version, tuple(out)


Handler = Callable[[Request, dict[str, str]], Awaitable[Response]]


@dataclass(frozen=True)
class DockerRoute:
    method: str
    segments: tuple[str, ...]
    handler: Handler

    def match(self, method: str, segments: tuple[str, ...]) -> dict[str, str] | None:
        if method != self.method and not (method == "HEAD" and self.method == "GET"):
            return None
        star = next((i for i, w in enumerate(self.segments) if w.endswith("*}")), None)
        if star is not None:  # an image name: one or more segments (a decoded segment never holds "/")
            extra = len(segments) - len(self.segments)
            if extra < 0:
                return None
            segments = (*segments[:star], "/".join(segments[star:star + extra + 1]), *segments[star + extra + 1:])
        if len(segments) != len(self.segments):
            return None
        params = {}
        for want, got in zip(self.segments, segments):
            if want.startswith("{"):
                params[want[1:-1].rstrip("*")] = got
            elif want != got:
                return None
        return params


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(data), status, media_type="application/json", headers=headers)


def _system_headers() -> dict[str, str]:
    return {"API-Version": API_VERSION, "Docker-Experimental": "false", "Ostype": "linux",
            "Server": f"weenv/{weenv_version} (linux)", "Cache-Control": "no-cache, no-store, must-revalidate",
            "Pragma": "no-cache"}


async def ping(request: Request, params: dict[str, str]) -> Response:
    body = b"" if request.method == "HEAD" else b"OK"
    return Response(body, 200, media_type="text/plain; charset=utf-8", headers=_system_headers())


def _arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


async def version(request: Request, params: dict[str, str]) -> Response:
    kernel = platform.release()
    return _json({"Platform": {"Name": "weenv"}, "Components": [{"Name": "weenv", "Version": weenv_version,
                                                               "Details": {"ApiVersion": API_VERSION}}],
                  "Version": weenv_version, "ApiVersion": API_VERSION, "MinAPIVersion": MIN_API_VERSION,
                  "GitCommit": "", "GoVersion": "", "Os": "linux", "Arch": _arch(), "KernelVersion": kernel,
                  "BuildTime": ""}, headers=_system_headers())


async def info(request: Request, params: dict[str, str]) -> Response:
    from ._docker_containers import visible
    from ._docker_images import images_of

    containers = visible(request)
    running = sum(1 for c in containers if c.running)
    return _json({"ID": "weenv", "Containers": len(containers), "ContainersRunning": running,
                  "ContainersPaused": sum(1 for c in containers if c.paused),
                  "ContainersStopped": len(containers) - running, "Images": len(images_of(request)),
                  "Driver": "weenv", "DriverStatus": [], "MemoryLimit": True, "SwapLimit": False,
                  "CpuCfsPeriod": True, "CpuCfsQuota": True, "OomKillDisable": False, "IPv4Forwarding": False,
                  "Debug": False, "NFd": 0, "NGoroutines": 0, "SystemTime": "", "LoggingDriver": "weenv",
                  "CgroupDriver": "cgroupfs", "CgroupVersion": "2", "KernelVersion": platform.release(),
                  "OperatingSystem": "weenv", "OSType": "linux", "Architecture": platform.machine(),
                  "NCPU": os.cpu_count() or 1, "MemTotal": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                  "Name": platform.node(), "Labels": [], "ServerVersion": weenv_version,
                  "Runtimes": {"weenv": {"path": "weenv"}}, "DefaultRuntime": "weenv",
                  "Swarm": {"LocalNodeState": "inactive"},
                  "SecurityOptions": ["name=userns", "name=seccomp,profile=default"], "Warnings": []},
                 headers=_system_headers())


def _routes() -> list[DockerRoute]:
    from . import _docker_archive as a
    from . import _docker_attach as t
    from . import _docker_build as b
    from . import _docker_commit as cm
    from . import _docker_containers as c
    from . import _docker_create as n
    from . import _docker_events as e
    from . import _docker_exec as x
    from . import _docker_images as i
    from . import _docker_lifecycle as life

    table: list[tuple[str, str, Handler]] = [
        ("GET", "_ping", ping), ("GET", "version", version), ("GET", "info", info),
        *n.ROUTES, *c.ROUTES, *t.ROUTES, *a.ROUTES, *x.ROUTES, *i.ROUTES, *life.ROUTES, *e.ROUTES, *cm.ROUTES,
        *b.ROUTES,
    ]
    return [DockerRoute(m, tuple(p.split("/")), h) for m, p, h in table]


ROUTES: list[DockerRoute] = []


async def dispatch(request: Request) -> Response:
    """The one Docker handler: parse the path once, match a route, run it (501 for the rest)."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, (bytes, bytearray)) else urllib.parse.quote(request.url.path)
    _version, segments = parse(path)
    if not ROUTES:
        ROUTES.extend(_routes())
    for route in ROUTES:
        params = route.match(request.method, segments)
        if params is not None:
            return await route.handler(request, params)
    shown = "/" + "/".join(urllib.parse.quote(s, safe=":@") for s in segments)
    if any(r.match(r.method, segments) is not None and not r.segments[-1].endswith("*}") for r in ROUTES):
        # (a route ending in an image name, DELETE /images/{name*}, matches every path under it: not a 405)
        raise HttpError(405, "method_not_allowed", f"{request.method} is not allowed on {shown[:200]}")
    raise not_supported(f"{request.method} {shown[:200]}")


async def _error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HttpError):
        return docker_error(exc.status, exc.message)
    assert isinstance(exc, StarletteHTTPException)
    return docker_error(exc.status_code, str(exc.detail))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("Docker API %s %s failed", request.method, request.url.path[:200])
    return docker_error(500, f"weenv failed on this request: {type(exc).__name__}")


def create_docker_app(state: Any) -> Starlette:
    app = Starlette(routes=[Route("/{rest:path}", dispatch, methods=["GET", "HEAD", "POST", "PUT", "DELETE"])],
                    exception_handlers={HttpError: _error, StarletteHTTPException: _error})
    app.state.api = state
    return app


def state_for(request: Request) -> Any:
    return state_of(request)
