"""The env lifecycle: plan lock → envlet layers → tmpfs upper + overlayfs → cgroup → crun.

Every step of :meth:`EnvManager.create` is undone by :meth:`EnvManager._teardown` if a later step
fails, and the same teardown serves kill, TTL expiry and gc: it is idempotent and tolerates any
partial state, so nothing (mount, cgroup, process, layer reference, directory) outlives an env.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import trio

from ... import _home, layerfmt
from ...envlet import EnvletClient, EnvletError, LayerNotFoundError, StoreSpec
from ...plan import Lock, LockedGroup, LockError, Plan, apply_overrides, is_locked, plan_to_builtins
from ...plan._model import network_policy
from ...registry import LayoutStore
from . import _mounts, _state
from .._errors import (
    AdmissionError,
    CgroupError,
    CgroupNotFoundError,
    ContainerNotFoundError,
    EnvError,
    EnvNotFoundError,
    EnvStartError,
    EnvStateError,
    ProcessNotFoundError,
    ProvisionError,
)
from ..runtime._agent import agent_listener
from ..._wire import ProcessEnd, ProcessInfo
from ._files import RootFS, resolve_user
from ..elastic._monitor import Monitor
from ..runtime._ocispec import ROOT_USER, BindMount, User
from ..elastic._policy import EnvLimits
from ..runtime._runtime import ExecResult, ProcessStream, Runtime, prepare_bundle
from .._errors import HostError
from ..runtime._gvisor import ANNOTATION_RUNTIME, plan_runtime, start_cpu_hint
from ..runtime._idmap import (DeviceNodeInTreeError, IdMap, apply_userns, bundle_relative_paths, make_tree_inert,
                     open_path_for_range, own_cgroups_only)
from ._snapshots import SnapshotLayer, SnapshotNotFoundError, SnapshotRecord, SnapshotStore, new_snapshot_id
from ._state import EnvRecord
from ._startcheck import LockVerifier, check_registered, check_start
from ._trees import LayerTrees
from ..cgroups import Cgroup, CgroupBackend

log = logging.getLogger("weenv.daemon")

OutputCallback = Callable[[str, bytes], Awaitable[None] | None]


def env_limits(lock: Plan, runtime: str = "crun") -> EnvLimits:
    """The monitor's limits for an env of ``lock`` run by ``runtime``. A gVisor env's memory is
    fixed at the plan's max (admitted and held whole, never elastic): the Sentry takes its memory
    in system calls that fail with ENOMEM at a limit instead of waiting for the monitor's doubling,
    and a Sentry refused memory dies with everything in it (a 45 MiB write burst killed the sandbox
    at a 64 MiB elastic limit in a loaded test run)."""
    r = lock.resources
    memory_min = r.memory.min
    if runtime == "gvisor" and r.memory.max is not None:
        memory_min = r.memory.max
    return EnvLimits(cpu_min_cores=r.cpu.min, cpu_max_cores=r.cpu.max, memory_min_bytes=memory_min,
                     memory_max_bytes=r.memory.max, pids_max=r.pids)


def store_spec(group: LockedGroup) -> StoreSpec:
    if group.registry is None:
        return StoreSpec("layout", path=_home.store_dir())
    from ...registry._group import insecure_by_default

    return StoreSpec("registry", registry=group.registry, insecure=insecure_by_default(group.registry))


def lock_for(plan: Plan) -> Lock:
    """A lock for ``plan``: locks pass through (never resolving a tag), plans are resolved now."""
    if is_locked(plan):
        return plan  # type: ignore[return-value]
    from ...build import lock_with_image_defaults

    return lock_with_image_defaults(plan)


def _pool_key(lock: Lock) -> str:
    """Envs are interchangeable when their locks are equal but for the TTL (it starts at hand-out)."""
    data = plan_to_builtins(lock)
    data.pop("ttl_s", None)
    return json.dumps(data, sort_keys=True)


def _install_tree(tmp: str, final: str) -> bool:
    """Move a copied upper into place as the tree of its layer (one already there wins)."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            return False
        shutil.rmtree(tmp, ignore_errors=True)
    return True


class _Stopwatch:
    """Records milliseconds since the previous mark under each name (create's timing breakdown)."""

    def __init__(self, into: dict[str, float]):
        self.into = into
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = round((now - self.last) * 1000, 1)
        self.last = now


