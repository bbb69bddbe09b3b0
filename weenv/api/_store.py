"""What the API server keeps under ``$WEENV_HOME/api/`` (every file 0600, written atomically):

- ``keys.json``: API keys, by name, as the sha256 of the key (keys are 256 random bits, so a
  plain hash is enough: nothing to brute-force). The key itself is shown once, at create.
- ``templates.json``: template aliases, ``NAME -> lock file | snapshot id``.
- ``envs.json``: who owns which env and snapshot, and the E2B facts weenv itself has no place
  for (metadata, template id, timeout). It is what survives a ``weenv serve`` restart.
- ``secret``: the key the per-env access tokens are derived from (HMAC-SHA256 of the env id),
  so a token can be handed out again (E2B's ``connect``) without being stored.

The CLI (``weenv token``, ``weenv template``) and the server are different processes: readers
look at the file's identity (inode, mtime, size) on every call and reload when it changed, so a
revoked key stops working on the next request.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
import threading
import time
from typing import Any

from .. import _home

__all__ = ["AccessTokens", "ApiKey", "KeyStore", "OwnerTable", "StoreError", "TemplateStore", "api_dir"]

KEY_PREFIX = "weenv_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class StoreError(ValueError):
    """A bad name, a duplicate, or an entry that does not exist; the message says which."""


def api_dir() -> str:
    return _home.path("api")


def _write_atomic(path: str, data: bytes) -> None:
    """``data`` at ``path``, mode 0600 from the start (never via the umask), replaced in one rename."""
    parent = os.path.dirname(path)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=parent)  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class _JsonFile:
    """A JSON object in a file, reloaded when the file changes under us (another process wrote it)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._ident: tuple[int, int, int] | None = None
        self._data: dict[str, Any] = {}

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self) -> dict[str, Any]:
        with self._lock:
            ident = self._identity()
            if ident != self._ident:
                if ident is None:
                    self._data = {}
                else:
                    with open(self.path, "rb") as f:
                        try:
                            self._data = json.loads(f.read() or b"{}")
                        except ValueError as e:
                            raise StoreError(f"{self.path}: not JSON ({e})") from None
                self._ident = ident
            return self._data

    def write(self, data: dict[str, Any]) -> None:
        with self._lock:
            _write_atomic(self.path, json.dumps(data, indent=1, sort_keys=True).encode())
            self._data, self._ident = data, self._identity()


def _check_name(name: str, what: str) -> str:
    if not _NAME.match(name or ""):
        raise StoreError(f"{what} name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit")
    return name


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ApiKey(dict):  # type: ignore[type-arg]
    """One key's record: ``name``, ``admin``, ``created_s`` (and ``sha256``)."""

    @property
    def name(self) -> str:
        return str(self["name"])

    @property
    def admin(self) -> bool:
        return bool(self.get("admin"))


class KeyStore:
    """API keys. ``verify`` hashes what it is given and compares it with every stored hash
    (``hmac.compare_digest``), so the time it takes does not depend on which key matched."""

    def __init__(self, directory: str | None = None):
        self._file = _JsonFile(os.path.join(directory or api_dir(), "keys.json"))

    def create(self, name: str, *, admin: bool = False) -> str:
        """A new key named ``name``; returns the key (it is stored only as its hash)."""
        _check_name(name, "key")
        data = dict(self._file.read())
        keys = dict(data.get("keys", {}))
        if name in keys:
            raise StoreError(f"a key named {name!r} exists already (revoke it first)")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        keys[name] = {"name": name, "sha256": _sha256(key), "admin": admin, "created_s": time.time()}
        self._file.write({**data, "keys": keys})
        return key

    def list(self) -> list[ApiKey]:
        return [ApiKey({k: v for k, v in rec.items() if k != "sha256"})
                for rec in self._file.read().get("keys", {}).values()]

    def revoke(self, name: str) -> None:
        data = dict(self._file.read())
        keys = dict(data.get("keys", {}))
        if name not in keys:
            raise StoreError(f"no key named {name!r} (see `weenv token ls`)")
        del keys[name]
        self._file.write({**data, "keys": keys})

    def verify(self, presented: str | None) -> ApiKey | None:
        """The key's record, or None for a missing or unknown key."""
        if not presented:
            return None
        digest = _sha256(presented)
        found = None
        for rec in self._file.read().get("keys", {}).values():
            if hmac.compare_digest(digest, str(rec.get("sha256", ""))):
                found = rec
        return ApiKey({k: v for k, v in found.items() if k != "sha256"}) if found else None


