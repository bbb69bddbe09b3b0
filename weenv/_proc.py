"""Whether a process has exited, by pid, and waiting until it has.

The processes weenv waits for by pid are often not its children: ``weenv daemon stop`` waits for a
daemon the CLI did not start, a daemon for an envlet an earlier daemon started, a local cluster for
the daemons of its nodes. A child of someone else that has exited stays in ``/proc`` as a zombie
until its parent reaps it; it runs no code and holds no file, mount or socket any more, so a zombie
counts as gone (state ``Z`` in ``/proc/<pid>/stat``). ``reap=True`` first reaps the pid when it is
this process's own child, so that a child that exited does not stay a zombie.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["gone", "wait_gone"]


def gone(pid: int, *, reap: bool = False) -> bool:
    """True once ``pid`` has exited (a zombie counts as gone). ``reap``: reap it first if it is our
    child (a child someone else waits for, such as a ``subprocess.Popen``, must not be reaped here)."""
    if reap:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child: only /proc tells
            pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the state follows the command name, which is in parentheses and may hold any character
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def wait_gone(pid: int, timeout_s: float, *, reap: bool = False, interval_s: float = 0.05,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep) -> bool:
    """Wait (blocking) until ``pid`` is :func:`gone`, checking every ``interval_s``; False if it still
    runs after ``timeout_s``. It is checked at least once, even with no time to wait."""
    deadline = clock() + timeout_s
    while not gone(pid, reap=reap):
        if clock() >= deadline:
            return False
        sleep(interval_s)
    return True
