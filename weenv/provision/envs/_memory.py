"""Memory snapshots of envs: park (a pause that frees the env's memory), commit and fork with memory.

The runtime's :class:`~weenv.provision.runtime._seam.MemorySnapshots` checkpoints the env's
processes into an image directory and restores them at a create; this module decides when:

- **park** (``pause(memory="park")``): the env is checkpointed into ``envs/<id>/memory/`` and its
  sandbox ends, so its memory is the node's again; its files, cgroup, network, TTL, owner, ports
  and tokens stay as a paused env's (it is ``cold`` as a ``memory=false`` pause, plus the image).
  :meth:`~._setup.EnvSetup.boot_again` (resume) restores it from the image, on this node; a
  restore that fails leaves it parked with its image.
- **commit with memory**: the env is checkpointed (its processes stop, so its files and its
  memory are one instant), its upper sealed as for a commit, and it is restored from the same
  image at once (a parked env's image is used as it is, the env stays parked). The image is
  cut into content-defined chunks, deduplicated against the images already in the embedded
  store (:class:`._memimages.MemoryImages`, :mod:`._memchunks`) and referenced from the snapshot record
  (sealed while the source is restored: both only read it). With a ``ref`` it is published with
  its packs (:mod:`._published`); another node pulls it and restores from it.
- **fork with memory**: one commit with memory, then ``n`` envs restored from its image (the
  checkpoint's own directory: no copy is written), each with its own rootfs, cgroups and id
  (:meth:`~._commit.Snapshotter.fork`). An env from a memory snapshot made earlier restores
  from a copy written out of the store's chunks (every chunk's digest checked) and removed
  once it is restored.

A checkpoint that fails leaves the env as it was (running, or frozen if it was paused).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from .._errors import ContainerError, EnvError, EnvStateError, MemorySnapshotUnavailableError
from ..cgroups import Cgroup
from ..elastic._monitor import Monitor
from ..runtime._criu import crun_memory_reason
from ..runtime._seam import MemorySnapshots, Runtime
from . import _state
from ._published import SnapshotPublishError, publish_snapshot
from ._memimages import MemoryImages, link_or_copy
from ._commit import Snapshotter
from ._snapshots import MemoryImage, SnapshotLayer, SnapshotRecord
from ._state import EnvRecord

log = logging.getLogger("weenv.daemon")

#: Where a parked env's image is, in its own directory (removed with the env).
PARKED_DIR = "memory"


class MemorySnapshotter:
    """Park, commit and fork with memory for the envs of the manager (each a callable or table of
    its: ``get``, ``env_lock``, ``cgroups``, ``limits_of`` (an env's monitor limits), ``save``;
    ``boot`` restores an env from an image directory; ``snapshotter`` seals uppers and records)."""

    def __init__(self, *, runtime: Runtime, envs_dir: str, images: MemoryImages, snapshotter: Snapshotter,
                 get: Callable[[str], EnvRecord], env_lock: Callable[[str], trio.Lock], cgroups: dict[str, Cgroup],
                 monitor: Monitor, limits_of: Callable[[EnvRecord], Any], save: Callable[[EnvRecord], None],
                 boot: Callable[[EnvRecord, str], Awaitable[None]]):
        self.runtime = runtime
        self.envs_dir = envs_dir
        self.images = images
        self._snapshotter = snapshotter
        self._get = get
        self._env_lock = env_lock
        self._cgroups = cgroups
        self._monitor = monitor
        self._limits_of = limits_of
        self._save = save
        self._boot = boot
        self.sealing: set[str] = set()  # snapshots (a fork's) whose memory image is being sealed

    async def capability(self, rec: EnvRecord) -> MemorySnapshots:
        """The env's runtime as a :class:`MemorySnapshots`; raises
        :class:`MemorySnapshotUnavailableError` (409) naming the runtime and why it cannot."""
        name = rec.lock.get("runtime") or getattr(self.runtime, "default", None) or getattr(self.runtime, "name", "crun")
        cap = await self.runtime.capability(rec.id, MemorySnapshots)
        if cap is not None:
            return cap
        why = await trio.to_thread.run_sync(crun_memory_reason) if name == "crun" else (
            f"memory snapshots need gVisor (runtime = \"gvisor\"): the {name} runtime cannot checkpoint")
        raise MemorySnapshotUnavailableError(f"runtime {name}: {why}", env_id=rec.id)

    def parked_dir(self, env_id: str) -> str:
        return os.path.join(_state.env_dir(self.envs_dir, env_id), PARKED_DIR)

    async def _checkpoint(self, rec: EnvRecord, image_dir: str) -> bool:
        """Checkpoint the running or frozen env into ``image_dir`` (made here); its sandbox ends and
        the monitor lets it go. On failure the env is as it was (frozen again if it was) and the
        directory gone. Whether it was frozen."""
        cap = await self.capability(rec)
        cg = self._cgroups[rec.id]
        await trio.to_thread.run_sync(lambda: os.makedirs(image_dir, mode=0o700))
        frozen = await trio.to_thread.run_sync(cg.is_frozen)
        if frozen:  # a frozen sandbox never answers runsc: thawed for the checkpoint
            await trio.to_thread.run_sync(cg.thaw)
        limits = self._limits_of(rec)
        self._monitor.remove(rec.id)  # the env's memory goes with its sandbox: no quota to hold meanwhile
        try:
            # unthrottled, as a boot is: the monitor halves an idle env's CPU (a quiet gVisor
            # sandbox uses ~0.15 cores, so 1 -> 0.5 cores after 2 s), and the checkpoint runs in
            # the sandbox's cgroup: the first park after 5 s of quiet took 1.2 s, 0.48 s unthrottled.
            # The monitor sets the env's limits again when it runs on.
            await trio.to_thread.run_sync(cg.set_cpu, None)
            await cap.checkpoint(rec.id, image_dir, leave_running=False)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: shutil.rmtree(image_dir, ignore_errors=True))
                try:
                    alive = (await self.runtime.state(rec.id)).status in ("running", "paused")
                except ContainerError:
                    alive = False
                if alive:  # as it was: limited, and frozen again if it was
                    self._monitor.add(rec.id, cg, limits, adopt=True)
                    if frozen:
                        await trio.to_thread.run_sync(cg.freeze)
                else:
                    rec.status, rec.error = "failed", "its checkpoint failed and its sandbox ended with it"
                    self._save(rec)
            raise
        await trio.to_thread.run_sync(cg.kill_all)  # nothing of the sandbox is left to hold memory
        rec.init_pid = 0
        return frozen

    async def park(self, env_id: str, *, only_if: Callable[[EnvRecord], bool] | None = None) -> None:
        """Checkpoint the env's memory to disk and end its sandbox (it is paused, parked); one
        parked already stays so. ``only_if(rec)``, checked under the env's lock: park only then
        (the park-after loop's deadline still stands)."""
        async with self._env_lock(env_id):
            rec = self._get(env_id)
            if rec.memory_image or (only_if is not None and not only_if(rec)):
                return
            if rec.status not in ("running", "paused") or rec.cold:
                raise EnvStateError(f"is {rec.status}{' without its memory' if rec.cold else ''}: only a running or "
                                    "paused env can be parked", env_id=env_id)
            t0 = time.perf_counter()
            image_dir = self.parked_dir(env_id)
            await trio.to_thread.run_sync(lambda: shutil.rmtree(image_dir, ignore_errors=True))  # a park cut short
            await self._checkpoint(rec, image_dir)
            rec.status, rec.cold, rec.memory_image = "paused", True, image_dir
            rec.park_at_s, rec.not_parked_because = None, ""
            rec.timings_ms["park"] = round((time.perf_counter() - t0) * 1000, 1)
            self._save(rec)
            log.info("env %s parked (%.0f ms)", env_id, rec.timings_ms["park"])

    async def commit(self, env_id: str, then: Callable[[SnapshotRecord], Awaitable[None]] | None = None, *,
                     ref: str | None = None) -> SnapshotRecord:
        """A snapshot of the env's files and memory at one instant (see the module's docstring).
        ``then(snapshot)`` is awaited as soon as it is recorded, while the source is restored
        (a fork's children start meanwhile)."""
        if ref:  # refused before any checkpoint: no half-published snapshot
            local = [g["name"] for g in self._get(env_id).lock.get("groups", []) if not g.get("registry")]
            if local:
                raise SnapshotPublishError(f"cannot publish a memory snapshot to {ref}: its plan's groups {local} live "
                                           "in this node's embedded store; publish them to a registry first", env_id=env_id)
        t0 = time.perf_counter()
        tmp = self.images.temp_dir(env_id)
        made: list[SnapshotRecord] = []
        held: list[MemoryImage] = []

        async def record(rec: EnvRecord, sealed: tuple[SnapshotLayer, bool, int], image_dir: str,
                         facts: dict[str, str]) -> None:
            if then is not None:
                return await record_forking(rec, sealed, image_dir, facts)
            memory = await trio.to_thread.run_sync(self.images.seal, image_dir, facts)
            self.images.hold(memory, image_dir)  # an env made from it meanwhile restores from it, not from a copy
            held.append(memory)
            try:
                made.append(await self._snapshotter.record(rec, *sealed, t0, memory=memory))
            finally:
                self.images.release_seal(memory)

        async def record_forking(rec: EnvRecord, sealed: tuple[SnapshotLayer, bool, int], image_dir: str,
                                 facts: dict[str, str]) -> None:
            """A fork's: the snapshot is recorded at once and the children restore from the
            checkpoint directory while its image is sealed (the seal is ~1 s of CPU for 100 MiB:
            off their path); its memory is recorded once sealed. Until then, an env from it
            is refused (:attr:`sealing`); if the seal fails, the fork is undone."""
            snap = await self._snapshotter.record(rec, *sealed, t0)
            made.append(snap)
            self.sealing.add(snap.id)
            sealed_memory: list[MemoryImage] = []
            seal_errors: list[Exception] = []

            async def seal() -> None:
                try:
                    sealed_memory.append(await trio.to_thread.run_sync(self.images.seal, image_dir, facts))
                except Exception as e:  # kept: the children's starts must not be cancelled half-way
                    seal_errors.append(e)

            try:
                try:
                    async with trio.open_nursery() as n:
                        n.start_soon(seal)
                        assert then is not None
                        await then(snap, image_dir)
                except BaseExceptionGroup as eg:
                    raise (eg.exceptions[0] if len(eg.exceptions) == 1 else eg) from None
                if seal_errors:
                    raise EnvError(f"its memory image could not be sealed: {seal_errors[0]}",
                                   env_id=rec.id) from seal_errors[0]
                snap.memory = sealed_memory[0]
                self._snapshotter.records.save(snap)
            except BaseException:
                with trio.CancelScope(shield=True):
                    for m in sealed_memory:  # sealed for a snapshot that is undone
                        await trio.to_thread.run_sync(self._snapshotter.discard_memory, m)
                raise
            finally:
                self.sealing.discard(snap.id)
                for m in sealed_memory:
                    self.images.release_seal(m)

        try:
            async with self._env_lock(env_id):
                rec = self._get(env_id)
                if not rec.memory_image and (rec.status not in ("running", "paused") or rec.cold):
                    raise EnvStateError(f"is {rec.status}{' without its memory' if rec.cold else ''}: a memory "
                                        "snapshot needs a running, paused or parked env", env_id=env_id)
                cap = await self.capability(rec)
                facts = await trio.to_thread.run_sync(cap.image_facts)
                if rec.memory_image:  # parked: its image is that instant already, and the env stays parked
                    sealed = await self._snapshotter.seal_upper(env_id, freeze=False)
                    await record(rec, sealed, rec.memory_image, facts)
                else:
                    frozen = await self._checkpoint(rec, tmp)
                    try:
                        sealed = await self._snapshotter.seal_upper(env_id, freeze=False)
                    except BaseException:
                        with trio.CancelScope(shield=True):
                            await self._restore_source(rec, tmp, frozen)
                        raise
                    await self._restore_alongside(rec, tmp, frozen, lambda: record(rec, sealed, tmp, facts))
        finally:
            for memory in held:
                self.images.release(memory)
            if os.path.lexists(tmp):
                await trio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))
        if ref:
            await self.publish(made[0], ref)
        return made[0]

    async def publish(self, snap: SnapshotRecord, ref: str) -> None:
        """Push the snapshot, its memory packs with it, to ``ref`` (:mod:`._published`): a node
        that pulls it restores its processes."""
        store = self._snapshotter.layout()
        out = await trio.to_thread.run_sync(lambda: publish_snapshot(
            snap.id, snap.lock, [msgspec.to_builtins(x) for x in snap.layers],
            msgspec.to_builtins(snap.memory) if snap.memory is not None else None, ref, store=store,
            source=f"weenv commit --memory {snap.source_env}"))
        snap.ref = out["ref"]
        self._snapshotter.records.save(snap)
        log.info("snapshot %s published with its memory to %s", snap.id, ref)

    async def _restore_alongside(self, rec: EnvRecord, image_dir: str, frozen: bool,
                                 work: Callable[[], Awaitable[None]]) -> None:
        """The source env restored from its image while ``work`` runs (the image sealed, a fork's
        children started: they only read the image): the source is back as soon as runsc allows."""
        try:
            async with trio.open_nursery() as n:
                n.start_soon(work)
                with trio.CancelScope(shield=True):  # the source must come back (or be parked) whatever happens
                    await self._restore_source(rec, image_dir, frozen)
        except BaseExceptionGroup as eg:  # the nursery's group of one: its error, said plainly
            raise (eg.exceptions[0] if len(eg.exceptions) == 1 else eg) from None

    async def _restore_source(self, rec: EnvRecord, image_dir: str, frozen: bool) -> None:
        """The env a commit checkpointed, restored from its image (frozen again if it was); a
        restore that fails parks it with a copy of the image instead (raised after)."""
        try:
            await self._boot(rec, image_dir)
        except Exception as e:
            parked = self.parked_dir(rec.id)
            await trio.to_thread.run_sync(lambda: shutil.copytree(image_dir, parked, copy_function=link_or_copy))
            rec.status, rec.cold, rec.memory_image, rec.error = "paused", True, parked, f"restore failed: {e}"
            self._save(rec)
            raise EnvError(f"checkpointed, but restoring it failed: it is parked with its image (resume retries): {e}",
                           env_id=rec.id) from e
        if frozen:
            await trio.to_thread.run_sync(self._cgroups[rec.id].freeze)
            rec.status = "paused"
            self._save(rec)

    def finish_resume(self, rec: EnvRecord) -> None:
        """A parked env restored: its image is not needed any more. Blocking."""
        if rec.memory_image:
            shutil.rmtree(rec.memory_image, ignore_errors=True)
            rec.memory_image = ""
            rec.error = ""
