"""The unmodified E2B SDK (sync), pointed at ``weenv serve`` in front of a real daemon and real crun envs."""

from __future__ import annotations

import pytest

from .fixtures_api import Served, served, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


def test_create_get_info_kill(served: Served) -> None:
    sbx = e2b.Sandbox.create("bb", metadata={"who": "sync"}, timeout=120)
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == "bb"
        assert info.metadata == {"who": "sync"}
        assert info.state.value == "running"
        assert sbx.is_running()
    finally:
        assert sbx.kill() is True
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.get_info(sbx.sandbox_id)


@pytest.fixture
def sbx(served: Served):  # type: ignore[no-untyped-def]
    s = e2b.Sandbox.create("bb", timeout=120)
    yield s
    s.kill()


def test_files(sbx) -> None:  # type: ignore[no-untyped-def]
    info = sbx.files.write("/tmp/w/a.txt", "hello")
    assert info.path == "/tmp/w/a.txt"
    assert sbx.files.read("/tmp/w/a.txt") == "hello"
    assert bytes(sbx.files.read("/tmp/w/a.txt", format="bytes")) == b"hello"
    sbx.files.write("/tmp/w/b.bin", b"\x00\x01" * 1000)
    assert bytes(sbx.files.read("/tmp/w/b.bin", format="bytes")) == b"\x00\x01" * 1000
    sbx.files.write_files([{"path": "/tmp/w/c1", "data": "1"}, {"path": "/tmp/w/c2", "data": b"2"}])
    assert sbx.files.read("/tmp/w/c2") == "2"
    names = sorted(e.name for e in sbx.files.list("/tmp/w"))
    assert names == ["a.txt", "b.bin", "c1", "c2"]
    assert sbx.files.make_dir("/tmp/w/d/e") is True
    assert sbx.files.make_dir("/tmp/w/d/e") is False
    deep = {e.path for e in sbx.files.list("/tmp/w", depth=2)}
    assert "/tmp/w/d/e" in deep
    assert sbx.files.exists("/tmp/w/a.txt")
    assert not sbx.files.exists("/tmp/w/nope")
    moved = sbx.files.rename("/tmp/w/a.txt", "/tmp/w/d/a2.txt")
    assert moved.path == "/tmp/w/d/a2.txt" and moved.size == 5
    assert not sbx.files.exists("/tmp/w/a.txt")
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.rename("/tmp/w/d/a2.txt", "/tmp/w/no-dir/a3.txt")
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.rename("/tmp/w/none", "/tmp/w/x")
    got = sbx.files.get_info("/tmp/w/d/a2.txt")
    assert got.type == e2b.FileType.FILE and got.size == 5 and got.owner == "root"
    assert got.permissions.startswith("-rw")
    assert sbx.files.get_info("/tmp/w/d").type == e2b.FileType.DIR
    sbx.files.remove("/tmp/w/d")
    assert not sbx.files.exists("/tmp/w/d/a2.txt")
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.read("/tmp/w/nope")
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.get_info("/tmp/w/nope")
    with pytest.raises(e2b.InvalidArgumentException, match="not a directory"):
        sbx.files.list("/tmp/w/c1")


def test_watch_dir_sees_a_write(sbx) -> None:  # type: ignore[no-untyped-def]
    sbx.files.make_dir("/tmp/watched")
    handle = sbx.files.watch_dir("/tmp/watched")
    try:
        sbx.files.write("/tmp/watched/new.txt", "x")
        events = handle.get_new_events()
        assert any(ev.name == "new.txt" and ev.type == e2b.FilesystemEventType.CREATE for ev in events), events
        assert handle.get_new_events() == []
        sbx.files.remove("/tmp/watched/new.txt")
        assert any(ev.type == e2b.FilesystemEventType.REMOVE for ev in handle.get_new_events())
    finally:
        handle.stop()


