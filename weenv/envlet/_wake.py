"""Wake the envlet's loop from a FUSE read that has nothing to read.

pyfuse3's loop waits until /dev/fuse is readable and then reads it with a *blocking* read, holding
the GIL. Other tasks run between the two, and the request that made the device readable can leave
its queue in that gap: the kernel withdraws a queued INTERRUPT when the request it names is answered
(another task answers it), and a process killed before its request was read takes the request with
it. The read then sleeps until the next FUSE request arrives, and the whole envlet sleeps with it:
the control socket, the metrics endpoint, fetch completions, its worker threads (no GIL) and every
reply that is waiting. On a quiet mount that is forever: an envlet whose control socket did not
answer for 120 s after a neighbour's lookup storm was stopped (benchmarks/envlet_fair, in CI).

No thread of the envlet can see it (the sleeping read holds the GIL), so a small watcher process
(this file, run as a script: stdlib only, no GIL of ours) samples the loop thread's
``/proc/PID/task/TID/syscall``. When the thread sleeps in a system call on the FUSE descriptor for
:data:`LATE_SAMPLES` samples in a row — a read after readiness never sleeps — it sends the thread
:data:`WAKE_SIGNAL`, whose handler does nothing and does not restart system calls: the read fails
with EINTR, which libfuse and pyfuse3 take as "wait for readability again". The watcher writes a
byte per wake to a pipe the envlet reads (``fuse_loop_wakeups``), and ends with the envlet.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("weenv.envlet")

WAKE_SIGNAL = signal.SIGUSR2
PERIOD_S = 0.05
LATE_SAMPLES = 3  # asleep in the read over 0.1 s


def fuse_fds(fd_dir: str = "/proc/self/fd") -> set[int]:
    """This process's descriptors open on /dev/fuse."""
    found = set()
    for name in os.listdir(fd_dir):
        try:
            if os.readlink(os.path.join(fd_dir, name)) == "/dev/fuse":
                found.add(int(name))
        except OSError:  # closed since the listing
            pass
    return found


def blocked_on(syscall_text: str, fds: Iterable[int]) -> bool:
    """Whether a ``/proc/…/task/TID/syscall`` text says the thread sleeps in a system call whose first
    argument is one of ``fds`` ("running" and "-1 …", blocked outside a system call, are not)."""
    parts = syscall_text.split()
    if len(parts) < 2 or not parts[0].isdigit():
        return False
    try:
        return int(parts[1], 16) in set(fds)
    except ValueError:
        return False


def _ignore(signum: int, frame: object) -> None:
    pass


def install() -> None:
    """The wake signal's handler: nothing, and the system call it lands in fails with EINTR.
    Process-wide state, so from the main thread, once, before the loop starts."""
    signal.signal(WAKE_SIGNAL, _ignore)
    signal.siginterrupt(WAKE_SIGNAL, True)


def watch(pid: int, tid: int, fds: set[int], *, period_s: float = PERIOD_S, late_samples: int = LATE_SAMPLES,
          out: Callable[[], None] = lambda: None) -> None:
    """The watcher's loop: runs while ``pid`` is its parent and the thread exists."""
    libc = ctypes.CDLL(None, use_errno=True)
    tgkill = getattr(libc, "tgkill", None)  # glibc ≥ 2.30; else the process-directed signal reaches
    path = f"/proc/{pid}/task/{tid}/syscall"  # the main thread first, which is the loop's
    asleep = 0
    while os.getppid() == pid:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            return
        asleep = asleep + 1 if blocked_on(text, fds) else 0
        if asleep >= late_samples:
            if tgkill is None or tgkill(pid, tid, WAKE_SIGNAL) != 0:
                os.kill(pid, WAKE_SIGNAL)
            out()
            asleep = 0
        time.sleep(period_s)


class LoopWatcher:
    """The watcher process of this process's thread ``tid`` (default: this one) reading ``fds``."""

    def __init__(self, fds: Iterable[int], *, tid: int | None = None, period_s: float = PERIOD_S,
                 late_samples: int = LATE_SAMPLES):
        self.fds = sorted(fds)
        self.tid = tid if tid is not None else threading.get_native_id()
        self.period_s, self.late_samples = period_s, late_samples
        self.proc: subprocess.Popen | None = None

    def start(self) -> LoopWatcher:
        if not self.fds:
            raise ValueError("no FUSE descriptor to watch")
        # -I -S: this file alone, stdlib only, so the watcher starts in milliseconds and holds no copy of us
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(self.tid),
             ",".join(map(str, self.fds)), str(self.period_s), str(self.late_samples)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True)
        return self

    async def report(self, on_wake: Callable[[], None]) -> None:
        """Count the watcher's wakes (a byte each) from the loop."""
        import trio

        assert self.proc is not None and self.proc.stdout is not None
        async with trio.lowlevel.FdStream(os.dup(self.proc.stdout.fileno())) as stream:
            while data := await stream.receive_some(64):
                for _ in data:
                    on_wake()
        log.warning("the FUSE loop watcher (pid %d) ended while the envlet runs (exit %s): stalls are no "
                    "longer woken", self.proc.pid, self.proc.poll())

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    _pid, _tid, _fds, _period, _late = sys.argv[1:6]
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    def _out() -> None:
        os.write(1, b"w")

    try:
        watch(int(_pid), int(_tid), {int(x) for x in _fds.split(",")}, period_s=float(_period),
              late_samples=int(_late), out=_out)
    except (BrokenPipeError, KeyboardInterrupt):
        pass
