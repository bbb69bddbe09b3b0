"""Tenant envs (a create with ``restricted: true``, what ``weenv serve`` sends for non-admin keys):
their egress policy can never open the node, loopback, link-local, the egress range or the node's
addresses, and DNS answers in them are dropped (docs/network.md, "Tenant envs").

First the policy logic alone (no I/O); then a real daemon with real namespaces and nftables, whose
allowed names are resolved by a DNS server of the test (on 127.0.0.1), and a host of the test at
a link-local address (:data:`RESERVED`, inside the outside namespace, reached by a /32 route to the
test's own veth): every target, allowed or denied, is an address of this machine.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import msgspec
import pytest

from weenv.net import parse_entry, parse_policy
from weenv.net._nft import EnvWiring, render_env_rules
from weenv.net._policy import Reserved, Resolved, change_policy, policy_from_builtins, restricted_problems
from weenv.plan import plan_to_builtins
from weenv.plan._model import NetworkPolicy

from .fixtures_daemon import wait_for
from .fixtures_network import OUT_A, OUT_B, OUT_HOST, PORT, EgressDaemon, Outside, outside, weenv_links
from .test_network import _DnsServer, _get, _info, _lock, _reachable, _run_then_check_clean

__all__ = ["outside"]  # the fixture, imported for pytest

RANGE = ipaddress.IPv4Network("10.213.0.0/16")
NODE = ipaddress.IPv4Address("192.0.2.2")
RESERVED_FOR_TESTS = Reserved(RANGE, frozenset({NODE, ipaddress.IPv4Address("127.0.0.1")}))


# -- the policy logic (pure) ---------------------------------------------------------------------

@pytest.mark.parametrize("text,words", [
    ("node:8000", "'node:8000': the node's own ports are not open to tenant envs"),
    ("node", "'node': the node's own ports are not open to tenant envs"),
    ("169.254.0.0/16", "'169.254.0.0/16': link-local (169.254.0.0/16, where cloud metadata services live) is not open"),
    ("169.254.169.254:80", "'169.254.169.254:80': link-local"),
    ("127.0.0.1:8000", "'127.0.0.1:8000': loopback (127.0.0.0/8) is not open to tenant envs"),
    ("0.0.0.0/8", '"this network" (0.0.0.0/8)'),
    ("224.0.0.251:5353", "multicast"),
    ("240.0.0.0/4", "the reserved range 240.0.0.0/4"),
    ("10.213.4.0/24", "'10.213.4.0/24': the egress range 10.213.0.0/16 (other envs) is not open to tenant envs"),
    ("10.213.0.6:9000", "the egress range 10.213.0.0/16"),
    ("192.0.2.2:22", "'192.0.2.2:22': 192.0.2.2, an address of this node, is not open to tenant envs"),
])
def test_a_tenant_allow_entry_that_opens_a_reserved_range_is_refused_by_its_place(text: str, words: str) -> None:
    entries = [parse_entry("198.18.0.1:8000"), parse_entry(text)]
    problems = restricted_problems(entries, RESERVED_FOR_TESTS)
    assert [p.location for p in problems] == ["allow[1]"]
    assert str(problems[0]).startswith("allow[1]: ") and words in str(problems[0]), str(problems[0])


@pytest.mark.parametrize("text", [
    "0.0.0.0/0",  # E2B's "all traffic": never the implicit denies, the node's addresses are its input
    "10.0.0.0/8:443",  # holds the egress range without being inside it
    "169.0.0.0/8",
    "192.0.2.0/24",  # the node's subnet (its address is not forwarded traffic)
    "192.0.2.3:80",
    "198.18.0.1:8000",
    "pypi.mirror.internal:443",  # names are checked when resolved
])
def test_a_tenant_may_allow_what_lies_outside_every_reserved_range(text: str) -> None:
    assert restricted_problems([parse_entry(text)], RESERVED_FOR_TESTS) == []


def test_deny_entries_are_never_refused() -> None:
    policy = parse_policy(["198.18.0.1:8000"], ["node:8000", "169.254.0.0/16", "127.0.0.1"], restricted=True)
    assert restricted_problems(policy.allow, RESERVED_FOR_TESTS) == []


def test_reserved_answers_of_a_name_are_split_off() -> None:
    addrs = tuple(ipaddress.IPv4Address(a) for a in (
        "198.18.0.1", "169.254.169.254", "127.0.0.53", "10.213.0.2", "192.0.2.2", "0.0.0.1", "239.1.1.1", "8.8.8.8"))
    kept, dropped = RESERVED_FOR_TESTS.split(addrs)
    assert [str(a) for a in kept] == ["198.18.0.1", "8.8.8.8"]
    assert [str(a) for a in dropped] == ["169.254.169.254", "127.0.0.53", "10.213.0.2", "192.0.2.2", "0.0.0.1",
                                         "239.1.1.1"]
    assert RESERVED_FOR_TESTS.split(addrs[1:2]) == ((), addrs[1:2])  # all dropped: the name resolves to nothing


def test_the_restriction_is_kept_through_saved_state_and_policy_changes() -> None:
    policy = parse_policy(["198.18.0.1:8000"], restricted=True)
    saved = policy.to_builtins()
    assert saved["restricted"] is True
    assert policy_from_builtins(saved).restricted
    changed = change_policy(policy_from_builtins(saved), allow=["svc.test:80"], remove=["198.18.0.1:8000"])
    assert changed.restricted and changed.to_builtins()["restricted"] is True
    # an env that is not a tenant's saves what it saved before
    assert "restricted" not in parse_policy(["198.18.0.1:8000"]).to_builtins()
    assert not change_policy(parse_policy([]), allow=["node:80"]).restricted


def test_a_restricted_policy_renders_no_accept_for_the_node_or_inside_an_implicit_deny() -> None:
    """Belt and braces: should an entry or answer in a reserved range get past the checks, the rules
    of a tenant's env still do not open it."""
    w = EnvWiring(key="e0123456789", veth="wv0123456789", address=ipaddress.IPv4Address("10.213.0.2"),
                  gateway=ipaddress.IPv4Address("10.213.0.1"))
    allow = ["node:8000", "169.254.169.254:80", "svc.test:80", "198.18.0.1:8000"]
    resolved = Resolved({"svc.test": (ipaddress.IPv4Address("169.254.1.1"),)})

    def accepts(restricted: bool) -> list[str]:
        rules = render_env_rules("weenv", w, parse_policy(allow, restricted=restricted), resolved, RANGE)
        return [r for r in rules if ("goto a_" in r or r.endswith("accept")) and
                ("169.254" in r or "dport 8000" in r and "10.213.0.1" in r)]

    assert len(accepts(False)) == 6  # today's: node:8000 (new and re-judged), 169.254.x.y on tcp and udp
    assert accepts(True) == []
    tenant = render_env_rules("weenv", w, parse_policy(allow, restricted=True), resolved, RANGE)
    assert any("198.18.0.1" in r and "goto a_" in r for r in tenant)  # what is outside them stays allowed