class EnvManager:
    """All envs of this node. Methods are trio-async; blocking work runs in worker threads."""

    def __init__(self, *, envs_dir: str, runtime: Runtime, backend: CgroupBackend, monitor: Monitor,
                 envlet: EnvletClient, agent_path: str | None = None, idmap: IdMap | None = None,
                 net: Any = None, pool_size: int = 0, pool_idle_s: float = 120.0,
                 layer_trees: tuple[int, int] | None = None):
        """Every part at once: ``agent_path``, the weenv-agent binary envs run as their init (None:
        catatonit + ``crun exec``); ``idmap``, envs in a user namespace over that host id range (None:
        env root is host root; the envlet must run with the same base); ``net``, the node's
        :class:`weenv.net._egress.EgressNetwork` (egress envs need it); ``pool_size``, envs kept
        started and idle per lock (0: no warm pool), dropped after ``pool_idle_s`` unasked;
        ``layer_trees``, (starts after which a group layer is copied out as a tree, the trees'
        budget in bytes), None: layers stay lazy. Background work runs in :meth:`run`."""
        self.envs_dir = envs_dir
        self.runtime = runtime
        self.backend = backend
        self.monitor = monitor
        self.envlet = envlet
        self.envs: dict[str, EnvRecord] = {}
        self.cgroups: dict[str, Cgroup] = {}
        self._locks: dict[str, trio.Lock] = {}
        self.pinned_layers: dict[str, int] = {}  # envlet references held by others than envs
        self.snapshots = SnapshotStore(os.path.join(os.path.dirname(envs_dir), "snapshots"))
        self.agent_path = agent_path  # weenv-agent binary; None: envs use catatonit + crun exec
        self.nursery: trio.Nursery | None = None  # for background work, while run() runs
        self.pool_size = pool_size
        self.pool_idle_s = pool_idle_s
        self._pools: dict[str, list[str]] = {}
        self._pool_used: dict[str, float] = {}
        self._ttl_deadlines: dict[str, tuple[float, float]] = {}  # env id -> (its expires_s, monotonic deadline)
        self._refilling: set[str] = set()
        self.pool_starting: set[str] = set()  # envs being started for a pool (not listed)
        self._store: LayoutStore | None = None
        # Snapshot layers made on this node, also kept as plain directories (a copy of the sealed
        # upper): envs from the snapshot stack them as overlay lowers directly, not through FUSE.
        self.trees_dir = os.path.join(os.path.dirname(envs_dir), "snapshot-trees")
        self.layer_trees: LayerTrees | None = None  # hot group layers as directories
        self._trees_in_progress: set[str] = set()
        self.lock_verifier = LockVerifier()  # every start checks each pinned field of the lock
        self.net: Any = net  # weenv.net EgressNetwork: egress envs need it
        self._forking: set[str] = set()  # fork snapshots whose children are being started (gc keeps them)
        # envs run in a user namespace over this host id range (None: env root is host root); the
        # daemon starts the envlet with the same base (weenv/provision/runtime/_idmap.py)
        self.idmap = idmap
        os.makedirs(envs_dir, mode=0o700, exist_ok=True)
        os.makedirs(self.trees_dir, mode=0o700, exist_ok=True)
        if layer_trees is not None:
            self.layer_trees = LayerTrees(os.path.join(os.path.dirname(envs_dir), "layer-trees"), after=layer_trees[0],
                                          budget_bytes=layer_trees[1], pins=self.pinned_layers)

    # ------------------------------------------------------------------ helpers

    def _lock(self, env_id: str) -> trio.Lock:
        return self._locks.setdefault(env_id, trio.Lock())

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
                if self.layer_trees is not None:
                    await nursery.start(self.layer_trees.run, self.trees_in_use)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self.nursery = None

    def trees_in_use(self) -> set[str]:
        return {d for rec in self.envs.values() for d in rec.trees}

    def tree_path(self, digest: str) -> str:
        """Where a snapshot layer made on this node is kept as a directory (it may not exist)."""
        return os.path.join(self.trees_dir, LayerTrees.key(digest))

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
                     snapshot_layers: Sequence[SnapshotLayer] = (), start_cpu_cores: float | None = None) -> EnvRecord:
        """Start an env for ``plan`` (a lock is used as is; a plan is locked first).

        ``snapshot_layers`` (in the embedded store) go on top of the plan's groups: the sealed
        uppers of a snapshot.
        """
        t0 = time.perf_counter()
        lock = await trio.to_thread.run_sync(lock_for, plan)
        await check_start(self.lock_verifier, lock)
        if not snapshot_layers and self.pool_size > 0:
            key = _pool_key(lock)
            self._pool_used[key] = time.monotonic()
            taken = self._take_pooled(key)
            self._refill_later(key, lock)
            if taken is not None:
                taken.timings_ms = {"pool": round((time.perf_counter() - t0) * 1000, 1)}
                if lock.ttl_s:
                    self._expire_in(taken, lock.ttl_s)
                self._save(taken)
                log.info("env %s handed out from the warm pool", taken.id)
                return taken
        return await self._create(lock, t0, snapshot=snapshot, parent=parent, snapshot_layers=snapshot_layers,
                                  start_cpu_cores=start_cpu_cores)

    async def _create(self, lock: Lock, t0: float, *, snapshot: str | None = None, parent: str | None = None,
                      snapshot_layers: Sequence[SnapshotLayer] = (), pooled: bool = False,
                      start_cpu_cores: float | None = None) -> EnvRecord:
        limits = env_limits(lock, self._runtime_name(lock))
        admission = self.monitor.admit(limits)
        while not admission and not pooled and await self._evict_one_pooled():
            admission = self.monitor.admit(limits)  # pooled envs make way for real ones
        if not admission:
            raise AdmissionError(f"not admitted: {admission.reason}")
        rec = EnvRecord(id=_state.new_env_id(lock.name), name=lock.name, lock=plan_to_builtins(lock),
                        snapshot=snapshot, parent=parent,
                        snapshot_layers=[msgspec.to_builtins(layer) for layer in snapshot_layers])
        if lock.ttl_s and not pooled:
            self._expire_in(rec, lock.ttl_s)
        if pooled:
            self.pool_starting.add(rec.id)
        self.envs[rec.id] = rec
        rec.timings_ms["lock"] = round((time.perf_counter() - t0) * 1000, 1)
        async with self._lock(rec.id):
            self._save(rec)
            try:
                await self._start(rec, lock, limits, start_cpu_cores)
            except BaseException as e:
                if rec.id not in self.monitor:
                    self.monitor.cancel_admission(limits)  # give back the room admission set aside
                self.pool_starting.discard(rec.id)
                with trio.CancelScope(shield=True):
                    log.warning("env %s failed to start (%s): undoing its setup", rec.id, e)
                    await self._teardown(rec)
                if isinstance(e, (ProvisionError, EnvletError)):
                    raise EnvStartError(str(e), env_id=rec.id) from e
                raise
        if pooled:
            rec.status = "pooled"
            self.pool_starting.discard(rec.id)
            self._save(rec)
        log.info("env %s %s (%d layers)", rec.id, "pooled" if pooled else "running", len(rec.layers))
        return rec

    # ------------------------------------------------------------------ warm pool

    def _take_pooled(self, key: str) -> EnvRecord | None:
        ids = self._pools.get(key)
        while ids:
            rec = self.envs.get(ids.pop())
            if rec is not None and rec.status == "pooled":
                rec.status = "running"
                rec.created_s = time.time()
                return rec
        return None

    def _refill_later(self, key: str, lock: Lock) -> None:
        if self.nursery is None or key in self._refilling:
            return
        self._refilling.add(key)
        self.nursery.start_soon(self._refill, key, lock)

    async def _refill(self, key: str, lock: Lock) -> None:
        """Keep ``pool_size`` envs of this lock started and idle, one at a time, in the background."""
        try:
            while len(self._pools.get(key, ())) < self.pool_size and key in self._pool_used:
                rec = await self._create(lock, time.perf_counter(), pooled=True)
                if key not in self._pool_used:  # dropped (idle, or gc) while this one was starting
                    await self.kill(rec.id)
                    break
                self._pools.setdefault(key, []).append(rec.id)
        except (ProvisionError, EnvletError) as e:
            log.info("warm pool: no refill for %s: %s", lock.name, e)
        finally:
            self._refilling.discard(key)

    async def _evict_one_pooled(self) -> bool:
        for key, ids in self._pools.items():
            while ids:
                rec = self.envs.get(ids.pop(0))
                if rec is not None and rec.status == "pooled":
                    await self.kill(rec.id)
                    return True
        return False

    async def drain_pools(self) -> list[str]:
        """Kill every pooled env and forget the pools (gc, shutdown of the pool)."""
        self._pool_used.clear()
        killed = []
        for key in list(self._pools):
            for env_id in self._pools.pop(key, []):
                if env_id in self.envs and self.envs[env_id].status == "pooled":
                    await self.kill(env_id)
                    killed.append(env_id)
        return killed

    async def pool_janitor(self, idle_s: float = 120.0, interval_s: float = 5.0) -> None:
        """Drop the pools of locks nobody asked for lately."""
        while True:
            await trio.sleep(interval_s)
            now = time.monotonic()
            for key, last in list(self._pool_used.items()):
                if now - last > idle_s:
                    del self._pool_used[key]
                    for env_id in self._pools.pop(key, []):
                        if env_id in self.envs and self.envs[env_id].status == "pooled":
                            await self.kill(env_id)

    async def _start(self, rec: EnvRecord, lock: Lock, limits: EnvLimits,
                     start_cpu_cores: float | None = None) -> None:
        local = StoreSpec("layout", path=_home.store_dir())
        layers: list[tuple[StoreSpec, str, int, str, str]] = [
            (store_spec(g), g.layer_digest, g.layer_size, g.toc_digest, g.repo) for g in lock.groups
        ] + [(local, x["digest"], x["size"], x["toc_digest"], "") for x in rec.snapshot_layers]
        paths: list[str | None] = [None] * len(layers)
        for i in range(len(lock.groups), len(layers)):  # snapshot layers kept here as directories
            tree = self.tree_path(layers[i][1])
            if os.path.isdir(tree):
                paths[i] = tree
        for i in range(len(lock.groups)):  # hot group layers kept here as directories
            tree = self.layer_trees.path(layers[i][1]) if self.layer_trees is not None else None
            if tree is not None:
                paths[i] = tree
                rec.trees.append(layers[i][1])  # recorded at once: eviction must not take it from under us

        errors: list[Exception] = []

        async def register(i: int) -> None:
            spec, digest, size, toc, repo = layers[i]
            try:
                info = await trio.to_thread.run_sync(
                    lambda: self.envlet.register(spec, digest, size, toc, repo=repo))
            except Exception as e:  # reported once all registrations are done
                errors.append(e)
                return
            rec.layers.append(info.name)  # recorded at once: teardown must release it even if others fail
            paths[i] = info.path
            if i < len(lock.groups):  # a layer registered before: its size and TOC digest against the lock
                try:
                    check_registered(lock, i, info.size, info.toc_digest)
                except LockError as e:
                    errors.append(e)

        mark = _Stopwatch(rec.timings_ms)
        netpol = network_policy(lock)
        if netpol.mode == "egress":  # wired in the background while layers, mounts and bundle are made
            self._network_up(rec.id, netpol)
        async with trio.open_nursery() as n:
            for i in range(len(layers)):
                if paths[i] is None:
                    n.start_soon(register, i)
        if errors:
            raise errors[0]
        self._save(rec)  # a daemon dying from here on must find the layer references to release
        mark("layers")
        rw = _state.upper_mount(self.envs_dir, rec.id)
        rootfs = _state.rootfs_path(self.envs_dir, rec.id)
        lowers = [p for p in reversed(paths) if p]  # overlayfs wants the top layer first
        if not lowers:
            raise EnvStartError("the plan has no layer groups", env_id=rec.id)

        def mounts() -> None:
            _mounts.mount_upper(rw, lock.resources.disk)
            if self.idmap is not None:  # the merged root takes the upper's owner: the top lower's (range ids)
                top = os.stat(lowers[0])
                os.chown(os.path.join(rw, "upper"), top.st_uid, top.st_gid)
            _mounts.mount_overlay(rootfs, lowers, os.path.join(rw, "upper"), os.path.join(rw, "work"))

        await trio.to_thread.run_sync(mounts)
        mark("mounts")
        cg = await trio.to_thread.run_sync(self.backend.create, rec.id)
        rec.cgroup = rec.id
        self.cgroups[rec.id] = cg
        await trio.to_thread.run_sync(cg.set_pids, lock.resources.pids)
        self._save(rec)
        mark("cgroup")

        listener: socket.socket | None = None
        try:
            routing, agent_ok = plan_runtime(self.runtime, lock.runtime)
        except HostError as e:
            raise EnvStartError(str(e), env_id=rec.id) from None

        def bundle() -> dict[str, Any]:
            nonlocal listener
            user = resolve_user(rootfs, lock.user) if lock.user else ROOT_USER
            agent: dict[str, str] = {}
            if self.agent_path is not None and not lock.init and agent_ok:
                sock_path = os.path.join(_state.env_dir(self.envs_dir, rec.id), "agent.sock")
                listener = agent_listener(sock_path)
                agent = {"agent_path": self.agent_path, "agent_socket": sock_path}
            spec = prepare_bundle(
                _state.bundle_path(self.envs_dir, rec.id), env_id=rec.id, rootfs=rootfs,
                host=getattr(self.runtime, "host", None), network=netpol.mode, args=lock.init, env=dict(lock.env),
                netns_path=self.net.netns_path(rec.id) if netpol.mode == "egress" else None,
                nameserver=self.net.nameserver(rec.id) if netpol.mode == "egress" else None,
                node_address=self.net.states[rec.id].gateway if netpol.mode == "egress" else None,
                cwd=lock.workdir or "/", user=user,
                bind_mounts=[BindMount(source=m.source, destination=m.target) for m in lock.mounts], **agent,
                annotations=routing or None,
            )
            if self.idmap is not None:
                # crun's child, the env's root, walks to the rootfs and the bind sources as host uid base:
                # from the bundle (crun's cwd), through the env's directory only
                env_dir, bundle_dir = _state.env_dir(self.envs_dir, rec.id), _state.bundle_path(self.envs_dir, rec.id)
                open_path_for_range([env_dir, bundle_dir], self.idmap)
                spec = own_cgroups_only(apply_userns(spec, self.idmap),
                                        [os.path.dirname(p) for p in cg.procs_paths()], self.backend.version)
                if routing.get(ANNOTATION_RUNTIME, getattr(self.runtime, "name", "crun")) == "crun":
                    spec = bundle_relative_paths(spec, bundle_dir, env_dir)
                else:  # runsc starts its sandbox in the env's user namespace and takes absolute paths only
                    open_path_for_range([os.path.dirname(self.envs_dir), self.envs_dir], self.idmap)
            return spec

        spec = await trio.to_thread.run_sync(bundle)
        mark("bundle")
        try:
            if netpol.mode == "egress":
                await self._network_ready(rec.id)
                mark("network")
            extra = {"listen_fd": listener.fileno()} if listener is not None else {}
            rec.init_pid = await self.runtime.create(rec.id, _state.bundle_path(self.envs_dir, rec.id),
                                                     spec["root"]["path"], spec, cg.procs_paths(), **extra)
        finally:
            if listener is not None:
                listener.close()  # the env's init holds its own copy now
        mark("crun_create")
        await self.runtime.start(rec.id)
        mark("crun_start")
        # Quotas apply from here: crun runs inside the env's cgroups (so that the init is born
        # there), and under a 0.25-core quota its own setup would take four times as long.
        self.monitor.add(rec.id, cg, limits, start_cpu_cores=start_cpu_hint(routing, start_cpu_cores))
        rec.status = "running"
        self._save(rec)
        mark("save")
        if self.layer_trees is not None:
            for spec, digest, size, toc, repo in layers[:len(lock.groups)]:
                if digest not in rec.trees:
                    register, unregister = self._tree_source(spec, digest, size, toc, repo)
                    self.layer_trees.note_start(digest, size, register, unregister, copy=self.envlet.extract)

    def _network_up(self, env_id: str, netpol: Any) -> None:
        """Reserve the env's slot now (its netns path and resolver go into the bundle); wire it in the
        daemon's nursery, awaited by :meth:`_network_ready` just before crun create."""
        from ...net import parse_policy

        if self.net is None:
            raise EnvStartError("network = egress: this daemon has no egress networking", env_id=env_id)
        try:
            policy = parse_policy(netpol.allow, netpol.deny, netpol.bandwidth, netpol.dns)
            self.net.reserve(env_id, policy)
        except ValueError as e:  # PolicyError, or a full range
            raise EnvStartError(f"network: {e}", env_id=env_id) from None
        env_dir = _state.env_dir(self.envs_dir, env_id)
        if self.nursery is not None:
            self.nursery.start_soon(self.net.up, env_id, env_dir, policy)
        else:  # no daemon loop: wired when awaited
            self._net_inline = (env_id, env_dir, policy)

    async def _network_ready(self, env_id: str) -> None:
        from ...net._host import NetError

        inline = getattr(self, "_net_inline", None)
        if inline is not None and inline[0] == env_id:
            self._net_inline = None
            await self.net.up(*inline)
        try:
            await self.net.ready(env_id)
        except (NetError, ValueError, OSError) as e:
            raise EnvStartError(f"network: {e}", env_id=env_id) from None

    def _tree_source(self, spec: StoreSpec, digest: str, size: int, toc: str, repo: str
                     ) -> tuple[Callable[[], tuple[str, str]], Callable[[str], None]]:
        """How a layer tree copy holds (and lets go of) the layer in the envlet while it is written out."""

        def register() -> tuple[str, str]:
            info = self.envlet.register(spec, digest, size, toc, repo=repo, prefetch=False)
            return info.name, info.path

        return register, self.envlet.unregister

    # ------------------------------------------------------------------ teardown

    async def _teardown(self, rec: EnvRecord) -> list[str]:
        """Undo everything an env may have set up; idempotent. Returns the problems it hit (logged)."""
        problems: list[str] = []
        env_id = rec.id
        rec.status = "stopping"
        self.monitor.remove(env_id)
        cg = self.cgroups.pop(env_id, None)
        if cg is None and rec.cgroup:
            try:
                cg = await trio.to_thread.run_sync(self.backend.open, rec.cgroup)
            except CgroupNotFoundError:
                cg = None
            except CgroupError as e:
                problems.append(f"cgroup: {e}")
        if cg is not None:
            try:  # a frozen env cannot die: thaw first
                if await trio.to_thread.run_sync(cg.is_frozen):
                    await trio.to_thread.run_sync(cg.thaw)
            except CgroupError as e:
                problems.append(f"thaw: {e}")
        try:
            await self.runtime.delete(env_id, force=True)
        except ContainerNotFoundError:
            pass
        except ProvisionError as e:
            problems.append(f"runtime: {e}")
        if cg is not None:
            try:
                await trio.to_thread.run_sync(cg.kill_all)
                await trio.to_thread.run_sync(cg.remove)
            except CgroupError as e:
                problems.append(f"cgroup: {e}")

        def unmount_all() -> None:
            for m in _mounts.mounts_under(_state.env_dir(self.envs_dir, env_id)):
                try:
                    _mounts.unmount(m)
                except ProvisionError as e:
                    problems.append(str(e))

        await trio.to_thread.run_sync(unmount_all)
        if self.net is not None:  # after the processes are gone: nothing holds the namespace
            problems += await self.net.down(env_id, _state.env_dir(self.envs_dir, env_id))
        for name in list(rec.layers):
            try:
                await trio.to_thread.run_sync(self.envlet.unregister, name)
            except LayerNotFoundError:
                pass
            except EnvletError as e:
                problems.append(f"envlet: {e}")
                continue
            rec.layers.remove(name)
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
        for ids in self._pools.values():
            if env_id in ids:
                ids.remove(env_id)
        async with self._lock(env_id):
            if env_id not in self.envs:
                return
            problems = await self._teardown(rec)
        if problems:
            raise EnvStateError(f"killed, but cleanup is incomplete: {'; '.join(problems)} (run `weenv gc`)",
                                env_id=env_id)
        log.info("env %s killed", env_id)

    # ------------------------------------------------------------------ operations

    def _running(self, env_id: str) -> EnvRecord:
        rec = self.get(env_id)
        if rec.status == "paused":
            raise EnvStateError("is paused (resume it first)", env_id=env_id)
        if rec.status != "running":
            raise EnvStateError(f"is {rec.status}", env_id=env_id)
        return rec

    async def _exec_target(self, env_id: str, argv: Sequence[str],
                           user: str | None) -> tuple[User | None, Sequence[str]]:
        """What exec and start_process check and resolve first: the env runs, a command, the user, the
        cgroup files the process joins."""
        self._running(env_id)
        if not argv:
            raise EnvStateError("empty command", env_id=env_id)
        who: User | None = None
        if user is not None:
            who = await trio.to_thread.run_sync(resolve_user, self.rootfs(env_id), user)
        cg = self.cgroups.get(env_id)
        return who, (cg.procs_paths() if cg is not None else ())

    async def exec(self, env_id: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                   cwd: str | None = None, user: str | None = None, stdin: bytes | None = None,
                   timeout_s: float | None = None, on_output: OutputCallback | None = None) -> ExecResult:
        who, procs = await self._exec_target(env_id, argv, user)
        return await self.runtime.exec(env_id, argv, env=env, cwd=cwd, user=who, stdin=stdin, timeout_s=timeout_s,
                                       cgroup_procs=procs, on_output=on_output)

    # -- process handles (docs/architecture.md, "Processes"): the env's agent keeps the table,
    # so they outlive the client that started them and this daemon

    async def start_process(self, env_id: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                            cwd: str | None = None, user: str | None = None, stdin: bool = False,
                            pty: tuple[int, int] | None = None, tag: str | None = None,
                            buffer_bytes: int | None = None) -> ProcessStream:
        who, procs = await self._exec_target(env_id, argv, user)
        return await self.runtime.start_process(env_id, argv, env=env, cwd=cwd, user=who, stdin=stdin, pty=pty,
                                                tag=tag, buffer_bytes=buffer_bytes,
                                                cgroup_procs=procs)

    async def connect_process(self, env_id: str, pid: int) -> ProcessStream:
        self._running(env_id)
        return await self.runtime.connect_process(env_id, pid)

    async def processes(self, env_id: str) -> list[ProcessInfo]:
        self._running(env_id)
        return await self.runtime.list_processes(env_id)

    async def process(self, env_id: str, pid: int) -> ProcessInfo:
        for info in await self.processes(env_id):
            if info.pid == pid:
                return info
        raise ProcessNotFoundError(f"no process {pid} started by weenv", env_id=env_id)

    async def send_stdin(self, env_id: str, pid: int, data: bytes, *, close: bool = False) -> None:
        self._running(env_id)
        await self.runtime.send_stdin(env_id, pid, data, close=close)

    async def signal_process(self, env_id: str, pid: int, sig: int) -> None:
        self._running(env_id)
        await self.runtime.signal_process(env_id, pid, sig)

    async def resize_process(self, env_id: str, pid: int, rows: int, cols: int) -> None:
        self._running(env_id)
        await self.runtime.resize_process(env_id, pid, rows, cols)

    async def wait_process(self, env_id: str, pid: int, timeout_s: float | None = None) -> ProcessEnd | None:
        self._running(env_id)
        return await self.runtime.wait_process(env_id, pid, timeout_s)

    async def open_port(self, env_id: str, port: int) -> socket.socket:
        """A TCP connection to ``port`` on the env's own loopback (``weenv serve``'s port proxy,
        E2B's ``get_host``). The socket is made in a thread that entered the env's network namespace
        (a socket stays in the namespace it was made in; the thread is never reused), so the env
        needs no interface for it."""
        from ..runtime._ns import CLONE_NEWNET, _check, _libc, in_fresh_thread

        rec = self._running(env_id)
        if not rec.init_pid:
            raise EnvStateError("has no init process to find its network in", env_id=env_id)
        if not 1 <= port <= 65535:
            raise EnvStateError(f"port {port} is not a TCP port (1-65535)", env_id=env_id)
        init_pid = rec.init_pid

        def connect() -> socket.socket:
            fd = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _check(_libc.setns(fd, CLONE_NEWNET), "enter the env's network namespace")
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.settimeout(5.0)
                sock.connect(("127.0.0.1", port))
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
            return sock

        try:
            return await trio.to_thread.run_sync(in_fresh_thread, connect)  # type: ignore[no-any-return]
        except (ConnectionRefusedError, TimeoutError, socket.timeout):
            raise EnvStateError(f"port {port} is not open (nothing listens on 127.0.0.1:{port} in the env)",
                                env_id=env_id) from None
        except FileNotFoundError:
            raise EnvStateError("its init process is gone", env_id=env_id) from None

    async def files(self, env_id: str, op: str, path: str, *, data: bytes = b"", mode: int = 0o644,
                    user: str | None = None, recursive: bool = False, max_bytes: int | None = None) -> Any:
        """read | write | list | stat | mkdir | remove, resolved inside the env's rootfs."""
        rec = self.get(env_id)
        if rec.status not in ("running", "paused"):
            raise EnvStateError(f"is {rec.status}", env_id=env_id)
        root = self.rootfs(env_id)

        ids = self.idmap

        def env_ids(info: Any) -> Any:  # owners as the env sees them
            return info if ids is None else msgspec.structs.replace(info, uid=ids.env(info.uid), gid=ids.env(info.gid))

        def run() -> Any:
            who = resolve_user(root, user) if user else None
            uid, gid = (who.uid, who.gid) if who else (0, 0)
            if ids is not None:  # written on the host: owned by the env's ids as the host has them
                uid, gid = ids.host(uid), ids.host(gid)
            fs = RootFS(root, uid=uid, gid=gid)
            try:
                if op == "read":
                    return fs.read(path, max_bytes=max_bytes) if max_bytes else fs.read(path)
                if op == "write":
                    fs.write(path, data, mode=mode, make_parents=True)
                    return None
                if op == "list":
                    return [env_ids(i) for i in fs.list(path)]
                if op == "stat":
                    return env_ids(fs.stat(path))
                if op == "mkdir":
                    fs.mkdir(path, parents=True, exist_ok=True, mode=mode if mode != 0o644 else 0o755)
                    return None
                if op == "remove":
                    fs.remove(path, recursive=recursive)
                    return None
            finally:
                fs.close()
            raise ValueError(f"unknown file operation {op!r}")

        return await trio.to_thread.run_sync(run)

    async def pause(self, env_id: str) -> None:
        async with self._lock(env_id):
            rec = self._running(env_id)
            await trio.to_thread.run_sync(self.cgroups[env_id].freeze)
            rec.status = "paused"
            self._save(rec)

    async def resume(self, env_id: str) -> None:
        async with self._lock(env_id):
            rec = self.get(env_id)
            if rec.status != "paused":
                raise EnvStateError(f"is {rec.status}, not paused", env_id=env_id)
            await trio.to_thread.run_sync(self.cgroups[env_id].thaw)
            rec.status = "running"
            self._save(rec)

    def set_ttl(self, env_id: str, ttl_s: float | None) -> EnvRecord:
        rec = self.get(env_id)
        self._expire_in(rec, ttl_s)
        self._save(rec)
        return rec

    def _expire_in(self, rec: EnvRecord, ttl_s: float | None) -> None:
        """The env's TTL: a wall-clock deadline in its record (restarts, display), a monotonic one here."""
        rec.expires_s = None if ttl_s is None else time.time() + ttl_s
        if ttl_s is None:
            self._ttl_deadlines.pop(rec.id, None)
        else:
            self._ttl_deadlines[rec.id] = (rec.expires_s, time.monotonic() + ttl_s)  # type: ignore[assignment]

    async def ttl_loop(self, interval_s: float = 0.25) -> None:
        # TTLs count monotonic time (a deadline set here, or the record's wall-clock one turned monotonic
        # when first seen: re-adopted envs), so a jump of the wall clock neither expires envs early nor
        # keeps them past their time
        deadlines = self._ttl_deadlines
        while True:
            now = time.monotonic()
            for gone in deadlines.keys() - self.envs.keys():
                del deadlines[gone]
            for rec in list(self.envs.values()):
                if rec.expires_s is None:
                    deadlines.pop(rec.id, None)
                    continue
                seen = deadlines.get(rec.id)
                if seen is None or seen[0] != rec.expires_s:
                    seen = deadlines[rec.id] = (rec.expires_s, now + rec.expires_s - time.time())
                if seen[1] <= now and rec.status in ("running", "paused"):
                    log.info("env %s: TTL expired, killing it", rec.id)
                    try:
                        await self.kill(rec.id)
                    except ProvisionError as e:
                        log.error("env %s: TTL kill: %s", rec.id, e)
            await trio.sleep(interval_s)

    # ------------------------------------------------------------------ snapshots

    def _layout(self) -> LayoutStore:
        if self._store is None:
            self._store = LayoutStore(_home.store_dir())
        return self._store

    async def commit(self, env_id: str, *, ref: str | None = None, build_key: str | None = None) -> SnapshotRecord:
        """Freeze the env, seal its upper into a layer in the embedded store, thaw; record a snapshot."""
        t0 = time.perf_counter()
        async with self._lock(env_id):
            rec = self.get(env_id)
            if rec.status not in ("running", "paused"):
                raise EnvStateError(f"is {rec.status}", env_id=env_id)
            cg = self.cgroups[env_id]
            froze = rec.status == "running"
            store = self._layout()
            upper = os.path.join(_state.upper_mount(self.envs_dir, env_id), "upper")
            tmp = os.path.join(store.root, "blobs", "sha256", f".commit-{env_id}-{secrets.token_hex(4)}")
            id_base = self.idmap.base if self.idmap is not None else 0

            def seal() -> layerfmt.BuildResult:
                try:
                    with open(tmp, "wb") as f:  # the layer records the env's ids, not the host's
                        res = layerfmt.build_layer(upper, f, overlay_upper=True, id_base=id_base)
                    final = store.blob_path(res.digest)
                    if os.path.exists(final):
                        os.unlink(tmp)
                    else:
                        os.replace(tmp, final)
                    return res
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except FileNotFoundError:
                        pass
                    raise

            tree_tmp = os.path.join(self.trees_dir, f".commit-{env_id}-{secrets.token_hex(4)}")
            copied = False

            async def copy_tree() -> None:  # the same upper as a directory (cp keeps whiteouts, xattrs)
                nonlocal copied
                p = await trio.run_process(["cp", "-a", "--", upper, tree_tmp], capture_stderr=True, check=False)
                copied = p.returncode == 0
                if not copied:
                    log.warning("env %s: commit: copying the upper failed (envs from the snapshot will read it "
                                "through the envlet): %s", env_id, p.stderr.decode(errors="replace").strip()[-300:])
                    return
                try:  # no device node, no capability for host processes in a tree on the host's disk
                    await trio.to_thread.run_sync(make_tree_inert, tree_tmp, id_base)
                except (DeviceNodeInTreeError, OSError) as e:
                    copied = False
                    log.warning("env %s: commit: no snapshot tree (envs from the snapshot read it through the "
                                "envlet, nodev): %s", env_id, e)

            self._trees_in_progress.update((tree_tmp, tmp))  # gc leaves both alone meanwhile
            try:
                if froze:
                    await trio.to_thread.run_sync(cg.freeze)
                try:
                    async with trio.open_nursery() as n:
                        n.start_soon(copy_tree)
                        res = await trio.to_thread.run_sync(seal)
                except BaseExceptionGroup as eg:  # the nursery's group of one: its error, said plainly
                    err = eg.exceptions[0] if len(eg.exceptions) == 1 else eg
                    if isinstance(err, OSError):
                        full = " (the disk of $WEENV_HOME is full)" if err.errno == errno.ENOSPC else ""
                        raise EnvError(f"commit: writing the snapshot layer failed: {err}{full}",
                                       env_id=env_id) from err
                    raise err from None
                finally:
                    if froze:
                        with trio.CancelScope(shield=True):
                            await trio.to_thread.run_sync(cg.thaw)
                tree = self.tree_path(res.digest)
                if copied:
                    copied = await trio.to_thread.run_sync(_install_tree, tree_tmp, tree)
            finally:
                self._trees_in_progress.difference_update((tree_tmp, tmp))
                if os.path.lexists(tree_tmp):
                    await trio.to_thread.run_sync(lambda: shutil.rmtree(tree_tmp, ignore_errors=True))
        layer = SnapshotLayer(digest=res.digest, size=res.size, toc_digest=res.toc_digest)
        parents = [msgspec.convert(x, SnapshotLayer) for x in rec.snapshot_layers]
        snap = SnapshotRecord(id=new_snapshot_id(), source_env=env_id, lock=rec.lock, layers=[*parents, layer],
                              build_key=build_key, diff_bytes=res.content_bytes,
                              cpu_quota_cores=self.monitor.cpu_quota(env_id))
        self.snapshots.save(snap)

        def warm() -> None:  # the new layer's chunks go to the node's disk cache at once
            info = self.envlet.register(StoreSpec("layout", path=store.root), layer.digest, layer.size,
                                        layer.toc_digest, warm=True)
            self.envlet.unregister(info.name)

        async def warm_in_background() -> None:
            try:
                await trio.to_thread.run_sync(warm)
            except EnvletError as e:
                log.warning("snapshot %s: could not warm the envlet cache: %s", snap.id, e)

        if copied:
            pass  # envs from it use the directory: nothing to cache
        elif self.nursery is not None:  # the caller has its snapshot now; the cache fills meanwhile
            self.nursery.start_soon(warm_in_background)
        else:
            await warm_in_background()
        if ref:
            from ...registry import publish_layer_file

            await trio.to_thread.run_sync(lambda: publish_layer_file(
                store.blob_path(layer.digest), ref, group="snapshot", group_class="task", digest=layer.digest,
                source=f"weenv commit {env_id}"))
            snap.ref = ref
            self.snapshots.save(snap)
        log.info("env %s committed as %s (%d bytes of diff, %.0f ms)", env_id, snap.id, res.content_bytes,
                 (time.perf_counter() - t0) * 1000)
        return snap

    async def create_from_snapshot(self, snap_id: str, **overrides: Any) -> EnvRecord:
        snap = self.snapshots.get(snap_id)
        lock: Plan = msgspec.convert(snap.lock, Lock)
        clean = {k: v for k, v in overrides.items() if v is not None}
        if clean:
            lock = apply_overrides(lock, **clean)
        return await self.create(lock, snapshot=snap.id, parent=snap.source_env, snapshot_layers=snap.layers,
                                 start_cpu_cores=snap.cpu_quota_cores)

    async def fork(self, env_id: str, n: int) -> tuple[SnapshotRecord, list[EnvRecord]]:
        """Commit once, start ``n`` children from that state; all or none (a failure kills the started ones)."""
        if not 1 <= n <= 1024:
            raise EnvStateError(f"fork needs 1 <= n <= 1024, got {n}", env_id=env_id)
        snap = await self.commit(env_id)
        snap.fork = True  # nobody asked for this snapshot: gc collects it when its children are gone
        self.snapshots.save(snap)
        children: list[EnvRecord] = []
        errors: list[BaseException] = []

        async def one() -> None:
            try:
                children.append(await self.create_from_snapshot(snap.id))
            except Exception as e:  # collected: the others keep going, then all are undone
                errors.append(e)

        self._forking.add(snap.id)
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(one)
        finally:
            self._forking.discard(snap.id)
        if errors:
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as nursery:
                    for child in children:
                        nursery.start_soon(self.kill, child.id)
            # a node too full for the children is a refusal to retry later (503), not a failed start (500)
            cls = AdmissionError if all(isinstance(e, AdmissionError) for e in errors) else EnvStartError
            raise cls(f"fork of {n}: {len(errors)} children failed to start: {errors[0]}", env_id=env_id)
        return snap, children

    def delete_snapshot(self, snap_id: str) -> list[str]:
        """Remove the record, and its layer blobs unless another snapshot, a live env or a tag uses them."""
        rec = self.snapshots.delete(snap_id)
        used: set[str] = set()
        for other in self.snapshots.list():
            used.update(layer.digest for layer in other.layers)
        for env in self.envs.values():
            used.update(x["digest"] for x in env.snapshot_layers)
        store = self._layout()
        tagged: set[str] = set()
        try:
            for repo in store.list_repos():
                for tag in store.list_tags(repo):
                    data, _ = store.get_manifest(repo, tag)
                    tagged.update(layer.get("digest", "") for layer in json.loads(data).get("layers", []))
        except Exception as e:  # an unreadable index must not make us delete blobs
            log.warning("snapshot rm: cannot read the store index (%s): keeping blobs", e)
            return []
        removed = []
        for layer in rec.layers:
            if layer.digest not in used:
                self._discard_tree(self.tree_path(layer.digest))
            if layer.digest not in used and layer.digest not in tagged:
                try:
                    os.unlink(store.blob_path(layer.digest))
                    removed.append(layer.digest)
                except FileNotFoundError:
                    pass
        return removed

    # ------------------------------------------------------------------ restart and gc

    async def adopt(self) -> dict[str, list[str]]:
        """After a daemon restart: keep envs whose container still runs, tear down the rest."""
        adopted, reaped = [], []
        for env_id in sorted(os.listdir(self.envs_dir)):
            rec = _state.load(self.envs_dir, env_id)
            if rec is None:
                rec = EnvRecord(id=env_id, name=env_id, status="failed", cgroup=env_id)
            alive = False
            if rec.status in ("running", "paused"):
                try:
                    st = await self.runtime.state(env_id)
                    alive = st.status in ("running", "paused") and st.pid > 0
                except ProvisionError:
                    alive = False
            if alive:
                try:
                    cg = await trio.to_thread.run_sync(self.backend.open, rec.cgroup or env_id)
                    self.cgroups[env_id] = cg
                    lock = self.lock_of(rec)
                    self.monitor.add(env_id, cg, env_limits(lock, self._runtime_name(lock)), adopt=True)
                    if await trio.to_thread.run_sync(cg.is_frozen):
                        if rec.status == "running":  # frozen by a commit or fork the crash cut short
                            log.warning("env %s: frozen by a commit cut short by the restart: thawed", env_id)
                            await trio.to_thread.run_sync(cg.thaw)
                        else:
                            rec.status = "paused"
                    if self.net is not None:
                        await self.net.adopt(env_id, _state.env_dir(self.envs_dir, env_id))
                    self.envs[env_id] = rec
                    adopted.append(env_id)
                    continue
                except (CgroupError, ValueError) as e:
                    log.warning("env %s: cannot re-adopt (%s); tearing it down", env_id, e)
            self.envs[env_id] = rec
            await self._teardown(rec)
            reaped.append(env_id)
        log.info("re-adopted %d envs, reaped %d", len(adopted), len(reaped))
        return {"adopted": adopted, "reaped": reaped}

    async def gc(self) -> dict[str, Any]:
        """Remove whatever dead envs left behind: idempotent, safe to run at any time."""
        out: dict[str, Any] = {"envs": [], "containers": [], "cgroups": [], "mounts": [], "dirs": [], "layers": []}
        out["pooled"] = await self.drain_pools()
        for rec in list(self.envs.values()):  # failed envs, and live ones whose container died
            dead = rec.status in ("failed", "stopping")
            if rec.status in ("running", "paused", "pooled"):
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
        for st in await self.runtime.list():
            if st.id not in live:
                await self.runtime.delete(st.id, force=True)
                out["containers"].append(st.id)
        for name in await trio.to_thread.run_sync(self.backend.list):
            if name not in live:
                try:
                    cg = await trio.to_thread.run_sync(self.backend.open, name)
                    await trio.to_thread.run_sync(cg.kill_all)
                    await trio.to_thread.run_sync(cg.remove)
                    out["cgroups"].append(name)
                except CgroupError as e:
                    log.warning("gc: cgroup %s: %s", name, e)
        for m in _mounts.mounts_under(self.envs_dir):
            env_id = os.path.relpath(m, self.envs_dir).split("/")[0]
            if env_id not in live:
                await trio.to_thread.run_sync(_mounts.unmount, m)
                out["mounts"].append(m)
        for env_id in os.listdir(self.envs_dir):
            if env_id not in live:
                await trio.to_thread.run_sync(
                    lambda: shutil.rmtree(os.path.join(self.envs_dir, env_id), ignore_errors=True))
                out["dirs"].append(env_id)
        out["layers"] = await self._gc_layers()
        if self.net is not None:
            out["network"] = await self.net.gc(live)
        out["snapshots"] = self._gc_fork_snapshots()
        used = {self.tree_path(layer.digest) for snap in self.snapshots.list() for layer in snap.layers}
        used |= {self.tree_path(x["digest"]) for env in self.envs.values() for x in env.snapshot_layers}
        out["trees"] = await trio.to_thread.run_sync(self._gc_trees, used | self._trees_in_progress)
        out["temps"] = await trio.to_thread.run_sync(self._gc_commit_temps)
        return out

    def _gc_commit_temps(self) -> list[str]:
        """Remove the store's ``.commit-*`` files of commits cut short (a daemon killed mid-commit)."""
        blobs = os.path.join(self._layout().root, "blobs", "sha256")
        removed = []
        for name in os.listdir(blobs) if os.path.isdir(blobs) else ():
            path = os.path.join(blobs, name)
            if name.startswith(".commit-") and path not in self._trees_in_progress:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                removed.append(name)
        return removed

    def _gc_fork_snapshots(self) -> list[str]:
        """Delete the snapshots made by fork that no env started from any more (commit and build
        snapshots stay until deleted); their ids."""
        wanted = {rec.snapshot for rec in self.envs.values()} | self._forking
        removed = []
        for snap in self.snapshots.list():
            if snap.fork and snap.id not in wanted:
                try:
                    self.delete_snapshot(snap.id)
                except SnapshotNotFoundError:
                    continue  # deleted meanwhile
                removed.append(snap.id)
        return removed

    def _gc_trees(self, keep: set[str]) -> list[str]:
        """Remove the snapshot trees not in ``keep`` (a snapshot deleted while its envs ran, a commit
        or a removal cut short); names of the trees removed."""
        removed = []
        for name in os.listdir(self.trees_dir):
            path = os.path.join(self.trees_dir, name)
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
                if not name.startswith("."):
                    removed.append(name)
        return removed

    def _discard_tree(self, path: str) -> None:
        """Take a snapshot tree out of use at once (a rename); its files go in a worker thread, off the
        loop (a big tree takes seconds)."""
        trash = os.path.join(self.trees_dir, f".trash-{secrets.token_hex(6)}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        if self.nursery is not None:
            self.nursery.start_soon(trio.to_thread.run_sync, shutil.rmtree, trash, True)
        else:
            shutil.rmtree(trash, ignore_errors=True)

    async def _gc_layers(self) -> list[str]:
        """Drop envlet references that no live env holds (left by a daemon that died mid-teardown)."""
        wanted: dict[str, int] = {}
        for rec in self.envs.values():
            for name in rec.layers:
                wanted[name] = wanted.get(name, 0) + 1
        released = []
        try:
            layers = await trio.to_thread.run_sync(self.envlet.list)
        except EnvletError:
            return []
        for info in layers:
            extra = info.refcount - wanted.get(info.name, 0) - self.pinned_layers.get(info.name, 0)
            for _ in range(max(0, extra)):
                await trio.to_thread.run_sync(self.envlet.unregister, info.name)
                released.append(info.name)
        return released

