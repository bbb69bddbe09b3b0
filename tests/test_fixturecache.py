"""The fixture cache (weenv/testing/_fixturecache.py): entries of the right kind, checked on every read."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from weenv.testing import (BadEntry, BuildError, FixtureCacheError, cache_root, cached, check_executable, check_tar,
                           check_tree, find)

MEMBERS = ("etc/os-release", "usr/bin/python3")


def write_tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


GOOD = {"etc/os-release": b"ID=debian\n", "usr/bin/python3": b"\x7fELF" + b"x" * 4000}


class Builder:
    """Records each build; writes a good tar (or what ``make`` says) at the path it is given."""

    def __init__(self, make=None) -> None:  # type: ignore[no-untyped-def]
        self.outs: list[Path] = []
        self.make = make or (lambda out: write_tar(out, GOOD))

    def __call__(self, out: Path) -> None:
        self.outs.append(out)
        self.make(out)


def get(root: Path, builder: Builder, name: str = "image.tar") -> Path:
    return cached(name, builder, lambda p: check_tar(p, MEMBERS), root=root)


def test_builds_once_under_its_own_suffix_in_a_private_dir_then_reuses(tmp_path) -> None:
    b = Builder()
    path = get(tmp_path, b)
    assert path == tmp_path / "image.tar" and path.is_file()
    (out,) = b.outs
    assert out.name == "image.tar" and out.parent.parent == tmp_path and out.parent.name.startswith(".image.tar.build-")
    assert not out.parent.exists()  # scratch removed
    assert get(tmp_path, b) == path and len(b.outs) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.tar", "image.tar.lock"]


@pytest.mark.parametrize("damage", ["directory", "truncated", "garbage_tail", "missing_member", "empty", "symlink"])
def test_an_entry_that_is_not_what_it_claims_is_rebuilt(tmp_path, damage: str) -> None:
    entry = tmp_path / "image.tar"
    if damage == "directory":  # what the old _mmdebstrap_tar left behind
        (entry / "etc").mkdir(parents=True)
        (entry / "etc" / "os-release").write_text("ID=debian\n")
    elif damage == "truncated":
        write_tar(entry, GOOD)
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 3])  # mid-member: tarfile alone reads this as a shorter tar
    elif damage == "garbage_tail":
        write_tar(entry, {"etc/os-release": b"x", "usr/bin/python3": b"y"})
        data = entry.read_bytes()
        entry.write_bytes(data[:1536] + b"\x01" * (len(data) - 1536))
    elif damage == "missing_member":
        write_tar(entry, {"etc/os-release": b"ID=debian\n"})
    elif damage == "empty":
        entry.write_bytes(b"")
    else:
        write_tar(tmp_path / "elsewhere.tar", GOOD)
        entry.symlink_to(tmp_path / "elsewhere.tar")
    with pytest.raises(BadEntry):
        check_tar(entry, MEMBERS)
    assert find("image.tar", lambda p: check_tar(p, MEMBERS), root=tmp_path) is None
    b = Builder()
    path = get(tmp_path, b)
    assert len(b.outs) == 1 and not path.is_symlink()
    check_tar(path, MEMBERS)
    with tarfile.open(path) as tf:
        assert tf.extractfile("./etc/os-release").read() == b"ID=debian\n"  # type: ignore[union-attr]


def test_builder_output_that_fails_its_check_never_enters_the_cache(tmp_path) -> None:
    def make_dir(out: Path) -> None:  # mmdebstrap given a name not ending in .tar
        (out / "etc").mkdir(parents=True)

    with pytest.raises(BuildError, match=r"image\.tar.*is a directory, not a tar file"):
        get(tmp_path, Builder(make_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.tar.lock"]


def test_a_failing_builder_leaves_nothing_behind_and_the_next_build_works(tmp_path) -> None:
    def fail(out: Path) -> None:
        out.write_bytes(b"half")
        raise subprocess.CalledProcessError(1, ["mmdebstrap"], stderr="no mirror")

    with pytest.raises(subprocess.CalledProcessError):
        get(tmp_path, Builder(fail))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.tar.lock"]
    (tmp_path / ".image.tar.build-999999").mkdir()  # a builder killed mid-way
    check_tar(get(tmp_path, Builder()), MEMBERS)
    assert not (tmp_path / ".image.tar.build-999999").exists()


def test_other_kinds_of_entry_are_checked_too(tmp_path) -> None:
    (tmp_path / "script").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "script", 0o755)
    with pytest.raises(BadEntry, match="not an ELF"):
        check_executable(tmp_path / "script")
    os.chmod(tmp_path / "script", 0o644)
    with pytest.raises(BadEntry, match="not executable"):
        check_executable(tmp_path / "script")
    check_executable(Path(sys.executable).resolve())
    (tmp_path / "tree").mkdir()
    with pytest.raises(BadEntry, match="tree lacks os.py"):
        check_tree(tmp_path / "tree", ("os.py",))
    with pytest.raises(BadEntry, match="not a directory"):
        check_tree(tmp_path / "script", ())
    with pytest.raises(BadEntry, match="missing"):
        check_tar(tmp_path / "nope.tar")


def test_cache_root_comes_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WEENV_FIXTURE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert cached("x.tar", Builder(), lambda p: check_tar(p, MEMBERS)) == tmp_path / "x.tar"
    monkeypatch.setenv("WEENV_FIXTURE_CACHE", "relative/dir")
    with pytest.raises(FixtureCacheError, match="WEENV_FIXTURE_CACHE must be an absolute .*, got 'relative/dir'"):
        cache_root()
    monkeypatch.delenv("WEENV_FIXTURE_CACHE")
    assert cache_root() == Path("/var/cache/weenv-fixtures")
    for bad in ("", "a/b", ".hidden", "x.lock"):
        with pytest.raises(ValueError, match="fixture cache entry name"):
            cached(bad, Builder(), check_tar, root=tmp_path)


CONCURRENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tests.test_fixturecache import GOOD, MEMBERS, write_tar
    from weenv.testing import cached, check_tar

    root, log = Path(sys.argv[1]), Path(sys.argv[2])
    def build(out):
        with open(log, "a") as f:
            f.write(f"{out}\\n")
        time.sleep(0.5)
        write_tar(out, GOOD)
    print(cached("image.tar", build, lambda p: check_tar(p, MEMBERS), root=root))
""")