# -- a real daemon, real envs --------------------------------------------------------------------

_PID = os.getpid()
RESERVED = f"169.254.{100 + _PID % 100}.{1 + _PID // 100 % 250}"  # a host of the test, at a link-local address


@pytest.fixture(scope="module")
def reserved_host(outside: Outside) -> Iterator[str]:
    """An HTTP server at :data:`RESERVED`:PORT in the outside namespace (serving ``/id``), reached from
    the node by a /32 route through the test's own veth; all of it removed afterwards."""
    d = tempfile.mkdtemp(prefix="wtest-www-")
    with open(os.path.join(d, "id"), "w") as f:
        f.write(f"{RESERVED}:{PORT}\n")
    proc = None
    try:
        subprocess.run(["ip", "-n", outside.netns, "addr", "add", f"{RESERVED}/32", "dev", "eth0"], check=True)
        subprocess.run(["ip", "route", "add", f"{RESERVED}/32", "dev", outside.iface], check=True)
        proc = subprocess.Popen(["ip", "netns", "exec", outside.netns, sys.executable, "-m", "http.server", str(PORT),
                                 "--bind", RESERVED, "--directory", d],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        code = f"import socket; socket.create_connection(({RESERVED!r}, {PORT}), 1).close()"
        assert wait_for(lambda: subprocess.run(["ip", "netns", "exec", outside.netns, sys.executable, "-c", code],
                                               capture_output=True).returncode == 0, timeout_s=10)
        yield RESERVED
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(5)
        subprocess.run(["ip", "route", "del", f"{RESERVED}/32", "dev", outside.iface], capture_output=True)
        subprocess.run(["ip", "-n", outside.netns, "addr", "del", f"{RESERVED}/32", "dev", "eth0"],
                       capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


class _TenantDaemon(EgressDaemon):
    """An egress daemon whose allowed names are resolved by the test's own DNS server."""


@contextmanager
def _tenant_daemon(world: Outside, dns_server: str) -> Iterator[_TenantDaemon]:
    from weenv.testing import busybox_plan, require_fuse, require_tool, teardown_private_daemon

    require_fuse()
    require_tool("crun")
    home = tempfile.mkdtemp(prefix="weenv-tenant-")
    plan, lock = busybox_plan(home, "bb")
    d = _TenantDaemon(home, os.path.join(home, "run", "weenv.sock"), f"weenv-tenant-{_PID}", lock, plan,
                      os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    d.world, d.left, d.dns_server = world, [], dns_server
    d.start()
    try:
        yield d
    finally:
        d.left = teardown_private_daemon(d) + weenv_links(world.table)


@pytest.fixture(scope="module")
def resolver() -> Iterator[_DnsServer]:
    r = _DnsServer({"rebind.test": OUT_A})
    yield r
    r.close()


@pytest.fixture(scope="module")
def tenant_daemon(outside: Outside, resolver: _DnsServer, reserved_host: str) -> Iterator[_TenantDaemon]:
    with _tenant_daemon(outside, resolver.address) as d:
        yield d
    assert not d.left, f"the tenant tests left: {d.left}"


@pytest.fixture
def daemon(tenant_daemon: _TenantDaemon, resolver: _DnsServer) -> Iterator[_TenantDaemon]:
    resolver.names["rebind.test"] = OUT_A
    yield tenant_daemon
    with tenant_daemon.client() as c:
        for e in c.list():
            c.get(e["id"]).kill()


def _post_create(d: _TenantDaemon, body: dict) -> httpx.Response:
    """``POST /v1/envs`` as ``weenv serve`` sends it for a tenant (the Python client has no ``restricted``)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=d.socket), base_url="http://weenv", timeout=120) as h:
        return h.post("/v1/envs", json=body)


def _create_tenant(d: _TenantDaemon, client, lock):  # type: ignore[no-untyped-def]
    """A tenant's env of ``lock``, as an Env of ``client``."""
    r = _post_create(d, {"plan": plan_to_builtins(lock), "restricted": True})
    assert r.status_code == 201, r.text
    return client.get(r.json()["id"])


def _refused(d: _TenantDaemon, body: dict) -> str:
    r = _post_create(d, {**body, "restricted": True})
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


def test_a_tenant_env_is_never_pinned_to_a_name_rebound_into_a_reserved_range(daemon: _TenantDaemon,
                                                                               resolver: _DnsServer) -> None:
    """The same policy, an operator's env and a tenant's: both reach the name's host; the name's answer
    moves to a host of the test at a link-local address. The operator's env reaches it (as before),
    the tenant's does not, by name nor by address; a tenant env started meanwhile neither. After a
    SIGKILL and restart of the daemon the restriction holds for policy changes and re-resolutions."""
    lock = _lock(daemon, allow=[f"rebind.test:{PORT}"])
    with daemon.client() as c:
        admin = c.create(lock)
        tenant = _create_tenant(daemon, c, lock)
        for env in (admin, tenant):
            code, out = _get(env, f"http://rebind.test:{PORT}/id")
            assert code == 0 and out.strip() == f"{OUT_A}:{PORT}", out
        assert _info(daemon, tenant.id).restricted is True and _info(daemon, admin.id).restricted is False

        resolver.names["rebind.test"] = RESERVED  # rebound into link-local
        for env in (admin, tenant):  # a policy change re-resolves every name, as the refresh does
            env.set_network(allow=[f"{OUT_B}:{PORT}"])
        assert _info(daemon, admin.id)["resolved"] == {"rebind.test": [RESERVED]}
        code, out = _get(admin, f"http://rebind.test:{PORT}/id")
        assert code == 0 and out.strip() == f"{RESERVED}:{PORT}", out  # the test's host is there, and reachable

        info = _info(daemon, tenant.id)
        assert info["resolved"] == {"rebind.test": []}
        assert info["dns_dropped"] == {"rebind.test": [RESERVED]}
        assert info["counters"]["dns_answers_dropped"] == 1
        r = tenant.exec(["busybox", "nslookup", "rebind.test"], timeout_s=10)
        assert RESERVED not in r.stdout.decode(), r  # its resolver does not answer it either
        before = info["counters"]["packets_denied"]
        assert not _reachable(tenant, f"http://rebind.test:{PORT}/id")
        assert not _reachable(tenant, f"http://{RESERVED}:{PORT}/id")
        assert _info(daemon, tenant.id)["counters"]["packets_denied"] > before
        assert _reachable(tenant, f"http://{OUT_B}:{PORT}/id")  # what it allows outside them still works

        late = _create_tenant(daemon, c, lock)  # resolved at its start: dropped there too
        assert _info(daemon, late.id)["resolved"] == {"rebind.test": []}
        assert not _reachable(late, f"http://{RESERVED}:{PORT}/id")

    daemon.kill9()
    daemon.start()
    with daemon.client() as c:
        tenant, admin = c.get(tenant.id), c.get(admin.id)
        with pytest.raises(Exception, match=r"allow\[0\]: 'node:8000': the node's own ports are not open"):
            tenant.set_network(allow=["node:8000"])
        with pytest.raises(Exception, match=r"allow\[1\]: '169\.254\.0\.0/16': link-local"):
            tenant.set_network(allow=[f"{OUT_A}:{PORT}", "169.254.0.0/16"])
        assert "node:8000" not in _info(daemon, tenant.id)["allow"]
        tenant.set_network(allow=[f"{OUT_A}:{PORT}"])  # a re-resolution after the restart still drops
        info = _info(daemon, tenant.id)
        assert info["resolved"] == {"rebind.test": []} and info["counters"]["dns_answers_dropped"] == 2
        assert not _reachable(tenant, f"http://{RESERVED}:{PORT}/id")
        assert "node:8000" in admin.set_network(allow=["node:8000"])["allow"]  # the operator's env: as before
        assert _reachable(admin, f"http://rebind.test:{PORT}/id")


@pytest.mark.parametrize("allow,where,words", [
    ([f"{OUT_A}:{PORT}", "node:8000"], "network.allow[1]", "the node's own ports are not open to tenant envs"),
    (["169.254.0.0/16"], "network.allow[0]", "'169.254.0.0/16': link-local (169.254.0.0/16"),
    (["127.0.0.1:80"], "network.allow[0]", "'127.0.0.1:80': loopback (127.0.0.0/8)"),
    ([f"{OUT_HOST}:{PORT}"], "network.allow[0]", f"'{OUT_HOST}:{PORT}': {OUT_HOST}, an address of this node,"),
    (["EGRESS"], "network.allow[0]", "the egress range"),
])
def test_a_tenant_create_that_opens_the_node_or_a_reserved_range_is_refused_naming_the_entry(
        daemon: _TenantDaemon, allow: list[str], where: str, words: str) -> None:
    allow = [a if a != "EGRESS" else str(ipaddress.IPv4Network(daemon.world.egress_range).network_address)
             for a in allow]
    lock = _lock(daemon, allow=allow)
    message = _refused(daemon, {"plan": plan_to_builtins(lock)})
    assert f"plan 'bb': {where}: '{allow[-1]}': " in message and words in message, message
    with daemon.client() as c:
        assert c.list() == []
        c.create(lock).kill()  # the operator's env: as before
    assert weenv_links(daemon.world.table) == []


def test_a_tenant_cannot_have_the_nodes_network(daemon: _TenantDaemon) -> None:
    lock = _lock(daemon)
    host = msgspec.structs.replace(lock, network=NetworkPolicy(mode="host"))
    assert "network.mode: 'host' (the node's own network) is not open to tenant envs" in \
        _refused(daemon, {"plan": plan_to_builtins(host)})
    # nor through an override, nor from a snapshot
    overridden = {"plan": plan_to_builtins(lock), "overrides": {"network": "host"}}
    assert "network.mode: 'host'" in _refused(daemon, overridden)
    with daemon.client() as c:
        env = c.create(lock)
        snap = env.commit()
        assert "network.mode: 'host'" in _refused(daemon, {"snapshot": snap, "overrides": {"network": "host"}})
        env.kill()
        assert [e["id"] for e in c.list()] == []


def test_forks_and_snapshot_envs_of_a_tenant_are_restricted(daemon: _TenantDaemon) -> None:
    lock = _lock(daemon, allow=[f"{OUT_A}:{PORT}"])
    with daemon.client() as c:
        parent = _create_tenant(daemon, c, lock)
        (child,) = parent.fork(1, keep=True)
        assert _info(daemon, child.id)["restricted"] is True
        with pytest.raises(Exception, match=r"allow\[0\]: 'node:8000': the node's own ports are not open"):
            child.set_network(allow=["node:8000"])
        assert _reachable(child, f"http://{OUT_A}:{PORT}/id")
        # a tenant's env from an operator's snapshot
        admin = c.create(lock)
        r = _post_create(daemon, {"snapshot": admin.commit(), "restricted": True})
        assert r.status_code == 201, r.text
        from_snap = c.get(r.json()["id"])
        with pytest.raises(Exception, match=r"allow\[0\]: '169\.254\.169\.254:80': link-local"):
            from_snap.set_network(allow=["169.254.169.254:80"])
        (admin_child,) = admin.fork(1, keep=True)  # an operator's fork: as before
        assert "node:8000" in admin_child.set_network(allow=["node:8000"])["allow"]
        for e in (child, parent, from_snap, admin_child, admin):
            e.kill()


def test_the_name_refresh_drops_a_tenant_envs_answers_rebound_into_a_reserved_range(outside: Outside,
                                                                                   reserved_host: str) -> None:
    """The refresh loop (every 0.3 s here): the name of two envs moves to the test's link-local host;
    the operator's env is re-pinned to it, the tenant's to nothing."""
    import trio

    from weenv.net._egress import EgressNetwork

    table, rng = f"wt{_PID % 100000}t", f"10.196.{_PID % 256}.0/28"
    resolver = _DnsServer({"moving.test": OUT_B})
    net = EgressNetwork(table=table, egress_range=rng, egress_interfaces=[outside.iface], dns_server=resolver.address,
                        refresh_s=0.3)
    dirs = {"admin-00000000": tempfile.mkdtemp(prefix="wtest-admin-"),
            "tenant-00000000": tempfile.mkdtemp(prefix="wtest-tenant-")}

    def connect(ns: str, addr: str) -> bool:
        code = f"import socket; socket.create_connection(({addr!r}, {PORT}), 3).close()"
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", code]
        return subprocess.run(cmd, capture_output=True).returncode == 0

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            net.start(nursery, dirs.__getitem__)
            admin = await net.up("admin-00000000", dirs["admin-00000000"], parse_policy([f"moving.test:{PORT}"]))
            tenant = await net.up("tenant-00000000", dirs["tenant-00000000"],
                                  parse_policy([f"moving.test:{PORT}"], restricted=True))
            try:
                for env_id in dirs:
                    await net.ready(env_id)
                for st in (admin, tenant):
                    assert st.resolved == {"moving.test": [OUT_B]}
                    assert await trio.to_thread.run_sync(connect, st.netns, OUT_B)
                resolver.names["moving.test"] = reserved_host
                with trio.fail_after(10):
                    while (net.states["admin-00000000"].resolved != {"moving.test": [reserved_host]}
                           or net.states["tenant-00000000"].resolved != {"moving.test": []}):
                        await trio.sleep(0.1)
                assert await trio.to_thread.run_sync(connect, admin.netns, reserved_host)
                assert not await trio.to_thread.run_sync(connect, tenant.netns, reserved_host)
                assert not await trio.to_thread.run_sync(connect, tenant.netns, OUT_B)  # no longer its answer
                assert net.states["tenant-00000000"].dns_dropped == {"moving.test": [reserved_host]}
                with trio.fail_after(10):  # each refresh that drops it again counts it again
                    while net.states["tenant-00000000"].dns_answers_dropped < 3:
                        await trio.sleep(0.1)
                saved = net.load(dirs["tenant-00000000"])
                assert saved is not None and saved.policy["restricted"] is True and saved.dns_answers_dropped >= 1
            finally:
                for env_id, d in dirs.items():
                    assert await net.down(env_id, d) == []
                nursery.cancel_scope.cancel()

    _run_then_check_clean(scenario, table, rng, resolver)
