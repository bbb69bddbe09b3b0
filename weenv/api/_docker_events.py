"""Docker's ``GET /events``: the container events (create, start, die, destroy, pause, unpause,
rename) since ``weenv serve`` started, each seen only by keys that may use its container, replayed
from ``since`` and then streamed as they come until ``until`` or until the client goes away. The
server keeps the last :data:`MAX_EVENTS`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ._common import ApiState, HttpError, key_of, state_of
from ._docker_containers import Container, _filters_doc, docker_state
from ._store import may_use

MAX_EVENTS = 10_000


@dataclass
class EventLog:
    events: list[tuple[int, dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (ns, owner, doc)
    changed: anyio.Event = field(default_factory=anyio.Event)


def _log(state: ApiState) -> EventLog:
    ds = docker_state(state)
    if ds.events is None:
        ds.events = EventLog()
    return ds.events  # type: ignore[no-any-return]


def emit(state: ApiState, c: Container, action: str, **extra: str) -> None:
    """One container event, as dockerd writes it (with the legacy ``status``/``id``/``from`` too)."""
    ns = time.time_ns()
    attrs = {**(c.config.get("Labels") or {}), "image": c.image, "name": c.name, **extra}
    doc = {"status": action, "id": c.id, "from": c.image, "Type": "container", "Action": action,
           "Actor": {"ID": c.id, "Attributes": attrs}, "scope": "local", "time": ns // 10**9, "timeNano": ns}
    log = _log(state)
    log.events.append((ns, c.owner, doc))
    del log.events[:-MAX_EVENTS]
    log.changed.set()
    log.changed = anyio.Event()


def _time_ns(request: Request, name: str) -> int | None:
    v = request.query_params.get(name)
    if not v:
        return None
    try:
        secs, _, frac = v.partition(".")
        return int(secs) * 10**9 + int((frac + "000000000")[:9])
    except ValueError:
        raise HttpError(400, "bad_request", f"invalid value for {name}: {v[:50]!r} (unix seconds[.nanoseconds])") \
            from None


def _passes(doc: dict[str, Any], filters: dict[str, list[str]]) -> bool:
    for k, values in filters.items():
        if k == "type" and doc["Type"] not in values:
            return False
        if k == "event" and doc["Action"] not in values:
            return False
        if k == "container" and not any(v in (doc["id"], doc["Actor"]["Attributes"].get("name")) or
                                        doc["id"].startswith(v) for v in values):
            return False
        if k == "label":
            attrs = doc["Actor"]["Attributes"]
            for want in values:
                lk, eq, lv = want.partition("=")
                if lk not in attrs or (eq and attrs[lk] != lv):
                    return False
    return True


async def events(request: Request, params: dict[str, str]) -> Response:
    state, key = state_of(request), key_of(request)
    filters = _filters_doc(request, ("type", "event", "container", "label"))
    since, until = _time_ns(request, "since"), _time_ns(request, "until")
    log = _log(state)

    def fresh(start: int) -> tuple[list[bytes], int]:
        out, seen = [], start
        for ns, owner, doc in [e for e in log.events if e[0] > start]:
            seen = max(seen, ns)
            if (until is None or ns <= until) and may_use(key, owner) and _passes(doc, filters):
                out.append(msgspec.json.encode(doc) + b"\n")
        return out, seen

    async def body() -> AsyncIterator[bytes]:
        seen = (since - 1) if since is not None else time.time_ns()
        while True:
            changed = log.changed
            lines, seen = fresh(seen)
            for line in lines:
                yield line
            now = time.time_ns()
            if until is not None and now >= until:
                return
            with anyio.move_on_after((until - now) / 1e9 if until is not None else 30):
                await changed.wait()

    return StreamingResponse(body(), 200, media_type="application/json")


ROUTES = [("GET", "events", events)]
