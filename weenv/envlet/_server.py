"""The envlet process: one FUSE mount per node, layers registered at run time over a control socket.

    weenv envlet serve --mountpoint DIR --cache-dir DIR --cache-size BYTES --memory-cache-size BYTES

State (the registered layers, their slots and reference counts) is written to a state file after
every change, so a restarted envlet clears the stale mount its predecessor left and brings the
same layers back under the same names.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pyfuse3
import trio

from .. import layerfmt
from .._atomic import atomic_write, atomic_writer
from .._unixsock import bind_unix
from ..layerfmt import RandomAccessReader
from ._control import (
    MAX_MESSAGE_BYTES,
    Extract,
    LayerInfo,
    ListLayers,
    PeerServing,
    Ping,
    Prune,
    Register,
    Reply,
    SetPeers,
    Stats,
    StoreSpec,
    Trace,
    Unregister,
    _LEN,
    encoder,
    request_decoder,
)
from ._extract import extract_layer
from ._fair import MAX_FUSE_TASKS, EnvResolver, FairShare
from ._fetch import Fetcher, LayerSource
from ._tier import DEFAULT_TIERS, TierConfig, TierConfigError, load_tiers
from ._fs import ROOT_TIMEOUT_S, EnvletFS
from ._metrics import Metrics, start_prometheus
from ._peer_server import PeerServer
from ._tier_peer import PeerOptions
from . import _wake
from ._tree import LayerTree

log = logging.getLogger("weenv.envlet")
NAME_LEN = 12
_FORGET_BOUND_S = 10.0  # how long an unregister waits for the kernel to drop the layer's root entry


@dataclass
class MountedLayer:
    name: str
    slot: int
    spec: StoreSpec
    repo: str
    digest: str
    size: int
    toc_digest: str
    layer: layerfmt.Layer
    tree: LayerTree
    source: LayerSource
    refcount: int = 1
    prefetched_bytes: int = 0
    first_reads: dict[int, None] = field(default_factory=dict)  # entry indices in first-read order

    def note_read(self, i: int) -> None:
        if i not in self.first_reads and len(self.first_reads) < 1_000_000:
            self.first_reads[i] = None

    def info(self, mountpoint: str) -> LayerInfo:
        return LayerInfo(self.name, os.path.join(mountpoint, self.name), self.digest, self.toc_digest, self.size,
                         self.refcount, len(self.tree.cols), self.layer.prefetch_end)


class _RecordingReader:
    """Remembers what Layer.open read, so the tail can be cached without fetching it twice."""

    def __init__(self, inner: RandomAccessReader):
        self.inner = inner
        self.reads: list[tuple[int, bytes]] = []

    @property
    def size(self) -> int:
        return self.inner.size

    def read_at(self, offset: int, n: int) -> bytes:
        data = self.inner.read_at(offset, n)
        self.reads.append((offset, data))
        return data

    def range(self, start: int, end: int) -> bytes | None:
        for off, data in self.reads:
            if off <= start and off + len(data) >= end:
                return data[start - off : end - off]
        return None


class _TailCachedReader:
    """Serves the cached tail of a blob from disk, everything else from the store."""

    def __init__(self, inner: RandomAccessReader, tail: bytes):
        self.inner, self.tail = inner, tail
        self._tail_start = inner.size - len(tail)

    @property
    def size(self) -> int:
        return self.inner.size

    def read_at(self, offset: int, n: int) -> bytes:
        if offset >= self._tail_start:
            return self.tail[offset - self._tail_start : offset - self._tail_start + n]
        return self.inner.read_at(offset, n)


class Envlet:
    """Registrations, caches and the fetcher behind one FUSE mount."""

    def __init__(self, mountpoint: str, cache_dir: str, *, cache_size_bytes: int, memory_cache_size_bytes: int,
                 control_socket: str, state_file: str | None = None, deadline_s: float = 30.0,
                 readahead_bytes: int = 4 << 20, neighbor_bytes: int = 64 << 10, max_concurrent_fetches: int = 8,
                 tiers: str | Sequence[str] = DEFAULT_TIERS, tier_options: dict[str, str] | None = None,
                 id_base: int = 0, fair: bool = True, fair_share_cores: float = 0.2, env_cgroup: str = "weenv"):
        self.mountpoint = os.path.abspath(mountpoint)
        # files are shown (and layer trees written) owned by the host ids of the envs' user
        # namespace, whose root is host uid id_base (0: none; docs/security.md, "User namespaces")
        self.id_base = id_base
        self.cache_dir = os.path.abspath(cache_dir)
        self.control_socket = control_socket
        self.state_file = state_file or os.path.join(self.cache_dir, "envlet-state.json")
        self.readahead_bytes = readahead_bytes
        self.neighbor_bytes = neighbor_bytes
        self.metrics = Metrics()
        self._fuse_live = False  # pyfuse3 is mounted and serving: kernel notices can be sent
        self.fair = FairShare(enabled=fair, share_cores=fair_share_cores, resolver=EnvResolver(env_cgroup))
        self.deadline_s = deadline_s
        config = TierConfig(self.metrics, cache_dir=self.cache_dir, cache_size_bytes=cache_size_bytes,
                            memory_cache_size_bytes=memory_cache_size_bytes,
                            max_concurrent_fetches=max_concurrent_fetches, options=dict(tier_options or {}))
        self.fetcher = Fetcher(load_tiers(tiers, config), self.metrics, deadline_s=deadline_s)
        # the caches behind the memory and disk tiers, when configured (stats, prune)
        self.l1 = getattr(self._tier("memory"), "cache", None)
        self.l2 = getattr(self._tier("disk"), "cache", None)
        # the peer tier (chunks from other nodes) and the server of our chunks to them (peer.listen)
        self.peer_tier = self._tier("peer")
        self.peer_server: PeerServer | None = None
        popts = self.peer_tier.options if self.peer_tier is not None else (
            PeerOptions.from_options(config.options) if "peer.listen" in config.options else None)
        if popts is not None and popts.listen is not None:
            self.peer_server = PeerServer(self, popts)
        self.by_name: dict[str, MountedLayer] = {}
        self.by_slot: dict[int, MountedLayer] = {}
        self.next_slot = 1
        self.started_s = time.time()
        self._tails_dir = os.path.join(self.cache_dir, "tails")
        os.makedirs(self._tails_dir, exist_ok=True)
        self._stores: dict[tuple, Any] = {}
        self._stores_lock = threading.Lock()
        self._register_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None

    def _tier(self, name: str) -> Any:
        try:
            return self.fetcher.tier(name)
        except KeyError:
            return None

    # ------------------------------------------------------------------ stores

    def _reader(self, spec: StoreSpec, repo: str, digest: str, size: int) -> RandomAccessReader:
        if spec.kind == "file":
            reader = layerfmt.FileReader.open(spec.path)
            if reader.size != size:
                reader.close()
                raise ValueError(f"{spec.path} has {reader.size} bytes, the registration says {size}")
            return reader
        from ..registry import BlobReader, LayoutStore, RemoteStore

        key = (spec.kind, spec.path, spec.registry, spec.insecure)
        with self._stores_lock:
            store = self._stores.get(key)
            if store is None:
                # the store gives up within the envlet's deadline, all attempts included: a worker
                # thread abandoned at the deadline must not stay blocked on a hung registry after it
                store = (LayoutStore(spec.path) if spec.kind == "layout"
                         else RemoteStore(spec.registry, insecure=spec.insecure, policy=self.store_policy()))
                self._stores[key] = store
        return BlobReader(store, repo, digest, size)

    def store_policy(self) -> "RetryPolicy":
        from ..registry import RetryPolicy

        d = RetryPolicy()
        return RetryPolicy(deadline_s=self.deadline_s, request_timeout_s=min(d.request_timeout_s, self.deadline_s),
                           connect_timeout_s=min(d.connect_timeout_s, self.deadline_s))

    # ------------------------------------------------------------------ registration

    def _open_layer(self, req: Register, name: str) -> tuple[layerfmt.Layer, RandomAccessReader]:
        inner = self._reader(req.store, req.repo, req.digest, req.size)
        tail_path = os.path.join(self._tails_dir, req.digest.replace(":", "-"))
        try:
            with open(tail_path, "rb") as f:
                tail = f.read()
        except FileNotFoundError:
            tail = b""
        if tail:
            try:
                layer = layerfmt.Layer.open(_TailCachedReader(inner, tail), expected_toc_digest=req.toc_digest,
                                            tail_read=len(tail))
                return layerfmt.Layer(inner, layer.footer, layer.columns), inner
            except layerfmt.LayerError as e:
                log.warning("layer %s: cached tail unusable (%s); reading it again", name, e)
        rec = _RecordingReader(inner)
        layer = layerfmt.Layer.open(rec, expected_toc_digest=req.toc_digest)
        tail = rec.range(layer.footer.toc_offset, req.size)
        if tail is not None:
            atomic_write(tail_path, tail, mode=None, fsync=False)
        return layerfmt.Layer(inner, layer.footer, layer.columns), inner

    async def register(self, req: Register, *, slot: int | None = None, refcount: int = 1) -> MountedLayer:
        if not req.digest.startswith("sha256:") or len(req.digest) != 71:
            raise ValueError(f"layer digest {req.digest!r} is not sha256:<64 hex>")
        name = req.digest[7 : 7 + NAME_LEN]
        async with self._register_lock:
            existing = self.by_name.get(name)
            if existing is not None:
                if existing.digest != req.digest:
                    raise ValueError(f"layer name {name} is taken by {existing.digest}")
                if existing.toc_digest != req.toc_digest:
                    raise ValueError(f"layer {req.digest} is registered with TOC {existing.toc_digest}, not {req.toc_digest}")
                if existing.size != req.size:
                    raise ValueError(f"layer {req.digest} is registered with size {existing.size}, not {req.size}")
                existing.refcount += refcount
                self._save_state()
                if req.warm and self._nursery is not None:
                    self._nursery.start_soon(self._prefetch, existing, True)
                return existing

            def build() -> tuple[layerfmt.Layer, RandomAccessReader, LayerTree]:
                layer, inner = self._open_layer(req, name)
                return layer, inner, LayerTree(layer.columns)

            layer, inner, tree = await trio.to_thread.run_sync(build)
            if slot is None:
                slot = self.next_slot
            self.next_slot = max(self.next_slot, slot + 1)
            mounted = MountedLayer(name, slot, req.store, req.repo, req.digest, req.size, req.toc_digest, layer, tree,
                                   LayerSource(name, inner, req.digest), refcount)
            self.by_name[name] = mounted
            self.by_slot[slot] = mounted
            self._save_state()
        log.info("registered layer %s (%s, %d entries)", name, req.digest, len(tree.cols))
        if self._nursery is not None and (req.warm or (req.prefetch and layer.prefetch_end)):
            self._nursery.start_soon(self._prefetch, mounted, req.warm)
        return mounted

    async def _prefetch(self, m: MountedLayer, everything: bool = False) -> None:
        cols = m.tree.cols
        end = m.layer.footer.toc_offset if everything else m.layer.prefetch_end
        chunks = []
        k = 0
        offsets = cols.chunk_offsets
        while k < len(offsets) and offsets[k] + cols.chunk_lengths[k] <= end:
            chunks.append(cols.chunk(k, 0))
            k += 1
        m.prefetched_bytes = await self.fetcher.prefetch(m.source, chunks)
        log.info("layer %s: prefetched %d bytes", m.name, m.prefetched_bytes)

    async def unregister(self, name: str) -> None:
        async with self._register_lock:
            m = self.by_name.get(name)
            if m is None:
                raise KeyError(name)
            m.refcount -= 1
            gone = m.refcount <= 0
            if gone:
                del self.by_name[name]
                del self.by_slot[m.slot]
                log.info("unregistered layer %s", name)
            self._save_state()
        if gone and self._fuse_live:
            await self._forget_root_entry(name)

    async def _forget_root_entry(self, name: str) -> None:
        """Make the kernel forget ``/<name>`` before the caller hears the layer is gone.

        pyfuse3's ``invalidate_entry_async`` only queues the notice: a caller that looked right
        after could still find the layer in the dentry cache (for up to ROOT_TIMEOUT_S). The
        notice blocks while a lookup in the root is being answered, so it is sent from a worker
        thread, outside the register lock, while this loop goes on answering."""
        def forget() -> None:
            try:
                pyfuse3.invalidate_entry(pyfuse3.ROOT_INODE, name.encode())
            except OSError as e:
                if e.errno != errno.ENOENT:  # ENOENT: the kernel never looked the name up
                    raise
        with trio.move_on_after(_FORGET_BOUND_S) as scope:
            try:
                await trio.to_thread.run_sync(forget, abandon_on_cancel=True)
            except OSError as e:
                log.warning("layer %s: the kernel was not told to forget it: %s", name, e)
        if scope.cancelled_caught:
            log.warning("layer %s: the kernel did not forget it within %.0f s; it expires in %.0f s",
                        name, _FORGET_BOUND_S, ROOT_TIMEOUT_S)

    # ------------------------------------------------------------------ state

    def _save_state(self) -> None:
        data = {
            "next_slot": self.next_slot,
            "layers": [
                {"name": m.name, "slot": m.slot, "refcount": m.refcount, "store": msgspec.to_builtins(m.spec),
                 "repo": m.repo, "digest": m.digest, "size": m.size, "toc_digest": m.toc_digest}
                for m in self.by_name.values()
            ],
        }
        with atomic_writer(self.state_file, mode=None, fsync=False, encoding="utf-8") as f:
            json.dump(data, f)

    async def restore_state(self) -> None:
        try:
            with open(self.state_file) as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except ValueError as e:
            log.error("state file %s is unreadable (%s); starting empty", self.state_file, e)
            return
        self.next_slot = max(self.next_slot, int(data.get("next_slot", 1)))
        for rec in data.get("layers", []):
            req = Register(msgspec.convert(rec["store"], StoreSpec), rec["digest"], rec["size"], rec["toc_digest"],
                           rec.get("repo", ""), prefetch=False)
            try:
                await self.register(req, slot=rec["slot"], refcount=rec["refcount"])
            except Exception as e:  # one broken layer must not keep the others away
                log.error("could not restore layer %s: %s", rec.get("name"), e)
        # a restart must not reuse the slots of the previous mount's inodes
        self.next_slot += 1

    # ------------------------------------------------------------------ control socket

    def stats(self) -> dict:
        l1, l2 = self.l1, self.l2
        return {
            **self.metrics.snapshot(),
            "l1_size_bytes": l1.size_bytes if l1 else 0, "l1_capacity_bytes": l1.capacity_bytes if l1 else 0,
            "l2_size_bytes": l2.size_bytes if l2 else 0, "l2_capacity_bytes": l2.capacity_bytes if l2 else 0,
            "l2_files": l2.files if l2 else 0, "layers": len(self.by_name),
            "inflight_chunks": len(self.fetcher._inflight),
            "tiers": {name: dataclasses.asdict(st) for name, st in self.fetcher.tier_stats.items()},
            "layer_tiers": self.layer_tiers(),
            "peer": {"tier": self.peer_tier.stats() if self.peer_tier is not None else None,
                     "server": self.peer_server.stats() if self.peer_server is not None else None},
            "fair": {"enabled": self.fair.enabled, "share_cores": self.fair.share_cores},
            "envs": self.fair.snapshot(),
        }

    def layer_tiers(self) -> dict:
        """{layer digest: {tier: {"chunks", "bytes"}}}: what each tier after memory answered, per layer."""
        names = {m.name: m.digest for m in self.by_name.values()}
        return {names.get(name, name): {t: {"chunks": v[0], "bytes": v[1]} for t, v in per.items()}
                for name, per in list(self.fetcher.layer_tiers.items())}

    async def handle(self, req: Any) -> Reply:
        try:
            if isinstance(req, Ping):
                return Reply(True, {"pid": os.getpid(), "mountpoint": self.mountpoint, "id_base": self.id_base})
            if isinstance(req, Register):
                m = await self.register(req)
                return Reply(True, msgspec.to_builtins(m.info(self.mountpoint)))
            if isinstance(req, Unregister):
                await self.unregister(req.name)
                return Reply(True)
            if isinstance(req, ListLayers):
                return Reply(True, [msgspec.to_builtins(m.info(self.mountpoint)) for m in self.by_name.values()])
            if isinstance(req, Stats):
                return Reply(True, self.stats())
            if isinstance(req, Trace):
                m = self.by_name.get(req.name)
                if m is None:
                    raise KeyError(req.name)
                paths = [m.tree.cols.paths[i] for i in m.first_reads]
                if req.clear:
                    m.first_reads.clear()
                return Reply(True, paths)
            if isinstance(req, Extract):
                m = self.by_name[req.name]
                if not os.path.isabs(req.dest):
                    return Reply(False, error=f"extract: {req.dest!r} is not an absolute path", error_kind="bad_request")
                counts = await extract_layer(
                    m.tree, lambda chunks, path: self.fetcher.get(m.source, chunks, path),
                    lambda chunks: self.fetcher.prefetch(m.source, chunks), req.dest, id_base=self.id_base)
                return Reply(True, counts)
            if isinstance(req, SetPeers):
                if self.peer_tier is None:
                    return Reply(False, error="set_peers: this envlet has no peer tier (--tiers ...,peer,...)",
                                 error_kind="bad_request")
                try:
                    n = self.peer_tier.set_peers(req.peers)
                except (ValueError, TierConfigError) as e:
                    return Reply(False, error=f"set_peers: {e}", error_kind="bad_request")
                return Reply(True, {"peers": n, "address": self.peer_tier.self_address})
            if isinstance(req, PeerServing):
                if self.peer_server is None:
                    return Reply(False, error="peer_serving: this envlet does not serve peers (no peer.listen)",
                                 error_kind="bad_request")
                self.peer_server.serving = req.enabled
                log.info("peer serving %s", "resumed" if req.enabled else "stopped (drained)")
                return Reply(True, self.peer_server.stats())
            if isinstance(req, Prune):
                files, freed = (await trio.to_thread.run_sync(self.l2.prune, req.to_bytes)) if self.l2 else (0, 0)
                if self.l1:
                    self.l1.clear()
                return Reply(True, {"files": files, "bytes": freed,
                                    "l2_size_bytes": self.l2.size_bytes if self.l2 else 0})
            return Reply(False, error=f"unknown request {type(req).__name__}", error_kind="bad_request")
        except KeyError as e:
            return Reply(False, error=f"no registered layer named {e.args[0]!r}", error_kind="not_found")
        except Exception as e:
            log.warning("control request %s failed: %s", type(req).__name__, e)
            return Reply(False, error=f"{type(req).__name__.lower()} failed: {e}", error_kind="failed")

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                while True:
                    head = await _receive_exact(stream, 4)
                    if head is None:
                        return
                    (n,) = _LEN.unpack(head)
                    if n > MAX_MESSAGE_BYTES:
                        return
                    body = await _receive_exact(stream, n)
                    if body is None:
                        return
                    try:
                        req = request_decoder.decode(body)
                    except msgspec.DecodeError as e:
                        reply = Reply(False, error=f"bad request: {e}", error_kind="bad_request")
                    else:
                        reply = await self.handle(req)
                    data = encoder.encode(reply)
                    await stream.send_all(_LEN.pack(len(data)) + data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    async def serve_control(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        path = self.control_socket
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # Mode 0600 from the start without touching the process-wide umask (weenv/_unixsock.py).
        sock = trio.socket.from_stdlib_socket(await trio.to_thread.run_sync(bind_unix, path, 0o600))
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self._serve_connection, [listener])

    # ------------------------------------------------------------------ main

    async def _tune_bdi(self) -> None:
        # The FUSE INIT reply caps the bdi's readahead (at 128 KiB); raise it once INIT is done, which a
        # stat of our own mount (answered by this loop) guarantees.
        try:
            await trio.to_thread.run_sync(os.stat, self.mountpoint)
        except OSError as e:
            log.warning("could not stat %s: %s", self.mountpoint, e)
        raise_read_ahead(self.mountpoint)

    def _woken(self) -> None:
        self.metrics.inc("fuse_loop_wakeups")
        log.warning("the FUSE loop slept in a read of /dev/fuse with nothing to read; woken (%d so far)",
                    self.metrics.counters["fuse_loop_wakeups"])

    async def main(self, metrics_port: int | None = None, watcher: _wake.LoopWatcher | None = None) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.fetcher.attach(nursery)
            nursery.start_soon(_terminate_on_signal)
            if watcher is not None:
                nursery.start_soon(watcher.report, self._woken)
            await self.restore_state()
            nursery.start_soon(self._tune_bdi)
            if metrics_port:
                start_prometheus(self.metrics, metrics_port, self.fair.snapshot, lambda: {
                    "l1_size_bytes": self.l1.size_bytes if self.l1 else 0,
                    "l2_size_bytes": self.l2.size_bytes if self.l2 else 0,
                    "layers": len(self.by_name)}, self.layer_tiers)
            if self.peer_server is not None:
                address = await nursery.start(self.peer_server.serve)
                if self.peer_tier is not None:
                    self.peer_tier.self_address = address
            await nursery.start(self.serve_control)
            log.info("envlet serving %s (control %s)", self.mountpoint, self.control_socket)
            # waiting requests (an env over its fair share) hold a task each: room for them and the rest
            self._fuse_live = True
            try:
                await pyfuse3.main(min_tasks=4, max_tasks=MAX_FUSE_TASKS)
            finally:
                self._fuse_live = False
            nursery.cancel_scope.cancel()


async def _receive_exact(stream: trio.SocketStream, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = await stream.receive_some(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        first = True
        async for _ in signals:  # keep receiving: a second signal must not kill us mid-unmount
            if first:
                log.info("signal received: unmounting")
                pyfuse3.terminate()
                first = False


def _mount_of(path: str) -> tuple[str, str] | None:
    """(major:minor, fstype) of the mount at exactly ``path``, from /proc/self/mountinfo."""
    path = os.path.abspath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        parts = line.split()
        mnt = parts[4].replace("\\040", " ")
        if mnt == path:
            sep = parts.index("-")
            found = (parts[2], parts[sep + 1])
    return found


def clear_stale_mount(mountpoint: str) -> bool:
    """Lazily unmount a FUSE mount a killed envlet left at ``mountpoint``; True when one was cleared."""
    m = _mount_of(mountpoint)
    stale = m is not None and m[1].startswith("fuse")
    if not stale:
        try:
            os.stat(mountpoint)
        except OSError as e:
            stale = e.errno == errno.ENOTCONN
    if not stale:
        return False
    r = subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True, text=True)
    if r.returncode != 0 and _mount_of(mountpoint) is not None:
        subprocess.run(["umount", "-l", mountpoint], capture_output=True)
    log.info("cleared a stale mount at %s", mountpoint)
    return True


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20), hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open files limit from %d: %s", soft, e)


def raise_read_ahead(mountpoint: str, kb: int = 1024) -> None:
    """Raise the FUSE mount's bdi read_ahead_kb (the default 128 KiB triples cold read time)."""
    m = _mount_of(mountpoint)
    if m is None:
        return
    try:
        with open(f"/sys/class/bdi/{m[0]}/read_ahead_kb", "w") as f:
            f.write(str(kb))
    except OSError as e:
        log.warning("could not raise read_ahead_kb for %s: %s", mountpoint, e)


