"""The OCI runtime config (``config.json``) weenv hands to crun: pure functions, no I/O.

What an env gets, and why:

- namespaces: pid, mount, ipc, uts, network, cgroup. The network namespace is empty: ``none``
  leaves its loopback down, ``loopback`` has the runtime bring it up after create (crun does not).
- no ``linux.resources`` and no ``cgroupsPath``: weenv owns the env's cgroups and crun runs with
  ``--cgroup-manager=disabled``; the runtime puts every crun process it spawns into the env's
  groups before exec, so the env's processes are born there.
- capabilities: Docker's default set minus ``CAP_MKNOD`` and ``CAP_NET_RAW``. There is no devices
  cgroup with the disabled manager, so an env must not be able to make device nodes; the runtime
  also remounts the env's root ``nodev`` (a layer may ship device nodes) and /dev holds only
  null, zero, full, random, urandom, tty, ptmx/pts, shm and mqueue. Non-root users get no
  effective capabilities, only the bounding set.
- ``noNewPrivileges``, a seccomp deny list (:data:`DENIED_SYSCALLS`: mount, module loading, kexec,
  ptrace, bpf, perf, keyrings, new user namespaces, clock setting, ...), masked and read-only
  /proc and /sys paths as Docker masks them.
- the init is a static idle reaper (catatonit ``-P``) bind-mounted read-only from the host at
  :data:`INIT_PATH`, inside /dev's tmpfs so nothing is written to the rootfs; any rootfs works,
  even one without a shell. A plan may replace it with its own argv.
- /etc/hosts, /etc/hostname and /etc/resolv.conf come from files in the bundle (read-only), so the
  env's view of its name never depends on what the image shipped.
"""

from __future__ import annotations

import json
import os
import platform
import posixpath
import uuid
from collections.abc import Mapping, Sequence

import msgspec

from .._errors import SpecError, UserNotFoundError

OCI_VERSION = "1.0.2"

#: Where the host's static init appears inside every env (a file in /dev's tmpfs).
INIT_PATH = "/dev/.weenv-init"
INIT_ARGS = (INIT_PATH, "-P")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: soft, hard
DEFAULT_NOFILE = (1024, 524288)

NETWORK_MODES = ("none", "loopback", "egress", "host")

#: Annotation keys the runtime reads back from a container's config.
ANNOTATION_ENV_ID = "org.weenv.env-id"
ANNOTATION_NETWORK = "org.weenv.network"
AGENT_PATH = "/dev/.weenv-agent"  # the in-env agent binary (read-only bind into /dev's tmpfs)
ANNOTATION_AGENT_SOCKET = "org.weenv.agent-socket"  # host path of the in-env agent's socket
ANNOTATION_EXEC_USER = "org.weenv.exec-user"  # [uid, gid, [gids], home]: the default user of exec

DEFAULT_CAPABILITIES = (
    "CAP_AUDIT_WRITE",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_NET_BIND_SERVICE",
    "CAP_SETFCAP",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
)

MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/devices/virtual/powercap",
    "/sys/firmware",
)

READONLY_PATHS = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

#: Syscalls an env never needs and that reach outside it; they fail with EPERM. Most already
#: fail for want of CAP_SYS_ADMIN & co.; the filter is the second wall (and covers ptrace,
#: bpf, perf_event_open, keyrings and io_uring, which capabilities do not fully close).
DENIED_SYSCALLS = (
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "get_kernel_syms",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pidfd_getfd",
    "pivot_root",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    "query_module",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "stime",
    "swapoff",
    "swapon",
    "syslog",
    "umount",
    "umount2",
    "uselib",
    "userfaultfd",
    "vhangup",
    "vm86",
    "vm86old",
)

CLONE_NEWUSER = 0x10000000
EPERM = 1
ENOSYS = 38

_SECCOMP_ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}


class User(msgspec.Struct, frozen=True, kw_only=True):
    """A process identity inside an env, numeric (as the kernel needs it)."""

    uid: int = 0
    gid: int = 0
    additional_gids: tuple[int, ...] = ()
    home: str = "/"
    name: str | None = None


