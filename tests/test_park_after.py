"""Park after N seconds paused (docs/snapshots.md, "Park after N seconds paused"), on real runsc
through the real daemon: a frozen gVisor env is parked once it stayed paused N s (its memory
freed) and resumes with its processes; a resume before N s just thaws; crun envs stay frozen and
say why; the daemon's ``--park-after`` applies to every freeze and its deadline survives a daemon
restart; a park that fails leaves the env frozen with the error recorded; bad input gets a clear
error. The deadline bookkeeping itself is unit-tested on a fake clock."""

from __future__ import annotations

import math
import os
import time

import pytest

import weenv
from tests.test_elastic_daemon import prometheus
from tests.test_gvisor import _gvisor_lock
from tests.test_memory_snapshots import (cgroup_memory_bytes, cgroup_procs, fill_shm, gvisor_platform,  # noqa: F401
                                         pids, read_counter, start_counter)
from weenv.testing import wait_for


def ps_status(daemon, env_id: str) -> str:
    """The STATUS column of ``weenv ps``'s table for the env, over the session daemon's list."""
    from rich.console import Console

    from weenv.cli._env import ps_table

    with daemon.client() as c:
        envs = c.list()
    with open(os.devnull, "w") as sink:
        console = Console(width=250, record=True, file=sink)
        console.print(ps_table(envs, time.time()))
    row = next(line for line in console.export_text().splitlines() if line.strip().startswith(env_id))
    return row.strip()[len(env_id):].strip().split("  ")[0]


@pytest.mark.usefixtures("gvisor_platform")
def test_a_freeze_with_park_after_is_parked_once_it_stayed_paused(daemon, tmp_path):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock, ttl_s=600) as env:
        pid = start_counter(env)
        fill_shm(env)
        time.sleep(0.2)
        before = read_counter(env, pid)
        t0 = time.time()
        env.pause(park_after_s=4)  # long enough that a loaded machine still sees it frozen first
        info = c.get(env.id).info
        assert (info["status"], info["parked"], info["not_parked_because"]) == ("paused", False, ""), info
        assert t0 + 3.9 < info["park_at_s"] < time.time() + 4.1, info  # the info says when
        frozen = cgroup_memory_bytes(env.id)
        assert cgroup_procs(env.id) != []  # frozen, not parked yet
        samples = prometheus(c)
        assert (samples[("weenv_envs_frozen", ())], samples[("weenv_envs_park_pending", ())],
                samples[("weenv_envs_parked", ())]) == (1, 1, 0), samples
        assert ps_status(daemon, env.id).startswith("paused, parks in ")
        assert wait_for(lambda: c.get(env.id).info["parked"], timeout_s=18), c.get(env.id).info
        parked_after = time.time() - t0
        info = c.get(env.id).info
        assert (info["status"], info["park_at_s"], info["init_pid"]) == ("paused", None, 0), info
        assert cgroup_procs(env.id) == []
        freed = cgroup_memory_bytes(env.id)
        samples = prometheus(c)
        image_bytes = samples[("weenv_envs_parked_image_bytes", ())]
        assert (samples[("weenv_envs_frozen", ())], samples[("weenv_envs_parked", ())]) == (0, 1), samples
        assert image_bytes > 40 << 20, samples  # the 48 MiB of random bytes, on disk now
        assert ps_status(daemon, env.id) == "parked"
        print(f"parked {parked_after:.2f} s after the pause (asked 4 s; park {info['timings_ms'].get('park')} ms); "
              f"cgroup memory frozen {frozen >> 20} MiB, parked {freed >> 20} MiB; image {int(image_bytes) >> 20} MiB")
        assert 3.9 < parked_after < 18
        assert freed < frozen / 2, (frozen, freed)
        t1 = time.perf_counter()
        env.resume()  # transparently restored
        print(f"resume of the parked env {1000 * (time.perf_counter() - t1):.0f} ms")
        assert pid in pids(env) and read_counter(env, pid) >= before
        assert not os.path.exists(os.path.join(daemon.home, "envs", env.id, "memory"))


