"""Burst reservations: the first doubling of a memory burst must fit the env's way to its max,
which stays reserved until the burst ends. Without it, envs growing at once on a short node stall
at half-grown limits and wait on each other forever (shown here on the fake backend)."""

from __future__ import annotations

import msgspec
import trio
from trio.testing import MockClock

from weenv.provision.elastic._monitor import Monitor
from weenv.provision.elastic._policy import DEFAULT_POLICY, EnvLimits, EnvQuotaState, NodeView, PolicyConfig, decide
from weenv.provision.cgroups import CgroupSample
from weenv.testing import FakeBackend

MIB = 1 << 20
GIB = 1 << 30
LIMITS = EnvLimits(memory_min_bytes=64 * MIB, memory_max_bytes=1 * GIB)
# Without reservations, and without the bounded wait (which would OOM-kill both after memory_wait_s,
# tests/test_memory_bounds.py), to show the deadlock reservations prevent.
OLD_RULE = PolicyConfig(memory_burst_reservation=False, memory_wait_s=float("inf"))


def sample(usage: int, **kw) -> CgroupSample:
    base = dict(
        timestamp_s=1.0, cpu_usage_ns=0, nr_periods=0, nr_throttled=0, throttled_ns=0, cpu_quota_cores=None,
        memory_usage_bytes=usage, memory_limit_bytes=None, memory_hard_limit_bytes=None, memory_limit_hits=0,
        memory_high_events=0, memory_stalled=False, oom_events=0, oom_kills=0, pids_current=1, pids_max=None,
    )  # fmt: skip
    base.update(kw)
    return CgroupSample(**base)


def node(headroom: int, reserved: int = 0) -> NodeView:
    # headroom = available - promised - reserved - 512 MiB (the default reserve)
    return NodeView(cpu_cores=4, memory_total_bytes=16 * GIB, memory_available_bytes=headroom + reserved + 512 * MIB,
                    memory_reserved_bytes=reserved)


def test_a_burst_starts_only_if_its_way_to_max_fits():
    at_limit = sample(60 * MIB, memory_stalled=True)
    s = EnvQuotaState(cpu_quota_cores=None, memory_limit_bytes=64 * MIB)
    # The next doubling alone (+64 MiB) fits, the way to 1 GiB (+960 MiB) does not: refused.
    d = decide(s, at_limit, None, LIMITS, node(500 * MIB), DEFAULT_POLICY, 1.0)
    assert (d.memory_change, d.memory_refused, d.state.memory_bursting) == (None, True, False)
    assert "960 MiB needed (the way to max 1024 MiB)" in d.reasons[0]
    # The old rule would have granted it.
    d_old = decide(s, at_limit, None, LIMITS, node(500 * MIB), OLD_RULE, 1.0)
    assert (d_old.memory_limit_bytes, d_old.state.memory_bursting) == (128 * MIB, False)
    # With room for the whole way, it starts: doubled, and bursting from now on.
    d = decide(d.state, at_limit, None, LIMITS, node(960 * MIB), DEFAULT_POLICY, 1.2)
    assert (d.memory_limit_bytes, d.memory_refused, d.state.memory_bursting) == (128 * MIB, False, True)


def test_a_bursting_env_grows_on_what_it_reserved_and_gives_it_back_when_it_halves():
    s = EnvQuotaState(cpu_quota_cores=None, memory_limit_bytes=256 * MIB, memory_bursting=True)
    # No headroom left at all (its own reservation is in `reserved`): still granted.
    d = decide(s, sample(250 * MIB, memory_stalled=True), None, LIMITS, node(0, reserved=768 * MIB),
               DEFAULT_POLICY, 1.0)
    assert (d.memory_limit_bytes, d.state.memory_bursting) == (512 * MIB, True)
    # Freed: after the hold, the first halving ends the burst.
    cfg = PolicyConfig(hold_s=1.0)
    low = sample(10 * MIB)
    d = decide(d.state, low, None, LIMITS, node(0), cfg, 2.0)
    assert d.memory_change is None and d.state.memory_bursting  # the hold starts
    d = decide(d.state, low, None, LIMITS, node(0), cfg, 3.0)
    assert (d.memory_limit_bytes, d.memory_change, d.state.memory_bursting) == (256 * MIB, "down", False)


