"""E2B network options through ``weenv serve`` onto weenv's egress policy, against a real egress
daemon and the test's own "outside" namespace (tests/fixtures_network.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from weenv.api import KeyStore, TemplateStore

from .fixtures_api import Served, start_serve, stop_serve
from .fixtures_network import OUT_A, OUT_B, PORT, EgressDaemon, Outside, egress_daemon, outside

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]
__all__ = ["outside"]


@pytest.fixture(scope="module")
def egress_served(outside: Outside) -> Iterator[Served]:
    with egress_daemon(outside) as d:
        api_dir = os.path.join(d.home, "api")
        keys = {"alice": KeyStore(api_dir).create("alice"), "root": KeyStore(api_dir).create("root", admin=True)}
        TemplateStore(api_dir).set("bb", d.plan_lock)
        served = start_serve(d, keys)
        try:
            yield served
        finally:
            stop_serve(served)
            with d.client() as c:
                for e in c.list():
                    c.get(e["id"]).kill()
    assert not d.left, f"the egress tests left: {d.left}"


def _reaches(sbx, addr: str) -> bool:  # type: ignore[no-untyped-def]
    # busybox's own wget -T crashes in this build: bound it with timeout instead
    try:
        sbx.commands.run(f"busybox timeout 3 busybox wget -q -O - http://{addr}:{PORT}/id", timeout=20)
    except e2b.CommandExitException:
        return False
    return True


def test_network_options_and_update(egress_served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in egress_served.e2b_env().items():
        monkeypatch.setenv(k, v)
    only_a = e2b.Sandbox.create("bb", timeout=120, network={"deny_out": [e2b.ALL_TRAFFIC], "allow_out": [OUT_A]})
    closed = e2b.Sandbox.create("bb", timeout=120, allow_internet_access=False)
    try:
        assert _reaches(only_a, OUT_A) and not _reaches(only_a, OUT_B)
        assert not _reaches(closed, OUT_A)
        only_a.update_network({"deny_out": [e2b.ALL_TRAFFIC], "allow_out": [OUT_B]})
        assert _reaches(only_a, OUT_B) and not _reaches(only_a, OUT_A)
        only_a.update_network({"deny_out": [f"{OUT_B}/32"]})  # everything else open again
        assert _reaches(only_a, OUT_A) and not _reaches(only_a, OUT_B)
        with pytest.raises(e2b.SandboxException, match="no egress network"):
            closed.update_network({"allow_out": [OUT_A]})
    finally:
        only_a.kill()
        closed.kill()


def test_internet_access_comes_with_a_resolver(egress_served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29 item 14: a sandbox with internet access resolves names (the node's resolver, here the
    outside's), as on E2B; a tenant's answers in a reserved range (the metadata address) are dropped."""
    for k, v in egress_served.e2b_env().items():
        monkeypatch.setenv(k, v)
    sbx = e2b.Sandbox.create("bb", timeout=120, allow_internet_access=True)
    try:
        assert "nameserver" in sbx.commands.run("cat /etc/resolv.conf").stdout
        assert OUT_A in sbx.commands.run("busybox nslookup svc.test", timeout=30).stdout
        out = sbx.commands.run(f"busybox timeout 3 busybox wget -q -O - http://other.test:{PORT}/id", timeout=20)
        assert out.stdout.strip() == f"{OUT_B}:{PORT}"
        looked = sbx.commands.run("busybox nslookup meta.test || true", timeout=30)
        assert "169.254" not in looked.stdout + looked.stderr
    finally:
        sbx.kill()
