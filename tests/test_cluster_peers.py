"""Peer tables out of node reports (issue 20): who each node's envlet asks for which layers (no Ray)."""

from __future__ import annotations

from weenv.cluster import Capacity, Cluster, LayerHeld, NodeReport, NodeState
from weenv.cluster._reconcile import NodeEntry
from weenv.cluster._report import peer_tables

A, B, C = ("sha256:" + c * 64 for c in "abc")
CAP = Capacity(cpu_cores=2, memory_total_bytes=1, memory_guaranteed_bytes=1, memory_headroom_bytes=1)


def rep(node: str, addr: str, *digests: str, healthy: bool = True, accepting: bool = True, seq: int = 1) -> NodeReport:
    return NodeReport(node=node, seq=seq, healthy=healthy, accepting=accepting, peer_address=addr, capacity=CAP,
                      layers=[LayerHeld(digest=d, size_bytes=10, where="envlet") for d in digests])


def test_each_node_gets_the_other_nodes_addresses_and_layers_never_its_own():
    reports = [rep("n1", "10.0.0.1:7070", A, B), rep("n2", "10.0.0.2:7070", B), rep("n3", "10.0.0.3:7070")]
    t = peer_tables(reports)
    assert t == {"n1": {"10.0.0.2:7070": [B], "10.0.0.3:7070": []},
                 "n2": {"10.0.0.1:7070": [A, B], "10.0.0.3:7070": []},
                 "n3": {"10.0.0.1:7070": [A, B], "10.0.0.2:7070": [B]}}


def test_unhealthy_unusable_and_addressless_nodes_are_in_nobodys_table():
    reports = [rep("n1", "10.0.0.1:7070", A), rep("n2", "10.0.0.2:7070", A, healthy=False),
               rep("n3", "10.0.0.3:7070", B), rep("n4", "", C), rep("n5", "10.0.0.5:7070", C)]
    t = peer_tables(reports, usable={"n1", "n2", "n4", "n5"})  # n3 lost or drained
    assert t["n1"] == {"10.0.0.5:7070": [C]}
    assert t["n5"] == {"10.0.0.1:7070": [A]}
    assert "n4" not in t  # no peer tier: no table to send
    assert t["n3"] == {"10.0.0.1:7070": [A], "10.0.0.5:7070": [C]}  # it may still read from the others


class FakeActor:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls
        outer = self

        class Method:
            def __init__(self, what: str):
                self.what = what

            def remote(self, token, arg):
                outer.calls.append((outer.name, self.what, token, arg))

        self.set_peers, self.set_peer_serving = Method("set_peers"), Method("set_peer_serving")


class FakeClient:
    def __init__(self, name: str, calls: list):
        self.name, self._token, self.actor = name, "tok", FakeActor(name, calls)


def cluster_with(reports: list[NodeReport], calls: list) -> Cluster:
    c = Cluster(token="tok")
    for r in reports:
        c.clients[r.node] = FakeClient(r.node, calls)  # type: ignore[assignment]
        c.reconciler.nodes[r.node] = NodeEntry(name=r.node, handle=None, since_s=0.0,  # type: ignore[arg-type]
                                               state=NodeState.HEALTHY, report=r)
    return c


def test_the_cluster_sends_each_table_once_until_it_changes_and_a_lost_node_stops_serving():
    calls: list = []
    c = cluster_with([rep("n1", "10.0.0.1:7070", A), rep("n2", "10.0.0.2:7070")], calls)
    c._push_peers()
    assert sorted(calls) == [("n1", "set_peers", "tok", {"10.0.0.2:7070": []}),
                             ("n2", "set_peers", "tok", {"10.0.0.1:7070": [A]})]
    calls.clear()
    c._push_peers()
    assert calls == []  # unchanged: not sent again (until peer_resend_s)
    c.reconciler.nodes["n2"].report = rep("n2", "10.0.0.2:7070", B, seq=2)
    c._push_peers()
    assert calls == [("n1", "set_peers", "tok", {"10.0.0.2:7070": [B]})]
    calls.clear()
    c.reconciler.mark_lost("n2", "test")
    assert calls == [("n2", "set_peer_serving", "tok", False)]
    calls.clear()
    c._push_peers()
    assert calls == [("n1", "set_peers", "tok", {})]  # n1 no longer asks n2


def test_the_daemon_refuses_a_peer_listen_it_cannot_use(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import weenv.provision
    from weenv.cli import main

    served = []
    monkeypatch.setattr(weenv.provision, "serve", lambda config, debug=False: served.append(config))
    r = CliRunner().invoke(main, ["daemon", "--envlet-peer-listen", "127.0.0.1:7070"])
    assert r.exit_code == 2 and "needs --cluster-token-file" in r.output
    token = tmp_path / "token"
    r = CliRunner().invoke(main, ["daemon", "--envlet-peer-listen", "nowhere", "--cluster-token-file", str(token)])
    assert r.exit_code == 2 and "'nowhere': give HOST:PORT" in r.output
    r = CliRunner().invoke(main, ["daemon", "--envlet-peer-listen", "127.0.0.1:0", "--cluster-token-file", str(token)])
    assert r.exit_code == 2 and "no such file" in r.output
    token.write_text("t")
    r = CliRunner().invoke(main, ["daemon", "--envlet-peer-listen", "127.0.0.1:0", "--cluster-token-file", str(token)])
    assert r.exit_code == 0, r.output
    assert served[0].envlet_tiers == ["memory", "disk", "peer", "registry"]
    assert served[0].envlet_tier_options == {"peer.listen": "127.0.0.1:0", "peer.token_file": str(token)}


def test_the_envlet_process_passes_tiers_and_tier_options():
    from weenv.envlet import EnvletProcess

    p = EnvletProcess("/m", "/c", "/s", tiers=["memory", "disk", "peer", "registry"],
                      tier_options={"peer.listen": "127.0.0.1:0", "peer.token_file": "/t"})
    assert p.args[p.args.index("--tiers") + 1] == "memory,disk,peer,registry"
    i = p.args.index("--tier-option")
    assert p.args[i:i + 4] == ["--tier-option", "peer.listen=127.0.0.1:0", "--tier-option", "peer.token_file=/t"]
