"""The reconciler's states with fake agents and a fake clock (no Ray), and the agent's token check."""

from __future__ import annotations

import pytest

from weenv.cluster import (
    AgentHandle,
    Capacity,
    ClusterAuthError,
    EnvHeld,
    EnvLostError,
    NodeReport,
    NodeState,
    PendingCall,
    Reconciler,
    node_of,
)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeCall(PendingCall):
    def __init__(self, agent):
        self.agent = agent

    def done(self):
        return self.agent.mode != "hang"

    def result(self):
        if self.agent.mode == "raise":
            raise ConnectionError("actor died")
        if self.agent.mode != "stuck":
            self.agent.seq += 1
        return NodeReport(node=self.agent.name, seq=self.agent.seq, envs=[EnvHeld(id=f"{self.agent.name}-bb-1", status="running")],
                          capacity=Capacity(cpu_cores=2, memory_total_bytes=1, memory_guaranteed_bytes=1,
                                            memory_headroom_bytes=1))


class FakeAgent(AgentHandle):
    def __init__(self, name):
        self.name, self.mode, self.seq, self.calls = name, "ok", 0, 0

    def start_report(self):
        self.calls += 1
        if self.mode == "gone":
            raise RuntimeError("no such actor")
        return FakeCall(self)


def make(**kw):
    clock = Clock()
    lost = []
    r = Reconciler(clock=clock, interval_s=1.0, call_timeout_s=3.0, failure_threshold=3, start_timeout_s=10.0,
                   on_lost=lost.append, **kw)
    return r, clock, lost


def run(r, clock, seconds, step=0.5):
    for _ in range(int(seconds / step)):
        clock.t += step
        r.tick()


def test_a_reporting_node_becomes_healthy_and_is_polled_once_per_interval():
    r, clock, _ = make()
    a = FakeAgent("a")
    r.add(a)
    r.tick()
    assert r.nodes["a"].state is NodeState.STARTING and a.calls == 1
    run(r, clock, 5.0)
    assert r.nodes["a"].state is NodeState.HEALTHY
    assert 5 <= a.calls <= 6
    assert [x.node for x in r.reports()] == ["a"]


def test_failures_below_the_threshold_make_it_unhealthy_then_healthy_again():
    r, clock, lost = make()
    a = FakeAgent("a")
    r.add(a)
    run(r, clock, 2.0)
    a.mode = "raise"
    run(r, clock, 2.0)  # two failed polls
    assert r.nodes["a"].state is NodeState.UNHEALTHY and r.reports() == []  # placement skips it
    a.mode = "ok"
    run(r, clock, 1.0)
    assert r.nodes["a"].state is NodeState.HEALTHY and not lost


@pytest.mark.parametrize("mode, why", [("raise", "actor died"), ("gone", "no such actor"),
                                       ("hang", "no answer within 3 s"), ("stuck", "did not change")])
def test_a_node_that_stops_reporting_is_lost_once(mode, why):
    r, clock, lost = make()
    a, b = FakeAgent("a"), FakeAgent("b")
    r.add(a)
    r.add(b)
    run(r, clock, 2.0)
    a.mode = mode
    run(r, clock, 20.0)
    assert r.nodes["a"].state is NodeState.LOST and why in r.nodes["a"].lost_reason
    assert [e.name for e in lost] == ["a"]  # told once
    assert r.nodes["b"].state is NodeState.HEALTHY  # the rest unaffected
    calls = a.calls
    run(r, clock, 5.0)
    assert a.calls == calls  # a lost node is not polled again
    r.add(FakeAgent("a"))  # nor brought back under the same name
    assert r.nodes["a"].state is NodeState.LOST


def test_a_node_that_never_reports_is_lost_after_the_start_timeout():
    r, clock, lost = make()
    a = FakeAgent("a")
    a.mode = "raise"
    r.add(a)
    run(r, clock, 9.0)
    assert r.nodes["a"].state is NodeState.STARTING  # start failures count only against the start timeout
    run(r, clock, 2.0)
    assert r.nodes["a"].state is NodeState.LOST and "no report within 10 s" in r.nodes["a"].lost_reason
    assert "actor died" in r.nodes["a"].lost_reason


def test_tick_never_waits_for_a_hanging_call():
    r, clock, _ = make()
    a = FakeAgent("a")
    a.mode = "hang"
    r.add(a)
    import time

    t0 = time.perf_counter()
    run(r, clock, 5.0)
    assert time.perf_counter() - t0 < 0.5


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="failure_threshold"):
        Reconciler(failure_threshold=0)


def test_lost_env_error_names_env_node_and_reason():
    e = EnvLostError("na1b2c3d4-bb-1", "na1b2c3d4", "3 report calls failed in a row")
    assert "na1b2c3d4-bb-1" in str(e) and "node na1b2c3d4 was lost" in str(e) and "not re-run" in str(e)


def test_node_of_reads_the_node_from_an_id():
    assert node_of("na1b2c3d4-bb-1a2b3c4d") == "na1b2c3d4"
    assert node_of("bb") is None and node_of("-x") is None and node_of("Node-x") is None


def test_the_agent_refuses_calls_without_the_cluster_token(tmp_path, monkeypatch):
    from weenv.cluster import NodeAgent
    from weenv.cluster._agent import token_digest

    monkeypatch.setenv("WEENV_HOME", str(tmp_path))
    monkeypatch.delenv("WEENV_CLUSTER_TOKEN", raising=False)
    agent = NodeAgent(token_sha256=token_digest("s3cret"), ray_node_id="ab" * 28, start_daemon=False,
                      report_interval_s=60)
    try:
        assert agent.report("s3cret").healthy is False  # no daemon here: reported, not hidden
        assert "weenv.sock" in agent.report("s3cret").problem
        with pytest.raises(ClusterAuthError):
            agent.report("wrong")
        with pytest.raises(ClusterAuthError):
            agent.request(None, "GET", "/v1/envs")
        assert agent.hello()["node"] == "nabababab"
    finally:
        agent._stop.set()


