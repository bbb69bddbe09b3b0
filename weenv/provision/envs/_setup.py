"""An env's parts on the host: set up at start, found again after a daemon restart, undone at the end.

The parts, in the order :meth:`EnvSetup.start` makes them: envlet layer references (or local trees)
→ tmpfs upper + overlayfs rootfs → cgroup → OCI bundle (agent socket, user namespace) → the egress
network (wired meanwhile) → the container (crun create + start) → the monitor's limits.
:meth:`EnvSetup.reattach` takes the cgroup, the monitor and the network of a container that
outlived its daemon back. :meth:`EnvSetup.undo` removes whatever of them exists, in any partial
state, so that nothing (mount, cgroup, process, layer reference) outlives an env.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import trio

from ... import _home
from ...envlet import EnvletClient, EnvletError, LayerNotFoundError, StoreSpec
from ...plan import Lock, LockedGroup, LockError
from ...plan._model import network_policy
from .._errors import AdmissionError, CgroupError, CgroupNotFoundError, ContainerNotFoundError, EnvStartError, HostError, ProvisionError
from ..cgroups import Cgroup, CgroupBackend
from ..elastic._monitor import Monitor
from ..elastic._policy import EnvLimits
from ..runtime._agent import agent_listener
from ..runtime._idmap import IdMap, apply_userns, bundle_relative_paths, open_path_for_range, own_cgroups_only
from ..runtime._ocispec import ROOT_USER, BindMount
from ..runtime._router import ANNOTATION_RUNTIME, memory_runtime, plan_runtime, start_cpu_hint
from ..runtime._runtime import Runtime, prepare_bundle
from . import _mounts, _state
from ._fileops import resolve_user
from ._snapshots import SnapshotTrees
from ._state import EnvRecord
from ._startcheck import check_registered
from ._trees import LayerTrees
from ._volumes import VolumeStore

log = logging.getLogger("weenv.daemon")


def store_spec(group: LockedGroup) -> StoreSpec:
    """Where the envlet reads a locked group's layer from: its registry, or the embedded store."""
    if group.registry is None:
        return StoreSpec("layout", path=_home.store_dir())
    from ...registry._group import insecure_by_default

    return StoreSpec("registry", registry=group.registry, insecure=insecure_by_default(group.registry))


class _Stopwatch:
    """Records milliseconds since the previous mark under each name (create's timing breakdown)."""

    def __init__(self, into: dict[str, float]):
        self.into = into
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = round((now - self.last) * 1000, 1)
        self.last = now


