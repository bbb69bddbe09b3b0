"""The env manager's parts on their own, over fakes (weenv/provision/envs/_pool.py, _ttl.py): the warm
pool's hand-out, refill, eviction and drain; TTL expiry on monotonic time. The manager over real
parts is tests/test_daemon.py (warm pool, TTL) and tests/test_snapshots.py."""

from __future__ import annotations

import itertools

import trio
import trio.testing

from weenv.plan import Lock
from weenv.provision.envs import EnvRecord
from weenv.provision.envs import _ttl
from weenv.provision.envs._pool import WarmPool, pool_key


def _lock(name: str = "x", ttl_s: float | None = None) -> Lock:
    return Lock(lock_version=1, name=name, ttl_s=ttl_s)


class FakeEnvs:
    """An env table whose ``start`` makes pooled records and whose ``kill`` drops them, both recorded."""

    def __init__(self) -> None:
        self.envs: dict[str, EnvRecord] = {}
        self.started: list[str] = []
        self.killed: list[str] = []
        self._ids = itertools.count(1)

    async def start(self, lock: Lock) -> EnvRecord:
        await trio.sleep(1)  # a start takes time: refills are one at a time
        rec = EnvRecord(id=f"{lock.name}-{next(self._ids)}", name=lock.name, status="pooled")
        self.envs[rec.id] = rec
        self.started.append(rec.id)
        return rec

    async def kill(self, env_id: str) -> None:
        self.envs.pop(env_id, None)
        self.killed.append(env_id)


def test_pool_key_ignores_the_ttl_only() -> None:
    assert pool_key(_lock(ttl_s=5)) == pool_key(_lock(ttl_s=None)) != pool_key(_lock("y"))


def test_the_pool_refills_in_the_background_and_hands_out_started_envs() -> None:
    fake = FakeEnvs()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            def spawn(fn, *args) -> bool:  # type: ignore[no-untyped-def]
                nursery.start_soon(fn, *args)
                return True

            pool = WarmPool(size=2, idle_s=60, envs=fake.envs, start=fake.start, kill=fake.kill, spawn=spawn)
            assert pool.take(_lock()) is None  # a miss starts the pool
            await trio.sleep(10)
            assert fake.started == ["x-1", "x-2"]  # filled to its size, no more
            rec = pool.take(_lock(ttl_s=30))  # an equal lock but for the TTL
            assert rec is not None and rec.id == "x-2" and rec.status == "running"
            await trio.sleep(10)
            assert fake.started == ["x-1", "x-2", "x-3"]  # refilled
            pool.forget("x-1")  # killed meanwhile: never handed out
            assert pool.take(_lock()).id == "x-3"  # type: ignore[union-attr]
            await trio.sleep(10)
            assert await pool.evict_one() is True
            assert await pool.drain() == [fake.started[-1]]
            assert fake.killed == [fake.started[-2], fake.started[-1]]
            assert await pool.evict_one() is False
            await trio.sleep(10)
            assert len(fake.started) == 5  # a drained pool does not refill
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_without_background_work_the_pool_stays_empty() -> None:
    fake = FakeEnvs()
    pool = WarmPool(size=2, idle_s=60, envs=fake.envs, start=fake.start, kill=fake.kill, spawn=lambda *a: False)
    assert pool.take(_lock()) is None
    assert pool.take(_lock()) is None
    assert fake.started == []


