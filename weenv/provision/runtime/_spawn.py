"""How crun processes start fast: from a sealed in-memory copy of the binary
(:func:`sealed_binary`), and ``crun create`` by posix_spawn through a POSIX sh that writes its
pid into the env's cgroups first (:func:`spawn_create`), so the init is born inside them.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence

_MFD_EXEC = 0x0010  # memfd_create(2): executable even where vm.memfd_noexec asks otherwise (Linux 6.3)
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_sealed: dict[tuple[str, int, int, int], tuple[int, str]] = {}  # (binary, pid, inode, mtime) -> (fd, path)


def sealed_binary(path: str) -> str:
    """A path that execs a sealed in-memory copy of the binary at ``path`` (one per process and
    binary version; ``path`` itself when the kernel has no memfds).

    crun 1.x protects the host binary from a container that would overwrite it through
    /proc/self/exe (CVE-2019-5736) by re-executing itself from a read-only copy on every
    invocation, unless it already runs from a memfd sealed against writes (its ``is_self_cloned``:
    exactly F_SEAL_SEAL|SHRINK|GROW|WRITE). That copy is a bind mount, a remount, a lazy unmount and
    a second exec loading its ten libraries again: 2.4 ms of a 4.8 ms ``crun --version`` here; in
    40 interleaved starts through the daemon, crun create 21.0 → 16.4 ms and crun start 7.2 → 4.6 ms
    p50. A copy sealed once gives crun the same guarantee (nothing can write to it) and it starts
    once. The copy is exec'd as ``/proc/<our pid>/fd/<fd>`` (the descriptor stays
    close-on-exec: children open it through our descriptor table, so none of them holds it)."""
    st = os.stat(path)
    key = (os.path.realpath(path), os.getpid(), st.st_ino, st.st_mtime_ns)
    known = _sealed.get(key)
    if known is not None:
        return known[1]
    try:
        try:
            fd = os.memfd_create("crun", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | _MFD_EXEC)
        except OSError:  # before Linux 6.3: no MFD_EXEC (and no noexec memfds either)
            fd = os.memfd_create("crun", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError):
        return path
    try:
        with open(path, "rb") as f:
            data = f.read()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) != _SEALS:
            raise OSError("unexpected seals")
    except OSError:
        os.close(fd)
        return path
    sealed = f"/proc/{os.getpid()}/fd/{fd}"
    _sealed[key] = (fd, sealed)
    return sealed


# crun create's spawner. posix_spawn puts the agent's listening socket at 3 and the env's
# cgroup.procs files at 4.. itself, so a POSIX sh only writes its pid into each and execs crun.
# bash was needed to move a descriptor above 9 to 3 (dash takes one digit in a redirection) and
# costs ~0.8 ms more per start here (bash -c 3.70 ms vs sh -c 2.92 ms p50, exec'ing true, 60
# interleaved). Exit status 125 (never crun's) means a write failed, as in ._ns.
_CREATE_TRAMPOLINE = ('i=4; n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ >"/dev/fd/$i" || exit 125; '
                      'i=$((i+1)); n=$((n-1)); done; exec "$@"')


def spawn_create(argv: Sequence[str], *, stdin: int, out: int, fd3: int | None, cgroup_fds: Sequence[int]) -> int:
    """Run ``argv`` (crun create) through :data:`_CREATE_TRAMPOLINE` and wait: stdin, stdout and
    stderr (``out``) set, ``fd3`` at 3, ``cgroup_fds`` at 4.., nothing else inherited (every other
    descriptor of the daemon is close-on-exec). Returns the exit status."""
    sources = [stdin, out, *([fd3] if fd3 is not None else []), *cgroup_fds]
    moved: list[int] = []
    try:
        # above every target first: a dup2 onto a descriptor still to be copied would clobber it
        for fd in sources:
            moved.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64))
        dup2 = os.POSIX_SPAWN_DUP2
        actions = [(dup2, moved[0], 0), (dup2, moved[1], 1), (dup2, moved[1], 2)]
        rest = moved[2:]
        if fd3 is not None:
            actions.append((dup2, rest.pop(0), 3))
        actions += [(dup2, fd, 4 + i) for i, fd in enumerate(rest)]
        pid = os.posix_spawn("/bin/sh", ["/bin/sh", "-c", _CREATE_TRAMPOLINE, "weenv-spawn", str(len(cgroup_fds)),
                                         *argv], os.environ, file_actions=actions)
    finally:
        for fd in moved:
            os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)

