"""Find the host's cgroup mode and put weenv's parent group under this process's own cgroup."""

from __future__ import annotations

import re

import msgspec

from .._errors import CgroupUnavailableError
from ._base import CgroupBackend, check_name
from ._fs import CgroupFs
from ._v1 import V1_CONTROLLERS, V1Backend
from ._v2 import V2Backend

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # /proc/*/mountinfo escapes space, tab, newline and backslash as \ooo.
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


class CgroupLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where each hierarchy is mounted and where this process sits in it."""

    mode: str
    """"legacy" (v1 only), "hybrid" (v1 controllers plus a controller-less v2 mount) or "unified"."""
    v1_mounts: dict[str, str] = {}
    """v1 controller -> mount point (co-mounted controllers share one)."""
    v1_own: dict[str, str] = {}
    """v1 controller -> this process's group, as a path below that mount point."""
    unified_mount: str | None = None
    unified_own: str | None = None

    def v1_parents(self, root_name: str) -> dict[str, str]:
        out = {}
        for c in V1_CONTROLLERS:
            if c in self.v1_mounts:
                own = self.v1_own.get(c, "/").rstrip("/")
                out[c] = f"{self.v1_mounts[c].rstrip('/')}{own}/{root_name}"
        return out


def parse_layout(mountinfo: str, proc_cgroup: str) -> CgroupLayout:
    """Read the layout from the text of ``/proc/self/mountinfo`` and ``/proc/self/cgroup``."""
    own_by_hierarchy: dict[str, str] = {}  # "memory" / "cpu,cpuacct" / "" (unified) -> path
    for line in proc_cgroup.splitlines():
        if not line.strip():
            continue
        _hid, controllers, path = line.split(":", 2)
        own_by_hierarchy[controllers] = path
    own_by_controller: dict[str, str] = {}
    for controllers, path in own_by_hierarchy.items():
        for c in controllers.split(","):
            if c:
                own_by_controller[c] = path

    v1_mounts: dict[str, str] = {}
    v1_roots: dict[str, str] = {}
    unified_mount = unified_root = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 10:
            continue
        sep = fields.index("-")
        fstype, super_opts = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        mount_root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup":
            for opt in super_opts.split(","):
                if opt in V1_CONTROLLERS and opt not in v1_mounts:
                    v1_mounts[opt] = mount_point
                    v1_roots[opt] = mount_root
        elif fstype == "cgroup2" and unified_mount is None:
            unified_mount, unified_root = mount_point, mount_root

    def relative(own: str, mount_root: str) -> str:
        # A mount of a sub-tree (containers) shows the sub-tree at its mount point.
        if mount_root not in ("/", "") and (own == mount_root or own.startswith(mount_root + "/")):
            own = own[len(mount_root):] or "/"
        return own

    v1_own = {c: relative(own_by_controller.get(c, "/"), v1_roots[c]) for c in v1_mounts}
    unified_own = None
    if unified_mount is not None:
        unified_own = relative(own_by_hierarchy.get("", "/"), unified_root or "/")
    if "memory" in v1_mounts:
        mode = "hybrid" if unified_mount is not None else "legacy"
    elif unified_mount is not None:
        mode = "unified"
    else:
        mode = "none"
    return CgroupLayout(
        mode=mode, v1_mounts=v1_mounts, v1_own=v1_own, unified_mount=unified_mount, unified_own=unified_own
    )


def detect_backend(root_name: str = "weenv", *, proc_dir: str = "/proc", fs: CgroupFs | None = None) -> CgroupBackend:
    """The backend for this host, with weenv's parent group ``<own cgroup>/<root_name>`` created
    in every hierarchy it uses (idempotent). Raises :class:`CgroupUnavailableError` without a
    usable hierarchy."""
    check_name(root_name)
    with open(f"{proc_dir}/self/mountinfo") as f:
        mountinfo = f.read()
    with open(f"{proc_dir}/self/cgroup") as f:
        proc_cgroup = f.read()
    layout = parse_layout(mountinfo, proc_cgroup)
    if layout.mode in ("legacy", "hybrid"):
        unified_parent = None
        if layout.unified_mount is not None:
            own = (layout.unified_own or "/").rstrip("/")
            unified_parent = f"{layout.unified_mount.rstrip('/')}{own}/{root_name}"
        return V1Backend(
            layout.v1_parents(root_name),
            unified_parent=unified_parent,
            memory_mount=layout.v1_mounts["memory"],
            fs=fs,
        )
    if layout.mode == "unified":
        assert layout.unified_mount is not None
        return V2Backend(layout.unified_mount, own_path=layout.unified_own or "/", root_name=root_name, fs=fs)
    raise CgroupUnavailableError(
        "no cgroup v1 memory hierarchy and no cgroup2 mount", path=f"{proc_dir}/self/mountinfo"
    )
