"""What every env start checks before it sets anything up: the lock's pins, and the mount sources
(and what it starts from: :func:`lock_for` a plan, :func:`env_limits` for the monitor).

A lock pins four things per group: ``digest`` (the manifest), ``layer_digest``, ``layer_size`` and
``toc_digest``. Every start checks all four against the group's store: the manifest is fetched by
its pinned digest, its bytes hashed, and the layer it references compared with the lock
(:func:`weenv.plan.check_manifest_pins`). A manifest is content-addressed: once its bytes matched
their digest, what it says never changes, so :class:`LockVerifier` keeps what each one pins
(bounded) and later starts compare their lock with that, in memory, without a fetch. The envlet
then checks the layer's TOC against ``toc_digest`` when it opens the layer, and the provisioner
compares an already-registered layer's size and TOC digest with the lock (:func:`check_registered`).

Mount sources were checked lexically when the plan was read; here they are resolved on the host
(symlinks included) and checked again with the same rule (:func:`check_mount_sources`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import trio

from ...plan import Lock, LockedGroup, LockError, Plan, Problem, exposed_host_path, is_locked
from ...plan._lock import ManifestPins, check_manifest_pins, read_manifest_pins
from ...plan._model import network_policy
from .._errors import SpecError
from ..elastic._policy import EnvLimits

MAX_REMEMBERED_MANIFESTS = 4096

OpenStore = Callable[[str | None], Any]  # registry host (None: the embedded store) -> a registry Store


def _open_store(registry: str | None) -> Any:
    from ...registry import open_store

    return open_store(registry)


def _label(lock: Lock, index: int, group: LockedGroup) -> str:
    return f"lock {lock.name!r}: groups[{index}] ({group.name})"


def _where(group: LockedGroup) -> str:
    return f"registry {group.registry}" if group.registry else "the embedded store"


class LockVerifier:
    """Checks every pinned field of a lock's groups against what their stores serve.

    ``missing(lock)`` says which manifests are not known yet; ``fetch`` gets and reads them
    (blocking: run it in a worker thread); ``compare`` checks a lock against what is known and
    raises :class:`weenv.plan.LockError` naming the lock, the group, the field, the lock's value
    and the value found. ``check`` does all three.
    """

    def __init__(self, open_store: OpenStore | None = None, *, max_entries: int = MAX_REMEMBERED_MANIFESTS):
        self._open_store = open_store or _open_store
        self._max_entries = max_entries
        self._pins: dict[tuple[str | None, str, str], ManifestPins] = {}
        self._mutex = threading.Lock()
        self.fetches = 0  # manifests fetched so far (tests and `weenv top` read it)

    @staticmethod
    def _key(group: LockedGroup) -> tuple[str | None, str, str]:
        return (group.registry, group.repo, group.digest)

    def missing(self, lock: Lock) -> list[int]:
        """Indices of the groups whose manifest is not known yet."""
        with self._mutex:
            return [i for i, g in enumerate(lock.groups) if self._key(g) not in self._pins]

    def fetch(self, lock: Lock, indices: list[int]) -> None:
        """Fetch the manifests of those groups by their pinned digests and remember what they pin."""
        from ...registry import IntegrityError, NotFoundError

        by_store: dict[str | None, list[int]] = {}
        for i in indices:
            by_store.setdefault(lock.groups[i].registry, []).append(i)
        for registry, members in by_store.items():
            store = self._open_store(registry)
            try:
                for i in members:
                    g = lock.groups[i]
                    try:
                        data, _media_type = store.get_manifest(g.repo, g.digest)
                    except NotFoundError:
                        raise LockError(
                            f"{_label(lock, i, g)}: digest: the lock pins {g.digest}, but {_where(g)} has no such "
                            f"manifest in repository {g.repo!r} (was the lock edited, or the group deleted?)",
                            group=g.name) from None
                    except IntegrityError as e:  # the store's own check of the bytes against the digest
                        raise LockError(f"{_label(lock, i, g)}: digest: {e}", group=g.name) from None
                    try:
                        pins = read_manifest_pins(data)
                    except ValueError as e:
                        raise LockError(f"{_label(lock, i, g)}: digest: {g.digest} in {_where(g)}: {e}",
                                        group=g.name) from None
                    with self._mutex:
                        if len(self._pins) >= self._max_entries:
                            self._pins.pop(next(iter(self._pins)))  # oldest first
                        self._pins[self._key(g)] = pins
                        self.fetches += 1
            finally:
                close = getattr(store, "close", None)
                if close is not None:
                    close()

    def compare(self, lock: Lock) -> None:
        """Every group's pins against its known manifest (``fetch`` must have run for the missing)."""
        for i, g in enumerate(lock.groups):
            with self._mutex:
                pins = self._pins.get(self._key(g))
            if pins is None:  # pragma: no cover - callers fetch first
                raise LockError(f"{_label(lock, i, g)}: the manifest {g.digest} was not fetched", group=g.name)
            check_manifest_pins(g, pins, label=_label(lock, i, g))

    def check(self, lock: Lock) -> None:
        """Blocking: fetch what is missing, then compare."""
        missing = self.missing(lock)
        if missing:
            self.fetch(lock, missing)
        self.compare(lock)


