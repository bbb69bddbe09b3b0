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

import atexit
import hashlib
import hmac
import json
import logging
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
    """A bad name (kind ``bad_request``), a duplicate (``conflict``), or an entry that does not
    exist (``key_not_found``, ``template_not_found``); the message says which."""

    def __init__(self, message: str, kind: str = "bad_request"):
        super().__init__(message)
        self.kind = kind


def api_dir() -> str:
    return _home.path("api")


def _write_atomic(path: str, data: bytes, *, fsync: bool = True) -> None:
    """``data`` at ``path``, mode 0600 from the start (never via the umask), replaced in one rename
    (``fsync=False``: not synced to disk first; the caller has :data:`_SYNCER` do it)."""
    parent = os.path.dirname(path)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=parent)  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class _Syncer:
    """Files made durable soon after they were replaced, by a thread of its own (started on first
    use): the owner table is written on every create and remove the server answers, from its event
    loop, where an fsync on a busy disk held every other request for 5-15 ms. The new file is in
    place (other processes read it) before the write returns; only its way to the disk, and its
    directory's, comes after. Paths waiting are synced once, as they are then."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._waiting: set[str] = set()
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, path: str) -> None:
        with self._cv:
            self._waiting.add(path)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="weenv-api-fsync", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every path submitted so far is synced; False when ``timeout_s`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._waiting and not self._busy, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._waiting))
                paths, self._waiting, self._busy = self._waiting, set(), True
            try:
                for path in sorted(paths):
                    _fsync_path(path)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


def _fsync_path(path: str) -> None:
    try:
        for target, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)):
            fd = os.open(target, flags)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as e:
        logging.getLogger("weenv.api").error("syncing %s to disk: %s", path, e)


_SYNCER = _Syncer()
atexit.register(_SYNCER.flush)


class _JsonFile:
    """A JSON object in a file, reloaded when the file changes under us (another process wrote it).
    ``sync_later``: a write returns once the new file is in place; :data:`_SYNCER` syncs it."""

    def __init__(self, path: str, *, sync_later: bool = False):
        self.path = path
        self.sync_later = sync_later
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
            _write_atomic(self.path, json.dumps(data, indent=1, sort_keys=True).encode(), fsync=not self.sync_later)
            self._data, self._ident = data, self._identity()
        if self.sync_later:
            _SYNCER.submit(self.path)


def _check_name(name: str, what: str) -> str:
    if not _NAME.match(name or ""):
        raise StoreError(f"{what} name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit")
    return name


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ApiKey(dict):  # type: ignore[type-arg]
    """One key's record: ``name``, ``id``, ``admin``, ``created_s``, ``limits`` (and ``sha256``).

    ``id`` is new with every key, so a key made again under a revoked key's name is another
    key: it owns none of the old one's envs, and their access tokens do not work for it."""

    @property
    def name(self) -> str:
        return str(self["name"])

    @property
    def id(self) -> str:
        return str(self["id"])

    @property
    def admin(self) -> bool:
        return bool(self.get("admin"))

    @property
    def created_s(self) -> float:
        return float(self.get("created_s") or 0.0)

    def owner_fields(self) -> dict[str, Any]:
        """What an API record of something this key made says of its owner."""
        return {"owner": self.name, "owner_id": self.id}


def owns(key: ApiKey, rec: dict[str, Any] | None) -> bool:
    """Whether ``rec`` (an env's or snapshot's API record) is ``key``'s own (admin keys own nothing
    by this test: they may *use* everything, see :func:`may_use`).

    Records from before key ids name the owner only: they are the key's when it has that name and
    is older than the record (a key made later under the same name is not their owner)."""
    if rec is None:
        return False
    if rec.get("owner_id") is not None:
        return hmac.compare_digest(str(rec["owner_id"]), key.id)
    started = rec.get("started_s") or rec.get("created_s")
    return rec.get("owner") == key.name and (started is None or key.created_s <= float(started))


def may_use(key: ApiKey, rec: dict[str, Any] | None) -> bool:
    return key.admin or owns(key, rec)


def _legacy_id(rec: dict[str, Any]) -> str:
    return "k" + str(rec.get("sha256", ""))[:15]


def _public(rec: dict[str, Any]) -> ApiKey:
    out = {k: v for k, v in rec.items() if k != "sha256"}
    out.setdefault("id", _legacy_id(rec))
    return ApiKey(out)


REVOKED_ENVS = ("kill", "keep")