ROOT_USER = User(uid=0, gid=0, home="/root", name="root")


class BindMount(msgspec.Struct, frozen=True, kw_only=True):
    """A host path made visible inside the env (explicit opt-in). It is read-only, noexec, nosuid
    and nodev all the way down: file systems mounted below ``source`` on the host get the same
    flags inside the env (crun's recursive options, ``mount_setattr(AT_RECURSIVE)``, Linux 5.12),
    so a tmpfs or a disk mounted there is neither writable nor a door to device nodes. ``readonly``
    and ``executable`` ask for writes and exec; setuid bits and device nodes never work."""

    source: str
    destination: str
    readonly: bool = True
    executable: bool = False


# -- seccomp -----------------------------------------------------------------------------------


def default_seccomp(machine: str | None = None) -> dict:
    """Allow by default, deny :data:`DENIED_SYSCALLS`, new user namespaces through clone/unshare,
    and clone3 (its flags live in memory a filter cannot read; ENOSYS makes libc fall back to
    clone, whose flags it can)."""
    arches = _SECCOMP_ARCHES.get(machine or platform.machine(), [])
    new_user_ns = [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": arches,
        "syscalls": [
            {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
            {"names": ["clone", "unshare"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM, "args": new_user_ns},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        ],
    }


# -- validation --------------------------------------------------------------------------------


def _check_argv(args: Sequence[str], what: str) -> list[str]:
    if isinstance(args, (str, bytes)) or not args:
        raise SpecError(f"{what} must be a non-empty list of strings, got {args!r}")
    out = []
    for i, a in enumerate(args):
        if not isinstance(a, str) or "\0" in a:
            raise SpecError(f"{what}[{i}] must be a string without NUL, got {a!r}")
        out.append(a)
    return out


def _check_abs(path: str, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise SpecError(f"{what} must be an absolute path, got {path!r}")
    return posixpath.normpath(path)


def merge_env(base: Mapping[str, str] | Sequence[str], extra: Mapping[str, str] | None) -> list[str]:
    """``KEY=value`` strings: ``base`` (a mapping or an OCI env list) overridden by ``extra``, in
    first-seen order. Names must be non-empty without ``=`` or NUL; values without NUL."""
    merged: dict[str, str] = {}
    items = base.items() if isinstance(base, Mapping) else (kv.split("=", 1) for kv in base)
    for pair in items:
        if len(pair) != 2:
            raise SpecError(f"env entry {pair[0]!r} has no '='")
        merged[pair[0]] = pair[1]
    for k, v in (extra or {}).items():
        merged[k] = v
    out = []
    for k, v in merged.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise SpecError(f"env var name {k!r} must be non-empty without '=' or NUL")
        if not isinstance(v, str) or "\0" in v:
            raise SpecError(f"env var {k} must be a string without NUL, got {v!r}")
        out.append(f"{k}={v}")
    return out


# -- process and spec --------------------------------------------------------------------------


def build_process(
    *,
    args: Sequence[str],
    env: Sequence[str],
    cwd: str = "/",
    user: User = ROOT_USER,
    capabilities: Sequence[str] = DEFAULT_CAPABILITIES,
    nofile: tuple[int, int] = DEFAULT_NOFILE,
    no_new_privileges: bool = True,
) -> dict:
    """The OCI ``process`` object, for the init and for every exec (``crun exec --process``), so
    exec'd commands get the same capabilities, no_new_privileges and limits as the init
    (``no_new_privileges=False``: a plan's ``setuid = true``, for sudo)."""
    caps = list(capabilities)
    # Like Docker: a non-root process keeps only the bounding set, so a capability can never be
    # used by the env's unprivileged user unless a file capability grants it (and NNP forbids).
    held = caps if user.uid == 0 else []
    soft, hard = nofile
    if not 0 < soft <= hard:
        raise SpecError(f"nofile limits must satisfy 0 < soft <= hard, got {nofile}")
    return {
        "terminal": False,
        # The primary group is listed too, as initgroups(3) does at login.
        "user": {"uid": user.uid, "gid": user.gid, "additionalGids": list(dict.fromkeys((user.gid, *user.additional_gids)))},
        "args": _check_argv(args, "args"),
        "env": list(env),
        "cwd": _check_abs(cwd, "cwd"),
        "capabilities": {"bounding": caps, "effective": held, "permitted": held, "inheritable": [], "ambient": []},
        "rlimits": [{"type": "RLIMIT_NOFILE", "soft": soft, "hard": hard}],
        "noNewPrivileges": no_new_privileges,
    }


def base_env(env_id: str, user: User) -> dict[str, str]:
    return {"PATH": DEFAULT_PATH, "HOSTNAME": env_id, "HOME": user.home or "/"}


def build_spec(
    *,
    env_id: str,
    rootfs: str,
    init_path: str | None,
    args: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str = "/",
    user: User = ROOT_USER,
    network: str = "none",
    bind_mounts: Sequence[BindMount] = (),
    etc_dir: str | None = None,
    readonly_rootfs: bool = False,
    nofile: tuple[int, int] = DEFAULT_NOFILE,
    capabilities: Sequence[str] = DEFAULT_CAPABILITIES,
    seccomp: Mapping | None = None,
    use_seccomp: bool = True,
    shm_size_bytes: int = 64 << 20,
    dev_size_bytes: int = 4 << 20,
    annotations: Mapping[str, str] | None = None,
    agent_path: str | None = None,
    agent_socket: str | None = None,
    netns_path: str | None = None,
    setuid: bool = False,
) -> dict:
    """The complete ``config.json`` for one env (``setuid``: the plan's, processes without
    no_new_privileges).

    ``init_path`` is the host path of the static init (bind-mounted at :data:`INIT_PATH`); with
    ``args`` the plan's own init runs instead and ``init_path`` may be None. ``etc_dir`` holds
    ``hosts``, ``hostname`` and ``resolv.conf`` (see :func:`render_etc_files`). ``env`` is laid
    over PATH, HOSTNAME and HOME; ``cwd`` and ``user`` are the defaults for every exec too.
    ``netns_path`` (required for ``network = "egress"``): the network namespace weenv.net wired.
    """
    if not env_id or "/" in env_id or "\0" in env_id or len(env_id) > 64:
        raise SpecError(f"env id {env_id!r} must be 1-64 characters without '/' or NUL")
    if network not in NETWORK_MODES:
        raise SpecError(f"network must be one of {', '.join(NETWORK_MODES)}, got {network!r}")
    if (network == "egress") != (netns_path is not None):
        raise SpecError("network = egress needs the path of its network namespace (and only it takes one)")
    use_agent = args is None and agent_path is not None and agent_socket is not None
    default_user = user
    if use_agent:
        # weenv-agent is the init and runs commands for the daemon: it must be root to run them
        # as any user; commands default to the plan's user (recorded in an annotation).
        # the listening socket the daemon bound, outside the env; its first connection holds the key
        args = (AGENT_PATH, "--fd", "3", "--key-first")
        user = ROOT_USER
    elif args is None:
        if init_path is None:
            raise SpecError("no init: give the host path of a static init or the plan's own init args")
        args = INIT_ARGS
    mounts: list[dict] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "noexec", "strictatime", "mode=755", f"size={dev_size_bytes // 1024}k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={shm_size_bytes // 1024}k"],
        },
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {
            "destination": "/sys/fs/cgroup",
            "type": "cgroup",
            "source": "cgroup",
            # rro: on a v1 host crun builds /sys/fs/cgroup as a tmpfs of per-hierarchy mounts; plain
            # ro leaves that tmpfs writable
            "options": ["nosuid", "noexec", "nodev", "relatime", "ro", "rro"],
        },
    ]
    if init_path is not None:
        mounts.append(
            {
                "destination": INIT_PATH,
                "type": "bind",
                "source": _check_abs(init_path, "init_path"),
                "options": ["bind", "ro", "nosuid", "nodev"],
            }
        )
    if use_agent:
        mounts.append({"destination": AGENT_PATH, "type": "bind", "source": _check_abs(agent_path, "agent_path"),
                       "options": ["bind", "ro", "nosuid", "nodev"]})
    if etc_dir is not None:
        etc_dir = _check_abs(etc_dir, "etc_dir")
        for name in ETC_FILES:
            mounts.append(
                {
                    "destination": f"/etc/{name}",
                    "type": "bind",
                    "source": f"{etc_dir}/{name}",
                    "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
                }
            )
        if os.path.exists(f"{etc_dir}/{BOOT_ID}"):  # the env's own boot id (the kernel's is the node's)
            mounts.append({"destination": BOOT_ID_PATH, "type": "bind", "source": f"{etc_dir}/{BOOT_ID}",
                           "options": ["bind", "ro", "nosuid", "nodev", "noexec"]})
    taken = {m["destination"] for m in mounts}
    for i, b in enumerate(bind_mounts):
        dest = _check_abs(b.destination, f"bind_mounts[{i}].destination")
        if dest == "/" or dest in taken or dest.startswith(("/proc/", "/sys/", "/dev/")) or dest in ("/proc", "/sys", "/dev"):
            raise SpecError(f"bind_mounts[{i}].destination {dest!r} would cover a path weenv mounts itself")
        opts = ["rbind", "nosuid", "nodev", "rnosuid", "rnodev"]
        opts += [] if b.executable else ["noexec", "rnoexec"]
        opts += ["ro", "rro"] if b.readonly else []
        mounts.append({"destination": dest, "type": "bind", "source": _check_abs(b.source, f"bind_mounts[{i}].source"), "options": opts})
    spec_env = merge_env(base_env(env_id, user), env)
    note = {ANNOTATION_ENV_ID: env_id, ANNOTATION_NETWORK: network}
    if use_agent:
        note[ANNOTATION_AGENT_SOCKET] = _check_abs(agent_socket, "agent_socket")  # type: ignore[arg-type]
        note[ANNOTATION_EXEC_USER] = json.dumps(
            [default_user.uid, default_user.gid, list(default_user.additional_gids), default_user.home or ""])
    note.update(annotations or {})
    linux: dict = {
        # network = host shares the node's network namespace (explicit opt-in, for trusted builds)
        "namespaces": [{"type": t, **({"path": netns_path} if t == "network" and netns_path else {})}
                       for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")
                       if not (t == "network" and network == "host")],
        "maskedPaths": list(MASKED_PATHS),
        "readonlyPaths": list(READONLY_PATHS),
        "rootfsPropagation": "rprivate",
    }
    if use_seccomp:
        linux["seccomp"] = dict(seccomp) if seccomp is not None else default_seccomp()
    return {
        "ociVersion": OCI_VERSION,
        "process": build_process(args=args, env=spec_env, cwd=cwd, user=user, capabilities=capabilities, nofile=nofile,
                                 no_new_privileges=not setuid),
        "root": {"path": _check_abs(rootfs, "rootfs"), "readonly": bool(readonly_rootfs)},
        "hostname": env_id,
        "mounts": mounts,
        "annotations": note,
        "linux": linux,
    }


