"""Volumes: node-local persistent storage that envs mount, shared by them and outliving them.

A volume is ``$WEENV_HOME/volumes/<id>/``: ``volume.json`` (its record), ``image`` (a sparse file
holding an ext4 file system of the volume's size) and ``mnt/`` (where that file system is mounted
on the host while something uses it). The size is the file system's: a write past it is ENOSPC
inside the env, whatever the env does (no reserved blocks: ``mkfs.ext4 -m 0``). Why a loop-mounted
image: the node's own file system here has no project quotas (ext4 without ``prjquota``), a tmpfs
would not survive a reboot, and an image file costs ~10 ms to make and ~10 ms to mount
(:func:`host_support` says what is missing on a node that cannot; creates then fail, saying so).

The host mount exists while an env mounts the volume or a file call runs: an env's start mounts
it (or finds it mounted) and binds it at ``envs/<env>/vol/<i>`` (under the env's own directory, so
env root in its user namespace needs to walk only that, as with the rootfs), from where crun binds
it into the env, read-write or read-only. The end of the last env that uses it unmounts it, and the
loop device goes with it (autoclear). A volume's loop device is looked up before a new one is
attached (``losetup -j``): one image is never behind two block devices, whose two ext4 mounts would
corrupt it. The host mounts survive a daemon restart (so do the envs using them); ``gc`` and the
start after a restart unmount the ones nothing uses.

File calls from the host (the volume content API) resolve every path inside the volume with
:class:`~weenv.provision.envs._files.RootFS` (``openat2(RESOLVE_IN_ROOT)``): a symlink an env
planted in a volume never leads the daemon out of it. Files it writes belong to the env ids the
caller names (root by default), as the host sees them in the node's user namespace range.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ... import _atomic
from .._errors import EnvFileError, EnvFileTypeError, ProvisionError
from ..runtime._idmap import IdMap
from . import _mounts
from ._files import FileInfo, RootFS, normalize

log = logging.getLogger("weenv.daemon")

VOLUME_ID = re.compile(r"^vol-[0-9a-f]{12}$")
VOLUME_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MIN_VOLUME_BYTES = 16 << 20  # ext4 with its journal needs a few MiB of its own
MAX_VOLUME_BYTES = 64 << 40
DEFAULT_VOLUME_BYTES = 1 << 30
MKFS_OPTIONS = ["-q", "-F", "-m", "0", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"]
_CMD_TIMEOUT_S = 60


class VolumeError(ProvisionError):
    """A volume call that cannot be done (kind ``bad_request``, or the subclass's)."""


class VolumeNotFoundError(VolumeError, LookupError):
    """No volume of that id or name on this node (kind ``volume_not_found``)."""


class VolumeExistsError(VolumeError):
    """A volume of that name exists already (kind ``conflict``)."""


class VolumeInUseError(VolumeError):
    """The volume is mounted by envs (named in the message; kind ``volume_in_use``)."""


class VolumeRecord(msgspec.Struct, kw_only=True):
    id: str
    name: str
    size_bytes: int
    created_s: float = msgspec.field(default_factory=time.time)

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "size_bytes": self.size_bytes, "created_s": self.created_s}


def host_support() -> str | None:
    """Why this node cannot make size-bounded volumes (None: it can): loop devices and mkfs.ext4."""
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 is not installed (apt-get install e2fsprogs)"
    if shutil.which("losetup") is None:
        return "losetup is not installed (apt-get install mount)"
    if not os.path.exists("/dev/loop-control"):
        return "this kernel has no loop devices (/dev/loop-control is missing: modprobe loop)"
    try:
        with open("/proc/filesystems") as f:
            if not any(line.split()[-1] == "ext4" for line in f if line.strip()):
                return "this kernel has no ext4"
    except OSError as e:
        return f"/proc/filesystems: {e.strerror}"
    return None


