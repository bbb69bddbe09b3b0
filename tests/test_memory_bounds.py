"""An env never waits unkillably for memory (issue 16 item 4).

A memory max the node can never cover is refused at admission; an env whose doubling is refused
waits at most ``memory_wait_s`` before its limit becomes hard and the kernel OOM-kills inside it.
The policy is tested on made-up samples, the monitor on the fake backend under a fake clock and on
the cgroup v2 mimic tree (the v1 path runs on this host's kernel in test_containment.py, the
admission message through the real daemon below).
"""

from __future__ import annotations

import os

import pytest
import trio
from trio.testing import MockClock

from tests.fixtures_cgroups import MIB, MimicCgroup2Fs
from weenv.provision.elastic._monitor import Monitor
from weenv.provision.elastic._policy import EnvLimits, EnvQuotaState, NodeView, PolicyConfig, admit, decide
from weenv.provision.cgroups import V2Backend
from weenv.provision.cgroups._base import CgroupSample
from weenv.testing import FakeBackend

GIB = 1 << 30
LIMITS = EnvLimits(memory_min_bytes=64 * MIB, memory_max_bytes=4 * GIB)
CFG = PolicyConfig(memory_wait_s=10.0)
FULL_NODE = NodeView(cpu_cores=2, memory_total_bytes=24 * GIB, memory_available_bytes=600 * MIB)  # headroom ~88 MiB


def _sample(t: float, *, usage: int, stalled: bool) -> CgroupSample:
    return CgroupSample(
        timestamp_s=t, cpu_usage_ns=0, nr_periods=0, nr_throttled=0, throttled_ns=0, cpu_quota_cores=None,
        memory_usage_bytes=usage, memory_limit_bytes=64 * MIB, memory_hard_limit_bytes=4 * GIB,
        memory_limit_hits=0, memory_high_events=0, memory_stalled=stalled, oom_events=0, oom_kills=0,
        pids_current=1, pids_max=None,
    )


# -- admission ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [32 * GIB, 10**20])
def test_a_max_the_node_can_never_cover_is_refused_naming_the_field(max_bytes):
    node = NodeView(cpu_cores=2, memory_total_bytes=24 * GIB, memory_available_bytes=23 * GIB)
    verdict = admit(EnvLimits(memory_min_bytes=64 * MIB, memory_max_bytes=max_bytes), node, [])
    assert not verdict
    assert "memory max" in verdict.reason and "resources.memory.max" in verdict.reason, verdict.reason
    assert "23.5 GiB (RAM 24.0 GiB minus the 512 MiB node reserve)" in verdict.reason, verdict.reason
    # the most it can give is admitted
    assert admit(EnvLimits(memory_min_bytes=64 * MIB, memory_max_bytes=23 * GIB + 512 * MIB), node, [])


# -- the policy ----------------------------------------------------------------------------------


def test_a_refused_wait_ends_with_a_hard_limit_after_memory_wait_s():
    state = EnvQuotaState(cpu_quota_cores=None, memory_limit_bytes=64 * MIB)
    prev = _sample(0.0, usage=64 * MIB, stalled=True)
    changes = []
    for tick in range(1, 60):  # 200 ms ticks: 12 s
        now = tick * 0.2
        s = _sample(now, usage=64 * MIB, stalled=True)
        d = decide(state, s, prev, LIMITS, FULL_NODE, CFG, now)
        state, prev = d.state, s
        assert d.memory_refused and d.memory_limit_bytes == 64 * MIB
        if d.memory_change is not None:
            changes.append((round(now, 1), d.memory_change))
    assert changes == [(10.2, "hard")]  # refused first at 0.2 s, hard 10 s later, once
    assert state.memory_hard
    # The kill freed the memory: nothing waits any more, the limit throttles again.
    now += 0.2
    d = decide(state, _sample(now, usage=30 * MIB, stalled=False), prev, LIMITS, FULL_NODE, CFG, now)
    assert d.memory_change == "elastic" and not d.state.memory_hard and d.state.memory_refused_since_s is None


def test_a_granted_doubling_ends_the_wait_without_a_kill():
    state = EnvQuotaState(cpu_quota_cores=None, memory_limit_bytes=64 * MIB)
    prev = _sample(0.0, usage=64 * MIB, stalled=True)
    d = decide(state, _sample(5.0, usage=64 * MIB, stalled=True), prev, LIMITS, FULL_NODE, CFG, 5.0)
    assert d.memory_refused and d.state.memory_refused_since_s == 5.0
    roomy = NodeView(cpu_cores=2, memory_total_bytes=24 * GIB, memory_available_bytes=20 * GIB)
    d = decide(d.state, _sample(9.0, usage=64 * MIB, stalled=True), prev, LIMITS, roomy, CFG, 9.0)
    assert d.memory_change == "up" and d.state.memory_refused_since_s is None and not d.state.memory_hard


# -- the monitor -------------------------------------------------------------------------------


