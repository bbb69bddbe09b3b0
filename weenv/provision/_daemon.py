"""``weenv daemon``: one per node. Supervises the envlet, runs the monitor, serves the HTTP API.

Envs outlive the daemon: a restarted daemon re-adopts the envs whose container still runs and
reaps the rest. The envlet is its own process (own session) for the same reason.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import time
from typing import Any

import msgspec
import trio

from .. import __version__, _home
from ..envlet import EnvletClient, EnvletError, EnvletProcess
from ..plan import Lock, Plan, PlanError, apply_overrides, load_any, plan_from_builtins
from ._agent import ensure_agent
from ._envs import EnvManager
from ._errors import (
    AdmissionError,
    EnvFileError,
    EnvFileNotFoundError,
    EnvNotFoundError,
    EnvStartError,
    EnvStateError,
    ProvisionError,
    SpecError,
)
from ._http import HTTPError, Request, Response, Router, Server, StreamResponse, json_response
from ._monitor import PROMETHEUS_CONTENT_TYPE, Monitor
from ._policy import PolicyConfig
from ._runtime import CrunRuntime, ExecResult, Runtime
from ._snapshots import SnapshotNotFoundError
from .cgroups import CgroupBackend, detect_backend

log = logging.getLogger("weenv.daemon")
_json = msgspec.json.Encoder()


class DaemonConfig(msgspec.Struct, kw_only=True):
    home: str = msgspec.field(default_factory=_home.home)
    envlet_cache_size_bytes: int = 20 << 30
    envlet_memory_cache_size_bytes: int = 512 << 20
    envlet_deadline_s: float = 30.0
    monitor_interval_ms: int = 200
    monitor_offload: str = "apply"
    """What the monitor runs in a worker thread: "apply" (writes only; counter reads do not block,
    and the thread hop costs more CPU than they do, see benchmarks/monitor_overhead.py) or "all"."""
    monitor_idle_memory_refresh_s: float = 1.0
    """How stale an idle env's memory usage may get before the monitor re-reads it."""
    monitor_cpu_cores: float | None = None
    """Cores the monitor hands out (burst budget, CPU admission); None: the CPUs it may run on."""
    monitor_settled_read_every: int = 1
    """Read an idle, settled env every this many ticks (stalls at a memory limit still wake the
    monitor at once); 1 reads every env every tick."""
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    """Thresholds, hold time, node reserve, burst budget, admission overcommit (docs/elastic.md)."""
    envlet_check_interval_s: float = 0.5  # a ping is ~0.1 ms; a dead envlet is back within 2 s (start ~0.7 s)
    cgroup_root: str = "weenv"  # weenv's parent group, under this process's own cgroup
    use_agent: bool = True  # weenv-agent as the env init (fast exec); False: catatonit + crun exec
    # envs kept started per recently used lock, handed out by create (0: off; env WEENV_POOL_SIZE)
    pool_size: int = msgspec.field(default_factory=lambda: int(os.environ.get("WEENV_POOL_SIZE", "0") or 0))
    pool_idle_s: float = msgspec.field(  # a lock's pool is dropped after this long without a create
        default_factory=lambda: float(os.environ.get("WEENV_POOL_IDLE_S", "120") or 120))
    # a group layer is kept as a local directory after this many env starts used it (0: never;
    # env WEENV_LAYER_TREES_AFTER), within this many bytes of trees (weenv/provision/_trees.py)
    layer_trees_after: int = msgspec.field(
        default_factory=lambda: _int_env("WEENV_LAYER_TREES_AFTER", 3))
    layer_trees_size_bytes: int = msgspec.field(
        default_factory=lambda: _size_env("WEENV_LAYER_TREES_SIZE", 16 << 30))


def _size_env(name: str, default: int) -> int:
    from ..plan._units import parse_size

    value = os.environ.get(name)
    try:
        return parse_size(value) if value else default
    except ValueError as e:
        raise ValueError(f"${name}: {e}") from None


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    try:
        n = int(value) if value else default
    except ValueError:
        raise ValueError(f"${name}: {value!r} is not a whole number") from None
    if n < 0:
        raise ValueError(f"${name}: {n} must not be negative")
    return n


