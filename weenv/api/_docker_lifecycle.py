"""Docker's container lifecycle routes beyond start/stop: restart, pause/unpause (weenv's freezer
pause and resume), top (``ps`` run in the env), stats (from weenv's metrics), rename."""

from __future__ import annotations

import datetime as dt
import math
import os
import shlex
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ._common import ApiState, HttpError, daemon_errors, state_of
from ._docker import not_supported
from ._docker_containers import _NAME, Container, _env, _flag, _json, docker_state, emit, find, start, stop

PS_TITLES = ["UID", "PID", "PPID", "C", "STIME", "TTY", "TIME", "CMD"]
"""``ps -ef``'s columns: what dockerd's top answers by default."""
# For an image without ps (Debian minbase has none): the same columns from /proc, C/STIME/TIME unknown.
_PROC_PS = r"""for d in /proc/[0-9]*; do p=${d#/proc/}; [ "$p" = "$$" ] && continue
s=$(cat "$d/stat" 2>/dev/null) || continue; u=$(awk '/^Uid:/{print $2}' "$d/status" 2>/dev/null)
c=$(tr '\0' ' ' < "$d/cmdline" 2>/dev/null); [ -n "$c" ] || c="[$(cat "$d/comm" 2>/dev/null)]"
set -- ${s##*) }; n=$(getent passwd "$u" | cut -d: -f1)
printf '%s\t%s\t%s\t0\t-\t?\t-\t%s\n' "${n:-$u}" "$p" "$2" "${c% }"; done"""


def _running(c: Container) -> None:
    if not c.running:
        raise HttpError(409, "conflict", f"Container {c.id} is not running")


async def restart(request: Request, params: dict[str, str]) -> Response:
    await stop(request, params)
    await start(request, params)
    return Response(b"", 204)


async def pause(request: Request, params: dict[str, str]) -> Response:
    state, c = state_of(request), find(request, params["id"])
    _running(c)
    if c.paused:
        raise HttpError(409, "conflict", f"Container {c.id} is already paused")
    async with daemon_errors():
        await _env(state, c).pause()  # the freezer: memory kept, resumed as it was
    c.paused = True
    emit(state, c, "pause")
    return Response(b"", 204)


async def unpause(request: Request, params: dict[str, str]) -> Response:
    state, c = state_of(request), find(request, params["id"])
    if not c.paused:
        raise HttpError(409, "conflict", f"Container {c.id} is not paused")
    async with daemon_errors():
        await _env(state, c).resume()
    c.paused = False
    emit(state, c, "unpause")
    return Response(b"", 204)


async def rename(request: Request, params: dict[str, str]) -> Response:
    c = find(request, params["id"])
    name = request.query_params.get("name", "").lstrip("/")
    if not name or not _NAME.match(name):
        raise HttpError(400, "bad_request", f"Invalid container name ({name[:130]}), only [a-zA-Z0-9][a-zA-Z0-9_.-] "
                        "are allowed")
    taken = next((x for x in docker_state(state_of(request)).containers.values() if x.name == name), None)
    if taken is not None and taken is not c:
        raise HttpError(409, "conflict", f'Conflict. The container name "/{name}" is already in use by container '
                        f'"{taken.id}". You have to remove (or rename) that container to be able to reuse that name.')
    old, c.name = c.name, name
    emit(state_of(request), c, "rename", oldName="/" + old)
    return Response(b"", 204)


def _table(text: str, width: int) -> list[list[str]]:
    out = []
    for line in text.splitlines():
        if line.strip():
            cols = line.split(None, width - 1)
            out.append(cols + [""] * (width - len(cols)))
    return out


async def top(request: Request, params: dict[str, str]) -> Response:
    """``ps ARGS`` (default ``-ef``) run in the env; an image without ps gets ``ps -ef``'s columns
    read from /proc (``C``, ``STIME`` and ``TIME`` unknown there: ``0``, ``-``, ``-``)."""
    state, c = state_of(request), find(request, params["id"])
    _running(c)
    if c.paused:
        raise HttpError(409, "conflict", f"Container {c.id} is paused, unpause the container before top")
    args = request.query_params.get("ps_args") or "-ef"
    env = _env(state, c)
    async with daemon_errors():
        got = await env.exec(["ps", *shlex.split(args)], user="0", timeout_s=30)
        if got.exit_code == 127:
            if args != "-ef":
                raise not_supported(f"top with ps_args {args[:50]!r} in a container without ps")
            got = await env.exec(["sh", "-c", _PROC_PS], user="0", timeout_s=30)
            if got.exit_code != 0:
                raise HttpError(500, "failed", f"reading /proc in the container failed: {got.stderr[:200]!r}")
            rows = [line.split("\t", 7) for line in got.stdout.decode(errors="replace").splitlines() if line]
            return _json({"Titles": PS_TITLES, "Processes": rows})
    if got.exit_code != 0:
        raise HttpError(500, "failed", f"ps failed: {got.stderr.decode(errors='replace')[:200]}")
    lines = got.stdout.decode(errors="replace").splitlines()
    titles = lines[0].split() if lines else []
    return _json({"Titles": titles, "Processes": _table("\n".join(lines[1:]), len(titles) or 1)})


