"""The env lifecycle: plan lock → envlet layers → tmpfs upper + overlayfs → cgroup → crun.

:class:`EnvManager` is the one facade the daemon's server and the tests use: it keeps the table of
the node's envs (and each env's lock), and hands each concern to a part it builds in its
constructor:

- :mod:`._setup` (:class:`EnvSetup`): an env's parts on the host, set up, re-attached after a
  daemon restart, undone;
- :mod:`._pool` (:class:`WarmPool`): envs started ahead of time, per lock;
- :mod:`._ttl` (:class:`Ttls`): TTL deadlines and expiry;
- :mod:`._commit` (:class:`Snapshotter`): commit, fork, snapshot removal;
- :mod:`._processes` (:class:`EnvProcesses`, a base of the manager): exec and process handles;
- :mod:`._volumes` (:class:`VolumeStore`): volumes, mounted into envs; :mod:`._gc`: the sweeps of gc;
  :mod:`._files`, :mod:`._ports`: file access and port connections.

Every step of :meth:`EnvManager.create` is undone by :meth:`EnvManager._teardown` if a later step
fails, and the same teardown serves kill, TTL expiry and gc: it is idempotent and tolerates any
partial state, so nothing (mount, cgroup, process, layer reference, directory) outlives an env.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import trio

from ...envlet import EnvletClient, EnvletError
from ...plan import Lock, Plan, PlanValidationError, apply_overrides, is_locked, plan_to_builtins
from ...plan._model import network_policy
from ...plan._validate import gvisor_disk_problem
from .._errors import (AdmissionError, CgroupError, ContainerNotFoundError, EnvNotFoundError, EnvStartError,
                       EnvStateError, ProvisionError)
from ..cgroups import Cgroup, CgroupBackend
from ..elastic._monitor import Monitor
from ..runtime._gvisor import GvisorRuntime
from ..runtime._idmap import IdMap
from ..runtime._router import RuntimeRouter
from ..runtime._seam import Runtime
from . import _gc, _ports, _state
from ._commit import Snapshotter
from ._memimages import MemoryImages
from ._memory import MemorySnapshotter
from ._parking import Parking, check_park_after
from ._fileops import file_op
from ._pool import WarmPool
from ._processes import EnvProcesses
from ._setup import EnvSetup
from ._published import pull_memory, read_published
from ._snapshots import SnapshotLayer, SnapshotRecord, SnapshotStore, SnapshotTrees, new_snapshot_id
from ._startcheck import LockVerifier, check_start, env_limits, lock_for, tenant_problems
from ._state import EnvRecord
from ._trees import LayerTrees
from ._ttl import Ttls
from ._volumes import VolumeError, VolumeStore

log = logging.getLogger("weenv.daemon")

class EnvManager(EnvProcesses):
    """All envs of this node. Methods are trio-async; blocking work runs in worker threads."""

    def __init__(self, *, envs_dir: str, runtime: Runtime, backend: CgroupBackend, monitor: Monitor,
                 envlet: EnvletClient, agent_path: str | None = None, idmap: IdMap | None = None,
                 net: Any = None, pool_size: int = 0, pool_idle_s: float = 120.0,
                 layer_trees: tuple[int, int] | None = None, park_after_s: float | None = None):
        """Every part at once: ``agent_path``, the weenv-agent binary envs run as their init (None:
        catatonit + ``crun exec``); ``idmap``, envs in a user namespace over that host id range (None:
        env root is host root; the envlet must run with the same base); ``net``, the node's
        :class:`weenv.net._egress.EgressNetwork` (egress envs need it); ``pool_size``, envs kept
        started and idle per lock (0: no warm pool), dropped after ``pool_idle_s`` unasked;
        ``layer_trees``, (starts after which a group layer is copied out as a tree, the trees'
        budget in bytes), None: layers stay lazy; ``park_after_s``: :mod:`._parking`. Background in :meth:`run`."""
        home = os.path.dirname(envs_dir)
        self.envs_dir = envs_dir
        self.runtime = runtime
        self.backend = backend
        self.monitor = monitor
        self.envlet = envlet
        self.envs: dict[str, EnvRecord] = {}
        self.cgroups: dict[str, Cgroup] = {}
        self._locks: dict[str, trio.Lock] = {}
        self.pinned_layers: dict[str, int] = {}  # envlet references held by others than envs
        self.snapshots = SnapshotStore(os.path.join(home, "snapshots"))
        self.agent_path = agent_path  # weenv-agent binary; None: envs use catatonit + crun exec
        self.nursery: trio.Nursery | None = None  # for background work, while run() runs
        self.lock_verifier = LockVerifier()  # every start checks each pinned field of the lock
        self.net: Any = net  # weenv.net EgressNetwork: egress envs need it
        # envs run in a user namespace over this host id range (None: env root is host root); the
        # daemon starts the envlet with the same base (weenv/provision/runtime/_idmap.py)
        self.idmap = idmap
        os.makedirs(envs_dir, mode=0o700, exist_ok=True)
        # Snapshot layers made on this node, also kept as plain directories (a copy of the sealed
        # upper): envs from the snapshot stack them as overlay lowers directly, not through FUSE.
        self._snapshot_trees = SnapshotTrees(os.path.join(home, "snapshot-trees"), spawn=self._spawn)
        self.trees_dir = self._snapshot_trees.root
        self.layer_trees: LayerTrees | None = None  # hot group layers as directories
        if layer_trees is not None:
            self.layer_trees = LayerTrees(os.path.join(home, "layer-trees"), after=layer_trees[0],
                                          budget_bytes=layer_trees[1], pins=self.pinned_layers)
        self._pool = WarmPool(size=pool_size, idle_s=pool_idle_s, envs=self.envs, start=self._create_pooled,
                              kill=self.kill, spawn=self._spawn)
        self._ttls = Ttls(envs=self.envs, kill=self.kill)
        self.volumes = VolumeStore(os.path.join(home, "volumes"), envs=self.envs, idmap=idmap)
        self._setup = EnvSetup(envs_dir=envs_dir, runtime=runtime, backend=backend, monitor=monitor, envlet=envlet,
                               cgroups=self.cgroups, save=self._save, spawn=self._spawn,
                               snapshot_trees=self._snapshot_trees, layer_trees=self.layer_trees,
                               agent_path=agent_path, idmap=idmap, net=net, volumes=self.volumes)
        self._snapshotter = Snapshotter(records=self.snapshots, trees=self._snapshot_trees, envs_dir=envs_dir,
                                        envs=self.envs, cgroups=self.cgroups, get=self.get, env_lock=self._lock,
                                        envlet=envlet, monitor=monitor, idmap=idmap, spawn=self._spawn,
                                        start=self.create_from_snapshot, kill=self.kill)
        self._snapshotter.memory_images = images = MemoryImages(
            os.path.join(home, "memory-images"), self._snapshotter.layout,
            known=lambda: [s.memory for s in self.snapshots.list() if s.memory is not None])
        self._memory = MemorySnapshotter(
            runtime=runtime, envs_dir=envs_dir, images=images, snapshotter=self._snapshotter, get=self.get,
            env_lock=self._lock, cgroups=self.cgroups, monitor=monitor, save=self._save,
            limits_of=lambda rec: env_limits(self.lock_of(rec), self._runtime_name(self.lock_of(rec))),
            boot=lambda rec, image: self._setup.boot(rec, lock := self.lock_of(rec), env_limits(
                lock, self._runtime_name(lock)), restore_from=image))
        self._parking = Parking(envs=self.envs, park=self._memory.park, save=self._save, default_s=park_after_s)

    # ------------------------------------------------------------------ helpers

    def _lock(self, env_id: str) -> trio.Lock:
        return self._locks.setdefault(env_id, trio.Lock())

    def _spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Run ``fn(*args)`` in the background (in :meth:`run`'s nursery); False while run() does not run."""
        if self.nursery is None:
            return False
        self.nursery.start_soon(fn, *args)
        return True

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """The manager's background work until cancelled: TTLs, the warm pool's janitor, hot layers
        copied out as trees, the egress networks; pool refills and other background jobs run in its
        nursery (:attr:`nursery`)."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            try:
                if self.net is not None:
                    self.net.start(nursery, lambda env_id: os.path.join(self.envs_dir, env_id))
                if self.pool_size:
                    nursery.start_soon(self.pool_janitor, self.pool_idle_s)
                nursery.start_soon(self.ttl_loop)
                nursery.start_soon(self._parking.run)
                nursery.start_soon(self._probe_gvisor)
                if self.layer_trees is not None:
                    await nursery.start(self.layer_trees.run, self.trees_in_use)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self.nursery = None

    async def _probe_gvisor(self) -> None:
        """Find the gVisor platform now, where this node runs gVisor envs, not when the first one
        starts (:meth:`GvisorRuntime.ensure_platform`); a node that cannot run them says so then."""
        if not isinstance(self.runtime, RuntimeRouter) or shutil.which("runsc") is None:
            return
        try:
            gvisor = self.runtime.get("gvisor")
            if isinstance(gvisor, GvisorRuntime):
                await gvisor.ensure_platform()
        except Exception as e:  # never the daemon's end: the first gVisor create says it again
            log.info("gVisor envs cannot run on this node: %s", e)

    pool_size = property(lambda self: self._pool.size)  # envs kept started and idle per lock (0: no warm pool)

    pool_idle_s = property(lambda self: self._pool.idle_s)

    pool_starting = property(lambda self: self._pool.starting)  # envs being started for a pool (not listed)

    def trees_in_use(self) -> set[str]:
        return {d for rec in self.envs.values() for d in rec.trees}

    def tree_path(self, digest: str) -> str:
        """Where a snapshot layer made on this node is kept as a directory (it may not exist)."""
        return self._snapshot_trees.path(digest)

    def get(self, env_id: str) -> EnvRecord:
        rec = self.envs.get(env_id)
        if rec is None:
            raise EnvNotFoundError("no such env", env_id=env_id)
        return rec

    def rootfs(self, env_id: str) -> str:
        return _state.rootfs_path(self.envs_dir, env_id)

    def _save(self, rec: EnvRecord) -> None:
        _state.save(self.envs_dir, rec)

    def lock_of(self, rec: EnvRecord) -> Lock:
        return msgspec.convert(rec.lock, Lock)  # type: ignore[no-any-return]

    def _runtime_name(self, lock: Plan) -> str:
        """The runtime that runs (or would run) an env of ``lock`` on this node."""
        return lock.runtime or getattr(self.runtime, "default", None) or getattr(self.runtime, "name", "crun")

    # ------------------------------------------------------------------ create

    async def create(self, plan: Plan, *, snapshot: str | None = None, parent: str | None = None,
                     snapshot_layers: Sequence[SnapshotLayer] = (), start_cpu_cores: float | None = None,
                     restricted: bool = False, restore_from: str | None = None,
                     env_id: str | None = None) -> EnvRecord:
        """Start an env for ``plan`` (a lock is used as is; a plan is locked first).

        ``snapshot_layers`` (in the embedded store) go on top of the plan's groups: the sealed
        uppers of a snapshot (``restore_from``: its checkpoint image). ``restricted``: a tenant's env (``weenv serve``, non-admin keys), whose
        network can never open the node, loopback, link-local or other envs (:meth:`_check_tenant`).
        ``env_id``: the env's id instead of a fresh one (a parked env the cluster moves here keeps
        its id); one this node has is an EnvStateError (409).
        """
        t0 = time.perf_counter()
        # a lock passes through as it is: no worker thread for it (~0.2 ms of a pooled create)
        lock = plan if is_locked(plan) else await trio.to_thread.run_sync(lock_for, plan)
        await check_start(self.lock_verifier, lock)
        mode = network_policy(lock).mode
        if restricted:
            await self._check_tenant(lock)
        if env_id is not None and (env_id in self.envs or os.path.lexists(_state.env_dir(self.envs_dir, env_id))):
            raise EnvStateError("this node has an env of that id already", env_id=env_id)
        # a pooled env was wired unrestricted: a tenant's egress env is always made for it
        if not snapshot_layers and not restore_from and env_id is None and self.pool_size > 0 and \
                not (restricted and mode == "egress"):
            taken = self._pool.take(lock)
            if taken is not None:
                taken.restricted = restricted
                taken.timings_ms = {"pool": round((time.perf_counter() - t0) * 1000, 1)}
                if lock.ttl_s:
                    self._ttls.expire_in(taken, lock.ttl_s)
                self._save(taken)
                log.info("env %s handed out from the warm pool", taken.id)
                return taken
        return await self._create(lock, t0, snapshot=snapshot, parent=parent, snapshot_layers=snapshot_layers,
                                  start_cpu_cores=start_cpu_cores, restricted=restricted, restore_from=restore_from,
                                  env_id=env_id)

    async def _check_tenant(self, lock: Lock) -> None:
        """A tenant's plan (:func:`._startcheck.tenant_problems`): PlanValidationError (a 400) names each problem."""
        problems = await tenant_problems(lock, self.net)
        if problems:
            raise PlanValidationError(f"plan {lock.name!r}", problems)

    async def _create_pooled(self, lock: Lock) -> EnvRecord:  # a warm pool's env (:mod:`._pool`)
        return await self._create(lock, time.perf_counter(), pooled=True)

    async def _create(self, lock: Lock, t0: float, *, snapshot: str | None = None, parent: str | None = None,
                      snapshot_layers: Sequence[SnapshotLayer] = (), pooled: bool = False,
                      start_cpu_cores: float | None = None, restricted: bool = False,
                      restore_from: str | None = None, env_id: str | None = None) -> EnvRecord:
        runtime = self._runtime_name(lock)
        if runtime == "gvisor" and lock.runtime is None:  # a plan naming gvisor was checked when read
            problem = gvisor_disk_problem(lock, 'this node\'s default runtime "gvisor"')
            if problem is not None:
                raise PlanValidationError(f"plan {lock.name!r}", [problem])
        limits = env_limits(lock, runtime)
        admission = self.monitor.admit(limits)
        while not admission and not pooled and await self._pool.evict_one():
            admission = self.monitor.admit(limits)  # pooled envs make way for real ones
        if not admission:
            raise AdmissionError(f"not admitted: {admission.reason}")
        rec = EnvRecord(id=env_id or _state.new_env_id(lock.name), name=lock.name, lock=plan_to_builtins(lock),
                        snapshot=snapshot, parent=parent, restricted=restricted,
                        snapshot_layers=[msgspec.to_builtins(layer) for layer in snapshot_layers])
        if lock.ttl_s and not pooled:
            self._ttls.expire_in(rec, lock.ttl_s)
        if pooled:
            self.pool_starting.add(rec.id)
        self.envs[rec.id] = rec
        rec.timings_ms["lock"] = round((time.perf_counter() - t0) * 1000, 1)
        async with self._lock(rec.id):
            self._save(rec)
            try:
                await self._setup.start(rec, lock, limits, start_cpu_cores, restore_from)
            except BaseException as e:
                if rec.id not in self.monitor:
                    self.monitor.cancel_admission(limits)  # give back the room admission set aside
                self.pool_starting.discard(rec.id)
                with trio.CancelScope(shield=True):
                    log.warning("env %s failed to start (%s): undoing its setup", rec.id, e)
                    await self._teardown(rec)
                if isinstance(e, (ProvisionError, EnvletError)) and not isinstance(e, VolumeError):
                    raise EnvStartError(str(e), env_id=rec.id) from e
                raise
        if pooled:
            rec.status = "pooled"
            self.pool_starting.discard(rec.id)
            self._save(rec)
        log.info("env %s %s (%d layers)", rec.id, "pooled" if pooled else "running", len(rec.layers))
        return rec

    # ------------------------------------------------------------------ warm pool

    async def drain_pools(self, *, settle_s: float | None = None) -> list[str]:
        """Kill every pooled env and forget the pools (gc, shutdown of the pool); with ``settle_s``,
        then wait that long at most for the refills under way to end (each kills what it started)."""
        killed = await self._pool.drain()
        if settle_s is not None and not await self._pool.settle(settle_s):
            log.warning("warm pool: refills still under way after %g s", settle_s)
        return killed

    async def pool_janitor(self, idle_s: float = 120.0, interval_s: float = 5.0) -> None:
        """Drop the pools of locks nobody asked for lately."""
        await self._pool.janitor(idle_s, interval_s)

    # ------------------------------------------------------------------ teardown

    async def _teardown(self, rec: EnvRecord) -> list[str]:
        """Undo everything an env may have set up; idempotent. Returns the problems it hit (logged)."""
        env_id = rec.id
        rec.status = "stopping"
        problems = await self._setup.undo(rec)
        if not problems:
            await trio.to_thread.run_sync(
                lambda: shutil.rmtree(_state.env_dir(self.envs_dir, env_id), ignore_errors=True))
            self.envs.pop(env_id, None)
            self._locks.pop(env_id, None)
        else:
            rec.status = "failed"
            rec.error = "; ".join(problems)
            self._save(rec)
            log.error("env %s: teardown left problems: %s", env_id, rec.error)
        return problems

    async def kill(self, env_id: str) -> None:
        rec = self.get(env_id)
        self._pool.forget(env_id)
        async with self._lock(env_id):
            if env_id not in self.envs:
                return
            problems = await self._teardown(rec)
        if problems:
            raise EnvStateError(f"killed, but cleanup is incomplete: {'; '.join(problems)} (run `weenv gc`)",
                                env_id=env_id)
        log.info("env %s killed", env_id)

    # ------------------------------------------------------------------ operations

    async def open_port(self, env_id: str, port: int) -> socket.socket:
        """A TCP connection to ``port`` on the env's own loopback (``weenv serve``'s port proxy,
        E2B's ``get_host``), made inside the env's network namespace (:mod:`._ports`)."""
        rec = self._running(env_id)
        if not rec.init_pid:
            raise EnvStateError("has no init process to find its network in", env_id=env_id)
        if not 1 <= port <= 65535:
            raise EnvStateError(f"port {port} is not a TCP port (1-65535)", env_id=env_id)
        net = rec.lock.get("network")  # host: its namespace is the node's, a tunnel would reach the node's own
        if (net.get("mode") if isinstance(net, dict) else net) == "host":
            raise EnvStateError("uses the node's network (network = \"host\"): its ports are the node's own, "
                                "and the port proxy does not reach them", env_id=env_id)
        return await _ports.connect(env_id, rec.init_pid, port)

    async def files(self, env_id: str, op: str, path: str, *, data: bytes = b"", mode: int = 0o644,
                    user: str | None = None, recursive: bool = False, max_bytes: int | None = None,
                    to: str | None = None, xattrs: dict[str, str] | bool | None = None) -> Any:
        """read | write | list | stat | mkdir | remove | move, resolved inside the env's rootfs."""
        rec = self.get(env_id)
        if rec.status not in ("running", "paused"):
            raise EnvStateError(f"is {rec.status}", env_id=env_id)
        root, path, to = self.volumes.file_root(rec, self.envs_dir, op, path, to)  # a path in a volume: in it
        return await trio.to_thread.run_sync(lambda: file_op(
            root, op, path, data=data, mode=mode, user=user, recursive=recursive, max_bytes=max_bytes,
            idmap=self.idmap, to=to, xattrs=xattrs, users_root=self.rootfs(env_id)))

    async def pause(self, env_id: str, *, memory: bool | str = True, park_after_s: float | None = None) -> None:
        """Freeze the env (``memory``: its processes resume where they were), or end its processes and
        keep its files (``memory=False``; a frozen env may be paused so too: resume boots it again),
        or park it (``memory="park"``, :mod:`._memory`); a freeze parked later: ``park_after_s`` (:mod:`._parking`)."""
        check_park_after(env_id, memory, park_after_s)
        if memory == "park":
            return await self._memory.park(env_id)
        async with self._lock(env_id):
            rec = self.get(env_id)
            if memory or rec.status != "paused":
                rec = self._running(env_id)
            if not memory and rec.memory_image:  # parked: its memory dropped, its files kept
                return await trio.to_thread.run_sync(self._memory.finish_resume, rec) or self._save(rec)
            self._parking.disarm(rec)
            if not memory:  # (an env paused so already: nothing to do)
                return None if rec.cold else await self._setup.stop(rec)
            await self._parking.arm(rec, park_after_s, self._memory.capability)
            await trio.to_thread.run_sync(self.cgroups[env_id].freeze)
            rec.status = "paused"
            self._save(rec)

    async def resume(self, env_id: str) -> None:
        async with self._lock(env_id):
            rec = self.get(env_id)
            if rec.status != "paused":
                raise EnvStateError(f"is {rec.status}, not paused", env_id=env_id)
            self._parking.disarm(rec)
            if rec.cold:  # paused without its memory: a new boot over the same files
                lock = self.lock_of(rec)
                await self._setup.boot_again(rec, lock, env_limits(lock, self._runtime_name(lock)))
                await trio.to_thread.run_sync(self._memory.finish_resume, rec)  # parked: its image is done with
                return self._save(rec)
            await trio.to_thread.run_sync(self.cgroups[env_id].thaw)
            rec.status = "running"
            self._save(rec)

    def set_ttl(self, env_id: str, ttl_s: float | None) -> EnvRecord:
        self._ttls.expire_in(rec := self.get(env_id), ttl_s)
        self._save(rec)
        return rec

    async def ttl_loop(self, interval_s: float = 0.25) -> None:  # kill envs past their TTL (:mod:`._ttl`)
        await self._ttls.run(interval_s)

    # ------------------------------------------------------------------ snapshots

    async def commit(self, env_id: str, *, ref: str | None = None, build_key: str | None = None,
                     memory: bool = False) -> SnapshotRecord:
        """Freeze the env, seal its upper into a layer in the embedded store, thaw; record a snapshot
        (``memory``: its processes too, :mod:`._memory`)."""
        if memory:
            return await self._memory.commit(env_id, ref=ref)
        return await self._snapshotter.commit(env_id, ref=ref, build_key=build_key)

    async def create_from_snapshot(self, snap_id: str, *, restricted: bool = False, restore_from: str | None = None,
                                   env_id: str | None = None, **overrides: Any) -> EnvRecord:
        """An env from a snapshot, with ``overrides`` applied to its lock (``restricted``, ``env_id``: see
        :meth:`create`; ``restore_from``: a fork's child, restored from its commit's checkpoint
        directory while the image is sealed)."""
        snap = self.snapshots.get(snap_id)
        if restore_from is None and snap_id in self._memory.sealing:
            raise EnvStateError(f"snapshot {snap_id}: its memory image is being sealed (a fork's): try again")
        lock: Plan = msgspec.convert(snap.lock, Lock)
        clean = {k: v for k, v in overrides.items() if v is not None}
        if clean:
            lock = apply_overrides(lock, **clean)
        held = snap.memory if restore_from is None else None
        image = await trio.to_thread.run_sync(self._memory.images.checkout, held) if held else restore_from
        try:
            return await self.create(lock, snapshot=snap.id, parent=snap.source_env, snapshot_layers=snap.layers,
                                     start_cpu_cores=snap.cpu_quota_cores, restricted=restricted, restore_from=image,
                                     env_id=env_id)
        finally:
            if held is not None:  # restored (runsc read the whole image): the copy written for it goes
                await trio.to_thread.run_sync(self._memory.images.release, held)

    async def pull_snapshot(self, ref: str) -> SnapshotRecord:
        """Record the snapshot published at ``ref`` (:mod:`._published`) as one of this node's:
        envs from it start on its published lock, and restore its processes if it has memory
        (its packs are downloaded into the embedded store first)."""
        lock, memory = await trio.to_thread.run_sync(read_published, ref)
        if memory is not None:
            layout = self._snapshotter.layout()
            pulled = await trio.to_thread.run_sync(pull_memory, ref, memory, layout)
            log.info("snapshot %s: %d bytes of memory packs pulled", ref, pulled)
        snap = SnapshotRecord(id=new_snapshot_id(), source_env=ref.rsplit(":", 1)[-1], lock=lock, memory=memory,
                              ref=ref)
        self.snapshots.save(snap)
        return snap

    async def fork(self, env_id: str, n: int, *, memory: bool = False) -> tuple[SnapshotRecord, list[EnvRecord]]:
        """Commit once, start ``n`` children from that state; all or none (a failure kills the started ones).
        ``memory``: a memory snapshot, whose children restore the parent's processes."""
        return await self._snapshotter.fork(env_id, n, commit=self._memory.commit if memory else None)

    def delete_snapshot(self, snap_id: str) -> list[str]:
        """Remove the record, and its layer blobs unless another snapshot, a live env or a tag uses them."""
        return self._snapshotter.delete(snap_id)

    # ------------------------------------------------------------------ restart and gc

    async def adopt(self) -> dict[str, list[str]]:
        """After a daemon restart: keep envs whose container still runs, tear down the rest."""
        adopted, reaped = [], []
        for env_id in sorted(os.listdir(self.envs_dir)):
            rec = _state.load(self.envs_dir, env_id)
            if rec is None:
                rec = EnvRecord(id=env_id, name=env_id, status="failed", cgroup=env_id)
            alive = False
            if rec.status == "paused" and rec.cold:  # no container to find: its files, cgroup and network
                try:
                    await self._setup.reattach(rec, None)
                    self.envs[env_id] = rec
                    adopted.append(env_id)
                    continue
                except (CgroupError, ValueError) as e:
                    log.warning("env %s: cannot re-adopt (%s); tearing it down", env_id, e)
            elif rec.status in ("running", "paused"):
                try:
                    st = await self.runtime.state(env_id)
                    alive = st.status in ("running", "paused") and st.pid > 0
                except ProvisionError:
                    alive = False
            if alive:
                try:
                    lock = self.lock_of(rec)
                    await self._setup.reattach(rec, env_limits(lock, self._runtime_name(lock)))
                    self.envs[env_id] = rec
                    adopted.append(env_id)
                    continue
                except (CgroupError, ValueError) as e:
                    log.warning("env %s: cannot re-adopt (%s); tearing it down", env_id, e)
            self.envs[env_id] = rec
            await self._teardown(rec)
            reaped.append(env_id)
        await trio.to_thread.run_sync(self.volumes.release_idle)  # host mounts no adopted env uses
        log.info("re-adopted %d envs, reaped %d", len(adopted), len(reaped))
        return {"adopted": adopted, "reaped": reaped}

    async def gc(self) -> dict[str, Any]:
        """Remove whatever dead envs left behind: idempotent, safe to run at any time."""
        out: dict[str, Any] = {"envs": [], "containers": [], "cgroups": [], "mounts": [], "dirs": [], "layers": []}
        out["pooled"] = await self.drain_pools()
        for rec in list(self.envs.values()):  # failed envs, and live ones whose container died
            dead = rec.status in ("failed", "stopping")
            if rec.status in ("running", "paused", "pooled") and not rec.cold:
                try:
                    st = await self.runtime.state(rec.id)
                    dead = st.status not in ("running", "paused")
                except ContainerNotFoundError:
                    dead = True
            if dead:
                async with self._lock(rec.id):
                    await self._teardown(rec)
                out["envs"].append(rec.id)
        live = set(self.envs)
        out.update(await _gc.sweep_host(live, runtime=self.runtime, backend=self.backend, envs_dir=self.envs_dir))
        out["layers"] = await _gc.release_layers(self.envs.values(), self.envlet, self.pinned_layers)
        if self.net is not None:
            out["network"] = await self.net.gc(live)
        out["snapshots"] = self._snapshotter.gc_forks()
        out["trees"] = await self._snapshotter.gc_trees()
        out["memory_images"] = await trio.to_thread.run_sync(self._memory.images.gc, {
            s.memory.digest for s in self.snapshots.list() if s.memory is not None})
        out["temps"] = await trio.to_thread.run_sync(self._snapshotter.gc_commit_temps)
        out["volumes"] = await trio.to_thread.run_sync(self.volumes.release_idle)
        return out