def test_monitor_on_a_full_node_oom_kills_inside_the_env_within_the_wait():
    clock = MockClock(autojump_threshold=0)
    # Other work holds all but 256 MiB of the node: the env's way to its 4 GiB max never fits.
    backend = FakeBackend(clock=clock.current_time, memory_total_bytes=24 * GIB)
    backend.other_used_bytes = 24 * GIB - 256 * MIB
    monitor = Monitor(backend.node_memory, interval_ms=200, cfg=CFG, cpu_cores=2, offload="none")

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            g = backend.create("bomb")
            monitor.add("bomb", g, LIMITS)
            g.set_demand(memory_bytes=1 * GIB)  # an allocation bomb, bounded at 1 GiB
            started = trio.current_time()
            while g.oom_kills == 0:
                assert trio.current_time() - started < 30, "the env still waits at its limit after 30 s"
                await trio.sleep(0.2)
            waited = trio.current_time() - started
            assert 10 <= waited <= 11, waited
            assert ("memory", (64 * MIB, 64 * MIB)) in g.history  # made hard where it waited
            assert monitor.metrics("bomb").memory_hardened == 1
            await trio.sleep(1)
            assert g.history[-1] == ("memory", (64 * MIB, 4 * GIB))  # elastic again once nothing waits
            assert monitor.snapshot()["envs"]["bomb"]["memory"]["hard"] is False
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


def test_monitor_on_cgroup_v2_makes_memory_max_the_limit_after_the_wait(tmp_path):
    # v2: the env is throttled above memory.high (a near-stall, not a kill); after the wait
    # memory.max comes down to the limit and memory.high is lifted: the kernel kills there.
    fs = MimicCgroup2Fs(str(tmp_path / "cgroup2"))
    backend = V2Backend(fs.root, root_name="weenv", fs=fs)
    clock = MockClock(autojump_threshold=0)
    node = [(24 * GIB, 300 * MIB)]
    monitor = Monitor(lambda: node[0], interval_ms=200, cfg=CFG, cpu_cores=2, offload="none")
    g = backend.create("bomb")
    d = f"{fs.root}/weenv/bomb"
    try:

        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(monitor.run)
                monitor.add("bomb", g, LIMITS)
                assert (fs.get(d, "memory.high").strip(), fs.get(d, "memory.max").strip()) == (
                    str(64 * MIB), str(4 * GIB))
                for i in range(1, 100):  # usage at the limit, throttled, more every tick
                    fs.put(d, "memory.current", f"{64 * MIB}\n")
                    fs.put(d, "memory.events", f"low 0\nhigh {i}\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
                    fs.put(d, "cpu.stat", f"usage_usec {i * 1000}\nuser_usec 0\nsystem_usec 0\n"
                                          "nr_periods 0\nnr_throttled 0\nthrottled_usec 0\n")
                    await trio.sleep(0.2)
                    if fs.get(d, "memory.max").strip() == str(64 * MIB):
                        break
                assert 10 <= i * 0.2 <= 11, i
                assert fs.get(d, "memory.high").strip() == "max"
                nursery.cancel_scope.cancel()

        trio.run(main, clock=clock)
    finally:
        monitor.remove("bomb")
        g.remove()
        backend.remove_parent()


# -- through the daemon --------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("memory", ["64MiB-32GiB", "64MiB-1TiB"])  # (10**20 is refused by the plan: <= 1 TiB)
def test_the_daemon_refuses_a_max_above_the_node_with_a_clear_message(daemon, memory):
    import weenv

    with daemon.client() as c:
        with pytest.raises(weenv.ApiError) as ei:
            c.create(daemon.plan_lock, memory=memory)
        message = str(ei.value)
        assert "more than this node can ever give one env" in message and "resources.memory.max" in message, message
        assert c.list() == []


def _v1_memory_dir(cgroup_root: str, env_id: str) -> str | None:
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup/memory"):
        if os.path.basename(dirpath) == cgroup_root and env_id in dirnames:
            return os.path.join(dirpath, env_id)
    return None


def test_unit_let_go_makes_elastic_limits_hard():
    backend = FakeBackend()
    monitor = Monitor(backend.node_memory, cfg=CFG, cpu_cores=2, offload="none")
    g, fixed = backend.create("elastic"), backend.create("fixed")
    monitor.add("elastic", g, LIMITS)
    monitor.add("fixed", fixed, EnvLimits(memory_min_bytes=64 * MIB, memory_max_bytes=64 * MIB))
    assert monitor.let_go() == 1 and monitor.let_go() == 0
    assert g.history[-1] == ("memory", (64 * MIB, 64 * MIB))
    assert fixed.history == [("memory", (64 * MIB, 64 * MIB))]  # already hard: untouched


@pytest.mark.integration
def test_envs_kept_by_a_stopping_daemon_are_killed_at_their_limit_not_left_waiting(daemon):
    # While no daemon runs nobody raises limits: v1's disabled OOM killer would let an allocation
    # sleep at the limit until a daemon came back. A stopping daemon makes the limits hard; the
    # next one re-adopts the envs elastic.
    from weenv.provision.cgroups import detect_backend

    if detect_backend(daemon.cgroup_root).version != "v1":
        pytest.skip("the oom_control check is v1's (this host)")
    with daemon.client() as c:
        env = c.create(daemon.plan_lock)
    mem = _v1_memory_dir(daemon.cgroup_root, env.id)
    assert mem is not None
    oom = lambda: open(f"{mem}/memory.oom_control").read()  # noqa: E731
    assert "oom_kill_disable 1" in oom()
    daemon.stop()  # SIGTERM: envs keep running
    try:
        assert "oom_kill_disable 0" in oom()
    finally:
        daemon.start()
    with daemon.client() as c:
        assert c.get(env.id).exec(["true"]).exit_code == 0
        assert "oom_kill_disable 1" in oom()  # re-adopted elastic
        c.get(env.id).kill()
