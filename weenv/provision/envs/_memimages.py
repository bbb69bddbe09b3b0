"""The node's store of memory-snapshot images (:class:`MemoryImages`): a checkpoint image cut into
content-defined chunks (:mod:`._memchunks`), deduplicated against the images already in the
embedded store, packed as weenv layers and referenced by digest; checked out again into a
directory (every chunk's digest checked) for a restore, and collected when no snapshot holds it.
:mod:`._memory` decides when an env is checkpointed and restored."""

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
from collections.abc import Callable, Iterator

from ... import layerfmt
from ...layerfmt._source import SpoolOpener
from ...registry import LayoutStore
from .._errors import EnvError
from . import _memchunks
from ._snapshots import MemoryImage, SnapshotLayer

log = logging.getLogger("weenv.daemon")


def link_or_copy(src: str, dst: str) -> None:
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