# -- /etc files --------------------------------------------------------------------------------

ETC_FILES = ("hosts", "hostname", "resolv.conf")
BOOT_ID, BOOT_ID_PATH = "boot_id", "/proc/sys/kernel/random/boot_id"


def render_etc_files(env_id: str, network: str, nameserver: str | None = None,
                     node_address: str | None = None) -> dict[str, bytes]:
    """Contents of the env's /etc/hosts, /etc/hostname and /etc/resolv.conf. With no network
    beyond loopback there is no resolver; the file says so rather than pointing at one. An egress
    env with ``dns = "node"`` gets ``nameserver``: its gateway, which answers only allowed names;
    every egress env has its gateway (``node_address``) as ``weenv-node`` in /etc/hosts."""
    if network not in NETWORK_MODES:
        raise SpecError(f"network must be one of {', '.join(NETWORK_MODES)}, got {network!r}")
    hosts = (
        "127.0.0.1\tlocalhost\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        f"127.0.1.1\t{env_id}\n"
    )
    if node_address is not None:
        hosts += f"{node_address}\tweenv-node\n"  # the node as this env sees it (allow "node:PORT")
    resolv = f"# weenv: network={network}, no DNS resolver in this env\n"
    if nameserver is not None:
        resolv = f"# weenv: network={network}, the env's resolver on its gateway\nnameserver {nameserver}\n"
    if network == "host":
        try:
            with open("/etc/resolv.conf", "rb") as f:
                resolv = f.read().decode("utf-8", "replace")
        except OSError:
            pass
    return {"hosts": hosts.encode(), "hostname": f"{env_id}\n".encode(), "resolv.conf": resolv.encode(),
            BOOT_ID: f"{uuid.uuid4()}\n".encode()}


