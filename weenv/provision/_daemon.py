"""``weenv daemon``: one per node. Supervises the envlet, runs the monitor, serves the HTTP API.

Envs outlive the daemon: a restarted daemon re-adopts the envs whose container still runs and
reaps the rest. The envlet is its own process (own session) for the same reason.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import msgspec
import trio

from .. import __version__, _home
from .. import _wire as wire
from ..envlet import EnvletClient, EnvletError, EnvletProcess
from ..plan import Lock, Plan, PlanError, apply_overrides, load_any, plan_from_builtins
from .runtime._agent import ensure_agent
from ._envs import EnvManager
from ._errors import (
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
from ._http import HTTPError, Request, Response, Router, Send, Server, StreamResponse, error_info, json_response
from .elastic import PROMETHEUS_CONTENT_TYPE, Monitor
from .elastic._policy import PolicyConfig
from .runtime._runtime import ExecResult, Runtime
from .runtime._gvisor import node_runtime
from .envs._snapshots import SnapshotNotFoundError
from .cgroups import CgroupBackend, detect_backend

log = logging.getLogger("weenv.daemon")


def _alive(pid: int) -> bool:
    """A zombie nobody reaps (the envlet is not always our child) is gone."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class DaemonConfig(msgspec.Struct, kw_only=True):
    home: str = msgspec.field(default_factory=_home.home)
    envlet_cache_size_bytes: int = 20 << 30
    envlet_memory_cache_size_bytes: int = 512 << 20
    envlet_deadline_s: float = msgspec.field(  # env WEENV_ENVLET_DEADLINE_S
        default_factory=lambda: float(os.environ.get("WEENV_ENVLET_DEADLINE_S", "30") or 30))
    """A read the envlet cannot serve fails (EIO) after this long; an envlet that does not answer
    its pings for this long (stopped, hung) is killed and restarted, so reads never wait for ever."""
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
    # the envlet's chunk tiers (None: memory, disk, registry) and their --tier-option settings; a
    # cluster node adds the peer tier (docs/cluster.md, "Peer chunk tier"; weenv daemon --envlet-peer-listen)
    envlet_tiers: list[str] | None = None
    envlet_tier_options: dict[str, str] = {}
    envlet_check_interval_s: float = 0.5  # a ping is ~0.1 ms; a dead envlet is back within 2 s (start ~0.7 s)
    cgroup_root: str = "weenv"  # weenv's parent group, under this process's own cgroup
    use_agent: bool = True  # weenv-agent as the env init (fast exec); False: catatonit + crun exec
    # runtime of plans that name none: "crun" or "gvisor" (runsc; docs/security.md); env WEENV_RUNTIME
    runtime: str = msgspec.field(default_factory=lambda: os.environ.get("WEENV_RUNTIME") or "crun")
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
    # egress envs (docs/network.md): their traffic leaves the node only by these interfaces (none
    # named: they reach nothing beyond the node's allowed ports); addresses from egress_range; rules
    # in the nft table inet <egress_table>; allowed host names resolved by egress_dns (ADDR[:PORT],
    # None: the node's resolver)
    egress_interfaces: list[str] = []
    egress_range: str = "10.213.0.0/16"
    egress_table: str = "weenv"
    egress_dns: str | None = None
    # env ids start with "<node_name>-" (1-12 of [a-z0-9]; None: env WEENV_NODE_NAME, else no prefix),
    # so a cluster gateway routes an id to its node without asking (docs/cluster.md)
    node_name: str | None = msgspec.field(default_factory=lambda: os.environ.get("WEENV_NODE_NAME") or None)
    # every crun env in a user namespace: env ids 0..65535 are host ids userns_base.. (docs/security.md,
    # "User namespaces"; env WEENV_USERNS=0/1 sets the default)
    userns: bool = msgspec.field(default_factory=lambda: _bool_env("WEENV_USERNS", True))
    userns_base: int = 1 << 30  # _idmap.DEFAULT_BASE


