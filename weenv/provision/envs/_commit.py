"""Commit, fork and snapshot removal: an env's upper sealed into a layer of the embedded store.

A commit freezes the env (a paused env stays frozen), seals its upper into a layer blob in the
embedded store while ``cp -a`` copies the same upper as a snapshot tree, thaws, and records a
:class:`SnapshotRecord` of the env's layers plus the new one; the new layer's chunks then go to
the envlet's disk cache in the background (not needed when the tree was made). A fork is one
commit and ``n`` envs started from it, all or none. A snapshot's blobs are deleted with it unless
another snapshot, a live env or a published tag still uses them; gc collects fork snapshots no env
uses any more and the temporary files of commits cut short.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable

from typing import Any

import msgspec
import trio

from ... import _home, layerfmt
from ...envlet import EnvletClient, EnvletError, StoreSpec
from ...registry import LayoutStore
from .._errors import AdmissionError, EnvError, EnvStartError, EnvStateError
from ..cgroups import Cgroup
from ..elastic._monitor import Monitor
from ..runtime._idmap import DeviceNodeInTreeError, IdMap, make_tree_inert
from . import _state
from ._snapshots import (MemoryImage, SnapshotLayer, SnapshotNotFoundError, SnapshotRecord, SnapshotStore, SnapshotTrees,
                         new_snapshot_id)
from ._state import EnvRecord

log = logging.getLogger("weenv.daemon")


class Snapshotter:
    """Commits and forks the envs in ``envs`` (looked up with ``get``, each under its ``env_lock``,
    frozen through its cgroup in ``cgroups``) into ``records`` and ``trees``; a fork starts its
    children with ``start`` (a snapshot id, and ``restricted`` as the parent is: an env) and kills
    them with ``kill`` if one fails. ``spawn`` runs the cache warming in the background (False: it
    is awaited)."""

    def __init__(self, *, records: SnapshotStore, trees: SnapshotTrees, envs_dir: str, envs: dict[str, EnvRecord],
                 cgroups: dict[str, Cgroup], get: Callable[[str], EnvRecord], env_lock: Callable[[str], trio.Lock],
                 envlet: EnvletClient, monitor: Monitor, idmap: IdMap | None, spawn: Callable[..., bool],
                 start: Callable[..., Awaitable[EnvRecord]], kill: Callable[[str], Awaitable[None]]):
        self.records = records
        self.trees = trees
        self._envs_dir = envs_dir
        self._envs = envs
        self._cgroups = cgroups
        self._get = get
        self._env_lock = env_lock
        self._envlet = envlet
        self._monitor = monitor
        self._idmap = idmap
        self._spawn = spawn
        self._start = start
        self._kill = kill
        self._store: LayoutStore | None = None  # opened at first use: $WEENV_HOME is read then
        self.forking: set[str] = set()  # fork snapshots whose children are being started (gc keeps them)
        self.memory_images: Any = None  # :class:`._memimages.MemoryImages`: a memory snapshot's image goes with it

    def layout(self) -> LayoutStore:
        """The embedded store the snapshot layers go to."""
        if self._store is None:
            self._store = LayoutStore(_home.store_dir())
        return self._store

    async def commit(self, env_id: str, *, ref: str | None = None, build_key: str | None = None) -> SnapshotRecord:
        """Freeze the env, seal its upper into a layer in the embedded store, thaw; record a snapshot."""
        t0 = time.perf_counter()
        async with self._env_lock(env_id):
            rec = self._get(env_id)
            if rec.status not in ("running", "paused"):
                raise EnvStateError(f"is {rec.status}", env_id=env_id)
            layer, copied, diff_bytes = await self.seal_upper(env_id, freeze=rec.status == "running")
        return await self.record(rec, layer, copied, diff_bytes, t0, ref=ref, build_key=build_key)

    async def seal_upper(self, env_id: str, *, freeze: bool) -> tuple[SnapshotLayer, bool, int]:
        """Seal the env's upper into a layer blob of the embedded store (frozen meanwhile if
        ``freeze``), copied as a snapshot tree too; (the layer, whether the tree was made, its
        content bytes). The caller holds the env's lock."""
        cg = self._cgroups[env_id]
        froze = freeze
        store = self.layout()
        upper = os.path.join(_state.upper_mount(self._envs_dir, env_id), "upper")
        tmp = os.path.join(store.root, "blobs", "sha256", f".commit-{env_id}-{secrets.token_hex(4)}")
        id_base = self._idmap.base if self._idmap is not None else 0

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

        tree_tmp = self.trees.temp_path(env_id)
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

        self.trees.in_progress.update((tree_tmp, tmp))  # gc leaves both alone meanwhile
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
            tree = self.trees.path(res.digest)
            if copied:
                copied = await trio.to_thread.run_sync(self.trees.install, tree_tmp, tree)
        finally:
            self.trees.in_progress.difference_update((tree_tmp, tmp))
            if os.path.lexists(tree_tmp):
                await trio.to_thread.run_sync(lambda: shutil.rmtree(tree_tmp, ignore_errors=True))
        return SnapshotLayer(digest=res.digest, size=res.size, toc_digest=res.toc_digest), copied, res.content_bytes

    async def record(self, rec: EnvRecord, layer: SnapshotLayer, copied: bool, diff_bytes: int, t0: float, *,
                     ref: str | None = None, build_key: str | None = None,
                     memory: MemoryImage | None = None) -> SnapshotRecord:
        """Record the snapshot of ``rec`` whose newest layer is ``layer`` (and ``memory``), warm
        the envlet's cache with it unless its tree was made, publish it to ``ref``."""
        env_id = rec.id
        store = self.layout()
        parents = [msgspec.convert(x, SnapshotLayer) for x in rec.snapshot_layers]
        snap = SnapshotRecord(id=new_snapshot_id(), source_env=env_id, lock=rec.lock, layers=[*parents, layer],
                              build_key=build_key, diff_bytes=diff_bytes, memory=memory,
                              cpu_quota_cores=self._monitor.cpu_quota(env_id))
        self.records.save(snap)

        def warm() -> None:  # the new layer's chunks go to the node's disk cache at once
            info = self._envlet.register(StoreSpec("layout", path=store.root), layer.digest, layer.size,
                                         layer.toc_digest, warm=True)
            self._envlet.unregister(info.name)

        async def warm_in_background() -> None:
            try:
                await trio.to_thread.run_sync(warm)
            except EnvletError as e:
                log.warning("snapshot %s: could not warm the envlet cache: %s", snap.id, e)

        if copied:
            pass  # envs from it use the directory: nothing to cache
        elif not self._spawn(warm_in_background):  # spawned: the caller has its snapshot, the cache fills meanwhile
            await warm_in_background()
        if ref:
            from ...registry import publish_layer_file

            await trio.to_thread.run_sync(lambda: publish_layer_file(
                store.blob_path(layer.digest), ref, group="snapshot", group_class="task", digest=layer.digest,
                source=f"weenv commit {env_id}"))
            snap.ref = ref
            self.records.save(snap)
        log.info("env %s committed as %s (%d bytes of diff, %.0f ms)", env_id, snap.id, snap.diff_bytes,
                 (time.perf_counter() - t0) * 1000)
        return snap

    async def fork(self, env_id: str, n: int, *, commit: Callable[..., Awaitable[SnapshotRecord]] | None = None
                   ) -> tuple[SnapshotRecord, list[EnvRecord]]:
        """Commit once, start ``n`` children from that state; all or none (a failure kills the
        started ones). ``commit``: another commit (a memory snapshot's, :mod:`._memory`), called
        as ``commit(env_id, then)``: it awaits ``then(snapshot)`` once the snapshot is recorded
        (the children start while it finishes the rest: the source's restore)."""
        if not 1 <= n <= 1024:
            raise EnvStateError(f"fork needs 1 <= n <= 1024, got {n}", env_id=env_id)
        if commit is None:
            snap = await self.commit(env_id)
            return snap, await self.start_children(env_id, snap, n)
        started: list[list[EnvRecord]] = []

        async def then(snap: SnapshotRecord, restore_from: str | None = None) -> None:
            started.append(await self.start_children(env_id, snap, n, restore_from=restore_from))

        try:
            snap = await commit(env_id, then)
        except BaseException:
            if started:  # the children are up but the commit failed after (its image's seal): all or none
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as nursery:
                        for child in started[0]:
                            nursery.start_soon(self._kill, child.id)
                    try:
                        self.delete(started[0][0].snapshot or "")
                    except Exception as e:
                        log.warning("fork of %s failed; its snapshot stays until gc: %s", env_id, e)
            raise
        return snap, started[0]

    async def start_children(self, env_id: str, snap: SnapshotRecord, n: int, *, restore_from: str | None = None
                             ) -> list[EnvRecord]:
        """``n`` envs from ``snap`` (a fork's: gc collects it with them), all or none
        (``restore_from``: the checkpoint directory they restore from, see :mod:`._memory`)."""
        restricted = self._get(env_id).restricted  # a tenant's env has a tenant's children
        snap.fork = True  # nobody asked for this snapshot: gc collects it when its children are gone
        self.records.save(snap)
        children: list[EnvRecord] = []
        errors: list[BaseException] = []

        async def one() -> None:
            try:
                kw = {"restore_from": restore_from} if restore_from is not None else {}
                children.append(await self._start(snap.id, restricted=restricted, **kw))
            except Exception as e:  # collected: the others keep going, then all are undone
                errors.append(e)

        self.forking.add(snap.id)
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(one)
        finally:
            self.forking.discard(snap.id)
        if errors:
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as nursery:
                    for child in children:
                        nursery.start_soon(self._kill, child.id)
            try:  # all or none: a refused fork leaves no snapshot behind either (was: until a gc)
                self.delete(snap.id)
            except Exception as e:
                log.warning("fork of %s failed; its snapshot %s stays until gc: %s", env_id, snap.id, e)
            # a node too full for the children is a refusal to retry later (503), not a failed start (500)
            cls = AdmissionError if all(isinstance(e, AdmissionError) for e in errors) else EnvStartError
            raise cls(f"fork of {n}: {len(errors)} children failed to start: {errors[0]}", env_id=env_id)
        return children

    def delete(self, snap_id: str) -> list[str]:
        """Remove the record, and its layer blobs unless another snapshot, a live env or a tag uses them."""
        rec = self.records.delete(snap_id)
        used: set[str] = set()
        for other in self.records.list():
            used.update(layer.digest for layer in other.layers)
            if other.memory is not None:
                used.update(b.digest for b in other.memory.blobs())
        for env in self._envs.values():
            used.update(x["digest"] for x in env.snapshot_layers)
        store = self.layout()
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
                self.trees.discard(self.trees.path(layer.digest))
            if layer.digest not in used and layer.digest not in tagged:
                try:
                    os.unlink(store.blob_path(layer.digest))
                    removed.append(layer.digest)
                except FileNotFoundError:
                    pass
        if rec.memory is not None:  # its checkpoint image (no tag holds one), and its packs no other image reads
            if self.memory_images is not None:
                used |= self.memory_images.pinned()
                if rec.memory.digest not in used:
                    self.memory_images.discard(rec.memory.digest)
            for blob in rec.memory.blobs():
                if blob.digest in used:
                    continue
                try:
                    os.unlink(store.blob_path(blob.digest))
                    removed.append(blob.digest)
                except FileNotFoundError:
                    pass
        return removed

    def discard_memory(self, memory: MemoryImage) -> list[str]:
        """Remove the blobs of an image no snapshot recorded (a fork undone while it was sealed)
        that no recorded image uses."""
        used = {b.digest for r in self.records.list() if r.memory is not None for b in r.memory.blobs()}
        if self.memory_images is not None:
            used |= self.memory_images.pinned() - {memory.digest}
        removed = []
        for blob in memory.blobs():
            if blob.digest not in used:
                try:
                    os.unlink(self.layout().blob_path(blob.digest))
                    removed.append(blob.digest)
                except FileNotFoundError:
                    pass
        return removed

    # ------------------------------------------------------------------ gc

    def gc_forks(self) -> list[str]:
        """Delete the snapshots made by fork that no env started from any more (commit and build
        snapshots stay until deleted); their ids."""
        wanted = {rec.snapshot for rec in self._envs.values()} | self.forking
        removed = []
        for snap in self.records.list():
            if snap.fork and snap.id not in wanted:
                try:
                    self.delete(snap.id)
                except SnapshotNotFoundError:
                    continue  # deleted meanwhile
                removed.append(snap.id)
        return removed

    async def gc_trees(self) -> list[str]:
        """Remove the snapshot trees that no snapshot and no live env uses; their names."""
        used = {self.trees.path(layer.digest) for snap in self.records.list() for layer in snap.layers}
        used |= {self.trees.path(x["digest"]) for env in self._envs.values() for x in env.snapshot_layers}
        return await trio.to_thread.run_sync(self.trees.gc, used | self.trees.in_progress)

    def gc_commit_temps(self) -> list[str]:
        """Remove the store's ``.commit-*`` files of commits cut short (a daemon killed mid-commit)."""
        blobs = os.path.join(self.layout().root, "blobs", "sha256")
        removed = []
        for name in os.listdir(blobs) if os.path.isdir(blobs) else ():
            path = os.path.join(blobs, name)
            if name.startswith(".commit-") and path not in self.trees.in_progress:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                removed.append(name)
        return removed
