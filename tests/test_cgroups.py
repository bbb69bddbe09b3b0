"""The cgroup seam: one conformance suite over v1 (this host), v2 (this host's unified mount, which
has no controllers, and a mimic tree that has them) and the fake; then what only a real kernel
shows (throttling, OOM kills, the pids limit, the freezer) on v1; then v2 file formats."""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

import msgspec
import pytest

from tests.fixtures_cgroups import MIB, Harness
from weenv.provision._errors import CgroupBusyError, CgroupError, CgroupExistsError, CgroupNameError
from weenv.provision._errors import CgroupNotFoundError, CgroupUnavailableError, ProvisionError
from weenv.provision.cgroups import CgroupSample, parse_layout
from weenv.provision.cgroups._base import translate_oserror

pytestmark = pytest.mark.integration


def need(h: Harness, *features: str) -> None:
    missing = [f for f in features if f not in h.backend.features]
    if missing:
        pytest.skip(f"{h.kind} backend on this host lacks {missing}")


def need_processes(h: Harness) -> None:
    if not h.real_processes:
        pytest.skip(f"{h.kind} backend holds no real processes")


def wait_for(predicate, timeout_s: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("State:"):
                return line.split()[1]
    raise AssertionError("no State line")


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


BUSY = "import sys; print('up', flush=True)\nwhile True: pass"


# -- conformance: every backend --------------------------------------------------------------------


class TestConformance:
    def test_create_list_open_remove(self, cgroup_harness: Harness):
        b = cgroup_harness.backend
        g = b.create("env-a")
        assert g.name == "env-a"
        assert b.list() == ["env-a"]
        assert b.open("env-a").name == "env-a"
        g.remove()
        g.remove()  # idempotent
        assert b.list() == []
        with pytest.raises(CgroupNotFoundError) as info:
            b.open("env-a")
        assert "env-a" in str(info.value)

    def test_create_twice_is_refused(self, cgroup_harness: Harness):
        b = cgroup_harness.backend
        b.create("twice")
        with pytest.raises(CgroupExistsError, match="twice"):
            b.create("twice")
        assert b.list() == ["twice"]

    @pytest.mark.parametrize("bad", ["", "..", "a/b", "../escape", ".hidden", "x" * 200, "sp ace"])
    def test_names_cannot_escape_the_parent(self, cgroup_harness: Harness, bad: str):
        with pytest.raises(CgroupNameError):
            cgroup_harness.backend.create(bad)
        with pytest.raises(CgroupNameError):
            cgroup_harness.backend.open(bad)
        assert cgroup_harness.backend.list() == []

    def test_errors_belong_to_one_tree(self):
        for exc in (CgroupBusyError, CgroupExistsError, CgroupNameError, CgroupNotFoundError, CgroupUnavailableError):
            assert issubclass(exc, CgroupError) and issubclass(exc, ProvisionError)

    def test_cpu_quota_round_trips(self, cgroup_harness: Harness):
        need(cgroup_harness, "cpu")
        b = cgroup_harness.backend
        g = b.create("cpu")
        assert g.sample().cpu_quota_cores is None
        g.set_cpu(0.5)
        assert g.sample().cpu_quota_cores == 0.5
        # Re-adoption reads the kernel, not the object's memory.
        assert b.open("cpu").sample().cpu_quota_cores == 0.5
        g.set_cpu(2.0, period_us=50_000)
        assert b.open("cpu").sample().cpu_quota_cores == 2.0
        # Steep drops and rises: the kernel refuses a burst above the quota (5.14+), so the
        # backend must order its writes.
        g.set_cpu(0.01)
        assert b.open("cpu").sample().cpu_quota_cores == 0.01
        b.open("cpu").set_cpu(4.0)
        b.open("cpu").set_cpu(0.25)
        assert b.open("cpu").sample().cpu_quota_cores == 0.25
        g.set_cpu(None)
        assert b.open("cpu").sample().cpu_quota_cores is None

    def test_memory_limit_round_trips(self, cgroup_harness: Harness):
        need(cgroup_harness, "memory")
        b = cgroup_harness.backend
        g = b.create("mem")
        assert g.set_memory(64 * MIB) == 64 * MIB
        s = g.sample()
        assert (s.memory_limit_bytes, s.memory_hard_limit_bytes) == (64 * MIB, 64 * MIB)
        assert b.open("mem").sample().memory_limit_bytes == 64 * MIB
        # Elastic: throttle at 32 MiB, kill at 256 MiB.
        assert g.set_memory(32 * MIB, hard_limit_bytes=256 * MIB) == 32 * MIB
        s = g.sample()
        assert (s.memory_limit_bytes, s.memory_hard_limit_bytes) == (32 * MIB, 256 * MIB)
        assert b.open("mem").sample().memory_limit_bytes == 32 * MIB
        # Unaligned requests are rounded up to a page, so what is read back is what was asked.
        assert g.set_memory(10 * MIB + 1) == 10 * MIB + 4096
        assert g.set_memory(None) is None
        assert b.open("mem").sample().memory_limit_bytes is None

    def test_pids_limit_round_trips(self, cgroup_harness: Harness):
        need(cgroup_harness, "pids")
        b = cgroup_harness.backend
        g = b.create("pids")
        g.set_pids(16)
        assert g.sample().pids_max == 16
        assert b.open("pids").sample().pids_max == 16
        g.set_pids(None)
        assert b.open("pids").sample().pids_max is None

    def test_missing_controllers_are_reported_not_ignored(self, cgroup_harness: Harness):
        b = cgroup_harness.backend
        g = b.create("partial")
        for feature, call in (
            ("cpu", lambda: g.set_cpu(1.0)),
            ("memory", lambda: g.set_memory(64 * MIB)),
            ("pids", lambda: g.set_pids(10)),
        ):
            if feature not in b.features:
                with pytest.raises(CgroupUnavailableError, match=feature):
                    call()

    def test_sample_counters_are_monotonic(self, cgroup_harness: Harness):
        g = cgroup_harness.backend.create("sample")
        a = g.sample()
        b = g.sample()
        assert isinstance(a, CgroupSample)
        assert b.timestamp_s >= a.timestamp_s
        for field in ("cpu_usage_ns", "nr_periods", "nr_throttled", "throttled_ns", "memory_limit_hits", "oom_kills"):
            assert getattr(b, field) >= getattr(a, field) >= 0, field
        if "pressure" in cgroup_harness.backend.features:
            assert a.memory_pressure_some_total_us is not None and a.cpu_pressure_some_avg10 is not None

    def test_a_process_entering_through_procs_paths_is_inside(self, cgroup_harness: Harness):
        need_processes(cgroup_harness)
        g = cgroup_harness.backend.create("procs")
        child = cgroup_harness.spawn(g)
        wait_for(lambda: child.pid in g.pids(), what="child in cgroup.procs")
        if cgroup_harness.kernel:
            # Every hierarchy, per the kernel's own view of the child.
            with open("/proc/self/mountinfo") as f, open("/proc/self/cgroup") as c:
                layout = parse_layout(f.read(), c.read())
            where = {}
            with open(f"/proc/{child.pid}/cgroup") as f:
                for line in f:
                    _, controllers, path = line.strip().split(":", 2)
                    for c in controllers.split(",") if controllers else [""]:
                        where[c] = path
            mounts = {m: c for c, m in layout.v1_mounts.items()}
            if layout.unified_mount:
                mounts[layout.unified_mount] = ""
            for p in g.procs_paths():
                d = os.path.dirname(p)
                mount = next(m for m in mounts if d.startswith(m + "/"))
                for c in [c for c, m in layout.v1_mounts.items() if m == mount] or [""]:
                    assert d == mount + where[c], (c, d, where)
        if "pids" in cgroup_harness.backend.features:
            assert g.sample().pids_current >= 1

    def test_idle_readings_are_reused_but_activity_is_seen(self, cgroup_harness: Harness):
        if not cgroup_harness.kernel:
            pytest.skip(f"{cgroup_harness.kind}: counters only move under a kernel")
        g = cgroup_harness.backend.create("activity")
        a = g.sample(memory_max_age_s=60)
        b = g.sample(memory_max_age_s=60)
        assert b.timestamp_s > a.timestamp_s
        assert msgspec.structs.replace(b, timestamp_s=a.timestamp_s) == a
        child = cgroup_harness.spawn(g, "x = bytearray(20 << 20)\n" + BUSY)
        assert child.stdout.readline() == b"up\n"
        time.sleep(0.1)
        c = g.sample(memory_max_age_s=60)
        assert c.cpu_usage_ns > b.cpu_usage_ns
        if "memory" in cgroup_harness.backend.features:
            assert c.memory_usage_bytes >= b.memory_usage_bytes + 20 * MIB
        if "cpu" in cgroup_harness.backend.features:
            g.set_cpu(0.1)
            time.sleep(0.3)
            d = g.sample(memory_max_age_s=60)
            assert d.cpu_quota_cores == 0.1 and d.nr_throttled > c.nr_throttled

    def test_freeze_stops_and_thaw_resumes(self, cgroup_harness: Harness):
        need(cgroup_harness, "freeze")
        g = cgroup_harness.backend.create("freeze")
        if not cgroup_harness.real_processes:
            g.freeze()
            assert g.is_frozen()
            g.thaw()
            assert not g.is_frozen()
            return
        child = cgroup_harness.spawn(g, BUSY)
        assert child.stdout.readline() == b"up\n"
        g.freeze()
        assert g.is_frozen()
        before = cpu_ticks(child.pid)
        time.sleep(0.2)
        assert cpu_ticks(child.pid) == before, "a frozen process kept running"
        g.thaw()
        assert not g.is_frozen()
        wait_for(lambda: cpu_ticks(child.pid) > before, what="the thawed process to run")

    def test_kill_all_empties_the_group(self, cgroup_harness: Harness):
        g = cgroup_harness.backend.create("kill")
        if cgroup_harness.real_processes:
            children = [cgroup_harness.spawn(g) for _ in range(3)]
            wait_for(lambda: len(g.pids()) == 3, what="three children inside")
        else:
            for pid in (101, 102, 103):
                g.attach(pid)
        assert g.kill_all() == 3
        if cgroup_harness.real_processes:
            assert [c.wait(timeout=5) for c in children] == [-signal.SIGKILL] * 3
        wait_for(lambda: g.pids() == [], what="an empty group")
        assert g.kill_all() == 0
        g.remove()
        assert cgroup_harness.backend.list() == []

    def test_remove_refuses_a_populated_group_in_time(self, cgroup_harness: Harness):
        g = cgroup_harness.backend.create("busy")
        if cgroup_harness.real_processes:
            cgroup_harness.spawn(g)
            wait_for(lambda: g.pids(), what="child inside")
        else:
            g.attach(4242)
        with pytest.raises(CgroupBusyError, match="busy"):
            g.remove(timeout_s=0.05)
        assert cgroup_harness.backend.list() == ["busy"]
        g.kill_all()
        g.remove()
        assert cgroup_harness.backend.list() == []

    def test_removed_group_answers_not_found(self, cgroup_harness: Harness):
        g = cgroup_harness.backend.create("gone")
        g.sample()  # opens descriptors that must not keep it alive
        g.remove()
        with pytest.raises(CgroupNotFoundError, match="gone"):
            g.sample()
        if cgroup_harness.kernel:
            for p in g.procs_paths():
                assert not os.path.exists(os.path.dirname(p))

    def test_node_memory(self, cgroup_harness: Harness):
        total, available = cgroup_harness.backend.node_memory()
        assert total > 0 and 0 <= available <= total


# -- v1, this host's real kernel ---------------------------------------------------------------------


class TestV1Host:
    def test_layout_matches_the_kernel(self, v1_backend):
        # Ours is the only memory cgroup the parent may sit under; the others are the roots.
        with open("/proc/self/cgroup") as f:
            own_memory = next(line.split(":", 2)[2].strip() for line in f if ":memory:" in line)
        mem_parent = next(d for d in v1_backend.parent_dirs if "/memory" in d)
        assert mem_parent == f"/sys/fs/cgroup/memory{own_memory.rstrip('/')}/{os.path.basename(mem_parent)}"
        assert {"cpu", "memory", "pids", "freeze", "kill"} <= v1_backend.features

    def test_quota_throttles_a_busy_process(self, v1_backend, tmp_path):
        g = v1_backend.create("throttle")
        h = Harness("v1", v1_backend, True, True)
        try:
            g.set_cpu(0.2)
            child = h.spawn(g, BUSY)
            assert child.stdout.readline() == b"up\n"
            a = g.sample()
            time.sleep(0.6)
            b = g.sample()
            used = (b.cpu_usage_ns - a.cpu_usage_ns) / 1e9 / (b.timestamp_s - a.timestamp_s)
            print(f"busy loop under a 0.2-core quota used {used:.2f} cores")
            assert used < 0.5
            assert b.nr_throttled > a.nr_throttled and b.throttled_ns > a.throttled_ns
            assert b.nr_periods > a.nr_periods
        finally:
            h.close()

    def test_oom_kill_stays_inside_the_group(self, v1_backend):
        victim_group = v1_backend.create("oom")
        bystander_group = v1_backend.create("bystander")
        h = Harness("v1", v1_backend, True, True)
        try:
            victim_group.set_memory(64 * MIB)
            bystander_group.set_memory(64 * MIB)
            bystander = h.spawn(bystander_group)
            victim = h.spawn(victim_group, "b = []\nwhile True: b.append(bytearray(1 << 20))")
            assert victim.wait(timeout=20) == -signal.SIGKILL
            s = victim_group.sample()
            assert s.oom_kills >= 1 and s.memory_limit_hits > 0
            assert bystander.poll() is None
            assert bystander_group.sample().oom_kills == 0
        finally:
            h.close()

    def test_below_the_hard_limit_tasks_wait_instead_of_dying(self, v1_backend):
        g = v1_backend.create("stall")
        h = Harness("v1", v1_backend, True, True)
        try:
            g.set_memory(48 * MIB, hard_limit_bytes=512 * MIB)
            child = h.spawn(g, "b = [bytearray(1 << 20) for _ in range(80)]\nprint('done', flush=True)\n"
                               "import time; time.sleep(60)")  # fmt: skip
            wait_for(lambda: g.sample().memory_stalled, what="the allocation to stall at the limit")
            assert proc_state(child.pid) == "D" and child.poll() is None
            assert g.set_memory(160 * MIB, hard_limit_bytes=512 * MIB) == 160 * MIB
            assert child.stdout.readline() == b"done\n"
            s = g.sample()
            assert not s.memory_stalled and s.oom_kills == 0
            # Reaching the hard limit re-enables the OOM killer.
            g.set_memory(512 * MIB)
            assert g.sample().memory_hard_limit_bytes == 512 * MIB
        finally:
            h.close()

    def test_lowering_below_usage_is_reported_not_raised(self, v1_backend):
        g = v1_backend.create("ebusy")
        h = Harness("v1", v1_backend, True, True)
        try:
            g.set_memory(256 * MIB)
            child = h.spawn(g, "b = bytearray(100 << 20)\nb[::4096] = b'x' * len(b[::4096])\n"
                               "print('held', flush=True)\nimport time; time.sleep(60)")  # fmt: skip
            assert child.stdout.readline() == b"held\n"
            assert g.set_memory(32 * MIB) == 256 * MIB
            assert g.sample().memory_limit_bytes == 256 * MIB
            assert child.poll() is None
        finally:
            h.close()

    def test_frozen_process_is_in_the_freezer(self, v1_backend):
        g = v1_backend.create("frozen")
        h = Harness("v1", v1_backend, True, True)
        try:
            child = h.spawn(g, BUSY)
            assert child.stdout.readline() == b"up\n"
            g.freeze()
            # The v1 freezer parks tasks in uninterruptible sleep.
            assert proc_state(child.pid) == "D"
            g.thaw()
            wait_for(lambda: proc_state(child.pid) == "R", what="the thawed task to run")
        finally:
            h.close()

    def test_a_freeze_stuck_in_freezing_is_kicked_and_a_hopeless_one_thaws(self, v1_backend):
        # The v1 freezer can stay FREEZING (a task forking or ptrace-stopped, as under gVisor's
        # ptrace platform, when the state was written); only a new write retries. The stand-in fs
        # reports FREEZING until the group has been told FROZEN `needed` times.
        from weenv.provision.cgroups._fs import CgroupFs

        class StuckFreezer(CgroupFs):
            def __init__(self, needed: int):
                self.needed, self.writes = needed, []

            def write(self, path, data):
                if path.endswith("freezer.state"):
                    self.writes.append(data)
                super().write(path, data)

            def read(self, path):
                if path.endswith("freezer.state") and self.writes.count("FROZEN") < self.needed:
                    return b"FREEZING\n"
                return super().read(path)

        g = v1_backend.create("stuck")
        h = Harness("v1", v1_backend, True, True)
        try:
            child = h.spawn(g, BUSY)
            assert child.stdout.readline() == b"up\n"
            g._fs = fs = StuckFreezer(needed=3)
            g.freeze()
            assert fs.writes == ["FROZEN", "THAWED", "FROZEN", "THAWED", "FROZEN"]
            assert proc_state(child.pid) == "D"
            g.thaw()
            g._fs = fs = StuckFreezer(needed=10**6)
            with pytest.raises(CgroupBusyError, match="still FREEZING after 0.3 s"):
                g.freeze(timeout_s=0.3)
            assert fs.writes[-1] == "THAWED"  # not left half-frozen behind a running env
            wait_for(lambda: proc_state(child.pid) == "R", what="the task to run again")
        finally:
            h.close()

    def test_pids_limit_makes_fork_fail(self, v1_backend):
        g = v1_backend.create("forks")
        h = Harness("v1", v1_backend, True, True)
        code = (
            "import os, time\nok = failed = 0\nfor _ in range(12):\n"
            "    try:\n        pid = os.fork()\n    except BlockingIOError:\n        failed += 1\n        continue\n"
            "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    ok += 1\n"
            "print(ok, failed, flush=True)\ntime.sleep(60)\n"
        )
        try:
            g.set_pids(5)
            child = h.spawn(g, code)
            ok, failed = map(int, child.stdout.readline().split())
            assert (ok, failed) == (4, 8)  # the python parent is the fifth task
            assert g.sample().pids_current == 5
            assert g.kill_all() == 5
        finally:
            h.close()

    def test_kill_all_wins_against_a_forking_process(self, v1_backend):
        g = v1_backend.create("forker")
        h = Harness("v1", v1_backend, True, True)
        code = "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(0.01)\n        os._exit(0)\n"
        try:
            g.set_pids(64)
            h.spawn(g, code)
            wait_for(lambda: len(g.pids()) > 3, what="forks")
            g.kill_all()
            wait_for(lambda: not g.pids(), timeout_s=2, what="the group to empty")
            g.remove()
        finally:
            h.close()

    def test_pressure_comes_from_the_unified_hierarchy(self, v1_backend):
        if "pressure" not in v1_backend.features:
            pytest.skip("no PSI in the unified hierarchy of this host")
        g = v1_backend.create("psi")
        assert any("/unified/" in p for p in g.procs_paths())
        s = g.sample()
        assert s.memory_pressure_some_avg10 == 0.0 and s.memory_pressure_full_total_us == 0

    def test_open_recreates_a_hierarchy_lost_in_a_crash(self, v1_backend):
        v1_backend.create("half")
        freezer_dir = next(d for d in v1_backend.parent_dirs if "/freezer/" in d) + "/half"
        os.rmdir(freezer_dir)
        g = v1_backend.open("half")
        assert os.path.isdir(freezer_dir)
        g.freeze()
        g.thaw()

    def test_node_memory_is_the_host(self, v1_backend):
        total, available = v1_backend.node_memory()
        with open("/proc/meminfo") as f:
            host_total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
        assert total <= host_total and available <= total


# -- v2 formats, on the mimic tree --------------------------------------------------------------------


class TestV2Mimic:
    def test_controllers_are_enabled_in_our_parent_only(self, v2_mimic):
        backend, fs = v2_mimic
        assert fs.get(backend.parent_dir, "cgroup.subtree_control").split() == ["cpu", "memory", "pids"]
        assert fs.get(f"{fs.root}/daemon.service", "cgroup.subtree_control").split() == ["cpu", "memory", "pids"]
        assert {"cpu", "memory", "pids", "freeze", "kill", "pressure"} <= backend.features

    def test_undelegated_controllers_are_missing_features(self, tmp_path):
        from tests.fixtures_cgroups import MimicCgroup2Fs
        from weenv.provision.cgroups import V2Backend

        fs = MimicCgroup2Fs(str(tmp_path / "cg"), delegated=("pids",))
        backend = V2Backend(fs.root, root_name="weenv", fs=fs)
        assert "cpu" not in backend.features and "memory" not in backend.features
        g = backend.create("x")
        with pytest.raises(CgroupUnavailableError, match="cpu"):
            g.set_cpu(1.0)
        g.remove()
        assert backend.remove_parent()

    def test_memory_elastic_limit_is_memory_high(self, v2_mimic):
        backend, fs = v2_mimic
        g = backend.create("m")
        d = f"{backend.parent_dir}/m"
        g.set_memory(64 * MIB, hard_limit_bytes=1024 * MIB)
        assert (fs.get(d, "memory.high").strip(), fs.get(d, "memory.max").strip()) == (str(64 * MIB), str(1024 * MIB))
        g.set_memory(128 * MIB, hard_limit_bytes=1024 * MIB)
        assert fs.get(d, "memory.high").strip() == str(128 * MIB)
        g.set_memory(1024 * MIB, hard_limit_bytes=1024 * MIB)
        assert (fs.get(d, "memory.high").strip(), fs.get(d, "memory.max").strip()) == ("max", str(1024 * MIB))
        g.set_memory(None)
        assert (fs.get(d, "memory.high").strip(), fs.get(d, "memory.max").strip()) == ("max", "max")
        g.set_cpu(0.25)
        assert fs.get(d, "cpu.max").strip() == "25000 100000"

    def test_cpu_burst_follows_quota_both_ways(self, v2_mimic):
        # The mimic refuses a burst above the quota, as the kernel does: raising and lowering
        # must write the two files in the right order.
        backend, fs = v2_mimic
        g = backend.create("b")
        d = f"{backend.parent_dir}/b"
        for cores in (0.25, 2.0, 0.5, 0.01, None, 0.25):
            g.set_cpu(cores)
            quota = fs.get(d, "cpu.max").split()[0]
            if cores is not None:
                assert fs.get(d, "cpu.max.burst").strip() == quota
        # A daemon that restarts re-reads the burst, so its first lowering is ordered too.
        backend.open("b").set_cpu(0.01)
        assert fs.get(d, "cpu.max.burst").strip() == "1000"

    def test_sample_parses_kernel_formats(self, v2_mimic):
        backend, fs = v2_mimic
        g = backend.create("s")
        d = f"{backend.parent_dir}/s"
        g.set_cpu(0.5)
        g.set_memory(64 * MIB, hard_limit_bytes=256 * MIB)
        fs.put(d, "cpu.stat", "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 40\n"
                              "nr_throttled 12\nthrottled_usec 7000\nnr_bursts 0\nburst_usec 0\n")  # fmt: skip
        fs.put(d, "memory.current", f"{50 * MIB}\n")
        fs.put(d, "memory.events", "low 0\nhigh 9\nmax 3\noom 2\noom_kill 1\noom_group_kill 0\n")
        fs.put(d, "memory.pressure", "some avg10=1.50 avg60=0.20 avg300=0.00 total=123456\n"
                                     "full avg10=0.50 avg60=0.10 avg300=0.00 total=65432\n")  # fmt: skip
        fs.put(d, "cpu.pressure", "some avg10=12.25 avg60=1.00 avg300=0.10 total=999\n")
        s = g.sample()
        assert (s.cpu_usage_ns, s.nr_periods, s.nr_throttled, s.throttled_ns) == (1_500_000, 40, 12, 7_000_000)
        assert (s.memory_usage_bytes, s.memory_limit_bytes, s.memory_hard_limit_bytes) == (50 * MIB, 64 * MIB, 256 * MIB)
        assert (s.memory_high_events, s.memory_limit_hits, s.oom_events, s.oom_kills) == (9, 3, 2, 1)
        assert (s.memory_pressure_some_avg10, s.memory_pressure_full_avg10) == (1.5, 0.5)
        assert (s.memory_pressure_some_total_us, s.memory_pressure_full_total_us) == (123456, 65432)
        assert s.cpu_pressure_some_avg10 == 12.25
        assert not s.memory_stalled

    def test_open_reads_limits_back(self, v2_mimic):
        backend, fs = v2_mimic
        g = backend.create("o")
        g.set_cpu(1.5)
        g.set_memory(64 * MIB, hard_limit_bytes=512 * MIB)
        g.set_pids(99)
        s = backend.open("o").sample()
        assert (s.cpu_quota_cores, s.memory_limit_bytes, s.memory_hard_limit_bytes, s.pids_max) == (
            1.5, 64 * MIB, 512 * MIB, 99,
        )  # fmt: skip

    def test_garbage_in_a_counter_names_the_file(self, v2_mimic):
        backend, fs = v2_mimic
        g = backend.create("bad")
        fs.put(f"{backend.parent_dir}/bad", "memory.current", "lots\n")
        with pytest.raises(CgroupError, match="memory.current"):
            g.sample()


# -- the error boundary ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "err, expected",
    [
        (errno.ENOENT, CgroupNotFoundError),
        (errno.ENODEV, CgroupNotFoundError),
        (errno.EBUSY, CgroupBusyError),
        (errno.EACCES, CgroupUnavailableError),
        (errno.EPERM, CgroupUnavailableError),
        (errno.EROFS, CgroupUnavailableError),
        (errno.EINVAL, CgroupError),
        (errno.ENOSPC, CgroupError),
    ],
)
def test_every_oserror_is_mapped_at_the_boundary(err, expected):
    with pytest.raises(expected) as info:
        with translate_oserror("env-7", "/sys/fs/cgroup/x/cpu.max"):
            raise OSError(err, os.strerror(err))
    assert type(info.value) is expected
    assert "env-7" in str(info.value) and "/sys/fs/cgroup/x/cpu.max" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


