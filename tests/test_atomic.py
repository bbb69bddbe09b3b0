"""weenv._atomic: the one atomic-write helper (temp beside the target, O_EXCL, fchmod, fsync, rename)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time

import pytest

from weenv._atomic import AtomicFile, atomic_write, atomic_writer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_bytes_and_str_replace_the_file_whole(tmp_path) -> None:
    p = tmp_path / "f"
    atomic_write(p, b"one")
    assert p.read_bytes() == b"one"
    atomic_write(p, "twö")
    assert p.read_bytes() == "twö".encode()
    with atomic_writer(p, encoding="utf-8") as f:
        json.dump({"a": 1}, f)
    assert json.loads(p.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["f"], "a temp file was left behind"


def test_the_file_object_is_binary_unless_an_encoding_is_given(tmp_path) -> None:
    with atomic_writer(tmp_path / "b") as f:
        with pytest.raises(TypeError):
            f.write("text")
        f.write(b"bytes")
    assert (tmp_path / "b").read_bytes() == b"bytes"


_UMASK_CHILD = """
import os, stat, sys
from weenv._atomic import atomic_write
os.umask(int(sys.argv[1], 8))  # this child process only
mode = None if sys.argv[2] == "None" else int(sys.argv[2], 8)
atomic_write(sys.argv[3], b"x", mode=mode, fsync=False)
print(oct(stat.S_IMODE(os.stat(sys.argv[3]).st_mode)))
"""


@pytest.mark.parametrize(("umask", "mode", "expected"), [
    ("077", "644", 0o644),  # the umask does not take bits away
    ("000", "600", 0o600),  # nor leave extra ones
    ("022", "755", 0o755),
    ("027", "None", 0o640),  # None: what open() would give, 0o666 less the umask
])
def test_the_mode_does_not_depend_on_the_umask(tmp_path, umask: str, mode: str, expected: int) -> None:
    # The umask is process-wide: it is changed only in a child process, never in the test runner.
    target = str(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", _UMASK_CHILD, umask, mode, target], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=60)
    assert int(out.stdout.strip(), 8) == expected == _mode(target)


def test_the_mode_of_an_existing_file_is_replaced_too(tmp_path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"old")
    os.chmod(p, 0o600)
    atomic_write(p, b"new", mode=0o644)
    assert _mode(p) == 0o644 and p.read_bytes() == b"new"


def test_an_error_in_the_block_leaves_the_old_file_and_no_temp(tmp_path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_writer(p) as f:
            f.write(b"half of the new")
            raise RuntimeError("boom")
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]
    with pytest.raises(RuntimeError):
        with atomic_writer(tmp_path / "never") as f:
            raise RuntimeError
    assert os.listdir(tmp_path) == ["f"], "a file appeared for a write that failed"


def test_a_failed_rename_removes_the_temp(tmp_path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_bytes(b"keeps the directory non-empty")
    with pytest.raises(OSError):
        atomic_write(tmp_path / "d", b"cannot replace a directory")
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_a_name_chosen_after_writing(tmp_path) -> None:
    with AtomicFile(tmp_path / "unnamed") as a:
        a.file.write(b"content-addressed")
        a.commit(tmp_path / "sha256-abc")
    assert os.listdir(tmp_path) == ["sha256-abc"]
    with AtomicFile(tmp_path / "x") as a:
        with pytest.raises(ValueError, match="not in the same directory"):
            a.commit(tmp_path / "sub" / "x")
    assert os.listdir(tmp_path) == ["sha256-abc"]
    with pytest.raises(ValueError, match="already committed"):
        a.commit()


def test_two_writers_of_one_path_never_share_a_temp(tmp_path) -> None:
    a, b = AtomicFile(tmp_path / "f"), AtomicFile(tmp_path / "f")
    assert a.tmp != b.tmp and os.path.dirname(a.tmp) == str(tmp_path)
    a.file.write(b"a")
    b.file.write(b"b")
    a.commit()
    b.commit()
    assert (tmp_path / "f").read_bytes() == b"b"
    assert os.listdir(tmp_path) == ["f"]


def test_concurrent_writers_never_produce_a_torn_file(tmp_path) -> None:
    """Writers each replace the file with 1 MiB of their own byte, written in pieces; a reader that
    opens it at any moment sees exactly one writer's whole payload (a plain open-and-write would
    show empty, short and mixed files here)."""
    p = tmp_path / "f"
    size, piece = 1 << 20, 64 << 10
    atomic_write(p, b"\0" * size, fsync=False)
    stop = time.monotonic() + 3.0
    errors: list[BaseException] = []
    writes = [0] * 4

    def writer(i: int) -> None:
        try:
            data = bytes([65 + i]) * piece
            while time.monotonic() < stop and writes[i] < 300:
                with atomic_writer(p, fsync=False) as f:
                    for _ in range(size // piece):
                        f.write(data)
                writes[i] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(writes))]
    for t in threads:
        t.start()
    reads, seen = 0, set()
    while any(t.is_alive() for t in threads) and reads < 5000:
        got = p.read_bytes()
        assert len(got) == size, f"read {len(got)} bytes: a torn file"
        assert got.count(got[:1]) == size, "bytes of two writers in one file"
        seen.add(got[:1])
        reads += 1
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert sum(writes) >= len(writes) and reads > 0
    assert os.listdir(tmp_path) == ["f"], "temp files left behind"
