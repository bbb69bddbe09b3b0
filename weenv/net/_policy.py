"""The egress policy of one env, as data: the allow/deny grammar, bandwidth, DNS, address slots.

No I/O here (a test pins that this module imports no socket, subprocess or trio): the plan
validates entries with :func:`parse_entry`, the daemon compiles a plan's ``[network]`` table with
:func:`parse_policy` and hands the result to :mod:`._nft` to become kernel rules.

Entry grammar (docs/network.md)::

    entry  = target [":" ports]
    target = "node" | IPv4 address | IPv4 CIDR | host name
    ports  = port | port "-" port        (1-65535; tcp and udp; no ports: every protocol and port)

``node`` is the env's gateway: the node itself as the env sees it.

A *restricted* policy (``EgressPolicy.restricted``: an env created for a tenant, a non-admin API
key) can never open what :class:`Reserved` lists: the node, loopback, link-local, the other
implicit denies, the egress range (other envs) and the node's own addresses. Its allow entries
are checked with :func:`restricted_problems`, and DNS answers in those ranges are dropped
(:meth:`Reserved.split`) before anything is pinned.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Literal

EntryKind = Literal["cidr", "node", "host"]
DnsMode = Literal["node", "forward", "none"]

#: Denied unless an allow entry names a network inside one of them explicitly: link-local (cloud
#: metadata services live at 169.254.169.254), "this network", loopback, multicast, broadcast.
IMPLICIT_DENY: tuple[ipaddress.IPv4Network, ...] = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4"))
_IMPLICIT_WORDS = dict(zip(IMPLICIT_DENY, (
    '"this network" (0.0.0.0/8)', "loopback (127.0.0.0/8)",
    "link-local (169.254.0.0/16, where cloud metadata services live)", "multicast (224.0.0.0/4)",
    "the reserved range 240.0.0.0/4")))

_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOST = re.compile(rf"^{_LABEL}(\.{_LABEL})*\.?$")
_BANDWIDTH = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*$", re.IGNORECASE)
_BANDWIDTH_UNITS = {"bit": 1, "kbit": 1000, "mbit": 1000**2, "gbit": 1000**3}
BANDWIDTH_PATTERN = r"^\s*\d+(\.\d+)?\s*([kKmMgG])?[bB][iI][tT]\s*$"
MIN_BANDWIDTH_BPS = 8_000  # below 1 kB/s TCP cannot even keep its connection alive
MAX_BANDWIDTH_BPS = 400 * 1000**3


class PolicyError(ValueError):
    """An entry, bandwidth or DNS value that breaks the grammar; ``location`` names it
    (``allow[2]``), the message says what is wrong."""

    def __init__(self, location: str, message: str):
        super().__init__(f"{location}: {message}" if location else message)
        self.location, self.message = location, message


@dataclass(frozen=True)
class Entry:
    """One allow or deny entry. ``ports`` is an inclusive range; None means every protocol and port."""

    text: str
    kind: EntryKind
    network: ipaddress.IPv4Network | None = None  # for kind "cidr"
    host: str | None = None  # for kind "host" (lowercase, no trailing dot)
    ports: tuple[int, int] | None = None


def _parse_ports(text: str, entry: str) -> tuple[int, int]:
    lo_s, sep, hi_s = text.partition("-")
    try:
        lo, hi = int(lo_s), int(hi_s) if sep else int(lo_s)
    except ValueError:
        raise ValueError(f"{entry!r}: port {text!r} is not a number or a range like 8000-8100") from None
    for p in (lo, hi):
        if not 1 <= p <= 65535:
            raise ValueError(f"{entry!r}: port {p} is outside 1-65535")
    if lo > hi:
        raise ValueError(f"{entry!r}: port range {text!r} is reversed (write {hi}-{lo})")
    return lo, hi


def parse_entry(text: str) -> Entry:
    """One entry of ``allow`` or ``deny``; ValueError says what is wrong with it."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("an entry must be a non-empty string such as '10.0.0.0/8:443' or 'node:8000'")
    s = text.strip()
    if s.startswith("[") or s.count(":") > 1:
        raise ValueError(f"{text!r}: IPv6 is not supported (an egress env has no IPv6 route); "
                         "use IPv4 addresses or host names")
    target, sep, port_text = s.partition(":")
    if sep and not port_text:
        raise ValueError(f"{text!r}: nothing after ':' (write a port such as :443, or leave ':' out for all ports)")
    ports = _parse_ports(port_text, text) if sep else None
    if target == "node":
        return Entry(text=text, kind="node", ports=ports)
    if re.fullmatch(r"[0-9./]+", target):
        try:
            net = ipaddress.IPv4Network(target, strict=True)
        except ipaddress.NetmaskValueError as e:
            raise ValueError(f"{text!r}: {e}") from None
        except ValueError as e:
            if "has host bits set" in str(e):
                fixed = ipaddress.IPv4Network(target, strict=False)
                raise ValueError(f"{text!r}: {target} has host bits set (write {fixed})") from None
            raise ValueError(f"{text!r}: {target!r} is not an IPv4 address or CIDR") from None
        return Entry(text=text, kind="cidr", network=net, ports=ports)
    if not _HOST.match(target) or len(target) > 253:
        raise ValueError(f"{text!r}: {target!r} is not 'node', an IPv4 address or CIDR, or a host name")
    if target.rstrip(".").split(".")[-1].isdigit():
        raise ValueError(f"{text!r}: {target!r} looks like an IP address but is not a valid one")
    return Entry(text=text, kind="host", host=target.rstrip(".").lower(), ports=ports)


