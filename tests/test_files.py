"""Safe file operations inside a rootfs: hostile symlinks, atomic writes, ownership, special files.

Every test runs twice: with openat2 (the kernel resolves inside the root) and with the
component-by-component fallback used where openat2 is missing.
"""

from __future__ import annotations

import os
import stat

import pytest

from weenv.provision._errors import EnvFileError, EnvFileNotFoundError, EnvFileTooLargeError, EnvFileTypeError
from weenv.provision._errors import UserNotFoundError
from weenv.provision.envs._fileops import resolve_user
from weenv.provision.envs._files import OPENAT2_AVAILABLE, RootFS, normalize
from weenv.provision.runtime._ocispec import User


@pytest.fixture(params=["openat2", "walk"])
def fs_and_host(request, tmp_path):
    """(RootFS, root dir, a 'host' dir outside the root holding a secret file)."""
    if request.param == "openat2" and not OPENAT2_AVAILABLE:
        pytest.skip("this kernel has no openat2 (ENOSYS): only the fallback walk applies")
    root = tmp_path / "root"
    host = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "etc/hostname").write_text("inside\n")
    (root / "tmp").mkdir()
    host.mkdir()
    (host / "secret").write_text("HOST SECRET\n")
    fs = RootFS(str(root), use_openat2=request.param == "openat2")
    yield fs, root, host
    fs.close()


# -- resolution stays inside the root --------------------------------------------------------


def test_absolute_symlink_to_a_host_path_resolves_inside_the_root(fs_and_host):
    fs, root, host = fs_and_host
    os.symlink(str(host / "secret"), root / "abs")
    os.symlink("/etc/hostname", root / "etc-link")
    with pytest.raises(EnvFileNotFoundError):
        fs.read("/abs")  # the host path does not exist inside the root
    (root / str(host / "secret").lstrip("/")).parent.mkdir(parents=True)
    (root / str(host / "secret").lstrip("/")).write_text("decoy inside\n")
    assert fs.read("/abs") == b"decoy inside\n"
    assert fs.read("etc-link") == b"inside\n"


def test_dotdot_chains_and_relative_symlinks_cannot_climb_out(fs_and_host):
    fs, root, host = fs_and_host
    depth = len(root.parts) + 3
    os.symlink("../" * depth + str(host / "secret").lstrip("/"), root / "up")
    os.symlink("../../../../..", root / "tmp/top")
    with pytest.raises(EnvFileNotFoundError):
        fs.read("/up")
    assert fs.read("/tmp/top/etc/hostname") == b"inside\n"
    assert fs.read("/../../../etc/hostname") == b"inside\n"
    assert normalize("../../x/./y/..") == "/x"


def test_symlinked_directory_to_host_root_is_the_env_root(fs_and_host):
    fs, root, host = fs_and_host
    os.symlink("/", root / "escape")
    assert fs.read("escape/etc/hostname") == b"inside\n"
    fs.write("escape/tmp/new", b"x")
    assert (root / "tmp/new").read_bytes() == b"x"
    assert [e.name for e in fs.list("escape/etc")] == ["hostname"]


def test_symlink_loop_is_an_error_not_a_hang(fs_and_host):
    fs, root, _host = fs_and_host
    os.symlink("b", root / "a")
    os.symlink("a", root / "b")
    with pytest.raises(EnvFileError, match="symbolic links"):
        fs.read("/a")


# -- writes ------------------------------------------------------------------------------------


def test_write_replaces_a_symlink_to_a_host_file_instead_of_following_it(fs_and_host):
    fs, root, host = fs_and_host
    os.symlink(str(host / "secret"), root / "etc/evil")
    fs.write("/etc/evil", b"new content\n")
    assert (host / "secret").read_text() == "HOST SECRET\n"
    assert not os.path.islink(root / "etc/evil")
    assert (root / "etc/evil").read_bytes() == b"new content\n"


def test_write_is_atomic_and_keeps_mode_and_owner_of_the_file_it_replaces(fs_and_host):
    fs, root, _host = fs_and_host
    target = root / "etc/conf"
    target.write_text("old")
    os.chmod(target, 0o640)
    os.chown(target, 1234, 4321)
    inode_before = os.stat(target).st_ino
    fs.write("/etc/conf", b"new")
    st = os.stat(target)
    assert target.read_bytes() == b"new"
    assert st.st_ino != inode_before  # a new file renamed into place, not an in-place rewrite
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, 1234, 4321)
    assert sorted(os.listdir(root / "etc")) == ["conf", "hostname"]  # no temp file left


def test_new_files_and_dirs_belong_to_the_env_user(fs_and_host, tmp_path):
    _fs, root, _host = fs_and_host
    with RootFS(str(root), uid=1000, gid=1001) as fs:
        fs.write("/home/user/notes/a.txt", b"hi", make_parents=True, mode=0o600)
        for rel in ("home", "home/user", "home/user/notes", "home/user/notes/a.txt"):
            st = os.stat(root / rel)
            assert (st.st_uid, st.st_gid) == (1000, 1001), rel
        assert stat.S_IMODE(os.stat(root / "home/user/notes/a.txt").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(root / "home/user/notes").st_mode) == 0o755


def test_write_into_a_directory_path_or_the_root_is_refused(fs_and_host):
    fs, _root, _host = fs_and_host
    with pytest.raises(EnvFileTypeError):
        fs.write("/etc", b"x")
    with pytest.raises(EnvFileTypeError):
        fs.write("/", b"x")
    with pytest.raises(EnvFileNotFoundError):
        fs.write("/no/such/dir/file", b"x")


