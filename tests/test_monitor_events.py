"""The monitor's two shortcuts around its 200 ms tick: quiet ticks (no group used CPU since the
last tick: settled envs are not read at all) and memory events (a task stalled at its limit is
answered between ticks). Fake backend under MockClock for the logic, this host's cgroup v1 for
the kernel's side."""

from __future__ import annotations

import os
import select
import subprocess

import pytest
import trio
from trio.testing import MockClock

from tests.fixtures_cgroups import MIB
from tests.test_monitor import run
from weenv.provision.elastic._monitor import Monitor
from weenv.provision.elastic._policy import EnvLimits, PolicyConfig
from weenv.testing import FakeBackend

LIMITS = EnvLimits(cpu_min_cores=0.25, cpu_max_cores=2.0, memory_min_bytes=64 * MIB, memory_max_bytes=1 << 30)


def count_samples(group) -> list[int]:
    calls = [0]
    real = group.sample

    def sample(**kw):
        calls[0] += 1
        return real(**kw)

    group.sample = sample
    return calls


def test_quiet_ticks_read_only_due_memory_refreshes_and_activity_ends_them():
    async def scenario(monitor, backend):
        groups = [backend.create(f"e{i}") for i in range(3)]
        for i, g in enumerate(groups):
            monitor.add(f"e{i}", g, LIMITS)
        await trio.sleep(1)  # settle
        counts = [count_samples(g) for g in groups]
        quiet0 = monitor.statistics().quiet_ticks
        await trio.sleep(5)
        # 25 ticks, but idle envs are read once a second (their memory refresh), not every tick.
        assert monitor.statistics().quiet_ticks - quiet0 >= 24
        assert all(4 <= c[0] <= 6 for c in counts), [c[0] for c in counts]
        # One env starts working: the probe moves, every env is read each tick again, and the
        # busy one reacts on the next tick as it would without the probe.
        before = [c[0] for c in counts]
        groups[1].set_demand(cpu_cores=4.0)
        start = trio.current_time()
        while groups[1].quota_cores != 0.5:
            await trio.sleep(0.01)
        assert trio.current_time() - start <= 0.2 + 0.01 + 1e-6  # one tick (and one poll)
        await trio.sleep(1)
        assert all(c[0] - b >= 5 for c, b in zip(counts, before)), [c[0] - b for c, b in zip(counts, before)]

    run(scenario, probe=True)


def test_with_or_without_the_probe_the_monitor_makes_the_same_decisions():
    async def scenario(monitor, backend):
        busy = backend.create("busy")
        idle = backend.create("idle")
        monitor.add("busy", busy, LIMITS)
        monitor.add("idle", idle, LIMITS)
        for _ in range(3):  # bursts: compile and test, then think
            await trio.sleep(3)
            busy.cpu_demand_cores, busy.memory_demand_bytes = 2.0, 300 * MIB
            await trio.sleep(1.5)
            busy.cpu_demand_cores, busy.memory_demand_bytes = 0.0, 0
        await trio.sleep(8)

    with_probe, b1 = run(scenario, probe=True)
    without, b2 = run(scenario, probe=False)
    for name in ("busy", "idle"):
        assert b1._groups[name].history == b2._groups[name].history
    assert with_probe.statistics().quiet_ticks > 0 and without.statistics().quiet_ticks == 0
    m = with_probe.metrics("busy")
    assert m.cpu_up >= 3 and m.memory_up >= 3 and m.cpu_down >= 3 and m.memory_down >= 3


# -- the kernel's side: cgroup v1 on this host ----------------------------------------------------


