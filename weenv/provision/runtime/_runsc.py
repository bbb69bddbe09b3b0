"""runsc on this host, apart from running envs: what the gVisor runtime (:mod:`._gvisor`) asks of it.

- the platform (how the Sentry intercepts system calls), probed, never assumed: ``kvm`` when
  ``/dev/kvm`` runs a probe container within a few seconds, else ``ptrace``
  (:func:`probe_platform`), cached per runsc version and kernel;
- the spec as runsc takes it (:func:`gvisor_spec`: the refusals, no recursive mount flags, the
  rootfs's own /tmp);
- runsc's view of the env's rootfs and bundle (:func:`runsc_view_spec`, :func:`enter_runsc_view`:
  a tmpfs on :data:`RUNSC_VIEW_DIR` in a mount namespace of ``runsc run``'s own), and the bind
  sources the env's root cannot reach, named (:func:`unreachable_sources`);
- the sandbox's processes as the host sees them (:func:`sandbox_alive`) and as ``runsc ps``
  lists them (:func:`ps_table`).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

import msgspec

from ..._atomic import atomic_write
from .._errors import HostError, SpecError
from ._hostcheck import CLONE_NEWNS, MS_PRIVATE, MS_REC, _libc
from ._ns import _check, _empty_stdin
from ._ocispec import ANNOTATION_NETWORK

log = logging.getLogger("weenv.runtime")

#: Network modes a gVisor env can have (the sandbox's own stack; no veth, no host network).
GVISOR_NETWORK_MODES = ("none", "loopback")
PLATFORMS = ("kvm", "ptrace")
#: An empty directory on the host (made once, root's, 0700). Each ``runsc run`` mounts a tmpfs
#: here in a mount namespace of its own and binds the env's rootfs and bundle into it: the only
#: directories above them are then ``/`` and ``/run`` (see :mod:`._gvisor`).
RUNSC_VIEW_DIR = "/run/weenv-gvisor"
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND = 0x2, 0x4, 0x8, 0x1000
#: mount_setattr's recursive options, which weenv gives plan mounts (crun applies them to submounts)
_RECURSIVE_FLAGS = frozenset({"rro", "rnosuid", "rnodev", "rnoexec"})


class PlatformProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`probe_platform` found: the platform to use and why the others were passed over."""

    platform: str
    runsc_version: str
    kernel_release: str
    results: dict[str, str]
    """platform -> "ok" or why it did not work ("hung for 5 s", "exit status 1: ...", "no /dev/kvm")."""


def _runsc_version(runsc: str) -> str:
    try:
        out = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.splitlines()[0].strip() if out else ""


