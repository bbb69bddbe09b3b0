"""The daemon's file operations on an env's rootfs (:func:`file_op`), and the identity a plan's
``user`` names there (:func:`resolve_user`): both through :class:`._files.RootFS`, so a hostile
symlink in the env cannot make weenv read or write a host file."""

from __future__ import annotations

from typing import Any

import msgspec

from .._errors import EnvFileError, EnvFileNotFoundError, EnvFileTypeError
from ..runtime._idmap import IdMap
from ..runtime._ocispec import User, parse_user
from ._files import _MAX_ACCOUNT_FILE_BYTES, RootFS
from ._xattrs import check_xattrs


def resolve_user(rootfs: RootFS | str, spec: str | int | None) -> User:
    """The numeric identity for a plan's ``user`` (``name``, ``uid``, ``name:group``, ...),
    looked up in the env's own /etc/passwd and /etc/group, read through :class:`RootFS` so a
    hostile symlink there cannot make weenv read a host file."""
    owned = isinstance(rootfs, str)
    fs = RootFS(rootfs) if isinstance(rootfs, str) else rootfs
    try:
        texts = []
        for name in ("/etc/passwd", "/etc/group"):
            try:
                texts.append(fs.read(name, max_bytes=_MAX_ACCOUNT_FILE_BYTES).decode("utf-8", errors="replace"))
            except (EnvFileNotFoundError, EnvFileTypeError):
                texts.append("")
        return parse_user(spec, texts[0], texts[1])
    finally:
        if owned:
            fs.close()


def file_op(root: str, op: str, path: str, *, data: bytes = b"", mode: int = 0o644, user: str | None = None,
            recursive: bool = False, max_bytes: int | None = None, idmap: IdMap | None = None,
            to: str | None = None, xattrs: dict[str, str] | bool | None = None,
            users_root: str | None = None) -> Any:
    """One file operation of the daemon API on the rootfs ``root``: read | write | list | stat | mkdir |
    remove | move (to ``to``) | extract | archive (:mod:`._archive`), as ``user`` (None: root). ``idmap``: the env runs in a user namespace over that host id
    range; files are written owned by the env's ids as the host has them, and owners are reported as
    the env sees them. ``xattrs``: for write, ``{NAME: value}`` set as ``user.NAME``; for stat and list,
    True reports each entry's ``user.*`` attributes. ``users_root``: where ``user`` is looked up
    (default ``root``; a volume has no account files: the env's rootfs). Blocks (a worker thread's call)."""

    def env_ids(info: Any) -> Any:  # owners as the env sees them
        if idmap is None:
            return info
        return msgspec.structs.replace(info, uid=idmap.env(info.uid), gid=idmap.env(info.gid))

    who = resolve_user(users_root or root, user) if user else None
    uid, gid = (who.uid, who.gid) if who else (0, 0)
    if idmap is not None:  # written on the host: owned by the env's ids as the host has them
        uid, gid = idmap.host(uid), idmap.host(gid)
    fs = RootFS(root, uid=uid, gid=gid)
    try:
        if op == "read":
            return fs.read(path, max_bytes=max_bytes) if max_bytes else fs.read(path)
        if op == "write":
            fs.write(path, data, mode=mode, make_parents=True,
                     xattrs=check_xattrs(xattrs) if isinstance(xattrs, dict) else None)
            return None
        if op == "list":
            return [env_ids(i) for i in fs.list(path, xattrs=xattrs is True)]
        if op == "stat":
            return env_ids(fs.stat(path, xattrs=xattrs is True))
        if op == "mkdir":
            fs.mkdir(path, parents=True, exist_ok=True, mode=mode if mode != 0o644 else 0o755)
            return None
        if op == "remove":
            fs.remove(path, recursive=recursive)
            return None
        if op == "move":
            if not to:
                raise EnvFileError("move needs a destination", path=path)
            fs.move(path, to)
            return env_ids(fs.stat(to))
        if op in ("extract", "archive"):  # data: the tar's chunks / where the tar's pieces go
            from ._archive import ChunkReader, archive, extract

            ident = (lambda i: i)
            if op == "extract":
                return extract(fs, path, ChunkReader(data), host_id=idmap.host if idmap else ident)
            return archive(fs, path, data, env_id=idmap.env if idmap else ident)  # type: ignore[arg-type]
    finally:
        fs.close()
    raise ValueError(f"unknown file operation {op!r}")
