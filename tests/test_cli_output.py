"""Terminal output on a real daemon (issue 14, item 8): `top` piped prints as it goes, ids are never
cut, sizes never wrapped, milliseconds rounded to 0.1."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from rich.console import Console

from weenv.cli import main

pytestmark = pytest.mark.integration

LONG = "a-plan-name-long-enough-to-squeeze-a-table"  # 42 chars; ids get "-<8 hex>" (cut at 40)


def run(daemon, *args: str):  # type: ignore[no-untyped-def]
    r = CliRunner().invoke(main, list(args), env={"WEENV_HOME": daemon.home})
    assert r.exit_code == 0, r.output
    return r.output


def test_up_json_timings_are_rounded_to_a_tenth_of_a_millisecond(daemon) -> None:  # type: ignore[no-untyped-def]
    info = json.loads(run(daemon, "up", daemon.plan_lock, "--json"))
    timings = info["timings_ms"]
    assert "lock" in timings and len(timings) >= 3
    assert all(isinstance(v, (int, float)) and v == round(v, 1) for v in timings.values()), timings
    with daemon.client() as c:
        c.get(info["id"]).kill()


def test_ps_and_top_keep_ids_whole_and_sizes_on_one_line(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        envs = [c.create(daemon.plan_lock, name=LONG) for _ in range(2)]
        try:
            out = run(daemon, "ps")  # 80 columns: CliRunner output is no terminal
            for e in envs:
                row = [line for line in out.splitlines() if e.id in line]
                assert len(row) == 1, out
                assert re.search(r"\d+(\.\d)? \w?i?B / \d+\.\d MiB", row[0]), out
            from weenv.cli._top import render

            buf = io.StringIO()
            Console(file=buf, width=60, soft_wrap=True).print(render(c.top()))
            for e in envs:
                assert e.id in buf.getvalue(), buf.getvalue()
            assert not re.search(r"\d\.\d…", buf.getvalue()), buf.getvalue()  # no cut size either
        finally:
            for e in envs:
                e.kill()


def test_top_piped_prints_each_frame_at_once(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        proc = subprocess.Popen([sys.executable, "-m", "weenv", "top", "--interval", "0.3"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, "WEENV_HOME": daemon.home})
        try:
            got = b""
            deadline = time.monotonic() + 15
            while got.count(env.id.encode()) < 2 and time.monotonic() < deadline:  # two frames
                ready, _, _ = select.select([proc.stdout], [], [], 0.5)
                if ready:
                    chunk = os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
                    if not chunk:
                        break
                    got += chunk
            assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
            text = got.decode()
            assert text.count(env.id) >= 2 and text.count(" env ·") >= 2, text
        finally:
            proc.send_signal(signal.SIGTERM)  # what `timeout 4 weenv top | cat` does
            proc.wait(10)
