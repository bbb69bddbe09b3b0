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
  store (:class:`MemoryImages`, :mod:`._memchunks`) and referenced from the snapshot record
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

import collections
import contextlib
import io
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec
import trio

from ... import layerfmt
from ...layerfmt._source import SpoolOpener
from ...registry import LayoutStore
from .._errors import ContainerError, EnvError, EnvStateError, MemorySnapshotUnavailableError
from ..cgroups import Cgroup
from ..elastic._monitor import Monitor
from ..runtime._criu import crun_memory_reason
from ..runtime._seam import MemorySnapshots, Runtime
from . import _memchunks, _state
from ._published import SnapshotPublishError, publish_snapshot
from ._commit import Snapshotter
from ._snapshots import MemoryImage, SnapshotLayer, SnapshotRecord
from ._state import EnvRecord

log = logging.getLogger("weenv.daemon")

#: Where a parked env's image is, in its own directory (removed with the env).
PARKED_DIR = "memory"


def _link_or_copy(src: str, dst: str) -> None:
    """Images are never written once made: a hard link is a copy (a real one across filesystems)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class MemoryImageError(EnvError):
    """A memory snapshot's image cannot be made whole: a blob of it is missing, or a chunk is
    missing or corrupt. Nothing is changed: the snapshot stays as it is."""


#: In a pack: the image's recipe, and each chunk as a file named by its sha256.
RECIPE_PATH = "recipe.json"
CHUNK_DIR = "c"


class MemoryImages:
    """Checkpoint images of this node, in the embedded store (``layout()``) as deduplicated
    chunks (:mod:`._memchunks`): an image's own blob is a pack (a layerfmt layer) of its
    recipe and of the chunks that no pack of ``known()`` (the images of this node's
    snapshots) holds yet; the others are read from those packs. ``root`` holds images being
    written, sealed or restored from (a directory per image in use, removed after), and the
    directories of images made before chunking (``root/<digest key>/``)."""

    def __init__(self, root: str, layout: Callable[[], LayoutStore],
                 known: Callable[[], list[MemoryImage]] = lambda: []):
        self.root = root
        self._layout = layout
        self._known = known
        self._lock = threading.Lock()
        self._index: dict[bytes, SnapshotLayer] = {}  # chunk sha256 -> a pack holding it
        self._indexed: dict[str, tuple[SnapshotLayer, list[bytes]]] = {}  # pack digest -> it, its chunks
        self._pins: collections.Counter[str] = collections.Counter()  # packs a seal uses, not recorded yet
        self._live: dict[str, list] = {}  # image digest -> [directory, users, ours to remove]
        self._making: dict[str, threading.Lock] = {}
        os.makedirs(root, mode=0o700, exist_ok=True)

    def temp_dir(self, env_id: str) -> str:
        return os.path.join(self.root, f".ckpt-{env_id}-{secrets.token_hex(4)}")

    def path(self, digest: str) -> str:
        return os.path.join(self.root, digest.replace(":", "-"))

    # ---------------------------------------------------------------- sealing

    def _index_packs(self) -> None:
        """The chunk index, for the packs of the images known now (under ``_lock``)."""
        store = self._layout()
        live = {b.digest: b for m in self._known() if m.chunked for b in m.blobs()}  # a deleted image's pack
        gone = set(self._indexed) - set(live) - set(self._pins)
        if gone:  # its blob is deleted: the index again from the packs left
            self._indexed = {k: v for k, v in self._indexed.items() if k not in gone}
            self._index = {d: pack for pack, chunks in self._packs_of().items() for d in chunks}
        for digest, m in live.items():  # (a pack kept for the images reading from it) is indexed too
            if digest in self._indexed or not os.path.exists(store.blob_path(digest)):
                continue
            pack = m
            try:
                with contextlib.closing(layerfmt.FileReader.open(store.blob_path(digest))) as reader:
                    layer = layerfmt.Layer.open(reader, expected_toc_digest=m.toc_digest)
                    chunks = [bytes.fromhex(e.path.rsplit("/", 1)[1]) for e in layer.entries
                              if e.type == "file" and e.path.startswith(CHUNK_DIR + "/")]
            except (OSError, ValueError, layerfmt.LayerError) as e:
                log.warning("memory pack %s unreadable, not deduplicated against: %s", digest, e)
                continue
            self._indexed[digest] = (pack, chunks)
            for d in chunks:
                self._index.setdefault(d, pack)

    def _packs_of(self) -> dict[SnapshotLayer, list[bytes]]:
        return dict(self._indexed.values())

    def seal(self, image_dir: str, facts: dict[str, str]) -> MemoryImage:
        """Seal ``image_dir`` into the store as a pack of its new chunks (see the class). The
        packs it shares chunks with stay pinned (:meth:`pinned`) until :meth:`unpin`: call it
        once the snapshot naming them is recorded. Blocking."""
        store = self._layout()
        with self._lock:
            self._index_packs()
            index = dict(self._index)
        spool_path = os.path.join(self.root, f".spool-{secrets.token_hex(4)}")
        tmp = os.path.join(store.root, "blobs", "sha256", f".commit-memory-{secrets.token_hex(4)}")
        shared: dict[str, SnapshotLayer] = {}
        new: dict[bytes, tuple[int, int]] = {}
        files: list[_memchunks.ImageFile] = []
        image_bytes = 0
        spool = os.open(spool_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.unlink(spool_path)  # read through its descriptor only
            offset = 0
            for name in sorted(os.listdir(image_dir)):
                path = os.path.join(image_dir, name)
                if not os.path.isfile(path) or os.path.islink(path):
                    raise EnvError(f"checkpoint image {image_dir}: {name} is not a regular file")
                image_bytes += os.path.getsize(path)
                for raw in (False, True):
                    mark, chunks = offset, []
                    try:
                        with open(path, "rb") as f:
                            info, it = _memchunks.iter_chunks(f, raw=raw)
                            for digest, data in it:
                                chunks.append((digest.hex(), len(data)))
                                if digest in index:
                                    shared.setdefault(index[digest].digest, index[digest])
                                elif digest not in new:
                                    os.pwrite(spool, data, offset)
                                    new[digest] = (offset, len(data))
                                    offset += len(data)
                    except _memchunks.ImageFormatError:
                        if raw:
                            raise
                        for d in [d for d, (off, _) in new.items() if off >= mark]:
                            del new[d]  # cut again as it is
                        offset = mark
                        continue
                    files.append(_memchunks.ImageFile(name=name, chunks=chunks, **info))
                    break
            recipe = _memchunks.encode_recipe(_memchunks.Recipe(files=files))
            entries = [layerfmt.SourceEntry(path=".", type="dir", mode=0o755),
                       layerfmt.SourceEntry(path=CHUNK_DIR, type="dir", mode=0o755),
                       layerfmt.SourceEntry(path=RECIPE_PATH, type="file", size=len(recipe),
                                            opener=lambda: io.BytesIO(recipe))]
            entries += [layerfmt.SourceEntry(path=f"{CHUNK_DIR}/{d.hex()}", type="file", size=n,
                                             opener=SpoolOpener(spool, off, n)) for d, (off, n) in new.items()]
            with self._lock:
                self._pins.update(list(shared))
            try:
                with open(tmp, "wb") as f:
                    res = layerfmt.build_entries(entries, f, level=1)
                final = store.blob_path(res.digest)
                if os.path.exists(final):
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
            except BaseException:
                self.unpin(list(shared))
                raise
        finally:
            os.close(spool)
            if os.path.exists(tmp):
                os.unlink(tmp)
        image = MemoryImage(digest=res.digest, size=res.size, toc_digest=res.toc_digest, image_bytes=image_bytes,
                            facts=facts, chunked=True, packs=sorted(shared.values(), key=lambda p: p.digest))
        with self._lock:
            own = SnapshotLayer(digest=res.digest, size=res.size, toc_digest=res.toc_digest)
            self._indexed[res.digest] = (own, list(new))
            for d in new:
                self._index.setdefault(d, own)
            self._pins[res.digest] += 1
        return image

    def unpin(self, packs: list[str]) -> None:
        with self._lock:
            self._pins.subtract(packs)
            self._pins += collections.Counter()  # drop the ones at zero

    def release_seal(self, image: MemoryImage) -> None:
        """The snapshot naming ``image`` is recorded (or given up): its packs need no pin any more."""
        self.unpin([b.digest for b in image.blobs()])

    def pinned(self) -> set[str]:
        """Packs a seal in progress uses: not to be deleted even if no snapshot names them yet."""
        with self._lock:
            return set(self._pins)

    # ---------------------------------------------------------------- restoring

    def hold(self, image: MemoryImage, directory: str) -> None:
        """``directory`` holds ``image`` (the checkpoint a commit just made): restores of it use
        it rather than writing another copy, until :meth:`release` (which leaves it in place)."""
        with self._lock:
            self._live.setdefault(image.digest, [directory, 0, False])[1] += 1

    def checkout(self, image: MemoryImage) -> str:
        """The directory of ``image`` for a restore, written out of the store if no restore or
        commit has it now; :meth:`release` it after. Raises :class:`MemoryImageError` when a
        blob or chunk of it is missing or corrupt. Blocking."""
        if not image.chunked:
            return self._ensure_files(image)
        with self._lock:
            making = self._making.setdefault(image.digest, threading.Lock())
        with making:  # concurrent restores of one image (a fork's children) write it once
            with self._lock:
                live = self._live.get(image.digest)
                if live is not None:
                    live[1] += 1
                    return live[0]
            directory = self.temp_dir("restore")
            os.mkdir(directory, 0o700)
            try:
                self._assemble(image, directory)
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            with self._lock:
                self._live[image.digest] = [directory, 1, True]
            return directory

    def release(self, image: MemoryImage) -> None:
        """One use of :meth:`checkout` or :meth:`hold` is over; the last one removes a written-out copy."""
        if not image.chunked:
            return
        with self._lock:
            live = self._live.get(image.digest)
            if live is None:
                return
            live[1] -= 1
            if live[1] > 0:
                return
            del self._live[image.digest]
        if live[2]:
            shutil.rmtree(live[0], ignore_errors=True)

    def _assemble(self, image: MemoryImage, directory: str) -> None:
        """Write ``image``'s files into ``directory`` from its packs, every chunk verified."""
        store = self._layout()
        readers = []
        try:
            where: dict[bytes, tuple[layerfmt.Layer, str, str]] = {}
            own = None
            for blob in image.blobs():
                path = store.blob_path(blob.digest)
                if not os.path.exists(path):
                    raise MemoryImageError(f"memory image {image.digest}: its pack {blob.digest} is not in this "
                                           "node's store")
                readers.append(layerfmt.FileReader.open(path))
                try:
                    layer = layerfmt.Layer.open(readers[-1], expected_toc_digest=blob.toc_digest)
                except layerfmt.LayerError as e:
                    raise MemoryImageError(f"memory image {image.digest}: its pack {blob.digest} is unreadable: {e}"
                                           ) from None
                own = layer if own is None else own
                for e in layer.entries:
                    if e.type == "file" and e.path.startswith(CHUNK_DIR + "/"):
                        where.setdefault(bytes.fromhex(e.path.rsplit("/", 1)[1]), (layer, e.path, blob.digest))
            try:
                recipe = _memchunks.decode_recipe(own.read(RECIPE_PATH))
            except (layerfmt.LayerError, _memchunks.ImageFormatError) as e:
                raise MemoryImageError(f"memory image {image.digest}: its recipe is unreadable: {e}") from None

            def chunks(f: _memchunks.ImageFile) -> Iterator[bytes]:
                for pos, (hexd, n) in enumerate(f.chunks):
                    at = where.get(bytes.fromhex(hexd))
                    if at is None:
                        raise MemoryImageError(f"memory image {image.digest}: chunk {pos} of {f.name} (sha256 {hexd}, "
                                               f"{n} bytes) is in none of its packs")
                    try:
                        data = at[0].read(at[1])
                    except layerfmt.LayerError as e:
                        raise MemoryImageError(f"memory image {image.digest}: chunk {pos} of {f.name} (sha256 "
                                               f"{hexd}) is corrupt in its pack {at[2]}: {e}") from None
                    if len(data) != n:
                        raise MemoryImageError(f"memory image {image.digest}: chunk {pos} of {f.name} holds "
                                               f"{len(data)} bytes, its recipe says {n}")
                    yield data

            for f in recipe.files:
                if "/" in f.name or f.name in ("", ".", ".."):
                    raise MemoryImageError(f"memory image {image.digest}: bad file name {f.name!r} in its recipe")
                with open(os.path.join(directory, f.name), "wb") as out:
                    _memchunks.write_image_file(out, f, chunks(f))
        finally:
            for r in readers:
                r.close()

    def _ensure_files(self, image: MemoryImage) -> str:
        """An image made before chunking: its directory, written out of its blob (its files) if not here."""
        final = self.path(image.digest)
        if os.path.isdir(final):
            return final
        blob = self._layout().blob_path(image.digest)
        if not os.path.exists(blob):
            raise MemoryImageError(f"the memory image {image.digest} is neither here nor in the store")
        tmp = self.temp_dir("extract")
        os.mkdir(tmp, 0o700)
        reader = layerfmt.FileReader.open(blob)
        try:
            layer = layerfmt.Layer.open(reader, expected_toc_digest=image.toc_digest)
            for entry in layer.entries:
                if entry.type == "file" and "/" not in entry.path.strip("/"):
                    with open(os.path.join(tmp, os.path.basename(entry.path)), "wb") as out:
                        for part in layer.iter_read(entry.path):
                            out.write(part)
            os.rename(tmp, final)
        finally:
            reader.close()
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def discard(self, digest: str) -> None:
        shutil.rmtree(self.path(digest), ignore_errors=True)

    def gc(self, keep: set[str]) -> list[str]:
        """Remove the images (and temporaries cut short) whose digest is not in ``keep``."""
        keep_names = {os.path.basename(self.path(d)) for d in keep}
        removed = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith(".") and time.time() - os.lstat(path).st_mtime < 3600:
                continue  # a checkpoint being written or sealed now
            if name not in keep_names:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                removed.append(name)
        return removed


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
            await trio.to_thread.run_sync(lambda: shutil.copytree(image_dir, parked, copy_function=_link_or_copy))
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