class KeyStore:
    """API keys. ``verify`` hashes what it is given and compares it with every stored hash
    (``hmac.compare_digest``), so the time it takes does not depend on which key matched.

    ``revoke`` keeps a record of the revoked key (its id, name and what becomes of its envs:
    ``kill``, the default, or ``keep`` for an admin); ``weenv serve`` acts on it
    (weenv/api/_reaper.py) and refuses the key's access tokens from the next request on."""

    def __init__(self, directory: str | None = None):
        self._file = _JsonFile(os.path.join(directory or api_dir(), "keys.json"))

    def create(self, name: str, *, admin: bool = False, limits: dict[str, Any] | None = None) -> str:
        """A new key named ``name``; returns the key (it is stored only as its hash)."""
        _check_name(name, "key")
        data = dict(self._file.read())
        keys = dict(data.get("keys", {}))
        if name in keys:
            raise StoreError(f"a key named {name!r} exists already (revoke it first)", "conflict")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        rec: dict[str, Any] = {"name": name, "id": "k" + secrets.token_hex(8), "sha256": _sha256(key),
                               "admin": admin, "created_s": time.time()}
        if limits:
            rec["limits"] = dict(limits)
        keys[name] = rec
        self._file.write({**data, "keys": keys})
        return key

    def list(self) -> list[ApiKey]:
        return [_public(rec) for rec in self._file.read().get("keys", {}).values()]

    def get(self, name: str) -> ApiKey:
        rec = self._file.read().get("keys", {}).get(name)
        if rec is None:
            raise StoreError(f"no key named {name!r} (see `weenv token ls`)", "key_not_found")
        return _public(rec)

    def set_limits(self, name: str, limits: dict[str, Any]) -> ApiKey:
        """Replace the given limits of key ``name`` (a value of None goes back to the default)."""
        data = dict(self._file.read())
        keys = dict(data.get("keys", {}))
        if name not in keys:
            raise StoreError(f"no key named {name!r} (see `weenv token ls`)", "key_not_found")
        merged = {**keys[name].get("limits", {}), **limits}
        keys[name] = {**keys[name], "limits": {k: v for k, v in merged.items() if v is not None}}
        self._file.write({**data, "keys": keys})
        return _public(keys[name])

    def defaults(self) -> dict[str, Any]:
        """The operator's default limits (``weenv token defaults``) for keys that set none."""
        return dict(self._file.read().get("defaults", {}))

    def set_defaults(self, limits: dict[str, Any]) -> dict[str, Any]:
        data = dict(self._file.read())
        merged = {**data.get("defaults", {}), **limits}
        data["defaults"] = {k: v for k, v in merged.items() if v is not None}
        self._file.write(data)
        return dict(data["defaults"])

    def revoke(self, name: str, *, envs: str = "kill") -> ApiKey:
        """Delete a key. Its envs are killed (``envs="kill"``) or kept for an admin (``"keep"``)
        by the server; either way their access tokens stop working at once."""
        if envs not in REVOKED_ENVS:
            raise StoreError(f"revoke: envs={envs!r} (kill or keep)")
        data = dict(self._file.read())
        keys = dict(data.get("keys", {}))
        if name not in keys:
            raise StoreError(f"no key named {name!r} (see `weenv token ls`)", "key_not_found")
        gone = _public(keys.pop(name))
        revoked = dict(data.get("revoked", {}))
        revoked[gone.id] = {"name": name, "revoked_s": time.time(), "envs": envs}
        self._file.write({**data, "keys": keys, "revoked": revoked})
        return gone

    def revoked(self) -> dict[str, dict[str, Any]]:
        """Revoked keys by id: ``{"name", "revoked_s", "envs": "kill" | "keep"}``."""
        return dict(self._file.read().get("revoked", {}))

    def live(self, key_id: str) -> ApiKey | None:
        """The key with id ``key_id``, if it still exists."""
        for rec in self._file.read().get("keys", {}).values():
            if hmac.compare_digest(str(rec.get("id") or _legacy_id(rec)), key_id):
                return _public(rec)
        return None

    def verify(self, presented: str | None) -> ApiKey | None:
        """The key's record, or None for a missing or unknown key."""
        if not presented:
            return None
        digest = _sha256(presented)
        found = None
        for rec in self._file.read().get("keys", {}).values():
            if hmac.compare_digest(digest, str(rec.get("sha256", ""))):
                found = rec
        return _public(found) if found else None


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

    def put(self, entries: dict[str, dict[str, Any]], *, drop: tuple[str, ...] | list[str] = ()) -> None:
        """Aliases ``weenv serve`` makes (templates built through the E2B SDK: ``NAME`` or
        ``NAME:TAG``, each entry naming its owner key), and ``drop`` removed, in one write."""
        for name in entries:
            base, _, tag = name.partition(":")
            _check_name(base, "template")
            if tag:
                _check_name(tag, "tag")
        data = {k: v for k, v in self._file.read().items() if k not in set(drop)}
        self._file.write({**data, **entries})

    def list(self) -> dict[str, dict[str, str]]:
        return dict(self._file.read())

    def remove(self, name: str) -> None:
        data = dict(self._file.read())
        if name not in data:
            raise StoreError(f"no template named {name!r} (see `weenv template ls`)", "template_not_found")
        del data[name]
        self._file.write(data)


