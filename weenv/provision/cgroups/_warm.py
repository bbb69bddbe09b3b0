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

from ._fs import CgroupFs

log = logging.getLogger("weenv.cgroups")

#: What the scratch groups' names start with; never a valid group name (see check_name).
SCRATCH_PREFIX = "_moves-"


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

    def kick(self) -> None:
        """One move (blocking: call it from a worker thread). Skipped while another is under way
        (one in flight is all it takes). Never raises: at worst a start waits as it did."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            if self._proc is None or self._proc.poll() is not None:
                self._park()
            assert self._proc is not None
            self._side ^= 1
            self._fs.write(f"{self.dirs[self._side]}/cgroup.procs", str(self._proc.pid))
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
        """End the parked process and remove the scratch groups (no more kicks after this)."""
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
