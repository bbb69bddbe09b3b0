"""`weenv cp` through click's CliRunner against a real daemon: trees both ways, trailing `/`, errors
on one line (issue 14, item 5)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from weenv.cli import main

pytestmark = pytest.mark.integration


def cp(daemon, *args: str):  # type: ignore[no-untyped-def]
    r = CliRunner().invoke(main, ["cp", *args], env={"WEENV_HOME": daemon.home})
    assert "Traceback" not in r.output and not isinstance(r.exception, OSError), r.output
    return r


def one_line_error(r) -> str:  # type: ignore[no-untyped-def]
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    return lines[0]


def make_tree(root) -> None:  # type: ignore[no-untyped-def]
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("A\n")
    (root / "sub" / "b.sh").write_text("echo b\n")
    os.chmod(root / "sub" / "b.sh", 0o755)
    (root / "sub" / "deeper" / "c").write_bytes(b"\0" * 70000)
    (root / "empty").mkdir()


def test_cp_directories_both_ways_like_docker_cp(daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "repo"
    make_tree(src)
    (src / "link").symlink_to("a.txt")
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        e = env.id
        # a directory to a path that does not exist: that path becomes the copy
        r = cp(daemon, str(src), f"{e}:/work")
        assert r.exit_code == 0, r.output
        assert "copied 3 files, 4 directories" in r.output and f"to {e}:/work" in r.output
        assert "skipped" in r.output and "link (symlink)" in r.output  # the files API makes no symlinks
        assert env.read_file("/work/sub/deeper/c") == b"\0" * 70000
        assert env.exec(["sh", "-c", "test -x /work/sub/b.sh && test -d /work/empty"]).exit_code == 0
        # into an existing directory: under its own name; SRC/. copies the content only
        assert cp(daemon, str(src), f"{e}:/work").exit_code == 0
        assert env.read_file("/work/repo/a.txt") == b"A\n"
        assert cp(daemon, f"{src}/.", f"{e}:/tmp").exit_code == 0
        assert env.read_file("/tmp/sub/b.sh") == b"echo b\n"
        # env -> host: the tree comes back, modes and symlinks kept
        env.exec(["sh", "-c", "ln -s sub/b.sh /work/blink"])
        back = tmp_path / "back"
        r = cp(daemon, f"{e}:/work", str(back))
        assert r.exit_code == 0, r.output
        assert (back / "sub" / "deeper" / "c").read_bytes() == b"\0" * 70000
        assert (back / "repo" / "a.txt").read_text() == "A\n"
        assert os.stat(back / "sub" / "b.sh").st_mode & 0o777 == 0o755
        assert os.readlink(back / "blink") == "sub/b.sh"
        assert (back / "empty").is_dir()
        # into an existing host directory with a trailing /
        r = cp(daemon, f"{e}:/work/sub", f"{tmp_path}/")
        assert r.exit_code == 0 and (tmp_path / "sub" / "deeper" / "c").exists(), r.output


def test_cp_files_trailing_slash_means_into_the_directory(daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "f.txt"
    f.write_text("one\n")
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        e = env.id
        env.mkdir("/repo")
        r = cp(daemon, str(f), f"{e}:/repo/")
        assert r.exit_code == 0, r.output
        assert env.read_file("/repo/f.txt") == b"one\n" and f"to {e}:/repo/f.txt" in r.output
        assert cp(daemon, str(f), f"{e}:/repo").exit_code == 0  # an existing directory without the /
        assert cp(daemon, str(f), f"{e}:/repo/g.txt").exit_code == 0
        assert env.read_file("/repo/g.txt") == b"one\n"
        err = one_line_error(cp(daemon, str(f), f"{e}:/nope/"))
        assert f"{e}:/nope/" in err and "must exist" in err
        err = one_line_error(cp(daemon, str(f), f"{e}:/nope/g.txt"))
        assert f"{e}:/nope: no such directory" in err
        # env -> host, into a directory, then to a file name
        assert cp(daemon, f"{e}:/repo/g.txt", f"{tmp_path}/").exit_code == 0
        assert (tmp_path / "g.txt").read_text() == "one\n"
        assert cp(daemon, f"{e}:/repo/g.txt", str(tmp_path / "h")).exit_code == 0
        assert (tmp_path / "h").read_text() == "one\n"


def test_cp_errors_are_one_line(daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "d"
    d.mkdir()
    (tmp_path / "file").write_text("x")
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        e = env.id
        assert f"{tmp_path}/missing: no such file or directory" in one_line_error(
            cp(daemon, str(tmp_path / "missing"), f"{e}:/tmp/x"))
        assert f"{e}:/missing: no such file or directory" in one_line_error(cp(daemon, f"{e}:/missing", str(d)))
        assert "no such directory" in one_line_error(cp(daemon, f"{e}:/etc/passwd", str(tmp_path / "no" / "x")))
        assert "cannot copy directory" in one_line_error(cp(daemon, str(d), f"{e}:/etc/passwd"))
        assert "cannot copy directory" in one_line_error(cp(daemon, f"{e}:/etc", str(tmp_path / "file")))
        assert "not a directory" in one_line_error(cp(daemon, f"{tmp_path}/file/", f"{e}:/tmp/"))
        assert "exactly one" in cp(daemon, str(d), str(d)).output
        assert "absolute" in cp(daemon, str(d), f"{e}:tmp").output
        assert "no-such-env" in one_line_error(cp(daemon, str(d), "no-such-env:/tmp"))
