"""Mounting an env's root filesystem: a size-bounded tmpfs for the writable upper, overlayfs on top.

The upper lives on a tmpfs of ``disk`` bytes, so a full upper is ENOSPC inside the env and nothing
else; tmpfs pages are charged to the memory cgroup of the process that writes them, so an env's
writes also count against its own memory limit (see docs/architecture.md).
"""

from __future__ import annotations

import ctypes
import errno
import os

from .._errors import MountError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2
OVERLAY_OPTIONS = "index=off,xino=off,redirect_dir=off,metacopy=off"
MAX_MOUNT_OPTIONS = 4095  # the kernel copies at most one page of mount data


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise MountError(f"mount -t {fstype} on {target} failed: {os.strerror(err)} (options {data!r})")


def mount_upper(path: str, size_bytes: int) -> None:
    """A tmpfs of ``size_bytes`` at ``path`` holding ``upper/`` and ``work/`` for overlayfs."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    _mount("weenv-upper", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={max(size_bytes, 1 << 20)},mode=0700")
    os.mkdir(os.path.join(path, "upper"), 0o755)
    os.mkdir(os.path.join(path, "work"), 0o700)


def overlay_options(lowers_top_first: list[str], upper: str, work: str) -> str:
    data = f"lowerdir={':'.join(lowers_top_first)},upperdir={upper},workdir={work},{OVERLAY_OPTIONS}"
    if len(data) > MAX_MOUNT_OPTIONS:
        raise MountError(f"overlay options are {len(data)} bytes, the kernel takes {MAX_MOUNT_OPTIONS}: too many layers")
    for p in (*lowers_top_first, upper, work):
        if "," in p or ":" in p:
            raise MountError(f"overlay layer path {p!r} contains ',' or ':'")
    return data


def mount_overlay(target: str, lowers_top_first: list[str], upper: str, work: str, *, setuid: bool = False) -> None:
    """The env's rootfs; ``nosuid,nodev`` on the host too: a setuid binary or a device node that an
    env's layers or upper hold grants nothing to a host process that reaches the mount. ``setuid``
    (a plan's ``setuid = true``, for sudo): ``nodev`` only; the mount lies in ``$WEENV_HOME``, which
    only host root traverses, and a setuid bit gives host root nothing it has not."""
    os.makedirs(target, mode=0o755, exist_ok=True)
    _mount("overlay", target, "overlay", MS_NODEV | (0 if setuid else MS_NOSUID),
           overlay_options(lowers_top_first, upper, work))


def unmount(target: str) -> bool:
    """Unmount ``target`` (lazily if busy); False when nothing was mounted there."""
    if _libc.umount2(target.encode(), 0) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):
        return False
    if err == errno.EBUSY and _libc.umount2(target.encode(), MNT_DETACH) == 0:
        return True
    raise MountError(f"umount {target} failed: {os.strerror(err)}")


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix`` (deepest first), from /proc/self/mountinfo."""
    prefix = os.path.abspath(prefix)
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mnt = line.split()[4].replace("\\040", " ")
                if mnt == prefix or mnt.startswith(prefix + "/"):
                    out.append(mnt)
    except OSError:
        return []
    return sorted(set(out), key=lambda m: -m.count("/"))
