"""User namespaces for envs: env root is an unprivileged host uid (docs/security.md, "User namespaces").

Every crun env runs in a user namespace of its own mapping env ids 0..65535 to host ids
``base``..``base+65535`` (one range for the node, :data:`DEFAULT_BASE` = 2^30 by default). The
range is shared by the node's envs because their lowers are: the envlet has one FUSE mount for
all envs, FUSE (libfuse 3.14, pyfuse3) cannot be idmapped (mount_setattr(MOUNT_ATTR_IDMAP) is
EINVAL on it, and on overlayfs itself), so the envlet shows each file owned by ``base + owner``
(``weenv envlet serve --id-base``) and every env's user namespace maps that range back.

How the pieces fit:

- the env's overlay is mounted by the daemon on the host as before (``nosuid,nodev``); its lowers
  are owned by host ids of the range (envlet, layer trees, snapshot trees) and its upper is
  written through the env's namespace, so it holds host ids of the range too;
- crun's child runs as the env's root (host uid ``base``) while it mounts the rootfs and the
  bind mounts: it cannot walk ``$WEENV_HOME`` (0700, root), so the spec names the rootfs and
  weenv's bind sources relative to the bundle, where crun runs (:func:`bundle_relative_paths`),
  and only ``envs/<id>`` and its bundle are ``root:<base> 0710``: traversable by the range's
  root group, listable by nobody but host root (the agent's key stays 0600 root);
- host-side trees are inert: owned by range ids (a setuid bit makes a file setuid to an
  unprivileged uid), file capabilities are v3 of the range's root (ignored by host processes),
  and a tree never holds a device node (:func:`make_tree_inert`);
- commit seals the upper with ``build_layer(id_base=base)``: the layer records the env's ids.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Iterable

import msgspec

from ..._atomic import atomic_write
from ...layerfmt._ids import CAPABILITY_XATTR, ID_COUNT, cap_to_host, to_host_id, to_layer_id

# below 2^31: procps (ps) and other tools print uids from 2^31 up as negative numbers
DEFAULT_BASE = 1 << 30


class DeviceNodeInTreeError(OSError):
    """A tree that would be stacked from the host's disk holds a device node."""


class IdMap(msgspec.Struct, frozen=True, kw_only=True):
    """Env ids ``0..count-1`` are host ids ``base..base+count-1`` (``base`` 0: no user namespace)."""

    base: int = DEFAULT_BASE
    count: int = ID_COUNT

    def __post_init__(self) -> None:
        if not 0 < self.base <= 2**32 - 1 - self.count:
            raise ValueError(f"user namespace base {self.base} must be between 1 and {2**32 - 1 - self.count}")
        if self.count != ID_COUNT:
            raise ValueError(f"user namespace size must be {ID_COUNT}, got {self.count}")

    def host(self, env_id: int) -> int:
        return to_host_id(env_id, self.base)

    def env(self, host_id: int) -> int:
        return to_layer_id(host_id, self.base)


def apply_userns(spec: dict, idmap: IdMap) -> dict:
    """The OCI spec with a user namespace mapping the env's ids onto ``idmap``'s host range."""
    linux = spec.setdefault("linux", {})
    namespaces = [ns for ns in linux.get("namespaces", []) if ns.get("type") != "user"]
    linux["namespaces"] = [{"type": "user"}, *namespaces]
    mapping = [{"containerID": 0, "hostID": idmap.base, "size": idmap.count}]
    linux["uidMappings"] = mapping
    linux["gidMappings"] = [dict(m) for m in mapping]
    return spec


def own_cgroups_only(spec: dict, cgroup_dirs: Iterable[str], version: str) -> dict:
    """On a v1 host, mount the env's own groups (read-only) at ``/sys/fs/cgroup/<hierarchy>``
    instead of crun's ``cgroup`` mount. In a user namespace crun mounts every hierarchy that
    /proc/self/cgroup lists, and the kernel lets a user namespace mount only hierarchies that
    exist: one made and dropped meanwhile elsewhere (runsc mounts hugetlb for its sandboxes) fails
    the env's start with EPERM. The env sees what the cgroup namespace showed it: its own groups."""
    if version != "v1":
        return spec  # v2: crun mounts cgroup2 in the env's cgroup namespace, nothing to enumerate
    names: dict[str, str] = {}
    for d in cgroup_dirs:
        rel = os.path.relpath(d, "/sys/fs/cgroup")
        if rel.startswith("..") or "/" not in rel:
            return spec  # not under /sys/fs/cgroup (a test's mimic): crun's mount stays
        name = rel.split("/", 1)[0]
        if name != "unified":  # a hybrid host's v2 mount: crun runs where it is hidden, and never showed it
            names.setdefault(name, d)
    mounts: list[dict] = []
    for m in spec.get("mounts", []):
        if m.get("destination") != "/sys/fs/cgroup" or m.get("type") != "cgroup":
            mounts.append(m)
            continue
        mounts.append({"destination": "/sys/fs/cgroup", "type": "tmpfs", "source": "cgroup",
                       "options": ["nosuid", "noexec", "nodev", "mode=755", "size=64k"]})
        for name, d in sorted(names.items()):
            mounts.append({"destination": f"/sys/fs/cgroup/{name}", "type": "bind", "source": d,
                           "options": ["bind", "ro", "nosuid", "nodev", "noexec"]})
        linux = spec.setdefault("linux", {})
        # read-only once filled: the tmpfs, then each group again (crun's read-only bind of the tmpfs
        # is recursive and leaves the copies of the groups below it writable)
        linux["readonlyPaths"] = [*linux.get("readonlyPaths", []), "/sys/fs/cgroup",
                                  *(f"/sys/fs/cgroup/{name}" for name in sorted(names))]
    spec["mounts"] = mounts
    return spec


