"""The monitor: deterministic runs on the fake backend under trio's MockClock, then the real thing
on this host's cgroup v1 (a CPU-hungry env, an allocating env, an env going past its max)."""

from __future__ import annotations

import json
import logging
import signal
import time

import pytest
import trio
from trio.testing import MockClock

from tests.fixtures_cgroups import MIB, Harness
from weenv.provision.elastic._monitor import Monitor
from weenv.provision.elastic._policy import EnvLimits, PolicyConfig
from weenv.testing import FakeBackend

GIB = 1 << 30
HUNGRY = EnvLimits(cpu_min_cores=0.25, cpu_max_cores=2.0, memory_min_bytes=64 * MIB, memory_max_bytes=1 * GIB)


def run(scenario, *, cfg: PolicyConfig = PolicyConfig(), cpu_cores: float = 4, offload: str = "none",
        memory_total_bytes: int = 16 * GIB, probe: bool = False):  # fmt: skip
    """Run ``scenario(monitor, backend)`` next to a running monitor on a fake clock (``probe``: the
    monitor may skip quiet ticks by the backend's usage counter)."""
    clock = MockClock(autojump_threshold=0)
    backend = FakeBackend(clock=clock.current_time, memory_total_bytes=memory_total_bytes)
    monitor = Monitor(backend.node_memory, interval_ms=200, cfg=cfg, cpu_cores=cpu_cores, offload=offload,
                      usage_ns=backend.usage_ns if probe else None)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            await scenario(monitor, backend)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    return monitor, backend


def cpu_history(group) -> list[float]:
    return [v for kind, v in group.history if kind == "cpu"]


