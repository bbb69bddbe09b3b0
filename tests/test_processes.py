"""Process handles (docs/architecture.md, "Processes"): background processes that outlive the
client that started them, reattached, listed, fed stdin, signalled, waited for, on a pty.

The integration tests drive a real daemon (crun, the in-env agent); the last ones run the same
promises against :class:`weenv.testing.FakeRuntime`.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import trio

import weenv
from weenv import _wire as wire
from weenv.provision._errors import ProcessNotFoundError, ProcessStartError, ProcessStateError
from weenv.testing import FakeRuntime

from .fixtures_daemon import daemon, weenv_daemon  # noqa: F401
from .fixtures_runtime import crun_runtime  # noqa: F401


def _output(events) -> tuple[bytes, wire.ProcessEnd | None, int]:  # type: ignore[no-untyped-def]
    out, end, dropped = b"", None, 0
    for ev in events:
        if ev.data_b64 is not None:
            out += ev.data_b64
        if ev.dropped:
            dropped += ev.dropped
        if ev.end is not None:
            end = ev.end
    return out, end, dropped


def _until(proc, want: bytes, seen: bytes = b"") -> bytes:  # type: ignore[no-untyped-def]
    """Read ``proc``'s output until ``want`` shows (or it ends)."""
    for ev in proc.events():
        seen += ev.data_b64 or b""
        if want in seen or ev.end is not None:
            return seen
    return seen


# -- on crun, through the daemon ----------------------------------------------------------------


def test_a_background_process_outlives_its_client_and_is_reattached(daemon):  # noqa: F811
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        with daemon.client() as starter:
            proc = starter.get(env.id).spawn(["sh", "-c", "echo one; sleep 1; echo two; echo err >&2; exit 3"],
                                             tag="bg")
            assert _until(proc, b"one\n") == b"one\n"
        # the starting client is gone (its stream closed mid-run): the process is still there
        listed = {p.pid: p for p in env.processes()}
        assert proc.pid in listed
        info = listed[proc.pid]
        assert info.running and info.background and info.tag == "bg" and info.argv[0] == "sh"
        out, end, _ = _output(env.connect(proc.pid).events())
        assert out == b"two\nerr\n"  # what it wrote while nobody was attached, then live
        assert end is not None and end.exit_code == 3 and end.signal is None and end.status == "exit status 3"
        finished = env.process(proc.pid).info()
        assert not finished.running and finished.end is not None and finished.end.exit_code == 3


def test_stdin_is_written_and_closed(daemon):  # noqa: F811
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        cat = env.spawn(["cat"], stdin=True)
        cat.send_stdin("hello\n")
        assert _until(cat, b"hello\n") == b"hello\n"
        cat.send_stdin(b"world\n")
        cat.close_stdin()
        out, end, _ = _output(cat.events())
        assert out == b"world\n" and end is not None and end.exit_code == 0
        # head reads one line and exits: the rest of its stdin does not matter
        head = env.spawn(["head", "-n1"], stdin=True)
        head.send_stdin("first\nsecond\n")
        out, end, _ = _output(head.events())
        assert out == b"first\n" and end is not None and end.exit_code == 0
        with pytest.raises(weenv.ApiError) as e:
            env.process(head.pid).send_stdin("late\n")
        assert e.value.status == 409
        # a process started without stdin says so
        quiet = env.spawn(["sleep", "30"])
        with pytest.raises(weenv.ApiError, match="stdin") as e:
            quiet.send_stdin("x")
        assert e.value.status == 409 and e.value.kind == "process_state"
        quiet.kill()
        assert quiet.wait(timeout_s=10).exit_code == 137  # type: ignore[union-attr]


def test_a_signal_ends_a_process_and_wait_reports_it(daemon):  # noqa: F811
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        with env.spawn(["sleep", "30"]) as sleeper:
            pid = sleeper.pid
        assert env.process(pid).wait(timeout_s=0.3) is None  # still running: the wait timed out
        env.process(pid).signal("SIGTERM")
        end = env.process(pid).wait(timeout_s=10)
        assert end == wire.ProcessEnd(exit_code=143, signal=15, status="signal: terminated")
        with env.spawn(["sh", "-c", "exit 7"]) as p:
            assert p.wait() == wire.ProcessEnd(exit_code=7, signal=None, status="exit status 7")
        with pytest.raises(weenv.ApiError) as e:  # an unknown name is a 400 naming the field
            env.process(pid).signal("SIGNOPE")
        assert e.value.status == 400 and "$.signal" in str(e.value)


