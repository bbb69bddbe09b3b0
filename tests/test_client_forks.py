"""The Python client on a real daemon (issue 14, items 9 and 10): ``async with client.create(...)``
under trio, forks that die with their parent's ``with`` block unless kept, fork snapshots that
``gc`` collects once no env uses them."""

from __future__ import annotations

import pytest
import trio

import weenv

pytestmark = pytest.mark.integration


def live_ids(daemon) -> set[str]:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        return {e["id"] for e in c.list()}


def snapshot_ids(daemon) -> set[str]:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        return {s["id"] for s in c.snapshots()}


def test_async_create_is_an_async_context_manager_under_trio(daemon) -> None:  # type: ignore[no-untyped-def]
    async def main() -> tuple[str, bytes, str]:
        async with daemon.async_client() as c:
            async with c.create(daemon.plan_lock) as env:
                assert isinstance(env, weenv.AsyncEnv)
                await env.write_file("/tmp/f", b"trio")
                data = await env.read_file("/tmp/f")
                inside = env.id
            other = await c.create(daemon.plan_lock)  # still awaitable
            try:
                return inside, data, other.id
            finally:
                await other.kill()

    env_id, data, other = trio.run(main)
    assert data == b"trio" and env_id not in live_ids(daemon) and other not in live_ids(daemon)


def test_async_forks_die_with_the_parent_unless_kept(daemon) -> None:  # type: ignore[no-untyped-def]
    async def main() -> tuple[set[str], set[str]]:
        async with daemon.async_client() as c:
            async with c.create(daemon.plan_lock) as parent:
                await parent.exec(["sh", "-c", "echo s > /state"])
                gone = await parent.fork(2)
                kept = await parent.fork(1, keep=True)
                grandchildren = await gone[0].fork(1)  # a fork of a fork goes with it
                assert [(await k.exec(["cat", "/state"])).stdout for k in gone + kept] == [b"s\n"] * 3
            return {e.id for e in gone + grandchildren}, {e.id for e in kept}

    gone, kept = trio.run(main)
    live = live_ids(daemon)
    assert not gone & live and kept <= live
    with daemon.client() as c:
        for env_id in kept:
            c.get(env_id).kill()


def test_sync_forks_die_with_the_parent_and_gc_collects_their_snapshot(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        before = snapshot_ids(daemon)
        with c.create(daemon.plan_lock) as parent:
            parent.exec(["sh", "-c", "echo s > /state"])
            gone = parent.fork(2)
            kept = parent.fork(1, keep=True)[0]
            committed = parent.commit()  # asked for: gc keeps it
            assert all(k.exec(["cat", "/state"]).stdout == b"s\n" for k in [*gone, kept])
        live = live_ids(daemon)
        assert parent.id not in live and not {k.id for k in gone} & live and kept.id in live
        gone_snap, kept_snap = gone[0].info["snapshot"], kept.info["snapshot"]
        assert {gone_snap, kept_snap, committed} <= snapshot_ids(daemon) - before
        out = c.gc()
        assert out["snapshots"] == [gone_snap]  # the kept child still runs from its snapshot
        assert snapshot_ids(daemon) - before == {kept_snap, committed}
        with pytest.raises(weenv.ApiError):
            c.create(gone_snap)
        kept.kill()
        assert c.gc()["snapshots"] == [kept_snap]
        assert c.gc()["snapshots"] == []
        assert snapshot_ids(daemon) - before == {committed}
        c.delete_snapshot(committed)


def test_an_unawaited_async_create_says_what_to_write(tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = weenv.AsyncClient(str(tmp_path / "none.sock"), autostart=False)
    start = c.create({"name": "x"})
    with pytest.raises(AttributeError, match=r"env = await client.create\(...\)"):
        start.exec  # noqa: B018
    start._coro.close()  # never awaited, on purpose


def test_the_quickstart_async_example_runs(daemon) -> None:  # type: ignore[no-untyped-def]
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "quickstart.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "async def rollout" in b)
    code = code.replace('"task-123.lock.toml"', repr(daemon.plan_lock)).replace(
        "weenv.AsyncClient()", f"weenv.AsyncClient({daemon.socket!r}, autostart=False)")
    code = code.replace("print(trio.run(rollout, 4))", "RESULT = trio.run(rollout, 4)")
    scope: dict = {}
    exec(compile(code, "quickstart.md", "exec"), scope)
    assert scope["RESULT"] == [127] * 4  # busybox has no pytest: each child ran the command
    assert live_ids(daemon) == set()
