"""nftables scripts for egress envs: pure text rendering and JSON parsing, no I/O.

One table (``inet weenv`` by default; tests give every daemon its own) holds everything weenv
adds to the kernel, so nothing else in the node's ruleset is read, flushed or changed::

    forward (filter, priority -10): iifname vmap @env_out   env → elsewhere: its o_<key> chain
                                     oifname vmap @env_back  elsewhere → env: its b_<key> chain
                                     iifname @fwd_guard ct state new,invalid,untracked drop:
                                       forwarding weenv turned on carries replies only
    input   (filter, priority -10): iifname vmap @env_in    env → the node: its i_<key> chain
    postrouting (nat, srcnat):       from the range, out of an @egress interface: masquerade
    rst (regular):                   the verdict of a denial: tcp reset for TCP, else icmpx

Per env (``key`` = ``e`` + 10 hex digits): chains ``o_``/``i_``/``b_``/``p_``/``a_<key>`` and four
named counters ``<key>_out`` (allowed env → world), ``<key>_in`` (world → env replies),
``<key>_conn`` (connections allowed) and ``<key>_deny`` (packets refused). ``p_`` is the forward
policy, matched on the connection's *original* tuple (``ct original ip daddr``, ``ct original
proto-dst``) so it judges a packet of either direction; ``a_`` is its allow verdict.

**Policy generations.** Every env has a generation (1-65535, :data:`GEN_MASK` bits of the
conntrack mark; other bits are left alone). Accepting a connection stamps the env's current
generation on it; an established packet takes the fast accept only if its connection carries the
current generation. A policy change re-renders ``o_``/``i_``/``b_``/``p_``/``a_`` with the next
generation in one transaction, so from its commit on every open connection is judged again by its
next packet (either direction): still allowed → re-stamped (fast again, not counted as a new
connection); denied → refused (chain ``rst``): a packet from the env is answered with a tcp reset,
the peer's first packet is turned into a reset on its way to the env and its next one answered
with a reset, so both ends lose the connection whichever speaks first.

A restricted (tenant) policy renders no accept for the node's ports nor for anything inside the
implicit denies or the egress range, whatever it holds (its entries and DNS answers there are
refused or dropped before: see :mod:`._policy`).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._policy import IMPLICIT_DENY, EgressPolicy, Entry, Resolved

COUNTERS = ("out", "in", "conn", "deny")
CHAINS = ("o", "i", "b", "p", "a")  # per env; o, i, b are entered from the verdict maps
GEN_SHIFT = 16
GEN_MASK = 0xFFFF << GEN_SHIFT  # the conntrack mark bits weenv owns: its policy generation
GEN_MAX = 0xFFFE  # 0: never accepted; 0xffff (all the bits): cut, never a current generation


def next_generation(gen: int) -> int:
    """The generation after ``gen``: 1..65534 and round again."""
    return gen % GEN_MAX + 1


def _gen(gen: int) -> str:
    if not 1 <= gen <= GEN_MAX:
        raise ValueError(f"policy generation {gen} is outside 1-{GEN_MAX}")
    return f"0x{gen << GEN_SHIFT:08x}"


@dataclass(frozen=True)
class EnvWiring:
    """What the rules of one env refer to."""

    key: str  # e + 10 hex digits: names its chains and counters
    veth: str  # the host end of its veth pair
    address: ipaddress.IPv4Address
    gateway: ipaddress.IPv4Address


def _q(name: str) -> str:
    return json.dumps(name)  # interface names in nft syntax are quoted strings


def _set(items: Iterable[object]) -> str:
    items = list(items)
    return str(items[0]) if len(items) == 1 else "{ " + ", ".join(str(i) for i in items) + " }"


def render_base(table: str, egress_range: ipaddress.IPv4Network, egress_ifaces: Sequence[str],
                guard_ifaces: Sequence[str] = ()) -> str:
    """The table, its sets and maps and its three base chains (idempotent: chains are flushed and
    refilled in the same transaction, env chains and map elements are kept)."""
    t = f"inet {table}"
    lines = [
        f"add table {t}",
        f"add set {t} egress {{ type ifname; }}",
        f"add set {t} fwd_guard {{ type ifname; }}",
        f"add set {t} envs {{ type ifname; }}",
        *(f"add map {t} {m} {{ type ifname : verdict; }}" for m in ("env_out", "env_in", "env_back")),
        f"add chain {t} forward {{ type filter hook forward priority -10; policy accept; }}",
        f"add chain {t} input {{ type filter hook input priority -10; policy accept; }}",
        f"add chain {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}",
        f"add chain {t} rst",
        f"flush chain {t} forward", f"flush chain {t} input", f"flush chain {t} postrouting", f"flush chain {t} rst",
        # A refused TCP packet resets its sender's socket: a connect fails at once, and an open
        # connection the policy no longer allows is cut (an ICMP error is only a soft error there).
        # The first refused packet of such a connection from the peer goes on to the env as a reset
        # (its flags replaced by RST+ACK: accepted by an established socket and by one still in
        # SYN_SENT; the env may be only reading, with nothing to send that could be
        # refused) and marks the connection cut; the peer's next one is answered with a reset.
        f"add rule {t} rst ct direction reply meta l4proto tcp ct mark and 0x{GEN_MASK:08x} != 0x{GEN_MASK:08x} "
        f"ct mark set ct mark or 0x{GEN_MASK:08x} tcp flags set rst | ack accept",
        f"add rule {t} rst meta l4proto tcp reject with tcp reset",
        f"add rule {t} rst reject",
        f"add rule {t} forward iifname vmap @env_out",
        f"add rule {t} forward oifname vmap @env_back",
        f"add rule {t} forward iifname @fwd_guard ct state new,invalid,untracked drop",
        f"add rule {t} input iifname vmap @env_in",
        f"add rule {t} postrouting ip saddr {egress_range} oifname @egress masquerade",
        f"flush set {t} egress", f"flush set {t} fwd_guard",
    ]
    if egress_ifaces:
        lines.append(f"add element {t} egress {{ {', '.join(_q(i) for i in egress_ifaces)} }}")
    if guard_ifaces:
        lines.append(f"add element {t} fwd_guard {{ {', '.join(_q(i) for i in guard_ifaces)} }}")
    return "\n".join(lines) + "\n"


def _ports(e: Entry) -> str:
    if e.ports is None:
        return ""
    lo, hi = e.ports
    return f" meta l4proto {{ tcp, udp }} th dport {lo if lo == hi else f'{lo}-{hi}'}"


def _original_ports(e: Entry) -> list[str]:
    """The port match on the connection's original tuple: one per protocol (``ct original
    proto-dst`` takes its type from a single ``meta l4proto``; a set of protocols leaves it untyped)."""
    if e.ports is None:
        return [""]
    lo, hi = e.ports
    return [f" meta l4proto {proto} ct original proto-dst {lo if lo == hi else f'{lo}-{hi}'}" for proto in ("tcp", "udp")]


def _targets(e: Entry, w: EnvWiring, resolved: Resolved) -> list[ipaddress.IPv4Network]:
    if e.kind == "cidr":
        assert e.network is not None
        return [e.network]
    if e.kind == "node":
        return [ipaddress.IPv4Network(w.gateway)]
    return [ipaddress.IPv4Network(a) for a in resolved.of(e.host or "")]


def _inside_implicit(net: ipaddress.IPv4Network, egress_range: ipaddress.IPv4Network) -> bool:
    return any(net.subnet_of(n) for n in (*IMPLICIT_DENY, egress_range))


def _match(nets: list[ipaddress.IPv4Network]) -> str:
    """The destination, as the connection was opened (the same for a packet of either direction)."""
    collapsed = list(ipaddress.collapse_addresses(nets))
    return "ct original ip daddr " + _set(str(n) if n.prefixlen < 32 else str(n.network_address) for n in collapsed)


def render_env_rules(table: str, w: EnvWiring, policy: EgressPolicy, resolved: Resolved,
                     egress_range: ipaddress.IPv4Network, generation: int = 1) -> list[str]:
    """Flush and refill the env's chains for policy ``generation`` (a creation or a policy change).
    ``b_`` is refilled too: its fast accept names the generation."""
    t, k, g = f"inet {table}", w.key, _gen(generation)
    mark = f"ct mark and 0x{GEN_MASK:08x}"  # this env's generation, as stamped on a connection
    fast = f"ct state established,related {mark} == {g}"
    restamp = f"ct mark set ct mark and 0x{~GEN_MASK & 0xFFFFFFFF:08x} or {g}"
    deny, refuse = f"counter name {k}_deny reject", f"counter name {k}_deny goto rst"
    o, i, b, p, a = (f"add rule {t} {c}_{k}" for c in CHAINS)
    lines = [f"flush chain {t} {c}_{k}" for c in CHAINS]  # (not "add chain": one that exists costs ~8 ms)

    # allowed: a connection seen for the first time is counted and stamped; one judged again after a
    # policy change is re-stamped and counted as traffic (its direction's bytes), not as a connection
    lines += [f"{a} {mark} == 0 {restamp} counter name {k}_conn accept",
              f"{a} {restamp} ct direction reply counter name {k}_in accept",
              f"{a} counter name {k}_out accept"]

    # env → elsewhere, forwarded: the fast accept of current connections, then the policy
    lines += [f"{o} ip saddr != {w.address} {deny}", f"{o} meta nfproto ipv6 {deny}",
              f"{o} {fast} counter name {k}_out accept",
              f"{o} ct state invalid counter name {k}_deny drop",  # not a connection's packet: never a reset
              f"{o} oifname != @egress {refuse}",
              f"{o} goto p_{k}"]
    # elsewhere → env: replies only; those of a connection of an older generation are judged again
    lines += [f"{b} {fast} counter name {k}_in accept",
              f"{b} ct state established,related goto p_{k}",
              f"{b} counter name {k}_deny drop"]

    # the policy, on the connection's original tuple
    for e in policy.deny:
        if e.kind != "node" and (nets := _targets(e, w, resolved)):
            lines += [f"{p} {_match(nets)}{ports} {refuse}" for ports in _original_ports(e)]
    late: list[str] = []
    for e in policy.allow:
        if e.kind == "node":
            continue
        nets = _targets(e, w, resolved)
        if not nets:
            continue  # a name that resolved to nothing allows nothing
        early = [n for n in nets if _inside_implicit(n, egress_range)]
        rest = [n for n in nets if n not in early]
        if early and not policy.restricted:  # named explicitly inside an implicit deny: allowed before it
            # (a tenant's policy never has such an entry or answer, refused or dropped before: and
            # should one get here, it stays denied)
            lines += [f"{p} {_match(early)}{ports} goto a_{k}" for ports in _original_ports(e)]
        if rest:
            late += [f"{p} {_match(rest)}{ports} goto a_{k}" for ports in _original_ports(e)]
    implicit = [*IMPLICIT_DENY, egress_range]
    lines.append(f"{p} ct original ip daddr {_set(implicit)} {refuse}")
    lines += late
    lines.append(f"{p} {refuse}")

    # env → the node (its replies are the node's output: not filtered)
    lines += [f"{i} ip saddr != {w.address} {deny}", f"{i} meta nfproto ipv6 {deny}",
              f"{i} {fast} accept",
              f"{i} ct state established,related ct direction reply accept",  # the node's own connections to the env
              f"{i} ct state invalid counter name {k}_deny drop"]
    for e in policy.deny:
        if e.kind == "node" or (e.kind == "cidr" and e.network is not None and w.gateway in e.network):
            lines.append(f"{i} ip daddr {w.gateway}{_ports(e)} {refuse}")
    if policy.dns != "none":
        lines.append(f"{i} ip daddr {w.gateway} meta l4proto {{ tcp, udp }} th dport 53 {restamp} accept")
    for e in policy.allow:
        if e.kind == "node" and not policy.restricted:  # a tenant's policy may not open the node (refused before)
            to = f"{i} ip daddr {w.gateway}{_ports(e)}"
            lines += [f"{to} {mark} == 0 {restamp} counter name {k}_conn accept", f"{to} {restamp} accept"]
    lines.append(f"{i} {refuse}")
    return lines


def render_env(table: str, w: EnvWiring, policy: EgressPolicy, resolved: Resolved,
               egress_range: ipaddress.IPv4Network, generation: int = 1) -> str:
    """Everything for a new env: counters, chains, rules, and its entries in the verdict maps."""
    t, k = f"inet {table}", w.key
    lines = [f"add counter {t} {k}_{c}" for c in COUNTERS]
    lines += [f"add chain {t} {c}_{k}" for c in CHAINS]
    lines += render_env_rules(table, w, policy, resolved, egress_range, generation)
    v = _q(w.veth)
    lines += [f"add element {t} env_out {{ {v} : jump o_{k} }}", f"add element {t} env_in {{ {v} : jump i_{k} }}",
              f"add element {t} env_back {{ {v} : jump b_{k} }}", f"add element {t} envs {{ {v} }}"]
    return "\n".join(lines) + "\n"


def render_policy_change(table: str, w: EnvWiring, policy: EgressPolicy, resolved: Resolved,
                         egress_range: ipaddress.IPv4Network, generation: int = 1) -> str:
    """The env's chains refilled for ``generation`` in one transaction: from its commit on, a
    connection stamped with another generation is judged by the new policy at its next packet."""
    return "\n".join(render_env_rules(table, w, policy, resolved, egress_range, generation)) + "\n"


@dataclass
class TableState:
    """What a table holds, from ``nft -j list table``: enough to delete exactly what exists."""

    chains: set[str] = field(default_factory=set)
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)  # name: (packets, bytes)
    elements: dict[str, set[str]] = field(default_factory=dict)  # map or set name: keys

    def keys(self) -> set[str]:
        """Env keys that have any chain here."""
        return {c[2:] for c in self.chains if c[:2] in {f"{x}_" for x in CHAINS}}


def parse_table(text: str) -> TableState:
    """``nft -j list table inet T`` output → :class:`TableState` (empty for empty text)."""
    st = TableState()
    if not text.strip():
        return st
    for item in json.loads(text).get("nftables", []):
        if "chain" in item:
            st.chains.add(item["chain"]["name"])
        elif "counter" in item:
            c = item["counter"]
            st.counters[c["name"]] = (int(c.get("packets", 0)), int(c.get("bytes", 0)))
        elif "map" in item or "set" in item:
            s = item.get("map") or item.get("set")
            keys: set[str] = set()
            for el in s.get("elem", []) or []:
                if isinstance(el, list):  # map element: [key, value]
                    el = el[0]
                if isinstance(el, str):
                    keys.add(el)
            st.elements[s["name"]] = keys
    return st


def render_env_delete(table: str, key: str, veth: str, state: TableState) -> str:
    """Remove what exists of one env (maps entries first: they reference its chains; its chains
    in :data:`CHAINS` order, each emptied before it goes, so no rule still jumps to one deleted)."""
    t, v = f"inet {table}", _q(veth)
    lines = []
    for m in ("env_out", "env_in", "env_back", "envs"):
        if veth in state.elements.get(m, set()):
            lines.append(f"delete element {t} {m} {{ {v} }}")
    chains = [c for c in CHAINS if f"{c}_{key}" in state.chains]
    lines += [f"flush chain {t} {c}_{key}" for c in chains]
    lines += [f"delete chain {t} {c}_{key}" for c in chains]
    for c in COUNTERS:
        if f"{key}_{c}" in state.counters:
            lines.append(f"delete counter {t} {key}_{c}")
    return "\n".join(lines) + ("\n" if lines else "")


def full_state(key: str, veth: str) -> TableState:
    """The state :func:`render_env` leaves: deleting against it assumes everything is there (one
    transaction, no listing; if something is missing it fails as a whole and nothing changes)."""
    return TableState(chains={f"{c}_{key}" for c in CHAINS},
                      counters={f"{key}_{c}": (0, 0) for c in COUNTERS},
                      elements={m: {veth} for m in ("env_out", "env_in", "env_back", "envs")})


def stale_elements(state: TableState, live_veths: set[str]) -> list[str]:
    """Map entries naming a veth no live env owns (a daemon died between steps)."""
    return sorted({k for m in ("env_out", "env_in", "env_back", "envs") for k in state.elements.get(m, set())}
                  - live_veths)


def env_counters(state: TableState, key: str) -> dict[str, int]:
    """The accounting of one env in the words of ``weenv top`` and the env's info."""
    def get(c: str) -> tuple[int, int]:
        return state.counters.get(f"{key}_{c}", (0, 0))

    return {"bytes_out": get("out")[1], "bytes_in": get("in")[1], "connections_allowed": get("conn")[0],
            "packets_denied": get("deny")[0], "bytes_denied": get("deny")[1]}
