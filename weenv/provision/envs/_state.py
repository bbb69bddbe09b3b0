"""What the daemon remembers about each env, persisted as ``$WEENV_HOME/envs/<id>/state.json``."""

from __future__ import annotations

import os
import secrets
import time
from typing import Any, Literal

import msgspec

from ..._atomic import atomic_write
EnvStatus = Literal["creating", "pooled", "running", "paused", "stopping", "failed"]
STATE_FILE = "state.json"


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

    def public(self, envs_dir: str) -> dict[str, Any]:
        """What ``ps`` / the API show."""
        return {
            "id": self.id, "name": self.name, "status": self.status, "created_s": self.created_s,
            "expires_s": self.expires_s, "init_pid": self.init_pid, "snapshot": self.snapshot, "parent": self.parent,
            "groups": [g.get("name") for g in self.lock.get("groups", [])], "rootfs": rootfs_path(envs_dir, self.id),
            "error": self.error, "timings_ms": self.timings_ms, "restricted": self.restricted,
            "user": self.lock.get("user"), "workdir": self.lock.get("workdir"), "volumes": self.volumes,
            "parked": bool(self.memory_image), "park_at_s": self.park_at_s,
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


def save(envs_dir: str, rec: EnvRecord) -> None:
    d = env_dir(envs_dir, rec.id)
    os.makedirs(d, mode=0o700, exist_ok=True)
    atomic_write(os.path.join(d, STATE_FILE), _encoder.encode(rec), mode=None, fsync=False)


def load(envs_dir: str, env_id: str) -> EnvRecord | None:
    try:
        with open(os.path.join(env_dir(envs_dir, env_id), STATE_FILE), "rb") as f:
            return _decoder.decode(f.read())
    except (OSError, msgspec.DecodeError):
        return None