def _bool_env(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${name}: {value!r} is not 0 or 1")


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


class Daemon:
    def __init__(self, config: DaemonConfig | None = None, *, runtime: Runtime | None = None,
                 backend: CgroupBackend | None = None):
        self.config = config or DaemonConfig()
        from .envs import _state

        _state.set_node_name(self.config.node_name)
        home = self.config.home
        self.run_dir = os.path.join(home, "run")
        self.socket_path = os.path.join(self.run_dir, "weenv.sock")
        self.envs_dir = os.path.join(home, "envs")
        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        self.runtime = runtime or node_runtime(self.run_dir, self.config.runtime)
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
        if c.userns:
            from .runtime._idmap import IdMap

            self.manager.idmap = IdMap(base=c.userns_base)
        self._trees_for_ids()
        if c.layer_trees_after > 0:
            self.manager.enable_layer_trees(after=c.layer_trees_after, budget_bytes=c.layer_trees_size_bytes)
        from ..net._egress import EgressNetwork

        self.manager.net = EgressNetwork(table=c.egress_table, egress_range=c.egress_range,
                                         egress_interfaces=c.egress_interfaces, dns_server=c.egress_dns)
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
                             deadline_s=c.envlet_deadline_s, id_base=self._id_base,
                             env_cgroup=c.cgroup_root,  # the envlet charges requests to the envs' groups
                             tiers=c.envlet_tiers, tier_options=c.envlet_tier_options)

    def _trees_for_ids(self) -> None:
        """Drop layer and snapshot trees written for other host ids (--userns changed) before they
        are found and stacked; not while envs that may stack them are left (a live envlet with the
        other base refuses this daemon anyway)."""
        from .runtime._idmap import trees_for_base

        if os.path.isdir(self.envs_dir) and os.listdir(self.envs_dir):
            return
        for root in (os.path.join(self.config.home, "layer-trees"), self.manager.trees_dir):
            if not trees_for_base(root, self._id_base):
                log.info("%s: trees written for other host ids were dropped (--userns changed)", root)

    @property
    def _id_base(self) -> int:
        return self.manager.idmap.base if self.manager.idmap is not None else 0

    def ensure_envlet(self) -> bool:
        """Start the envlet unless one answers; True when it had to be started.

        One that is alive but has not answered for ``envlet_deadline_s`` (SIGSTOP, a hung loop) is
        SIGKILLed first: its FUSE connection is then aborted, so reads waiting on it fail at once
        (ECONNABORTED/ENOTCONN, as after a crash) instead of waiting for ever."""
        try:
            info = self.envlet.ping()
        except EnvletError:
            if self._envlet_silent():
                return False
        else:
            self._envlet_pid, self._envlet_silent_since = int(info.get("pid") or 0) or None, None
            if int(info.get("id_base", 0)) != self._id_base:
                raise EnvletError(
                    f"the running envlet (pid {info.get('pid')}) shows files owned from host id "
                    f"{info.get('id_base', 0)}, this daemon's envs need {self._id_base} (--userns/--no-userns "
                    f"changed): stop it first (`weenv daemon stop --kill-envs`)")
            return False
        log.info("starting the envlet")
        started = self._envlet_process().start()
        self._envlet_pid, self._envlet_silent_since = started.proc.pid, None
        return True

    _envlet_pid: int | None = None  # the envlet that last answered a ping
    _envlet_silent_since: float | None = None  # monotonic time of its first unanswered ping

    def _envlet_silent(self) -> bool:
        """True while the last envlet is alive and not silent for long enough to be killed."""
        pid = self._envlet_pid
        if pid is None or not _alive(pid):
            self._envlet_pid = self._envlet_silent_since = None
            return False
        now = time.monotonic()
        if self._envlet_silent_since is None:
            self._envlet_silent_since = now
        silent_s = now - self._envlet_silent_since
        if silent_s < self.config.envlet_deadline_s:
            return True
        log.error("the envlet (pid %d) has not answered for %.0f s (stopped or hung): killing it so that reads "
                  "waiting on it fail instead of hanging; a new one starts", pid, silent_s)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = now + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        self._envlet_pid = self._envlet_silent_since = None
        return False

    async def _supervise_envlet(self) -> None:
        while True:
            await trio.sleep(self.config.envlet_check_interval_s)
            try:
                started = await trio.to_thread.run_sync(self.ensure_envlet)
            except EnvletError as e:
                log.error("envlet is down and does not restart: %s", e)
                continue
            if started:
                log.error("the envlet had died and was restarted: envs started before whose layers were on its "
                          "mount keep running, but files they had not read fail with ENOTCONN (layers kept as "
                          "local trees are unaffected); recreate those envs (docs/architecture.md)")

    # ------------------------------------------------------------------ main

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(self.ensure_envlet)
        if self.config.use_agent:
            self.manager.agent_path = await trio.to_thread.run_sync(
                ensure_agent, os.path.join(self.config.home, "lib"))
        adoption = await self.manager.adopt()
        server = Server(self.router)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.manager.nursery = nursery
            self.manager.net.start(nursery, lambda env_id: os.path.join(self.envs_dir, env_id))
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
        # No monitor raises the limits of envs kept running from here on: they are OOM-killed at
        # their limits rather than wait there until a daemon comes back (docs/security.md).
        hardened = await trio.to_thread.run_sync(self.monitor.let_go)
        if hardened:
            log.info("stop: %d envs kept running have hard memory limits until a daemon re-adopts them", hardened)
        # Background work is over (no envlet restart, no pool refill): the envlet goes too, unless
        # envs kept running stack its layers (then it serves them until `daemon stop --kill-envs`).
        live = [rec.id for rec in self.manager.envs.values() if rec.status in ("creating", "running", "paused")]
        if live:
            log.info("stopped; %d envs keep running, and the envlet keeps serving their layers", len(live))
        else:
            await trio.to_thread.run_sync(self._stop_envlet)
            try:  # nothing of weenv is left on the node but its files: the parent cgroup goes too
                await trio.to_thread.run_sync(self.backend.remove_parent)
            except Exception as e:
                log.warning("stop: cannot remove weenv's parent cgroup: %s", e)
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


def serve(config: DaemonConfig | None = None, *, debug: bool = False) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s weenvd[%(process)d] %(levelname)s %(name)s: %(message)s")
    daemon = Daemon(config)
    trio.run(daemon.run)
