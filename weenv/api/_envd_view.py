"""envd's view of one env (its id, its daemon, the user a request acts as) and what every envd
module shares: limits, the Connect message base, envd's EntryInfo, error translation."""

from __future__ import annotations

import datetime as dt
import posixpath
import stat as stat_mod
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from .._aclient import AsyncClient, AsyncEnv
from .._connection import ApiError as DaemonError
from .._wire import FileInfo
from ._common import ApiState, HttpError, owner_id
from ._connect import (
    Code,
    ConnectError,
    code_for_http_status,
)
from ._store import ApiKey

MAX_RPC_BODY_BYTES = 1 << 20
MAX_LIST_ENTRIES = 10_000
MAX_WATCH_ENTRIES = 10_000
MAX_WATCHERS = 16384
"""A bound on every key's watchers together (memory); each key is held to its own quota first."""
MAX_WATCHERS_PER_ENV = 64
MAX_WATCH_DIRS = 256
WATCHER_IDLE_S = 120.0
WATCH_POLL_S = 0.25
KEEPALIVE_S = 50.0

_FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}



# -- request messages (proto JSON: camelCase names; unknown fields ignored, as proto JSON readers do) --


class _Message(msgspec.Struct, rename="camel", kw_only=True):
    pass



# -- the env, through the daemon ----------------------------------------------------------------


@dataclass
class EnvView:
    """One request's env: its id, its daemon, and the user the request acts as."""

    state: ApiState
    env_id: str
    user: str | None

    @property
    def client(self) -> AsyncClient:
        return self.state.backend.for_env(self.env_id)

    def owner_id(self) -> str:
        return owner_id(self.state, self.state.owners.env(self.env_id)) or ""

    def owner(self) -> ApiKey | None:
        """The key that owns the env (its quotas apply to what this request starts), if any."""
        oid = self.owner_id()
        return self.state.keys.live(oid) if oid else None

    @property
    def env(self) -> AsyncEnv:
        """The env on its daemon."""
        return self.client.env(self.env_id)

    async def stat(self, path: str) -> FileInfo:
        """The entry, with its ``user.*`` extended attributes (E2B's file metadata)."""
        if not in_env_mounts(path):
            return await self.env.stat(path, xattrs=True)
        r = await self.env.exec(["stat", "-c", "%s %a %u %g %Y %F", "--", path], user=self.user,
                                timeout_s=MOUNTED_TIMEOUT_S)
        parts = r.stdout.decode("utf-8", "replace").strip().split(" ", 5)
        if r.exit_code != 0 or len(parts) != 6 or not all(p.isdigit() for p in parts[:5]):
            raise DaemonError(404, "file_not_found", f"{path}: no such file in the env")
        size, mode, uid, gid, mtime, kind = parts
        return FileInfo(name=posixpath.basename(path), kind=_STAT_KINDS.get(kind, kind.split()[-1]), size_bytes=int(size),
                        mode=int(mode, 8), uid=int(uid), gid=int(gid), mtime_s=float(mtime))

    async def read_mounted(self, path: str) -> bytes:
        """A file of what the env mounts itself (/proc, /sys, /dev, its /etc/hosts...), read in the
        env's own mount namespace (the node's view of its rootfs has none of them)."""
        r = await self.env.exec(["cat", "--", path], user=self.user, timeout_s=MOUNTED_TIMEOUT_S)
        if r.stdout_truncated:
            raise DaemonError(413, "too_large", f"{path}: larger than a command's output may be")
        if r.exit_code != 0:
            err = r.stderr.decode("utf-8", "replace").strip()[:200]
            raise DaemonError(404, "file_not_found", f"{path}: no such file in the env ({err})")
        return r.stdout

    async def listdir(self, path: str, *, xattrs: bool = True) -> list[FileInfo]:
        return await self.env.list_dir(path, xattrs=xattrs)

    async def acting_user(self) -> str | None:
        """Who the request acts as: the SDK's user, else the env's own default (its plan's user;
        None: root). Files it makes without a user belong to that one, as in E2B."""
        return self.user or await _default_user(self)

    async def home(self) -> str:
        """The acting user's home directory, from the env's /etc/passwd (root: /root)."""
        return await _home(self, await self.acting_user())

    async def path(self, path: str, what: str = "path") -> str:
        """``path`` as the absolute path it names: relative paths are the acting user's home's, as in E2B."""
        _check_path(path, what)
        if path.startswith("/"):
            return posixpath.normpath(path)
        return posixpath.normpath(posixpath.join(await self.home(), path))


_defaults_cache: dict[str, tuple[float, str | None]] = {}
CACHE_S = 10.0


async def _default_user(view: EnvView) -> str | None:
    hit = _defaults_cache.get(view.env_id)
    if hit is not None and time.monotonic() - hit[0] < CACHE_S:
        return hit[1]
    user = (await view.env.refresh()).user or None
    if len(_defaults_cache) > 4096:
        _defaults_cache.clear()
    _defaults_cache[view.env_id] = (time.monotonic(), user)
    return user


async def _home(view: EnvView, user: str | None) -> str:
    """The home of ``user`` (a name or uid, optionally ``:group``) in the env's /etc/passwd."""
    who = (user or "root").split(":", 1)[0]
    if who in ("root", "0"):
        return "/root"
    homes = await _passwd(view)
    for name, uid, home in homes:
        if who in (name, uid):
            return home or "/"
    return "/" if who.isdigit() else f"/home/{who}"