def _now() -> str:
    d = dt.datetime.now(dt.timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond:06d}000Z"


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu(total_ns: int, cores: int) -> dict[str, Any]:
    return {"cpu_usage": {"total_usage": total_ns, "usage_in_kernelmode": 0, "usage_in_usermode": 0},
            "system_cpu_usage": _system_ns(), "online_cpus": cores,
            "throttling_data": {"periods": 0, "throttled_periods": 0, "throttled_time": 0}}


def _system_ns() -> int:
    """The host's CPU time, as dockerd's ``system_cpu_usage`` (/proc/stat, all CPUs, in ns)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:8]
        return sum(int(x) for x in fields) * (10 ** 9 // os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return 0


async def _stats_doc(state: ApiState, c: Container, pre: dict[str, Any] | None) -> dict[str, Any]:
    """One sample: memory and CPU from the env's usage points (the CPU time integrated over them:
    weenv samples usage, not the cgroup's counter), pids from the daemon's monitor view."""
    usage = limit = pids = total_ns = 0
    cores = os.cpu_count() or 1
    if c.running:
        async with daemon_errors():
            points = await _env(state, c).metrics()
            view = (await state.backend.for_env(c.env_id).top()).envs.get(c.env_id) or {}
        for a, b in zip(points, points[1:]):
            total_ns += int(b.get("cpu_used_cores", 0) * max(0.0, b["t"] - a["t"]) * 1e9)
        if points:
            last = points[-1]
            usage, limit = int(last.get("memory_used_bytes", 0)), int(last.get("memory_limit_bytes", 0))
            if last.get("cpu_quota_cores"):
                cores = max(1, math.ceil(last["cpu_quota_cores"]))
        pids = int((view.get("pids") or {}).get("current") or 0)
    empty = {"cpu_usage": {"total_usage": 0, "usage_in_kernelmode": 0, "usage_in_usermode": 0},
             "system_cpu_usage": 0, "online_cpus": 0,
             "throttling_data": {"periods": 0, "throttled_periods": 0, "throttled_time": 0}}
    return {"read": _now(), "preread": pre["read"] if pre else "0001-01-01T00:00:00Z",
            "pids_stats": {"current": pids} if c.running else {},
            "blkio_stats": {"io_service_bytes_recursive": None, "io_serviced_recursive": None,
                            "io_queue_recursive": None, "io_service_time_recursive": None,
                            "io_wait_time_recursive": None, "io_merged_recursive": None,
                            "io_time_recursive": None, "sectors_recursive": None},
            "num_procs": 0, "storage_stats": {},
            "cpu_stats": _cpu(total_ns, cores) if c.running else empty,
            "precpu_stats": pre["cpu_stats"] if pre else empty,
            "memory_stats": {"usage": usage, "stats": {}, "limit": limit or _host_memory()} if c.running else {},
            "name": "/" + c.name, "id": c.id}


async def stats(request: Request, params: dict[str, str]) -> Response:
    state, c = state_of(request), find(request, params["id"])
    if not _flag(request, "stream", True) or _flag(request, "one-shot"):
        return _json(await _stats_doc(state, c, None))

    async def body() -> AsyncIterator[bytes]:
        pre = None
        while c.id in docker_state(state).containers:
            doc = await _stats_doc(state, c, pre)
            yield msgspec.json.encode(doc) + b"\n"
            pre = doc
            await anyio.sleep(1)

    return StreamingResponse(body(), 200, media_type="application/json")


ROUTES = [
    ("POST", "containers/{id}/restart", restart),
    ("POST", "containers/{id}/pause", pause),
    ("POST", "containers/{id}/unpause", unpause),
    ("POST", "containers/{id}/rename", rename),
    ("GET", "containers/{id}/top", top),
    ("GET", "containers/{id}/stats", stats),
]