class EnvSetup:
    """Sets up and undoes envs under ``envs_dir``; the cgroups it makes go to ``cgroups`` (env id →
    cgroup, shared with the manager), records are written with ``save``, and ``spawn`` wires an
    egress network in the background (False: no background work runs, it is wired when awaited).
    The other parts are :class:`~weenv.provision.envs.EnvManager`'s, described there."""

    def __init__(self, *, envs_dir: str, runtime: Runtime, backend: CgroupBackend, monitor: Monitor,
                 envlet: EnvletClient, cgroups: dict[str, Cgroup], save: Callable[[EnvRecord], None],
                 spawn: Callable[..., bool], snapshot_trees: SnapshotTrees, layer_trees: LayerTrees | None,
                 agent_path: str | None, idmap: IdMap | None, net: Any, volumes: VolumeStore):
        self.envs_dir = envs_dir
        self.runtime = runtime
        self.backend = backend
        self.monitor = monitor
        self.envlet = envlet
        self.cgroups = cgroups
        self._save = save
        self._spawn = spawn
        self.snapshot_trees = snapshot_trees
        self.layer_trees = layer_trees
        self.agent_path = agent_path
        self.idmap = idmap
        self.net = net
        self.volumes = volumes
        self._net_inline: tuple[str, str, Any] | None = None  # an egress network to wire when awaited (no spawn)

    async def start(self, rec: EnvRecord, lock: Lock, limits: EnvLimits, start_cpu_cores: float | None = None,
                    restore_from: str | None = None) -> None:
        """Make every part of ``rec`` and start its container; each part is recorded in ``rec`` (and
        saved) as soon as it exists, so that :meth:`undo` finds it if a later step fails."""
        local = StoreSpec("layout", path=_home.store_dir())
        layers: list[tuple[StoreSpec, str, int, str, str]] = [
            (store_spec(g), g.layer_digest, g.layer_size, g.toc_digest, g.repo) for g in lock.groups
        ] + [(local, x["digest"], x["size"], x["toc_digest"], "") for x in rec.snapshot_layers]
        paths: list[str | None] = [None] * len(layers)
        for i in range(len(lock.groups), len(layers)):  # snapshot layers kept here as directories
            tree = self.snapshot_trees.path(layers[i][1])
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
        # The groups first: the env's first process is moved into them a few ms from now, and the
        # kernel's wait for that move (an RCU grace period after a quiet spell, ~10 ms here) can
        # start at once, beside layers, mounts and bundle (cgroups/_warm.py). A move holds the
        # cgroup mutex while it waits, so no group is made after it is asked for.
        cg = await trio.to_thread.run_sync(self.backend.create, rec.id)
        rec.cgroup = rec.id
        self.cgroups[rec.id] = cg
        self._spawn(trio.to_thread.run_sync, self.backend.warm_moves)
        await trio.to_thread.run_sync(cg.set_pids, lock.resources.pids)
        self._save(rec)
        mark("cgroup")
        netpol = network_policy(lock)
        if netpol.mode == "egress":  # wired in the background while layers, mounts and bundle are made
            self._network_up(rec.id, netpol, restricted=rec.restricted)
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
            _mounts.mount_overlay(rootfs, lowers, os.path.join(rw, "upper"), os.path.join(rw, "work"), setuid=lock.setuid)

        await trio.to_thread.run_sync(mounts)
        mark("mounts")

        await trio.to_thread.run_sync(self._bind_volumes, rec, lock)
        await self.boot(rec, lock, limits, start_cpu_cores, mark, first=netpol.mode == "egress", restore_from=restore_from)
        if self.layer_trees is not None:
            for spec, digest, size, toc, repo in layers[:len(lock.groups)]:
                if digest not in rec.trees:
                    register, unregister = self._tree_source(spec, digest, size, toc, repo)
                    self.layer_trees.note_start(digest, size, register, unregister, copy=self.envlet.extract)

    async def boot(self, rec: EnvRecord, lock: Lock, limits: EnvLimits, start_cpu_cores: float | None = None,
                   mark: Callable[[str], None] | None = None, *, first: bool = False,
                   restore_from: str | None = None) -> None:
        """Write the env's bundle and start its container over the rootfs, cgroup, volumes and network
        it has (at its start, and again after :meth:`stop`: a new boot). ``first``: wait for the
        egress network being wired meanwhile. ``restore_from``: a checkpoint image directory whose
        processes the container is restored with (a memory snapshot's, or a parked env's)."""
        mark = mark or (lambda _name: None)
        rootfs = _state.rootfs_path(self.envs_dir, rec.id)
        cg = self.cgroups[rec.id]
        netpol = network_policy(lock)
        volume_binds = self._volume_binds(rec, lock)
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
                bind_mounts=[*(BindMount(source=m.source, destination=m.target) for m in lock.mounts),
                             *volume_binds], **agent,
                annotations=routing or None, setuid=lock.setuid,
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
                # runsc sees the rootfs and bundle in its own view (runtime/_gvisor.py): $WEENV_HOME stays 0700
            return spec

        spec = await trio.to_thread.run_sync(bundle)
        mark("bundle")
        try:
            if first:
                await self._network_ready(rec.id)
                mark("network")
            extra = {"listen_fd": listener.fileno()} if listener is not None else {}
            # a new boot (resume, restore) runs unthrottled as a first one does: the monitor had cut
            # an idle env's CPU to its min, and a restore under 0.05 cores took 0.4 s more
            await trio.to_thread.run_sync(cg.set_cpu, None)
            if restore_from is not None:
                restorer = memory_runtime(self.runtime, routing.get(ANNOTATION_RUNTIME))
                if restorer is None:
                    raise EnvStartError(f"the {lock.runtime or 'default'} runtime cannot restore a memory image "
                                        "(memory snapshots need gVisor)", env_id=rec.id)
                rec.init_pid = await restorer.restore(rec.id, _state.bundle_path(self.envs_dir, rec.id),
                                                      spec["root"]["path"], spec, restore_from, cg.procs_paths())
            else:
                rec.init_pid = await self.runtime.create(rec.id, _state.bundle_path(self.envs_dir, rec.id),
                                                         spec["root"]["path"], spec, cg.procs_paths(), **extra)
        finally:
            if listener is not None:
                listener.close()  # the env's init holds its own copy now
        mark("restore" if restore_from is not None else "crun_create")
        if restore_from is None:
            await self.runtime.start(rec.id)
            mark("crun_start")
        # Quotas apply from here: crun runs inside the env's cgroups (so that the init is born
        # there), and under a 0.25-core quota its own setup would take four times as long.
        self.monitor.add(rec.id, cg, limits, start_cpu_cores=start_cpu_hint(routing, start_cpu_cores))
        rec.status = "running"
        self._save(rec)
        mark("save")

    async def boot_again(self, rec: EnvRecord, lock: Lock, limits: EnvLimits) -> None:
        """Resume an env paused without its memory (``rec.cold``): admitted again, then booted (a
        parked one restored from its image, ``rec.memory_image``); a boot that fails leaves it
        paused as it was (parked: with its image)."""
        if not (admission := self.monitor.admit(limits)):
            raise AdmissionError(f"not admitted: {admission.reason}")
        rec.cold = False
        try:
            await self.boot(rec, lock, limits, restore_from=rec.memory_image or None)
        except BaseException as e:
            if rec.id not in self.monitor:
                self.monitor.cancel_admission(limits)
            if isinstance(e, Exception):  # said by ``ps`` until a resume works (a parked env keeps its image)
                rec.error = f"resume failed: {e}"
            with trio.CancelScope(shield=True):
                await self.stop(rec)  # back to paused, nothing half-started left
            raise
        rec.error = ""

    async def stop(self, rec: EnvRecord) -> None:
        """End the env's container and every process in it, keeping its rootfs (files), cgroup, network
        and layers: a pause without memory, which :meth:`boot` ends with a new boot."""
        cg = self.cgroups[rec.id]
        self.monitor.remove(rec.id)
        if await trio.to_thread.run_sync(cg.is_frozen):
            await trio.to_thread.run_sync(cg.thaw)
        try:
            await self.runtime.delete(rec.id, force=True)
        except ContainerNotFoundError:
            pass
        await trio.to_thread.run_sync(cg.kill_all)
        rec.init_pid = 0
        rec.status, rec.cold = "paused", True
        self._save(rec)

    def _volume_binds(self, rec: EnvRecord, lock: Lock) -> list[BindMount]:
        """The bind mounts of the volumes :meth:`_bind_volumes` bound (they stay bound across a
        :meth:`stop`: a new boot binds them again at their paths)."""
        top = os.path.join(_state.env_dir(self.envs_dir, rec.id), "vol")
        return [BindMount(source=os.path.join(top, str(i)), destination=v.path, readonly=v.read_only, executable=True)
                for i, v in enumerate(lock.volumes)]

    def _bind_volumes(self, rec: EnvRecord, lock: Lock) -> list[BindMount]:
        """Each ``[[volumes]]`` table's volume, bound at ``envs/<id>/vol/<i>`` (under the env's own
        directory, as the rootfs: env root walks only that) for crun to bind at its path. The env is
        recorded as the volume's user before it is bound, so a release meanwhile keeps the mount."""
        binds = []
        for i, v in enumerate(lock.volumes):
            vol = self.volumes.get(v.name)
            rec.volumes.append(vol.id)
            self._save(rec)
            top = os.path.join(_state.env_dir(self.envs_dir, rec.id), "vol")
            os.makedirs(top, mode=0o711, exist_ok=True)
            _, src = self.volumes.bind_for_env(rec.id, vol.id, os.path.join(top, str(i)))
            binds.append(BindMount(source=src, destination=v.path, readonly=v.read_only, executable=True))
        return binds

    def _network_up(self, env_id: str, netpol: Any, *, restricted: bool = False) -> None:
        """Reserve the env's slot now (its netns path and resolver go into the bundle); wire it in the
        background, awaited by :meth:`_network_ready` just before crun create. ``restricted``: a
        tenant's env, whose policy is checked again as it is wired (docs/network.md)."""
        from ...net import parse_policy

        if self.net is None:
            raise EnvStartError("network = egress: this daemon has no egress networking", env_id=env_id)
        try:
            policy = parse_policy(netpol.allow, netpol.deny, netpol.bandwidth, netpol.dns, restricted=restricted)
            self.net.reserve(env_id, policy)
        except ValueError as e:  # PolicyError, or a full range
            raise EnvStartError(f"network: {e}", env_id=env_id) from None
        env_dir = _state.env_dir(self.envs_dir, env_id)
        if not self._spawn(self.net.up, env_id, env_dir, policy):  # no daemon loop: wired when awaited
            self._net_inline = (env_id, env_dir, policy)

    async def _network_ready(self, env_id: str) -> None:
        from ...net._host import NetError

        inline = self._net_inline
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

    async def reattach(self, rec: EnvRecord, limits: EnvLimits | None) -> None:
        """Take back the parts of an env whose container outlived the daemon: its cgroup, its limits
        in the monitor (at the cgroup's current values), its network; a commit or fork the restart
        cut short left it frozen: thawed. Raises CgroupError or ValueError if a part is gone."""
        env_id = rec.id
        cg = await trio.to_thread.run_sync(self.backend.open, rec.cgroup or env_id)
        self.cgroups[env_id] = cg
        if limits is None:  # paused without memory (``rec.cold``): no container, nothing to limit
            if self.net is not None:
                await self.net.adopt(env_id, _state.env_dir(self.envs_dir, env_id))
            return
        self.monitor.add(env_id, cg, limits, adopt=True)
        if await trio.to_thread.run_sync(cg.is_frozen):
            if rec.status == "running":  # frozen by a commit or fork the crash cut short
                log.warning("env %s: frozen by a commit cut short by the restart: thawed", env_id)
                await trio.to_thread.run_sync(cg.thaw)
            else:
                rec.status = "paused"
        if self.net is not None:
            await self.net.adopt(env_id, _state.env_dir(self.envs_dir, env_id))

    async def undo(self, rec: EnvRecord) -> list[str]:
        """Remove every part of the env that exists, whatever state it is in: the monitor's limits, the
        container (thawed first), its processes and cgroup, the mounts, the network, the layer
        references (each released one leaves ``rec.layers``). The problems it hit; none: all gone."""
        problems: list[str] = []
        env_id = rec.id
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
        if rec.volumes:  # the env's binds are gone: the host mounts no other env uses go too
            problems += await trio.to_thread.run_sync(lambda: self.volumes.release(rec.volumes, but=env_id))
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
        return problems
