"""Keeping a start's first cgroup move off the RCU grace period.

Every process weenv starts in an env (crun create's trampoline, hence the env's init) is moved
into the env's groups by a write to ``cgroup.procs``. A move takes the kernel's global
``cgroup_threadgroup_rwsem`` for writing, and the first writer after a quiet spell waits for an
RCU grace period (the semaphore's readers switch to their slow path first): measured here, a
move after 250 ms without one took 12.0 ms p50, against well under a millisecond while moves
keep coming (docs/architecture.md, "Where a start's time goes"). Mounting the hierarchies with
``favordynmods`` removes the wait, but that is the host's choice, and one-way until reboot.

So a create asks for the wait at once, in a worker thread, by moving a parked process of its
own between two scratch groups (:meth:`MoveWarmer.kick`), while it locks, stacks layers, mounts
and writes its bundle (~5 ms); its own move then finds the semaphore ready or nearly so (5.9 ms
p50 instead of 12.0 with 6 ms of head start, measured interleaved). On a busy node, moves keep it
ready anyway and the kick costs a write.

A burst of creates (an RL step asks for hundreds) keeps the semaphore ready for all but its first:
after a kick the warmer goes on moving its parked process every :data:`TICK_S` (5 ms) until
:data:`KEEP_WARM_S` (2 s, ``$WEENV_CGROUP_KEEP_WARM_S``; 0 turns it off) after the last kick. The
semaphore goes back to its fast-reader mode one grace period after its last writer (measured here:
a move 10 ms after the last one took 0.17 ms p50, 20 ms after it 7.9 ms), so a move every 5 ms
keeps every create of the burst off the wait. Its cost while it runs: a write to ``cgroup.procs``
every 5 ms (~1 % of a core), and the host's forks and exits taking the semaphore's slower reader
path (an atomic on a shared counter) until the window ends.

The scratch groups are ``_moves-a`` and ``_moves-b`` in weenv's parent of one hierarchy: no env
name can start with ``_`` (:func:`~._base.check_name`), and the backends leave them out of
:meth:`~._base.CgroupBackend.list`. The parked process is ``sh -c 'read _'`` on a pipe whose other
end only the daemon holds: it ends when the daemon does, however the daemon ends.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from ._fs import CgroupFs

log = logging.getLogger("weenv.cgroups")

#: What the scratch groups' names start with; never a valid group name (see check_name).
SCRATCH_PREFIX = "_moves-"
#: How long after the last kick the warmer keeps the semaphore ready (seconds; the environment's
#: ``WEENV_CGROUP_KEEP_WARM_S`` overrides it, 0 = one move per kick only).
KEEP_WARM_S = 2.0
#: The moves' period while it does: well inside the ~10-20 ms the semaphore stays ready after one.
TICK_S = 0.005


def _keep_warm_s() -> float:
    raw = os.environ.get("WEENV_CGROUP_KEEP_WARM_S")
    if raw is None:
        return KEEP_WARM_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        log.warning("WEENV_CGROUP_KEEP_WARM_S=%r is not a number of seconds: using %g", raw, KEEP_WARM_S)
        return KEEP_WARM_S


class MoveWarmer:
    """Moves a parked process between ``<directory>/_moves-a`` and ``_moves-b`` on each :meth:`kick`."""

    def __init__(self, fs: CgroupFs, directory: str):
        self._fs = fs
        self.dirs = [f"{directory}/{SCRATCH_PREFIX}a", f"{directory}/{SCRATCH_PREFIX}b"]
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._hold = -1  # the write end of the parked process's stdin
        self._side = 0
        self._closed = False
        self.keep_warm_s = _keep_warm_s()
        self.moves = 0  # moves made (kicks and ticks): what tests and the curious read
        self._until = 0.0  # monotonic time the ticker stops at
        self._ticker: threading.Thread | None = None
        self._ticking = threading.Lock()  # guards _until and _ticker
        self._stop = threading.Event()

    def kick(self) -> None:
        """One move now (blocking: call it from a worker thread), then keep moving every
        :data:`TICK_S` until ``keep_warm_s`` from now. Never raises: at worst a start waits as it did."""
        self._move()
        if self.keep_warm_s > 0:
            with self._ticking:
                if self._closed:
                    return
                self._until = time.monotonic() + self.keep_warm_s
                if self._ticker is None:
                    self._ticker = threading.Thread(target=self._tick, name="weenv-cgroup-warm", daemon=True)
                    self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._ticking:
                if time.monotonic() >= self._until:
                    self._ticker = None
                    return
            self._move(park=False)

    def _move(self, *, park: bool = True) -> None:
        """Skipped while another is under way (one in flight is all it takes). A tick
        (``park=False``) never starts a parked process: only a kick does."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            if self._proc is None or self._proc.poll() is not None:
                if not park:
                    return
                self._park()
            assert self._proc is not None
            self._side ^= 1
            self._fs.write(f"{self.dirs[self._side]}/cgroup.procs", str(self._proc.pid))
            self.moves += 1
        except OSError as e:
            log.debug("cgroup move warm-up skipped: %s", e)
        finally:
            self._lock.release()

    def _park(self) -> None:
        self._stop_parked()
        for d in self.dirs:
            try:
                self._fs.mkdir(d)
            except FileExistsError:
                pass
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            self._proc = subprocess.Popen(["/bin/sh", "-c", "read _"], stdin=r, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._hold = w

    def _stop_parked(self) -> None:
        if self._hold >= 0:
            os.close(self._hold)  # EOF: the parked shell's read returns and it exits
            self._hold = -1
        if self._proc is not None:
            try:
                self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """End the ticker and the parked process and remove the scratch groups (no more kicks after this)."""
        with self._ticking:
            self._closed = True
            ticker, self._ticker = self._ticker, None
        self._stop.set()
        if ticker is not None and ticker is not threading.current_thread():
            ticker.join()
        with self._lock:
            self._closed = True
            self._stop_parked()
            remove_scratch(self._fs, self.dirs)


def remove_scratch(fs: CgroupFs, dirs: list[str]) -> None:
    """Remove the scratch groups that are there (empty once their parked process has ended)."""
    for d in dirs:
        try:
            fs.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("cannot remove %s: %s", d, e)
