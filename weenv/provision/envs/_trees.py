"""Hot layers kept as plain directories, so that envs stack them as overlay lowers without FUSE.

The envlet makes a first start fast: nothing is pulled but what is read. But every ``open`` of a
file in a lazily served layer is a request to the envlet's one Python loop, for the life of every
env; with 16 envs starting Python at once, a node spends 1.4–1.7x as long as on local lowers
(``benchmarks/layer_trees.py``). So a layer that envs keep using on a node is written out once, in
the background, by the envlet from its verified chunks (``EnvletClient.extract``: the whole layer
in large range reads, then files by worker threads; whiteouts, opaque dirs, xattrs, hardlinks as
the mount shows them) into ``$WEENV_HOME/layer-trees/<digest>/``, and envs started after that
stack the directory instead.

- When: after ``after`` env starts on this node used the layer (counted since the daemon
  started); 0 turns the feature off. One copy runs at a time.
- Cost: a copy reads the whole layer, so it pulls what the envs did not read yet; layers above
  ``max_layer_bytes`` (compressed, 2 GiB by default) stay lazy.
- Bound: the trees' bytes (``du``) stay under ``budget_bytes``: least recently used trees that no
  live env stacks are removed first; a layer bigger than the budget is never copied, and one that
  finds the budget full of trees in use (or whose copy fails) is tried again 5 minutes later.
- A tree is complete once it has its name (the copy goes to ``.tmp-*`` and is renamed); a daemon
  start removes leftovers of copies that did not finish.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

log = logging.getLogger("weenv.daemon")


@dataclass
class _Tree:
    size: int
    used_s: float = field(default_factory=time.monotonic)


@dataclass
class _Job:
    digest: str
    register: Callable[[], tuple[str, str]]  # -> (envlet layer name, path of its directory)
    unregister: Callable[[str], None]
    copy: Callable[[str, str], None] | None = None  # (layer name, destination); None: cp -a of the path


class LayerTrees:
    """All blocking work runs in worker threads; the bookkeeping runs on the daemon's trio loop."""

    def __init__(self, root: str, *, after: int, budget_bytes: int, max_layer_bytes: int = 2 << 30,
                 pins: dict[str, int] | None = None):
        self.root = root
        self.max_layer_bytes = max_layer_bytes  # compressed: a bigger layer stays lazy
        self.pins = pins if pins is not None else {}  # envlet references held while copying (for gc)
        self.after = after
        self.budget_bytes = budget_bytes
        self.uses: dict[str, int] = {}
        self.trees: dict[str, _Tree] = {}
        self._queued: set[str] = set()
        self._too_big: set[str] = set()
        self._retry_after: dict[str, float] = {}  # a copy failed or found no room: not before this
        self.retry_s = 300.0
        self._send, self._receive = trio.open_memory_channel[_Job](1024)
        self.copies = 0
        self.evictions = 0
        os.makedirs(root, mode=0o700, exist_ok=True)
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.startswith(".") or name.endswith(".size"):
                continue
            try:
                with open(path + ".size") as f:
                    size = int(f.read())
            except (OSError, ValueError):  # a tree without its size was not finished: drop it
                shutil.rmtree(path, ignore_errors=True)
                continue
            self.trees[name] = _Tree(size)
        for name in os.listdir(root):  # copies cut short, sizes without a tree
            path = os.path.join(root, name)
            if name.startswith(".tmp-") or (name.endswith(".size") and name[:-5] not in self.trees):
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else _unlink(path)

    @staticmethod
    def key(digest: str) -> str:
        return digest.replace(":", "-")

    @property
    def size_bytes(self) -> int:
        return sum(t.size for t in self.trees.values())

    def path(self, digest: str) -> str | None:
        """The complete tree of ``digest`` (and it counts as used now), or None."""
        tree = self.trees.get(self.key(digest))
        if tree is None:
            return None
        tree.used_s = time.monotonic()
        return os.path.join(self.root, self.key(digest))

    def note_start(self, digest: str, size: int, register: Callable[[], tuple[str, str]],
                   unregister: Callable[[str], None], copy: Callable[[str, str], None] | None = None) -> None:
        """An env started with ``digest`` served by the envlet; the ``after``-th such start queues its copy."""
        if self.after <= 0:
            return
        key = self.key(digest)
        self.uses[key] = self.uses.get(key, 0) + 1
        if self.uses[key] < self.after or key in self.trees or key in self._queued or key in self._too_big:
            return
        if time.monotonic() < self._retry_after.get(key, 0.0):
            return
        if size > min(self.budget_bytes, self.max_layer_bytes):  # compressed: the tree can only be bigger
            self._too_big.add(key)
            return
        try:
            self._send.send_nowait(_Job(digest, register, unregister, copy))
            self._queued.add(key)
        except trio.WouldBlock:
            pass

    async def run(self, in_use: Callable[[], set[str]], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Copy queued layers one at a time, forever. ``in_use``: the digests live envs stack as trees."""
        task_status.started()
        async for job in self._receive:
            try:
                await self._copy(job, in_use)
            except Exception as e:  # noqa: BLE001 - a failed copy only means the envlet keeps serving it
                self._retry_after[self.key(job.digest)] = time.monotonic() + self.retry_s
                log.warning("layer %s: no tree (%s): envs keep reading it through the envlet; retrying in %.0f s",
                            job.digest, e, self.retry_s)
            finally:
                self._queued.discard(self.key(job.digest))

    async def _copy(self, job: _Job, in_use: Callable[[], set[str]]) -> None:
        key = self.key(job.digest)
        final = os.path.join(self.root, key)
        tmp = os.path.join(self.root, f".tmp-{key}")
        t0 = time.perf_counter()
        name, src = await trio.to_thread.run_sync(job.register)
        self.pins[name] = self.pins.get(name, 0) + 1
        try:
            await trio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))
            if job.copy is not None:  # the envlet writes it out from its chunks
                await trio.to_thread.run_sync(job.copy, name, tmp)
            else:  # at the lowest priority: it yields to the envs when the node is busy
                p = await trio.run_process([*_LOW_PRIORITY, "cp", "-a", "--", src, tmp], capture_stderr=True,
                                           check=False)
                if p.returncode != 0:
                    raise RuntimeError(f"cp -a failed: {p.stderr.decode(errors='replace').strip()[-300:]}")
            size = await trio.to_thread.run_sync(_du, tmp)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))
            raise
        finally:
            with trio.CancelScope(shield=True):
                self.pins[name] -= 1
                if not self.pins[name]:
                    del self.pins[name]
                await trio.to_thread.run_sync(job.unregister, name)
        if size > self.budget_bytes:
            await trio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))
            self._too_big.add(key)
            log.info("layer %s: its tree (%d bytes) would not fit the %d-byte budget", job.digest, size,
                     self.budget_bytes)
            return
        await self.evict(size, in_use())
        if self.size_bytes + size > self.budget_bytes:  # the rest is stacked by live envs
            await trio.to_thread.run_sync(lambda: shutil.rmtree(tmp, ignore_errors=True))
            self._retry_after[key] = time.monotonic() + self.retry_s
            log.info("layer %s: no room for its tree (%d bytes): the trees in use fill the %d-byte budget; "
                     "retrying in %.0f s", job.digest, size, self.budget_bytes, self.retry_s)
            return

        def install() -> None:
            with open(final + ".size", "w") as f:
                f.write(str(size))
            os.rename(tmp, final)

        await trio.to_thread.run_sync(install)
        self.trees[key] = _Tree(size)
        self.copies += 1
        log.info("layer %s: kept as a tree (%d bytes, %.1f s); new envs stack it without the envlet",
                 job.digest, size, time.perf_counter() - t0)

    async def evict(self, room: int, in_use: set[str]) -> list[str]:
        """Remove least recently used trees no live env stacks until ``room`` more bytes fit."""
        keep = {self.key(d) for d in in_use}
        removed = []
        for key, tree in sorted(self.trees.items(), key=lambda kv: kv[1].used_s):
            if self.size_bytes + room <= self.budget_bytes:
                break
            if key in keep:
                continue
            del self.trees[key]
            path = os.path.join(self.root, key)

            def remove(path: str = path) -> None:
                _unlink(path + ".size")
                shutil.rmtree(path, ignore_errors=True)

            await trio.to_thread.run_sync(remove)
            removed.append(key)
            self.evictions += 1
        return removed

    def stats(self) -> dict[str, int]:
        return {"trees": len(self.trees), "bytes": self.size_bytes, "budget_bytes": self.budget_bytes,
                "copies": self.copies, "evictions": self.evictions, "queued": len(self._queued)}


_LOW_PRIORITY = (["nice", "-n", "19"] if shutil.which("nice") else []) + (
    ["ionice", "-c", "3"] if shutil.which("ionice") else [])


def _du(path: str) -> int:
    out = subprocess.run(["du", "-s", "-B1", "--", path], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