def memory_history(group) -> list[int]:
    return [v[0] // MIB for kind, v in group.history if kind == "memory"]


def test_hungry_env_doubles_to_max_in_three_ticks():
    async def scenario(monitor, backend):
        g = backend.create("hungry")
        monitor.add("hungry", g, HUNGRY)
        g.cpu_demand_cores = 4.0
        # add() takes a baseline sample, so ticks 1, 2, 3 each double.
        await trio.sleep(0.7)
        assert cpu_history(g) == [0.25, 0.5, 1.0, 2.0]
        assert monitor.metrics("hungry").cpu_up == 3
        await trio.sleep(5)
        assert cpu_history(g) == [0.25, 0.5, 1.0, 2.0]  # at max, still throttled, stays

    run(scenario)


def test_a_settled_env_still_reacts_on_the_next_tick():
    async def scenario(monitor, backend):
        g = backend.create("sleepy")
        monitor.add("sleepy", g, HUNGRY)
        await trio.sleep(5)  # idle at its mins: decide() is skipped from the second tick on
        assert monitor._envs["sleepy"].settled
        assert cpu_history(g) == [0.25] and memory_history(g) == [64]
        g.cpu_demand_cores = 4.0
        g.memory_demand_bytes = 60 * MIB
        start = trio.current_time()
        while g.quota_cores != 0.5 or g.limit_bytes != 128 * MIB:
            await trio.sleep(0.01)
        assert trio.current_time() - start <= 0.2 + 1e-6
        assert not monitor._envs["sleepy"].settled

    run(scenario)


def test_idle_env_returns_to_min_after_holds():
    async def scenario(monitor, backend):
        g = backend.create("idle")
        monitor.add("idle", g, HUNGRY)
        g.cpu_demand_cores = 4.0
        await trio.sleep(1)
        assert g.quota_cores == 2.0
        g.cpu_demand_cores = 0.0
        went_idle = trio.current_time()
        while g.quota_cores != 0.25:
            await trio.sleep(0.2)
        # Three halvings, each after a full 2 s hold.
        assert 6.0 <= trio.current_time() - went_idle <= 6.6
        assert cpu_history(g)[-3:] == [1.0, 0.5, 0.25]
        m = monitor.metrics("idle")
        assert (m.cpu_up, m.cpu_down) == (3, 3)
        assert m.throttled_ns > 0

    run(scenario)


def test_memory_grows_by_doubling_and_is_not_killed_under_max():
    async def scenario(monitor, backend):
        g = backend.create("grow")
        monitor.add("grow", g, HUNGRY)
        for step in range(1, 23):
            g.memory_demand_bytes = step * 40 * MIB
            await trio.sleep(0.2)
        await trio.sleep(1)
        assert memory_history(g) == [64, 128, 256, 512, 1024]
        assert g.oom_kills == 0 and g.memory_usage_bytes == 880 * MIB
        m = monitor.metrics("grow")
        assert (m.memory_up, m.oom_kills, m.memory_refusals) == (4, 0, 0)

    run(scenario)


def test_past_max_the_env_is_oom_killed_and_counted(caplog):
    async def scenario(monitor, backend):
        g = backend.create("greedy")
        other = backend.create("other")
        monitor.add("greedy", g, HUNGRY)
        monitor.add("other", other, HUNGRY)
        other.memory_demand_bytes = 30 * MIB
        step = 0
        while g.oom_kills == 0:  # the process keeps allocating until the kernel kills it
            step += 1
            g.memory_demand_bytes = step * 60 * MIB
            await trio.sleep(0.2)
        assert step * 60 * MIB > GIB
        await trio.sleep(1)
        assert monitor.metrics("greedy").oom_kills == 1
        assert monitor.metrics("other").oom_kills == 0
        assert other.memory_usage_bytes == 30 * MIB

    with caplog.at_level(logging.WARNING, logger="weenv.provision.monitor"):
        run(scenario)
    assert any("OOM-killed inside its cgroup" in r.getMessage() and "greedy" in r.getMessage() for r in caplog.records)


def test_node_without_headroom_refuses_then_grants(caplog):
    async def scenario(monitor, backend):
        g = backend.create("squeezed")
        monitor.add("squeezed", g, HUNGRY)
        # 16 GiB node, 15.5 GiB used elsewhere, 512 MiB reserve: nothing to give.
        backend.other_used_bytes = 15 * GIB + 512 * MIB
        g.memory_demand_bytes = 100 * MIB
        await trio.sleep(3)
        assert g.limit_bytes == 64 * MIB and g.stalled
        m = monitor.metrics("squeezed")
        assert (m.memory_refusals, m.memory_up) == (1, 0)  # one episode, however many ticks
        snap = monitor.snapshot()["envs"]["squeezed"]
        assert snap["memory"]["refused"] is True
        backend.other_used_bytes = 0
        await trio.sleep(0.5)
        assert g.limit_bytes == 128 * MIB and not g.stalled
        assert monitor.snapshot()["envs"]["squeezed"]["memory"]["refused"] is False

    with caplog.at_level(logging.WARNING, logger="weenv.provision.monitor"):
        run(scenario)
    refusals = [r for r in caplog.records if "headroom" in r.getMessage()]
    assert len(refusals) == 1


def test_a_finished_burst_gives_its_memory_back_at_once_while_another_env_waits():
    cfg = PolicyConfig(hold_s=1.0, memory_headroom_bytes=16 * MIB, node_memory_reserve_bytes=512 * MIB)
    waited: list[float] = []

    async def scenario(monitor, backend):
        a, b = backend.create("a"), backend.create("b")
        monitor.add("a", a, HUNGRY)
        monitor.add("b", b, HUNGRY)
        # 1600 MiB node less 512 MiB reserve: a's burst (its way to 1 GiB reserved) leaves b no
        # room, and b's burst fits only once a is back at its min.
        a.memory_demand_bytes = 900 * MIB
        while a.limit_bytes < GIB:
            await trio.sleep(0.2)
        b.memory_demand_bytes = 600 * MIB
        await trio.sleep(1)
        assert b.limit_bytes == 64 * MIB and b.stalled  # waits: a holds its burst
        assert monitor.snapshot()["node"]["memory_waiters"] == 1
        assert b"weenv_node_memory_waiters 1.0" in monitor.prometheus_text()
        a.memory_demand_bytes = 10 * MIB  # a's burst ends
        ended = trio.current_time()
        while b.limit_bytes == 64 * MIB:
            await trio.sleep(0.2)
        waited.append(trio.current_time() - ended)
        # The contended hold (0.2 s, not hold_s), then straight to the floor (usage + headroom, at
        # least the min), not 1024 -> 512 -> 256 -> 128 -> 64 over four 1 s holds.
        assert memory_history(a)[-1] == 64 and memory_history(a).count(512) == 1  # 512 on the way up only

    run(scenario, cfg=cfg, memory_total_bytes=1600 * MIB)
    assert waited and waited[0] <= 0.8, waited


def test_burst_budget_is_shared_within_a_tick():
    async def scenario(monitor, backend):
        groups = []
        for i in range(3):
            g = backend.create(f"b{i}")
            monitor.add(f"b{i}", g, HUNGRY)
            g.cpu_demand_cores = 4.0
            groups.append(g)
        await trio.sleep(3)
        burst = sum(g.quota_cores - 0.25 for g in groups)
        assert burst == pytest.approx(2.0)  # the 2-core node's budget, never more
        assert sum(monitor.metrics(f"b{i}").cpu_refusals for i in range(3)) >= 1

    run(scenario, cpu_cores=2)


def test_snapshot_is_json_and_reports_last_change():
    async def scenario(monitor, backend):
        g = backend.create("snap")
        monitor.add("snap", g, HUNGRY)
        g.cpu_demand_cores = 1.0
        g.memory_demand_bytes = 10 * MIB
        await trio.sleep(0.9)
        snap = monitor.snapshot()
        json.dumps(snap)
        env = snap["envs"]["snap"]
        # 0.25 -> 0.5 -> 1.0 (demand 1.0 is throttled at 0.5), then it fits.
        assert env["cpu"]["quota_cores"] == 1.0 and env["cpu"]["min_cores"] == 0.25
        assert env["cpu"]["used_cores"] == pytest.approx(1.0) and env["cpu"]["throttled_share"] == 0
        assert env["memory"]["used_bytes"] == 10 * MIB and env["memory"]["limit_bytes"] == 64 * MIB
        assert env["last_change"]["resource"] == "cpu" and env["last_change"]["direction"] == "up"
        assert "throttled" in env["last_change"]["reason"]
        assert env["last_change"]["to"] == 1.0 and env["last_change"]["at_s"] == pytest.approx(0.4)
        assert env["metrics"]["cpu_up"] == 2
        assert snap["node"]["cpu_cores"] == 4 and snap["ticks"] >= 4

    run(scenario)


def test_removed_env_is_left_alone_and_vanished_groups_do_not_stop_the_loop(caplog):
    async def scenario(monitor, backend):
        a, b, c = (backend.create(n) for n in "abc")
        for name, g in zip("abc", (a, b, c)):
            monitor.add(name, g, HUNGRY)
            g.cpu_demand_cores = 4.0
        await trio.sleep(0.3)
        final = monitor.remove("a")
        assert final is not None and "a" not in monitor
        b.remove()  # the group vanishes under the monitor
        await trio.sleep(2)
        assert cpu_history(a) == [0.25, 0.5]
        assert monitor.metrics("b").sample_errors >= 5
        assert c.quota_cores == 2.0
        assert monitor.snapshot()["envs"]["b"]["error"]

    with caplog.at_level(logging.WARNING, logger="weenv.provision.monitor"):
        run(scenario)
    assert len([r for r in caplog.records if "cannot sample" in r.getMessage()]) == 1


def test_adopt_keeps_the_quotas_a_running_env_has():
    async def scenario(monitor, backend):
        g = backend.create("adopted")
        g.set_cpu(1.0)
        g.set_memory(256 * MIB)
        g.memory_demand_bytes = 150 * MIB
        g.cpu_demand_cores = 0.8
        monitor.add("adopted", g, HUNGRY, adopt=True)
        await trio.sleep(1)
        assert (g.quota_cores, g.limit_bytes) == (1.0, 256 * MIB)
        assert g.hard_limit_bytes == 1 * GIB  # the plan's max became the kill point

    run(scenario)


def test_admission_through_the_monitor():
    async def scenario(monitor, backend):
        half = EnvLimits(memory_min_bytes=1 * GIB, memory_max_bytes=2 * GIB)
        for i in range(3):
            assert monitor.admit(half)
            monitor.add(f"e{i}", backend.create(f"e{i}"), half)
        await trio.sleep(0.5)
        a = monitor.admit(half)
        assert not a and "3 envs" in a.reason

    run(scenario, memory_total_bytes=4 * GIB)


def test_add_twice_is_an_error():
    async def scenario(monitor, backend):
        g = backend.create("dup")
        monitor.add("dup", g, HUNGRY)
        with pytest.raises(ValueError, match="dup"):
            monitor.add("dup", g, HUNGRY)

    run(scenario)


def test_worker_thread_mode_reaches_the_same_result():
    async def scenario(monitor, backend):
        g = backend.create("threaded")
        monitor.add("threaded", g, HUNGRY)
        g.cpu_demand_cores = 4.0
        # The fake clock jumps while the worker thread runs, so count ticks, not virtual seconds.
        while g.quota_cores != 2.0:
            assert monitor.statistics().ticks < 10, cpu_history(g)
            await trio.sleep(0.2)
        assert cpu_history(g) == [0.25, 0.5, 1.0, 2.0]

    run(scenario, offload="all")


# -- the real thing: this host's cgroup v1 -----------------------------------------------------------


def run_real(backend, scenario, cfg: PolicyConfig):
    monitor = Monitor(backend.node_memory, interval_ms=200, cfg=cfg)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            await scenario(monitor)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return monitor


BUSY = "print('up', flush=True)\nwhile True: pass"


@pytest.mark.integration
def test_real_hungry_env_reaches_max_then_idles_back_to_min(v1_backend):
    g = v1_backend.create("hungry")
    h = Harness("v1", v1_backend, True, True)
    limits = EnvLimits(cpu_min_cores=0.25, cpu_max_cores=1.0)
    result = {}

    async def scenario(monitor):
        monitor.add("hungry", g, limits)
        # Two busy processes: on a loaded 2-core host one alone may not even reach its quota.
        children = [h.spawn(g, BUSY) for _ in range(2)]
        for child in children:
            assert await trio.to_thread.run_sync(child.stdout.readline) == b"up\n"
        # timed from when both are busy: python's own start-up under a 0.25-core quota is not the monitor's
        start, ticks0 = time.monotonic(), monitor.statistics().ticks
        with trio.fail_after(10):
            while monitor.snapshot()["envs"]["hungry"]["cpu"]["quota_cores"] != 1.0:
                await trio.sleep(0.05)
        result["up_s"] = time.monotonic() - start
        result["up_ticks"] = monitor.statistics().ticks - ticks0
        for child in children:
            child.kill()
            child.wait()
        start = time.monotonic()
        with trio.fail_after(15):
            while monitor.snapshot()["envs"]["hungry"]["cpu"]["quota_cores"] != 0.25:
                await trio.sleep(0.05)
        result["down_s"] = time.monotonic() - start

    try:
        monitor = run_real(v1_backend, scenario, PolicyConfig(hold_s=0.6))
    finally:
        h.close()
    print(f"0.25 -> 1.0 core in {result['up_s']:.2f} s once busy ({result['up_ticks']} ticks); "
          f"back to 0.25 in {result['down_s']:.2f} s")  # fmt: skip
    # Two doublings take two ticks once throttled; "about a second", with slack for a loaded host.
    assert result["up_s"] <= 5.0
    m = monitor.metrics("hungry")
    assert (m.cpu_up, m.cpu_down) == (2, 2) and m.throttled_ns > 0
    assert g.sample().cpu_quota_cores == 0.25


@pytest.mark.integration
class _RecordsMemoryLimits:
    """A cgroup whose memory limits, as the monitor sets them, are recorded in order (sampling
    the monitor's view every 20 ms misses a step when the test itself is starved under load)."""

    def __init__(self, group):
        self._group = group
        self.limits: list[int] = []

    def __getattr__(self, name):
        return getattr(self._group, name)

    def set_memory(self, limit_bytes, **kw):
        actual = self._group.set_memory(limit_bytes, **kw)
        if not self.limits or self.limits[-1] != actual:
            self.limits.append(actual)
        return actual


def test_real_memory_grows_by_doubling_without_oom_kill(v1_backend):
    g = _RecordsMemoryLimits(v1_backend.create("grow"))
    h = Harness("v1", v1_backend, True, True)
    limits = EnvLimits(memory_min_bytes=32 * MIB, memory_max_bytes=512 * MIB)
    # 300 MiB in 4 MiB steps, every page touched, as fast as the limit allows.
    code = ("b = []\nfor _ in range(75):\n    x = bytearray(4 << 20)\n    x[::4096] = b'x' * len(x[::4096])\n"
            "    b.append(x)\nprint('done', flush=True)\nimport time; time.sleep(60)")  # fmt: skip

    async def scenario(monitor):
        monitor.add("grow", g, limits)
        child = h.spawn(g._group, code)
        with trio.fail_after(20):
            while child.poll() is None:
                if g.sample().memory_usage_bytes >= 300 * MIB:
                    break
                await trio.sleep(0.02)
            line = await trio.to_thread.run_sync(child.stdout.readline)
        assert line == b"done\n"
        assert child.poll() is None
        assert monitor.snapshot()["envs"]["grow"]["memory"]["limit_bytes"] == g.limits[-1]

    try:
        monitor = run_real(v1_backend, scenario, PolicyConfig())
    finally:
        h.close()
    print("memory limit went", " -> ".join(f"{x // MIB}" for x in g.limits), "MiB")
    m = monitor.metrics("grow")
    assert m.oom_kills == 0
    # Each step exactly doubles, from the min, up to where 300 MiB fits.
    mib = [x // MIB for x in g.limits]
    assert mib[0] == 32 and all(b == 2 * a for a, b in zip(mib, mib[1:])) and mib[-1] >= 512
    assert m.memory_up == 4


@pytest.mark.integration
def test_real_env_past_its_max_is_oom_killed_alone(v1_backend):
    greedy = v1_backend.create("greedy")
    calm = v1_backend.create("calm")
    h = Harness("v1", v1_backend, True, True)
    limits = EnvLimits(memory_min_bytes=32 * MIB, memory_max_bytes=128 * MIB)

    async def scenario(monitor):
        monitor.add("greedy", greedy, limits)
        monitor.add("calm", calm, limits)
        bystander = h.spawn(calm)
        victim = h.spawn(greedy, "b = []\nwhile True:\n    x = bytearray(4 << 20)\n    x[::4096] = b'x' * len(x[::4096])\n"
                                 "    b.append(x)")  # fmt: skip
        with trio.fail_after(20):
            rc = await trio.to_thread.run_sync(victim.wait)
        assert rc == -signal.SIGKILL
        await trio.sleep(0.5)
        assert bystander.poll() is None

    try:
        monitor = run_real(v1_backend, scenario, PolicyConfig())
    finally:
        h.close()
    assert monitor.metrics("greedy").oom_kills >= 1
    assert monitor.metrics("calm").oom_kills == 0
    s = greedy.sample()
    assert s.oom_kills >= 1 and s.memory_limit_bytes == 128 * MIB