def serve(mountpoint: str, cache_dir: str, *, cache_size_bytes: int, memory_cache_size_bytes: int,
          control_socket: str, state_file: str | None = None, deadline_s: float = 30.0,
          metrics_port: int | None = None, readahead_bytes: int = 4 << 20, neighbor_bytes: int = 64 << 10,
          tiers: str | Sequence[str] = DEFAULT_TIERS, debug: bool = False, id_base: int = 0, fair: bool = True,
          fair_share_cores: float = 0.2, env_cgroup: str = "weenv", tier_options: dict[str, str] | None = None) -> None:
    """Mount and serve until SIGTERM/SIGINT; always unmounts."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s envlet[%(process)d] %(levelname)s %(message)s")
    _raise_nofile()  # the disk cache keeps one descriptor per pack (16 or more)
    # The stale mount goes first: on a mount whose envlet died, stat answers ENOTCONN, so makedirs
    # (which stats an existing path) would raise FileExistsError and the envlet would never come back.
    clear_stale_mount(mountpoint)
    os.makedirs(mountpoint, exist_ok=True)
    os.makedirs(cache_dir, exist_ok=True)
    envlet = Envlet(mountpoint, cache_dir, cache_size_bytes=cache_size_bytes,
                    memory_cache_size_bytes=memory_cache_size_bytes, control_socket=control_socket,
                    state_file=state_file, deadline_s=deadline_s, readahead_bytes=readahead_bytes,
                    neighbor_bytes=neighbor_bytes, tiers=tiers, id_base=id_base, fair=fair,
                    fair_share_cores=fair_share_cores, env_cgroup=env_cgroup, tier_options=tier_options)
    options = set(pyfuse3.default_options)
    options |= {"fsname=weenv-envlet", "subtype=weenv", "allow_other", "ro"}
    if debug:
        options.add("debug")
    pyfuse3.init(EnvletFS(envlet), mountpoint, options)
    # pyfuse3 reads /dev/fuse blocking after a readiness wait; a read left with nothing to read must
    # not stall the loop until the next request (weenv/envlet/_wake.py)
    watcher = None
    fds = _wake.fuse_fds()
    if fds:
        _wake.install()
        watcher = _wake.LoopWatcher(fds).start()
    else:
        log.warning("no /dev/fuse descriptor found after mounting: the FUSE loop watcher does not run")
    try:
        trio.run(envlet.main, metrics_port, watcher)
    finally:
        if watcher is not None:
            watcher.stop()  # before pyfuse3.close closes the descriptor it watches
        for sig in (signal.SIGTERM, signal.SIGINT):  # late signals must not interrupt the unmount
            signal.signal(sig, signal.SIG_IGN)
        pyfuse3.close(unmount=True)
        try:
            os.unlink(control_socket)
        except OSError:
            pass