def test_the_janitor_drops_pools_nobody_asked_for() -> None:
    fake = FakeEnvs()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            def spawn(fn, *args) -> bool:  # type: ignore[no-untyped-def]
                nursery.start_soon(fn, *args)
                return True

            pool = WarmPool(size=1, idle_s=0.5, envs=fake.envs, start=fake.start, kill=fake.kill, spawn=spawn,
                            clock=trio.current_time)
            pool.take(_lock())
            await trio.sleep(2)
            assert fake.started == ["x-1"] and fake.killed == []
            nursery.start_soon(pool.janitor, 0.5, 0.1)
            await trio.sleep(1)
            assert fake.killed == ["x-1"]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_refill_under_way_when_the_pool_is_drained_kills_its_env_to_the_end_even_when_cancelled() -> None:
    """The daemon's stop drains the pools, waits for the refills (settle), then cancels its
    background work: a pooled env mid-start must not outlive that (its kill is shielded)."""
    fake = FakeEnvs()
    finished: list[str] = []

    async def slow_kill(env_id: str) -> None:
        await trio.sleep(1)  # a kill takes time: a cancel may land in the middle
        await fake.kill(env_id)
        finished.append(env_id)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            def spawn(fn, *args) -> bool:  # type: ignore[no-untyped-def]
                nursery.start_soon(fn, *args)
                return True

            pool = WarmPool(size=1, idle_s=60, envs=fake.envs, start=fake.start, kill=slow_kill, spawn=spawn,
                            refill_delay_s=0)
            pool.take(_lock())
            await trio.sleep(0.5)  # the refill's start (1 s) is under way
            assert await pool.drain() == [] and fake.started == []
            assert await pool.settle(0.1) is False  # still starting: settle says so, bounded
            await trio.sleep(0.6)  # its start is done; its kill (1 s) has begun
            assert fake.started == ["x-1"] and finished == []
            nursery.cancel_scope.cancel()  # what the daemon's stop does next
        assert finished == ["x-1"] and fake.envs == {}  # the kill ran to its end

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_settle_returns_once_the_refills_end() -> None:
    fake = FakeEnvs()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            def spawn(fn, *args) -> bool:  # type: ignore[no-untyped-def]
                nursery.start_soon(fn, *args)
                return True

            pool = WarmPool(size=1, idle_s=60, envs=fake.envs, start=fake.start, kill=fake.kill, spawn=spawn,
                            refill_delay_s=0)
            pool.take(_lock())
            await trio.sleep(0.5)
            await pool.drain()
            t0 = trio.current_time()
            assert await pool.settle(60) is True
            assert trio.current_time() - t0 < 2 and fake.killed == ["x-1"] and fake.envs == {}

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_ttls_kill_on_monotonic_time_not_the_wall_clock(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    envs = {i: EnvRecord(id=i, name=i, status=s) for i, s in
            (("short", "running"), ("paused", "paused"), ("long", "running"), ("pooled", "pooled"), ("none", "running"))}
    killed: list[str] = []

    async def kill(env_id: str) -> None:
        killed.append(env_id)
        envs.pop(env_id)

    ttls = _ttl.Ttls(envs=envs, kill=kill)  # type: ignore[arg-type]
    for env_id, ttl_s in (("short", 0.0), ("paused", 0.0), ("long", 3600.0), ("pooled", 0.0)):
        ttls.expire_in(envs[env_id], ttl_s)
    assert envs["long"].expires_s is not None and envs["none"].expires_s is None
    real_time = _ttl.time.time
    monkeypatch.setattr(_ttl.time, "time", lambda: real_time() + 7200)  # the wall clock jumps 2 h ahead

    async def main() -> None:
        with trio.move_on_after(0.5):
            await ttls.run(interval_s=0.05)

    trio.run(main)
    assert sorted(killed) == ["paused", "short"]  # "long" still has its hour; pooled envs have no TTL yet
    ttls.expire_in(envs["long"], None)
    assert envs["long"].expires_s is None


# -- the state file's two slots (envs/_state.py) ---------------------------------------------------


def test_saves_alternate_slots_and_load_takes_the_newest(tmp_path) -> None:
    from weenv.provision.envs import _state

    envs = str(tmp_path)
    rec = EnvRecord(id="e1", name="e")
    for status in ("creating", "running", "paused"):
        rec.status = status  # type: ignore[assignment]
        _state.save(envs, rec)
    d = tmp_path / "e1"
    assert sorted(p.name for p in d.iterdir()) == ["state.a", "state.b"]
    back = _state.load(envs, "e1")
    assert back is not None and (back.status, back.state_seq) == ("paused", 3)
    _state.save(envs, back)  # a record read back goes on from its number: the older slot is overwritten
    assert _state.load(envs, "e1").state_seq == 4  # type: ignore[union-attr]


def test_a_save_cut_short_leaves_the_one_before_it(tmp_path) -> None:
    from weenv.provision.envs import _state

    envs = str(tmp_path)
    rec = EnvRecord(id="e1", name="e", status="running")
    _state.save(envs, rec)  # seq 1 → state.b
    rec.status = "paused"
    _state.save(envs, rec)  # seq 2 → state.a
    newest = tmp_path / "e1" / "state.a"
    data = newest.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 5, 0):
        newest.write_bytes(data[:cut])  # a crash mid-write
        back = _state.load(envs, "e1")
        assert back is not None and (back.status, back.state_seq) == ("running", 1), cut
    newest.write_bytes(data[:-3] + b"  }")  # as long, other bytes: the CRC tells
    assert _state.load(envs, "e1").status == "running"  # type: ignore[union-attr]
    (tmp_path / "e1" / "state.b").write_bytes(b"")
    assert _state.load(envs, "e1") is None  # nothing valid: as a missing record