def _run(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VolumeError(f"{argv[0]}: {e}") from None
    if out.returncode != 0:
        raise VolumeError(f"{' '.join(argv[:3])}...: {(out.stderr or out.stdout).strip()[-500:]}")
    return out.stdout


def _mounted(path: str) -> bool:
    return path in _mounts.mounts_under(path)


class VolumeStore:
    """The volumes of this node under ``root``; ``envs`` is the manager's env table (env id →
    record with ``volumes``, the ids it mounts), read to tell which volumes are in use; ``idmap``:
    envs run in a user namespace over that range (the volume's root belongs to the env's root).
    Blocking calls (every one but :meth:`list`): run them in a worker thread."""

    def __init__(self, root: str, *, envs: Mapping[str, Any], idmap: IdMap | None = None):
        self.root = root
        self.envs = envs
        self.idmap = idmap
        self._lock = threading.RLock()  # mounts, unmounts, creates and deletes, one at a time
        self._busy: dict[str, int] = {}  # volume id -> file calls in flight (they hold the host mount)

    # -- records ---------------------------------------------------------------------------------

    def _dir(self, vol_id: str) -> str:
        return os.path.join(self.root, vol_id)

    def mount_point(self, vol_id: str) -> str:
        return os.path.join(self._dir(vol_id), "mnt")

    def list(self) -> list[VolumeRecord]:
        out = []
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        for name in names:
            if VOLUME_ID.match(name):
                try:
                    with open(os.path.join(self.root, name, "volume.json"), "rb") as f:
                        out.append(msgspec.json.decode(f.read(), type=VolumeRecord))
                except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                    continue  # a create cut short: its directory holds no record (gc removes it)
        return out

    def get(self, ref: str) -> VolumeRecord:
        """The volume ``ref`` names: its id, else its name."""
        vols = self.list()
        for v in vols:
            if v.id == ref:
                return v
        for v in vols:
            if v.name == ref:
                return v
        raise VolumeNotFoundError(f"no volume {ref!r} on this node")

    def users(self, vol_id: str, *, but: str | None = None) -> list[str]:
        """The envs that mount the volume (``but`` one of them, being torn down)."""
        return sorted(e for e, rec in list(self.envs.items()) if vol_id in (getattr(rec, "volumes", None) or ())
                      and e != but)

    def info(self, rec: VolumeRecord) -> dict[str, Any]:
        used = None
        mnt = self.mount_point(rec.id)
        if _mounted(mnt):
            st = os.statvfs(mnt)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return {**rec.public(), "envs": self.users(rec.id), "mounted": used is not None, "used_bytes": used}

    # -- create and delete -----------------------------------------------------------------------

    def create(self, name: str | None = None, size_bytes: int | None = None) -> VolumeRecord:
        """A new, empty volume of ``size_bytes`` (default 1 GiB; the image is sparse: it takes the
        disk its files take). ``name`` is unique on the node (default: the id)."""
        why = host_support()
        if why is not None:
            raise VolumeError(f"this node cannot make volumes with a size limit: {why}")
        size = DEFAULT_VOLUME_BYTES if size_bytes is None else int(size_bytes)
        if not MIN_VOLUME_BYTES <= size <= MAX_VOLUME_BYTES:
            raise VolumeError(f"a volume's size must be {MIN_VOLUME_BYTES >> 20} MiB to {MAX_VOLUME_BYTES >> 40} TiB, "
                              f"not {size} bytes")
        if name is not None and not VOLUME_NAME.match(name):
            raise VolumeError(f"volume name {name!r}: letters, digits, '_', '.' and '-' (at most 63, not starting "
                              "with '_', '.' or '-')")
        with self._lock:
            if name is not None and any(v.name == name or v.id == name for v in self.list()):
                raise VolumeExistsError(f"a volume named {name!r} exists on this node")
            vol_id = "vol-" + secrets.token_hex(6)
            d = self._dir(vol_id)
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            os.mkdir(d, 0o700)
            try:
                image = os.path.join(d, "image")
                with open(image, "xb") as f:
                    f.truncate(size)
                _run(["mkfs.ext4", *MKFS_OPTIONS, image])
                os.mkdir(os.path.join(d, "mnt"), 0o700)
                rec = VolumeRecord(id=vol_id, name=name or vol_id, size_bytes=size)
                self._attach(rec)
                try:  # the file system's root belongs to the env's root (and lost+found is not the env's)
                    mnt = self.mount_point(vol_id)
                    shutil.rmtree(os.path.join(mnt, "lost+found"), ignore_errors=True)
                    root_id = self.idmap.host(0) if self.idmap is not None else 0
                    os.chown(mnt, root_id, root_id)
                    os.chmod(mnt, 0o755)
                finally:
                    self._detach(vol_id)
                _atomic.atomic_write(os.path.join(d, "volume.json"), msgspec.json.encode(rec), mode=0o600)
            except BaseException:
                self._detach(vol_id)
                shutil.rmtree(d, ignore_errors=True)
                raise
        log.info("volume %s (%s) made: %d bytes", vol_id, rec.name, size)
        return rec

    def delete(self, ref: str) -> VolumeRecord:
        """Remove the volume and everything in it; refused while an env mounts it."""
        with self._lock:
            rec = self.get(ref)
            users = self.users(rec.id)
            if users:
                raise VolumeInUseError(f"volume {rec.name!r} ({rec.id}) is mounted by env {', '.join(users)}: "
                                       "kill the env first")
            if self._busy.get(rec.id):
                raise VolumeInUseError(f"volume {rec.name!r} ({rec.id}) has file calls in flight")
            self._detach(rec.id)
            os.unlink(os.path.join(self._dir(rec.id), "volume.json"))  # gone from the list at once
            shutil.rmtree(self._dir(rec.id), ignore_errors=True)
        log.info("volume %s (%s) deleted", rec.id, rec.name)
        return rec

    # -- the host mount --------------------------------------------------------------------------

    def _loop_of(self, image: str) -> str | None:
        out = _run(["losetup", "-j", image, "-O", "NAME", "-n"]).split()
        return out[0] if out else None

    def _attach(self, rec: VolumeRecord) -> str:
        """Mount the volume's file system at its mount point, unless it is; the mount point."""
        mnt = self.mount_point(rec.id)
        if _mounted(mnt):
            return mnt
        image = os.path.join(self._dir(rec.id), "image")
        loop = self._loop_of(image)  # still attached (an env holds it): the same device, never a second
        if loop is not None:
            _run(["mount", "-t", "ext4", "-o", "nosuid,nodev", loop, mnt])
        else:
            _run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev", image, mnt])
        return mnt

    def _detach(self, vol_id: str, timeout_s: float = 5.0) -> None:
        """Unmount the volume's file system and wait (bounded) for its loop device to go: autoclear
        detaches it after the last close, asynchronously, and a mount of the image meanwhile would
        find a device on its way out (or, by its deletion, an image file still held)."""
        mnt = self.mount_point(vol_id)
        was_mounted = False
        while _mounted(mnt):
            _mounts.unmount(mnt)
            was_mounted = True
        if not was_mounted:
            return
        image = os.path.join(self._dir(vol_id), "image")
        deadline = time.monotonic() + timeout_s
        while os.path.exists(image) and self._loop_of(image) is not None:
            if time.monotonic() > deadline:
                log.warning("volume %s: its loop device is still attached %g s after the unmount", vol_id, timeout_s)
                return
            time.sleep(0.02)

    def bind_for_env(self, env_id: str, ref: str, target_dir: str) -> tuple[VolumeRecord, str]:
        """Mount the volume (or find it mounted) and bind it at ``target_dir`` (a new directory in
        the env's own directory, which the env's teardown unmounts). The caller records the env as
        a user (``rec.volumes``) *before* calling, so that a release racing with it keeps the mount."""
        with self._lock:
            rec = self.get(ref)
            mnt = self._attach(rec)
            os.makedirs(target_dir, mode=0o755, exist_ok=True)
            _mounts._mount(mnt, target_dir, "", _MS_BIND, "")
        return rec, target_dir

    def release(self, vol_ids: Iterable[str], *, but: str | None = None) -> list[str]:
        """Unmount each volume that no env (but ``but``) and no file call uses; the problems met."""
        problems = []
        with self._lock:
            for vol_id in vol_ids:
                if self.users(vol_id, but=but) or self._busy.get(vol_id):
                    continue
                try:
                    self._detach(vol_id)
                except ProvisionError as e:
                    problems.append(f"volume {vol_id}: {e}")
        return problems

    def release_idle(self) -> list[str]:
        """Unmount every volume nothing uses, remove what a cut-short create left (gc); the ids unmounted."""
        done = []
        with self._lock:
            for name in (os.listdir(self.root) if os.path.isdir(self.root) else []):
                if not VOLUME_ID.match(name):
                    continue
                if not os.path.exists(os.path.join(self.root, name, "volume.json")):
                    self._detach(name)
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                    continue
                if _mounted(self.mount_point(name)) and not self.users(name) and not self._busy.get(name):
                    self._detach(name)
                    done.append(name)
        return done

    def file_root(self, env: Any, envs_dir: str, op: str, path: str, to: str | None) -> tuple[str, str, str | None]:
        """Where an env's file call acts: ``(root, path, to)``, the env's rootfs, or the volume's
        bind in the env's directory when ``path`` lies in a volume the env mounts (the host's view
        of the rootfs does not see the env's mounts), with the path made the volume's own. A write
        to a read-only volume is refused; a move between a volume and the rest is EXDEV's refusal."""
        from ._state import env_dir, rootfs_path

        norm = normalize(path)
        tables = [v for v in (env.lock.get("volumes") or []) if isinstance(v, dict)]
        for i, v in sorted(enumerate(tables), key=lambda iv: -len(iv[1].get("path", ""))):
            mp = v.get("path", "")
            if not mp or not (norm == mp or norm.startswith(mp + "/")):
                continue
            if v.get("read_only") and op not in ("read", "list", "stat", "archive"):
                raise EnvFileError("is in a read-only volume", path=path)
            rel = norm[len(mp):] or "/"
            if to is not None:
                tnorm = normalize(to)
                if not (tnorm == mp or tnorm.startswith(mp + "/")):
                    raise EnvFileError("cannot be moved out of its volume (another file system)", path=path)
                to = tnorm[len(mp):] or "/"
            return os.path.join(env_dir(envs_dir, env.id), "vol", str(i)), rel, to
        if to is not None and any(normalize(to) == v.get("path") or normalize(to).startswith(v.get("path", "") + "/")
                                  for v in tables):
            raise EnvFileError("cannot be moved into a volume (another file system)", path=to)
        return rootfs_path(envs_dir, env.id), path, to

    # -- file calls (the volume content API) -----------------------------------------------------

    def files(self, ref: str, op: str, path: str, *, data: bytes | Iterable[bytes] = b"", mode: int | None = None,
              uid: int | None = None, gid: int | None = None, recursive: bool = False,
              max_bytes: int | None = None) -> Any:
        """read | write | list | stat | mkdir | remove | chattr inside the volume, resolved in it as
        its root; ``uid``/``gid`` are env ids (what the env sees), default 0."""
        with self._lock:
            rec = self.get(ref)
            mnt = self._attach(rec)
            self._busy[rec.id] = self._busy.get(rec.id, 0) + 1
        try:
            return self._file_op(mnt, op, path, data=data, mode=mode, uid=uid, gid=gid, recursive=recursive,
                                 max_bytes=max_bytes)
        finally:
            with self._lock:
                self._busy[rec.id] -= 1
                if not self._busy[rec.id]:
                    del self._busy[rec.id]
            self.release([rec.id])

    def _file_op(self, mnt: str, op: str, path: str, *, data: Any, mode: int | None, uid: int | None,
                 gid: int | None, recursive: bool, max_bytes: int | None) -> Any:
        host = self.idmap.host if self.idmap is not None else (lambda i: i)
        env = self.idmap.env if self.idmap is not None else (lambda i: i)
        h_uid, h_gid = host(uid or 0), host(gid or 0)

        def seen(info: FileInfo) -> FileInfo:
            return msgspec.structs.replace(info, uid=env(info.uid), gid=env(info.gid))

        fs = RootFS(mnt, uid=h_uid, gid=h_gid)
        try:
            if op == "read":
                return fs.read(path, max_bytes=max_bytes) if max_bytes else fs.read(path)
            if op == "write":
                fs.write(path, data, mode=mode, uid=h_uid if uid is not None else None,
                         gid=h_gid if gid is not None else None, make_parents=True)
                return seen(fs.stat(path))
            if op == "list":
                return [seen(i) for i in fs.list(path)]
            if op == "stat":
                return seen(fs.stat(path))
            if op == "mkdir":
                fs.mkdir(path, parents=True, exist_ok=True, mode=0o755 if mode is None else mode)
                return seen(fs.stat(path))
            if op == "remove":
                fs.remove(path, recursive=recursive)
                return None
            if op == "chattr":
                _chattr(fs, path, mode, None if uid is None else h_uid, None if gid is None else h_gid)
                return seen(fs.stat(path))
        finally:
            fs.close()
        raise ValueError(f"unknown volume file operation {op!r}")


_MS_BIND = 4096


def _chattr(fs: RootFS, path: str, mode: int | None, uid: int | None, gid: int | None) -> None:
    """chmod/chown of a file or directory inside ``fs`` (a symlink is refused, never followed)."""
    try:
        pfd = fs._resolve(path, follow_last=False)
    except OSError as exc:
        raise fs._translate(exc, path) from exc
    try:
        st = os.fstat(pfd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise EnvFileTypeError("only files and directories have their mode or owner changed", path=path)
        fd = fs._reopen(pfd, os.O_RDONLY | (os.O_DIRECTORY if stat.S_ISDIR(st.st_mode) else 0))
        try:
            if uid is not None or gid is not None:
                os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
            if mode is not None:
                os.fchmod(fd, mode & 0o7777 & ~0o6000)  # never setuid or setgid from the API
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise fs._translate(exc, path) from exc
        raise EnvFileError(exc.strerror or str(exc), path=path) from exc
    finally:
        os.close(pfd)