_passwd_cache: dict[str, tuple[float, list[tuple[str, str, str]]]] = {}


async def _passwd(view: EnvView) -> list[tuple[str, str, str]]:
    """(name, uid, home) of each /etc/passwd line of the env (cached a few seconds)."""
    hit = _passwd_cache.get(view.env_id)
    if hit is not None and time.monotonic() - hit[0] < CACHE_S:
        return hit[1]
    out: list[tuple[str, str, str]] = []
    try:
        text = (await view.env.read_file("/etc/passwd")).decode("utf-8", "replace")
        for line in text.splitlines()[:10_000]:
            parts = line.split(":")
            if len(parts) >= 6:
                out.append((parts[0], parts[2], parts[5]))
    except DaemonError:
        pass
    if len(_passwd_cache) > 4096:
        _passwd_cache.clear()
    _passwd_cache[view.env_id] = (time.monotonic(), out)
    return out


MOUNTED_TIMEOUT_S = 10.0
_MOUNTED_DIRS = ("/proc", "/sys", "/dev")
_MOUNTED_FILES = ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf")
_STAT_KINDS = {"regular file": "file", "regular empty file": "file", "directory": "dir", "symbolic link": "symlink"}


def in_env_mounts(path: str) -> bool:
    """Whether ``path`` (absolute, normalized) lies in what the env mounts itself: read in the env."""
    return path in _MOUNTED_DIRS or path.startswith(tuple(d + "/" for d in _MOUNTED_DIRS)) or path in _MOUNTED_FILES


_names_cache: dict[tuple[str, str], tuple[float, dict[int, str]]] = {}


async def _names(view: EnvView, which: str) -> dict[int, str]:
    """uid/gid -> name from the env's /etc/passwd or /etc/group (cached a few seconds)."""
    key = (view.env_id, which)
    hit = _names_cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < 10.0:
        return hit[1]
    names: dict[int, str] = {}
    try:
        text = (await view.env.read_file(f"/etc/{which}")).decode("utf-8", "replace")
        for line in text.splitlines()[:10_000]:
            parts = line.split(":")
            if len(parts) >= 3 and parts[2].isdigit():
                names.setdefault(int(parts[2]), parts[0])
    except DaemonError:
        pass
    if len(_names_cache) > 4096:
        _names_cache.clear()
    _names_cache[key] = (time.monotonic(), names)
    return names


def _ts(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat().replace("+00:00", "Z")


async def _entry(view: EnvView, info: dict[str, Any], path: str) -> dict[str, Any]:
    """weenv's FileInfo as envd's EntryInfo (proto JSON: camelCase, int64 as a string, enum names)."""
    users, groups = await _names(view, "passwd"), await _names(view, "group")
    kind = info.get("kind", "file")
    mode = int(info.get("mode", 0))
    type_bits = {"dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK}.get(kind, stat_mod.S_IFREG)
    out: dict[str, Any] = {
        "name": info.get("name") or posixpath.basename(path.rstrip("/")) or "/",
        "type": _FILE_TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
        "path": path, "size": str(int(info.get("size_bytes", 0))), "mode": mode,
        "permissions": stat_mod.filemode(type_bits | mode),
        "owner": users.get(int(info.get("uid", 0)), str(info.get("uid", 0))),
        "group": groups.get(int(info.get("gid", 0)), str(info.get("gid", 0))),
        "modifiedTime": _ts(float(info.get("mtime_s", 0.0))),
    }
    if kind == "symlink":
        out["isSymlink"] = True
        out["symlinkTarget"] = info.get("link_target") or ""
    meta = metadata_of(info.get("xattrs"))
    if meta:
        out["metadata"] = meta
    return out


E2B_XATTRS = "e2b."
"""E2B's file metadata is its ``user.e2b.*`` extended attributes (``KEY`` -> ``user.e2b.KEY``)."""


def metadata_of(xattrs: dict[str, str] | None) -> dict[str, str]:
    return {k[len(E2B_XATTRS):]: v for k, v in (xattrs or {}).items() if k.startswith(E2B_XATTRS)}


def _check_path(path: str, what: str = "path") -> None:
    if not path:
        raise ConnectError(Code.INVALID_ARGUMENT, f"{what} is required")
    if "\x00" in path:
        raise ConnectError(Code.INVALID_ARGUMENT, f"{what} holds a NUL byte")


def _rpc_error(e: DaemonError | HttpError, path: str | None = None) -> ConnectError:
    status = e.status
    message = e.detail if isinstance(e, DaemonError) else e.message
    kind = e.kind
    if kind == "env_not_found":
        return ConnectError(Code.UNAVAILABLE, f"sandbox was not found: {message}")
    if kind == "wrong_state":
        return ConnectError(Code.UNAVAILABLE, f"sandbox is not running: {message}")
    if kind == "file_not_found":
        return ConnectError(Code.NOT_FOUND, message)
    if kind == "file_error":
        return ConnectError(Code.INVALID_ARGUMENT, message)
    return ConnectError(code_for_http_status(status), message)


def _decode_message(data: bytes, cls: type[_Message]) -> Any:
    """The request message as ``cls``; a wrong one is INVALID_ARGUMENT naming the place (``at `$.path```)."""
    try:
        return msgspec.json.decode(data or b"{}", type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ConnectError(Code.INVALID_ARGUMENT, f"request message: {e}") from None
