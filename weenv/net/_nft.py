"""nftables scripts for egress envs: pure text rendering and JSON parsing, no I/O.

One table (``inet weenv`` by default; tests give every daemon its own) holds everything weenv
adds to the kernel, so nothing else in the node's ruleset is read, flushed or changed::

    forward (filter, priority -10): iifname vmap @env_out   env → elsewhere: its o_<key> chain
                                     oifname vmap @env_back  elsewhere → env: its b_<key> chain
                                     iifname @fwd_guard ct state new,invalid,untracked drop:
                                       forwarding weenv turned on carries replies only
    input   (filter, priority -10): iifname vmap @env_in    env → the node: its i_<key> chain
    postrouting (nat, srcnat):       from the range, out of an @egress interface: masquerade

Per env (``key`` = ``e`` + 10 hex digits): chains ``o_``/``i_``/``b_<key>`` and four named
counters ``<key>_out`` (allowed env → world), ``<key>_in`` (world → env replies), ``<key>_conn``
(new connections allowed) and ``<key>_deny`` (packets dropped). Every chain ends in a counted drop.
A policy change re-renders ``o_`` and ``i_`` in one transaction: flush and refill are atomic.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._policy import IMPLICIT_DENY, EgressPolicy, Entry, Resolved

COUNTERS = ("out", "in", "conn", "deny")


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
        f"flush chain {t} forward", f"flush chain {t} input", f"flush chain {t} postrouting",
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
    collapsed = list(ipaddress.collapse_addresses(nets))
    return "ip daddr " + _set(str(n) if n.prefixlen < 32 else str(n.network_address) for n in collapsed)


def render_env_rules(table: str, w: EnvWiring, policy: EgressPolicy, resolved: Resolved,
                     egress_range: ipaddress.IPv4Network) -> list[str]:
    """Flush and refill the env's ``o_`` and ``i_`` chains (a creation or a policy change)."""
    t, k = f"inet {table}", w.key
    deny, conn = f"counter name {k}_deny reject", f"counter name {k}_conn accept"  # reject: fails fast
    o, i = f"add rule {t} o_{k}", f"add rule {t} i_{k}"
    lines = [f"flush chain {t} o_{k}", f"flush chain {t} i_{k}",
             f"{o} ip saddr != {w.address} {deny}", f"{o} meta nfproto ipv6 {deny}",
             f"{o} ct state established,related counter name {k}_out accept",
             f"{o} oifname != @egress {deny}"]
    forward_allow = [e for e in policy.allow if e.kind != "node"]
    for e in policy.deny:
        if e.kind != "node" and (nets := _targets(e, w, resolved)):
            lines.append(f"{o} {_match(nets)}{_ports(e)} {deny}")
    late: list[str] = []
    for e in forward_allow:
        nets = _targets(e, w, resolved)
        if not nets:
            continue  # a name that resolved to nothing allows nothing
        early = [n for n in nets if _inside_implicit(n, egress_range)]
        rest = [n for n in nets if n not in early]
        if early:  # named explicitly inside an implicit deny: allowed before it
            lines.append(f"{o} {_match(early)}{_ports(e)} {conn}")
        if rest:
            late.append(f"{o} {_match(rest)}{_ports(e)} {conn}")
    implicit = [*IMPLICIT_DENY, egress_range]
    lines.append(f"{o} ip daddr {_set(implicit)} {deny}")
    lines += late
    lines.append(f"{o} {deny}")

    lines += [f"{i} ip saddr != {w.address} {deny}", f"{i} meta nfproto ipv6 {deny}",
              f"{i} ct state established,related accept"]
    for e in policy.deny:
        if e.kind == "node" or (e.kind == "cidr" and e.network is not None and w.gateway in e.network):
            lines.append(f"{i} ip daddr {w.gateway}{_ports(e)} {deny}")
    if policy.dns == "node":
        lines.append(f"{i} ip daddr {w.gateway} meta l4proto {{ tcp, udp }} th dport 53 accept")
    for e in policy.allow:
        if e.kind == "node":
            lines.append(f"{i} ip daddr {w.gateway}{_ports(e)} {conn}")
    lines.append(f"{i} {deny}")
    return lines


def render_env(table: str, w: EnvWiring, policy: EgressPolicy, resolved: Resolved,
               egress_range: ipaddress.IPv4Network) -> str:
    """Everything for a new env: counters, chains, rules, and its entries in the verdict maps."""
    t, k = f"inet {table}", w.key
    lines = [f"add counter {t} {k}_{c}" for c in COUNTERS]
    lines += [f"add chain {t} {c}_{k}" for c in ("o", "i", "b")]
    lines += [f"flush chain {t} b_{k}",
              f"add rule {t} b_{k} ct state established,related counter name {k}_in accept",
              f"add rule {t} b_{k} counter name {k}_deny drop"]
    lines += render_env_rules(table, w, policy, resolved, egress_range)
    v = _q(w.veth)
    lines += [f"add element {t} env_out {{ {v} : jump o_{k} }}", f"add element {t} env_in {{ {v} : jump i_{k} }}",
              f"add element {t} env_back {{ {v} : jump b_{k} }}", f"add element {t} envs {{ {v} }}"]
    return "\n".join(lines) + "\n"


def render_policy_change(table: str, w: EnvWiring, policy: EgressPolicy, resolved: Resolved,
                         egress_range: ipaddress.IPv4Network) -> str:
    return "\n".join(render_env_rules(table, w, policy, resolved, egress_range)) + "\n"


@dataclass
class TableState:
    """What a table holds, from ``nft -j list table``: enough to delete exactly what exists."""

    chains: set[str] = field(default_factory=set)
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)  # name: (packets, bytes)
    elements: dict[str, set[str]] = field(default_factory=dict)  # map or set name: keys

    def keys(self) -> set[str]:
        """Env keys that have any chain here."""
        return {c[2:] for c in self.chains if c[:2] in ("o_", "i_", "b_")}


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
    """Remove what exists of one env (maps entries first: they reference its chains)."""
    t, v = f"inet {table}", _q(veth)
    lines = []
    for m in ("env_out", "env_in", "env_back", "envs"):
        if veth in state.elements.get(m, set()):
            lines.append(f"delete element {t} {m} {{ {v} }}")
    for c in ("o", "i", "b"):
        if f"{c}_{key}" in state.chains:
            lines += [f"flush chain {t} {c}_{key}", f"delete chain {t} {c}_{key}"]
    for c in COUNTERS:
        if f"{key}_{c}" in state.counters:
            lines.append(f"delete counter {t} {key}_{c}")
    return "\n".join(lines) + ("\n" if lines else "")


def full_state(key: str, veth: str) -> TableState:
    """The state :func:`render_env` leaves: deleting against it assumes everything is there (one
    transaction, no listing; if something is missing it fails as a whole and nothing changes)."""
    return TableState(chains={f"{c}_{key}" for c in ("o", "i", "b")},
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
