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
    assert 1 <= len(metrics) <= 3 and metrics[-1].cpu_count >= 1  # a point every 5 s, then now


def test_metrics_history_honours_start_and_end(sbx) -> None:  # type: ignore[no-untyped-def]
    """Issue 29 item 10: ``get_metrics(start, end)`` answers the daemon's history (a point every 5 s
    from the monitor's view), oldest first, within the range; a range after now is empty."""
    import datetime as dt

    sbx.commands.run("timeout 7 sh -c 'while :; do :; done'; true", timeout=60)  # CPU for 7 s
    points = sbx.get_metrics()
    assert len(points) >= 2, points  # at least one recorded while it ran, and now
    stamps = [p.timestamp.timestamp() for p in points]
    assert stamps == sorted(stamps)
    assert max(p.cpu_used_pct for p in points) > 10, points
    assert all(p.mem_total > 0 and p.mem_used > 0 for p in points), points
    first = dt.datetime.fromtimestamp(int(stamps[0]), dt.timezone.utc)
    assert [p.timestamp for p in sbx.get_metrics(end=first)] == [points[0].timestamp]
    assert len(sbx.get_metrics(start=first + dt.timedelta(seconds=1))) == len(points) - 1
    assert sbx.get_metrics(start=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)) == []
    with pytest.raises(e2b.SandboxException, match="before start"):
        sbx.get_metrics(start=dt.datetime.now(dt.timezone.utc), end=first)


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


def test_an_image_is_a_template(served: Served, busybox_oci) -> None:  # type: ignore[no-untyped-def]
    """Issue 28 item 1: E2B's template may name an image; an API key may name only images in the
    registries the node reads for keys, never one on the node's disk."""
    image = f"oci:{busybox_oci}:bb"
    sbx = e2b.Sandbox.create(image, timeout=120, api_key=served.keys["root"])
    try:
        assert sbx.get_info().template_id == image
        out = sbx.commands.run("cat /etc/new; echo $FOO; pwd", user="root")
        assert out.stdout == "new\nbar\n/srv\n", out
    finally:
        sbx.kill()
    with pytest.raises(e2b.SandboxException) as err:
        e2b.Sandbox.create(image, timeout=60)  # alice: a tenant
    assert "403" in str(err.value) and "admin key" in str(err.value)


def test_remove_of_a_missing_path_is_silent(sbx) -> None:  # type: ignore[no-untyped-def]
    """Issue 29 item 2: as envd (RemoveAll), removing what is not there is no error."""
    sbx.files.remove("/tmp/never-was-here")
    sbx.files.write("/tmp/rm/x", "1")
    sbx.files.remove("/tmp/rm")
    assert not sbx.files.exists("/tmp/rm")
    sbx.files.remove("/tmp/rm")


def _seconds_left(sandbox_id: str) -> float:
    import datetime as dt

    return (e2b.Sandbox.get_info(sandbox_id).end_at - dt.datetime.now(dt.timezone.utc)).total_seconds()


def test_connect_only_extends_and_set_timeout_zero_ends(served: Served) -> None:
    """Issue 29 item 8: ``connect(id, timeout)`` never shortens a sandbox's time (E2B's rule), and
    ``set_timeout(0)`` ends the sandbox now."""
    import time

    s = e2b.Sandbox.create("bb", timeout=600)
    try:
        e2b.Sandbox.connect(s.sandbox_id, timeout=30)
        assert _seconds_left(s.sandbox_id) > 500  # not cut to 30 s
        e2b.Sandbox.connect(s.sandbox_id, timeout=1200)
        assert 1100 < _seconds_left(s.sandbox_id) <= 1200
        s.set_timeout(60)  # set_timeout may shorten
        assert _seconds_left(s.sandbox_id) <= 60
        s.set_timeout(0)
        deadline = time.monotonic() + 10
        while s.sandbox_id in {x.sandbox_id for x in e2b.Sandbox.list().next_items()}:
            assert time.monotonic() < deadline, "still listed 10 s after set_timeout(0)"
            time.sleep(0.2)
        with pytest.raises(e2b.NotFoundException):
            e2b.Sandbox.get_info(s.sandbox_id)
    finally:
        try:
            s.kill()
        except e2b.SandboxException:
            pass


