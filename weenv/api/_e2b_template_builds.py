"""Templates built through the E2B SDK: what ``weenv serve`` keeps of them and how a build runs.

``$WEENV_HOME/api/e2b_templates.json`` (0600, atomic, as the other API files) holds each template
(id, name, owner key, tags -> build ids) and each build (status, its reason when it failed, its
log, bounded, and the lock it made). A build runs in the server's task group; the blocking work
(weenv's builder: envs, commits, image conversion, publishing) in a worker thread, never on the
event loop. Only the event loop writes the file. A build that was waiting or building when the
server stopped is reported as failed ("interrupted") after a restart; finished ones as they were.

Uploads (the tars the SDK sends for ``COPY``, by files hash) are kept per key under
``$WEENV_HOME/api/template-files/<key id>/<hash>.tar`` with the sha256 of what was received.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._common import ApiState, HttpError, log
from ._store import ApiKey, _JsonFile, may_use

MAX_LOG_ENTRIES = 5000
MAX_LOG_MESSAGE = 4096
MAX_BUILDS_KEPT = 20
"""Builds kept per template (the newest); older ones' records and locks go, unless a tag names them."""
BUILD_TIMEOUT_S = float(os.environ.get("WEENV_TEMPLATE_BUILD_TIMEOUT_S", "1800"))
CONCURRENT_BUILDS = 2
ACTIVE_BUILDS_PER_KEY = 4
SERVER_STARTED_S = time.time()


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class LiveBuild:
    """A build this server runs now: its log grows from the worker thread (under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    entries: list[dict[str, Any]] = field(default_factory=list)
    step: str | None = None
    truncated: bool = False

    def add(self, message: str, level: str = "info", step: str | None = None) -> None:
        with self.lock:
            if len(self.entries) >= MAX_LOG_ENTRIES:
                if not self.truncated:
                    self.truncated = True
                    self.entries.append({"timestamp": iso(time.time()), "level": "warn",
                                         "message": f"(log cut at {MAX_LOG_ENTRIES} entries)"})
                return
            entry = {"timestamp": iso(time.time()), "level": level, "message": message[:MAX_LOG_MESSAGE]}
            if step or self.step:
                entry["step"] = step or self.step
            self.entries.append(entry)

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.entries)


class Builds:
    """The records of ``e2b_templates.json`` and the builds running now."""

    def __init__(self, directory: str):
        self.dir = directory
        self._file = _JsonFile(os.path.join(directory, "e2b_templates.json"))
        self.live: dict[str, LiveBuild] = {}
        self.slots = anyio.CapacityLimiter(CONCURRENT_BUILDS)

    # -- records

    def _data(self) -> dict[str, Any]:
        return dict(self._file.read())

    def templates(self) -> dict[str, dict[str, Any]]:
        return dict(self._data().get("templates", {}))

    def template(self, tid: str) -> dict[str, Any] | None:
        return self._data().get("templates", {}).get(tid)

    def build(self, bid: str) -> dict[str, Any] | None:
        rec = self._data().get("builds", {}).get(bid)
        if rec is not None and rec.get("status") in ("waiting", "building") and bid not in self.live \
                and float(rec.get("created_s") or 0) < SERVER_STARTED_S:
            return {**rec, "status": "error", "reason": {"message": "the build was interrupted: weenv serve "
                                                         "restarted before it finished; build it again"}}
        return rec

    def put(self, *, templates: dict[str, Any] | None = None, builds: dict[str, Any] | None = None,
            drop_templates: tuple[str, ...] = (), drop_builds: tuple[str, ...] = ()) -> None:
        data = self._data()
        t = {k: v for k, v in {**data.get("templates", {}), **(templates or {})}.items() if k not in drop_templates}
        b = {k: v for k, v in {**data.get("builds", {}), **(builds or {})}.items() if k not in drop_builds}
        self._file.write({**data, "templates": t, "builds": b})

    def by_name(self, name: str) -> tuple[str, dict[str, Any]] | None:
        for tid, rec in self.templates().items():
            if rec.get("name") == name:
                return tid, rec
        return None

    def owned(self, key: ApiKey, id_or_name: str) -> tuple[str, dict[str, Any]]:
        """A template of ``key``'s by id or name (``name:tag`` too); a 404 for anything else."""
        rec = self.template(id_or_name)
        tid = id_or_name
        if rec is None:
            found = self.by_name(id_or_name.partition(":")[0])
            tid, rec = found if found is not None else (id_or_name, None)
        if rec is None or not may_use(key, rec):
            raise HttpError(404, "template_not_found", f"template '{id_or_name[:200]}' not found")
        return tid, rec

    def owned_build(self, key: ApiKey, tid: str, bid: str) -> dict[str, Any]:
        self.owned(key, tid)
        rec = self.build(bid)
        if rec is None or rec.get("template_id") != tid:
            raise HttpError(404, "not_found", f"build '{bid[:64]}' of template '{tid[:64]}' not found")
        return rec

    def active(self, key: ApiKey) -> int:
        return sum(1 for bid, rec in self._data().get("builds", {}).items()
                   if rec.get("owner_id") == key.id and bid in self.live)

    def entries(self, bid: str, rec: dict[str, Any]) -> list[dict[str, Any]]:
        live = self.live.get(bid)
        return live.snapshot() if live is not None else list(rec.get("log") or [])

    # -- uploads

    def upload_path(self, key: ApiKey, files_hash: str) -> str:
        return os.path.join(self.dir, "template-files", key.id, f"{files_hash}.tar")

    def uploaded(self, key: ApiKey, files_hash: str) -> tuple[str, str] | None:
        """(tar path, sha256 of its content) of an upload of ``key``'s, if there is one."""
        path = self.upload_path(key, files_hash)
        try:
            with open(path + ".sha256", encoding="ascii") as f:
                digest = f.read().strip()
        except OSError:
            return None
        return (path, digest) if os.path.exists(path) else None

    def lock_path(self, tid: str, bid: str) -> str:
        return os.path.join(self.dir, "template-locks", tid, f"{bid}.lock.toml")