@pytest.mark.usefixtures("gvisor_platform")
def test_a_resume_before_the_deadline_just_thaws(daemon, tmp_path):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        pid = start_counter(env)
        env.pause(park_after_s=2)
        assert c.get(env.id).info["park_at_s"] is not None
        t0 = time.perf_counter()
        env.resume()
        print(f"thaw before the deadline {1000 * (time.perf_counter() - t0):.0f} ms")
        info = c.get(env.id).info
        assert (info["status"], info["parked"], info["park_at_s"]) == ("running", False, None), info
        time.sleep(2.5)  # past the old deadline: a running env is never parked
        assert c.get(env.id).info["parked"] is False
        env.pause()  # a freeze that asks nothing, on a daemon without --park-after: frozen for good
        assert c.get(env.id).info["park_at_s"] is None
        env.resume()
        env.pause(park_after_s=1)  # a pause, a resume and a new pause: only the new deadline counts
        env.resume()
        env.pause(park_after_s=30)
        time.sleep(1.5)
        assert c.get(env.id).info["parked"] is False
        env.resume()
        assert pid in pids(env) and read_counter(env, pid) > 0


def test_crun_envs_stay_frozen_and_say_why(daemon, tmp_path):
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        env.exec(["sh", "-c", "echo kept > /root/f"])
        env.pause(park_after_s=0.5)
        info = c.get(env.id).info
        assert (info["status"], info["parked"], info["park_at_s"]) == ("paused", False, None), info
        why = info["not_parked_because"]
        print(why)
        assert "frozen" in why and "runtime crun" in why and "gVisor" in why, why
        assert ps_status(daemon, env.id) == "paused, frozen"
        time.sleep(1.0)
        assert c.get(env.id).info["parked"] is False
        env.resume()
        info = c.get(env.id).info
        assert (info["status"], info["not_parked_because"]) == ("running", ""), info
        assert env.exec(["cat", "/root/f"]).stdout == b"kept\n"


def test_the_async_client_pauses_with_park_after_as_the_sync_one(daemon):
    import trio

    async def main() -> None:
        async with daemon.async_client() as c:
            async with c.create(daemon.plan_lock) as env:
                await env.pause(park_after_s=5)
                info = (await c.get(env.id)).info
                assert info.status == "paused" and "runtime crun" in info.not_parked_because, info
                assert info.park_at_s is None and not info.parked
                await env.resume()
                with pytest.raises(ValueError, match="park_after_s"):
                    await env.pause(memory=False, park_after_s=1)

    trio.run(main)


@pytest.mark.usefixtures("gvisor_platform")
def test_a_park_that_fails_leaves_the_env_frozen_with_the_error(daemon, tmp_path):
    lock = _gvisor_lock(daemon, tmp_path)
    with daemon.client() as c, c.create(lock) as env:
        pid = start_counter(env)
        before = read_counter(env, pid)
        blocker = os.path.join(daemon.home, "envs", env.id, "memory")
        with open(blocker, "w") as f:  # where the image goes: a file, so the park cannot make its directory
            f.write("in the way")
        try:
            env.pause(park_after_s=0.3)
            assert wait_for(lambda: c.get(env.id).info["not_parked_because"], timeout_s=10), c.get(env.id).info
            info = c.get(env.id).info
            print(info["not_parked_because"])
            assert (info["status"], info["parked"], info["park_at_s"]) == ("paused", False, None), info
            assert "park failed" in info["not_parked_because"] and "stays frozen" in info["not_parked_because"]
            assert f"env {env.id}: park after its pause failed" in daemon.log()
            assert ps_status(daemon, env.id) == "paused, park failed"
            assert cgroup_procs(env.id) != []  # the sandbox is there, frozen
            with pytest.raises(weenv.ApiError, match="paused"):
                env.exec(["true"])
        finally:
            os.unlink(blocker)
        env.resume()
        assert pid in pids(env) and read_counter(env, pid) >= before  # nothing was lost