# -- layout detection (pure) -------------------------------------------------------------------------

HYBRID_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
32 30 0:28 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu
33 30 0:29 / /sys/fs/cgroup/cpuacct rw,nosuid - cgroup cgroup rw,cpuacct
34 30 0:30 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer
36 30 0:32 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
"""
HYBRID_CGROUP = "8:pids:/\n6:freezer:/\n4:memory:/process_api/abc\n2:cpuacct:/\n1:cpu:/\n0::/\n"


class TestLayout:
    def test_hybrid_with_separate_cpu_and_cpuacct(self):
        layout = parse_layout(HYBRID_MOUNTINFO, HYBRID_CGROUP)
        assert layout.mode == "hybrid"
        assert layout.v1_parents("weenv") == {
            "memory": "/sys/fs/cgroup/memory/process_api/abc/weenv",
            "cpu": "/sys/fs/cgroup/cpu/weenv",
            "cpuacct": "/sys/fs/cgroup/cpuacct/weenv",
            "freezer": "/sys/fs/cgroup/freezer/weenv",
            "pids": "/sys/fs/cgroup/pids/weenv",
        }
        assert (layout.unified_mount, layout.unified_own) == ("/sys/fs/cgroup/unified", "/")

    def test_co_mounted_cpu_cpuacct_share_a_directory(self):
        mountinfo = (
            "32 30 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
            "34 30 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        )
        layout = parse_layout(mountinfo, "3:cpu,cpuacct:/user.slice\n2:memory:/user.slice\n")
        assert layout.mode == "legacy"
        parents = layout.v1_parents("w")
        assert parents["cpu"] == parents["cpuacct"] == "/sys/fs/cgroup/cpu,cpuacct/user.slice/w"

    def test_unified_inside_a_container(self):
        mountinfo = "40 39 0:33 /kubepods/pod1/ctr /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        layout = parse_layout(mountinfo, "0::/kubepods/pod1/ctr/daemon\n")
        assert (layout.mode, layout.unified_mount, layout.unified_own) == ("unified", "/sys/fs/cgroup", "/daemon")

    def test_escaped_mount_points(self):
        mountinfo = r"34 30 0:30 / /mnt/cg\040memory rw - cgroup cgroup rw,memory" + "\n"
        assert parse_layout(mountinfo, "2:memory:/\n").v1_mounts == {"memory": "/mnt/cg memory"}

    def test_no_cgroups(self):
        assert parse_layout("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n", "").mode == "none"


def test_host_detection_agrees_with_proc():
    layout = parse_layout(open("/proc/self/mountinfo").read(), open("/proc/self/cgroup").read())
    with open("/proc/self/mounts") as f:
        fstypes = {line.split()[2] for line in f}
    assert (layout.mode in ("legacy", "hybrid")) == ("cgroup" in fstypes and "memory" in layout.v1_mounts)
    print(f"this host: {layout.mode}; python {sys.version.split()[0]}")