def parse_bandwidth(text: str) -> int:
    """``"100Mbit"`` → 100_000_000 bits per second (bit, kbit, Mbit, Gbit; decimal units)."""
    m = _BANDWIDTH.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a rate such as '100Mbit', '1.5Gbit' or '800kbit'")
    bps = int(float(m[1]) * _BANDWIDTH_UNITS[m[2].lower()])
    if not MIN_BANDWIDTH_BPS <= bps <= MAX_BANDWIDTH_BPS:
        raise ValueError(f"{text!r} is outside {MIN_BANDWIDTH_BPS // 1000}kbit-{MAX_BANDWIDTH_BPS // 1000**3}Gbit")
    return bps


@dataclass(frozen=True)
class EgressPolicy:
    """What one egress env may reach. ``deny`` wins over ``allow``; the implicit denies
    (:data:`IMPLICIT_DENY`, other envs, the node itself) give way only to an allow entry inside them."""

    allow: tuple[Entry, ...] = ()
    deny: tuple[Entry, ...] = ()
    bandwidth_bps: int | None = None
    dns: DnsMode = "none"
    restricted: bool = False  # a tenant's env: nothing in Reserved can ever be opened (module docstring)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names to resolve (allow and deny), each once, in order."""
        seen: dict[str, None] = {}
        for e in (*self.allow, *self.deny):
            if e.host is not None:
                seen.setdefault(e.host)
        return tuple(seen)

    @property
    def allowed_hosts(self) -> tuple[str, ...]:
        """The names the env's resolver answers."""
        return tuple(dict.fromkeys(e.host for e in self.allow if e.host is not None))

    def reaches(self, addr: ipaddress.IPv4Address, others: ipaddress.IPv4Network | None = None) -> bool:
        """Whether some port of ``addr`` is open by the CIDR entries (what a forwarded DNS answer may
        name): deny wins, and an implicit deny (``others``: the egress range) gives way only to an
        allow entry inside it."""
        if any(e.network is not None and e.ports is None and addr in e.network for e in self.deny):
            return False
        closed = [n for n in (*IMPLICIT_DENY, *([others] if others is not None else [])) if addr in n]
        return any(e.network is not None and addr in e.network and all(e.network.subnet_of(n) for n in closed)
                   for e in self.allow if e.kind == "cidr")

    def node_ports(self) -> tuple[tuple[int, int] | None, ...]:
        """Port ranges of the node the env may reach (None: every port)."""
        return tuple(e.ports for e in self.allow if e.kind == "node")

    def to_builtins(self) -> dict:
        out: dict = {"allow": [e.text for e in self.allow], "deny": [e.text for e in self.deny], "dns": self.dns}
        if self.bandwidth_bps is not None:
            out["bandwidth_bps"] = self.bandwidth_bps
        if self.restricted:
            out["restricted"] = True
        return out


