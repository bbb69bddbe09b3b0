"""Where weenv keeps its state on a node: everything lives under ``$WEENV_HOME`` (default /var/lib/weenv)."""

from __future__ import annotations

import os

DEFAULT_HOME = "/var/lib/weenv"


def home() -> str:
    return os.path.abspath(os.environ.get("WEENV_HOME") or DEFAULT_HOME)


def path(*parts: str) -> str:
    return os.path.join(home(), *parts)


def store_dir() -> str:
    """The embedded OCI image-layout store."""
    return path("store")


def envlet_mountpoint() -> str:
    return path("envlet", "mnt")


def envlet_cache_dir() -> str:
    return path("envlet", "cache")


def envlet_socket() -> str:
    return path("run", "envlet.sock")


def daemon_socket() -> str:
    return path("run", "weenv.sock")


def envs_dir() -> str:
    return path("envs")
