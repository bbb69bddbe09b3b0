"""The resolver the daemon runs on an env's gateway (UDP port 53), one trio task per env.

``dns = "node"``: the allowed host names, with exactly the addresses pinned in the env's rules
(:func:`._dns.answer`); every other name is NXDOMAIN. ``dns = "forward"`` (the default of an env
that reaches every address, such as an E2B sandbox with internet access): the pinned names as
before, and any other name asked of the node's resolver (``--egress-dns``, else the node's own),
its A answers kept only where the env's policy reaches them (:meth:`EgressPolicy.reaches`; a
tenant's also never in a reserved range), cached for :data:`CACHE_S`. Lookups run one at a time
per env in a worker thread, each bounded by the lookup's timeout, so one env's queries cost the
node at most one thread.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable

import trio

from . import _dns
from ._policy import EgressPolicy, Reserved

log = logging.getLogger("weenv.net.resolver")

CACHE_S = 30.0
CACHE_NAMES = 1024
Names = dict[str, tuple[ipaddress.IPv4Address, ...]]


class Forwarder:
    """Answers for names outside the pinned ones, through ``lookup`` (a blocking ``name -> addresses``
    that raises ValueError for a name that does not resolve)."""

    def __init__(self, lookup: Callable[[str], tuple[ipaddress.IPv4Address, ...]],
                 policy: Callable[[], EgressPolicy], egress_range: ipaddress.IPv4Network,
                 reserved: Callable[[], Reserved]):
        self._lookup, self._policy, self._range, self._reserved = lookup, policy, egress_range, reserved
        self._cache: dict[str, tuple[float, tuple[ipaddress.IPv4Address, ...] | None]] = {}

    async def addresses(self, name: str) -> tuple[ipaddress.IPv4Address, ...] | None:
        """The addresses ``name`` answers with for this env (None: no such name)."""
        hit = self._cache.get(name)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        policy = self._policy()
        try:
            found: tuple[ipaddress.IPv4Address, ...] | None = await trio.to_thread.run_sync(self._lookup, name)
        except ValueError:
            found = None
        if found is not None:
            found = tuple(a for a in found if policy.reaches(a, self._range))
            if policy.restricted and found:
                found = (await trio.to_thread.run_sync(self._reserved)).split(found)[0]
        if len(self._cache) >= CACHE_NAMES:
            self._cache.clear()
        self._cache[name] = (time.monotonic() + CACHE_S, found)
        return found


async def serve(gateway: str, names: Names, scope: trio.CancelScope, forwarder: Forwarder | None = None) -> None:
    """Answer DNS on ``gateway:53`` until ``scope`` is cancelled. ``names`` may change meanwhile
    (a policy change): the next query sees them."""
    with scope:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # beside a resolver on *:53
            try:
                await sock.bind((gateway, 53))
            except OSError as e:
                log.error("resolver on %s:53: %s", gateway, e)
                return
            while True:
                data, peer = await sock.recvfrom(4096)
                reply = await _reply(data, names, forwarder)
                if reply is not None:
                    try:
                        await sock.sendto(reply, peer)
                    except OSError:
                        pass


async def _reply(data: bytes, names: Names, forwarder: Forwarder | None) -> bytes | None:
    if forwarder is None:
        return _dns.answer(data, names)
    name = _dns.question_name(data)
    if name is None or name in names:
        return _dns.answer(data, names)  # not a query (dropped), or a pinned name
    found = await forwarder.addresses(name)  # for AAAA too: an empty NOERROR for a name that exists
    return _dns.answer(data, {name: found} if found is not None else {})
