"""The env's resolver as a pure function: a query in, an answer out (dnspython does the wire format).

It answers only the names the env's policy allows, with exactly the addresses pinned in its
rules: an allowed name that the env resolves is one it can reach, and no other name resolves, so
DNS cannot be used to learn about (or tunnel to) anything else. Other names get NXDOMAIN.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

ANSWER_TTL_S = 30


def answer(query_wire: bytes, names: Mapping[str, Sequence[ipaddress.IPv4Address]]) -> bytes | None:
    """The response to one DNS query; None for a packet that is not a query (dropped)."""
    try:
        query = dns.message.from_wire(query_wire)
    except (dns.exception.DNSException, ValueError):
        return None
    if query.flags & dns.flags.QR or len(query.question) != 1:
        return None
    resp = dns.message.make_response(query)
    resp.flags |= dns.flags.AA
    resp.flags &= ~dns.flags.RA
    q = query.question[0]
    name = q.name.to_text(omit_final_dot=True).lower()
    addrs = names.get(name)
    if addrs is None or q.rdclass != dns.rdataclass.IN:
        resp.set_rcode(dns.rcode.NXDOMAIN)
    elif q.rdtype in (dns.rdatatype.A, dns.rdatatype.ANY) and addrs:
        resp.answer.append(dns.rrset.from_text(q.name, ANSWER_TTL_S, "IN", "A", *map(str, addrs)))
    # other types of an allowed name (AAAA, ...): an empty NOERROR answer
    return resp.to_wire()


def question_name(query_wire: bytes) -> str | None:
    """The name a query asks about (lower case, no final dot); None for what is not one query."""
    try:
        query = dns.message.from_wire(query_wire)
    except (dns.exception.DNSException, ValueError):
        return None
    if query.flags & dns.flags.QR or len(query.question) != 1:
        return None
    return str(query.question[0].name.to_text(omit_final_dot=True).lower())


def resolve(host: str, *, server: str | None, timeout_s: float = 3.0) -> tuple[ipaddress.IPv4Address, ...]:
    """A host name's IPv4 addresses: from ``server`` (``ADDR`` or ``ADDR:PORT``), else the node's
    own resolver. Blocking. An empty tuple when the name has no address; OSError-like failures
    propagate as ``ValueError`` naming the host."""
    if server is None:
        import socket

        try:
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"{host}: {e.strerror}") from None
        return tuple(sorted({ipaddress.IPv4Address(i[4][0]) for i in infos}))
    import dns.resolver

    addr, _, port = server.partition(":")
    r = dns.resolver.Resolver(configure=False)
    r.nameservers = [addr]
    r.port = int(port or 53)
    r.timeout = r.lifetime = timeout_s
    try:
        ans = r.resolve(host, "A", search=False)
    except dns.resolver.NXDOMAIN:
        raise ValueError(f"{host}: no such name (asked {server})") from None
    except dns.resolver.NoAnswer:
        return ()
    except dns.exception.DNSException as e:
        raise ValueError(f"{host}: {e} (asked {server})") from None
    return tuple(sorted({ipaddress.IPv4Address(a.address) for a in ans}))
