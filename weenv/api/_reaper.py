"""The server's housekeeping loop: revoked keys' envs, and what gone envs left in the server.

- A revoked key (``weenv token revoke NAME``, ``DELETE /v1/keys/NAME``) loses its envs' access
  and traffic tokens at once (they name their owner key: weenv/api/_store.py). Its envs are then
  killed (``--envs kill``, the default) or kept for admin keys (``--envs keep``: their record
  names no owner any more, only ``kept_from``); its snapshots are kept for admin keys either way
  (a snapshot is data: deleting it is an admin's call).
- Watchers of envs that are gone (a TTL, a kill on the node) are dropped: they held a share of
  their key's watcher quota and a listing in memory.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from ._common import ApiState, HttpError, daemon_errors, log

REAP_INTERVAL_S = 1.0
WATCHER_SWEEP_S = 5.0


def _revoked_owner(rec: dict[str, Any], revoked: dict[str, dict[str, Any]], live_names: set[str]) -> str | None:
    """The revoked key id that owned ``rec``, if any (records from before key ids: by name)."""
    if rec.get("owner_id") is not None:
        return str(rec["owner_id"]) if str(rec["owner_id"]) in revoked else None
    name = rec.get("owner")
    if name is None or name in live_names:
        return None
    for key_id, r in revoked.items():
        if r.get("name") == name:
            return key_id
    return None


async def reap_revoked(state: ApiState) -> int:
    """Act on revoked keys' envs and snapshots once; how many envs were killed or handed over."""
    revoked = state.keys.revoked()
    if not revoked:
        return 0
    live_names = {k.name for k in state.keys.list()}
    done = 0
    for env_id, rec in state.owners.envs().items():
        key_id = _revoked_owner(rec, revoked, live_names)
        if key_id is None:
            continue
        kept = {"owner": None, "owner_id": None, "kept_from": {"name": rec.get("owner"), "id": key_id}}
        if revoked[key_id].get("envs") == "keep":
            state.owners.put_env(env_id, {**rec, **kept})
            log.info("env %s of revoked key %s is kept for admin keys", env_id, rec.get("owner"))
            done += 1
            continue
        try:
            async with daemon_errors():
                await state.backend.kill(env_id)
        except HttpError as e:
            if e.status not in (404, 410):  # gone already, or on a lost node: nothing left to kill
                log.warning("killing env %s of revoked key %s: %s (tried again)", env_id, rec.get("owner"), e.message)
                continue
        state.envs_gone([env_id])
        log.info("env %s of revoked key %s killed", env_id, rec.get("owner"))
        done += 1
    for snap_id, rec in state.owners.snapshots().items():
        key_id = _revoked_owner(rec, revoked, live_names)
        if key_id is not None:
            state.owners.put_snapshot(snap_id, {**rec, "owner": None, "owner_id": None,
                                                "kept_from": {"name": rec.get("owner"), "id": key_id}})
    return done


async def sweep_watchers(state: ApiState) -> int:
    """Drop watchers of envs no daemon knows any more; how many went."""
    if not state.watchers:
        return 0
    try:
        async with daemon_errors():
            known = {e.id for e in await state.backend.list_envs()}
    except HttpError:
        return 0
    gone = {w.env_id for w in state.watchers.values()} - known
    for env_id in gone:
        state.forget_env(env_id)
    return len(gone)


async def housekeeping(state: ApiState, interval_s: float = REAP_INTERVAL_S) -> None:
    """Runs for the server's life (its lifespan task group)."""
    last_sweep = time.monotonic()
    while True:
        await anyio.sleep(interval_s)
        try:
            await reap_revoked(state)
            if time.monotonic() - last_sweep >= WATCHER_SWEEP_S:
                last_sweep = time.monotonic()
                await sweep_watchers(state)
        except Exception:  # the loop must outlive one bad pass
            log.exception("housekeeping pass failed")