def test_list_is_newest_first_and_filters_by_start(served: Served) -> None:
    """Issue 29 item 9: the SDK's list, newest first unless ``order="asc"``; ``started_after``."""
    from e2b.sandbox.sandbox_api import SandboxQuery

    older = e2b.Sandbox.create("bb", timeout=120, metadata={"list": "t9"})
    newer = e2b.Sandbox.create("bb", timeout=120, metadata={"list": "t9"})
    try:
        query = SandboxQuery(metadata={"list": "t9"})
        ids = [x.sandbox_id for x in e2b.Sandbox.list(query=query).next_items()]
        assert ids == [newer.sandbox_id, older.sandbox_id]
        ids = [x.sandbox_id for x in e2b.Sandbox.list(query=query, order="asc").next_items()]
        assert ids == [older.sandbox_id, newer.sandbox_id]
        pager = e2b.Sandbox.list(query=query, limit=1)
        assert [x.sandbox_id for x in pager.next_items()] == [newer.sandbox_id] and pager.has_next
        assert [x.sandbox_id for x in pager.next_items()] == [older.sandbox_id] and not pager.has_next
        since = e2b.Sandbox.get_info(newer.sandbox_id).started_at
        later = SandboxQuery(metadata={"list": "t9"}, started_after=since)
        assert [x.sandbox_id for x in e2b.Sandbox.list(query=later).next_items()] == [newer.sandbox_id]
    finally:
        older.kill()
        newer.kill()


def test_create_from_a_snapshot_with_internet_access_keeps_its_network(sbx) -> None:  # type: ignore[no-untyped-def]
    """Issue 29 item 11: SDK 2.45 always sends ``allow_internet_access=True``; from a snapshot that
    asks for nothing the snapshot lacks (E2B's default, all open), so it is no 400. Narrowing still
    says why."""
    sbx.files.write("/tmp/marker", "snap")
    snap = sbx.create_snapshot()
    child = e2b.Sandbox.create(snap.snapshot_id, timeout=60, allow_internet_access=True)
    try:
        assert child.files.read("/tmp/marker") == "snap"
    finally:
        child.kill()
    with pytest.raises(e2b.SandboxException, match="narrow egress"):
        e2b.Sandbox.create(snap.snapshot_id, timeout=60, network={"deny_out": ["10.0.0.0/8"]})


