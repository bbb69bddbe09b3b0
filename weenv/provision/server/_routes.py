"""The daemon's own HTTP API (``/v1/...`` on ``run/weenv.sock``), apart from the daemon.

Each route decodes its body and query with the wire types (:mod:`weenv._wire`) at the boundary,
calls the env manager (:class:`~weenv.provision.envs.EnvManager`) or the monitor, and encodes the
answer; :func:`_error` maps the expected errors to HTTP answers (anything else is a 500 in the
server, :mod:`._http`). The E2B-compatible API (:mod:`weenv.api`) sits beside this one: a server of
its own that reaches the daemon through this API.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from functools import lru_cache, partial
from typing import Any

import msgspec
import trio

from ... import __version__
from ... import _wire as wire
from ... import _wire_volumes as vw
from ..._routes import by_name
from ...envlet import EnvletError
from ...plan import Lock, Plan, PlanError, apply_overrides, load_any, plan_from_builtins
from .._errors import (
    AdmissionError,
    EnvFileError,
    EnvFileNotFoundError,
    EnvNotFoundError,
    EnvStartError,
    EnvStateError,
    ProcessNotFoundError,
    ProcessStartError,
    ProcessExitedError,
    ProcessStateError,
    MemorySnapshotUnavailableError,
    ProvisionError,
    SpecError,
)
from ._http import HTTPError, Request, Response, Router, Send, StreamResponse, error_info, json_response
from ..elastic import Monitor, PROMETHEUS_CONTENT_TYPE
from ..elastic._history import History, as_point, usage
from ..envs._manager import EnvManager
from ..envs._snapshots import SnapshotNotFoundError
from ..envs._parking import park_after
from ..envs._parking import prometheus_text as parking_prometheus_text
from ..envs._volumes import VolumeError, VolumeExistsError, VolumeInUseError, VolumeNotFoundError
from ..runtime._runtime import ExecResult

log = logging.getLogger("weenv.daemon")



#: Plan texts up to this size are kept parsed (a burst of creates sends one lock many times over).
_PLAN_CACHE_MAX_TEXT = 64 << 10


def _plan_text(text: str, fmt: Any, source: str) -> Plan:
    """The plan a request's text holds: bytes, always the document itself (load_any reads a str that
    does not look like a document as a path, and a request must never name a file on the daemon's
    host). Parsed plans are frozen Structs, so a text seen lately is not parsed again (0.2-0.4 ms of
    a pooled create's ~2 ms here); what fails to parse is not kept."""
    if len(text) > _PLAN_CACHE_MAX_TEXT:
        return load_any(text.encode("utf-8"), fmt=fmt, source=source)
    return _plan_text_cached(text, fmt, source)


@lru_cache(maxsize=64)
def _plan_text_cached(text: str, fmt: Any, source: str) -> Plan:
    return load_any(text.encode("utf-8"), fmt=fmt, source=source)


def _error(e: BaseException) -> HTTPError:
    """Map an expected error to its HTTP answer (anything else is a 500 in the server)."""
    from ...registry import RegistryError

    if isinstance(e, EnvNotFoundError):
        return HTTPError(404, "env_not_found", str(e))
    if isinstance(e, SnapshotNotFoundError):
        return HTTPError(404, "snapshot_not_found", str(e))
    if isinstance(e, VolumeError):
        kind = {VolumeNotFoundError: "volume_not_found", VolumeInUseError: "volume_in_use",
                VolumeExistsError: "conflict"}.get(type(e), "bad_request")
        return HTTPError(wire.KIND_STATUS[kind], kind, str(e))
    if isinstance(e, EnvFileNotFoundError):
        return HTTPError(404, "file_not_found", str(e))
    if isinstance(e, MemorySnapshotUnavailableError):  # before its base: E2B's pause tells it apart
        return HTTPError(409, "memory_unavailable", str(e))
    if isinstance(e, EnvStateError):
        return HTTPError(409, "wrong_state", str(e))
    if isinstance(e, ProcessNotFoundError):
        return HTTPError(404, "process_not_found", str(e))
    if isinstance(e, ProcessExitedError):
        return HTTPError(409, "process_exited", str(e))
    if isinstance(e, ProcessStateError):
        return HTTPError(409, "process_state", str(e))
    if isinstance(e, ProcessStartError):
        return HTTPError(400, "command_not_found" if e.not_found else "cannot_start", str(e))
    if isinstance(e, AdmissionError):
        return HTTPError(503, "not_admitted", str(e))
    if isinstance(e, (PlanError, SpecError)):
        return HTTPError(400, "bad_plan", str(e))
    if isinstance(e, EnvFileError):
        return HTTPError(400, "file_error", str(e))
    if isinstance(e, RegistryError):
        return HTTPError(502, "registry", str(e))
    if isinstance(e, EnvStartError):
        return HTTPError(500, "start_failed", str(e))
    if isinstance(e, (ProvisionError, EnvletError)):
        return HTTPError(500, "failed", str(e))
    raise e



class DaemonApi:
    """The routes of the daemon's API over its parts; :attr:`router` is what the server serves."""

    def __init__(self, *, manager: EnvManager, monitor: Monitor, request_stop: Callable[..., None],
                 started_s: float, history: History | None = None):
        self.manager = manager
        self.monitor = monitor
        self.history = history or History()
        self.request_stop = request_stop
        self.started_s = started_s
        self.envs_dir = manager.envs_dir
        self.router = Router(errors=_error)
        self._routes()

    def _routes(self) -> None:
        """Every route of :data:`weenv._routes.DAEMON_ROUTES`, by name, with its handler and options;
        the router maps the parts' errors to answers (:func:`_error`) for all of them."""
        table: list[tuple[Any, ...]] = [  # (route name, handler[, options])
            ("ping", self.ping),
            ("daemon_stop", self.stop),
            ("env_create", self.create),
            ("env_commit", self.commit),
            ("env_fork", self.fork),
            ("snapshot_list", self.snapshots),
            ("snapshot_show", self.snapshot),
            ("snapshot_delete", self.snapshot_rm),
            ("snapshot_pull", self.snapshot_pull),
            ("env_list", self.ps),
            ("env_show", self.show),
            ("env_kill", self.kill),
            ("env_pause", self.pause, dict(query=PauseQuery)),
            ("env_resume", self.resume),
            ("env_ttl", self.ttl),
            ("env_metrics", self.env_metrics, dict(query=MetricsQuery)),
            ("env_exec", self.exec_),
            ("process_start", self.process_start),
            ("process_list", self.process_list),
            ("process_show", self.process_show),
            ("process_stream", self.process_connect),
            ("process_stdin", self.process_stdin),
            ("process_signal", self.process_signal),
            ("process_resize", self.process_resize),
            ("process_wait", self.process_wait),
            ("port_tunnel", self.port_tunnel, dict(stream_body=True, max_body_bytes=1 << 62)),
            ("files_get", self.files_get, dict(query=wire.FilesQuery)),
            ("files_put", self.files_put, dict(query=wire.FilesWriteQuery, stream_body=True,
                                               max_body_bytes=wire.MAX_UPLOAD_BYTES)),
            ("files_mkdir", self.files_mkdir, dict(query=wire.FilesWriteQuery)),
            ("files_move", self.files_move, dict(query=wire.FilesMoveQuery)),
            ("files_delete", self.files_delete, dict(query=wire.FilesRemoveQuery)),
            ("archive_get", self.archive_get, dict(query=wire.ArchiveQuery)),
            ("archive_put", self.archive_put, dict(query=wire.ArchiveQuery, stream_body=True,
                                                   max_body_bytes=wire.MAX_ARCHIVE_BYTES)),
            ("volume_create", self.volume_create),
            ("volume_list", self.volume_list),
            ("volume_show", self.volume_show),
            ("volume_delete", self.volume_delete),
            ("volume_files_get", self.volume_files_get, dict(query=vw.VolumeFilesQuery)),
            ("volume_files_put", self.volume_files_put, dict(query=vw.VolumeWriteQuery, stream_body=True,
                                                             max_body_bytes=wire.MAX_UPLOAD_BYTES)),
            ("volume_files_mkdir", self.volume_files_mkdir, dict(query=vw.VolumeWriteQuery)),
            ("volume_files_chattr", self.volume_files_chattr, dict(query=vw.VolumeWriteQuery)),
            ("volume_files_delete", self.volume_files_delete, dict(query=vw.VolumeRemoveQuery)),
            ("gc", self.gc),
            ("top", self.top),
            ("network_show", self.network_show),
            ("network_change", self.network_change),
            ("metrics", self.metrics),
        ]
        for name, handler, *opts in table:
            self.router.add(by_name(name), handler, **(opts[0] if opts else {}))

    async def ping(self, req: Request) -> Response:
        return json_response(wire.Ping(pid=os.getpid(), version=__version__, envs=len(self.manager.envs),
                                       uptime_s=time.time() - self.started_s))

    async def stop(self, req: Request) -> Response:
        body = req.decode(wire.StopRequest)
        self.request_stop(kill_envs=body.kill_envs)
        return json_response(wire.StopResponse(pid=os.getpid(), stopping=True, kill_envs=body.kill_envs), 202)

    async def create(self, req: Request) -> Response:
        body = req.decode(wire.CreateRequest)
        overrides = body.overrides.given() if body.overrides is not None else {}
        if body.snapshot is not None:
            rec = await self.manager.create_from_snapshot(body.snapshot, restricted=body.restricted,
                                                          env_id=body.env_id, **overrides)
        else:
            plan = await self._plan_from_request(body, overrides)
            rec = await self.manager.create(plan, restricted=body.restricted, env_id=body.env_id)
        return json_response(self._env_info(rec), 201)

    async def commit(self, req: Request) -> Response:
        body = req.decode(wire.CommitRequest)
        snap = await self.manager.commit(req.params["id"], ref=body.ref, memory=body.memory)
        return json_response(msgspec.convert({"snapshot": snap.id, **snap.public()}, wire.CommitResponse), 201)

    async def fork(self, req: Request) -> Response:
        body = req.decode(wire.ForkRequest)
        snap, children = await self.manager.fork(req.params["id"], body.n, memory=body.memory)
        return json_response(wire.ForkResponse(snapshot=snap.id, envs=[self._env_info(c) for c in children]), 201)

    async def snapshots(self, req: Request) -> Response:
        return json_response(msgspec.convert([s.public() for s in self.manager.snapshots.list()], list[wire.SnapshotInfo]))

    async def snapshot(self, req: Request) -> Response:
        rec = await _sync(self.manager.snapshots.get, req.params["id"])
        return json_response(msgspec.convert({**rec.public(), "lock": rec.lock}, wire.SnapshotDetail))

    async def snapshot_pull(self, req: Request) -> Response:
        rec = await self.manager.pull_snapshot(req.decode(wire.SnapshotPullRequest).ref)
        return json_response(msgspec.convert({**rec.public(), "lock": rec.lock}, wire.SnapshotDetail), 201)

    async def snapshot_rm(self, req: Request) -> Response:
        removed = await _sync(self.manager.delete_snapshot, req.params["id"])
        return json_response(wire.SnapshotRemoved(id=req.params["id"], removed_blobs=list(removed)))

    async def ps(self, req: Request) -> Response:
        top = self.monitor.snapshot().get("envs", {})
        return json_response([self._env_info(rec, top.get(rec.id)) for rec in self.manager.envs.values()
                              if rec.status != "pooled" and rec.id not in self.manager.pool_starting])

    async def show(self, req: Request) -> Response:
        rec = await _sync(self.manager.get, req.params["id"])
        top = self.monitor.snapshot().get("envs", {})
        await self.manager.net.counters()  # the env's accounting, fresh
        return json_response(self._env_info(rec, top.get(rec.id)))

    async def env_metrics(self, req: Request) -> Response:
        """The env's usage points from ``start`` to ``end`` (epoch seconds, either open), oldest first,
        then its usage now when the range reaches now."""
        rec = await _sync(self.manager.get, req.params["id"])
        start, end = (_epoch(v, k) for k, v in (("start", req.q.start), ("end", req.q.end)))
        points = self.history.between(rec.id, start, end)
        now = time.time()
        if (end is None or end >= now) and (start is None or start <= now):
            view = self.monitor.snapshot().get("envs", {}).get(rec.id)
            if view is not None:
                points.append(as_point(usage(view, now)))
        return json_response(points)

    async def kill(self, req: Request) -> Response:
        req.decode(wire.Empty)
        await self.manager.kill(req.params["id"])
        return json_response(wire.EnvStatus(id=req.params["id"], status="killed"))

    async def pause(self, req: Request) -> Response:
        req.decode(wire.Empty)
        if req.q.memory not in (None, "true", "false", "park"):
            raise HTTPError(400, "bad_request",
                            f"query string $.memory: {req.q.memory[:20]!r} is not true, false or park")
        memory = "park" if req.q.memory == "park" else req.q.memory != "false"
        park_after_s = None
        if req.q.park_after_s is not None:
            try:
                park_after_s = float(req.q.park_after_s)
                park_after(park_after_s, None)
            except ValueError:
                raise HTTPError(400, "bad_request", f"query string $.park_after_s: {req.q.park_after_s[:20]!r} is "
                                                    "not a number of seconds >= 0 (inf: never)") from None
            if memory is not True:
                raise HTTPError(400, "bad_request", "query string $.park_after_s: only with a freezer pause "
                                                    f"(memory=true), not memory={req.q.memory}")
        await self.manager.pause(req.params["id"], memory=memory, park_after_s=park_after_s)
        return json_response(wire.EnvStatus(id=req.params["id"], status="paused"))

    async def resume(self, req: Request) -> Response:
        req.decode(wire.Empty)
        await self.manager.resume(req.params["id"])
        return json_response(wire.EnvStatus(id=req.params["id"], status="running"))

    async def ttl(self, req: Request) -> Response:
        body = req.decode(wire.TtlRequest)
        rec = await _sync(self.manager.set_ttl, req.params["id"], body.ttl_s)
        return json_response(self._env_info(rec))

    async def exec_(self, req: Request) -> Response | StreamResponse:
        body = req.decode(wire.ExecRequest)
        argv = body.command()
        kw = dict(env=body.env, cwd=body.cwd, user=body.user, stdin=body.stdin_b64, timeout_s=body.timeout_s)
        env_id = req.params["id"]
        await _sync(self.manager._running, env_id)
        if not body.stream:
            # cancelled (and the command killed) when the client goes away: see _http.Server._watch
            result: ExecResult = await self.manager.exec(env_id, argv, **kw)
            return Response(200, wire.encode(result))
        return StreamResponse(partial(self._exec_stream, env_id, argv, kw))

    # -- process handles (docs/architecture.md, "Processes") --------------------------------

    async def process_start(self, req: Request) -> Response | StreamResponse:
        body = req.decode(wire.ProcessStartRequest)
        pty = (body.pty.rows, body.pty.cols) if body.pty is not None else None
        proc = await self.manager.start_process(req.params["id"], body.command(), env=body.env, cwd=body.cwd,
                                          user=body.user, stdin=body.stdin, pty=pty, tag=body.tag,
                                          buffer_bytes=body.buffer_bytes)
        if not body.stream:
            pid = proc.pid
            with trio.CancelScope(shield=True):
                await proc.aclose()  # detach: the process runs on
            return json_response(await self.manager.process(req.params["id"], pid), 201)
        return StreamResponse(partial(self._process_stream, proc))

    async def process_list(self, req: Request) -> Response:
        return json_response(await self.manager.processes(req.params["id"]))

    async def process_show(self, req: Request) -> Response:
        return json_response(await self.manager.process(req.params["id"], _pid(req)))

    async def process_connect(self, req: Request) -> StreamResponse:
        proc = await self.manager.connect_process(req.params["id"], _pid(req))
        return StreamResponse(partial(self._process_stream, proc))

    async def process_stdin(self, req: Request) -> Response:
        body = req.decode(wire.StdinRequest)
        pid = _pid(req)
        await self.manager.send_stdin(req.params["id"], pid, body.data_b64, close=body.close)
        return json_response(wire.Done(pid=pid))

    async def process_signal(self, req: Request) -> Response:
        body = req.decode(wire.SignalRequest)
        pid = _pid(req)
        await self.manager.signal_process(req.params["id"], pid, _signal_number(body.signal))
        return json_response(wire.Done(pid=pid))

    async def process_resize(self, req: Request) -> Response:
        body = req.decode(wire.PtySize)
        pid = _pid(req)
        await self.manager.resize_process(req.params["id"], pid, body.rows, body.cols)
        return json_response(wire.Done(pid=pid))

    async def process_wait(self, req: Request) -> Response:
        body = req.decode(wire.WaitRequest)
        pid = _pid(req)
        end = await self.manager.wait_process(req.params["id"], pid, body.timeout_s)
        return json_response(wire.ProcessWait(pid=pid, end=end))

    async def port_tunnel(self, req: Request) -> Response | StreamResponse:
        """A byte tunnel to a TCP port on the env's loopback: the request body (chunked, as it
        comes) goes to the port, what the port sends is the chunked answer; the request body's
        end is a half-close. ``weenv serve`` proxies HTTP and WebSocket through it."""
        port = req.params["port"]
        if not port.isdigit():
            raise HTTPError(400, "bad_request", f"port {port!r} is not a number")
        sock = trio.socket.from_stdlib_socket(await self.manager.open_port(req.params["id"], int(port)))
        return StreamResponse(partial(_relay_port, req, trio.SocketStream(sock)), 200, "application/octet-stream")

    async def files_get(self, req: Request) -> Response:
        q: wire.FilesQuery = req.q
        out = await self.manager.files(req.params["id"], q.op, q.path, user=q.user, xattrs=q.xattrs == "true")
        if q.op == "read":
            return Response(200, out, "application/octet-stream")
        return Response(200, wire.encode(out))

    async def files_put(self, req: Request) -> Response:
        q: wire.FilesWriteQuery = req.q
        size = 0
        xattrs = None
        if q.xattrs is not None:
            try:
                xattrs = msgspec.json.decode(q.xattrs, type=dict[str, str])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise HTTPError(400, "bad_request", f"query string $.xattrs: not a JSON object of strings ({e})") from None

        def chunks() -> Iterator[bytes]:
            """Runs in the file write's worker thread: the body goes to disk as it arrives."""
            nonlocal size
            while chunk := trio.from_thread.run(req.receive_chunk):
                size += len(chunk)
                yield chunk

        await self.manager.files(req.params["id"], "write", q.path, data=chunks(),  # type: ignore[arg-type]
                           mode=q.mode_bits(0o644), user=q.user, xattrs=xattrs)
        return json_response(wire.PathDone(path=q.path, size_bytes=size))

    async def files_mkdir(self, req: Request) -> Response:
        q: wire.FilesWriteQuery = req.q
        await self.manager.files(req.params["id"], "mkdir", q.path, mode=q.mode_bits(0o755), user=q.user)
        return json_response(wire.PathDone(path=q.path))

    async def files_move(self, req: Request) -> Response:
        q: wire.FilesMoveQuery = req.q
        return json_response(await self.manager.files(req.params["id"], "move", q.path, to=q.to))

    async def archive_put(self, req: Request) -> Response:
        q: wire.ArchiveQuery = req.q
        size = 0

        def chunks() -> Iterator[bytes]:  # read in the extraction's worker thread, as it arrives
            nonlocal size
            while chunk := trio.from_thread.run(req.receive_chunk):
                size += len(chunk)
                yield chunk

        await self.manager.files(req.params["id"], "extract", q.path, data=chunks())  # type: ignore[arg-type]
        return json_response(wire.PathDone(path=q.path, size_bytes=size))

    async def archive_get(self, req: Request) -> Response:
        q: wire.ArchiveQuery = req.q
        env_id = req.params["id"]
        await self.manager.files(env_id, "stat", q.path)  # a missing path is a 404 before the stream starts

        async def produce(send: Send) -> None:
            await self.manager.files(env_id, "archive", q.path,
                                     data=lambda piece: trio.from_thread.run(send, piece))  # type: ignore[arg-type]

        return StreamResponse(produce, 200, "application/x-tar")

    async def files_delete(self, req: Request) -> Response:
        q: wire.FilesRemoveQuery = req.q
        await self.manager.files(req.params["id"], "remove", q.path, recursive=q.recursive == "1")
        return json_response(wire.PathDone(path=q.path))

    # -- volumes (envs/_volumes.py): node-local storage envs mount --------------------------------

    async def _volume_call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await trio.to_thread.run_sync(partial(fn, *args, **kw))

    async def volume_create(self, req: Request) -> Response:
        body = req.decode(vw.VolumeCreateRequest)
        store = self.manager.volumes
        rec = await self._volume_call(store.create, body.name, body.size_bytes)
        return json_response(msgspec.convert(await self._volume_call(store.info, rec), vw.VolumeInfo), 201)

    async def volume_list(self, req: Request) -> Response:
        store = self.manager.volumes
        infos = await self._volume_call(lambda: [store.info(v) for v in store.list()])
        return json_response(msgspec.convert(infos, list[vw.VolumeInfo]))

    async def volume_show(self, req: Request) -> Response:
        store = self.manager.volumes
        info = await self._volume_call(lambda: store.info(store.get(req.params["id"])))
        return json_response(msgspec.convert(info, vw.VolumeInfo))

    async def volume_delete(self, req: Request) -> Response:
        req.decode(wire.Empty)
        rec = await self._volume_call(self.manager.volumes.delete, req.params["id"])
        return json_response(vw.VolumeRemoved(id=rec.id, name=rec.name))

    async def volume_files_get(self, req: Request) -> Response:
        q: vw.VolumeFilesQuery = req.q
        out = await self._volume_call(self.manager.volumes.files, req.params["id"], q.op, q.path)
        if q.op == "read":
            return Response(200, out, "application/octet-stream")
        return Response(200, wire.encode(out))

    async def volume_files_put(self, req: Request) -> Response:
        q: vw.VolumeWriteQuery = req.q
        uid, gid = q.ids()

        def chunks() -> Iterator[bytes]:  # read in the write's worker thread, as it arrives
            while chunk := trio.from_thread.run(req.receive_chunk):
                yield chunk

        info = await self._volume_call(self.manager.volumes.files, req.params["id"], "write", q.path, data=chunks(),
                                       mode=None if q.mode is None else int(q.mode, 8), uid=uid, gid=gid)
        return json_response(info, 201)

    async def volume_files_mkdir(self, req: Request) -> Response:
        return await self._volume_attrs(req, "mkdir", 201)

    async def volume_files_chattr(self, req: Request) -> Response:
        return await self._volume_attrs(req, "chattr", 200)

    async def _volume_attrs(self, req: Request, op: str, status: int) -> Response:
        q: vw.VolumeWriteQuery = req.q
        uid, gid = q.ids()
        info = await self._volume_call(self.manager.volumes.files, req.params["id"], op, q.path,
                                       mode=None if q.mode is None else int(q.mode, 8), uid=uid, gid=gid)
        return json_response(info, status)

    async def volume_files_delete(self, req: Request) -> Response:
        q: vw.VolumeRemoveQuery = req.q
        await self._volume_call(self.manager.volumes.files, req.params["id"], "remove", q.path,
                                recursive=q.recursive == "1")
        return json_response(wire.PathDone(path=q.path))

    async def gc(self, req: Request) -> Response:
        req.decode(wire.Empty)
        return json_response(await self.manager.gc())

    async def top(self, req: Request) -> Response:
        trees = self.manager.layer_trees.stats() if self.manager.layer_trees is not None else None
        return json_response({**self.monitor.snapshot(), "statistics": msgspec.to_builtins(self.monitor.statistics()),
                              "layer_trees": trees, "network": await self.manager.net.counters()})

    async def network_show(self, req: Request) -> Response:
        rec = await _sync(self.manager.get, req.params["id"])
        return json_response(await self.manager.net.info(rec.id))

    async def network_change(self, req: Request) -> Response:
        """Body ``{"allow": [...], "deny": [...], "remove": [...]}``: the running env's new policy."""
        rec = await _sync(self.manager.get, req.params["id"])
        if rec.status not in ("running", "paused"):
            raise HTTPError(409, "wrong_state", f"env {rec.id} is {rec.status}")
        if rec.id not in self.manager.net.states:
            raise HTTPError(409, "wrong_state", f"env {rec.id} has no egress network")
        try:
            info = await self.manager.net.change_from_body(rec.id, os.path.join(self.envs_dir, rec.id), req.body)
        except ValueError as e:
            raise HTTPError(400, "bad_request", f"network change: {e}") from None
        return json_response(info)

    async def metrics(self, req: Request) -> Response:
        parking = await trio.to_thread.run_sync(parking_prometheus_text, list(self.manager.envs.values()))
        text = self.monitor.prometheus_text() + parking.encode() + (await self.manager.net.prometheus_text()).encode()
        return Response(200, text, PROMETHEUS_CONTENT_TYPE)

    def _env_info(self, rec: Any, resources: dict[str, Any] | None = None) -> wire.EnvInfo:
        return msgspec.convert({**rec.public(self.envs_dir), "resources": resources,
                                "network": self.manager.net.public(rec.id)}, wire.EnvInfo)

    async def _plan_from_request(self, body: wire.CreateRequest, overrides: dict[str, Any]) -> Any:
        try:
            if body.image is not None:
                from ...registry import lock_for_image

                plan = await trio.to_thread.run_sync(lock_for_image, body.image)  # converted once per store
            elif body.plan is not None:
                cls = Lock if "lock_version" in body.plan else Plan
                plan = plan_from_builtins(body.plan, cls, source="request body $.plan")
            else:
                plan = _plan_text(body.plan_text or "", body.format, body.source or "request body $.plan_text")
        except RecursionError:
            raise HTTPError(400, "bad_request", "request body: the plan is nested too deeply") from None
        if overrides:
            plan = apply_overrides(plan, **overrides)
        return plan

    async def _process_stream(self, proc: Any, send: Send) -> None:
        """NDJSON :class:`~weenv._wire.ProcessEvent` lines of an attached process until it ends.
        A client that goes away only detaches: the process runs on, its output kept for the next
        reader (all but what was in flight to this one)."""
        try:
            await send(wire.encode(wire.ProcessEvent(start=wire.ProcessStarted(pid=proc.pid))) + b"\n")
            try:
                async for ev in proc:
                    await send(wire.encode(ev) + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise  # the client is gone: nothing to tell it
            except Exception as e:
                try:
                    err = _error(e)
                    info = error_info(err.status, err.kind, err.message, in_stream=True)
                except Exception:
                    log.exception("process stream failed")
                    info = error_info(500, "internal", f"{type(e).__name__}: {e}", in_stream=True)
                await send(wire.encode(wire.ProcessEvent(error=info)) + b"\n")
        finally:
            with trio.CancelScope(shield=True):
                await proc.aclose()

    async def _exec_stream(self, env_id: str, argv: list[str], kw: dict[str, Any], send: Send) -> None:
        """NDJSON exec frames; runs in the connection's task, so a client that goes away cancels
        the exec (and the env's agent kills the command) instead of leaving it to its timeout."""

        async def on_output(stream: str, data: bytes) -> None:
            await send(wire.encode(wire.ExecFrame(stream=stream, data_b64=data)) + b"\n")  # type: ignore[arg-type]

        try:
            result = await self.manager.exec(env_id, argv, on_output=on_output, **kw)
            final = wire.ExecFrame(result=result)  # type: ignore[arg-type]
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise  # the client is gone: nothing to tell it
        except Exception as e:
            try:
                err = _error(e)
                final = wire.ExecFrame(error=error_info(err.status, err.kind, err.message, in_stream=True))
            except Exception:
                log.exception("exec stream failed")
                final = wire.ExecFrame(error=error_info(500, "internal", f"{type(e).__name__}: {e}", in_stream=True))
        await send(wire.encode(final) + b"\n")


async def _relay_port(req: Request, stream: trio.SocketStream, send: Any) -> None:
    """Both ways at once until the port closes; the client's end of body half-closes toward the port."""
    async with stream:
        async with trio.open_nursery() as nursery:

            async def upstream() -> None:
                try:
                    while chunk := await req.receive_chunk(1):
                        await stream.send_all(chunk)
                    await stream.send_eof()
                except (HTTPError, trio.BrokenResourceError, trio.ClosedResourceError):
                    nursery.cancel_scope.cancel()  # the client went away, or the port did

            nursery.start_soon(upstream)
            while True:
                try:
                    data = await stream.receive_some(1 << 16)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    break
                await send(data)
            nursery.cancel_scope.cancel()


class PauseQuery(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/envs/{id}/pause?memory=false``: end its processes, keep its files;
    ``?memory=park``: checkpoint its memory to disk and free it (gVisor envs);
    ``?park_after_s=N`` (a freeze): park it once it stayed paused N s (``inf``: never; none given:
    the daemon's ``--park-after``)."""

    memory: str | None = None
    park_after_s: str | None = None


class MetricsQuery(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /v1/envs/{id}/metrics?start=&end=``: epoch seconds."""

    start: str | None = None
    end: str | None = None


def _epoch(value: str | None, name: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        t = float(value)
    except ValueError:
        t = float("nan")
    if not 0 <= t < 1e11:  # NaN too
        raise HTTPError(400, "bad_request", f"query string $.{name}: {value[:40]!r} is not a time in epoch seconds")
    return t


def _pid(req: Request) -> int:
    text = req.params["pid"]
    if not text.isdigit() or not 0 < int(text) < 1 << 22:
        raise HTTPError(400, "bad_request", f"path: {text!r} is not a process id (a positive whole number)")
    return int(text)


def _signal_number(sig: int | str) -> int:
    if isinstance(sig, int):
        return sig
    name = sig if sig.startswith("SIG") else f"SIG{sig}"
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise HTTPError(400, "bad_request", f"request body: unknown signal {sig!r} - at `$.signal`") from None


async def _sync(fn, *args):  # type: ignore[no-untyped-def]
    return fn(*args)