def run_two_envs(cfg: PolicyConfig) -> tuple[Monitor, FakeBackend, list[tuple[float, int, int]]]:
    """Two envs that each need 700 MiB at once (max 1 GiB) on a 4 GiB node with 2.25 GiB used
    elsewhere: room for one whole burst, not for two."""
    clock = MockClock(autojump_threshold=0)
    backend = FakeBackend(clock=clock.current_time, memory_total_bytes=4 * GIB)
    backend.other_used_bytes = 2304 * MIB
    monitor = Monitor(backend.node_memory, interval_ms=200, cfg=cfg, offload="none")
    history: list[tuple[float, int, int]] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            a, b = backend.create("a"), backend.create("b")
            monitor.add("a", a, LIMITS)
            monitor.add("b", b, LIMITS)
            a.memory_demand_bytes = b.memory_demand_bytes = 700 * MIB
            a_freed = False
            for _ in range(300):  # 30 s
                await trio.sleep(0.1)
                history.append((trio.current_time(), a.limit_bytes, b.limit_bytes))
                if not a_freed and a.memory_usage_bytes >= 700 * MIB and not a.stalled:
                    await trio.sleep(1)  # a's work is done: it frees its memory
                    a.memory_demand_bytes = 0
                    a_freed = True
                if b.memory_usage_bytes >= 700 * MIB and not b.stalled:
                    break
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    return monitor, backend, history


def test_with_reservations_one_burst_finishes_then_the_other_runs():
    monitor, backend, history = run_two_envs(DEFAULT_POLICY)
    a, b = backend._groups["a"], backend._groups["b"]
    assert b.memory_usage_bytes == 700 * MIB and not b.stalled, history[-1]
    assert a.oom_kills == b.oom_kills == 0
    # While a burst, b waited at its min (one refusal episode), not at a half-grown limit.
    a_done = next(t for t, la, _ in history if la == 1 * GIB)
    assert all(lb == 64 * MIB for t, _, lb in history if t <= a_done)
    assert monitor.metrics("b").memory_refusals == 1 and monitor.metrics("a").memory_refusals == 0
    assert monitor.snapshot()["envs"]["b"]["memory"]["bursting"] is True


def test_without_reservations_the_same_node_deadlocks():
    monitor, backend, history = run_two_envs(OLD_RULE)
    a, b = backend._groups["a"], backend._groups["b"]
    # Both stalled at 512 MiB, each waiting for memory the other holds.
    assert a.stalled and b.stalled and a.limit_bytes == b.limit_bytes == 512 * MIB
    assert history[-1][0] > 25


def test_the_longest_waiting_env_gets_freed_memory_first():
    clock = MockClock(autojump_threshold=0)
    backend = FakeBackend(clock=clock.current_time, memory_total_bytes=4 * GIB)
    backend.other_used_bytes = 2304 * MIB
    monitor = Monitor(backend.node_memory, interval_ms=200, offload="none")
    order: list[str] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            groups = {name: backend.create(name) for name in ("a", "b", "c")}
            for name, g in groups.items():
                monitor.add(name, g, LIMITS)
            groups["a"].memory_demand_bytes = 700 * MIB
            await trio.sleep(0.5)
            groups["c"].memory_demand_bytes = 700 * MIB  # c starts waiting before b
            await trio.sleep(0.5)
            groups["b"].memory_demand_bytes = 700 * MIB
            for _ in range(400):
                await trio.sleep(0.1)
                for name, g in groups.items():
                    if name not in order and g.memory_usage_bytes >= 700 * MIB and not g.stalled:
                        order.append(name)
                        await trio.sleep(0.5)
                        g.memory_demand_bytes = 0  # done: free it
                if len(order) == 3:
                    break
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    assert order == ["a", "c", "b"]
    assert all(monitor.metrics(n).oom_kills == 0 for n in "abc")
    assert msgspec.to_builtins(monitor.statistics())["envs"] == 3