def test_a_legacy_state_json_is_read_and_removed_by_the_next_save(tmp_path) -> None:
    import msgspec

    from weenv.provision.envs import _state

    d = tmp_path / "e1"
    d.mkdir()
    (d / "state.json").write_bytes(msgspec.json.encode(EnvRecord(id="e1", name="e", status="running")))
    back = _state.load(str(tmp_path), "e1")
    assert back is not None and back.status == "running" and back.state_seq == 0
    back.status = "paused"
    _state.save(str(tmp_path), back)
    assert not (d / "state.json").exists()
    assert _state.load(str(tmp_path), "e1").status == "paused"  # type: ignore[union-attr]


def test_a_plan_text_seen_lately_is_not_parsed_again_and_a_bad_one_is_not_kept(monkeypatch) -> None:
    import pytest

    from weenv.plan import PlanError
    from weenv.provision.server import _routes

    calls = []
    real = _routes.load_any
    monkeypatch.setattr(_routes, "load_any", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    _routes._plan_text_cached.cache_clear()
    text = 'name = "p"\n\n[[groups]]\nname = "os"\nref = "busybox:test"\nclass = "os"\n'
    first = _routes._plan_text(text, None, "body")
    assert _routes._plan_text(text, None, "body") is first and len(calls) == 1
    for _ in range(2):
        with pytest.raises(PlanError):
            _routes._plan_text('name = "p"\nbogus = 1\n', None, "body")
    assert len(calls) == 3  # errors are parsed (and reported) every time
    big = text + "#" * (_routes._PLAN_CACHE_MAX_TEXT + 1) + "\n"
    _routes._plan_text(big, None, "body")
    _routes._plan_text(big, None, "body")
    assert len(calls) == 5  # too big to keep


def test_clients_on_the_daemon_socket_load_the_ca_bundle_once_per_process(monkeypatch) -> None:
    """Every httpx client and transport loaded certifi's CAs for itself (~35-75 ms each), a
    Unix-socket client too: weenv's clients and stores share one context (weenv/_tls.py)."""
    import ssl

    from weenv import _tls
    from weenv._connection import AsyncConnection, Connection
    from weenv.registry._remote import RemoteStore

    loads = []
    real = ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", lambda self, *a, **kw: loads.append(a) or real(self, *a, **kw))
    _tls.default_tls_context.cache_clear()
    made = [Connection("/tmp/weenv-test-no.sock", autostart=False) for _ in range(3)]
    made += [AsyncConnection("/tmp/weenv-test-no.sock", autostart=False) for _ in range(3)]
    stores = [RemoteStore("127.0.0.1:5000") for _ in range(2)]
    assert len(loads) == 1, loads
    for c in made[:3]:
        c.close()
    for s in stores:
        s.close()