def test_set_timeout_and_metrics(sbx) -> None:  # type: ignore[no-untyped-def]
    import datetime as dt

    sbx.set_timeout(3600)
    end = sbx.get_info().end_at
    left = (end - dt.datetime.now(dt.timezone.utc)).total_seconds()
    assert 3500 < left <= 3600
    metrics = sbx.get_metrics()
    assert len(metrics) == 1 and metrics[0].cpu_count >= 1


def test_pause_connect_keeps_state(sbx) -> None:  # type: ignore[no-untyped-def]
    sbx.files.write("/tmp/state", "kept")
    assert sbx.pause() is True
    assert e2b.Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
    again = e2b.Sandbox.connect(sbx.sandbox_id)
    assert again.get_info().state.value == "running"
    assert again.files.read("/tmp/state") == "kept"


def test_fork_and_snapshot(sbx, served: Served) -> None:  # type: ignore[no-untyped-def]
    sbx.files.write("/tmp/marker", "parent")
    children = sbx.fork(count=2)
    try:
        assert len(children) == 2
        for child in children:
            assert not isinstance(child, Exception), child
            assert child.files.read("/tmp/marker") == "parent"
            child.files.write("/tmp/marker", child.sandbox_id)
        assert sbx.files.read("/tmp/marker") == "parent"
    finally:
        for child in children:
            if not isinstance(child, Exception):
                child.kill()
    snap = sbx.create_snapshot()
    assert snap.snapshot_id.startswith("snap-")
    listed = [s.snapshot_id for s in e2b.Sandbox.list_snapshots().next_items()]
    assert snap.snapshot_id in listed
    from_snap = e2b.Sandbox.create(snap.snapshot_id, timeout=60)
    try:
        assert from_snap.files.read("/tmp/marker") == "parent"
    finally:
        from_snap.kill()
    assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert e2b.Sandbox.delete_snapshot(snap.snapshot_id) is False
    named = sbx.create_snapshot(name="golden")
    assert named.names == ["golden"]
    golden = e2b.Sandbox.create("golden", timeout=60)  # a snapshot's name is a template of its owner's
    try:
        assert golden.files.read("/tmp/marker") == "parent"
        assert golden.get_info().template_id == "golden"
    finally:
        golden.kill()
    with pytest.raises(e2b.SandboxException, match="404"):
        e2b.Sandbox.create("golden", api_key=served.keys["bob"])
    with served.daemon.client() as c:  # deleted on the node: gone from the list too
        c.delete_snapshot(named.snapshot_id)
    assert named.snapshot_id not in [s.snapshot_id for s in e2b.Sandbox.list_snapshots().next_items()]


def test_list_with_metadata_filter(served: Served) -> None:
    a = e2b.Sandbox.create("bb", metadata={"job": "a"}, timeout=60)
    b = e2b.Sandbox.create("bb", metadata={"job": "b"}, timeout=60)
    try:
        found = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"job": "b"})).next_items()
        assert [s.sandbox_id for s in found] == [b.sandbox_id]
        everything = {s.sandbox_id for s in e2b.Sandbox.list().next_items()}
        assert {a.sandbox_id, b.sandbox_id} <= everything
        page = e2b.Sandbox.list(limit=1)
        first = page.next_items()
        assert len(first) == 1 and page.has_next
        assert len(page.next_items()) == 1
    finally:
        a.kill()
        b.kill()


def test_unknown_template_is_not_found(served: Served) -> None:
    with pytest.raises(e2b.SandboxException) as err:
        e2b.Sandbox.create("no-such-template")
    assert "404" in str(err.value) and "no-such-template" in str(err.value)