def builds_of(state: ApiState) -> Builds:
    if state.template_builds is None:
        state.template_builds = Builds(os.path.dirname(state.templates._file.path))
    return state.template_builds  # type: ignore[no-any-return]


def new_build_id() -> str:
    return str(uuid.uuid4())


@dataclass
class BuildJob:
    """What a build needs, checked by the route that starts it."""

    key: ApiKey
    template_id: str
    build_id: str
    name: str
    tags: list[str]
    base: dict[str, str]
    steps: list[Any]
    start_cmd: str | None
    ready_cmd: str | None
    force: bool
    cpu: float | None
    memory_mb: int | None


def _blocking_build(state: ApiState, job: BuildJob, live: LiveBuild, socket: str) -> Any:
    from .. import Client
    from ..build._templatebuild import build_template

    def on_output(stream: str, data: bytes) -> None:
        for line in data.decode("utf-8", "replace").splitlines():
            live.add(line, "info" if stream == "stdout" else "warn")

    def on_step(i: int) -> None:  # 0: the end (the last WORKDIR, the start and ready commands, publishing)
        live.step = str(i) if i else "finalize"
        if not i:
            live.add("finalizing: the workdir, the start and ready commands, the lock")
            return
        step = job.steps[i - 1]
        live.add(f"[{i}/{len(job.steps)}] {step.kind} {' '.join(step.args)[:500]}")

    deadline = time.monotonic() + BUILD_TIMEOUT_S
    with Client(socket, autostart=False, timeout_s=BUILD_TIMEOUT_S + 60) as c:
        return build_template(
            c, name=job.name, base=job.base, steps=job.steps,
            lock_path=builds_of(state).lock_path(job.template_id, job.build_id), start_cmd=job.start_cmd,
            ready_cmd=job.ready_cmd, network=None if job.key.admin else "loopback", deadline=deadline,
            force=job.force, cpu=job.cpu, memory_mb=job.memory_mb, say=lambda m: live.add(m),
            on_output=on_output, on_step=on_step)


async def run_build(state: ApiState, job: BuildJob) -> None:
    """Run ``job`` to its end (the server's task group); its record says how it ended."""
    from ..build import BuildError, StepFailedError

    builds = builds_of(state)
    live = builds.live.setdefault(job.build_id, LiveBuild())
    started = time.time()
    reason: dict[str, Any] | None = None
    result = None
    try:
        socket = state.backend.any().target
        if socket.startswith(("http://", "https://")):
            raise HttpError(501, "not_supported", "templates are built on a server next to its daemon (its socket)")
        live.add(f"building {job.name} ({len(job.steps)} steps) on weenv's builder", step="base")
        live.step = "base"
        async with builds.slots:
            builds.put(builds={job.build_id: {**(builds.build(job.build_id) or {}), "status": "building"}})
            result = await anyio.to_thread.run_sync(functools.partial(_blocking_build, state, job, live, socket),
                                                    abandon_on_cancel=True)
        cached = sum(1 for s in result.steps if s.cached)
        live.add(f"built in {result.seconds:.2f}s: {len(result.steps) - cached} steps built, {cached} from the "
                 f"step cache, {result.uploaded_bytes} bytes published", step="finalize")
    except StepFailedError as e:
        step = (live.step if e.index >= 0 else "finalize") or "finalize"
        output = [x["message"] for x in live.snapshot() if x.get("step") == step and not x["message"].startswith("[")]
        reason = {"message": str(e).rstrip() + ("\n" + "\n".join(output[-20:]) if output and not e.output_tail else ""),
                  "step": step}
    except (BuildError, HttpError) as e:
        reason = {"message": str(e) if isinstance(e, BuildError) else e.message, "step": live.step or "base"}
    except Exception as e:  # noqa: BLE001 - the build's end is recorded whatever went wrong
        log.exception("template build %s failed", job.build_id)
        reason = {"message": f"the build failed: {type(e).__name__}: {e}", "step": live.step or "base"}
    finally:
        with anyio.CancelScope(shield=True):
            _record_end(state, job, live, result, reason, started)