def parse_policy(allow: list[str] | tuple[str, ...] = (), deny: list[str] | tuple[str, ...] = (),
                 bandwidth: str | int | None = None, dns: str | None = None, *,
                 restricted: bool = False) -> EgressPolicy:
    """Compile the fields of a plan's ``[network]`` table; :class:`PolicyError` names the bad one.

    ``dns`` defaults to ``node`` when some allow entry is a host name, else ``forward`` when one opens
    every address (``0.0.0.0/0``: the env reaches what any name resolves to), else ``none``. ``bandwidth``
    may already be bits per second (an int). ``restricted`` marks a tenant's policy; what it may
    not allow is checked against the node by :func:`restricted_problems`, not here."""
    parsed: dict[str, list[Entry]] = {"allow": [], "deny": []}
    for name, entries in (("allow", allow), ("deny", deny)):
        for i, text in enumerate(entries):
            try:
                parsed[name].append(parse_entry(text))
            except ValueError as e:
                raise PolicyError(f"{name}[{i}]", str(e)) from None
    bps: int | None = None
    if isinstance(bandwidth, int) and not isinstance(bandwidth, bool):
        bps = bandwidth
    elif bandwidth is not None:
        try:
            bps = parse_bandwidth(bandwidth)
        except ValueError as e:
            raise PolicyError("bandwidth", str(e)) from None
    if dns is None:
        dns = _default_dns(parsed["allow"], "none")
    if dns not in ("node", "forward", "none"):
        raise PolicyError("dns", f"expected 'node', 'forward' or 'none', got {dns!r}")
    return EgressPolicy(allow=tuple(parsed["allow"]), deny=tuple(parsed["deny"]), bandwidth_bps=bps,
                        dns=dns, restricted=restricted)  # type: ignore[arg-type]


def change_policy(policy: EgressPolicy, *, allow: list[str] = (), deny: list[str] = (),  # type: ignore[assignment]
                  remove: list[str] = ()) -> EgressPolicy:  # type: ignore[assignment]
    """A running env's new policy: ``allow`` entries are added (and taken off the deny list), ``deny``
    entries added (and taken off the allow list), ``remove`` entries dropped from both lists."""
    def parsed(name: str, texts: list[str]) -> list[Entry]:
        out = []
        for i, t in enumerate(texts):
            try:
                out.append(parse_entry(t))
            except ValueError as e:
                raise PolicyError(f"{name}[{i}]", str(e)) from None
        return out

    new_allow, new_deny, removed = parsed("allow", allow), parsed("deny", deny), parsed("remove", remove)
    drop_allow = {_key(e) for e in (*new_deny, *removed)}
    drop_deny = {_key(e) for e in (*new_allow, *removed)}
    kept_allow = [e for e in policy.allow if _key(e) not in drop_allow]
    kept_deny = [e for e in policy.deny if _key(e) not in drop_deny]
    have_a, have_d = {_key(e) for e in kept_allow}, {_key(e) for e in kept_deny}
    allow_out = kept_allow + [e for e in new_allow if _key(e) not in have_a]
    deny_out = kept_deny + [e for e in new_deny if _key(e) not in have_d]
    dns = policy.dns  # what the change opens: names (none -> node), every address (-> forward)
    if _default_dns(allow_out, "none") == "forward":
        dns = "forward"
    elif dns == "none" and any(e.kind == "host" for e in new_allow):
        dns = "node"
    return EgressPolicy(allow=tuple(allow_out), deny=tuple(deny_out), bandwidth_bps=policy.bandwidth_bps, dns=dns,
                        restricted=policy.restricted)


def _default_dns(allow: list[Entry], otherwise: str) -> str:
    """``node`` for allowed host names (answered from the pinned addresses), ``forward`` for an env that
    reaches every address (every name asked of the node's resolver), else ``otherwise``."""
    if otherwise == "forward" or any(e.kind == "cidr" and e.network is not None and e.network.prefixlen == 0
                                     for e in allow):
        return "forward"
    return "node" if any(e.kind == "host" for e in allow) else otherwise


def _key(e: Entry) -> tuple:
    return (e.kind, e.network, e.host, e.ports)


def policy_from_builtins(data: dict) -> EgressPolicy:
    """The inverse of :meth:`EgressPolicy.to_builtins` (the daemon's saved state)."""
    return parse_policy(data.get("allow", ()), data.get("deny", ()), data.get("bandwidth_bps"), data.get("dns"),
                        restricted=bool(data.get("restricted", False)))


# -- tenants ---------------------------------------------------------------------------------