def test_a_pty_is_a_terminal_and_can_be_resized(daemon):  # noqa: F811
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        proc = env.spawn(["sh", "-c", "tty; stty size; read x; stty size"], pty=(10, 40))
        seen = _until(proc, b"10 40")
        assert b"/dev/pts/" in seen and b"10 40" in seen
        proc.resize(30, 100)
        proc.send_stdin("\n")
        out, end, _ = _output(proc.events())
        assert b"30 100" in out and end is not None and end.exit_code == 0
        # a non-root user's terminal is its own (it can reopen /dev/tty)
        mine = env.spawn(["sh", "-c", "id -u; echo ok > /dev/tty"], pty=(24, 80), user="user", cwd="/tmp")
        out, end, _ = _output(mine.events())
        assert out.split() == [b"1000", b"ok"] and end is not None and end.exit_code == 0
        plain = env.spawn(["sleep", "30"])
        with pytest.raises(weenv.ApiError, match="pty") as e:
            plain.resize(5, 5)
        assert e.value.status == 409
        plain.kill()



def test_a_pty_command_that_closes_its_terminal_before_exiting_is_not_hung_up(daemon):  # noqa: F811
    """Closing a pty's master hangs the terminal up (SIGHUP to its session): the agent keeps it
    open until the command is reaped, so a command that closes fds 0-2 and then goes on (coreutils
    does at exit; this one waits a while) ends with its own exit code, not 129."""
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        proc = env.spawn(["sh", "-c", "echo closing; exec 0<&- 1>&- 2>&-; sleep 0.5; exit 3"], pty=(24, 80))
        out, end, _ = _output(proc.events())
        assert b"closing" in out
        assert end is not None and (end.exit_code, end.signal) == (3, None), end

def test_output_kept_while_nobody_reads_is_bounded(daemon):  # noqa: F811
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        # it writes once its starter has detached, so every byte is either kept or counted as dropped
        with env.spawn(["sh", "-c", "sleep 0.5; head -c 3000000 /dev/zero; echo END"], buffer_bytes=256 << 10) as p:
            pid = p.pid
        assert env.process(pid).wait(timeout_s=30).exit_code == 0  # type: ignore[union-attr]
        info = env.process(pid).info()
        assert 0 < info.buffered_bytes <= 256 << 10 and info.dropped_bytes > 2_000_000
        out, end, dropped = _output(env.connect(pid).events())
        assert out.endswith(b"END\n") and len(out) <= 256 << 10
        assert dropped + len(out) == 3_000_004 and end is not None and end.exit_code == 0
        assert env.process(pid).info().buffered_bytes == 0  # the reader took it


def test_processes_are_listed_and_errors_are_typed(daemon):  # noqa: F811
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        a = env.spawn(["sleep", "30"], tag="a")
        b = env.spawn(["sleep", "30"], tag="b", cwd="/tmp")
        listed = {p.tag: p for p in env.processes() if p.tag}
        assert listed["a"].pid == a.pid and listed["b"].cwd == "/tmp" and listed["b"].running
        with pytest.raises(weenv.ApiError) as e:
            env.spawn(["no-such-command"])
        assert e.value.status == 400 and e.value.kind == "command_not_found"
        with pytest.raises(weenv.ApiError) as e:
            env.connect(999999)
        assert e.value.status == 404 and e.value.kind == "process_not_found"
        with pytest.raises(weenv.ApiError) as e:
            env.process(0).info()
        assert e.value.status == 400
        for bad, where in (({"argv": ["true"], "pty": {"rows": 0}}, "$.pty.rows"),
                           ({"argv": ["true"], "buffer_bytes": 1 << 30}, "$.buffer_bytes"),
                           ({"argv": ["true"], "stdin": "yes"}, "$.stdin")):
            with pytest.raises(weenv.ApiError) as e:
                c.connection.request("process_start", {"id": env.id}, json=bad)
            assert e.value.status == 400 and where in str(e.value), str(e.value)
        with pytest.raises(weenv.ApiError) as e:
            c.connection.request("process_stdin", {"id": env.id, "pid": a.pid}, json={"data_b64": "not base64!"})
        assert e.value.status == 400 and "$.data_b64" in str(e.value)
        a.kill()
        b.kill()
        assert a.wait(timeout_s=10).signal == 9 and b.wait(timeout_s=10).signal == 9  # type: ignore[union-attr]


