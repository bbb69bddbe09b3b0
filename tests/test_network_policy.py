"""weenv.net's pure parts: the allow/deny grammar, policy changes, address slots, the nft scripts,
the resolver's answers, and the plan's [network] table (no I/O, no kernel)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import dns.message
import dns.rcode
import pytest

from weenv.net import PolicyError, parse_bandwidth, parse_entry, parse_policy
from weenv.net._dns import answer
from weenv.net._nft import (EnvWiring, env_counters, full_state, next_generation, parse_table, render_base,
                            render_env, render_env_delete, render_policy_change, stale_elements)
from weenv.net._policy import Resolved, change_policy, free_slot, parse_range, slot, slot_count
from weenv.plan import PlanValidationError, dump_plan, load_plan, plan_json_schema
from weenv.plan._model import network_policy

RANGE = ipaddress.IPv4Network("10.213.0.0/16")
WIRING = EnvWiring(key="e0123456789", veth="wv0123456789", address=ipaddress.IPv4Address("10.213.0.2"),
                   gateway=ipaddress.IPv4Address("10.213.0.1"))


# -- grammar ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,kind,net,host,ports", [
    ("10.0.0.0/8:443", "cidr", "10.0.0.0/8", None, (443, 443)),
    ("198.18.0.1", "cidr", "198.18.0.1/32", None, None),
    ("198.18.0.1:8000-8100", "cidr", "198.18.0.1/32", None, (8000, 8100)),
    ("node:8000", "node", None, None, (8000, 8000)),
    ("node", "node", None, None, None),
    ("PyPI.Mirror.internal.:443", "host", None, "pypi.mirror.internal", (443, 443)),
])
def test_entries_parse(text, kind, net, host, ports) -> None:  # type: ignore[no-untyped-def]
    e = parse_entry(text)
    assert (e.kind, str(e.network) if e.network else None, e.host, e.ports) == (kind, net, host, ports)


@pytest.mark.parametrize("text,words", [
    ("10.0.0.1/8:443", "host bits set (write 10.0.0.0/8)"),
    ("10.0.0.0/33", "10.0.0.0/33"),
    ("node:0", "port 0 is outside 1-65535"),
    ("node:70000", "port 70000 is outside"),
    ("node:9-3", "reversed (write 3-9)"),
    ("node:http", "not a number"),
    ("node:", "nothing after ':'"),
    ("[::1]:443", "IPv6 is not supported"),
    ("2001:db8::/32", "IPv6 is not supported"),
    ("under_score.example", "not 'node', an IPv4 address or CIDR, or a host name"),
    ("999.1.1.1", "not an IPv4 address or CIDR"),
    ("", "non-empty"),
])
def test_bad_entries_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        parse_entry(text)
    assert words in str(info.value)


def test_bandwidth() -> None:
    assert parse_bandwidth("100Mbit") == 100_000_000
    assert parse_bandwidth("1.5gbit") == 1_500_000_000
    assert parse_bandwidth("800 kbit") == 800_000
    for bad in ("100MB", "fast", "1bit", "1000Gbit"):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


def test_policy_errors_are_located_and_dns_defaults_follow_host_names() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(["node:80", "10.0.0.1/8"])
    assert info.value.location == "allow[1]"
    with pytest.raises(PolicyError) as info:
        parse_policy(deny=["x:y"])
    assert info.value.location == "deny[0]"
    with pytest.raises(PolicyError) as info:
        parse_policy(bandwidth="zoom")
    assert info.value.location == "bandwidth"
    assert parse_policy(["10.0.0.0/8:443"]).dns == "none"
    assert parse_policy(["mirror.example:443"]).dns == "node"
    assert parse_policy(["mirror.example:443"], dns="none").dns == "none"
    p = parse_policy(["a.example", "node:1"], ["b.example", "a.example"])
    assert p.hosts == ("a.example", "b.example") and p.allowed_hosts == ("a.example",)


def test_policy_change_moves_entries_between_lists() -> None:
    p = parse_policy(["198.18.0.1:8000"], ["198.18.0.3"])
    q = change_policy(p, allow=["198.18.0.3"], deny=["198.18.0.1:8000"])
    assert [e.text for e in q.allow] == ["198.18.0.3"] and [e.text for e in q.deny] == ["198.18.0.1:8000"]
    r = change_policy(q, remove=["198.18.0.1:8000"], allow=["svc.example:1"])
    assert [e.text for e in r.deny] == [] and r.dns == "node"
    with pytest.raises(PolicyError) as info:
        change_policy(p, allow=["node:1", "bad host"])
    assert info.value.location == "allow[1]"


def test_slots() -> None:
    net = parse_range("10.213.0.0/16")
    assert slot_count(net) == 16384
    s = slot(net, 3)
    assert (str(s.gateway), str(s.address), s.prefix) == ("10.213.0.13", "10.213.0.14", 30)
    assert free_slot(net, {0, 1, 3}) == 2
    with pytest.raises(ValueError, match="full"):
        free_slot(parse_range("10.0.0.0/28"), {0, 1, 2, 3})
    for bad in ("10.0.0.0/29", "169.254.0.0/16", "10.0.0.1/16", "nonsense"):
        with pytest.raises(ValueError, match="egress range"):
            parse_range(bad)


# -- nft scripts --------------------------------------------------------------------------------------

def _rules(script: str, chain: str) -> list[str]:
    prefix = f"add rule inet t {chain} "
    return [line[len(prefix):] for line in script.splitlines() if line.startswith(prefix)]


def test_rules_order_deny_then_implicit_then_allow_and_a_counted_reject_last() -> None:
    policy = parse_policy(["198.18.0.0/24:8000", "169.254.169.254:80", "svc.example:443", "node:8000"],
                          ["198.18.0.3"])
    resolved = Resolved({"svc.example": (ipaddress.IPv4Address("198.18.0.1"), ipaddress.IPv4Address("198.18.0.1"))})
    script = render_env("t", WIRING, policy, resolved, RANGE)
    out = _rules(script, "o_e0123456789")
    assert out[0].startswith("ip saddr != 10.213.0.2 ")  # no spoofing
    assert "meta nfproto ipv6" in out[1]
    assert out[2].startswith("ct state established,related ct mark and 0xffff0000 == 0x00010000 ")  # current only
    assert out[3] == "ct state invalid counter name e0123456789_deny drop"  # never a reset for these
    assert out[4].startswith("oifname != @egress")  # only the operator's interfaces
    assert out[5:] == ["goto p_e0123456789"]
    # the policy judges the connection's original tuple: the same rules for a packet of either direction
    pol = _rules(script, "p_e0123456789")
    assert pol[0] == "ct original ip daddr 198.18.0.3 counter name e0123456789_deny goto rst"
    # an allow inside an implicit deny (metadata) comes before it; the rest after; ports per protocol
    assert pol[1:3] == [f"ct original ip daddr 169.254.169.254 meta l4proto {p} ct original proto-dst 80 "
                        "goto a_e0123456789" for p in ("tcp", "udp")]
    assert pol[3].startswith("ct original ip daddr { 0.0.0.0/8, 127.0.0.0/8, 169.254.0.0/16, 224.0.0.0/4, "
                             "240.0.0.0/4, 10.213.0.0/16 }") and pol[3].endswith("goto rst")
    assert pol[4] == "ct original ip daddr 198.18.0.0/24 meta l4proto tcp ct original proto-dst 8000 goto a_e0123456789"
    assert pol[6].startswith("ct original ip daddr 198.18.0.1 meta l4proto tcp ct original proto-dst 443")  # pinned, once
    assert len(pol) == 9 and pol[-1] == "counter name e0123456789_deny goto rst"
    node = _rules(script, "i_e0123456789")
    assert "ip daddr 10.213.0.1 meta l4proto { tcp, udp } th dport 53 ct mark set ct mark and 0x0000ffff or " \
           "0x00010000 accept" in node  # dns = node
    assert ("ip daddr 10.213.0.1 meta l4proto { tcp, udp } th dport 8000 ct mark and 0xffff0000 == 0 "
            "ct mark set ct mark and 0x0000ffff or 0x00010000 counter name e0123456789_conn accept") in node
    assert node[-1] == "counter name e0123456789_deny goto rst"


def test_open_connections_are_judged_again_after_a_policy_change() -> None:
    """Only a connection stamped with the current generation takes the fast accept, in either
    direction; one of an older generation goes through the policy again (a reply too)."""
    policy = parse_policy(["198.18.0.1:8000", "node:8000"])
    for gen in (1, 7, 65534):
        g = f"0x{gen << 16:08x}"
        script = render_policy_change("t", WIRING, policy, Resolved(), RANGE, generation=gen)
        fast = f"ct state established,related ct mark and 0xffff0000 == {g}"
        assert _rules(script, "o_e0123456789")[2] == f"{fast} counter name e0123456789_out accept"
        assert _rules(script, "i_e0123456789")[2] == f"{fast} accept"
        # the env's replies on connections the node opened to it (the node is not confined)
        assert _rules(script, "i_e0123456789")[3] == "ct state established,related ct direction reply accept"
        assert _rules(script, "b_e0123456789") == [f"{fast} counter name e0123456789_in accept",
                                                   "ct state established,related goto p_e0123456789",
                                                   "counter name e0123456789_deny drop"]
        # nothing established is accepted without its generation
        for chain in ("o", "i", "b", "p", "a"):
            for rule in _rules(script, f"{chain}_e0123456789"):
                assert not ("established" in rule and rule.endswith("accept") and g not in rule
                            and "ct direction reply" not in rule), rule
    with pytest.raises(ValueError, match="generation 0"):
        render_policy_change("t", WIRING, policy, Resolved(), RANGE, generation=0)
    with pytest.raises(ValueError, match="generation 65535"):  # all the bits: the mark of a cut connection
        render_policy_change("t", WIRING, policy, Resolved(), RANGE, generation=0xFFFF)
    assert [next_generation(g) for g in (1, 2, 65533, 65534)] == [2, 3, 65534, 1]


def test_allowed_counts_connections_not_packets_judged_again() -> None:
    script = render_policy_change("t", WIRING, parse_policy(["198.18.0.1"]), Resolved(), RANGE, generation=3)
    stamp = "ct mark set ct mark and 0x0000ffff or 0x00030000"
    assert _rules(script, "a_e0123456789") == [
        f"ct mark and 0xffff0000 == 0 {stamp} counter name e0123456789_conn accept",  # first seen: a connection
        f"{stamp} ct direction reply counter name e0123456789_in accept",  # judged again: its bytes
        "counter name e0123456789_out accept"]
    # other users' bits of the conntrack mark are kept: every write masks with 0x0000ffff
    assert all("ct mark set ct mark and 0x0000ffff or " in line
               for line in script.splitlines() if "ct mark set" in line)


def test_a_refused_packet_cuts_its_connection_both_ways() -> None:
    base = _rules(render_base("t", RANGE, ["eth9"]), "rst")
    assert base == [  # the peer's first refused packet reaches the env as a reset and marks it cut
        "ct direction reply meta l4proto tcp ct mark and 0xffff0000 != 0xffff0000 ct mark set ct mark or 0xffff0000 "
        "tcp flags set rst | ack accept",
        "meta l4proto tcp reject with tcp reset",  # an env's (or the peer's next) packet: its sender is reset
        "reject"]
    script = render_env("t", WIRING, parse_policy(["198.18.0.1"], ["198.18.0.0/16:22"]), Resolved(), RANGE)
    refusals = [r for c in ("o", "i", "p") for r in _rules(script, f"{c}_e0123456789") if "_deny" in r]
    # every refusal of a possibly open connection goes through rst; only spoofed sources, IPv6 and
    # invalid packets (never part of an allowed connection) are refused on the spot
    assert all(r.endswith("goto rst") or r.startswith(("ip saddr != ", "meta nfproto ipv6 ", "ct state invalid "))
               for r in refusals), refusals


def test_no_dns_rule_and_no_node_access_by_default() -> None:
    node = _rules(render_env("t", WIRING, parse_policy(["198.18.0.1"]), Resolved(), RANGE), "i_e0123456789")
    assert not any("dport 53" in r or "accept" in r and "established" not in r for r in node)


def test_policy_change_rewrites_only_the_env_chains() -> None:
    script = render_policy_change("t", WIRING, parse_policy(["198.18.0.1"]), Resolved(), RANGE)
    lines = script.splitlines()
    # all five refilled at once; no "add chain" (one that exists costs ~8 ms: the start is one too)
    assert lines[:5] == [f"flush chain inet t {c}_e0123456789" for c in ("o", "i", "b", "p", "a")]
    made = render_env("t", WIRING, parse_policy(["198.18.0.1"]), Resolved(), RANGE).splitlines()
    assert len([x for x in made if x.startswith("add chain ")]) == len({x for x in made if x.startswith("add chain ")}) == 5
    assert "counter" in script and "add counter" not in script and "element" not in script


def test_base_keeps_to_its_own_table() -> None:
    script = render_base("weenv", RANGE, ["eth9"], ["eth9"])
    assert all(" inet weenv " in f" {line} " or line.startswith("add table inet weenv") for line in script.splitlines())
    assert "flush ruleset" not in script
    assert 'add element inet weenv egress { "eth9" }' in script
    assert "ip saddr 10.213.0.0/16 oifname @egress masquerade" in script
    assert "add rule inet weenv forward iifname @fwd_guard ct state new,invalid,untracked drop" in script
    assert 'add element inet weenv fwd_guard { "eth9" }' in script
    assert "element inet weenv egress" not in render_base("weenv", RANGE, [])  # none named: no way out


_LISTING = {"nftables": [
    {"metainfo": {"json_schema_version": 1}},
    {"table": {"family": "inet", "name": "t"}},
    {"map": {"family": "inet", "name": "env_out", "table": "t", "type": "ifname", "map": "verdict",
             "elem": [["wv0123456789", {"jump": {"target": "o_e0123456789"}}], ["wvdead", {"jump": {"target": "o_edead"}}]]}},
    {"set": {"family": "inet", "name": "envs", "table": "t", "type": "ifname", "elem": ["wv0123456789"]}},
    {"chain": {"family": "inet", "table": "t", "name": "o_e0123456789"}},
    {"chain": {"family": "inet", "table": "t", "name": "i_e0123456789"}},
    {"chain": {"family": "inet", "table": "t", "name": "forward"}},
    {"counter": {"family": "inet", "name": "e0123456789_in", "table": "t", "packets": 7, "bytes": 9000}},
    {"counter": {"family": "inet", "name": "e0123456789_deny", "table": "t", "packets": 2, "bytes": 120}},
]}


def test_parse_table_and_delete_only_what_exists() -> None:
    st = parse_table(json.dumps(_LISTING))
    assert st.keys() == {"e0123456789"}
    assert env_counters(st, "e0123456789") == {"bytes_out": 0, "bytes_in": 9000, "connections_allowed": 0,
                                              "packets_denied": 2, "bytes_denied": 120}
    script = render_env_delete("t", "e0123456789", "wv0123456789", st)
    lines = script.splitlines()
    assert lines[:2] == ['delete element inet t env_out { "wv0123456789" }', 'delete element inet t envs { "wv0123456789" }']
    assert "delete chain inet t o_e0123456789" in lines and "delete chain inet t b_e0123456789" not in lines
    assert "delete counter inet t e0123456789_in" in lines and "delete counter inet t e0123456789_out" not in lines
    assert stale_elements(st, {"wv0123456789"}) == ["wvdead"]
    # the usual kill: everything render_env made, deleted in one transaction without a listing
    everything = render_env_delete("t", "e0123456789", "wv0123456789", full_state("e0123456789", "wv0123456789"))
    made = render_env("t", WIRING, parse_policy(["198.18.0.1"]), Resolved(), RANGE)
    for kind in ("chain", "counter"):
        created = {line.split()[-1] for line in made.splitlines() if line.startswith(f"add {kind} ")}
        deleted = {line.split()[-1] for line in everything.splitlines() if line.startswith(f"delete {kind} ")}
        assert created == deleted, kind
    assert everything.count("delete element") == 4
    assert parse_table("").chains == set()


# -- resolver -----------------------------------------------------------------------------------------

def test_resolver_answers_allowed_names_only() -> None:
    names = {"svc.example": (ipaddress.IPv4Address("198.18.0.1"),)}
    q = dns.message.make_query("SVC.example.", "A")
    r = dns.message.from_wire(answer(q.to_wire(), names))  # type: ignore[arg-type]
    assert r.rcode() == dns.rcode.NOERROR and [a.address for a in r.answer[0]] == ["198.18.0.1"]
    r = dns.message.from_wire(answer(dns.message.make_query("svc.example", "AAAA").to_wire(), names))  # type: ignore[arg-type]
    assert r.rcode() == dns.rcode.NOERROR and not r.answer
    r = dns.message.from_wire(answer(dns.message.make_query("evil.example", "A").to_wire(), names))  # type: ignore[arg-type]
    assert r.rcode() == dns.rcode.NXDOMAIN and not r.answer
    assert answer(b"\x00garbage", names) is None


# -- the plan's [network] -----------------------------------------------------------------------------

_BASE = 'name = "x"\n[[groups]]\nname = "os"\nref = "a:b"\nclass = "os"\n'


def _short(value: str) -> str:
    return f'name = "x"\nnetwork = "{value}"\n' + _BASE.split("\n", 1)[1]


def test_plan_network_table_and_short_forms() -> None:
    p = load_plan(_BASE + '[network]\nmode = "egress"\nallow = ["node:8000", "10.0.0.0/8:443"]\nbandwidth = "100Mbit"\n')
    net = network_policy(p)
    assert net.mode == "egress" and net.allow == ["node:8000", "10.0.0.0/8:443"] and net.bandwidth == "100Mbit"
    assert load_plan(dump_plan(p)) == p
    for short in ("none", "loopback", "egress", "host"):
        q = load_plan(_short(short))
        assert q.network == short and network_policy(q).mode == short
    assert network_policy(load_plan(_BASE)).mode == "none"


@pytest.mark.parametrize("text,message", [
    ('[network]\nmode = "egress"\nallow = ["10.0.0.1/8:443"]\n',
     "network.allow[0]: '10.0.0.1/8:443': 10.0.0.1/8 has host bits set (write 10.0.0.0/8)"),
    ('[network]\nmode = "egress"\ndeny = ["ok.example", "node:0"]\n', "network.deny[1]: 'node:0': port 0 is outside 1-65535"),
    ('[network]\nmode = "egress"\nallow = [8000]\n', "network.allow[0]: expected a string, got an integer (8000)"),
    ('[network]\nmode = "loopback"\nallow = ["node:1"]\n', 'network.allow: only for mode = "egress"'),
    ('[network]\nmode = "egress"\nbandwidth = "fast"\n', "network.bandwidth: expected a rate such as '100Mbit'"),
    ('[network]\nmode = "egress"\ndns = "google"\n', "network.dns: expected one of"),
    ('[network]\nmod = "egress"\n', "network.mod: unknown field"),
])
def test_plan_network_errors_are_located(text: str, message: str) -> None:
    with pytest.raises(PlanValidationError) as info:
        load_plan(_BASE + text, source="plan.toml")
    assert f"plan.toml: {message}" in str(info.value)


def test_short_form_error_lists_the_modes_in_order() -> None:
    with pytest.raises(PlanValidationError) as info:
        load_plan(_short("wifi"), source="plan.toml")
    assert str(info.value) == "plan.toml: network: expected one of none, loopback, egress, host, got 'wifi'"


def test_json_schema_has_the_network_table() -> None:
    schema = plan_json_schema()
    net = schema["$defs"]["NetworkPolicy"]
    assert set(net["properties"]) == {"mode", "allow", "deny", "bandwidth", "dns"}
    assert net["additionalProperties"] is False


def test_pure_modules_import_no_io() -> None:
    code = ("import sys; import weenv.net._policy, weenv.net._nft, weenv.plan; "
            "bad = [m for m in ('socket', 'subprocess', 'trio', 'weenv.net._host', 'weenv.net._egress') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_top_shows_egress_accounting() -> None:
    from rich.console import Console

    from weenv.cli._top import render

    env = {"cpu": {"quota_cores": 1.0}, "memory": {"limit_bytes": 1 << 30},
           "metrics": {"cpu_refusals": 0, "memory_refusals": 0, "oom_kills": 0, "cpu_up": 0, "memory_up": 0,
                       "cpu_down": 0, "memory_down": 0}}
    top = {"envs": {"a-1": env, "b-2": env},
           "network": {"a-1": {"bytes_out": 2048, "bytes_in": 3 << 20, "connections_allowed": 4, "packets_denied": 7,
                               "bytes_denied": 420}}}
    console = Console(width=300, record=True)
    console.print(render(top, now_wall_s=0.0))
    text = console.export_text()
    row_a = next(line for line in text.splitlines() if line.strip().startswith("a-1"))
    row_b = next(line for line in text.splitlines() if line.strip().startswith("b-2"))
    assert "NET OUT/IN" in text and "7 pkts" in row_a and "3.0MiB" in row_a.replace(" ", "")
    assert row_b.rstrip().endswith("-")
