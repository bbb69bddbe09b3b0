"""The elastic policy, rule by rule, on made-up samples and a fake clock (no I/O, no time)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weenv.provision.elastic._policy import DEFAULT_POLICY, EnvLimits, EnvQuotaState, NodeView, PolicyConfig
from weenv.provision.elastic._policy import admit, adopt_state, decide, initial_state
from weenv.provision.cgroups import CgroupSample
from weenv.testing import FakeBackend

MIB = 1 << 20
GIB = 1 << 30
TICK_S = 0.2

LIMITS = EnvLimits(cpu_min_cores=0.25, cpu_max_cores=2.0, memory_min_bytes=64 * MIB, memory_max_bytes=1 * GIB)
NODE = NodeView(cpu_cores=4, memory_total_bytes=16 * GIB, memory_available_bytes=12 * GIB)


def sample(t: float, **kw) -> CgroupSample:
    base = dict(
        timestamp_s=t, cpu_usage_ns=0, nr_periods=0, nr_throttled=0, throttled_ns=0, cpu_quota_cores=None,
        memory_usage_bytes=0, memory_limit_bytes=None, memory_hard_limit_bytes=None, memory_limit_hits=0,
        memory_high_events=0, memory_stalled=False, oom_events=0, oom_kills=0, pids_current=1, pids_max=None,
    )  # fmt: skip
    base.update(kw)
    return CgroupSample(**base)


def state(cpu: float | None = 0.25, mem: int | None = 64 * MIB, **kw) -> EnvQuotaState:
    return EnvQuotaState(cpu_quota_cores=cpu, memory_limit_bytes=mem, **kw)


def cpu_pair(used_cores: float, throttled_share: float, dt_s: float = TICK_S, t0: float = 10.0, mem: int = 0):
    periods = round(dt_s / 0.1) * 10  # plenty of periods so shares are exact
    prev = sample(t0, memory_usage_bytes=mem)
    cur = sample(
        t0 + dt_s,
        cpu_usage_ns=int(used_cores * dt_s * 1e9),
        nr_periods=periods,
        nr_throttled=round(periods * throttled_share),
        memory_usage_bytes=mem,
    )
    return prev, cur


# -- CPU ---------------------------------------------------------------------------------------------


def test_throttled_env_gets_double_cpu():
    prev, cur = cpu_pair(used_cores=0.25, throttled_share=0.9)
    d = decide(state(cpu=0.25), cur, prev, LIMITS, NODE, DEFAULT_POLICY, now_s=cur.timestamp_s)
    assert (d.cpu_quota_cores, d.cpu_change) == (0.5, "up")
    assert d.state.cpu_quota_cores == 0.5 and d.state.cpu_last_change_s == cur.timestamp_s
    assert d.cpu_throttled_share == pytest.approx(0.9)
    assert d.reasons and "throttled in 90%" in d.reasons[0]


def test_throttling_below_the_threshold_changes_nothing():
    prev, cur = cpu_pair(used_cores=0.2, throttled_share=0.2)
    d = decide(state(cpu=0.25), cur, prev, LIMITS, NODE, DEFAULT_POLICY, now_s=cur.timestamp_s)
    assert (d.cpu_quota_cores, d.cpu_change, d.cpu_refused) == (0.25, None, False)


def test_cpu_doubling_stops_at_max():
    prev, cur = cpu_pair(used_cores=1.5, throttled_share=1.0)
    d = decide(state(cpu=1.5), cur, prev, LIMITS, NODE, DEFAULT_POLICY, now_s=1)
    assert d.cpu_quota_cores == 2.0
    d = decide(state(cpu=2.0), cur, prev, LIMITS, NODE, DEFAULT_POLICY, now_s=1)
    assert (d.cpu_quota_cores, d.cpu_change, d.cpu_refused) == (2.0, None, False)


def test_cpu_doubling_is_cut_to_the_node_burst_budget():
    node = msgspec.structs.replace(NODE, cpu_cores=2, cpu_burst_committed_cores=1.8)
    prev, cur = cpu_pair(used_cores=0.5, throttled_share=1.0)
    d = decide(state(cpu=0.5), cur, prev, LIMITS, node, DEFAULT_POLICY, now_s=1)
    assert d.cpu_quota_cores == pytest.approx(0.7) and d.cpu_change == "up"


def test_cpu_doubling_is_refused_when_the_budget_is_spent():
    node = msgspec.structs.replace(NODE, cpu_cores=2, cpu_burst_committed_cores=2.0)
    prev, cur = cpu_pair(used_cores=0.5, throttled_share=1.0)
    d = decide(state(cpu=0.5), cur, prev, LIMITS, node, DEFAULT_POLICY, now_s=1)
    assert (d.cpu_quota_cores, d.cpu_change, d.cpu_refused, d.state.cpu_refused) == (0.5, None, True, True)
    assert "budget" in d.reasons[0]
    # The refusal is explained once per episode, not every tick.
    d2 = decide(d.state, cur, prev, LIMITS, node, DEFAULT_POLICY, now_s=1.2)
    assert d2.cpu_refused and d2.reasons == ()


def test_idle_cpu_halves_only_after_the_hold_time():
    cfg = PolicyConfig(hold_s=2.0)
    s = state(cpu=2.0)
    t = 0.0
    changes = []
    while t < 10:
        prev, cur = cpu_pair(used_cores=0.01, throttled_share=0.0, t0=t)
        t = cur.timestamp_s
        d = decide(s, cur, prev, LIMITS, NODE, cfg, now_s=t)
        if d.cpu_change:
            changes.append((round(t, 1), d.cpu_quota_cores))
        s = d.state
    # First low tick at 0.2 s starts the hold; each halving needs a fresh full hold.
    assert changes == [(2.2, 1.0), (4.2, 0.5), (6.2, 0.25)]
    assert s.cpu_quota_cores == 0.25


def test_one_busy_tick_restarts_the_hold():
    cfg = PolicyConfig(hold_s=1.0)
    s = state(cpu=1.0)
    for i, used in enumerate([0.1, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1]):
        prev, cur = cpu_pair(used_cores=used, throttled_share=0.0, t0=i * TICK_S)
        d = decide(s, cur, prev, LIMITS, NODE, cfg, now_s=cur.timestamp_s)
        assert d.cpu_change is None, f"halved at tick {i}"
        s = d.state
    prev, cur = cpu_pair(used_cores=0.1, throttled_share=0.0, t0=9 * TICK_S)
    assert decide(s, cur, prev, LIMITS, NODE, cfg, now_s=cur.timestamp_s).cpu_change == "down"


def test_no_previous_sample_no_cpu_decision():
    d = decide(state(cpu=0.25), sample(1.0, nr_periods=10, nr_throttled=10), None, LIMITS, NODE, DEFAULT_POLICY, 1.0)
    assert d.cpu_change is None and d.cpu_usage_cores is None


# -- memory -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "signal, why",
    [
        (dict(memory_usage_bytes=52 * MIB), ">= 80%"),
        (dict(memory_usage_bytes=10 * MIB, memory_limit_hits=3), "limit hit 3x"),
        (dict(memory_usage_bytes=10 * MIB, memory_high_events=2), "memory.high 2x"),
        (dict(memory_usage_bytes=10 * MIB, memory_stalled=True), "wait at the limit"),
        (dict(memory_usage_bytes=10 * MIB, memory_pressure_some_total_us=20_000), "stalls 10%"),
    ],
)
def test_memory_doubles_on_each_signal(signal, why):
    prev = sample(1.0, memory_usage_bytes=10 * MIB, memory_pressure_some_total_us=0)
    cur = sample(1.2, **{"memory_pressure_some_total_us": 0, **signal})
    d = decide(state(mem=64 * MIB), cur, prev, LIMITS, NODE, DEFAULT_POLICY, now_s=1.2)
    assert (d.memory_limit_bytes, d.memory_change) == (128 * MIB, "up")
    assert why in d.reasons[0]


def test_small_pressure_is_not_a_signal():
    prev = sample(1.0, memory_usage_bytes=10 * MIB, memory_pressure_some_total_us=0)
    cur = sample(1.2, memory_usage_bytes=10 * MIB, memory_pressure_some_total_us=2_000)  # 1 %
    d = decide(state(mem=64 * MIB), cur, prev, LIMITS, NODE, DEFAULT_POLICY, now_s=1.2)
    assert d.memory_change is None


def test_memory_doubling_stops_at_max():
    cur = sample(1.0, memory_usage_bytes=700 * MIB)
    d = decide(state(mem=768 * MIB), cur, None, LIMITS, NODE, DEFAULT_POLICY, now_s=1)
    assert d.memory_limit_bytes == 1 * GIB
    d = decide(state(mem=1 * GIB), sample(1.0, memory_usage_bytes=1000 * MIB), None, LIMITS, NODE, DEFAULT_POLICY, 1)
    assert (d.memory_change, d.memory_refused) == (None, False)


def test_memory_doubling_is_refused_without_node_headroom():
    # 600 MiB free, 300 MiB promised to others, 512 MiB reserve: no room for +256 MiB.
    node = msgspec.structs.replace(NODE, memory_available_bytes=600 * MIB, memory_promised_bytes=300 * MIB)
    cur = sample(1.0, memory_usage_bytes=250 * MIB)
    d = decide(state(mem=256 * MIB), cur, None, LIMITS, node, DEFAULT_POLICY, now_s=1)
    assert (d.memory_limit_bytes, d.memory_change, d.memory_refused) == (256 * MIB, None, True)
    assert "headroom" in d.reasons[0] and d.state.memory_refused
    # Once memory frees up, the same env is granted on the next tick.
    node = msgspec.structs.replace(node, memory_available_bytes=2 * GIB)
    d = decide(d.state, cur, None, LIMITS, node, DEFAULT_POLICY, now_s=1.2)
    assert (d.memory_limit_bytes, d.memory_refused, d.state.memory_refused) == (512 * MIB, False, False)


def test_memory_halves_after_hold_but_keeps_headroom_above_usage():
    cfg = PolicyConfig(hold_s=1.0, memory_headroom_bytes=64 * MIB)
    s = state(mem=1 * GIB)
    limits_seen = []
    t = 0.0
    while t < 10:
        t += TICK_S
        d = decide(s, sample(t, memory_usage_bytes=100 * MIB), None, LIMITS, NODE, cfg, now_s=t)
        if d.memory_change:
            limits_seen.append(d.memory_limit_bytes // MIB)
        s = d.state
    # 1024 -> 512 -> 256 (100 MiB < 25 %) -> floor 100 + 64 = 164 MiB, then stop (164 * 25% < 100).
    assert limits_seen == [512, 256]
    assert s.memory_limit_bytes == 256 * MIB


def test_memory_halving_respects_the_floor_of_usage_plus_headroom():
    cfg = PolicyConfig(hold_s=0.0, memory_headroom_bytes=250 * MIB)
    s = state(mem=1 * GIB, memory_low_since_s=0.0)
    d = decide(s, sample(5.0, memory_usage_bytes=100 * MIB), None, LIMITS, NODE, cfg, now_s=5.0)
    assert d.memory_limit_bytes == 512 * MIB
    d = decide(state(mem=800 * MIB, memory_low_since_s=0.0), sample(5.0, memory_usage_bytes=190 * MIB), None,
               LIMITS, NODE, cfg, now_s=5.0)  # fmt: skip
    assert d.memory_limit_bytes == 440 * MIB  # half would be 400; usage + headroom is 440


def test_memory_drops_straight_to_its_floor_while_other_envs_wait_for_memory():
    cfg = PolicyConfig(hold_s=1.0, memory_headroom_bytes=16 * MIB)
    s = state(mem=1 * GIB, memory_low_since_s=0.0)
    cur = sample(5.0, memory_usage_bytes=40 * MIB)
    # Nobody waits: half per hold, as before.
    assert decide(s, cur, None, LIMITS, NODE, cfg, now_s=5.0).memory_limit_bytes == 512 * MIB
    # Two envs wait for headroom: the finished burst gives back everything above usage + headroom
    # (and never goes under the min), in one step.
    waiting = msgspec.structs.replace(NODE, memory_waiters=2)
    d = decide(s, cur, None, LIMITS, waiting, cfg, now_s=5.0)
    assert (d.memory_change, d.memory_limit_bytes) == ("down", 64 * MIB)
    assert "2 env(s) wait for memory" in d.reasons[0]
    d = decide(s, sample(5.0, memory_usage_bytes=100 * MIB), None, LIMITS, waiting, cfg, now_s=5.0)
    assert d.memory_limit_bytes == 116 * MIB
    # A hold still applies, the shorter contended one: a first low reading changes nothing, one
    # that has lasted memory_contended_hold_s (0.2 s, not hold_s) drops the limit.
    d = decide(state(mem=1 * GIB), cur, None, LIMITS, waiting, cfg, now_s=5.0)
    assert d.memory_change is None and d.state.memory_low_since_s == 5.0
    d = decide(d.state, sample(5.1, memory_usage_bytes=40 * MIB), None, LIMITS, waiting, cfg, now_s=5.1)
    assert d.memory_change is None
    d = decide(d.state, sample(5.2, memory_usage_bytes=40 * MIB), None, LIMITS, waiting, cfg, now_s=5.2)
    assert (d.memory_change, d.memory_limit_bytes) == ("down", 64 * MIB)
    # A contended hold of 0: the first low reading is enough.
    now = PolicyConfig(hold_s=1.0, memory_headroom_bytes=16 * MIB, memory_contended_hold_s=0.0)
    d = decide(state(mem=1 * GIB), cur, None, LIMITS, waiting, now, now_s=5.0)
    assert (d.memory_change, d.memory_limit_bytes) == ("down", 64 * MIB)
    # Without waiters the same 0.2 s does not complete the hold.
    d = decide(state(mem=1 * GIB, memory_low_since_s=5.0), cur, None, LIMITS, NODE, cfg, now_s=5.2)
    assert d.memory_change is None


def test_memory_never_below_min():
    cfg = PolicyConfig(hold_s=0.0, memory_headroom_bytes=0)
    d = decide(state(mem=96 * MIB, memory_low_since_s=0.0), sample(5.0, memory_usage_bytes=0), None, LIMITS, NODE,
               cfg, now_s=5.0)  # fmt: skip
    assert d.memory_limit_bytes == 64 * MIB
    d = decide(d.state, sample(9.0, memory_usage_bytes=0), None, LIMITS, NODE, cfg, now_s=9.0)
    assert d.memory_change is None


def test_static_limits_never_move():
    static = EnvLimits(cpu_min_cores=1.0, cpu_max_cores=1.0, memory_min_bytes=64 * MIB, memory_max_bytes=64 * MIB)
    prev, cur = cpu_pair(used_cores=1.0, throttled_share=1.0, mem=64 * MIB)
    cur = msgspec.structs.replace(cur, memory_limit_hits=5)
    d = decide(initial_state(static), cur, prev, static, NODE, DEFAULT_POLICY, now_s=1)
    assert (d.cpu_change, d.memory_change, d.cpu_refused, d.memory_refused) == (None, None, False, False)


def test_an_env_starts_at_its_min_or_at_a_start_hint_clamped_to_its_range():
    limits = EnvLimits(cpu_min_cores=0.25, cpu_max_cores=2.0, memory_min_bytes=64 * MIB, memory_max_bytes=GIB)
    assert (initial_state(limits).cpu_quota_cores, initial_state(limits).memory_limit_bytes) == (0.25, 64 * MIB)
    assert initial_state(limits, start_cpu_cores=1.0).cpu_quota_cores == 1.0  # a busy source's quota
    assert initial_state(limits, start_cpu_cores=8.0).cpu_quota_cores == 2.0
    assert initial_state(limits, start_cpu_cores=0.05).cpu_quota_cores == 0.25
    assert initial_state(limits, start_cpu_cores=1.0).memory_limit_bytes == 64 * MIB  # memory: always the min
    assert initial_state(EnvLimits(), start_cpu_cores=1.0).cpu_quota_cores is None  # unlimited stays unlimited


def test_unlimited_resources_are_left_alone():
    s = initial_state(EnvLimits())
    assert (s.cpu_quota_cores, s.memory_limit_bytes) == (None, None)
    prev, cur = cpu_pair(used_cores=3.0, throttled_share=1.0, mem=10 * GIB)
    d = decide(s, cur, prev, EnvLimits(), NODE, DEFAULT_POLICY, now_s=1)
    assert (d.cpu_quota_cores, d.memory_limit_bytes, d.reasons) == (None, None, ())


def test_limits_validate():
    with pytest.raises(ValueError, match="cpu_min_cores 2 > cpu_max_cores 1"):
        EnvLimits(cpu_min_cores=2, cpu_max_cores=1)
    with pytest.raises(ValueError, match="memory_max_bytes must be > 0"):
        EnvLimits(memory_max_bytes=0)
    assert EnvLimits(cpu_max_cores=1.5).cpu_range == (1.5, 1.5)
    assert EnvLimits(memory_min_bytes=100).memory_range == (4096, 4096)


def test_adopt_keeps_running_quotas_clamped_to_the_plan():
    s = adopt_state(LIMITS, sample(0, cpu_quota_cores=8.0, memory_limit_bytes=200 * MIB))
    assert (s.cpu_quota_cores, s.memory_limit_bytes) == (2.0, 200 * MIB)
    s = adopt_state(LIMITS, sample(0, cpu_quota_cores=None, memory_limit_bytes=None))
    assert (s.cpu_quota_cores, s.memory_limit_bytes) == (2.0, 1 * GIB)


# -- hysteresis: a steady load settles and stays ----------------------------------------------------


def simulate(cpu_demand: float, memory_demand: int, seconds: float, cfg: PolicyConfig = DEFAULT_POLICY):
    """Drive decide() against the fake backend's workload model with a manual clock."""
    now = [0.0]
    backend = FakeBackend(clock=lambda: now[0])
    g = backend.create("sim")
    limits = LIMITS
    s = initial_state(limits)
    g.set_cpu(s.cpu_quota_cores)
    g.set_memory(s.memory_limit_bytes, hard_limit_bytes=limits.memory_range[1])
    g.cpu_demand_cores = cpu_demand
    g.memory_demand_bytes = memory_demand
    prev = g.sample()
    changes = []
    while now[0] < seconds:
        now[0] += TICK_S
        cur = g.sample()
        node = NodeView(cpu_cores=4, memory_total_bytes=16 * GIB, memory_available_bytes=12 * GIB,
                        cpu_burst_committed_cores=s.cpu_quota_cores - 0.25)  # fmt: skip
        d = decide(s, cur, prev, limits, node, cfg, now[0])
        if d.cpu_change:
            g.set_cpu(d.cpu_quota_cores)
            changes.append((now[0], "cpu", d.cpu_change, d.cpu_quota_cores))
        if d.memory_change:
            g.set_memory(d.memory_limit_bytes, hard_limit_bytes=limits.memory_range[1])
            changes.append((now[0], "memory", d.memory_change, d.memory_limit_bytes))
        s, prev = d.state, cur
    return s, changes, g


