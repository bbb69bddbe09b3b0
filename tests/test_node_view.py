"""What the monitor takes the node to be: admissions still starting count against the room, and a
memory limit on the daemon's own cgroup is the node's RAM, with inactive page cache available."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from weenv.provision.elastic._monitor import Monitor
from weenv.provision.elastic._policy import EnvLimits
from weenv.testing import FakeBackend

from .fixtures_cgroups import require_v1_host

MIB = 1 << 20
GIB = 1 << 30
BIG = EnvLimits(memory_min_bytes=1 * GIB, memory_max_bytes=2 * GIB)


def test_admitted_envs_count_before_they_are_added():
    backend = FakeBackend(memory_total_bytes=4 * GIB)
    monitor = Monitor(backend.node_memory, offload="none")
    # 3 GiB of mins fit in 4 GiB minus the 512 MiB reserve, a fourth does not, even though none
    # of the three has been added yet (concurrent creates, all still starting).
    assert monitor.admit(BIG) and monitor.admit(BIG) and monitor.admit(BIG)
    refused = monitor.admit(BIG)
    assert not refused and "3 envs" in refused.reason
    # add() takes an admission over; a failed start gives it back.
    monitor.add("a", backend.create("a"), BIG)
    assert not monitor.admit(BIG)
    assert monitor.cancel_admission(BIG)
    assert monitor.admit(BIG)
    stats = monitor.statistics()
    assert (stats.admitted, stats.admission_refusals) == (4, 2)


def test_lapsed_admissions_stop_counting(monkeypatch):
    backend = FakeBackend(memory_total_bytes=4 * GIB)
    monitor = Monitor(backend.node_memory, offload="none")
    for _ in range(3):
        assert monitor.admit(BIG)
    assert not monitor.admit(BIG)
    monkeypatch.setattr(Monitor, "PENDING_ADMISSION_S", -1.0)  # every pending one has lapsed
    assert monitor.admit(BIG)


def test_admission_sees_the_quotas_granted_since_the_last_tick():
    backend = FakeBackend(memory_total_bytes=4 * GIB)
    monitor = Monitor(backend.node_memory, offload="none")
    small = EnvLimits(memory_min_bytes=1 * GIB, memory_max_bytes=1 * GIB)
    monitor.add("a", backend.create("a"), small)
    monitor.add("b", backend.create("b"), small)
    # No tick has run: the node view must still count a's and b's 2 GiB as promised.
    view = monitor.node_view()
    assert view.memory_promised_bytes == 2 * GIB
    assert monitor.admit(small) and not monitor.admit(small)


CHILD = r"""
import json, os, subprocess, sys
from weenv.provision.cgroups import detect_backend
b = detect_backend(sys.argv[1])
out = {"before": b.node_memory()}
with open(sys.argv[2], "wb") as f:  # 256 MiB of page cache, charged to this cgroup
    for _ in range(256):
        f.write(b"x" * (1 << 20))
    f.flush()
    os.fsync(f.fileno())
out["cache"] = b.node_memory()
p = subprocess.Popen([sys.argv[3], "alloc", "256", "1500"], stdout=subprocess.PIPE)
import time; time.sleep(1.0)
out["anon"] = b.node_memory()
p.wait()
b.remove_parent()
print(json.dumps(out))
"""


@pytest.mark.integration
def test_a_memory_limit_on_the_daemons_cgroup_is_the_node(tmp_path):
    require_v1_host()
    from weenv.testing import rollout_binary

    with open("/proc/self/cgroup") as f:
        own = next(line.split(":", 2)[2].strip() for line in f if ":memory:" in line).rstrip("/")
    node = f"/sys/fs/cgroup/memory{own}/weenv-test-node-{os.getpid()}"
    os.mkdir(node)
    try:
        with open(f"{node}/memory.limit_in_bytes", "w") as f:
            f.write(str(1 * GIB))

        def join() -> None:
            with open(f"{node}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

        r = subprocess.run([sys.executable, "-c", CHILD, f"weenv-test-nv-{os.getpid()}", str(tmp_path / "cache"),
                            str(rollout_binary())], preexec_fn=join, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
    finally:
        os.rmdir(node)
    (total, before), (_, cache), (_, anon) = out["before"], out["cache"], out["anon"]
    assert total == 1 * GIB and before <= total
    # Written-once page cache sits on the inactive list: the kernel reclaims it first, so it is
    # still available; 256 MiB of anonymous memory is not.
    assert cache >= before - 64 * MIB, (before, cache)
    assert anon <= cache - 200 * MIB, (cache, anon)