# -- users and groups from the env's own files -------------------------------------------------

_MAX_ID = 0xFFFFFFFE


def _parse_id(text: str, what: str) -> int:
    if not text.isdigit():
        raise SpecError(f"{what} {text!r} is not a number")
    value = int(text)
    if value > _MAX_ID:
        raise SpecError(f"{what} {value} is out of range")
    return value


def _passwd_entries(text: str):
    for line in text.splitlines():
        f = line.split(":")
        if len(f) < 7 or line.startswith("#") or not f[2].isdigit() or not f[3].isdigit():
            continue
        yield f[0], int(f[2]), int(f[3]), f[5] or "/"


def _group_entries(text: str):
    for line in text.splitlines():
        f = line.split(":")
        if len(f) < 4 or line.startswith("#") or not f[2].isdigit():
            continue
        yield f[0], int(f[2]), [m for m in f[3].split(",") if m]


def parse_user(spec: str | int | None, passwd_text: str, group_text: str) -> User:
    """Resolve ``name``, ``uid``, ``name:group``, ``uid:gid`` (any mix) against the text of the
    env's /etc/passwd and /etc/group. A numeric uid missing from passwd is allowed (gid 0,
    home /); a name that is missing is an error, but for ``root`` (uid 0). Supplementary groups come
    from /etc/group."""
    if spec is None or spec == "":
        spec = "0"
    spec = str(spec)
    user_part, _, group_part = spec.partition(":")
    if not user_part:
        raise SpecError(f"user {spec!r} has no user part")
    passwd = list(_passwd_entries(passwd_text))
    groups = list(_group_entries(group_text))
    entry = None
    if user_part.isdigit():
        uid = _parse_id(user_part, "uid")
        entry = next((e for e in passwd if e[1] == uid), None)
    else:
        entry = next((e for e in passwd if e[0] == user_part), None)
        if entry is None and user_part == "root":
            entry = ("root", 0, 0, "/root")  # an image without /etc/passwd (busybox, distroless) still has root
        if entry is None:
            raise UserNotFoundError(f"user {user_part!r} is not in the env's /etc/passwd")
        uid = entry[1]
    name, gid, home = (entry[0], entry[2], entry[3]) if entry else (None, 0, "/")
    if group_part:
        if group_part.isdigit():
            gid = _parse_id(group_part, "gid")
        else:
            g = next((g for g in groups if g[0] == group_part), None)
            if g is None:
                raise UserNotFoundError(f"group {group_part!r} is not in the env's /etc/group")
            gid = g[1]
    extra: list[int] = []
    if name is not None:
        for _gname, ggid, members in groups:
            if name in members and ggid != gid and ggid not in extra:
                extra.append(ggid)
    return User(uid=uid, gid=gid, additional_gids=tuple(extra), home=home, name=name)