@pytest.mark.parametrize("cpu_demand", [0.1, 0.3, 0.49, 0.5, 0.51, 0.99, 1.7, 3.0])
@pytest.mark.parametrize("memory_demand_mib", [10, 52, 100, 400, 900])
def test_a_steady_load_settles_without_oscillation(cpu_demand, memory_demand_mib):
    s, changes, g = simulate(cpu_demand, memory_demand_mib * MIB, seconds=40)
    late = [c for c in changes if c[0] > 10]
    assert late == [], f"still changing after 10 s: {late}"
    # Settled where the load fits: not throttled (unless above max), memory below the high-water mark.
    assert s.cpu_quota_cores >= min(cpu_demand, 2.0) or s.cpu_quota_cores == 2.0
    assert g.sample().oom_kills == 0
    assert memory_demand_mib * MIB <= 0.8 * s.memory_limit_bytes or s.memory_limit_bytes == GIB


@settings(max_examples=60, deadline=None)
@given(cpu_demand=st.floats(0.0, 3.0), memory_demand=st.integers(0, 1000 * MIB))
def test_any_steady_load_stops_changing(cpu_demand, memory_demand):
    _s, changes, _g = simulate(cpu_demand, memory_demand, seconds=30)
    assert [c for c in changes if c[0] > 12] == []
    # Each resource moves one way only under a steady load: up to fit it, or down to it.
    for resource in ("cpu", "memory"):
        directions = {c[2] for c in changes if c[1] == resource}
        assert len(directions) <= 1, changes