def _record_end(state: ApiState, job: BuildJob, live: LiveBuild, result: Any, reason: dict[str, Any] | None,
                started: float) -> None:
    builds = builds_of(state)
    if reason is not None:
        live.add(reason["message"], "error", reason.get("step"))
    entries = live.snapshot()
    rec = {**(builds.build(job.build_id) or {}), "status": "error" if reason else "ready", "finished_s": time.time(),
           "seconds": round(time.time() - started, 3), "log": entries}
    if reason is not None:
        rec["reason"] = {**reason, "logEntries": entries[-20:]}
    else:
        rec["lock"] = result.lock_path
        rec["cached_steps"] = sum(1 for s in result.steps if s.cached)
        rec["built_steps"] = sum(1 for s in result.steps if not s.cached)
    tpl = builds.template(job.template_id)
    try:
        if reason is None and tpl is not None:
            publish_tags(state, job.key, job.template_id, tpl, job.build_id, job.tags, rec)
        builds.put(builds={job.build_id: rec})
        prune(state, job.template_id)
    finally:
        builds.live.pop(job.build_id, None)


def alias_entry(key_fields: dict[str, Any], tid: str, bid: str, build: dict[str, Any]) -> dict[str, Any]:
    entry = {"lock": build["lock"], **key_fields, "template_id": tid, "build_id": bid}
    for k in ("start_cmd", "ready_cmd"):
        if build.get(k):
            entry[k] = build[k]
    return entry


def alias_of(name: str, tag: str) -> str:
    return name if tag == "default" else f"{name}:{tag}"


def publish_tags(state: ApiState, key: ApiKey, tid: str, tpl: dict[str, Any], bid: str, tags: list[str],
                 build: dict[str, Any]) -> None:
    """``tags`` of template ``tid`` name build ``bid`` now: the aliases Sandbox.create resolves."""
    owner = {"owner": tpl.get("owner"), "owner_id": tpl.get("owner_id")}
    entries = {alias_of(tpl["name"], t): alias_entry(owner, tid, bid, build) for t in tags}
    state.templates.put(entries)
    now = time.time()
    builds_of(state).put(templates={tid: {**tpl, "tags": {**(tpl.get("tags") or {}),
                                                          **{t: {"build_id": bid, "created_s": now} for t in tags}}}})


def check_aliases_free(state: ApiState, key: ApiKey, name: str, tags: list[str]) -> None:
    """Every alias of ``name:tag`` is free or this key's own: never an operator's or another key's."""
    for tag in tags:
        entry = state.templates.get(alias_of(name, tag))
        if entry is not None and (entry.get("owner_id") is None or entry.get("owner_id") != key.id):
            raise HttpError(409, "conflict", f"template name '{alias_of(name, tag)}' is taken (an operator's alias "
                            "or another key's template): choose another name")


def prune(state: ApiState, tid: str) -> None:
    """Keep the newest :data:`MAX_BUILDS_KEPT` builds of a template, and every build a tag names."""
    builds = builds_of(state)
    tpl = builds.template(tid) or {}
    tagged = {t["build_id"] for t in (tpl.get("tags") or {}).values()}
    mine = sorted(((bid, rec) for bid, rec in builds._data().get("builds", {}).items() if rec.get("template_id") == tid
                   and bid not in builds.live), key=lambda kv: float(kv[1].get("created_s") or 0))
    old = [bid for bid, _ in mine[:-MAX_BUILDS_KEPT] if bid not in tagged]
    for bid in old:
        try:
            os.unlink(builds.lock_path(tid, bid))
        except OSError:
            pass
    if old:
        builds.put(drop_builds=tuple(old))