@pytest.mark.usefixtures("gvisor_platform")
def test_the_daemons_park_after_parks_every_freeze_across_a_restart(daemon, tmp_path):
    """``weenv daemon --park-after`` ($WEENV_PARK_AFTER_S): every freezer pause of a gVisor env is
    parked once it stayed paused that long; a pause may say never (inf); the recorded deadline
    is kept by a daemon killed and started again."""
    lock = _gvisor_lock(daemon, tmp_path)
    os.environ["WEENV_PARK_AFTER_S"] = "3"
    try:
        daemon.kill9()
        daemon.start()
        with daemon.client() as c:
            env, kept = c.create(lock), c.create(lock)
            pid = start_counter(env)
            asked = time.time()
            env.pause()  # the daemon's policy
            answered = time.time()
            kept.pause(park_after_s=math.inf)  # never, whatever the daemon says
            park_at = c.get(env.id).info["park_at_s"]
            # 3 s from the pause (not from now: a loaded machine may take a second to answer)
            assert park_at is not None and asked + 3 - 0.01 <= park_at <= answered + 3 + 0.01, c.get(env.id).info
            assert c.get(kept.id).info["park_at_s"] is None
        daemon.kill9()  # the deadline is in the env's record
        daemon.start()
        with daemon.client() as c:
            info = c.get(env.id).info
            assert (info["status"], info["parked"], info["park_at_s"]) == ("paused", False, park_at), info
            assert wait_for(lambda: c.get(env.id).info["parked"], timeout_s=20), c.get(env.id).info
            print(f"parked {time.time() - park_at:+.2f} s from its recorded deadline, after a daemon restart")
            assert time.time() >= park_at
            assert c.get(kept.id).info["parked"] is False
            c.get(env.id).resume()
            assert pid in pids(c.get(env.id)) and read_counter(c.get(env.id), pid) > 0
            c.get(kept.id).resume()
            for e in (env, kept):
                c.get(e.id).kill()
    finally:
        del os.environ["WEENV_PARK_AFTER_S"]
        daemon.kill9()
        daemon.start()


def test_bad_park_after_input_gets_a_clear_error(daemon, tmp_path):
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        for bad in (dict(park_after_s=-1), dict(park_after_s=float("nan")), dict(memory=False, park_after_s=1),
                    dict(memory="park", park_after_s=1)):
            with pytest.raises(ValueError, match="park_after_s"):
                env.pause(**bad)
        for query, said in (({"park_after_s": "soon"}, "not a number of seconds"),
                            ({"park_after_s": "-2"}, "not a number of seconds"),
                            ({"memory": "false", "park_after_s": "1"}, "only with a freezer pause")):
            with pytest.raises(weenv.ApiError, match=said) as refused:
                c._run(weenv._calls.Call("env_pause", weenv._calls.env(env.id), query=query))
            assert refused.value.status == 400, refused.value
        assert c.get(env.id).info["status"] == "running"  # nothing was changed


def test_the_deadlines_on_a_fake_clock(monkeypatch):
    from weenv.provision.envs._parking import Parking, park_after, still_due
    from weenv.provision.envs._state import EnvRecord

    wall, mono = [1000.0], [50.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    monkeypatch.setattr(time, "monotonic", lambda: mono[0])
    assert (park_after(None, None), park_after(None, 30), park_after(5, 30), park_after(math.inf, 30)) == (
        None, 30, 5, None)
    with pytest.raises(ValueError):
        park_after(-1, None)
    a, b = EnvRecord(id="a", name="a", status="paused"), EnvRecord(id="b", name="b", status="paused")
    envs = {"a": a, "b": b}
    p = Parking(envs=envs, park=None, save=None, default_s=None)  # type: ignore[arg-type]
    p.park_in(a, 10)
    assert a.park_at_s == 1010 and p.due_now() == []
    b.park_at_s = 1005  # a re-adopted env's recorded deadline: turned monotonic when first seen
    assert p.due_now() == []
    wall[0] += 3600  # the wall clock jumps: nothing is due early or late for it
    assert p.due_now() == []
    mono[0] += 5
    assert p.due_now() == [("b", 1005)]
    mono[0] += 5
    assert p.due_now() == [("a", 1010), ("b", 1005)]
    assert still_due(a, 1010) and not still_due(a, 1011)
    a.status = "running"
    assert not still_due(a, 1010) and p.due_now() == [("b", 1005)]
    b.cold = True  # parked (or paused without memory): nothing to park
    assert p.due_now() == []
    del envs["b"]
    p.park_in(a, None)
    assert a.park_at_s is None and p.due_now() == []


def test_ps_says_parked_when_it_will_be_and_why_not():
    from weenv.cli._env import status_text

    now = 1000.0
    paused = {"status": "paused", "parked": False, "park_at_s": None, "not_parked_because": ""}
    assert [status_text({**paused, **change}, now) for change in (
        {"status": "running"}, {}, {"parked": True}, {"park_at_s": 1012.4}, {"park_at_s": 990.0},
        {"not_parked_because": "stays frozen while paused: runtime crun: ..."},
        {"not_parked_because": "its park failed (it stays frozen): ..."})] == [
        "running", "paused", "parked", "paused, parks in 12s", "paused, parks in 0s", "paused, frozen",
        "paused, park failed"]
