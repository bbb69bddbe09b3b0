"""The unmodified E2B SDK (async, on asyncio) against ``weenv serve``: the streamed calls
(``watch_dir`` is a Connect server stream here, where the sync SDK polls) and the same lifecycle."""

from __future__ import annotations

import asyncio

import pytest

from .fixtures_api import Served, served, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


def test_async_sandbox_lifecycle_and_files(served: Served) -> None:
    async def main() -> None:
        sbx = await e2b.AsyncSandbox.create("bb", metadata={"who": "async"}, timeout=120)
        try:
            info = await sbx.get_info()
            assert info.metadata == {"who": "async"}
            await sbx.files.write("/tmp/a.txt", "async hello")
            assert await sbx.files.read("/tmp/a.txt") == "async hello"
            assert await sbx.files.make_dir("/tmp/d") is True
            assert await sbx.files.make_dir("/tmp/d") is False
            assert await sbx.files.exists("/tmp/a.txt")
            await sbx.files.rename("/tmp/a.txt", "/tmp/d/b.txt")
            assert [e.name for e in await sbx.files.list("/tmp/d")] == ["b.txt"]
            assert (await sbx.files.get_info("/tmp/d/b.txt")).size == len("async hello")
            await sbx.files.remove("/tmp/d/b.txt")
            assert not await sbx.files.exists("/tmp/d/b.txt")

            events: list = []
            seen = asyncio.Event()

            def on_event(ev) -> None:  # type: ignore[no-untyped-def]
                events.append(ev)
                if ev.name == "w.txt":
                    seen.set()

            handle = await sbx.files.watch_dir("/tmp/d", on_event, timeout=30)
            try:
                await sbx.files.write("/tmp/d/w.txt", "x")
                await asyncio.wait_for(seen.wait(), 10)
            finally:
                await handle.stop()
            assert any(ev.type == e2b.FilesystemEventType.CREATE for ev in events)

            out = await sbx.commands.run("echo async; exit 0")
            assert out.stdout == "async\n"
            with pytest.raises(e2b.CommandExitException) as err:
                await sbx.commands.run("exit 4")
            assert err.value.exit_code == 4

            await sbx.set_timeout(600)
            assert await sbx.pause() is True
            again = await e2b.AsyncSandbox.connect(sbx.sandbox_id)
            assert (await again.get_info()).state.value == "running"
            assert await again.files.exists("/tmp/d")

            children = await sbx.fork(count=2)
            assert all(not isinstance(c, Exception) for c in children)
            for child in children:
                assert await child.files.exists("/tmp/d")
                await child.kill()
            snap = await sbx.create_snapshot()
            other = await e2b.AsyncSandbox.create(snap.snapshot_id, timeout=60)
            assert await other.files.exists("/tmp/d")
            await other.kill()
            found = await e2b.AsyncSandbox.list(query=e2b.SandboxQuery(metadata={"who": "async"})).next_items()
            assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
        finally:
            await sbx.kill()
        with pytest.raises(e2b.NotFoundException):
            await e2b.AsyncSandbox.get_info(sbx.sandbox_id)

    asyncio.run(main())


def test_concurrent_creates(served: Served) -> None:
    """Eight sandboxes at once through one server: each its own env, token and owner record."""
    import os

    from weenv.api import OwnerTable

    async def one(i: int) -> tuple[str, str]:
        sbx = await e2b.AsyncSandbox.create("bb", metadata={"i": str(i)}, timeout=60)
        try:
            out = await sbx.commands.run(f"echo {i}")
            return sbx.sandbox_id, out.stdout
        finally:
            await sbx.kill()

    async def main() -> list[tuple[str, str]]:
        return list(await asyncio.gather(*(one(i) for i in range(8))))

    results = asyncio.run(main())
    assert [out for _, out in results] == [f"{i}\n" for i in range(8)]
    assert len({sid for sid, _ in results}) == 8
    owners = OwnerTable(os.path.join(served.home, "api"))
    assert not {sid for sid, _ in results} & set(owners.envs())  # killed: forgotten


def test_async_commands_on_process_handles(served: Served) -> None:
    """background + kill, stdin (one call and a stream), connect, list, envs/cwd/user/timeout,
    a non-zero exit, and a pty, through the async SDK."""
    from e2b.sandbox.commands.command_handle import PtySize

    async def main() -> None:
        sbx = await e2b.AsyncSandbox.create("bb", timeout=120)
        try:
            out = await sbx.commands.run("echo $X; pwd; id -u", envs={"X": "y"}, cwd="/tmp", user="user")
            assert out.stdout == "y\n/tmp\n1000\n"
            with pytest.raises(e2b.CommandExitException) as err:
                await sbx.commands.run("echo oops >&2; exit 7")
            assert err.value.exit_code == 7 and err.value.stderr == "oops\n"
            with pytest.raises(e2b.TimeoutException):
                await sbx.commands.run("sleep 30", timeout=1)

            h = await sbx.commands.run("sleep 1; echo later; sleep 60", background=True)
            assert h.pid in {p.pid for p in await sbx.commands.list()}
            await h.disconnect()
            await asyncio.sleep(1.5)
            again = await sbx.commands.connect(h.pid)
            assert await sbx.commands.kill(h.pid) is True
            with pytest.raises(e2b.CommandExitException) as err:
                await again.wait()
            assert err.value.stdout == "later\n" and err.value.exit_code == -1
            assert await sbx.commands.kill(h.pid) is False

            cat = await sbx.commands.run("cat", background=True, stdin=True)
            await sbx.commands.send_stdin(cat.pid, "a\n")
            async with sbx.commands.stream_input(cat.pid) as inp:  # a client stream, fed as it goes
                await inp.send("b\n")
                await inp.send(b"c\n")
            await sbx.commands.close_stdin(cat.pid)
            assert (await cat.wait()).stdout == "a\nb\nc\n"

            got = bytearray()
            term = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=got.extend)
            await sbx.pty.send_stdin(term.pid, b"stty size\n")
            for _ in range(100):
                if b"24 80" in got:
                    break
                await asyncio.sleep(0.05)
            await sbx.pty.resize(term.pid, PtySize(rows=30, cols=90))
            await sbx.pty.send_stdin(term.pid, b"stty size; exit 0\n")
            await term.wait()
            assert b"24 80" in got and b"30 90" in got, bytes(got)
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_async_remove_connect_and_list_as_e2b(served: Served) -> None:
    """Issue 29 items 2, 8, 9 on the async SDK: a missing path's remove is silent, connect never
    shortens the time left, the list is newest first."""
    import datetime as dt

    async def left(sandbox_id: str) -> float:
        info = await e2b.AsyncSandbox.get_info(sandbox_id)
        return (info.end_at - dt.datetime.now(dt.timezone.utc)).total_seconds()

    async def main() -> None:
        older = await e2b.AsyncSandbox.create("bb", timeout=600, metadata={"list": "async9"})
        newer = await e2b.AsyncSandbox.create("bb", timeout=120, metadata={"list": "async9"})
        try:
            await older.files.remove("/tmp/not-there")
            await e2b.AsyncSandbox.connect(older.sandbox_id, timeout=30)
            assert await left(older.sandbox_id) > 500
            query = e2b.SandboxQuery(metadata={"list": "async9"})
            listed = await e2b.AsyncSandbox.list(query=query).next_items()
            assert [x.sandbox_id for x in listed] == [newer.sandbox_id, older.sandbox_id]
        finally:
            await older.kill()
            await newer.kill()

    asyncio.run(main())
