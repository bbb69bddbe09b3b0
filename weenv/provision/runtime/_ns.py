"""Low-level helpers of the crun runtime: ctypes calls (setns, unshare, mount_setattr, ioctl on
``lo``), fresh threads for namespace changes (a thread that changes namespace must end), the
POSIX-shell trampoline that puts crun in the env's cgroups before it execs, and finding and
killing an exec's whole process tree by pidfd."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from fcntl import ioctl


_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
SYS_MOUNT_SETATTR = 442
AT_EMPTY_PATH = 0x1000
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


# A cgroup.procs write needs to happen in the child before it execs crun. A Python preexec_fn
# would force subprocess to fork() the whole daemon (5-10 ms here, growing with its memory); a
# POSIX shell does it for ~1 ms and lets Python use vfork. "$$" is the shell, which then becomes
# crun. The files are opened by the parent and handed down as descriptors: the child of
# ``create`` may run where the cgroup2 mount is hidden. Exit status 125 (never crun's) means a
# write failed.
_TRAMPOLINE = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ >"/dev/fd/$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
TRAMPOLINE_FAILED = 125
# The same, then duplicate descriptor $s to 3 for ``crun --preserve-fds 1`` (the agent's listening socket).
_TRAMPOLINE_FD3 = ('s=$1; shift; n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ >"/dev/fd/$1" || exit 125; shift; '
                   'n=$((n-1)); done; eval "exec 3<&$s" || exit 125; exec "$@"')


class _CgroupFds:
    """The env's cgroup.procs files, open for the trampoline (a context manager)."""

    def __init__(self, cgroup_procs: Sequence[str]):
        self.paths = list(cgroup_procs)
        self.fds: list[int] = []

    def __enter__(self) -> _CgroupFds:
        try:
            for p in self.paths:
                self.fds.append(os.open(p, os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def wrap(self, argv: list[str], *, fd3: int | None = None) -> list[str]:
        if fd3 is not None:
            # bash, not sh: dash takes single-digit descriptors only in redirections
            return ["/bin/bash", "-c", _TRAMPOLINE_FD3, "weenv-spawn", str(fd3), str(len(self.fds)),
                    *map(str, self.fds), *argv]
        if not self.fds:
            return argv
        return ["/bin/sh", "-c", _TRAMPOLINE, "weenv-spawn", str(len(self.fds)), *map(str, self.fds), *argv]


def _empty_stdin() -> int:
    """crun's stdin instead of /dev/null: the read end of a pipe already closed for writing. In a
    user namespace crun before 1.23 fchowns its std streams to the env's root (crun issue #1845),
    and for /dev/null that is the host's /dev/null, which the env then owns through its bind in
    the env's /dev (test_escape.py::test_env_root_cannot_change_the_hosts_dev_null)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    os.close(w)
    return r


def in_fresh_thread(fn: Callable[[], object]) -> object:
    """Run ``fn`` in a thread of its own and return its result (or raise its exception).

    For work that changes the calling thread's namespaces (mount, network: both per thread in
    Linux): the thread is never reused. We return as soon as ``fn`` is done, not when the thread
    has exited: tearing down a private mount namespace waits for an RCU grace period, which is
    the thread's business, not the caller's."""
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="weenv-ns", daemon=True).start()
    done.wait()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("result")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _setup_env_namespaces(init_pid: int, *, remount_root: bool, loopback: bool | None, setuid: bool = False) -> None:
    """From a fresh thread, between ``crun create`` and ``crun start`` (the init is parked):

    - remount the env's root ``nodev,nosuid`` (``nodev`` only for a plan's ``setuid = true``: sudo,
      whose processes run without no_new_privileges). A mount can only be changed from its own mount
      namespace; a thread may switch after unsharing its fs_struct (CLONE_FS). crun re-applies its
      own flags to the root bind mount, so a flag set on the rootfs before create would not last.
    - set ``lo`` up or down (crun brings it up in every new network namespace).
    """
    nsfds = []
    try:
        mnt = os.open(f"/proc/{init_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        nsfds.append(mnt)
        root = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        nsfds.append(root)
        net = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        nsfds.append(net)
        if remount_root:
            _check(_libc.unshare(CLONE_FS), "unshare(CLONE_FS)")
            _check(_libc.setns(mnt, CLONE_NEWNS), f"setns into the mount namespace of pid {init_pid}")
            attr = _MountAttr(MOUNT_ATTR_NODEV | (0 if setuid else MOUNT_ATTR_NOSUID), MOUNT_ATTR_NOSUID if setuid else 0,
                              0, 0)
            rc = _libc.syscall(SYS_MOUNT_SETATTR, ctypes.c_int(root), b"", ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
            _check(rc, "mount_setattr(nodev%s) on the env's root" % ("" if setuid else ",nosuid"))
        if loopback is not None:
            _check(_libc.setns(net, CLONE_NEWNET), f"setns into the network namespace of pid {init_pid}")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                req = struct.pack("16sH14x", b"lo", 0)
                flags = struct.unpack("16sH14x", ioctl(sock.fileno(), SIOCGIFFLAGS, req))[1]
                wanted = (flags | IFF_UP) if loopback else (flags & ~IFF_UP)
                if wanted != flags:
                    ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", wanted))
    finally:
        for fd in nsfds:
            os.close(fd)


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, session id, state) of a live pid, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[3]), fields[0].decode()


def _members(leader: int, sessions: set[int]) -> list[int]:
    """Live (non-zombie) processes of one exec: descendants of ``leader`` (crun's pid), plus
    every process in a session that one of them ever led or belonged to. crun's helper starts
    the command in a session of its own, and an orphaned background job (``(cmd &)``) is
    reparented to the env's init, so parentage alone misses it; its session does not.
    ``sessions`` accumulates across scans (a session id is not reused while any process is in
    it). Parents come before their children, so that a kill in this order never lets a parent
    see a child die and react (a shell running its next command, or exiting 137 on its own
    before its SIGKILL lands)."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    found = {leader}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, sid, _s) in table.items():
            if pid not in found and (ppid in found or sid in sessions):
                found.add(pid)
                grew = True
        for pid in found:
            if pid in table and table[pid][1] not in sessions:
                sessions.add(table[pid][1])
                grew = True

    def depth(pid: int) -> int:  # ancestors inside the exec; bounded, as a ppid loop cannot be
        d = 0
        while pid in table and table[pid][0] in found and table[pid][0] != pid and d < len(found):
            pid, d = table[pid][0], d + 1
        return d

    live = [pid for pid in found if pid in table and table[pid][2] not in ("Z", "X")]
    return sorted(live, key=lambda pid: (depth(pid), pid))


def kill_exec_tree(leader: int, *, spare_leader: bool = True, deadline_s: float = 5.0) -> int:
    """SIGKILL every process of the exec led by ``leader`` (crun's pid) until a scan finds none
    alive; returns how many were signalled. The leader itself is spared when asked, so that crun
    can report the command's exit status."""
    signalled = 0
    sessions = {leader}
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        ordered = _members(leader, sessions)
        if spare_leader and leader in ordered:
            ordered.remove(leader)
        if not ordered:
            return signalled
        targets = set(ordered)
        for pid in ordered:  # parents first: see _members
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                # Re-checked once the pidfd pins the process: a pid freed and reused since the
                # scan belongs to someone else (and is in none of our sessions).
                st = _proc_stat(pid)
                if st is not None and (st[1] in sessions or st[0] in targets or st[0] == leader):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    signalled += 1
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.001)
    return signalled