def test_a_bursty_load_keeps_its_quota_between_bursts():
    """1 s bursts every 1.6 s: the 2 s hold never completes, so no halve/double sawtooth."""
    now = [0.0]
    backend = FakeBackend(clock=lambda: now[0])
    g = backend.create("bursty")
    s = initial_state(LIMITS)
    g.set_cpu(s.cpu_quota_cores)
    prev = g.sample()
    changes = []
    while now[0] < 30:
        now[0] += TICK_S
        g.cpu_demand_cores = 1.5 if (now[0] % 1.6) < 1.0 else 0.0
        cur = g.sample()
        d = decide(s, cur, prev, LIMITS, NODE, DEFAULT_POLICY, now[0])
        if d.cpu_change:
            g.set_cpu(d.cpu_quota_cores)
            changes.append((round(now[0], 1), d.cpu_change))
        s, prev = d.state, cur
    assert [c for c in changes if c[1] == "down"] == []
    assert s.cpu_quota_cores == 2.0


# -- admission --------------------------------------------------------------------------------------------


def test_admission_accepts_what_fits():
    a = admit(LIMITS, NODE, [LIMITS] * 3)
    assert a and a.admitted and "fits" in a.reason


def test_admission_refuses_memory_mins_beyond_ram():
    node = NodeView(cpu_cores=64, memory_total_bytes=4 * GIB, memory_available_bytes=4 * GIB)
    big = EnvLimits(memory_min_bytes=1 * GIB, memory_max_bytes=2 * GIB)
    assert admit(big, node, [big, big])  # 3 GiB of mins <= 4 GiB - 512 MiB reserve
    a = admit(big, node, [big, big, big])
    assert not a and "does not fit" in a.reason and "3 envs" in a.reason


def test_admission_refuses_when_headroom_is_short_now():
    node = NodeView(cpu_cores=8, memory_total_bytes=16 * GIB, memory_available_bytes=1 * GIB,
                    memory_promised_bytes=256 * MIB)  # fmt: skip
    a = admit(EnvLimits(memory_min_bytes=512 * MIB), node, [])
    assert not a and "headroom" in a.reason


def test_admission_refuses_cpu_mins_beyond_cores():
    node = NodeView(cpu_cores=2, memory_total_bytes=16 * GIB, memory_available_bytes=16 * GIB)
    one = EnvLimits(cpu_min_cores=0.5, cpu_max_cores=2)
    assert admit(one, node, [one] * 3)
    a = admit(one, node, [one] * 4)
    assert not a and "cpu min 0.5" in a.reason
    assert admit(one, node, [one] * 4, PolicyConfig(cpu_min_overcommit=4.0))