class TemplateStore:
    """Template aliases: ``NAME -> {"lock": path}`` or ``{"snapshot": id}``."""

    def __init__(self, directory: str | None = None):
        self._file = _JsonFile(os.path.join(directory or api_dir(), "templates.json"))

    def set(self, name: str, target: str) -> dict[str, str]:
        _check_name(name, "template")
        if target.startswith("snap-") and not os.path.exists(target):
            entry = {"snapshot": target}
        else:
            path = os.path.abspath(target)
            if not os.path.isfile(path):
                raise StoreError(f"template {name!r}: {target} is neither a lock/plan file nor a snapshot id "
                                 "(snap-...)")
            entry = {"lock": path}
        data = dict(self._file.read())
        data[name] = entry
        self._file.write(data)
        return entry

    def get(self, name: str) -> dict[str, str] | None:
        return self._file.read().get(name)

    def list(self) -> dict[str, dict[str, str]]:
        return dict(self._file.read())

    def remove(self, name: str) -> None:
        data = dict(self._file.read())
        if name not in data:
            raise StoreError(f"no template named {name!r} (see `weenv template ls`)")
        del data[name]
        self._file.write(data)


class OwnerTable:
    """Envs and snapshots made through the API: their owner (a key name) and E2B facts.

    Written only by the server (one process), read on every request; kept small by dropping
    envs the daemon no longer knows (:meth:`forget_envs`)."""

    def __init__(self, directory: str | None = None):
        self._file = _JsonFile(os.path.join(directory or api_dir(), "envs.json"))

    def envs(self) -> dict[str, dict[str, Any]]:
        return dict(self._file.read().get("envs", {}))

    def env(self, env_id: str) -> dict[str, Any] | None:
        return self._file.read().get("envs", {}).get(env_id)

    def put_env(self, env_id: str, record: dict[str, Any]) -> None:
        data = dict(self._file.read())
        data["envs"] = {**data.get("envs", {}), env_id: record}
        self._file.write(data)

    def update_env(self, env_id: str, **fields: Any) -> None:
        rec = self.env(env_id)
        if rec is not None:
            self.put_env(env_id, {**rec, **fields})

    def forget_envs(self, env_ids: list[str]) -> None:
        data = dict(self._file.read())
        envs = {k: v for k, v in data.get("envs", {}).items() if k not in set(env_ids)}
        if len(envs) != len(data.get("envs", {})):
            self._file.write({**data, "envs": envs})

    def snapshots(self) -> dict[str, dict[str, Any]]:
        return dict(self._file.read().get("snapshots", {}))

    def snapshot(self, snap_id: str) -> dict[str, Any] | None:
        return self._file.read().get("snapshots", {}).get(snap_id)

    def put_snapshot(self, snap_id: str, record: dict[str, Any]) -> None:
        data = dict(self._file.read())
        data["snapshots"] = {**data.get("snapshots", {}), snap_id: record}
        self._file.write(data)

    def forget_snapshot(self, snap_id: str) -> None:
        data = dict(self._file.read())
        snaps = dict(data.get("snapshots", {}))
        if snaps.pop(snap_id, None) is not None:
            self._file.write({**data, "snapshots": snaps})


def _secret(directory: str | None = None) -> bytes:
    path = os.path.join(directory or api_dir(), "secret")
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        pass
    value = secrets.token_bytes(32)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # first writer wins
    except FileExistsError:
        with open(path, "rb") as f:
            return f.read()
    with os.fdopen(fd, "wb") as f:
        f.write(value)
    return value


class AccessTokens:
    """Per-env access tokens: ``HMAC-SHA256(secret, env id)``, url-safe base64."""

    def __init__(self, directory: str | None = None):
        self._key = _secret(directory)

    def mint(self, env_id: str) -> str:
        import base64

        mac = hmac.new(self._key, b"env-access:" + env_id.encode(), hashlib.sha256).digest()
        return "wea_" + base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def verify(self, env_id: str, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(self.mint(env_id), presented or "")

    def mint_traffic(self, env_id: str) -> str:
        """The token for the env's ports when it was made with public traffic off (E2B's
        ``trafficAccessToken``, sent as ``e2b-traffic-access-token``): another key than the access
        token's, so handing out a port URL's token opens no envd."""
        import base64

        mac = hmac.new(self._key, b"env-traffic:" + env_id.encode(), hashlib.sha256).digest()
        return "wet_" + base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def verify_traffic(self, env_id: str, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(self.mint_traffic(env_id), presented or "")