def bundle_relative_paths(spec: dict, bundle_dir: str, env_dir: str) -> dict:
    """Paths crun's child (the env's root, host uid ``base``) resolves, made reachable without
    walking ``$WEENV_HOME`` (0700, root): crun runs in the bundle directory, so the root and
    bind-mount sources under the env's directory become relative to it (OCI allows both), and a
    file weenv binds from elsewhere under the env's directory's parents (the agent binary) is
    hard-linked into the bundle first. Only the env's directory and the bundle need to let the
    range's root group through (:func:`open_path_for_range`)."""
    root = spec.get("root", {}).get("path")
    if root and os.path.isabs(root):
        spec["root"]["path"] = os.path.relpath(root, bundle_dir)
    home = os.path.dirname(os.path.dirname(os.path.abspath(env_dir)))  # $WEENV_HOME (envs/<id>)
    for m in spec.get("mounts", []):
        src = m.get("source", "")
        if m.get("type") != "bind" or not os.path.isabs(src) or not src.startswith(home + "/"):
            continue  # plan mounts and system files: their own paths
        if not src.startswith(os.path.abspath(env_dir) + "/"):
            link = os.path.join(bundle_dir, ".bind-" + os.path.basename(src))
            if not os.path.exists(link):
                try:
                    os.link(src, link)
                except OSError:  # another file system (EXDEV), or links not allowed: a copy
                    shutil.copy2(src, link)
            src = link
        m["source"] = os.path.relpath(src, bundle_dir)
    return spec


def open_path_for_range(paths: Iterable[str], idmap: IdMap) -> None:
    """``root:<base> 0710`` for each directory, so crun's child (the env's root, host ``base``) can
    walk through it to the rootfs and bind-mount sources, and list nothing."""
    for p in paths:
        st = os.stat(p)
        if st.st_uid != 0 or st.st_gid != idmap.base:
            os.chown(p, 0, idmap.base)
        if stat.S_IMODE(st.st_mode) != 0o710:
            os.chmod(p, 0o710)


def make_tree_inert(root: str, base: int) -> int:
    """Make a tree copied from an env's upper safe to keep on the host's disk (it becomes an overlay
    lower of later envs): v2 file capabilities (a copied-up lower's, valid for host processes too)
    become v3 of the range's root, and a device node (not a whiteout) refuses the whole tree
    (:class:`DeviceNodeInTreeError`: the layer is then served by the envlet's nodev mount).
    Owners need nothing: everything the env wrote is owned by range ids. Returns how many
    capabilities were rewritten. Walks with no-follow calls only."""
    rewritten = 0
    stack = [root]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                m = st.st_mode
                if (stat.S_ISCHR(m) or stat.S_ISBLK(m)) and st.st_rdev != 0:
                    raise DeviceNodeInTreeError(f"device node {os.path.relpath(entry.path, root)} "
                                                f"({os.major(st.st_rdev)}:{os.minor(st.st_rdev)})")
                if stat.S_ISDIR(m):
                    stack.append(entry.path)
                elif stat.S_ISREG(m) and base:
                    outside = (m & stat.S_ISUID and not base <= st.st_uid < base + ID_COUNT) or (
                        m & stat.S_ISGID and not base <= st.st_gid < base + ID_COUNT)
                    if outside:  # never setuid/setgid to a host id outside the range (none should exist)
                        os.chmod(entry.path, stat.S_IMODE(m) & ~(stat.S_ISUID | stat.S_ISGID))
                    try:
                        cap = os.getxattr(entry.path, CAPABILITY_XATTR, follow_symlinks=False)
                    except OSError:
                        continue
                    if is_v2_capability(cap):
                        os.setxattr(entry.path, CAPABILITY_XATTR, cap_to_host(cap, base), follow_symlinks=False)
                        rewritten += 1
    return rewritten


def is_v2_capability(value: bytes) -> bool:
    """A ``security.capability`` value that applies in every user namespace, the host's included."""
    return len(value) >= 4 and value[3] == 0x02


ID_BASE_MARKER = ".id-base"  # a sibling of the trees directory: <root>.id-base


def trees_for_base(root: str, base: int) -> bool:
    """Keep the trees under ``root`` (layer or snapshot trees) only if they were written for host
    ids from ``base``: a daemon restarted with ``--userns`` after ``--no-userns`` (or another base)
    would stack root-owned trees that its envs see as nobody's. They are caches (the layers are in
    the store or the registry): otherwise they all go, and are made again. A directory without a
    marker was written before user namespaces, for base 0. True when the trees were kept."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    marker = os.path.normpath(root) + ID_BASE_MARKER
    try:
        with open(marker) as f:
            had = int(f.read().strip() or 0)
    except FileNotFoundError:
        had = 0
    except (OSError, ValueError):
        had = -1
    kept = had == base
    if not kept:
        for name in os.listdir(root):
            path = os.path.join(root, name)
            trash = os.path.join(root, f".trash-ids-{secrets.token_hex(4)}")
            os.rename(path, trash)  # out of use at once, then removed
            if os.path.isdir(trash) and not os.path.islink(trash):
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.unlink(trash)
    if base == 0:  # no marker means base 0 (as before user namespaces)
        if os.path.lexists(marker):
            os.unlink(marker)
        return kept
    atomic_write(marker, f"{base}\n", mode=None, fsync=False)
    return kept