def spawn_in(group, argv) -> subprocess.Popen:
    paths = group.procs_paths()

    def enter() -> None:
        for p in paths:
            fd = os.open(p, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

    return subprocess.Popen(argv, preexec_fn=enter, stdout=subprocess.PIPE)


@pytest.fixture(scope="module")
def rollout() -> str:
    from weenv.testing import rollout_binary

    return str(rollout_binary())


@pytest.mark.integration
def test_v1_memory_event_fd_turns_readable_when_a_task_stalls_at_the_limit(v1_backend, rollout):
    g = v1_backend.create("evt")
    fd = g.memory_event_fd()
    assert fd is not None and g.memory_event_fd() == fd  # one per group
    g.set_memory(32 * MIB, hard_limit_bytes=256 * MIB)
    proc = spawn_in(g, [rollout, "alloc", "64", "0"])
    try:
        readable, _, _ = select.select([fd], [], [], 20)
        assert readable == [fd], "no event while the task waits at 32 MiB"
        assert int.from_bytes(os.read(fd, 8), "little") >= 1
        s = g.sample()
        assert s.memory_stalled and s.memory_usage_bytes >= 30 * MIB and proc.poll() is None
        g.set_memory(128 * MIB, hard_limit_bytes=256 * MIB)  # wakes it; 64 MiB fits
        assert proc.wait(20) == 0 and proc.stdout.read() == b"ok\n"
        assert not g.sample().memory_stalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    g.remove()
    with pytest.raises(OSError):
        os.fstat(fd)  # the group closed it


@pytest.mark.integration
def test_a_stalled_env_grows_between_ticks(v1_backend, rollout):
    """With a 5 s tick, four doublings (32 -> 512 MiB) would take four ticks without events."""
    g = v1_backend.create("grow")
    monitor = Monitor(v1_backend.node_memory, interval_ms=5000, cfg=PolicyConfig(), offload="apply",
                      usage_ns=v1_backend.usage_ns)
    result = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            monitor.add("grow", g, EnvLimits(memory_min_bytes=32 * MIB, memory_max_bytes=512 * MIB))
            ticks0 = monitor.statistics().ticks
            proc = spawn_in(g, [rollout, "alloc", "300", "0"])
            try:
                result["rc"] = await trio.to_thread.run_sync(proc.wait, 60)
                result["out"] = proc.stdout.read()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
            result["ticks"] = monitor.statistics().ticks - ticks0
            nursery.cancel_scope.cancel()

    trio.run(main)
    m = monitor.metrics("grow")
    stats = monitor.statistics()
    print(f"{m.memory_up} doublings in {result['ticks']} ticks, {stats.fast_steps} fast steps")
    assert (result["rc"], result["out"]) == (0, b"ok\n")
    assert m.memory_up == 4 and m.oom_kills == 0
    assert result["ticks"] <= 2 and stats.fast_steps >= 3
    monitor.remove("grow")
    g.remove()


def test_settled_envs_are_read_every_other_tick_and_still_react_within_two():
    clock = MockClock(autojump_threshold=0)
    backend = FakeBackend(clock=clock.current_time)
    monitor = Monitor(backend.node_memory, interval_ms=200, cpu_cores=4, offload="none",
                      usage_ns=backend.usage_ns, settled_read_every=2)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            groups = [backend.create(f"e{i}") for i in range(4)]
            for i, g in enumerate(groups):
                monitor.add(f"e{i}", g, LIMITS)
            groups[0].set_demand(cpu_cores=0.1)  # below its quota: it keeps every tick busy (no quiet tick)
            await trio.sleep(1)
            counts = [count_samples(g) for g in groups]
            await trio.sleep(5)  # 25 ticks
            assert counts[0][0] >= 24
            assert all(11 <= c[0] <= 14 for c in counts[1:]), [c[0] for c in counts]
            # A settled env that starts working is seen within two ticks.
            for g in groups[1:]:
                g.set_demand(cpu_cores=4.0)
                start = trio.current_time()
                while g.quota_cores == 0.25:
                    await trio.sleep(0.01)
                assert trio.current_time() - start <= 0.4 + 0.01 + 1e-6  # two ticks (and one poll)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


def test_a_burst_in_a_tick_that_skipped_the_env_is_read_in_the_next_quiet_tick():
    clock = MockClock(autojump_threshold=0)
    backend = FakeBackend(clock=clock.current_time)
    monitor = Monitor(backend.node_memory, interval_ms=200, cpu_cores=4, offload="none",
                      usage_ns=backend.usage_ns, settled_read_every=4, idle_memory_refresh_s=60)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            g = backend.create("x")
            monitor.add("x", g, LIMITS)
            await trio.sleep(2)
            assert monitor._envs["x"].settled
            calls = count_samples(g)
            # Busy for a bit less than one tick, then idle again: the ticks after it are quiet.
            await trio.sleep(0.05)
            g.set_demand(cpu_cores=4.0)
            await trio.sleep(0.1)
            g.set_demand(cpu_cores=0.0)
            await trio.sleep(0.5)
            # Read in at most the two ticks that follow (the moving one may skip it, the quiet one
            # after it may not), and judged: throttled, so doubled.
            assert 1 <= calls[0] <= 2
            assert g.quota_cores == 0.5
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
