"""The node side of egress envs: one :class:`EgressNetwork` per daemon.

For each env with ``mode = "egress"``: a slot of the node-local range (a /30: gateway and env
address), a network namespace ``<table>-<key>`` with ``eth0`` and ``lo``, a veth ``wv<hex>``
whose alias ``<table>:<env id>`` lets gc find it after a crash, nftables chains in the daemon's
table, an optional token bucket per direction, and a resolver on the gateway answering only the
allowed names. What was set up is written to ``<env dir>/net.json`` *before* it is set up, so a
daemon that dies at any point leaves a record that teardown or gc can follow.

A restricted env (a tenant's: ``EgressPolicy.restricted``, kept in its saved policy, so it holds
after a restart, for every policy change and for the name refresh) never gets an allow entry
inside :class:`~weenv.net._policy.Reserved` (refused at its start and at every change) nor a DNS
answer there (dropped, logged and counted, at every resolution).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import trio

from .._atomic import atomic_write
from . import _dns, _host, _nft, _resolver
from ._policy import (SLOT_PREFIX, EgressPolicy, PolicyError, Reserved, Resolved, change_policy, free_slot,
                      parse_entry, parse_range, policy_from_builtins, restricted_problems, slot)

log = logging.getLogger("weenv.net")

STATE_FILE = "net.json"
DEFAULT_RANGE = "10.213.0.0/16"
DEFAULT_TABLE = "weenv"


class NetState(msgspec.Struct, kw_only=True):
    """What the node holds for one egress env (``<env dir>/net.json``)."""

    env_id: str
    key: str
    netns: str
    veth: str
    slot: int
    address: str
    gateway: str
    policy: dict[str, Any] = {}
    resolved: dict[str, list[str]] = {}
    resolved_s: float = 0.0
    generation: int = 1  # of the policy in force: stamped on the env's connections (_nft.GEN_MASK)
    dns_dropped: dict[str, list[str]] = {}  # a restricted env's reserved answers, at the last resolution
    dns_answers_dropped: int = 0  # ... and how many were dropped, all resolutions together

    def wiring(self) -> _nft.EnvWiring:
        return _nft.EnvWiring(key=self.key, veth=self.veth, address=ipaddress.IPv4Address(self.address),
                              gateway=ipaddress.IPv4Address(self.gateway))

    def public(self) -> dict[str, Any]:
        out = {"mode": "egress", "address": self.address, "gateway": self.gateway, "netns": self.netns,
               "veth": self.veth, **self.policy, "policy": dict(self.policy), "resolved": self.resolved}
        if self.policy.get("restricted"):
            out["dns_dropped"] = self.dns_dropped
        return out

    def note_dropped(self, resolved: Resolved) -> None:
        """What a resolution of a restricted env's names dropped."""
        self.dns_dropped = {h: [str(a) for a in addrs] for h, addrs in resolved.dropped.items()}
        self.dns_answers_dropped += sum(len(addrs) for addrs in resolved.dropped.values())


