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
from functools import partial
from typing import Any

import msgspec
import trio

from ... import __version__
from ... import _wire as wire
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
    ProcessStateError,
    ProvisionError,
    SpecError,
)
from ._http import HTTPError, Request, Response, Router, Send, StreamResponse, error_info, json_response
from ..elastic import Monitor, PROMETHEUS_CONTENT_TYPE
from ..envs._manager import EnvManager
from ..envs._snapshots import SnapshotNotFoundError
from ..runtime._runtime import ExecResult

log = logging.getLogger("weenv.daemon")


def _error(e: BaseException) -> HTTPError:
    """Map an expected error to its HTTP answer (anything else is a 500 in the server)."""
    from ...registry import RegistryError

    if isinstance(e, EnvNotFoundError):
        return HTTPError(404, "env_not_found", str(e))
    if isinstance(e, SnapshotNotFoundError):
        return HTTPError(404, "snapshot_not_found", str(e))
    if isinstance(e, EnvFileNotFoundError):
        return HTTPError(404, "file_not_found", str(e))
    if isinstance(e, EnvStateError):
        return HTTPError(409, "wrong_state", str(e))
    if isinstance(e, ProcessNotFoundError):
        return HTTPError(404, "process_not_found", str(e))
    if isinstance(e, ProcessStateError):
        return HTTPError(409, "wrong_state", str(e))
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
                 started_s: float):
        self.manager = manager
        self.monitor = monitor
        self.request_stop = request_stop
        self.started_s = started_s
        self.envs_dir = manager.envs_dir
        self.router = Router()
        self._routes()

    def _routes(self) -> None:
        r = self.router
        m = self.manager

        async def call(coro: Any) -> Any:
            try:
                return await coro
            except HTTPError:
                raise
            except Exception as e:
                raise _error(e) from None

        @r.route("GET", "/v1/ping")
        async def ping(req: Request) -> Response:
            return json_response(wire.Ping(pid=os.getpid(), version=__version__, envs=len(m.envs),
                                           uptime_s=time.time() - self.started_s))

        @r.route("POST", "/v1/daemon/stop")
        async def stop(req: Request) -> Response:
            body = req.decode(wire.StopRequest)
            self.request_stop(kill_envs=body.kill_envs)
            return json_response(wire.StopResponse(pid=os.getpid(), stopping=True, kill_envs=body.kill_envs), 202)

        @r.route("POST", "/v1/envs")
        async def create(req: Request) -> Response:
            body = req.decode(wire.CreateRequest)
            overrides = body.overrides.given() if body.overrides is not None else {}
            if body.snapshot is not None:
                rec = await call(m.create_from_snapshot(body.snapshot, **overrides))
            else:
                plan = await call(self._plan_from_request(body, overrides))
                rec = await call(m.create(plan))
            return json_response(self._env_info(rec), 201)

        @r.route("POST", "/v1/envs/{id}/commit")
        async def commit(req: Request) -> Response:
            body = req.decode(wire.CommitRequest)
            snap = await call(m.commit(req.params["id"], ref=body.ref))
            return json_response(msgspec.convert({"snapshot": snap.id, **snap.public()}, wire.CommitResponse), 201)

        @r.route("POST", "/v1/envs/{id}/fork")
        async def fork(req: Request) -> Response:
            body = req.decode(wire.ForkRequest)
            snap, children = await call(m.fork(req.params["id"], body.n))
            return json_response(wire.ForkResponse(snapshot=snap.id, envs=[self._env_info(c) for c in children]), 201)

        @r.route("GET", "/v1/snapshots")
        async def snapshots(req: Request) -> Response:
            return json_response(msgspec.convert([s.public() for s in m.snapshots.list()], list[wire.SnapshotInfo]))

        @r.route("GET", "/v1/snapshots/{id}")
        async def snapshot(req: Request) -> Response:
            rec = await call(_sync(m.snapshots.get, req.params["id"]))
            return json_response(msgspec.convert({**rec.public(), "lock": rec.lock}, wire.SnapshotDetail))

        @r.route("DELETE", "/v1/snapshots/{id}")
        async def snapshot_rm(req: Request) -> Response:
            removed = await call(_sync(m.delete_snapshot, req.params["id"]))
            return json_response(wire.SnapshotRemoved(id=req.params["id"], removed_blobs=list(removed)))

        @r.route("GET", "/v1/envs")
        async def ps(req: Request) -> Response:
            top = self.monitor.snapshot().get("envs", {})
            return json_response([self._env_info(rec, top.get(rec.id)) for rec in m.envs.values()
                                  if rec.status != "pooled" and rec.id not in m.pool_starting])

        @r.route("GET", "/v1/envs/{id}")
        async def show(req: Request) -> Response:
            rec = await call(_sync(m.get, req.params["id"]))
            top = self.monitor.snapshot().get("envs", {})
            await m.net.counters()  # the env's accounting, fresh
            return json_response(self._env_info(rec, top.get(rec.id)))

        @r.route("DELETE", "/v1/envs/{id}")
        async def kill(req: Request) -> Response:
            req.decode(wire.Empty)
            await call(m.kill(req.params["id"]))
            return json_response(wire.EnvStatus(id=req.params["id"], status="killed"))

        @r.route("POST", "/v1/envs/{id}/pause")
        async def pause(req: Request) -> Response:
            req.decode(wire.Empty)
            await call(m.pause(req.params["id"]))
            return json_response(wire.EnvStatus(id=req.params["id"], status="paused"))

        @r.route("POST", "/v1/envs/{id}/resume")
        async def resume(req: Request) -> Response:
            req.decode(wire.Empty)
            await call(m.resume(req.params["id"]))
            return json_response(wire.EnvStatus(id=req.params["id"], status="running"))

        @r.route("POST", "/v1/envs/{id}/ttl")
        async def ttl(req: Request) -> Response:
            body = req.decode(wire.TtlRequest)
            rec = await call(_sync(m.set_ttl, req.params["id"], body.ttl_s))
            return json_response(self._env_info(rec))

        @r.route("POST", "/v1/envs/{id}/exec")
        async def exec_(req: Request) -> Response | StreamResponse:
            body = req.decode(wire.ExecRequest)
            argv = body.command()
            kw = dict(env=body.env, cwd=body.cwd, user=body.user, stdin=body.stdin_b64, timeout_s=body.timeout_s)
            env_id = req.params["id"]
            await call(_sync(m._running, env_id))
            if not body.stream:
                # cancelled (and the command killed) when the client goes away: see _http.Server._watch
                result: ExecResult = await call(m.exec(env_id, argv, **kw))
                return Response(200, wire.encode(result))
            return StreamResponse(partial(self._exec_stream, env_id, argv, kw))

        # -- process handles (docs/architecture.md, "Processes") --------------------------------

        @r.route("POST", "/v1/envs/{id}/processes")
        async def process_start(req: Request) -> Response | StreamResponse:
            body = req.decode(wire.ProcessStartRequest)
            pty = (body.pty.rows, body.pty.cols) if body.pty is not None else None
            proc = await call(m.start_process(req.params["id"], body.command(), env=body.env, cwd=body.cwd,
                                              user=body.user, stdin=body.stdin, pty=pty, tag=body.tag,
                                              buffer_bytes=body.buffer_bytes))
            if not body.stream:
                pid = proc.pid
                with trio.CancelScope(shield=True):
                    await proc.aclose()  # detach: the process runs on
                return json_response(await call(m.process(req.params["id"], pid)), 201)
            return StreamResponse(partial(self._process_stream, proc))

        @r.route("GET", "/v1/envs/{id}/processes")
        async def process_list(req: Request) -> Response:
            return json_response(await call(m.processes(req.params["id"])))

        @r.route("GET", "/v1/envs/{id}/processes/{pid}")
        async def process_show(req: Request) -> Response:
            return json_response(await call(m.process(req.params["id"], _pid(req))))

        @r.route("GET", "/v1/envs/{id}/processes/{pid}/stream")
        async def process_connect(req: Request) -> StreamResponse:
            proc = await call(m.connect_process(req.params["id"], _pid(req)))
            return StreamResponse(partial(self._process_stream, proc))

        @r.route("POST", "/v1/envs/{id}/processes/{pid}/stdin")
        async def process_stdin(req: Request) -> Response:
            body = req.decode(wire.StdinRequest)
            pid = _pid(req)
            await call(m.send_stdin(req.params["id"], pid, body.data_b64, close=body.close))
            return json_response(wire.Done(pid=pid))

        @r.route("POST", "/v1/envs/{id}/processes/{pid}/signal")
        async def process_signal(req: Request) -> Response:
            body = req.decode(wire.SignalRequest)
            pid = _pid(req)
            await call(m.signal_process(req.params["id"], pid, _signal_number(body.signal)))
            return json_response(wire.Done(pid=pid))

        @r.route("POST", "/v1/envs/{id}/processes/{pid}/resize")
        async def process_resize(req: Request) -> Response:
            body = req.decode(wire.PtySize)
            pid = _pid(req)
            await call(m.resize_process(req.params["id"], pid, body.rows, body.cols))
            return json_response(wire.Done(pid=pid))

        @r.route("POST", "/v1/envs/{id}/processes/{pid}/wait")
        async def process_wait(req: Request) -> Response:
            body = req.decode(wire.WaitRequest)
            pid = _pid(req)
            end = await call(m.wait_process(req.params["id"], pid, body.timeout_s))
            return json_response(wire.ProcessWait(pid=pid, end=end))

        @r.route("POST", "/v1/envs/{id}/ports/{port}", stream_body=True, max_body_bytes=1 << 62)
        async def port_tunnel(req: Request) -> Response | StreamResponse:
            """A byte tunnel to a TCP port on the env's loopback: the request body (chunked, as it
            comes) goes to the port, what the port sends is the chunked answer; the request body's
            end is a half-close. ``weenv serve`` proxies HTTP and WebSocket through it."""
            port = req.params["port"]
            if not port.isdigit():
                raise HTTPError(400, "bad_request", f"port {port!r} is not a number")
            sock = trio.socket.from_stdlib_socket(await call(m.open_port(req.params["id"], int(port))))
            return StreamResponse(partial(_relay_port, req, trio.SocketStream(sock)), 200, "application/octet-stream")

        @r.route("GET", "/v1/envs/{id}/files", query=wire.FilesQuery)
        async def files_get(req: Request) -> Response:
            q: wire.FilesQuery = req.q
            out = await call(m.files(req.params["id"], q.op, q.path, user=q.user))
            if q.op == "read":
                return Response(200, out, "application/octet-stream")
            return Response(200, wire.encode(out))

        @r.route("PUT", "/v1/envs/{id}/files", query=wire.FilesWriteQuery, stream_body=True,
                 max_body_bytes=wire.MAX_UPLOAD_BYTES)
        async def files_put(req: Request) -> Response:
            q: wire.FilesWriteQuery = req.q
            size = 0

            def chunks() -> Iterator[bytes]:
                """Runs in the file write's worker thread: the body goes to disk as it arrives."""
                nonlocal size
                while chunk := trio.from_thread.run(req.receive_chunk):
                    size += len(chunk)
                    yield chunk

            await call(m.files(req.params["id"], "write", q.path, data=chunks(),  # type: ignore[arg-type]
                               mode=q.mode_bits(0o644), user=q.user))
            return json_response(wire.PathDone(path=q.path, size_bytes=size))

        @r.route("POST", "/v1/envs/{id}/files/mkdir", query=wire.FilesWriteQuery)
        async def files_mkdir(req: Request) -> Response:
            q: wire.FilesWriteQuery = req.q
            await call(m.files(req.params["id"], "mkdir", q.path, mode=q.mode_bits(0o755), user=q.user))
            return json_response(wire.PathDone(path=q.path))

        @r.route("DELETE", "/v1/envs/{id}/files", query=wire.FilesRemoveQuery)
        async def files_delete(req: Request) -> Response:
            q: wire.FilesRemoveQuery = req.q
            await call(m.files(req.params["id"], "remove", q.path, recursive=q.recursive == "1"))
            return json_response(wire.PathDone(path=q.path))

        @r.route("POST", "/v1/gc")
        async def gc(req: Request) -> Response:
            req.decode(wire.Empty)
            return json_response(await call(m.gc()))

        @r.route("GET", "/v1/top")
        async def top(req: Request) -> Response:
            trees = m.layer_trees.stats() if m.layer_trees is not None else None
            return json_response({**self.monitor.snapshot(), "statistics": msgspec.to_builtins(self.monitor.statistics()),
                                  "layer_trees": trees, "network": await m.net.counters()})

        @r.route("GET", "/v1/envs/{id}/network")
        async def network_show(req: Request) -> Response:
            rec = await call(_sync(m.get, req.params["id"]))
            return json_response(await m.net.info(rec.id))

        @r.route("POST", "/v1/envs/{id}/network")
        async def network_change(req: Request) -> Response:
            """Body ``{"allow": [...], "deny": [...], "remove": [...]}``: the running env's new policy."""
            rec = await call(_sync(m.get, req.params["id"]))
            if rec.status not in ("running", "paused"):
                raise HTTPError(409, "wrong_state", f"env {rec.id} is {rec.status}")
            if rec.id not in m.net.states:
                raise HTTPError(409, "wrong_state", f"env {rec.id} has no egress network")
            try:
                info = await m.net.change_from_body(rec.id, os.path.join(self.envs_dir, rec.id), req.body)
            except ValueError as e:
                raise HTTPError(400, "bad_request", f"network change: {e}") from None
            return json_response(info)

        @r.route("GET", "/v1/metrics")
        async def metrics(req: Request) -> Response:
            text = self.monitor.prometheus_text() + (await m.net.prometheus_text()).encode()
            return Response(200, text, PROMETHEUS_CONTENT_TYPE)

    def _env_info(self, rec: Any, resources: dict[str, Any] | None = None) -> wire.EnvInfo:
        return msgspec.convert({**rec.public(self.envs_dir), "resources": resources,
                                "network": self.manager.net.public(rec.id)}, wire.EnvInfo)

    async def _plan_from_request(self, body: wire.CreateRequest, overrides: dict[str, Any]) -> Any:
        try:
            if body.plan is not None:
                cls = Lock if "lock_version" in body.plan else Plan
                plan = plan_from_builtins(body.plan, cls, source="request body $.plan")
            else:
                # bytes: always the document itself (load_any reads a str that does not look like
                # a document as a path, and a request must never name a file on the daemon's host)
                plan = load_any((body.plan_text or "").encode("utf-8"), fmt=body.format,
                                source=body.source or "request body $.plan_text")
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