def test_the_nodes_own_token_wins_over_the_creators(tmp_path, monkeypatch):
    from weenv.cluster import NodeAgent
    from weenv.cluster._agent import token_digest

    monkeypatch.setenv("WEENV_HOME", str(tmp_path))
    (tmp_path / "cluster.token").write_text("node-token\n")
    agent = NodeAgent(token_sha256=token_digest("creator"), ray_node_id="cd" * 28, start_daemon=False,
                      report_interval_s=60)
    try:
        agent.report("node-token")
        with pytest.raises(ClusterAuthError):
            agent.report("creator")
    finally:
        agent._stop.set()


def test_capacity_counts_only_the_envs_the_daemon_still_lists():
    from weenv.cluster import capacity_from_top

    top = {"node": {"cpu_cores": 2.0, "memory_total_bytes": 4 << 30, "memory_available_bytes": 3 << 30,
                    "memory_headroom_bytes": 2 << 30},
           "policy": {"node_memory_reserve_bytes": 512 << 20, "cpu_min_overcommit": 1.0},
           "envs": {e: {"cpu": {"min_cores": 0.5, "used_cores": 0.1}, "memory": {"min_bytes": 64 << 20}}
                    for e in ("a", "killed")}}
    assert capacity_from_top(top).cpu_committed_cores == 1.0
    cap = capacity_from_top(top, live={"a"})
    assert cap.cpu_committed_cores == 0.5 and cap.memory_committed_bytes == 64 << 20
    assert cap.memory_guaranteed_bytes == (4 << 30) - (512 << 20)


def test_a_late_answer_never_replaces_a_newer_report():
    r, clock, _ = make()
    a = FakeAgent("a")
    r.add(a)
    run(r, clock, 2.0)
    entry = r.nodes["a"]
    newer = NodeReport(node="a", seq=entry.report.seq + 10, capacity=entry.report.capacity)
    entry.report = newer  # what the cluster fetched right after a create
    run(r, clock, 1.0)  # the poll answers with an older sequence number
    assert entry.report is newer and entry.state is NodeState.HEALTHY


class DownAgent(FakeAgent):
    """An agent whose reports, once ``down`` is set, are the last report of a node taken down."""

    down = ""

    def start_report(self):
        call = super().start_report()
        if not self.down:
            return call
        down = self.down

        class Last(FakeCall):
            def result(self):
                import msgspec

                return msgspec.structs.replace(FakeCall.result(self), down=down, healthy=False, accepting=False)

        return Last(self)


@pytest.mark.parametrize("healthy_first", [True, False])
def test_a_node_taken_down_is_lost_at_its_next_report_whatever_its_state(healthy_first):
    # `weenv cluster stop-node`: the agent stays and answers, so nothing fails; its report says it is down
    r, clock, lost = make()
    a, b = DownAgent("a"), FakeAgent("b")
    r.add(a)
    r.add(b)
    if healthy_first:
        run(r, clock, 2.0)
        assert r.nodes["a"].state is NodeState.HEALTHY
    a.down = "weenv cluster stop-node: daemon stopped, envs killed"
    run(r, clock, 1.5)  # one poll answered: far below failure_threshold polls or the start timeout
    assert r.nodes["a"].state is NodeState.LOST, r.nodes["a"]
    assert r.nodes["a"].lost_reason == "taken down: weenv cluster stop-node: daemon stopped, envs killed"
    assert [e.name for e in lost] == ["a"] and [x.id for x in lost[0].report.envs] == ["a-bb-1"]
    assert r.nodes["b"].state is NodeState.HEALTHY and [x.node for x in r.reports()] == ["b"]


def test_a_stopped_agent_reports_itself_down_and_refuses_calls(tmp_path, monkeypatch):
    from weenv.cluster import ClusterError, NodeAgent
    from weenv.cluster._agent import token_digest

    monkeypatch.setenv("WEENV_HOME", str(tmp_path))
    monkeypatch.delenv("WEENV_CLUSTER_TOKEN", raising=False)
    agent = NodeAgent(token_sha256=token_digest("s3cret"), ray_node_id="ef" * 28, start_daemon=False,
                      report_interval_s=60)
    try:
        seq = agent.report("s3cret").seq
        with pytest.raises(ClusterAuthError):
            agent.stop("wrong")
        answer = agent.stop("s3cret", reason="weenv cluster stop-node")
        assert answer["down"] and not answer["daemon_stopped"] and answer["home"] == str(tmp_path)
        last = agent.report("s3cret")
        assert last.seq > seq and last.down and not last.accepting and not last.healthy
        assert "daemon and envs left running" in last.down and last.problem.startswith("taken down")
        assert agent.refresh("s3cret") == last  # a fresh report never writes over it
        agent._refresh()
        assert agent.report("s3cret") == last
        with pytest.raises(ClusterError, match="was taken down .*restart Ray"):
            agent.request("s3cret", "GET", "/v1/envs")
        assert agent.hello()["down"] == last.down
        again = agent.stop("s3cret", stop_daemon=True, kill_envs=True, timeout_s=5)  # no daemon, no envs here
        assert again["daemon_stopped"] and not again["daemon_was_running"] and again["envlet_pid"] is None
        assert "daemon stopped, envs killed" in agent.report("s3cret").down
    finally:
        agent._stop.set()