def test_gzip_bodies_both_ways(sbx, served: Served) -> None:  # type: ignore[no-untyped-def]
    """Issue 29 item 3: the SDK's ``gzip=True`` writes (octet-stream, ``Content-Encoding: gzip``) and
    reads (``Accept-Encoding: gzip``); a plain client's default list gets the file as it is; a body
    that is not gzip is a 400 naming it, and writes nothing."""
    import gzip

    import httpx

    data = b"compressible line\n" * 50_000
    sbx.files.write("/tmp/gz/a.txt", data, gzip=True)
    sbx.files.write("/tmp/gz/b.txt", "text too", gzip=True, use_octet_stream=True)
    assert bytes(sbx.files.read("/tmp/gz/a.txt", format="bytes", gzip=True)) == data
    assert sbx.files.read("/tmp/gz/b.txt", gzip=True) == "text too"
    assert sbx.commands.run("wc -c < /tmp/gz/a.txt").stdout.strip() == str(len(data))
    url = served.url + "/files"
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    params = {"path": "/tmp/gz/a.txt", "username": "root"}
    with httpx.Client(headers=headers, timeout=30) as c:
        chosen = c.get(url, params=params, headers={"Accept-Encoding": "gzip"})
        assert chosen.headers["content-encoding"] == "gzip" and chosen.content == data
        assert chosen.num_bytes_downloaded < len(data) // 20
        plain = c.get(url, params=params)  # httpx's default: "gzip, deflate"
        assert "content-encoding" not in plain.headers and plain.content == data
        two = gzip.compress(b"first ") + b"\0\0" + gzip.compress(b"second")  # members, padding
        r = c.post(url, params={"path": "/tmp/gz/two", "username": "root"}, content=two,
                   headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert r.status_code == 200, r.text
        assert sbx.files.read("/tmp/gz/two") == "first second"
        bad = c.post(url, params={"path": "/tmp/gz/bad", "username": "root"}, content=b"not gzip at all",
                     headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert bad.status_code == 400 and "gzip body does not decompress" in bad.text, bad.text
        cut = c.post(url, params={"path": "/tmp/gz/cut", "username": "root"}, content=gzip.compress(data)[:-20],
                     headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert cut.status_code == 400 and "ends inside" in cut.text, cut.text
        br = c.post(url, params={"path": "/tmp/gz/br", "username": "root"}, content=b"x",
                    headers={"Content-Type": "application/octet-stream", "Content-Encoding": "br"})
        assert br.status_code == 415 and "'br'" in br.text
    assert not sbx.files.exists("/tmp/gz/bad") and not sbx.files.exists("/tmp/gz/br")
    assert not sbx.files.exists("/tmp/gz/cut"), sbx.commands.run("wc -c /tmp/gz/cut").stdout


def test_killing_a_sandbox_ends_its_command_streams_as_e2b_does(served: Served) -> None:
    """Issue 29 item 7: a sandbox killed while a command streams (foreground, or a background
    handle's wait) ends the stream so that the SDK raises its sandbox-not-running error (E2B's
    proxy answer: "was not found"), not an internal error."""
    import threading
    import time

    for background in (False, True):
        s = e2b.Sandbox.create("bb", timeout=120)
        handle = s.commands.run("echo started; sleep 30", background=True) if background else None
        timer = threading.Timer(1.0, s.kill)
        timer.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(e2b.SandboxException) as err:
                handle.wait() if handle is not None else s.commands.run("echo started; sleep 30", timeout=60)
        finally:
            timer.join()
        assert time.monotonic() - t0 < 20
        assert "was not found" in str(err.value) and "killed" in str(err.value), repr(err.value)
        not_running = getattr(e2b, "SandboxNotRunningException", e2b.TimeoutException)  # SDK 2.63; 2.45: timeout
        assert isinstance(err.value, not_running), repr(err.value)


@pytest.fixture
def user_template(served: Served) -> str:
    """``bb-user``: the busybox template whose plan runs as ``user`` (/home/user), as E2B's base does."""
    import json
    import os

    from weenv.api import TemplateStore

    with open(served.daemon.plan_lock) as f:
        text = f.read()
    lock = json.loads(text) if text.lstrip().startswith("{") else __import__("tomllib").loads(text)
    lock["user"] = "user"
    path = os.path.join(served.home, "bb-user.lock.json")
    with open(path, "w") as f:
        json.dump(lock, f)
    TemplateStore(os.path.join(served.home, "api")).set("bb-user", path)
    return "bb-user"


def test_relative_paths_are_the_users_home_and_files_belong_to_the_default_user(user_template: str) -> None:
    """Issue 29 item 1: relative paths resolve against the acting user's home (``/home/user`` for the
    plan's user, ``/root`` for root); answers carry absolute paths; what is made with no user belongs
    to the env's default user, and ``owner`` says so; ``cwd`` may be relative."""
    s = e2b.Sandbox.create(user_template, timeout=120)
    try:
        info = s.files.write("a.txt", "in home")
        assert info.path == "/home/user/a.txt"
        assert s.files.read("/home/user/a.txt") == "in home" and s.files.read("a.txt") == "in home"
        got = s.files.get_info("a.txt")
        assert got.path == "/home/user/a.txt" and got.owner == "user" and got.group == "user"
        assert s.files.make_dir("sub/deeper") is True
        assert s.files.get_info("sub").owner == "user"
        assert {e.path for e in s.files.list(".")} >= {"/home/user/a.txt", "/home/user/sub"}
        assert s.files.exists("sub/deeper") and not s.files.exists("nope")
        moved = s.files.rename("a.txt", "sub/b.txt")
        assert moved.path == "/home/user/sub/b.txt"
        assert s.commands.run("pwd; cat b.txt", cwd="sub").stdout == "/home/user/sub\nin home"
        s.files.write_files([{"path": "w1", "data": "1"}])  # multipart
        assert s.files.get_info("/home/user/w1").owner == "user"
        as_root = s.files.write("r.txt", "root's", user="root")
        assert as_root.path == "/root/r.txt" and s.files.get_info("/root/r.txt", user="root").owner == "root"
        s.files.remove("sub")
        assert not s.files.exists("/home/user/sub")
    finally:
        s.kill()


def test_proc_and_the_envs_own_mounts_read_through_the_files_api(sbx) -> None:  # type: ignore[no-untyped-def]
    """Issue 29 item 5: /proc, /etc/resolv.conf and the like are read in the env's mount namespace
    (the node's view of the rootfs has none of them); the boot id is the env's own."""
    status = sbx.files.read("/proc/1/status")
    assert status.startswith("Name:") and "\nPid:\t1\n" in status
    assert "MemTotal:" in sbx.files.read("/proc/meminfo")
    assert "no DNS resolver" in sbx.files.read("/etc/resolv.conf")
    assert sbx.files.read("/etc/hostname").strip() == sbx.commands.run("hostname").stdout.strip()
    boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id").strip()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert len(boot_id) == 36 and boot_id != f.read().strip()
    other = e2b.Sandbox.create("bb", timeout=60)
    try:
        assert other.files.read("/proc/sys/kernel/random/boot_id").strip() != boot_id
    finally:
        other.kill()
    assert sbx.files.exists("/proc/meminfo") and not sbx.files.exists("/proc/nope")
    assert sbx.files.get_info("/proc/1").type == e2b.FileType.DIR
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.read("/proc/no-such-file")
    with pytest.raises(e2b.InvalidArgumentException, match="mounts it itself"):
        sbx.files.write("/etc/resolv.conf", "nameserver 192.0.2.1\n")


def _until_paused(sandbox_id: str, within_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + within_s
    while e2b.Sandbox.get_info(sandbox_id).state.value != "paused":
        assert time.monotonic() < deadline, f"not paused within {within_s} s"
        time.sleep(0.2)


def test_a_filesystem_pause_ends_the_processes_and_keeps_the_files(served: Served) -> None:
    """Issue 29 item 12: ``pause(mode="filesystem")`` (``keep_memory=False``) stops the processes and
    keeps the files; connect boots the env again; ``on_resume="reboot"`` reboots a memory pause."""
    s = e2b.Sandbox.create("bb", timeout=120)
    try:
        s.files.write("/root/kept", "files stay")
        s.commands.run("sleep 1000", background=True).disconnect()
        boot = s.files.read("/proc/sys/kernel/random/boot_id")
        assert s.pause(mode="filesystem") is True
        assert e2b.Sandbox.get_info(s.sandbox_id).state.value == "paused"
        again = e2b.Sandbox.connect(s.sandbox_id)
        assert again.files.read("/root/kept") == "files stay"
        assert again.files.read("/proc/sys/kernel/random/boot_id") != boot  # a new boot
        assert "sleep 1000" not in [" ".join(p.args) for p in again.commands.list()]
        again.commands.run("sleep 1000", background=True).disconnect()
        assert again.pause() is True  # with memory: the process is kept...
        rebooted = e2b.Sandbox.connect(s.sandbox_id, on_resume="reboot")  # ...unless the resume reboots
        assert rebooted.files.read("/root/kept") == "files stay"
        assert not any("sleep 1000" in " ".join(p.args) for p in rebooted.commands.list())
    finally:
        s.kill()


def test_auto_resume_wakes_a_paused_sandbox_on_its_traffic(served: Served) -> None:
    """Issue 29 item 12: ``lifecycle={"on_timeout": "pause", "auto_resume": True}``: the timeout pauses
    it, its next request (envd here) resumes it, and the lifecycle says so."""
    s = e2b.Sandbox.create("bb", timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        s.files.write("/root/x", "before")
        assert e2b.Sandbox.get_info(s.sandbox_id).lifecycle == {"on_timeout": "pause", "auto_resume": True}
        _until_paused(s.sandbox_id)
        assert s.files.read("/root/x") == "before"  # the request wakes it
        info = e2b.Sandbox.get_info(s.sandbox_id)
        assert info.state.value == "running"
        assert 0 < (info.end_at - __import__("datetime").datetime.now(info.end_at.tzinfo)).total_seconds() <= 2.5
    finally:
        s.kill()
    fs = e2b.Sandbox.create("bb", timeout=2, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        fs.files.write("/root/y", "cold")
        fs.commands.run("sleep 1000", background=True).disconnect()
        _until_paused(fs.sandbox_id)
        again = e2b.Sandbox.connect(fs.sandbox_id, timeout=60)
        assert again.files.read("/root/y") == "cold"
        assert not any("sleep 1000" in " ".join(p.args) for p in again.commands.list())
    finally:
        fs.kill()


def test_lifecycle_combinations_e2b_refuses_are_refused(served: Served) -> None:
    import httpx

    headers = {"X-API-Key": served.keys["alice"]}
    for body, field in (({"autoResume": {"enabled": True}}, "autoPause"),
                        ({"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}}, "filesystem"),
                        ({"autoResume": "yes"}, "autoResume")):
        r = httpx.post(served.url + "/sandboxes", json={"templateID": "bb", **body}, headers=headers, timeout=30)
        assert r.status_code == 400 and field in r.json()["message"], r.text
    r = httpx.post(served.url + "/sandboxes", json={"templateID": "bb", "autoPause": True, "autoResume": True},
                   headers=headers, timeout=30)  # SDK 2.45 sends a bare bool
    assert r.status_code == 201, r.text
    httpx.delete(f"{served.url}/sandboxes/{r.json()['sandboxID']}", headers=headers, timeout=30)


def test_bad_file_metadata_headers_are_refused(sbx, served: Served) -> None:  # type: ignore[no-untyped-def]
    import httpx

    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token,
               "Content-Type": "application/octet-stream", "X-Metadata-ok": "caf\xe9".encode("latin-1")}
    r = httpx.post(served.url + "/files", params={"path": "/tmp/badmeta", "username": "root"}, content=b"x",
                   headers=headers, timeout=30)
    assert r.status_code == 400 and "X-Metadata-ok" in r.text, r.text
    assert not sbx.files.exists("/tmp/badmeta")


def test_file_metadata_and_watch_entries_as_envd_0_6_4(sbx) -> None:  # type: ignore[no-untyped-def]
    """Issue 29 item 4: the envd version weenv advertises (0.6.4) and its features: file metadata set
    on write (``user.e2b.*`` extended attributes), surfaced by get_info and list, kept on rename;
    watch events with entry info; ``allow_network_mounts`` accepted."""
    assert sbx._envd_version >= __import__("packaging.version", fromlist=["Version"]).Version("0.6.4")
    written = sbx.files.write("/tmp/meta/a.txt", "x", metadata={"Owner": "alice", "task": "t-1"})
    assert written.metadata == {"owner": "alice", "task": "t-1"}
    assert sbx.files.get_info("/tmp/meta/a.txt").metadata == {"owner": "alice", "task": "t-1"}
    listed = {e.name: e for e in sbx.files.list("/tmp/meta")}
    assert listed["a.txt"].metadata == {"owner": "alice", "task": "t-1"}
    sbx.files.write_files([{"path": "/tmp/meta/b.txt", "data": "y"}], metadata={"batch": "2"})
    assert sbx.files.get_info("/tmp/meta/b.txt").metadata == {"batch": "2"}
    moved = sbx.files.rename("/tmp/meta/a.txt", "/tmp/meta/c.txt")
    assert moved.metadata == {"owner": "alice", "task": "t-1"}
    assert sbx.files.get_info("/tmp/meta/b.txt").metadata != sbx.files.get_info("/tmp/meta/c.txt").metadata
    plain = sbx.files.write("/tmp/meta/plain", "z")
    assert plain.metadata is None and sbx.files.get_info("/tmp/meta/plain").metadata is None
    with pytest.raises(e2b.InvalidArgumentException):
        sbx.files.write("/tmp/meta/bad", "z", metadata={"bad key": "v"})  # the SDK's own check
    handle = sbx.files.watch_dir("/tmp/meta", include_entry=True, allow_network_mounts=True)
    try:
        sbx.files.write("/tmp/meta/new.txt", "hello", metadata={"k": "v"})
        events = handle.get_new_events()
        created = [ev for ev in events if ev.name == "new.txt" and ev.type == e2b.FilesystemEventType.CREATE]
        assert created and created[0].entry is not None, events
        assert created[0].entry.path == "/tmp/meta/new.txt" and created[0].entry.size == 5
        assert created[0].entry.metadata == {"k": "v"}
        sbx.files.remove("/tmp/meta/new.txt")
        removed = [ev for ev in handle.get_new_events() if ev.type == e2b.FilesystemEventType.REMOVE]
        assert removed and removed[0].entry is None
    finally:
        handle.stop()