@dataclass(frozen=True)
class Reserved:
    """What a restricted (tenant) env can never reach, whatever its policy says: the implicit
    denies (loopback, link-local, ...), the node-local ``egress_range`` (other envs) and the
    node's own ``node_addresses`` (read from the node when the check is made: they can change)."""

    egress_range: ipaddress.IPv4Network
    node_addresses: frozenset[ipaddress.IPv4Address] = frozenset()

    def why(self, net: ipaddress.IPv4Network | ipaddress.IPv4Address) -> str | None:
        """What reserved range ``net`` (a network or one address) lies inside, in words; None when
        it lies inside none. A *wider* network (``0.0.0.0/0``) is not reserved: the rules put the
        implicit denies and the egress range before the allow entries that hold them, and the
        node's own addresses are reached through its input chain, which no CIDR opens
        (:mod:`._nft`); only an entry inside a reserved range could open it."""
        if isinstance(net, ipaddress.IPv4Address):
            net = ipaddress.IPv4Network(net)
        for n in IMPLICIT_DENY:
            if net.subnet_of(n):
                return _IMPLICIT_WORDS[n]
        if net.subnet_of(self.egress_range):
            return f"the egress range {self.egress_range} (other envs)"
        if net.prefixlen == 32 and net.network_address in self.node_addresses:
            return f"{net.network_address}, an address of this node,"
        return None

    def split(self, addresses: tuple[ipaddress.IPv4Address, ...]
              ) -> tuple[tuple[ipaddress.IPv4Address, ...], tuple[ipaddress.IPv4Address, ...]]:
        """A name's DNS answers as (kept, dropped): the dropped ones are reserved."""
        kept = tuple(a for a in addresses if self.why(a) is None)
        return kept, tuple(a for a in addresses if a not in kept)


def restricted_problems(entries: tuple[Entry, ...] | list[Entry], reserved: Reserved,
                        name: str = "allow") -> list[PolicyError]:
    """The allow entries a restricted policy may not have, each named by its place in ``entries``
    (``allow[1]``): ``node`` (the node's own ports), and any network inside a reserved range.
    Host names are checked when they are resolved (:meth:`Reserved.split`); deny entries are
    always fine."""
    problems = []
    for i, e in enumerate(entries):
        if e.kind == "node":
            what = "the node's own ports are"
        elif e.kind == "cidr" and e.network is not None and (why := reserved.why(e.network)) is not None:
            what = f"{why} is"
        else:
            continue
        problems.append(PolicyError(f"{name}[{i}]", f"{e.text!r}: {what} not open to tenant envs"))
    return problems


# -- addresses -------------------------------------------------------------------------------

SLOT_PREFIX = 30  # each env: a /30 of the node-local range (gateway .1, env .2)


@dataclass(frozen=True)
class Slot:
    """The addresses of env number ``index`` in the node-local range."""

    index: int
    gateway: ipaddress.IPv4Address
    address: ipaddress.IPv4Address
    prefix: int = SLOT_PREFIX


def parse_range(text: str) -> ipaddress.IPv4Network:
    """The node-local range egress envs take their addresses from (at least a /28: four envs)."""
    try:
        net = ipaddress.IPv4Network(text, strict=True)
    except ValueError as e:
        raise ValueError(f"egress range {text!r}: {e}") from None
    if net.prefixlen > 28:
        raise ValueError(f"egress range {text}: too small (at most /28)")
    if any(net.overlaps(n) for n in IMPLICIT_DENY):
        raise ValueError(f"egress range {text}: overlaps a reserved range (loopback, link-local, multicast)")
    return net


def slot_count(net: ipaddress.IPv4Network) -> int:
    return 1 << (SLOT_PREFIX - net.prefixlen)


def slot(net: ipaddress.IPv4Network, index: int) -> Slot:
    if not 0 <= index < slot_count(net):
        raise ValueError(f"slot {index} is outside {net} ({slot_count(net)} slots)")
    base = int(net.network_address) + 4 * index
    return Slot(index=index, gateway=ipaddress.IPv4Address(base + 1), address=ipaddress.IPv4Address(base + 2))


def free_slot(net: ipaddress.IPv4Network, taken: set[int] | frozenset[int]) -> int:
    """The lowest slot not in ``taken``; ValueError when the range is full."""
    for i in range(slot_count(net)):
        if i not in taken:
            return i
    raise ValueError(f"egress range {net} is full ({slot_count(net)} envs)")


@dataclass
class Resolved:
    """Addresses pinned for each host name (what the rules allow and the env's resolver answers)."""

    addresses: dict[str, tuple[ipaddress.IPv4Address, ...]] = field(default_factory=dict)
    # answers of a restricted env's names that were reserved, and so not pinned (not in to_builtins)
    dropped: dict[str, tuple[ipaddress.IPv4Address, ...]] = field(default_factory=dict)

    def of(self, host: str) -> tuple[ipaddress.IPv4Address, ...]:
        return self.addresses.get(host, ())

    def to_builtins(self) -> dict[str, list[str]]:
        return {h: [str(a) for a in addrs] for h, addrs in self.addresses.items()}

    @classmethod
    def from_builtins(cls, data: dict[str, list[str]]) -> "Resolved":
        return cls({h: tuple(ipaddress.IPv4Address(a) for a in addrs) for h, addrs in data.items()})