class NetChange(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A policy change: entries to allow, to deny, to drop from both lists."""

    allow: list[str] = []
    deny: list[str] = []
    remove: list[str] = []


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(NetState)


def env_key(table: str, env_id: str) -> str:
    return "e" + hashlib.sha256(f"{table}:{env_id}".encode()).hexdigest()[:10]


def check_table_name(table: str) -> str:
    """An nft table name weenv may own: letters, digits and '_', starting with a letter, ≤ 24."""
    if not table or not table.replace("_", "").isalnum() or not table[0].isalpha() or len(table) > 24 \
            or not table.isascii():
        raise ValueError(f"nft table name {table!r}: letters, digits and '_', starting with a letter (at most 24)")
    return table


def _point_resolv_conf(env_dir: str, gateway: str) -> None:
    """Rewrite the env's /etc/resolv.conf in place (it is a read-only bind of this very file, so the
    env sees the new text; a new file would not be seen)."""
    path = os.path.join(env_dir, "bundle", "etc", "resolv.conf")
    try:
        with open(path, "r+b") as f:
            f.write(f"# weenv: network=egress, a resolver that answers only allowed names\nnameserver {gateway}\n"
                    .encode())
            f.truncate()
    except FileNotFoundError:
        pass


class EgressNetwork:
    """Egress networking of one daemon. ``egress_interfaces``: the only interfaces traffic may
    leave the node by (none: egress envs reach only what is on the node and ``node:`` allows)."""

    def __init__(self, *, table: str = DEFAULT_TABLE, egress_range: str = DEFAULT_RANGE,
                 egress_interfaces: Iterable[str] = (), dns_server: str | None = None,
                 refresh_s: float = 300.0):
        self.table = check_table_name(table)
        self.range = parse_range(egress_range)
        self.egress_interfaces = tuple(egress_interfaces)
        self.dns_server = dns_server
        self.refresh_s = refresh_s
        self.states: dict[str, NetState] = {}
        self.nursery: trio.Nursery | None = None
        self._dns_scopes: dict[str, trio.CancelScope] = {}
        self._dns_names: dict[str, dict[str, tuple[ipaddress.IPv4Address, ...]]] = {}  # what each resolver answers
        self._base_ready = False
        self._lock = trio.Lock()
        self._last_counters: dict[str, dict[str, int]] = {}
        self._counters_read_s = 0.0
        self._counters_lock = trio.Lock()
        self._adopt_state: _nft.TableState | None = None  # one listing for all envs re-adopted at start
        self._pending: dict[str, trio.Event] = {}  # set when up() is done (either way)
        self._errors: dict[str, BaseException] = {}
        # one rule change at a time per env: a refresh, a policy change and the teardown
        self._env_locks: dict[str, trio.Lock] = {}

    # -- base ---------------------------------------------------------------------------------

    def _check_node(self) -> list[str]:
        for iface in self.egress_interfaces:
            if not _host.interface_exists(iface):
                raise _host.NetError(f"--egress-interface {iface}: no such interface on this node")
        for iface, cidr in _host.interface_addresses():
            net = ipaddress.IPv4Interface(cidr).network
            if net.overlaps(self.range) and not iface.startswith("wv"):
                raise _host.NetError(f"egress range {self.range} overlaps {cidr} on {iface}: "
                                     "pick another with --egress-range")
        guard = []
        for iface in self.egress_interfaces:  # forwarding is per input interface in IPv4
            if _host.read_sysctl(f"net/ipv4/conf/{iface}/forwarding") == "0":
                _host.write_sysctl(f"net/ipv4/conf/{iface}/forwarding", "1")
                guard.append(iface)
        state = _nft.parse_table(_host.list_table(self.table))
        guard += [i for i in state.elements.get("fwd_guard", set()) if i not in guard]
        return guard

    async def ensure_base(self) -> None:
        if self._base_ready:
            return
        async with self._lock:
            if self._base_ready:
                return

            def setup() -> None:
                guard = self._check_node()
                _host.nft(_nft.render_base(self.table, self.range, self.egress_interfaces, guard), what="base rules")

            await trio.to_thread.run_sync(setup)
            self._base_ready = True

    # -- one env ------------------------------------------------------------------------------

    def netns_path(self, env_id: str) -> str | None:
        st = self.states.get(env_id)
        return _host.netns_path(st.netns) if st is not None else None

    def nameserver(self, env_id: str) -> str | None:
        st = self.states.get(env_id)
        if st is None or policy_from_builtins(st.policy).dns == "none":
            return None
        return st.gateway

    def reserved(self) -> Reserved:
        """What a restricted env can never reach on this node, now (its addresses can change). Blocking."""
        return Reserved(self.range, _host.node_addresses())

    def restricted_problems(self, policy: EgressPolicy) -> list[PolicyError]:
        """The allow entries of ``policy`` that a restricted env may not have (by their place in
        ``policy.allow``); none for a policy that is not restricted. Blocking."""
        return restricted_problems(policy.allow, self.reserved()) if policy.restricted else []

    async def _resolve(self, policy: EgressPolicy, env_id: str) -> Resolved:
        """The addresses of the policy's names. A restricted env's answers inside a reserved range
        are dropped (and logged): a name rebound to link-local, loopback, another env or the node
        resolves, for that env, to the rest of its answers, or to nothing."""
        out = Resolved()
        reserved = await trio.to_thread.run_sync(self.reserved) if policy.restricted else None
        for host in policy.hosts:
            addrs = await trio.to_thread.run_sync(lambda h=host: _dns.resolve(h, server=self.dns_server))
            if reserved is not None:
                addrs, dropped = reserved.split(addrs)
                if dropped:
                    out.dropped[host] = dropped
                    log.warning("env %s: DNS answers for %s dropped: %s (a tenant env is never pinned to %s)",
                                env_id, host, ", ".join(str(a) for a in dropped),
                                "; ".join(dict.fromkeys(str(reserved.why(a)).rstrip(",") for a in dropped)))
            out.addresses[host] = addrs
        return out

    def reserve(self, env_id: str, policy: EgressPolicy) -> NetState:
        """Take a slot for a new env (no I/O): its namespace path and resolver address are known from
        here on, so the env's bundle can be written while :meth:`up` wires it."""
        key = env_key(self.table, env_id)
        index = free_slot(self.range, {s.slot for s in self.states.values()})
        sl = slot(self.range, index)
        st = NetState(env_id=env_id, key=key, netns=f"{self.table}-{key[1:]}", veth=f"wv{key[1:]}", slot=index,
                      address=str(sl.address), gateway=str(sl.gateway), policy=policy.to_builtins())
        self.states[env_id] = st  # the slot is taken, and gc keeps the table, from here on
        self._pending[env_id] = trio.Event()
        return st

    async def up(self, env_id: str, env_dir: str, policy: EgressPolicy) -> NetState:
        """Wire a new env (reserving its slot first unless :meth:`reserve` did). Never raises: the
        outcome is for :meth:`ready`, so this can run as a background task during the env's start.
        What was done is undone by :meth:`down`."""
        st = self.states.get(env_id) if env_id in self._pending else None
        if st is None:
            st = self.reserve(env_id, policy)
        done = self._pending[env_id]
        try:
            if policy.restricted:  # the daemon's create checked it already; the node may have changed since
                problems = await trio.to_thread.run_sync(self.restricted_problems, policy)
                if problems:
                    raise problems[0]
            await self.ensure_base()
            resolved = await self._resolve(policy, env_id) if policy.hosts else Resolved()
            st.resolved, st.resolved_s = resolved.to_builtins(), time.time()
            st.note_dropped(resolved)

            def wire() -> None:
                # recorded before anything exists in the kernel, with the pinned addresses: teardown and
                # a restarted daemon follow it (gc finds the rest by the veth alias and netns name)
                self._save(env_dir, st)
                _host.create_link(netns=st.netns, veth=st.veth, alias=f"{self.table}:{env_id}", address=st.address,
                                  gateway=st.gateway, prefix=SLOT_PREFIX)
                _host.nft(_nft.render_env(self.table, st.wiring(), policy, resolved, self.range, st.generation),
                          what="env rules")
                if policy.bandwidth_bps is not None:
                    _host.set_bandwidth(netns=st.netns, veth=st.veth, bps=policy.bandwidth_bps)

            await trio.to_thread.run_sync(wire)
            self._serve_dns(st)
        except (OSError, ValueError, _host.NetError) as e:
            self._errors[env_id] = e
        except BaseException as e:  # cancelled: nothing is waited for in vain
            self._errors[env_id] = _host.NetError(f"wiring cut short: {type(e).__name__}")
            raise
        finally:
            done.set()
        return st

    async def ready(self, env_id: str) -> None:
        """Wait for :meth:`up`; its failure is raised here (``NetError``, ``ValueError``, ``OSError``)."""
        done = self._pending.get(env_id)
        if done is not None:
            await done.wait()
        err = self._errors.pop(env_id, None)
        if err is not None:
            raise err

    @staticmethod
    def _save(env_dir: str, st: NetState) -> None:
        os.makedirs(env_dir, mode=0o700, exist_ok=True)
        atomic_write(os.path.join(env_dir, STATE_FILE), _enc.encode(st), mode=None, fsync=False)

    @staticmethod
    def load(env_dir: str) -> NetState | None:
        try:
            with open(os.path.join(env_dir, STATE_FILE), "rb") as f:
                return _dec.decode(f.read())
        except (OSError, msgspec.DecodeError):
            return None

    async def down(self, env_id: str, env_dir: str) -> list[str]:
        """Remove an env's namespace, veth, rules and resolver; idempotent. Problems found."""
        pending = self._pending.pop(env_id, None)
        if pending is not None:
            await pending.wait()  # a wiring still under way finishes first: then all of it is undone
        async with self._env_lock(env_id):  # a refresh or change under way lands (or fails) first
            self._errors.pop(env_id, None)
            st = self.states.get(env_id) or self.load(env_dir)  # its slot stays taken until the kernel let go
            scope = self._dns_scopes.pop(env_id, None)
            self._dns_names.pop(env_id, None)
            if scope is not None:
                scope.cancel()
            problems = [] if st is None else await self._unwire(st)
            if problems:
                self.states[env_id] = st  # kept for a later gc
            else:
                self.states.pop(env_id, None)
                self._env_locks.pop(env_id, None)
                if st is not None:
                    try:
                        os.unlink(os.path.join(env_dir, STATE_FILE))
                    except FileNotFoundError:
                        pass
        return [f"network: {p}" for p in problems]

    def _env_lock(self, env_id: str) -> trio.Lock:
        lock = self._env_locks.get(env_id)
        if lock is None:
            lock = self._env_locks[env_id] = trio.Lock()
        return lock

    async def _unwire(self, st: NetState) -> list[str]:
        def unwire() -> list[str]:
            problems = []
            try:  # the usual case first: everything is there, one transaction and no listing
                _host.nft(_nft.render_env_delete(self.table, st.key, st.veth, _nft.full_state(st.key, st.veth)),
                          what="delete env rules")
            except _host.NetError:  # a partial setup: delete what exists
                try:
                    state = _nft.parse_table(_host.list_table(self.table))
                    script = _nft.render_env_delete(self.table, st.key, st.veth, state)
                    if script:
                        _host.nft(script, what="delete env rules")
                except _host.NetError as e:
                    problems.append(str(e))
            problems += _host.delete_link(netns=st.netns, veth=st.veth)
            return problems

        return await trio.to_thread.run_sync(unwire)

    async def adopt(self, env_id: str, env_dir: str) -> bool:
        """After a daemon restart: take a running env's network back (its kernel state never went
        away); rules missing for some reason are put back. False when it has no egress network."""
        st = self.load(env_dir)
        if st is None:
            return False
        await self.ensure_base()
        self.states[env_id] = st

        def check() -> None:
            if self._adopt_state is None:
                self._adopt_state = _nft.parse_table(_host.list_table(self.table))
            state = self._adopt_state
            if any(f"{c}_{st.key}" not in state.chains for c in _nft.CHAINS) \
                    or st.veth not in state.elements.get("env_out", set()):
                # missing, or made by a weenv before policy generations (no p_/a_ chains)
                log.warning("env %s: its egress rules were missing or out of date; putting them back", env_id)
                _host.nft(_nft.render_env(self.table, st.wiring(), policy_from_builtins(st.policy),
                                          Resolved.from_builtins(st.resolved), self.range, st.generation),
                          what="env rules")

        await trio.to_thread.run_sync(check)
        self._serve_dns(st)
        return True

    async def change(self, env_id: str, env_dir: str, *, allow: list[str] = (),  # type: ignore[assignment]
                     deny: list[str] = (), remove: list[str] = ()) -> NetState:  # type: ignore[assignment]
        """A running env's new policy, in force when this returns: for new connections, and for the
        open ones from their next packet (a new generation: see :mod:`weenv.net._nft`)."""
        async with self._env_lock(env_id):
            st = self.states[env_id]
            policy = change_policy(policy_from_builtins(st.policy), allow=allow, deny=deny, remove=remove)
            if policy.restricted:  # whoever asks: the env is a tenant's. Named by their place in the change
                problems = restricted_problems([parse_entry(t) for t in allow],
                                               await trio.to_thread.run_sync(self.reserved))
                if problems:
                    raise problems[0]
            resolved = await self._resolve(policy, env_id)
            await self._apply(env_dir, st, policy, resolved, _nft.next_generation(st.generation))
            return st

    async def _apply(self, env_dir: str, st: NetState, policy: EgressPolicy, resolved: Resolved,
                     generation: int) -> None:
        await trio.to_thread.run_sync(lambda: _host.nft(
            _nft.render_policy_change(self.table, st.wiring(), policy, resolved, self.range, generation),
            what="policy change"))
        was = policy_from_builtins(st.policy).dns
        st.policy, st.resolved, st.resolved_s = policy.to_builtins(), resolved.to_builtins(), time.time()
        st.generation = generation
        st.note_dropped(resolved)
        await trio.to_thread.run_sync(self._save, env_dir, st)
        if was == "node" and policy.dns == "forward":  # the resolver starts again, forwarding
            scope = self._dns_scopes.pop(st.env_id, None)
            if scope is not None:
                scope.cancel()
            self._dns_names.pop(st.env_id, None)
        names = self._dns_names.get(st.env_id)
        if names is not None:  # the running resolver answers the new names from its next query on
            names.clear()
            names.update(self._allowed_names(st))
        else:
            self._serve_dns(st)
            if policy.dns != "none":  # the env had no resolver: /etc/resolv.conf now names its gateway
                await trio.to_thread.run_sync(_point_resolv_conf, env_dir, st.gateway)

    async def refresh_loop(self, env_dir_of: Any) -> None:
        """Re-resolve allowed host names every ``refresh_s``; a changed answer re-pins the rules for
        new connections. The generation stays: the policy did not change, so connections it allowed
        (to an address the name had) are kept."""
        while True:
            await trio.sleep(self.refresh_s)
            for env_id, st in list(self.states.items()):
                await self._refresh_one(env_id, st, env_dir_of)

    async def _refresh_one(self, env_id: str, st: NetState, env_dir_of: Any) -> None:
        """One env's re-resolution. Its names are resolved unlocked (a slow resolver holds up no
        change); the rules are re-pinned under the env's lock, only if the env and its policy are
        still what was resolved. A failure is logged: the loop goes on for every other env."""
        policy_seen = st.policy
        policy = policy_from_builtins(policy_seen)
        if not policy.hosts:
            return
        try:
            resolved = await self._resolve(policy, env_id)
        except (ValueError, _host.NetError) as e:
            log.warning("env %s: re-resolving its allowed names: %s (keeping the old addresses)", env_id, e)
            return
        async with self._env_lock(env_id):
            wiring = self._pending.get(env_id)
            if (self.states.get(env_id) is not st or (wiring is not None and not wiring.is_set())
                    or st.policy != policy_seen):
                return  # gone, still being wired, or changed since
            try:
                if resolved.to_builtins() != st.resolved:
                    await self._apply(env_dir_of(env_id), st, policy, resolved, st.generation)
                elif resolved.dropped:  # nothing moved, but reserved answers were dropped again: counted
                    st.note_dropped(resolved)
                    await trio.to_thread.run_sync(self._save, env_dir_of(env_id), st)
            except (_host.NetError, OSError) as e:
                log.warning("env %s: re-pinning its allowed names failed: %s (kept the old addresses)", env_id, e)

    def start(self, nursery: trio.Nursery, env_dir_of: Any) -> None:
        """The daemon's nursery is up: resolvers of adopted envs, and the name refresh."""
        self.nursery = nursery
        self._adopt_state = None
        for st in self.states.values():
            if st.env_id not in self._dns_scopes:
                self._serve_dns(st)
        nursery.start_soon(self.refresh_loop, env_dir_of)

    async def info(self, env_id: str) -> dict[str, Any]:
        """The env's network as the API shows it: mode, addresses, policy, pinned names, counters."""
        if env_id not in self.states:
            return {"mode": "not egress"}
        await self.counters(max_age_s=0.0)  # asked for this env's network: read now
        return self.public(env_id) or {}

    async def change_from_body(self, env_id: str, env_dir: str, body: bytes) -> dict[str, Any]:
        """``POST /v1/envs/{id}/network``: ValueError for a body or entry that is wrong."""
        try:
            req = msgspec.json.decode(body or b"{}", type=NetChange)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ValueError(str(e)) from None
        try:
            await self.change(env_id, env_dir, allow=req.allow, deny=req.deny, remove=req.remove)
        except _host.NetError as e:
            raise ValueError(str(e)) from None
        return await self.info(env_id)

    # -- accounting ---------------------------------------------------------------------------

    async def counters(self, max_age_s: float = 1.0) -> dict[str, dict[str, int]]:
        """Every egress env's accounting, read from the kernel at most ``max_age_s`` ago (kept for
        :meth:`public`). libnftables reads the whole table for a listing (33 ms at 100 envs), so
        env infos, top and metrics share one read a second however often they ask."""
        if not self.states:
            return {}
        async with self._counters_lock:
            if time.monotonic() - self._counters_read_s > max_age_s or set(self._last_counters) != set(self.states):
                text = await trio.to_thread.run_sync(_host.list_counters, self.table)
                state = _nft.parse_table(text)
                self._last_counters = {env_id: _nft.env_counters(state, st.key) for env_id, st in self.states.items()}
                self._counters_read_s = time.monotonic()
        return self._last_counters

    def public(self, env_id: str) -> dict[str, Any] | None:
        """The env's network for its info: None unless egress; counters as last read."""
        st = self.states.get(env_id)
        if st is None:
            return None
        counters = self._last_counters.get(env_id, {})
        if st.policy.get("restricted"):
            counters = {**counters, "dns_answers_dropped": st.dns_answers_dropped}
        return {**st.public(), "counters": counters}

    async def prometheus_text(self) -> str:
        counts = await self.counters()
        if not counts:
            return ""
        names = {"bytes_out": "Bytes the env sent out (allowed)", "bytes_in": "Bytes of replies to the env",
                 "connections_allowed": "New connections allowed", "packets_denied": "Packets dropped",
                 "bytes_denied": "Bytes dropped"}
        lines = []
        for field, help_text in names.items():
            metric = f"weenv_env_egress_{field}_total"
            lines += [f"# HELP {metric} {help_text}.", f"# TYPE {metric} counter"]
            lines += [f'{metric}{{env="{env_id}"}} {c[field]}' for env_id, c in sorted(counts.items())]
        return "\n".join(lines) + "\n"

    # -- gc -----------------------------------------------------------------------------------

    def _owned(self) -> tuple[set[str], set[str], set[str]]:
        """Namespaces, veths and keys of the envs this daemon knows, now. A starting env is in
        ``states`` before it has anything in the kernel, so what is not here when it is about to be
        deleted belongs to no env."""
        states = list(self.states.values())
        return {s.netns for s in states}, {s.veth for s in states}, {s.key for s in states}

    async def gc(self, live: set[str] | None = None) -> list[str]:
        """Remove namespaces, veths (found by their alias) and rules of this daemon's table that no
        env owns; delete the table when no egress env is left. ``live`` is unused: ownership is the
        daemon's network state, checked again right before each removal. What was removed, as
        ``veth NAME``, ``netns NAME``, ``rules KEY``, ``table NAME``."""

        def sweep() -> list[str]:
            out: list[str] = []
            for name in _host.links_with_alias_prefix(f"{self.table}:"):
                if name not in self._owned()[1]:
                    _host.delete_link(netns="", veth=name)
                    out.append(f"veth {name}")
            for ns in _host.netns_names(f"{self.table}-"):
                if ns not in self._owned()[0]:
                    _host.delete_link(netns=ns, veth="")
                    out.append(f"netns {ns}")
            state = _nft.parse_table(_host.list_table(self.table))
            _, veths, keys = self._owned()
            lines = []
            for veth in _nft.stale_elements(state, veths):
                lines += [f"delete element inet {self.table} {m} {{ \"{veth}\" }}"
                          for m in ("env_out", "env_in", "env_back", "envs") if veth in state.elements.get(m, set())]
            for key in sorted(state.keys() - keys):
                lines.append(_nft.render_env_delete(self.table, key, "", state).strip())
                out.append(f"rules {key}")
            script = "\n".join(x for x in lines if x)
            if script:
                _host.nft(script + "\n", what="gc rules")
            return out

        out = await trio.to_thread.run_sync(sweep)
        async with self._lock:
            if not self.states and (self._base_ready or await trio.to_thread.run_sync(_host.list_table, self.table)):
                self._base_ready = False  # a start from here on waits for the lock and builds the table anew
                await trio.to_thread.run_sync(self._drop_table)
                out.append(f"table {self.table}")
        return out

    def _drop_table(self) -> None:
        """The node's ruleset and forwarding as before weenv: the table goes, and forwarding is
        turned off again on the egress interfaces where weenv turned it on."""
        state = _nft.parse_table(_host.list_table(self.table))
        for iface in state.elements.get("fwd_guard", set()):
            if _host.interface_exists(iface):
                _host.write_sysctl(f"net/ipv4/conf/{iface}/forwarding", "0")
        _host.delete_table(self.table)

    # -- the env's resolver --------------------------------------------------------------------

    @staticmethod
    def _allowed_names(st: NetState) -> dict[str, tuple[ipaddress.IPv4Address, ...]]:
        allowed = policy_from_builtins(st.policy).allowed_hosts
        return {h: tuple(ipaddress.IPv4Address(a) for a in addrs) for h, addrs in st.resolved.items() if h in allowed}

    def _serve_dns(self, st: NetState) -> None:
        dns_mode = policy_from_builtins(st.policy).dns
        if self.nursery is None or dns_mode == "none":
            return
        scope = trio.CancelScope()
        self._dns_scopes[st.env_id] = scope
        names = self._dns_names[st.env_id] = self._allowed_names(st)
        forwarder = _resolver.Forwarder(lambda h: _dns.resolve(h, server=self.dns_server),
                                        lambda: policy_from_builtins(st.policy), self.range,
                                        self.reserved) if dns_mode == "forward" else None
        self.nursery.start_soon(_resolver.serve, st.gateway, names, scope, forwarder)