def check_registered(lock: Lock, index: int, size: int, toc_digest: str) -> None:
    """An already-registered layer (the envlet's, or a layer tree's record) against the lock."""
    g = lock.groups[index]
    for field, want, got in (("layer_size", g.layer_size, size), ("toc_digest", g.toc_digest, toc_digest)):
        if want != got:
            raise LockError(f"{_label(lock, index, g)}: {field} mismatch: the lock pins {want}, the layer "
                            f"{g.layer_digest} registered on this node has {got}", group=g.name)


def check_mount_sources(lock: Lock, *, home: str | None = None) -> None:
    """Each mount source resolved on the host (symlinks followed) must not expose it either."""
    if not lock.mounts:
        return
    from ... import _home

    real_home = os.path.realpath(home if home is not None else _home.home())
    for i, m in enumerate(lock.mounts):
        real = os.path.realpath(m.source)
        why = exposed_host_path(real, home=real_home)
        if why is not None:
            shown = m.source if real == m.source else f"{m.source} (resolves to {real})"
            raise SpecError(f"mounts[{i}].source: {shown} exposes the host: {why}")


async def check_start(verifier: LockVerifier, lock: Lock) -> None:
    """What :meth:`EnvManager.create` runs before admission: the lock's pins (a manifest fetch in a
    worker thread only for manifests not seen yet; otherwise a comparison in memory) and the
    resolved mount sources."""
    import trio

    if verifier.missing(lock):
        await trio.to_thread.run_sync(verifier.check, lock)
    else:
        verifier.compare(lock)
    if lock.mounts:
        await trio.to_thread.run_sync(check_mount_sources, lock)


async def tenant_problems(lock: Lock, net: Any) -> list[Problem]:
    """A tenant's env: no ``network = "host"``, and no allow entry that opens the node's ports
    or a network inside a reserved range (loopback, link-local, the egress range, the node's
    addresses: :class:`weenv.net._policy.Reserved`); ``net``: the daemon's egress network, or None."""
    netpol = network_policy(lock)
    problems = []
    if netpol.mode == "host":
        problems.append(Problem("network.mode", "'host' (the node's own network) is not open to tenant envs; "
                                "use 'egress' with the hosts it needs in network.allow"))
    elif netpol.mode == "egress" and net is not None:
        from ...net import PolicyError, parse_policy

        try:
            policy = parse_policy(netpol.allow, netpol.deny, netpol.bandwidth, netpol.dns, restricted=True)
        except PolicyError:
            return []  # a plan's grammar was checked when it was read: the start says what is wrong
        problems += [Problem(f"network.{e.location}", e.message)
                     for e in await trio.to_thread.run_sync(net.restricted_problems, policy)]
    return problems


def env_limits(lock: Plan, runtime: str = "crun") -> EnvLimits:
    """The monitor's limits for an env of ``lock`` run by ``runtime``. A gVisor env's memory is
    fixed at the plan's max (admitted and held whole, never elastic): the Sentry takes its memory
    in system calls that fail with ENOMEM at a limit instead of waiting for the monitor's doubling,
    and a Sentry refused memory dies with everything in it (a 45 MiB write burst killed the sandbox
    at a 64 MiB elastic limit in a loaded test run)."""
    r = lock.resources
    memory_min = r.memory.min
    if runtime == "gvisor" and r.memory.max is not None:
        memory_min = r.memory.max
    return EnvLimits(cpu_min_cores=r.cpu.min, cpu_max_cores=r.cpu.max, memory_min_bytes=memory_min,
                     memory_max_bytes=r.memory.max, pids_max=r.pids)


def lock_for(plan: Plan) -> Lock:
    """A lock for ``plan``: locks pass through (never resolving a tag), plans are resolved now."""
    if is_locked(plan):
        return plan  # type: ignore[return-value]
    from ...build import lock_with_image_defaults

    return lock_with_image_defaults(plan)