def test_one_shot_exec_is_unchanged_and_a_cut_exec_is_still_killed(daemon):  # noqa: F811
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        r = env.exec(["sh", "-c", "echo out; echo err >&2; exit 4"])
        assert (r.exit_code, r.stdout, r.stderr) == (4, b"out\n", b"err\n")
        r = env.exec(["no-such-command"])
        assert r.exit_code == 127 and r.command_not_found and b"command not found" in r.stderr
        r = env.exec(["sleep", "10"], timeout_s=0.3)
        assert r.timed_out and r.exit_code == 137
        # an exec is listed while it runs (not background), and killed when its client goes away
        argv = ["sh", "-c", "sleep 30; echo never"]
        body = json.dumps({"argv": argv}).encode()
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(daemon.socket)
            raw.sendall(b"POST /v1/envs/%s/exec HTTP/1.1\r\nHost: weenv\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (env.id.encode(), len(body), body))
            assert _wait_for(lambda: any(p.argv == argv and p.running and not p.background
                                         for p in env.processes()))
        assert _wait_for(lambda: not any(p.argv == argv for p in env.processes())), "the cut exec still runs"


def _wait_for(cond, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_reader_that_never_reads_does_not_stall_the_env(daemon):  # noqa: F811
    # the agent queues a reader's frames and cuts off one too far behind; it never waits for it
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        body = json.dumps({"argv": ["cat", "/dev/zero"], "tag": "flood"}).encode()
        with socket.socket(socket.AF_UNIX) as raw:  # starts the stream, then never reads it
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.connect(daemon.socket)
            raw.sendall(b"POST /v1/envs/%s/processes HTTP/1.1\r\nHost: weenv\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (env.id.encode(), len(body), body))
            assert _wait_for(lambda: any(p.tag == "flood" for p in env.processes()))
            time.sleep(1.0)  # the daemon's send to us is stuck, so is its read of the agent's stream
            t0 = time.monotonic()
            r = env.exec(["echo", "alive"], timeout_s=20)
            assert r.stdout == b"alive\n" and time.monotonic() - t0 < 5
            flood = next(p for p in env.processes() if p.tag == "flood")
            assert flood.running
            env.process(flood.pid).kill()
            assert env.process(flood.pid).wait(timeout_s=10).signal == 9  # type: ignore[union-attr]


def test_background_processes_survive_a_daemon_restart(daemon):  # noqa: F811
    # the agent keeps the table and the unread output: a restarted daemon lists and reattaches
    with daemon.client() as c:
        env = c.create(daemon.plan_lock)
        proc = env.spawn(["sh", "-c", "read x; echo got $x"], stdin=True, tag="kept")
        pid = proc.pid
        proc.detach()
    daemon.kill9()
    daemon.start()
    with daemon.client() as c:
        env = c.get(env.id)
        listed = {p.pid: p for p in env.processes()}
        assert listed[pid].tag == "kept" and listed[pid].running and listed[pid].stdin
        env.process(pid).send_stdin("restart\n")
        out, end, _ = _output(env.connect(pid).events())
        assert out == b"got restart\n" and end is not None and end.exit_code == 0
        env.kill()


def test_the_async_client_drives_a_process(daemon):  # noqa: F811
    async def main() -> None:
        async with daemon.async_client() as c, c.create(daemon.plan_lock) as env:
            cat = await env.spawn(["cat"], stdin=True)
            await cat.send_stdin(b"ping\n", close=True)
            out = b""
            async for ev in cat.events():
                out += ev.data_b64 or b""
            assert out == b"ping\n" and cat.end is not None and cat.end.exit_code == 0
            sleeper = await env.spawn(["sleep", "30"])
            await sleeper.detach()
            assert sleeper.pid in [p.pid for p in await env.processes()]
            await env.process(sleeper.pid).signal("KILL")
            end = await env.process(sleeper.pid).wait(timeout_s=10)
            assert end is not None and end.exit_code == 137 and end.status == "signal: killed"

    trio.run(main)


def test_a_process_that_ended_leaves_its_connection_for_the_next_request(daemon):  # noqa: F811
    """The stream is read to its end, so httpx keeps the connection (weenv serve spawns one
    process per E2B command: a new daemon connection each time cost a connect and an accept)."""
    def idle(http) -> list[bool]:  # type: ignore[no-untyped-def]
        return [conn.is_idle() for conn in http._transport._pool.connections]

    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        for _ in range(2):
            _out, end, _ = _output(env.spawn(["true"]).events())
            assert end is not None and end.exit_code == 0
            assert idle(c.connection.http) == [True]

    async def main() -> None:
        async with daemon.async_client() as c, c.create(daemon.plan_lock) as env:
            for _ in range(2):
                proc = await env.spawn(["true"])
                async for _ev in proc.events():
                    pass
                assert proc.end is not None and idle(c.connection.http) == [True]

    trio.run(main)


# -- the runtime seam: the same promises from crun (through the agent) and from the fake ----------


@pytest.fixture(params=["fake", "crun"])
def runtime_env(request, tmp_path):  # type: ignore[no-untyped-def]
    """(runtime, env id) of a started env: FakeRuntime, or CrunRuntime with the in-env agent."""
    if request.param == "fake":
        rt = FakeRuntime()

        async def up() -> None:
            await rt.create("p1", "/b", "/r", {"process": {"env": ["A=1"], "cwd": "/"}})
            await rt.start("p1")

        trio.run(up)
        yield rt, "p1"
        return
    from weenv.provision.runtime._agent import agent_listener, ensure_agent
    from weenv.provision.runtime._runtime import prepare_bundle

    from .fixtures_runtime import make_busybox_rootfs

    rt = request.getfixturevalue("crun_runtime")
    agent = ensure_agent(str(tmp_path / "lib"))
    if agent is None:
        pytest.skip("no static C toolchain for weenv-agent")
    rootfs = make_busybox_rootfs(str(tmp_path / "rootfs"))
    bundle = str(tmp_path / "bundle")
    os.makedirs(bundle)
    sock = os.path.join(bundle, "agent.sock")
    listener = agent_listener(sock)
    spec = prepare_bundle(bundle, env_id="p1", rootfs=rootfs, host=rt.host, agent_path=agent, agent_socket=sock)

    async def up() -> None:
        try:
            await rt.create("p1", bundle, rootfs, spec, [], listen_fd=listener.fileno())
        finally:
            listener.close()
        await rt.start("p1")

    trio.run(up)
    yield rt, "p1"


def test_conformance_process_handles(runtime_env):  # type: ignore[no-untyped-def]
    rt, env_id = runtime_env

    async def collect(stream) -> tuple[bytes, wire.ProcessEnd | None]:  # type: ignore[no-untyped-def]
        out = b""
        with trio.fail_after(10):
            async for ev in stream:
                out += ev.data_b64 or b""
        return out, stream.end

    async def main() -> None:
        cat = await rt.start_process(env_id, ["cat"], stdin=True, tag="t", env={"SHOWN": "1"})
        assert cat.pid > 0
        await rt.send_stdin(env_id, cat.pid, b"hi\n")
        with trio.fail_after(10):
            ev = await cat.receive()
        assert ev is not None and ev.stream == "stdout" and ev.data_b64 == b"hi\n"
        await cat.aclose()  # detached: it runs on, its output kept for the next reader
        await rt.send_stdin(env_id, cat.pid, b"again\n", close=True)
        assert await rt.wait_process(env_id, cat.pid, 10) == wire.ProcessEnd(exit_code=0, status="exit status 0")
        assert await collect(await rt.connect_process(env_id, cat.pid)) == (
            b"again\n", wire.ProcessEnd(exit_code=0, status="exit status 0"))
        with pytest.raises(ProcessStateError):
            await rt.send_stdin(env_id, cat.pid, b"late")
        sleeper = await rt.start_process(env_id, ["sleep", "30"])
        await sleeper.aclose()
        assert await rt.wait_process(env_id, sleeper.pid, 0.1) is None
        with pytest.raises(ProcessStateError):
            await rt.send_stdin(env_id, sleeper.pid, b"x")  # started without stdin
        with pytest.raises(ProcessStateError):
            await rt.resize_process(env_id, sleeper.pid, 5, 5)  # not on a pty
        await rt.signal_process(env_id, sleeper.pid, 15)
        assert await rt.wait_process(env_id, sleeper.pid, 10) == wire.ProcessEnd(
            exit_code=143, signal=15, status="signal: terminated")
        tty = await rt.start_process(env_id, ["stty", "size"], pty=(10, 40))
        out, end = await collect(tty)
        assert b"10 40" in out and end is not None and end.exit_code == 0
        infos = {p.pid: p for p in await rt.list_processes(env_id)}
        assert infos[cat.pid].tag == "t" and infos[cat.pid].argv == ["cat"] and not infos[cat.pid].running
        assert infos[cat.pid].env == {"SHOWN": "1"}  # what was asked for, not the env's whole environment
        assert infos[sleeper.pid].end is not None and infos[sleeper.pid].end.signal == 15
        with pytest.raises(ProcessNotFoundError):
            await rt.connect_process(env_id, 123456)
        with pytest.raises(ProcessStartError) as e:
            await rt.start_process(env_id, ["no-such-command"])
        assert e.value.not_found

    trio.run(main)


# -- the same promises on the fake runtime ------------------------------------------------------


def test_fake_runtime_process_handles():
    rt = FakeRuntime()

    async def main() -> None:
        await rt.create("e1", "/b", "/r", {"process": {"env": ["A=1"], "cwd": "/"}})
        await rt.start("e1")
        cat = await rt.start_process("e1", ["cat"], stdin=True, tag="t")
        await rt.send_stdin("e1", cat.pid, b"hi\n")
        ev = await cat.receive()
        assert ev is not None and ev.stream == "stdout" and ev.data_b64 == b"hi\n"
        await cat.aclose()  # detached: output is kept for the next reader
        await rt.send_stdin("e1", cat.pid, b"again\n", close=True)
        assert (await rt.wait_process("e1", cat.pid, 5)) == wire.ProcessEnd(exit_code=0, status="exit status 0")
        events = [ev async for ev in await rt.connect_process("e1", cat.pid)]
        assert [e.data_b64 for e in events if e.data_b64] == [b"again\n"] and events[-1].end is not None
        with pytest.raises(ProcessStateError):
            await rt.send_stdin("e1", cat.pid, b"late")
        sleeper = await rt.start_process("e1", ["sleep", "30"])
        assert await rt.wait_process("e1", sleeper.pid, 0.05) is None
        await rt.signal_process("e1", sleeper.pid, 15)
        end = await rt.wait_process("e1", sleeper.pid)
        assert end is not None and (end.exit_code, end.signal, end.status) == (143, 15, "signal: terminated")
        tty = await rt.start_process("e1", ["stty", "size"], pty=(10, 40))
        assert b"10 40" in b"".join([e.data_b64 or b"" async for e in tty])
        infos = {p.pid: p for p in await rt.list_processes("e1")}
        assert infos[cat.pid].tag == "t" and not infos[sleeper.pid].running and infos[tty.pid].pty
        with pytest.raises(ProcessNotFoundError):
            await rt.connect_process("e1", 12345)
        with pytest.raises(ProcessStartError):
            await rt.start_process("e1", ["no-such-command"])
        big = await rt.start_process("e1", ["cat"], stdin=True, buffer_bytes=10)
        await big.aclose()
        for _ in range(5):
            await rt.send_stdin("e1", big.pid, b"0123456789")
        await trio.sleep(0.01)
        await rt.send_stdin("e1", big.pid, b"", close=True)
        await rt.wait_process("e1", big.pid)
        events = [ev async for ev in await rt.connect_process("e1", big.pid)]
        assert events[0].dropped == 40 and [e.data_b64 for e in events if e.data_b64] == [b"0123456789"]

    trio.run(main)


def test_the_quickstart_process_example_runs(daemon):  # noqa: F811
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "quickstart.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "env.spawn(" in b)
    for old, new in (('["python", "-m", "http.server"]', '["sh", "-c", "while true; do sleep 1; done"]'),
                     ('["python", "-i"]', '["sh", "-i"]'), ('"print(6 * 7)\\n"', '"echo $((6 * 7))\\n"'),
                     ("print(later.wait())", "END = later.wait()")):
        assert old in code, old
        code = code.replace(old, new)
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        scope: dict = {"env": env}
        exec(compile(code, "quickstart.md", "exec"), scope)
        assert scope["END"] == wire.ProcessEnd(exit_code=143, signal=15, status="signal: terminated")
        scope["repl"].kill()
