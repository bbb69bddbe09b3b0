"""``weenv daemon``: one per node. Supervises the envlet, runs the monitor, serves the HTTP API.

Envs outlive the daemon: a restarted daemon re-adopts the envs whose container still runs and
reaps the rest. The envlet is its own process (own session) for the same reason.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import msgspec
import trio

from .. import __version__, _home
from .._proc import gone, wait_gone
from ..envlet import EnvletClient, EnvletError, EnvletProcess
from .runtime._agent import ensure_agent
from .envs import EnvManager
from .server import DaemonApi, Server
from .elastic import Monitor
from .elastic._history import History
from .elastic._policy import PolicyConfig
from .runtime._runtime import Runtime
from .runtime._router import node_runtime
from .cgroups import CgroupBackend, detect_backend

log = logging.getLogger("weenv.daemon")


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
    # a frozen gVisor env is parked (its memory checkpointed to disk and freed) once it stayed paused
    # this long, unless its pause says otherwise (None: off; env WEENV_PARK_AFTER_S; envs/_parking.py)
    park_after_s: float | None = msgspec.field(
        default_factory=lambda: float(os.environ["WEENV_PARK_AFTER_S"]) if os.environ.get("WEENV_PARK_AFTER_S") else None)
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
        from ..net._egress import EgressNetwork
        from .runtime._idmap import IdMap

        idmap = IdMap(base=c.userns_base) if c.userns else None
        # the weenv-agent binary, built once per source (None: envs use catatonit + crun exec)
        agent_path = ensure_agent(os.path.join(c.home, "lib")) if c.use_agent else None
        self._trees_for_ids(idmap.base if idmap is not None else 0)
        self.manager = EnvManager(
            envs_dir=self.envs_dir, runtime=self.runtime, backend=self.backend, monitor=self.monitor,
            envlet=self.envlet, agent_path=agent_path, idmap=idmap, pool_size=c.pool_size,
            pool_idle_s=c.pool_idle_s, park_after_s=c.park_after_s,
            layer_trees=(c.layer_trees_after, c.layer_trees_size_bytes) if c.layer_trees_after > 0 else None,
            net=EgressNetwork(table=c.egress_table, egress_range=c.egress_range,
                              egress_interfaces=c.egress_interfaces, dns_server=c.egress_dns))
        self.started_s = time.time()
        self._nursery: trio.Nursery | None = None
        self._stop = trio.Event()  # set by SIGTERM/SIGINT or POST /v1/daemon/stop
        self._stop_kill_envs = False
        self.history = History()
        self.api = DaemonApi(manager=self.manager, monitor=self.monitor, request_stop=self.request_stop,
                             started_s=self.started_s, history=self.history)

    # ------------------------------------------------------------------ envlet supervision

    def _envlet_process(self) -> EnvletProcess:
        c = self.config
        return EnvletProcess(os.path.join(c.home, "envlet", "mnt"), os.path.join(c.home, "envlet", "cache"),
                             self.envlet_socket, cache_size_bytes=c.envlet_cache_size_bytes,
                             memory_cache_size_bytes=c.envlet_memory_cache_size_bytes,
                             deadline_s=c.envlet_deadline_s, id_base=self._id_base,
                             env_cgroup=c.cgroup_root,  # the envlet charges requests to the envs' groups
                             tiers=c.envlet_tiers, tier_options=c.envlet_tier_options)

    def _trees_for_ids(self, id_base: int) -> None:
        """Drop layer and snapshot trees written for other host ids (--userns changed) before they
        are found and stacked; not while envs that may stack them are left (a live envlet with the
        other base refuses this daemon anyway)."""
        from .runtime._idmap import trees_for_base

        if os.path.isdir(self.envs_dir) and os.listdir(self.envs_dir):
            return
        for root in (os.path.join(self.config.home, "layer-trees"), os.path.join(self.config.home, "snapshot-trees")):
            if not trees_for_base(root, id_base):
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
        if pid is None or gone(pid, reap=True):  # reaped if ours (the envlet is not always our child)
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
        wait_gone(pid, 5.0, reap=True, interval_s=0.02)
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
        adoption = await self.manager.adopt()
        server = Server(self.api.router)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.monitor.run)
            await nursery.start(self.history.run, self.monitor.snapshot)
            await nursery.start(self.manager.run)
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
        await trio.to_thread.run_sync(self.backend.stop_warming)
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
            await m.drain_pools(settle_s=60.0)  # a refill cancelled mid-start or mid-kill would leave its env
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
            if not wait_gone(pid, timeout_s, reap=True, interval_s=0.02):
                log.warning("the envlet (pid %d) did not stop within %g s: killing it", pid, timeout_s)
                os.kill(pid, signal.SIGKILL)
                wait_gone(pid, 5.0, reap=True, interval_s=0.02)
        except ProcessLookupError:
            pass
        if mountpoint:
            clear_stale_mount(mountpoint)


def serve(config: DaemonConfig | None = None, *, debug: bool = False) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s weenvd[%(process)d] %(levelname)s %(name)s: %(message)s")
    daemon = Daemon(config)
    trio.run(daemon.run)