def test_concurrent_processes_build_an_entry_once(tmp_path) -> None:
    root, log = tmp_path / "cache", tmp_path / "builds.log"
    (root / "image.tar").mkdir(parents=True)  # and all of them find a bad entry to replace
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(root), str(log)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent) for _ in range(4)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, results
    assert {out.strip() for out, _ in results} == {str(root / "image.tar")}
    assert len(log.read_text().splitlines()) == 1
    check_tar(root / "image.tar", MEMBERS)


# ---------------------------------------------------- the real mmdebstrap path, with a stand-in tool

FAKE_MMDEBSTRAP = """#!/bin/sh
# Stands in for mmdebstrap: the last argument is the target, and like mmdebstrap this writes a tar
# only when the name ends in .tar ({always_dir}: always a directory); anything else becomes a directory.
for a; do target=$a; done
root=$(mktemp -d)
mkdir -p "$root/etc" "$root/usr/bin"
echo 'ID=debian' > "$root/etc/os-release"
echo 12.4 > "$root/etc/debian_version"
printf '#!/bin/sh\\n' > "$root/usr/bin/dpkg"
case "$target" in
    *.tar) if [ {always_dir} = no ]; then tar -cf "$target" -C "$root" .; rm -rf "$root"; exit 0; fi ;;
esac
mkdir -p "$target" && cp -a "$root/." "$target/"
rm -rf "$root"
"""


def fake_mmdebstrap(bin_dir: Path, monkeypatch, *, always_dir: bool = False) -> None:
    bin_dir.mkdir()
    tool = bin_dir / "mmdebstrap"
    tool.write_text(FAKE_MMDEBSTRAP.replace("{always_dir}", "yes" if always_dir else "no"))
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_mmdebstrap_tar_of_the_debian_test_is_a_tar_on_an_empty_cache(tmp_path, monkeypatch) -> None:
    from tests.test_registry_image import _mmdebstrap_tar

    monkeypatch.setenv("WEENV_FIXTURE_CACHE", str(tmp_path / "cache"))
    fake_mmdebstrap(tmp_path / "bin", monkeypatch)
    path = Path(_mmdebstrap_tar())
    assert path.parent == tmp_path / "cache" and path.suffix == ".tar"
    check_tar(path, ("etc/os-release", "etc/debian_version", "usr/bin/dpkg"))
    with tarfile.open(path) as tf:  # what the Debian test itself does with it
        assert len(tf.getmembers()) >= 3
    assert _mmdebstrap_tar() == str(path)  # the second run reuses it


def test_mmdebstrap_tar_fails_rather_than_caching_a_directory(tmp_path, monkeypatch) -> None:
    from tests.test_registry_image import _mmdebstrap_tar

    monkeypatch.setenv("WEENV_FIXTURE_CACHE", str(tmp_path / "cache"))
    fake_mmdebstrap(tmp_path / "bin", monkeypatch, always_dir=True)
    with pytest.raises(BuildError, match="is a directory, not a tar file"):
        _mmdebstrap_tar()
    assert not list((tmp_path / "cache").glob("*.tar"))


def test_demo_uses_a_cached_debian_tar_only_when_it_is_valid(tmp_path, monkeypatch) -> None:
    from weenv._demo import _os_source

    cache = tmp_path / "cache"
    monkeypatch.setenv("WEENV_FIXTURE_CACHE", str(cache))
    (cache / "debian-bookworm-minbase-0000.tar" / "etc").mkdir(parents=True)  # the old bug's leftover
    write_tar(cache / "debian-bookworm-minbase-python3-1111.tar", {**GOOD, "etc/debian_version": b"12\n",
                                                                   "usr/bin/dpkg": b"d"})
    src, label = _os_source(tmp_path / "w1")
    assert label == "busybox (static)" and src == str(tmp_path / "w1" / "os")
    good = cache / "debian-bookworm-minbase-2222.tar"
    write_tar(good, {**GOOD, "etc/debian_version": b"12\n", "usr/bin/dpkg": b"d"})
    assert _os_source(tmp_path / "w2") == (str(good), "Debian bookworm minbase (cached mmdebstrap tar)")