def _error(e: BaseException) -> HTTPError:
    """Map an expected error to its HTTP answer (anything else is a 500 in the server)."""
    from ..registry import RegistryError

    if isinstance(e, EnvNotFoundError):
        return HTTPError(404, "env_not_found", str(e))
    if isinstance(e, SnapshotNotFoundError):
        return HTTPError(404, "snapshot_not_found", str(e))
    if isinstance(e, EnvFileNotFoundError):
        return HTTPError(404, "file_not_found", str(e))
    if isinstance(e, EnvStateError):
        return HTTPError(409, "wrong_state", str(e))
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


class Daemon:
    def __init__(self, config: DaemonConfig | None = None, *, runtime: Runtime | None = None,
                 backend: CgroupBackend | None = None):
        self.config = config or DaemonConfig()
        home = self.config.home
        self.run_dir = os.path.join(home, "run")
        self.socket_path = os.path.join(self.run_dir, "weenv.sock")
        self.envs_dir = os.path.join(home, "envs")
        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        self.runtime = runtime or CrunRuntime(self.run_dir)
        self.backend = backend or detect_backend(self.config.cgroup_root)
        c = self.config
        self.monitor = Monitor(self.backend.node_memory, interval_ms=c.monitor_interval_ms, cfg=c.policy,
                               cpu_cores=c.monitor_cpu_cores, offload=c.monitor_offload,
                               idle_memory_refresh_s=c.monitor_idle_memory_refresh_s,
                               usage_ns=self.backend.usage_ns, settled_read_every=c.monitor_settled_read_every)
        self.envlet_socket = os.path.join(self.run_dir, "envlet.sock")
        self.envlet = EnvletClient(self.envlet_socket)
        self.manager = EnvManager(envs_dir=self.envs_dir, runtime=self.runtime, backend=self.backend,
                                  monitor=self.monitor, envlet=self.envlet)
        if c.layer_trees_after > 0:
            self.manager.enable_layer_trees(after=c.layer_trees_after, budget_bytes=c.layer_trees_size_bytes)
        self.started_s = time.time()
        self._nursery: trio.Nursery | None = None
        self._stop = trio.Event()  # set by SIGTERM/SIGINT or POST /v1/daemon/stop
        self._stop_kill_envs = False
        self.router = Router()
        self._routes()

    # ------------------------------------------------------------------ envlet supervision

    def _envlet_process(self) -> EnvletProcess:
        c = self.config
        return EnvletProcess(os.path.join(c.home, "envlet", "mnt"), os.path.join(c.home, "envlet", "cache"),
                             self.envlet_socket, cache_size_bytes=c.envlet_cache_size_bytes,
                             memory_cache_size_bytes=c.envlet_memory_cache_size_bytes,
                             deadline_s=c.envlet_deadline_s)

    def ensure_envlet(self) -> bool:
        """Start the envlet unless one answers; True when it had to be started."""
        try:
            self.envlet.ping()
            return False
        except EnvletError:
            pass
        log.info("starting the envlet")
        self._envlet_process().start()
        return True

    async def _supervise_envlet(self) -> None:
        while True:
            await trio.sleep(self.config.envlet_check_interval_s)
            try:
                started = await trio.to_thread.run_sync(self.ensure_envlet)
            except EnvletError as e:
                log.error("envlet is down and does not restart: %s", e)
                continue
            if started:
                log.error("the envlet had died and was restarted: envs started before keep their overlay on the "
                          "old mount and may see EIO on files they have not read yet")

    # ------------------------------------------------------------------ main

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(self.ensure_envlet)
        if self.config.use_agent:
            self.manager.agent_path = await trio.to_thread.run_sync(
                ensure_agent, os.path.join(self.config.home, "lib"))
        adoption = await self.manager.adopt()
        server = Server(self.router.dispatch)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.manager.nursery = nursery
            self.manager.pool_size = self.config.pool_size
            if self.config.pool_size:
                nursery.start_soon(self.manager.pool_janitor, self.config.pool_idle_s)
            await nursery.start(self.monitor.run)
            nursery.start_soon(self.manager.ttl_loop)
            if self.manager.layer_trees is not None:
                await nursery.start(self.manager.layer_trees.run, self.manager.trees_in_use)
            nursery.start_soon(self._supervise_envlet)
            await nursery.start(server.serve_unix, self.socket_path)
            log.info("weenv daemon %s serving %s (re-adopted %d envs)", __version__, self.socket_path,
                     len(adoption["adopted"]))
            nursery.start_soon(self._signals)
            task_status.started()
            await self._stop.wait()
            await self._stop_envs()
            nursery.cancel_scope.cancel()
        # Background work is over (no envlet restart, no pool refill): the envlet goes too, unless
        # envs kept running stack its layers (then it serves them until `daemon stop --kill-envs`).
        live = [rec.id for rec in self.manager.envs.values() if rec.status in ("creating", "running", "paused")]
        if live:
            log.info("stopped; %d envs keep running, and the envlet keeps serving their layers", len(live))
        else:
            await trio.to_thread.run_sync(self._stop_envlet)
            log.info("stopped (the envlet too)")

    def request_stop(self, *, kill_envs: bool = False) -> None:
        """Stop the daemon: pooled envs are killed, the others too with ``kill_envs``; then the envlet
        stops if no env is left running on it."""
        self._stop_kill_envs = self._stop_kill_envs or kill_envs
        self._stop.set()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:  # a second signal while stopping changes nothing
                log.info("%s received: stopping (envs keep running)", signal.Signals(signum).name)
                self.request_stop()

    async def _stop_envs(self) -> None:
        m = self.manager
        try:
            await m.drain_pools()
        except Exception as e:
            log.warning("stop: draining the warm pools failed: %s", e)
        if not self._stop_kill_envs:
            return
        ids = [env_id for env_id, rec in m.envs.items() if rec.status != "failed"]
        log.info("stop: killing %d envs", len(ids))

        async def kill(env_id: str) -> None:
            try:
                await m.kill(env_id)
            except Exception as e:  # the others still go; gc after a restart finishes this one
                log.warning("stop: env %s: %s", env_id, e)

        async with trio.open_nursery() as nursery:
            for env_id in ids:
                nursery.start_soon(kill, env_id)

    def _stop_envlet(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the envlet (it unmounts), wait for it; SIGKILL and a lazy unmount past the timeout."""
        from ..envlet._control import _alive
        from ..envlet._server import clear_stale_mount

        try:
            info = self.envlet.ping()
        except EnvletError:
            return
        pid, mountpoint = int(info["pid"]), info.get("mountpoint") or ""
        try:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(pid):
                log.warning("the envlet (pid %d) did not stop within %g s: killing it", pid, timeout_s)
                os.kill(pid, signal.SIGKILL)
                while _alive(pid) and time.monotonic() < deadline + 5:
                    time.sleep(0.02)
        except ProcessLookupError:
            pass
        if mountpoint:
            clear_stale_mount(mountpoint)

    # ------------------------------------------------------------------ API

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
            return json_response({"pid": os.getpid(), "version": __version__, "envs": len(m.envs),
                                  "uptime_s": time.time() - self.started_s})

        @r.route("POST", "/v1/daemon/stop")
        async def stop(req: Request) -> Response:
            kill_envs = req.json().get("kill_envs", False)
            if not isinstance(kill_envs, bool):
                raise HTTPError(400, "bad_request", f"'kill_envs' must be true or false, got {kill_envs!r}")
            self.request_stop(kill_envs=kill_envs)
            return json_response({"pid": os.getpid(), "stopping": True, "kill_envs": kill_envs}, 202)

        @r.route("POST", "/v1/envs")
        async def create(req: Request) -> Response:
            body = req.json()
            if "snapshot" in body:
                overrides = body.get("overrides") or {}
                if not isinstance(body["snapshot"], str) or not isinstance(overrides, dict):
                    raise HTTPError(400, "bad_request", "'snapshot' must be a snapshot id and 'overrides' an object")
                rec = await call(m.create_from_snapshot(body["snapshot"], **overrides))
            else:
                plan = await call(self._plan_from_request(body))
                rec = await call(m.create(plan))
            return json_response(rec.public(self.envs_dir), 201)

        @r.route("POST", "/v1/envs/{id}/commit")
        async def commit(req: Request) -> Response:
            ref = req.json().get("ref")
            snap = await call(m.commit(req.params["id"], ref=ref))
            return json_response({"snapshot": snap.id, **snap.public()}, 201)

        @r.route("POST", "/v1/envs/{id}/fork")
        async def fork(req: Request) -> Response:
            n = req.json().get("n", 1)
            if not isinstance(n, int) or isinstance(n, bool):
                raise HTTPError(400, "bad_request", f"'n' must be an integer, got {n!r}")
            snap, children = await call(m.fork(req.params["id"], n))
            return json_response({"snapshot": snap.id, "envs": [c.public(self.envs_dir) for c in children]}, 201)

        @r.route("GET", "/v1/snapshots")
        async def snapshots(req: Request) -> Response:
            return json_response([s.public() for s in m.snapshots.list()])

        @r.route("GET", "/v1/snapshots/{id}")
        async def snapshot(req: Request) -> Response:
            rec = await call(_sync(m.snapshots.get, req.params["id"]))
            return json_response({**rec.public(), "lock": rec.lock})

        @r.route("DELETE", "/v1/snapshots/{id}")
        async def snapshot_rm(req: Request) -> Response:
            removed = await call(_sync(m.delete_snapshot, req.params["id"]))
            return json_response({"id": req.params["id"], "removed_blobs": removed})

        @r.route("GET", "/v1/envs")
        async def ps(req: Request) -> Response:
            top = self.monitor.snapshot().get("envs", {})
            return json_response([{**rec.public(self.envs_dir), "resources": top.get(rec.id)}
                                  for rec in m.envs.values()
                                  if rec.status != "pooled" and rec.id not in m.pool_starting])

        @r.route("GET", "/v1/envs/{id}")
        async def show(req: Request) -> Response:
            rec = await call(_sync(m.get, req.params["id"]))
            top = self.monitor.snapshot().get("envs", {})
            return json_response({**rec.public(self.envs_dir), "resources": top.get(rec.id)})

        @r.route("DELETE", "/v1/envs/{id}")
        async def kill(req: Request) -> Response:
            await call(m.kill(req.params["id"]))
            return json_response({"id": req.params["id"], "status": "killed"})

        @r.route("POST", "/v1/envs/{id}/pause")
        async def pause(req: Request) -> Response:
            await call(m.pause(req.params["id"]))
            return json_response({"id": req.params["id"], "status": "paused"})

        @r.route("POST", "/v1/envs/{id}/resume")
        async def resume(req: Request) -> Response:
            await call(m.resume(req.params["id"]))
            return json_response({"id": req.params["id"], "status": "running"})

        @r.route("POST", "/v1/envs/{id}/ttl")
        async def ttl(req: Request) -> Response:
            ttl_s = req.json().get("ttl_s")
            if ttl_s is not None and (not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
                raise HTTPError(400, "bad_request", f"ttl_s must be a positive number or null, got {ttl_s!r}")
            rec = await call(_sync(m.set_ttl, req.params["id"], ttl_s))
            return json_response(rec.public(self.envs_dir))

        @r.route("POST", "/v1/envs/{id}/exec")
        async def exec_(req: Request) -> Response | StreamResponse:
            body = req.json()
            argv = body.get("argv")
            if argv is None and isinstance(body.get("cmd"), str):
                argv = ["/bin/sh", "-c", body["cmd"]]
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise HTTPError(400, "bad_request", "exec needs 'argv' (a non-empty list of strings) or 'cmd' (a string)")
            env = body.get("env") or None
            if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                      for k, v in env.items())):
                raise HTTPError(400, "bad_request", "'env' must map strings to strings")
            stdin = base64.b64decode(body["stdin_b64"]) if body.get("stdin_b64") else None
            kw = dict(env=env, cwd=body.get("cwd"), user=body.get("user"), stdin=stdin, timeout_s=body.get("timeout_s"))
            env_id = req.params["id"]
            await call(_sync(m._running, env_id))
            if not body.get("stream"):
                result: ExecResult = await call(m.exec(env_id, argv, **kw))
                return Response(200, _json.encode(result))
            return StreamResponse(self._exec_stream(env_id, argv, kw))

        @r.route("GET", "/v1/envs/{id}/files")
        async def files_get(req: Request) -> Response:
            op = req.query.get("op", "read")
            if op not in ("read", "list", "stat"):
                raise HTTPError(400, "bad_request", f"op must be read, list or stat, got {op!r}")
            out = await call(m.files(req.params["id"], op, _path(req), user=req.query.get("user") or None))
            if op == "read":
                return Response(200, out, "application/octet-stream")
            return Response(200, _json.encode(out))

        @r.route("PUT", "/v1/envs/{id}/files")
        async def files_put(req: Request) -> Response:
            mode = int(req.query.get("mode", "644"), 8)
            await call(m.files(req.params["id"], "write", _path(req), data=req.body, mode=mode,
                               user=req.query.get("user") or None))
            return json_response({"path": _path(req), "size_bytes": len(req.body)})

        @r.route("POST", "/v1/envs/{id}/files/mkdir")
        async def files_mkdir(req: Request) -> Response:
            mode = int(req.query.get("mode", "755"), 8)
            await call(m.files(req.params["id"], "mkdir", _path(req), mode=mode, user=req.query.get("user") or None))
            return json_response({"path": _path(req)})

        @r.route("DELETE", "/v1/envs/{id}/files")
        async def files_delete(req: Request) -> Response:
            await call(m.files(req.params["id"], "remove", _path(req), recursive=req.query.get("recursive") == "1"))
            return json_response({"path": _path(req)})

        @r.route("POST", "/v1/gc")
        async def gc(req: Request) -> Response:
            return json_response(await call(m.gc()))

        @r.route("GET", "/v1/top")
        async def top(req: Request) -> Response:
            trees = m.layer_trees.stats() if m.layer_trees is not None else None
            return json_response({**self.monitor.snapshot(), "statistics": msgspec.to_builtins(self.monitor.statistics()),
                                  "layer_trees": trees})

        @r.route("GET", "/v1/metrics")
        async def metrics(req: Request) -> Response:
            return Response(200, self.monitor.prometheus_text(), PROMETHEUS_CONTENT_TYPE)

    async def _plan_from_request(self, body: dict[str, Any]) -> Any:
        if "plan" in body:
            if not isinstance(body["plan"], dict):
                raise HTTPError(400, "bad_request", "'plan' must be a plan or lock object")
            cls = Lock if "lock_version" in body["plan"] else Plan
            plan = plan_from_builtins(body["plan"], cls, source="<request plan>")
        elif "plan_text" in body:
            plan = load_any(body["plan_text"], fmt=body.get("format", "toml"), source=body.get("source", "<request>"))
        else:
            raise HTTPError(400, "bad_request", "create needs 'plan' (an object) or 'plan_text'")
        overrides = body.get("overrides") or {}
        if overrides:
            allowed = {"name", "ttl_s", "cpu", "memory", "env", "workdir", "user", "network"}
            unknown = set(overrides) - allowed
            if unknown:
                raise HTTPError(400, "bad_request", f"unknown overrides {sorted(unknown)}; allowed: {sorted(allowed)}")
            plan = apply_overrides(plan, **overrides)
        return plan

    async def _exec_stream(self, env_id: str, argv: list[str], kw: dict[str, Any]):  # type: ignore[no-untyped-def]
        send, recv = trio.open_memory_channel[bytes](256)

        async def on_output(stream: str, data: bytes) -> None:
            line = json.dumps({"stream": stream, "data_b64": base64.b64encode(data).decode()}) + "\n"
            try:
                await send.send(line.encode())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; the command runs on to its end or timeout

        async def runner() -> None:
            async with send:
                try:
                    result = await self.manager.exec(env_id, argv, on_output=on_output, **kw)
                    final = {"result": msgspec.to_builtins(result)}
                except Exception as e:
                    try:
                        err = _error(e)
                        final = {"error": {"kind": err.kind, "message": err.message, "status": err.status}}
                    except Exception:
                        log.exception("exec stream failed")
                        final = {"error": {"kind": "internal", "message": f"{type(e).__name__}: {e}", "status": 500}}
                try:
                    await send.send((json.dumps(final) + "\n").encode())
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

        assert self._nursery is not None
        self._nursery.start_soon(runner)
        async with recv:
            async for chunk in recv:
                yield chunk


def _path(req: Request) -> str:
    p = req.query.get("path")
    if not p:
        raise HTTPError(400, "bad_request", "missing ?path=")
    return p


async def _sync(fn, *args):  # type: ignore[no-untyped-def]
    return fn(*args)


def serve(config: DaemonConfig | None = None, *, debug: bool = False) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s weenvd[%(process)d] %(levelname)s %(name)s: %(message)s")
    daemon = Daemon(config)
    trio.run(daemon.run)