def test_commands_run_foreground(sbx) -> None:  # type: ignore[no-untyped-def]
    out = sbx.commands.run("echo hi; echo err >&2", envs={"X": "y"})
    assert out.exit_code == 0 and out.stdout == "hi\n" and out.stderr == "err\n"
    assert sbx.commands.run("echo $X", envs={"X": "y"}).stdout == "y\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    with pytest.raises(e2b.CommandExitException) as err:
        sbx.commands.run("echo out; exit 3")
    assert err.value.exit_code == 3 and err.value.stdout == "out\n"
    assert sbx.commands.run("id -u", user="user").stdout == "1000\n"
    sbx.files.write("/tmp/by-user", "u", user="user")
    assert sbx.files.get_info("/tmp/by-user").owner == "user"
    lines: list[str] = []
    sbx.commands.run("echo a; echo b", on_stdout=lines.append)
    assert "".join(lines) == "a\nb\n"
    import time

    t0 = time.monotonic()
    with pytest.raises(e2b.TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t0 < 10
    for _ in range(50):  # the command goes with its stream: the daemon kills what nobody waits for
        if "sleep 30" not in sbx.commands.run("ps -o args").stdout:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the timed-out command is still running")


def test_streamed_upload_and_download(sbx) -> None:  # type: ignore[no-untyped-def]
    import io

    data = bytes(range(256)) * 4096  # 1 MiB
    sbx.files.write("/tmp/big.bin", io.BytesIO(data))  # a file-like object goes octet-stream, streamed
    with sbx.files.read("/tmp/big.bin", format="stream") as stream:
        got = b"".join(stream)
    assert got == data
    assert sbx.files.get_info("/tmp/big.bin").size == len(data)


def test_timeout_expiry_kills(served: Served) -> None:
    import time

    s = e2b.Sandbox.create("bb", timeout=1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            e2b.Sandbox.get_info(s.sandbox_id)
        except e2b.NotFoundException:
            break
        time.sleep(0.2)
    else:
        s.kill()
        pytest.fail("a sandbox with timeout=1 was still there after 20 s")
    assert not s.is_running()
    assert s.sandbox_id not in {x.sandbox_id for x in e2b.Sandbox.list().next_items()}


def test_update_network_without_egress_says_why(sbx) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(e2b.SandboxException, match="no egress network"):
        sbx.update_network({"deny_out": ["10.0.0.0/8"]})


def test_timeout_pauses_with_lifecycle_pause(served: Served) -> None:
    import time

    s = e2b.Sandbox.create("bb", timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        s.files.write("/tmp/kept", "yes")
        assert e2b.Sandbox.get_info(s.sandbox_id).state.value == "running"
        deadline = time.monotonic() + 20
        while e2b.Sandbox.get_info(s.sandbox_id).state.value != "paused":
            assert time.monotonic() < deadline, "not paused 20 s after its timeout of 2 s"
            time.sleep(0.2)
        time.sleep(3)  # paused is where it stays: never killed for its timeout
        assert e2b.Sandbox.get_info(s.sandbox_id).state.value == "paused"
        again = e2b.Sandbox.connect(s.sandbox_id, timeout=60)
        assert again.files.read("/tmp/kept") == "yes"
        assert again.get_info().state.value == "running"
    finally:
        s.kill()


def test_background_command_kill_list_connect(sbx) -> None:  # type: ignore[no-untyped-def]
    import time

    handle = sbx.commands.run("sleep 0.3; echo later", background=True)
    result = handle.wait()
    assert result.exit_code == 0 and result.stdout == "later\n"
    h = sbx.commands.run("sleep 0.3; echo first; sleep 60", background=True)
    assert h.pid > 1
    h.disconnect()  # as envd: the command runs on without its stream
    listed = {p.pid: p for p in sbx.commands.list()}
    assert h.pid in listed and listed[h.pid].args[-1] == "sleep 0.3; echo first; sleep 60"
    time.sleep(1.5)  # it printed "first" 0.3 s in (1.2 s to spare on a loaded node)
    assert h.pid in {p.pid for p in sbx.commands.list()}
    again = sbx.commands.connect(h.pid)
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(e2b.CommandExitException) as err:
        again.wait()
    assert err.value.exit_code == -1 and "first" in err.value.stdout  # what nobody read while disconnected
    assert h.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(h.pid) is False  # gone: the SDK's "not found"
    assert sbx.commands.kill(999_999) is False


def test_connect_to_a_finished_command_is_not_found(sbx) -> None:  # type: ignore[no-untyped-def]
    """As envd, which forgets a process when it ends: the SDK's NotFoundException, not a replay."""
    h = sbx.commands.run("echo done", background=True)
    assert h.wait().stdout == "done\n"
    with pytest.raises(e2b.NotFoundException, match=str(h.pid)):
        sbx.commands.connect(h.pid)


def test_send_stdin_and_close(sbx) -> None:  # type: ignore[no-untyped-def]
    h = sbx.commands.run("read a; echo got:$a; cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "one\n")
    h.send_stdin("two\n")
    sbx.commands.close_stdin(h.pid)
    out = h.wait()
    assert out.stdout == "got:one\ntwo\n"
    plain = sbx.commands.run("sleep 30", background=True)  # stdin off: nothing to send to
    with pytest.raises(e2b.SandboxException):
        sbx.commands.send_stdin(plain.pid, "x")
    plain.kill()


def test_command_timeout_kills_it_without_its_stream(sbx) -> None:  # type: ignore[no-untyped-def]
    import time

    h = sbx.commands.run("sleep 30", background=True, timeout=1)
    h.disconnect()
    deadline = time.monotonic() + 10
    while h.pid in {p.pid for p in sbx.commands.list()}:
        assert time.monotonic() < deadline, "the command outlived its timeout by 9 s"
        time.sleep(0.1)


def test_pty(sbx) -> None:  # type: ignore[no-untyped-def]
    import time

    from e2b.sandbox.commands.command_handle import PtySize

    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(term.pid, b"stty size; echo $TERM; tty\n")
    got = bytearray()
    deadline = time.monotonic() + 10
    resized = False
    for _out, _err, pty in term:
        if pty is not None:
            got += pty
        if not resized and b"/dev/pts/" in got:  # the first line ran: now a new size, and the end
            sbx.pty.resize(term.pid, PtySize(rows=40, cols=100))
            sbx.pty.send_stdin(term.pid, b"stty size; exit 0\n")
            resized = True
        assert time.monotonic() < deadline
    text = got.decode(errors="replace")
    assert "24 80" in text and "40 100" in text and "xterm-256color" in text and "/dev/pts/" in text, text
    other = sbx.pty.create(PtySize(rows=10, cols=20))
    assert sbx.pty.kill(other.pid) is True
    with pytest.raises(e2b.CommandExitException):
        other.wait()


def test_slime_sandbox_pattern(sbx) -> None:  # type: ignore[no-untyped-def]
    """slime's E2B sandbox: a detached command writing a marker file, polled until it is there
    (exec_and_wait), then its output read back."""
    import time

    sbx.commands.run("(sleep 0.5; echo result > /tmp/out.txt; echo $? > /tmp/done.marker) >/dev/null 2>&1 &",
                     background=True).disconnect()
    deadline = time.monotonic() + 15
    while not sbx.files.exists("/tmp/done.marker"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert sbx.files.read("/tmp/done.marker").strip() == "0"
    assert sbx.commands.run("cat /tmp/out.txt").stdout == "result\n"


def test_silent_command_streams_carry_keepalives(sbx, served: Served) -> None:  # type: ignore[no-untyped-def]
    """As envd: a Start stream with nothing to say sends a keepalive event every
    Keepalive-Ping-Interval seconds (the SDK asks for 50; here 1)."""
    import json
    import struct

    import httpx

    msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 2.5; echo done"]}}).encode()
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
               "Content-Type": "application/connect+json", "Keepalive-Ping-Interval": "1"}
    r = httpx.post(served.url + "/process.Process/Start", content=struct.pack(">BI", 0, len(msg)) + msg,
                   headers=headers, timeout=20)
    body, events = r.content, []
    while body:
        flags, n = struct.unpack(">BI", body[:5])
        events.append((flags, json.loads(body[5 : 5 + n])))
        body = body[5 + n :]
    kinds = [next(iter(e["event"])) if "event" in e else "end-of-stream" for _, e in events]
    assert kinds[0] == "start" and kinds[-2:] == ["end", "end-of-stream"], kinds
    assert kinds.count("keepalive") >= 2, kinds
    assert events[-1] == (2, {})