def test_write_failure_leaves_no_temp_file(fs_and_host):
    fs, root, _host = fs_and_host
    (root / "etc/dir").mkdir()
    with pytest.raises(EnvFileTypeError):
        fs.write("/etc/dir", b"x")
    assert sorted(os.listdir(root / "etc")) == ["dir", "hostname"]


# -- reads of special files --------------------------------------------------------------------


def test_fifo_and_devices_are_never_opened(fs_and_host):
    fs, root, _host = fs_and_host
    os.mkfifo(root / "tmp/fifo")
    os.mknod(root / "tmp/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    for p in ("/tmp/fifo", "/tmp/null"):
        with pytest.raises(EnvFileTypeError, match="not a regular file"):
            fs.read(p)  # a FIFO open would block this thread forever
    with pytest.raises(EnvFileTypeError, match="is a directory"):
        fs.read("/etc")


def test_read_limit(fs_and_host):
    fs, root, _host = fs_and_host
    (root / "tmp/big").write_bytes(b"x" * 5000)
    assert fs.read("/tmp/big", max_bytes=5000) == b"x" * 5000
    with pytest.raises(EnvFileTooLargeError):
        fs.read("/tmp/big", max_bytes=4999)


# -- list, stat, mkdir, remove -----------------------------------------------------------------


def test_list_and_stat_report_symlinks_as_symlinks(fs_and_host):
    fs, root, host = fs_and_host
    os.symlink(str(host), root / "tmp/hostdir")
    (root / "tmp/f").write_bytes(b"abc")
    entries = {e.name: e for e in fs.list("/tmp")}
    assert entries["hostdir"].kind == "symlink" and entries["hostdir"].link_target == str(host)
    assert entries["f"].kind == "file" and entries["f"].size_bytes == 3
    assert fs.stat("/tmp/hostdir").kind == "symlink"
    assert fs.stat("/").kind == "dir"
    with pytest.raises(EnvFileTypeError):
        fs.list("/tmp/f")
    # listing through the symlink lists the (missing) env path, not the host dir
    with pytest.raises(EnvFileNotFoundError):
        fs.list("/tmp/hostdir")


def test_mkdir_through_symlinks_stays_inside_the_root(fs_and_host):
    fs, root, host = fs_and_host
    os.symlink(str(host), root / "tmp/hostdir")
    # Dangling inside the env (the host dir exists only on the host): refused like `mkdir -p`.
    with pytest.raises(EnvFileTypeError):
        fs.mkdir("/tmp/hostdir/sub")
    assert not (host / "sub").exists()
    # Once the target exists inside the env, the symlink leads there.
    (root / str(host).lstrip("/")).mkdir(parents=True)
    fs.mkdir("/tmp/hostdir/sub/deeper")
    assert not (host / "sub").exists()
    assert (root / str(host).lstrip("/") / "sub/deeper").is_dir()
    with pytest.raises(EnvFileTypeError):
        fs.mkdir("/etc/hostname/x")
    with pytest.raises(EnvFileError, match="already exists"):
        fs.mkdir("/etc", exist_ok=False)
    with pytest.raises(EnvFileNotFoundError):
        fs.mkdir("/a/b", parents=False)


def test_remove_unlinks_symlinks_and_never_their_targets(fs_and_host):
    fs, root, host = fs_and_host
    os.symlink(str(host), root / "tmp/hostdir")
    (root / "tmp/tree/a/b").mkdir(parents=True)
    (root / "tmp/tree/a/b/f").write_text("x")
    os.symlink(str(host), root / "tmp/tree/a/link-to-host")
    fs.remove("/tmp/hostdir")
    fs.remove("/tmp/tree", recursive=True)
    assert (host / "secret").read_text() == "HOST SECRET\n"
    assert os.listdir(root / "tmp") == []
    (root / "tmp/d").mkdir()
    (root / "tmp/d/f").write_text("x")
    with pytest.raises(EnvFileError, match="not empty"):
        fs.remove("/tmp/d")
    with pytest.raises(EnvFileNotFoundError):
        fs.remove("/tmp/nothing")
    with pytest.raises(EnvFileTypeError):
        fs.remove("/")


def test_bad_paths(fs_and_host):
    fs, _root, _host = fs_and_host
    for bad in ("", "a\0b"):
        with pytest.raises(EnvFileError):
            fs.read(bad)


def test_missing_rootfs_is_a_clear_error(tmp_path):
    with pytest.raises(EnvFileNotFoundError, match="rootfs"):
        RootFS(str(tmp_path / "nope"))


# -- users from the env's own account files ----------------------------------------------------


def test_resolve_user_reads_the_env_files_and_never_the_host(busybox_rootfs, tmp_path):
    assert resolve_user(busybox_rootfs, "user") == User(uid=1000, gid=1000, additional_gids=(10,), home="/home/user", name="user")
    assert resolve_user(busybox_rootfs, None).uid == 0
    # A hostile /etc/passwd symlink to the host's file is read inside the env (and is missing).
    host_passwd = tmp_path / "host-passwd"
    host_passwd.write_text("intruder:x:0:0::/:/bin/sh\n")
    os.unlink(os.path.join(busybox_rootfs, "etc/passwd"))
    os.symlink(str(host_passwd), os.path.join(busybox_rootfs, "etc/passwd"))
    with pytest.raises(UserNotFoundError):
        resolve_user(busybox_rootfs, "intruder")
    assert resolve_user(busybox_rootfs, "0").uid == 0  # numeric ids need no entry
