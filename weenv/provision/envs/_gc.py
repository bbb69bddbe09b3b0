"""What dead envs left on the host, removed: the sweeps of :meth:`EnvManager.gc`.

Each sweep compares one kind of host state with the ids of the live envs (``live``) and removes
what no live env owns: containers, cgroups, mounts and directories under ``envs/``, envlet layer
references. All are idempotent and safe while envs start and stop (a daemon killed mid-teardown,
or a crash, is what leaves these behind). Snapshots, snapshot trees and the pool are swept by
their owners (:mod:`._commit`, :mod:`._snapshots`, :mod:`._pool`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Mapping

import trio

from ...envlet import EnvletClient, EnvletError
from .._errors import CgroupError
from ..cgroups import CgroupBackend
from ..runtime._runtime import Runtime
from . import _mounts
from ._state import EnvRecord

log = logging.getLogger("weenv.daemon")


async def sweep_host(live: set[str], *, runtime: Runtime, backend: CgroupBackend,
                     envs_dir: str) -> dict[str, list[str]]:
    """Remove the containers, cgroups, mounts under ``envs_dir`` and env directories of envs not in
    ``live``; what went, under ``containers``, ``cgroups``, ``mounts`` and ``dirs``."""
    out: dict[str, list[str]] = {"containers": [], "cgroups": [], "mounts": [], "dirs": []}
    for st in await runtime.list():
        if st.id not in live:
            await runtime.delete(st.id, force=True)
            out["containers"].append(st.id)
    for name in await trio.to_thread.run_sync(backend.list):
        if name not in live:
            try:
                cg = await trio.to_thread.run_sync(backend.open, name)
                await trio.to_thread.run_sync(cg.kill_all)
                await trio.to_thread.run_sync(cg.remove)
                out["cgroups"].append(name)
            except CgroupError as e:
                log.warning("gc: cgroup %s: %s", name, e)
    for m in _mounts.mounts_under(envs_dir):
        env_id = os.path.relpath(m, envs_dir).split("/")[0]
        if env_id not in live:
            await trio.to_thread.run_sync(_mounts.unmount, m)
            out["mounts"].append(m)
    for env_id in os.listdir(envs_dir):
        if env_id not in live:
            await trio.to_thread.run_sync(lambda: shutil.rmtree(os.path.join(envs_dir, env_id), ignore_errors=True))
            out["dirs"].append(env_id)
    return out


async def release_layers(envs: Iterable[EnvRecord], envlet: EnvletClient, pinned: Mapping[str, int]) -> list[str]:
    """Drop the envlet references that no env in ``envs`` holds and nobody ``pinned`` (left by a
    daemon that died mid-teardown); the layer names, once per reference dropped."""
    wanted: dict[str, int] = {}
    for rec in envs:
        for name in rec.layers:
            wanted[name] = wanted.get(name, 0) + 1
    released = []
    try:
        layers = await trio.to_thread.run_sync(envlet.list)
    except EnvletError:
        return []
    for info in layers:
        extra = info.refcount - wanted.get(info.name, 0) - pinned.get(info.name, 0)
        for _ in range(max(0, extra)):
            await trio.to_thread.run_sync(envlet.unregister, info.name)
            released.append(info.name)
    return released