def _probe_one(runsc: str, platform: str, static_binary: str, work: str, timeout_s: float) -> str:
    """Run ``static_binary --version`` as a container on ``platform``; "ok" or why not."""
    root = os.path.join(work, f"state-{platform}")
    bundle = os.path.join(work, f"bundle-{platform}")
    rootfs = os.path.join(bundle, "rootfs")
    os.makedirs(rootfs, exist_ok=True)
    os.makedirs(root, exist_ok=True)
    shutil.copy2(static_binary, os.path.join(rootfs, "probe"))
    spec = {
        "ociVersion": "1.0.2",
        "process": {"args": ["/probe", "--version"], "cwd": "/", "user": {"uid": 0, "gid": 0}, "env": ["PATH=/"]},
        "root": {"path": rootfs, "readonly": True},
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(spec, f)
    base = [runsc, "--root", root, "--network=none", "--ignore-cgroups", f"--platform={platform}"]
    cid = f"weenv-probe-{platform}-{os.getpid()}"
    # not /dev/null: runsc chowns its stdio to the sandbox's user (nobody), the host's /dev/null with it
    stdin_r = _empty_stdin()
    stdout = os.open(os.path.join(bundle, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        proc = subprocess.run([*base, "run", "--bundle", bundle, cid], stdin=stdin_r,
                              stdout=stdout, stderr=subprocess.PIPE, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"hung for {timeout_s:g} s"
    except OSError as e:
        return f"could not run runsc: {e}"
    finally:
        os.close(stdin_r)
        os.close(stdout)
        subprocess.run([*base, "delete", "--force", cid], capture_output=True, timeout=30)
    if proc.returncode != 0:
        return f"exit status {proc.returncode}: {proc.stderr.decode(errors='replace').strip()[-300:]}"
    return "ok"


def probe_platform(runsc: str, static_binary: str, *, cache_dir: str | None = None, timeout_s: float = 5.0,
                   kvm_device: str = "/dev/kvm") -> PlatformProbe:
    """Find the fastest gVisor platform that runs a container here: ``kvm`` if ``kvm_device`` is
    there and a probe container on it exits within ``timeout_s``, else ``ptrace`` (probed too).
    Raises :class:`HostError` when neither works. With ``cache_dir`` the answer is kept for the
    same runsc version and kernel (a probe costs about a second, a hung kvm ``timeout_s`` more)."""
    version = _runsc_version(runsc)
    kernel = os.uname().release
    cache = os.path.join(cache_dir, "platform.json") if cache_dir else None
    if cache is not None:
        try:
            with open(cache, "rb") as f:
                found = msgspec.json.decode(f.read(), type=PlatformProbe)
            if found.runsc_version == version and found.kernel_release == kernel:
                return found
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass
    results: dict[str, str] = {}
    chosen = None
    with tempfile.TemporaryDirectory(prefix="weenv-runsc-probe-") as work:
        for platform in PLATFORMS:
            if platform == "kvm" and not os.path.exists(kvm_device):
                results[platform] = f"no {kvm_device}"
                continue
            results[platform] = _probe_one(runsc, platform, static_binary, work, timeout_s)
            if results[platform] == "ok":
                chosen = platform
                break
    if chosen is None:
        raise HostError("runsc cannot run a container on this host: " + "; ".join(f"{k}: {v}" for k, v in results.items()))
    found = PlatformProbe(platform=chosen, runsc_version=version, kernel_release=kernel, results=results)
    if cache is not None:
        os.makedirs(cache_dir, exist_ok=True)  # type: ignore[arg-type]
        atomic_write(cache, msgspec.json.encode(found), mode=None, fsync=False)
    log.info("gVisor platform: %s (%s)", chosen, ", ".join(f"{k}: {v}" for k, v in results.items()))
    return found


def gvisor_spec(spec: Mapping, rootfs: str) -> dict:
    """The crun spec weenv builds, as runsc takes it: the rootfs's own /tmp bound over the tmpfs
    gVisor would mount there, no recursive mount flags, and the refusals (network modes the
    sandbox cannot have)."""
    spec = json.loads(json.dumps(spec))  # a deep copy: the caller's spec stays as built
    network = spec.get("annotations", {}).get(ANNOTATION_NETWORK, "none")
    if network not in GVISOR_NETWORK_MODES:
        raise SpecError(f"network = {network!r} is not available under gVisor (only {' or '.join(GVISOR_NETWORK_MODES)})")
    if any(ns.get("path") for ns in spec.get("linux", {}).get("namespaces", ())):
        raise SpecError("gVisor envs cannot join an existing namespace")
    spec["root"] = {**spec.get("root", {}), "path": rootfs}
    mounts = spec.setdefault("mounts", [])
    for m in mounts:
        # this runsc refuses the recursive flags ("unknown mount option"), and needs none of them:
        # a spec mount is one mount of the Sentry, its flags hold for every file below it
        if any(o in _RECURSIVE_FLAGS for o in m.get("options", ())):
            m["options"] = [o for o in m["options"] if o not in _RECURSIVE_FLAGS]
    if os.path.isdir(os.path.join(rootfs, "tmp")) and not any(m.get("destination") == "/tmp" for m in mounts):
        setuid = spec.get("process", {}).get("noNewPrivileges", True) is False  # a plan's setuid = true
        mounts.append({"destination": "/tmp", "type": "bind", "source": os.path.join(rootfs, "tmp"),
                       "options": ["rbind", "nodev", *([] if setuid else ["nosuid"])]})
    return spec


def range_root(spec: Mapping) -> tuple[int, int]:
    """The host uid and gid of the env's root: what runsc's gofer opens files as (0, 0 without a
    user namespace)."""
    linux = spec.get("linux", {})

    def host(mappings: Sequence[Mapping]) -> int:
        return next((int(m["hostID"]) for m in mappings if int(m.get("containerID", -1)) == 0), 0)

    return host(linux.get("uidMappings") or ()), host(linux.get("gidMappings") or ())


def runsc_view_spec(spec: Mapping, rootfs: str, bundle_dir: str, view_dir: str = RUNSC_VIEW_DIR) -> dict:
    """``spec`` with the rootfs and every bind source under ``rootfs`` or ``bundle_dir`` named as
    runsc sees them in its own mount namespace: ``view_dir/rootfs`` and ``view_dir/bundle``
    (:func:`enter_runsc_view` binds them there). Other sources (plan mounts, the init, cgroups)
    keep their paths."""
    spec = json.loads(json.dumps(spec))
    moved = ((os.path.abspath(rootfs), os.path.join(view_dir, "rootfs")),  # first: it may be in the bundle
             (os.path.abspath(bundle_dir), os.path.join(view_dir, "bundle")))

    def view(path: str) -> str:
        for real, seen in moved:
            if path == real or path.startswith(real + "/"):
                return seen + path[len(real):]
        return path

    spec["root"] = {**spec.get("root", {}), "path": os.path.join(view_dir, "rootfs")}
    for m in spec.get("mounts", ()):
        if m.get("type") == "bind" and os.path.isabs(m.get("source", "")):
            m["source"] = view(m["source"])
    return spec


def enter_runsc_view(view_dir: str, rootfs: str, bundle_dir: str, gid: int) -> None:
    """Move the calling thread (a fresh one: it never goes back) into a new private mount
    namespace in which ``view_dir`` is a tmpfs (``root:<gid> 0710``) holding ``rootfs`` and
    ``bundle`` bound from ``rootfs`` and ``bundle_dir``. Processes the thread spawns inherit it."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # private first: nothing mounted below may propagate to the host's namespace
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _check(_libc.mount(b"weenv-gvisor", os.fsencode(view_dir), b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                       f"mode=0710,uid=0,gid={gid},size=64k,nr_inodes=16".encode()), f"mount a tmpfs on {view_dir}")
    for name, source in (("rootfs", rootfs), ("bundle", bundle_dir)):
        target = os.path.join(view_dir, name)
        os.mkdir(target, 0o700)
        _check(_libc.mount(os.fsencode(source), os.fsencode(target), None, _MS_BIND | MS_REC, None),
               f"bind {source} on {target}")


def ensure_view_dir(view_dir: str) -> None:
    """``view_dir`` as :data:`RUNSC_VIEW_DIR` must be: a directory of root's (not a symlink), made if missing."""
    try:
        os.mkdir(view_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise HostError(f"gVisor envs need an empty directory {view_dir} (to show runsc the env's rootfs): {e}") from None
    st = os.lstat(view_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        raise HostError(f"{view_dir} is not a directory of root's: gVisor envs mount their view of the rootfs on it "
                        "(in a namespace of their own); remove it")


# A POSIX shell, run as the env's root, that says which directory stops it: chdir, not test -x,
# so ACLs count as the kernel counts them.
_WALK = 'for d; do cd "$d" 2>/dev/null || { printf "%s\\n" "$d"; exit 1; }; done'


def first_untraversable(path: str, uid: int, gid: int) -> str | None:
    """The first directory on the way to ``path`` (``path`` itself excluded) that host ``uid``
    (group ``gid``, no other groups) cannot walk through, or None."""
    dirs, d = [], os.path.dirname(os.path.abspath(path))
    while True:
        dirs.append(d)
        if d == "/":
            break
        d = os.path.dirname(d)
    try:
        proc = subprocess.run(["/bin/sh", "-c", _WALK, "weenv-walk", *reversed(dirs)], user=uid, group=gid,
                              extra_groups=[], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode == 0:
        return None
    return proc.stdout.decode(errors="replace").strip() or None


def unreachable_sources(spec: Mapping, view_dir: str = RUNSC_VIEW_DIR) -> list[tuple[str, str]]:
    """(source, directory) for each bind source of ``spec`` (and its root) that the env's root
    cannot reach on the host, naming the directory that stops it; [] without a user namespace.
    Paths under ``view_dir`` are runsc's view (:func:`runsc_view_spec`), reachable by design."""
    uid, gid = range_root(spec)
    if uid == 0:
        return []
    paths = [spec.get("root", {}).get("path", "")]
    paths += [m["source"] for m in spec.get("mounts", ()) if m.get("type") == "bind" and os.path.isabs(m.get("source", ""))]
    out = []
    for p in dict.fromkeys(p for p in paths if p and p != view_dir and not p.startswith(view_dir + "/")):
        blocked = first_untraversable(p, uid, gid)
        if blocked is not None:
            out.append((p, blocked))
    return out


def unreachable_message(blocked: Sequence[tuple[str, str]], uid: int) -> str:
    """What to tell the user about :func:`unreachable_sources`' answer: each path, the directory
    that stops the env's root, and the commands that let it through."""
    dirs = " ".join(shlex.quote(d) for d in dict.fromkeys(d for _, d in blocked))
    return (f"runsc cannot start the env: its root (host uid {uid}) cannot reach "
            + "; ".join(f"{src} (stopped at {d}, which it may not walk through)" for src, d in blocked)
            + f". Let it through with `setfacl -m u:{uid}:x {dirs}` (or `chmod o+x {dirs}`), or use a path it can reach")


def sandbox_alive(pid: int, state_dir: str) -> bool:
    """The sandbox process ``pid`` runs (not a zombie) and is one of ours (a reused pid is not)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return st[st.rindex(b")") + 2:][:1] not in (b"Z", b"X") and os.fsencode(state_dir) in cmd


def ps_table(out: bytes) -> dict[int, int]:
    """pid -> ppid from ``runsc ps`` (a table: UID PID PPID C TTY STIME TIME CMD; its json
    format holds only pids)."""
    table = {}
    for line in out.decode(errors="replace").splitlines()[1:]:
        f = line.split()
        if len(f) >= 3 and f[1].isdigit() and f[2].isdigit():
            table[int(f[1])] = int(f[2])
    return table
