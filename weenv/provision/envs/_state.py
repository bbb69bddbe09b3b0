"""What the daemon remembers about each env, persisted in ``$WEENV_HOME/envs/<id>/``.

A record is saved four to six times in a create, so a save must be cheap. It goes to one of two
slot files, ``state.a`` and ``state.b``, in turn, overwritten in place: the next save number
(:attr:`EnvRecord.state_seq`) picks the slot, and a header line carries the body's length and
CRC-32. :func:`load` takes the valid slot with the higher number, so a save cut short (a crash
mid-write) leaves the previous one to read. Replacing a file by rename instead cost 0.2-1.5 ms a
save here (a new inode each time, and ext4 flushing the new file's data when a rename replaces
one: ``auto_da_alloc``); an overwrite costs ~0.03 ms. ``state.json``, what daemons before this
one wrote, is read when no slot is there, and removed by the first save after it.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import zlib
from typing import Any, Literal

import msgspec
EnvStatus = Literal["creating", "pooled", "running", "paused", "stopping", "failed"]
STATE_FILE = "state.json"  # what daemons before the slots wrote (read, then removed)
SLOTS = ("state.a", "state.b")


class EnvRecord(msgspec.Struct, kw_only=True):
    """One env. ``lock`` is the plan lock it runs (JSON form), so a restarted daemon needs nothing else."""

    id: str
    name: str
    status: EnvStatus = "creating"
    created_s: float = msgspec.field(default_factory=time.time)
    lock: dict[str, Any] = {}
    layers: list[str] = []  # envlet layer names this env holds a reference on
    init_pid: int = 0
    cgroup: str | None = None
    expires_s: float | None = None  # wall clock; None: no TTL
    snapshot: str | None = None  # the snapshot it started from
    parent: str | None = None  # the env it was forked from
    error: str = ""
    timings_ms: dict[str, float] = {}  # how long each step of create took
    snapshot_layers: list[dict[str, Any]] = []  # sealed layers on top of the lock's groups (digest, size, toc_digest)
    trees: list[str] = []  # digests of the group layers it stacks as local trees (not through the envlet)
    restricted: bool = False  # a tenant's env (docs/network.md, "Tenant envs"); its forks are too
    cold: bool = False  # paused without its memory (processes ended, files kept): resume boots it again
    volumes: list[str] = []  # ids of the volumes it mounts (envs/_volumes.py), recorded before each is bound
    memory_image: str = ""  # parked (``cold`` too): the checkpoint image its resume restores (envs/_memory.py)
    park_at_s: float | None = None  # frozen: when the daemon parks it (wall clock; envs/_parking.py); None: never
    not_parked_because: str = ""  # a pause that asked to be parked later, and why it is not (its runtime; a park's error)
    state_seq: int = 0  # saves so far (the slot of the next one: see the module doc)

    def public(self, envs_dir: str) -> dict[str, Any]:
        """What ``ps`` / the API show."""
        return {
            "id": self.id, "name": self.name, "status": self.status, "created_s": self.created_s,
            "expires_s": self.expires_s, "init_pid": self.init_pid, "snapshot": self.snapshot, "parent": self.parent,
            "groups": [g.get("name") for g in self.lock.get("groups", [])], "rootfs": rootfs_path(envs_dir, self.id),
            "error": self.error, "timings_ms": self.timings_ms, "restricted": self.restricted,
            "user": self.lock.get("user"), "workdir": self.lock.get("workdir"), "volumes": self.volumes,
            "parked": bool(self.memory_image), "cold": self.cold, "park_at_s": self.park_at_s,
            "not_parked_because": self.not_parked_because,
        }


NODE_NAME_PATTERN = r"[a-z0-9]{1,12}"
_node_name = ""  # set once by the daemon at start (weenv daemon --node-name): env ids then name their node


def set_node_name(name: str | None) -> None:
    """Make every new env id start with ``<name>-`` (a cluster routes by it, docs/cluster.md)."""
    global _node_name
    import re

    if name and not re.fullmatch(NODE_NAME_PATTERN, name):
        raise ValueError(f"node name {name!r}: must be 1 to 12 lowercase letters or digits (no '-': "
                         f"an env id's first '-' ends its node name)")
    _node_name = name or ""


def new_env_id(name: str) -> str:
    """``[<node>-]<plan name>-<8 hex>``: short enough for a hostname (63), a cgroup and a crun container id."""
    prefix = f"{_node_name}-" if _node_name else ""
    return f"{prefix}{name[:40].rstrip('-') or 'env'}-{secrets.token_hex(4)}"


def env_dir(envs_dir: str, env_id: str) -> str:
    return os.path.join(envs_dir, env_id)


def rootfs_path(envs_dir: str, env_id: str) -> str:
    return os.path.join(envs_dir, env_id, "rootfs")


def upper_mount(envs_dir: str, env_id: str) -> str:
    return os.path.join(envs_dir, env_id, "rw")


def bundle_path(envs_dir: str, env_id: str) -> str:
    return os.path.join(envs_dir, env_id, "bundle")


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(EnvRecord)


_save_lock = threading.Lock()  # a record saved from two threads at once gets two numbers, in order


def save(envs_dir: str, rec: EnvRecord) -> None:
    d = env_dir(envs_dir, rec.id)
    with _save_lock:
        rec.state_seq += 1
        body = _encoder.encode(rec)
        data = b"%08x %d\n" % (zlib.crc32(body), len(body)) + body
        path = os.path.join(d, SLOTS[rec.state_seq % 2])
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            os.makedirs(d, mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            pos = 0
            while pos < len(data):
                pos += os.pwrite(fd, view[pos:], pos)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
        if rec.state_seq == 1:  # the first save of a record read from a legacy state.json (or a new one)
            try:
                os.unlink(os.path.join(d, STATE_FILE))
            except FileNotFoundError:
                pass


def _read_slot(path: str) -> EnvRecord | None:
    try:
        with open(path, "rb") as f:
            data = f.read()
        head, _, body = data.partition(b"\n")
        crc, length = head.split(b" ")
        if len(body) != int(length) or zlib.crc32(body) != int(crc, 16):
            return None  # cut short: the other slot holds the save before it
        return _decoder.decode(body)
    except (OSError, ValueError, msgspec.DecodeError):
        return None


def load(envs_dir: str, env_id: str) -> EnvRecord | None:
    d = env_dir(envs_dir, env_id)
    found = [r for r in (_read_slot(os.path.join(d, name)) for name in SLOTS) if r is not None]
    if found:
        return max(found, key=lambda r: r.state_seq)
    try:
        with open(os.path.join(d, STATE_FILE), "rb") as f:
            return _decoder.decode(f.read())
    except (OSError, msgspec.DecodeError):
        return None