GONE_KEEP_S = 600.0
GONE_KEEP_MAX = 2000


class OwnerTable:
    """Envs and snapshots made through the API: their owner (a key name) and E2B facts.

    Written only by the server (one process), read on every request; kept small by dropping
    envs the daemon no longer knows (:meth:`forget_envs`)."""

    def __init__(self, directory: str | None = None):
        # written from the server's event loop on every create and remove: synced to disk after
        self._file = _JsonFile(os.path.join(directory or api_dir(), "envs.json"), sync_later=True)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until what was written is on disk (the server calls it as it stops)."""
        return _SYNCER.flush(timeout_s)

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
        """The envs are gone. Who owned each is kept a while (:meth:`gone`), so a token of a gone
        env still names its owner: its calls answer "not running", not "wrong token"."""
        data = dict(self._file.read())
        drop = set(env_ids)
        old = data.get("envs", {})
        envs = {k: v for k, v in old.items() if k not in drop}
        if len(envs) != len(old):
            now = time.time()
            gone = {k: v for k, v in data.get("gone", {}).items() if now - float(v.get("gone_s", 0)) < GONE_KEEP_S}
            for k in drop & set(old):
                gone[k] = {f: old[k].get(f) for f in ("owner", "owner_id", "started_s")} | {"gone_s": now}
            if len(gone) > GONE_KEEP_MAX:
                gone = dict(sorted(gone.items(), key=lambda kv: kv[1]["gone_s"])[-GONE_KEEP_MAX:])
            self._file.write({**data, "envs": envs, "gone": gone})

    def gone(self, env_id: str) -> dict[str, Any] | None:
        """What is kept of a gone env's record (its owner), for :data:`GONE_KEEP_S`."""
        rec = self._file.read().get("gone", {}).get(env_id)
        if rec is None or time.time() - float(rec.get("gone_s", 0)) >= GONE_KEEP_S:
            return None
        return dict(rec)

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

    def volumes(self) -> dict[str, dict[str, Any]]:
        """Volumes made through the API (id -> owner, the E2B name, when)."""
        return dict(self._file.read().get("volumes", {}))

    def volume(self, vol_id: str) -> dict[str, Any] | None:
        return self._file.read().get("volumes", {}).get(vol_id)

    def put_volume(self, vol_id: str, record: dict[str, Any]) -> None:
        data = dict(self._file.read())
        data["volumes"] = {**data.get("volumes", {}), vol_id: record}
        self._file.write(data)

    def forget_volume(self, vol_id: str) -> None:
        data = dict(self._file.read())
        vols = dict(data.get("volumes", {}))
        if vols.pop(vol_id, None) is not None:
            self._file.write({**data, "volumes": vols})


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
    """Per-env access and traffic tokens: ``HMAC-SHA256(secret, kind, env id, owner key id)``,
    url-safe base64. A token names its env and the key that owns it: it stops working when that
    key is revoked (the caller checks the owner is live, :meth:`OwnerTable.owner_id`), and a
    token minted for one owner never works for an env another key owns."""

    def __init__(self, directory: str | None = None):
        self._key = _secret(directory)

    def _mac(self, kind: str, env_id: str, owner_id: str) -> str:
        import base64

        msg = f"{kind}:{len(env_id)}:{env_id}:{owner_id}".encode()
        return base64.urlsafe_b64encode(hmac.new(self._key, msg, hashlib.sha256).digest()).decode().rstrip("=")

    def mint(self, env_id: str, owner_id: str) -> str:
        return "wea_" + self._mac("env-access", env_id, owner_id)

    def verify(self, env_id: str, owner_id: str, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(self.mint(env_id, owner_id), presented or "")

    def sign(self, kind: str, subject: str, owner_id: str) -> str:
        """An HMAC of ``subject`` for ``kind`` (another kind than the env tokens'): a signed upload URL."""
        if kind in ("env-access", "env-traffic"):
            raise ValueError(f"kind {kind!r} is the env tokens'")
        return self._mac(kind, subject, owner_id)

    def mint_traffic(self, env_id: str, owner_id: str) -> str:
        """The token for the env's ports when they are not public (E2B's ``trafficAccessToken``,
        sent as ``e2b-traffic-access-token``): another key than the access token's, so handing out
        a port URL's token opens no envd."""
        return "wet_" + self._mac("env-traffic", env_id, owner_id)

    def verify_traffic(self, env_id: str, owner_id: str, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(self.mint_traffic(env_id, owner_id), presented or "")

    def mint_volume(self, vol_id: str, owner_id: str) -> str:
        """A volume's content token (E2B's volume ``token``, sent as ``Authorization: Bearer``): its
        volume's files only, for as long as the key that owns it lives."""
        return "wev_" + self._mac("volume", vol_id, owner_id)

    def verify_volume(self, vol_id: str, owner_id: str, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(self.mint_volume(vol_id, owner_id), presented or "")
