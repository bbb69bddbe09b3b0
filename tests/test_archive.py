"""Tar archives into and out of an env (``Env.put_archive`` / ``get_archive``): what COPY in
``weenv build -f`` and the Docker API's archive calls carry. On the real daemon."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

import weenv

pytestmark = pytest.mark.integration


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]], mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode, format=tarfile.PAX_FORMAT) as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, *, type: bytes = tarfile.REGTYPE, mode: int = 0o644, uid: int = 0, gid: int = 0,
          size: int = 0, linkname: str = "", mtime: int = 1_700_000_000, pax: dict | None = None) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.size, ti.linkname, ti.mtime = type, mode, uid, gid, size, linkname, mtime
    if pax:
        ti.pax_headers = pax
    return ti


def test_put_archive_keeps_types_modes_owners_and_times_and_get_archive_gives_them_back(daemon):
    members = [
        (_info("app", type=tarfile.DIRTYPE, mode=0o750, uid=1000, gid=1000), None),
        (_info("app/run.sh", mode=0o4755, size=10, uid=0, gid=0), b"#!/bin/sh\n"),
        (_info("app/data/x.txt", mode=0o600, uid=1000, gid=50, size=3, pax={"SCHILY.xattr.user.note": "hi"}), b"abc"),
        (_info("app/link", type=tarfile.SYMTYPE, linkname="/etc/passwd"), None),
        (_info("app/hard", type=tarfile.LNKTYPE, linkname="app/data/x.txt"), None),
        (_info("app/" + "n" * 250, size=1), b"z"),
    ]
    with daemon.client() as c:
        env = c.create(daemon.plan_lock)
        try:
            env.mkdir("/srv")
            done = env.put_archive("/srv", _tar(members, "w:gz"))
            assert done.path == "/srv" and done.size_bytes > 0
            out = env.exec(["sh", "-c", "cd /srv/app && stat -c '%n %a %u %g %h %Y' run.sh data/x.txt hard . && "
                                        "readlink link && cat hard && echo && ls | wc -l"]).stdout.decode().split("\n")
            assert out[:4] == ["run.sh 4755 0 0 1 1700000000", "data/x.txt 600 1000 50 2 1700000000",
                               "hard 600 1000 50 2 1700000000", ". 750 1000 1000 3 1700000000"], out
            assert out[4:7] == ["/etc/passwd", "abc", "5"], out
            # the daemon never followed the member symlink to a host file, and the env's own file is there
            assert env.read_file("/srv/app/link") == env.read_file("/etc/passwd")
            back = tarfile.open(fileobj=io.BytesIO(env.get_archive("/srv/app")))
            got = {m.name: m for m in back.getmembers()}
            assert set(got) == {"app", "app/run.sh", "app/data", "app/data/x.txt", "app/link", "app/hard",
                                "app/" + "n" * 250}
            assert got["app/run.sh"].mode == 0o4755 and back.extractfile("app/run.sh").read() == b"#!/bin/sh\n"
            assert (got["app/data/x.txt"].uid, got["app/data/x.txt"].gid) == (1000, 50)
            assert got["app/hard"].islnk() or got["app/data/x.txt"].islnk()
            assert got["app/link"].issym() and got["app/link"].linkname == "/etc/passwd"
            one = tarfile.open(fileobj=io.BytesIO(env.get_archive("/srv/app/data/x.txt")))
            assert one.getnames() == ["x.txt"] and one.extractfile("x.txt").read() == b"abc"
        finally:
            env.kill()


def test_bad_archives_are_refused_naming_the_member_and_change_nothing_outside(daemon, tmp_path):
    with daemon.client() as c:
        env = c.create(daemon.plan_lock)
        try:
            for members, words in (
                ([(_info("../../escape", size=1), b"x")], "'../../escape' climbs out of the destination"),
                ([(_info("dev", type=tarfile.CHRTYPE), None)], "'dev' is a device node"),
                ([(_info("h", type=tarfile.LNKTYPE, linkname="nothere"), None)], "links to 'nothere'"),
            ):
                with pytest.raises(weenv.ApiError) as e:
                    env.put_archive("/tmp", _tar(members))
                assert e.value.status == 400 and words in str(e.value), e.value
            with pytest.raises(weenv.ApiError, match="not a readable tar"):
                env.put_archive("/tmp", b"this is not a tar archive" * 40)
            with pytest.raises(weenv.ApiError, match="must be a directory"):
                env.put_archive("/etc/passwd", _tar([(_info("a", size=1), b"a")]))
            with pytest.raises(weenv.ApiError) as nf:
                env.get_archive("/no/such/path")
            assert nf.value.status == 404
            # a symlink in the env pointing at a host path is resolved inside the rootfs
            env.exec(["sh", "-c", f"mkdir -p {tmp_path} && ln -s {tmp_path} /tmp/hostdir"])
            env.put_archive("/tmp/hostdir", _tar([(_info("planted", size=2), b"no")]))
            assert not os.path.exists(tmp_path / "planted")
            assert env.exec(["cat", f"{tmp_path}/planted"]).stdout == b"no"
        finally:
            env.kill()
