"""What this host offers the container runtime, found by looking rather than assumed.

The fact that matters most: crun refuses a *hybrid* cgroup host (v1 controllers plus a cgroup2
mount) whenever the cgroup2 hierarchy holds controllers, even with ``--cgroup-manager=disabled``
(it reads ``<unified>/cgroup.controllers`` and stops with "cgroups in hybrid mode not supported,
drop all controllers from cgroupv2"). Only ``crun create``/``run`` check; ``exec``, ``start``,
``kill``, ``state`` and ``delete`` work as they are. Two ways around it:

- per create: a private mount namespace with the cgroup2 mount detached
  (:func:`private_mount_ns_recipe`), entered by the thread that spawns ``crun create`` (or by a
  child before exec). Its teardown waits for an RCU grace period (several ms on a loaded host);
  the runtime lets the spawning thread pay that after crun has answered, so it is off the start
  path;
- once per boot: mount each controller that cgroup2 holds as its own v1 hierarchy
  (:func:`bind_unified_controllers_to_v1`), the layout systemd's hybrid mode makes anyway. Then
  the cgroup2 mount is controller-less and crun needs nothing. This changes the host, and with
  the teardown off the start path it measured no faster (benchmarks/start_crun.py
  ``--alternative``), so the runtime uses the recipe.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import shutil

import msgspec

from .._errors import HostError
from ..cgroups import parse_layout

#: Where Debian's catatonit package installs a static init (pause mode ``-P`` reaps zombies).
INIT_CANDIDATES = ("/usr/bin/catatonit", "/usr/libexec/podman/catatonit")

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2


class HostFacts(msgspec.Struct, frozen=True, kw_only=True):
    """The host as the runtime sees it. Built by :func:`detect_host`; plain data for tests."""

    cgroup_mode: str
    """"legacy", "hybrid", "unified" or "none" (as :func:`weenv.provision.cgroups.parse_layout`)."""
    unified_mount: str | None = None
    unified_controllers: tuple[str, ...] = ()
    """Controllers attached to the cgroup2 hierarchy (``cgroup.controllers`` of its root)."""
    crun_path: str | None = None
    runsc_path: str | None = None
    """gVisor's runsc, for ``runtime = "gvisor"`` envs (its platform is probed by
    :func:`weenv.provision.runtime._runsc.probe_platform` on first use)."""
    init_path: str | None = None
    """A statically linked idle init to bind-mount into every env (catatonit)."""
    kernel_release: str = ""
    nofile_hard: int = 1 << 20
    """This process's hard RLIMIT_NOFILE: an env cannot get more (raising it needs
    CAP_SYS_RESOURCE, which sandboxed hosts like this one drop)."""

    @property
    def crun_needs_private_mount_ns(self) -> bool:
        """True when ``crun create`` must run with the cgroup2 mount hidden (see module doc)."""
        return self.cgroup_mode == "hybrid" and bool(self.unified_controllers)

    def require_crun(self) -> str:
        if self.crun_path is None:
            raise HostError("crun is not installed (apt-get install crun)")
        return self.crun_path

    def require_runsc(self) -> str:
        if self.runsc_path is None:
            raise HostError('runsc is not installed: runtime = "gvisor" needs it (apt-get install runsc)')
        return self.runsc_path

    def require_init(self) -> str:
        if self.init_path is None:
            raise HostError(
                "no static init for envs: looked for " + ", ".join(INIT_CANDIDATES) + " (apt-get install catatonit)"
            )
        return self.init_path


def _read_controllers(unified_mount: str | None) -> tuple[str, ...]:
    if unified_mount is None:
        return ()
    try:
        with open(os.path.join(unified_mount, "cgroup.controllers")) as f:
            return tuple(f.read().split())
    except OSError:
        return ()


def detect_host(*, proc_dir: str = "/proc") -> HostFacts:
    """Read the cgroup layout, cgroup2's controllers, and where crun and the init live."""
    with open(f"{proc_dir}/self/mountinfo") as f:
        mountinfo = f.read()
    with open(f"{proc_dir}/self/cgroup") as f:
        proc_cgroup = f.read()
    layout = parse_layout(mountinfo, proc_cgroup)
    init_path = next((p for p in INIT_CANDIDATES if os.access(p, os.X_OK)), None)
    return HostFacts(
        cgroup_mode=layout.mode,
        unified_mount=layout.unified_mount,
        unified_controllers=_read_controllers(layout.unified_mount),
        crun_path=shutil.which("crun"),
        runsc_path=shutil.which("runsc"),
        init_path=os.path.realpath(init_path) if init_path else None,
        kernel_release=platform.release(),
        nofile_hard=_nofile_hard(),
    )


def _nofile_hard() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return (1 << 20) if hard == resource.RLIM_INFINITY else hard


# -- the per-create recipe ---------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def private_mount_ns_recipe(unified_mount: str):
    """A callable that moves the calling thread (or a child, as a preexec_fn) into a new
    private mount namespace without the cgroup2 mount; processes it spawns inherit that.

    Everything is resolved here, so that the callable only makes three syscalls and touches no
    Python machinery that another thread could hold a lock on.
    """
    target = os.fsencode(unified_mount)
    unshare, mount, umount2 = _libc.unshare, _libc.mount, _libc.umount2
    get_errno = ctypes.get_errno

    def enter() -> None:
        if unshare(CLONE_NEWNS) != 0:
            raise OSError(get_errno(), "unshare(CLONE_NEWNS)")
        # Private first, or the detach below would propagate back to the host's namespace.
        if mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            raise OSError(get_errno(), "mount --make-rprivate /")
        if umount2(target, MNT_DETACH) != 0:
            raise OSError(get_errno(), "umount2 " + unified_mount)

    return enter


# -- the once-per-boot alternative -------------------------------------------------------------


def bind_unified_controllers_to_v1(facts: HostFacts, mount_root: str = "/sys/fs/cgroup") -> list[str]:
    """Mount each controller that cgroup2 holds as a v1 hierarchy at ``mount_root/<name>`` so
    that crun no longer needs the per-create recipe. Returns the mount points made (unmount them
    with :func:`unbind_v1_controllers`; the controllers go back to cgroup2 when their v1
    hierarchy has no child groups left). Raises :class:`HostError` when the kernel refuses
    (EBUSY: the controller is enabled in some cgroup2 ``subtree_control``)."""
    made: list[str] = []
    for controller in facts.unified_controllers:
        target = os.path.join(mount_root, controller)
        os.makedirs(target, exist_ok=True)
        if _libc.mount(b"cgroup", os.fsencode(target), b"cgroup", 0, controller.encode()) != 0:
            err = ctypes.get_errno()
            unbind_v1_controllers(made)
            raise HostError(
                f"cannot mount the {controller} controller as cgroup v1 at {target}: {os.strerror(err)}"
                + (" (it is enabled in a cgroup2 subtree_control)" if err == errno.EBUSY else "")
            )
        made.append(target)
    return made


def unbind_v1_controllers(mount_points: list[str]) -> None:
    for target in reversed(mount_points):
        if _libc.umount2(os.fsencode(target), 0) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOENT):
                raise HostError(f"cannot unmount {target}: {os.strerror(err)}")
