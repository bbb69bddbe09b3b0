"""User namespaces (issue 16 item 1, docs/security.md "User namespaces"): env root is an unprivileged
host uid; layers keep their owners; host-side trees and the rootfs mount are inert on the host.

The integration tests run one daemon started with ``--userns`` (WEENV_USERNS=1) over busybox plus
two layers made for the purpose: ``caps`` (a setuid-root binary, a ``cap_sys_admin=ep`` binary, a
file of uid 1000) and ``devs`` (a char device node, as images sometimes ship). Layer trees are made
after the first start, so the second env of a plan stacks them.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass

import pytest

from weenv.layerfmt import FileReader, Layer, build_layer
from weenv.layerfmt._ids import OVERFLOW_ID, cap_to_host, cap_to_layer, to_host_id, to_layer_id
from weenv.provision.runtime._idmap import (DEFAULT_BASE, DeviceNodeInTreeError, IdMap, apply_userns, make_tree_inert,
                                    own_cgroups_only, trees_for_base)

from .fixtures_common import require_command, require_fuse
from .fixtures_daemon import DaemonHandle, busybox_plan, teardown_private_daemon, wait_for
from .layertrees import chardev, d, f, make_tree
from .test_snapshots import overlay_lowers

BASE = DEFAULT_BASE
CAP_SYS_ADMIN = 21
# security.capability v2, effective, permitted = {CAP_SYS_ADMIN}: what `setcap cap_sys_admin=ep` writes
CAP_V2 = struct.pack("<IIIII", 0x02000001, 1 << CAP_SYS_ADMIN, 0, 0, 0)

# `probe setcap PATH` writes cap_sys_admin=ep (v2) on PATH; `probe ids` prints its euid and CapEff
PROBE_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/xattr.h>
int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "setcap") == 0) {
        unsigned int v[5] = {0x02000001u, 1u << 21, 0, 0, 0};
        if (setxattr(argv[2], "security.capability", v, sizeof v, 0) != 0) { perror("setxattr"); return 1; }
        return 0;
    }
    char line[256]; unsigned long long eff = 0; FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof line, f)) sscanf(line, "CapEff: %llx", &eff);
    printf("%u %llx\n", (unsigned)geteuid(), eff);
    return 0;
}
"""


# ------------------------------------------------------------------------------- pure functions


def test_ids_shift_into_the_range_and_back_and_foreign_ids_become_nobody():
    assert to_host_id(0, BASE) == BASE and to_host_id(1000, BASE) == BASE + 1000
    assert to_host_id(70000, BASE) == BASE + OVERFLOW_ID  # beyond the range: nobody, never root
    assert to_layer_id(BASE + 1000, BASE) == 1000
    assert to_layer_id(0, BASE) == OVERFLOW_ID  # a host-root file in an upper is not root in a layer
    assert to_host_id(5, 0) == 5 and to_layer_id(5, 0) == 5  # no user namespace: unchanged


def test_a_v2_capability_becomes_v3_of_the_ranges_root_and_back():
    host = cap_to_host(CAP_V2, BASE)
    magic, perm = struct.unpack_from("<II", host)
    assert magic == 0x03000001 and perm == 1 << CAP_SYS_ADMIN
    assert struct.unpack_from("<I", host, 20)[0] == BASE and len(host) == 24
    assert cap_to_layer(host, BASE) == CAP_V2
    assert cap_to_host(CAP_V2, 0) == CAP_V2


def test_the_spec_gets_a_user_namespace_over_the_range():
    spec = apply_userns({"linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]}}, IdMap(base=BASE))
    assert [ns["type"] for ns in spec["linux"]["namespaces"]] == ["user", "pid", "mount"]
    assert spec["linux"]["uidMappings"] == [{"containerID": 0, "hostID": BASE, "size": 65536}]
    assert spec["linux"]["gidMappings"] == spec["linux"]["uidMappings"]
    with pytest.raises(ValueError, match="base 0 must be between"):
        IdMap(base=0)


def test_on_v1_the_env_gets_its_own_groups_bound_read_only_instead_of_crun_mounting_every_hierarchy():
    spec = {"mounts": [{"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["ro"]},
                       {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}],
            "linux": {"readonlyPaths": ["/proc/sys"]}}
    dirs = ["/sys/fs/cgroup/memory/weenv/e1", "/sys/fs/cgroup/pids/weenv/e1", "/sys/fs/cgroup/unified/weenv/e1"]
    out = own_cgroups_only(spec, dirs, "v1")
    assert [(m["destination"], m["type"], m.get("source")) for m in out["mounts"]] == [
        ("/sys/fs/cgroup", "tmpfs", "cgroup"), ("/sys/fs/cgroup/memory", "bind", "/sys/fs/cgroup/memory/weenv/e1"),
        ("/sys/fs/cgroup/pids", "bind", "/sys/fs/cgroup/pids/weenv/e1"), ("/tmp", "tmpfs", "tmpfs")]
    assert all("ro" in m["options"] for m in out["mounts"][1:3])
    assert out["linux"]["readonlyPaths"] == ["/proc/sys", "/sys/fs/cgroup", "/sys/fs/cgroup/memory",
                                             "/sys/fs/cgroup/pids"]
    v2 = {"mounts": [{"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"}]}
    assert own_cgroups_only(v2, ["/sys/fs/cgroup/weenv/e1"], "v2")["mounts"][0]["type"] == "cgroup"  # crun's


def test_trees_written_for_other_host_ids_are_dropped_when_the_base_changes(tmp_path):
    root = tmp_path / "layer-trees"
    make_tree(root / "sha256-aa", f("etc/passwd", b"root\n"))
    (root / "sha256-aa.size").write_text("5")
    assert trees_for_base(str(root), 0)  # no marker: written before user namespaces, for base 0
    assert sorted(os.listdir(root)) == ["sha256-aa", "sha256-aa.size"]
    assert not trees_for_base(str(root), BASE)  # --userns now: root-owned trees would show as nobody's
    assert os.listdir(root) == [] and (tmp_path / "layer-trees.id-base").read_text() == f"{BASE}\n"
    make_tree(root / "sha256-bb", f("x", b"x", uid=BASE, gid=BASE))
    assert trees_for_base(str(root), BASE) and (root / "sha256-bb").is_dir()
    assert not trees_for_base(str(root), 0) and os.listdir(root) == []  # back to --no-userns: dropped
    assert not (tmp_path / "layer-trees.id-base").exists()


def test_a_layer_built_from_an_upper_records_the_envs_ids(tmp_path):
    src = make_tree(tmp_path / "upper", d("root", uid=BASE, gid=BASE), f("root/a", b"a", uid=BASE, gid=BASE),
                    f("home/u", b"u", uid=BASE + 1000, gid=BASE + 1000),
                    f("bin/cap", b"c", uid=BASE, gid=BASE))
    os.setxattr(os.path.join(src, "bin", "cap"), "security.capability", cap_to_host(CAP_V2, BASE))  # after chown
    os.chown(src, BASE, BASE)
    out = tmp_path / "layer"
    with open(out, "wb") as fh:
        build_layer(src, fh, overlay_upper=True, id_base=BASE)
    entries = {e.path: e for e in Layer.open(FileReader.open(str(out))).entries}
    assert (entries["root/a"].uid, entries["root/a"].gid) == (0, 0)
    assert (entries["home/u"].uid, entries["home/u"].gid) == (1000, 1000)
    assert entries["bin/cap"].xattrs["security.capability"] == CAP_V2


def test_a_tree_with_a_device_node_is_refused_and_v2_capabilities_become_v3(tmp_path):
    make_tree(tmp_path / "t", f("bin/cap", b"c", uid=BASE, gid=BASE), chardev("dev/wh", 0, 0, uid=BASE, gid=BASE))
    os.setxattr(tmp_path / "t" / "bin" / "cap", "security.capability", CAP_V2)  # after chown (it drops them)
    assert make_tree_inert(str(tmp_path / "t"), BASE) == 1
    assert os.getxattr(tmp_path / "t" / "bin" / "cap", "security.capability") == cap_to_host(CAP_V2, BASE)
    make_tree(tmp_path / "u", chardev("dev/null", 1, 3, mode=0o600))
    with pytest.raises(DeviceNodeInTreeError, match=r"dev/null \(1:3\)"):
        make_tree_inert(str(tmp_path / "u"), BASE)


# --------------------------------------------------------------------------------- integration


@dataclass
class _UsernsDaemon(DaemonHandle):
    def env_vars(self) -> dict[str, str]:
        return {**super().env_vars(), "WEENV_USERNS": "1", "WEENV_LAYER_TREES_AFTER": "1"}


def _publish_dir(home: str, src: str, ref: str, group: str) -> None:
    from weenv.registry import publish

    old = os.environ.get("WEENV_HOME")
    os.environ["WEENV_HOME"] = home
    try:
        publish(src, ref, group=group, group_class="task")
    finally:
        if old is None:
            os.environ.pop("WEENV_HOME", None)
        else:
            os.environ["WEENV_HOME"] = old


def _plan(home: str, name: str, groups: list[tuple[str, str]], user: str | None = None) -> str:
    from weenv.plan import load_plan, lock_plan, write_plan
    from weenv.registry import resolve_group
    from weenv.testing._daemon import weenv_home

    path = os.path.join(home, f"{name}.toml")
    with open(path, "w") as fh:
        fh.write(f'name = "{name}"\n' + (f'user = "{user}"\n' if user else ""))
        for g, ref in groups:
            fh.write(f'[[groups]]\nname = "{g}"\nref = "{ref}"\nclass = "{"os" if g == "os" else "task"}"\n')
    lock = os.path.join(home, f"{name}.lock.toml")
    with weenv_home(home):
        write_plan(lock_plan(load_plan(path), resolve_group), lock)
    return lock


@pytest.fixture(scope="module")
def userns_daemon(tmp_path_factory):
    require_fuse()
    require_command("crun")
    home = tempfile.mkdtemp(prefix="weenv-userns-")
    plan, lock = busybox_plan(home)
    src = str(tmp_path_factory.mktemp("layers"))
    caps = make_tree(os.path.join(src, "caps"), d("opt"), f("opt/suid", b"#!/bin/sh\nid -u\n", mode=0o4755),
                     f("opt/capbin", b"x", mode=0o755), f("opt/mine", b"mine\n", uid=1000, gid=1000))
    os.setxattr(os.path.join(caps, "opt", "capbin"), "security.capability", CAP_V2)  # after chown (it drops them)
    devs = make_tree(os.path.join(src, "devs"), chardev("opt/dev/null", 1, 3, mode=0o666))
    _publish_dir(home, caps, "caps:test", "caps")
    _publish_dir(home, devs, "devs:test", "devs")
    shutil.rmtree(devs)  # a real device node: only as long as it takes to publish it
    locks = {"bb": lock,
             "caps": _plan(home, "caps", [("os", "busybox:test"), ("caps", "caps:test")]),
             "devs": _plan(home, "devs", [("os", "busybox:test"), ("devs", "devs:test")]),
             "user": _plan(home, "usr", [("os", "busybox:test")], user="user")}
    h = _UsernsDaemon(home, os.path.join(home, "run", "weenv.sock"), f"weenv-userns-{os.getpid()}", lock, plan,
                      os.path.join(home, "daemon.log"), None)  # type: ignore[arg-type]
    h.start()
    h.locks = locks  # type: ignore[attr-defined]
    try:
        yield h
    finally:
        left = teardown_private_daemon(h)
        assert not left, f"the userns tests left: {left}"


def _status_ids(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return int(fields["Uid"].split()[1]), int(fields["Gid"].split()[1])  # effective ids


def _upper(d: DaemonHandle, env_id: str) -> str:
    return os.path.join(d.home, "envs", env_id, "rw", "upper")


@pytest.mark.integration
def test_env_root_is_an_unprivileged_host_uid(userns_daemon):
    """Promise: env root is not host root: its uid_map starts at the range's base, and the host
    (`ps`, /proc/PID/status) sees the env's init and commands as that uid."""
    with userns_daemon.client() as c, c.create(userns_daemon.plan_lock) as env:
        assert env.exec(["cat", "/proc/self/uid_map"]).stdout.split() == [b"0", str(BASE).encode(), b"65536"]
        assert env.exec(["id", "-u"]).stdout == b"0\n"
        init_pid = next(e["init_pid"] for e in c.list() if e["id"] == env.id)
        assert _status_ids(init_pid) == (BASE, BASE)
        env.exec(["sh", "-c", "sleep 17 >/dev/null 2>&1 &"])
        sleepers = []
        for p in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{p}/cmdline", "rb") as fh:
                    if fh.read() == b"sleep\x0017\x00":
                        sleepers.append(p)
            except OSError:
                continue
        assert sleepers and all(_status_ids(p) == (BASE, BASE) for p in sleepers), sleepers
        ps = subprocess.run(["ps", "-o", "uid=", "-p", str(init_pid)], capture_output=True, text=True)
        assert ps.stdout.strip() == str(BASE)


@pytest.mark.integration
def test_files_in_lowers_keep_their_layer_owners_inside(userns_daemon):
    """Promise: inside, lower files are owned as in the layer (root, uid 1000); on the host the
    envlet shows them as range ids."""
    with userns_daemon.client() as c, c.create(userns_daemon.locks["caps"]) as env:
        r = env.exec(["stat", "-c", "%n %u:%g %a", "/bin/busybox", "/home/user", "/opt/mine", "/opt/suid"])
        assert r.stdout.decode().split("\n")[:4] == [
            "/bin/busybox 0:0 755", "/home/user 1000:1000 755", "/opt/mine 1000:1000 644", "/opt/suid 0:0 4755"]
        assert env.exec(["sh", "-c", "echo x > /opt/new && chown 1000:1000 /opt/mine"]).exit_code == 0
        lowers = overlay_lowers(userns_daemon, env.id)
        st = os.stat(os.path.join(lowers[-1], "home", "user"))  # the os layer, bottom
        assert (st.st_uid, st.st_gid) == (BASE + 1000, BASE + 1000)


@pytest.mark.integration
def test_files_the_env_writes_are_owned_by_range_ids_on_the_host(userns_daemon):
    """Promise: what env root (or the files API for it) writes lands on the host as the range's root."""
    with userns_daemon.client() as c, c.create(userns_daemon.plan_lock) as env:
        assert env.exec(["sh", "-c", "echo hi > /root/x; mkdir /home/user/d; chown 1000:1000 /home/user/d"]).exit_code == 0
        env.write_file("/root/api", b"api\n")
        env.write_file("/home/user/api", b"api\n", user="user")
        up = _upper(userns_daemon, env.id)
        for path, ids in (("root/x", BASE), ("root/api", BASE), ("home/user/d", BASE + 1000),
                          ("home/user/api", BASE + 1000)):
            st = os.lstat(os.path.join(up, path))
            assert (st.st_uid, st.st_gid) == (ids, ids), path
        assert env.exec(["stat", "-c", "%u", "/root/api", "/home/user/api"]).stdout == b"0\n1000\n"
        assert env.stat("/home/user/api")["uid"] == 1000  # the API reports the env's ids


@pytest.mark.integration
def test_commit_records_the_envs_ids_and_a_fork_sees_them(userns_daemon):
    """Promise: the committed layer records uid 0 / 1000 (not host ids); its snapshot tree on the
    host is owned by range ids; a fork stacking that tree sees root and user owners inside."""
    from weenv.provision.envs._trees import LayerTrees

    with userns_daemon.client() as c:
        env = c.create(userns_daemon.plan_lock)
        try:
            env.exec(["sh", "-c", "echo made > /root/made; echo u > /home/user/u; chown 1000:1000 /home/user/u"])
            snap_id = env.commit()
            snap = c.snapshot(snap_id)
            digest = snap["layers"][-1]["digest"]
            blob = os.path.join(userns_daemon.home, "store", "blobs", "sha256", digest.split(":", 1)[1])
            entries = {e.path: e for e in Layer.open(FileReader.open(blob)).entries}
            assert (entries["root/made"].uid, entries["root/made"].gid) == (0, 0)
            assert entries["home/user/u"].uid == 1000
            tree = os.path.join(userns_daemon.home, "snapshot-trees", LayerTrees.key(digest))
            assert os.lstat(os.path.join(tree, "root", "made")).st_uid == BASE
            assert os.lstat(os.path.join(tree, "home", "user", "u")).st_uid == BASE + 1000
            with c.create(snap_id) as child:
                assert tree in overlay_lowers(userns_daemon, child.id)
                assert child.exec(["stat", "-c", "%u:%g", "/root/made", "/home/user/u"]).stdout == b"0:0\n1000:1000\n"
                assert child.exec(["cat", "/root/made"]).stdout == b"made\n"
                assert child.exec(["sh", "-c", "echo more >> /root/made"]).exit_code == 0  # still root's own
        finally:
            env.kill()


def _ids_as_nobody(path: str) -> tuple[int, int]:
    """(euid, CapEff) of the probe at ``path`` run by an unprivileged host user (uid 65534)."""
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", path, "ids"],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    euid, eff = r.stdout.split()
    return int(euid), int(eff, 16)


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> str:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc with static libc to build the probe")
    d = tmp_path_factory.mktemp("probe")
    (d / "probe.c").write_text(PROBE_C)
    r = subprocess.run(["gcc", "-static", "-O1", "-o", str(d / "probe"), str(d / "probe.c")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot build a static probe: {r.stderr[-300:]}")
    return str(d / "probe")


@pytest.mark.integration
def test_setuid_root_and_capability_files_made_in_the_env_are_inert_in_snapshot_trees(userns_daemon, probe, tmp_path):
    """Promise: a setuid-root binary and a cap_sys_admin=ep binary that env root makes and commits
    give an unprivileged host user neither root nor the capability when run from the snapshot
    tree's files (controls: the same files made by host root do)."""
    from weenv.provision.envs._trees import LayerTrees

    require_command("setpriv")
    os.chmod(tmp_path, 0o755)
    control = os.path.join(tmp_path, "control")
    os.mkdir(control, 0o755)
    shutil.copy(probe, os.path.join(control, "suid"))
    os.chmod(os.path.join(control, "suid"), 0o4755)
    shutil.copy(probe, os.path.join(control, "cap"))
    os.setxattr(os.path.join(control, "cap"), "security.capability", CAP_V2)
    assert _ids_as_nobody(os.path.join(control, "suid"))[0] == 0  # made by host root: setuid root works
    assert _ids_as_nobody(os.path.join(control, "cap"))[1] & (1 << CAP_SYS_ADMIN)  # and the capability does

    with userns_daemon.client() as c, c.create(userns_daemon.plan_lock) as env:
        with open(probe, "rb") as fh:
            env.write_file("/root/probe", fh.read(), mode=0o755)
        r = env.exec(["sh", "-c", "cp /root/probe /root/suid && chmod 4755 /root/suid && "
                                  "cp /root/probe /root/cap && /root/probe setcap /root/cap"])
        assert r.exit_code == 0, r.stderr
        snap = c.snapshot(env.commit())
        digest = snap["layers"][-1]["digest"]
        tree = os.path.join(userns_daemon.home, "snapshot-trees", LayerTrees.key(digest))
        suid, cap = os.path.join(tree, "root", "suid"), os.path.join(tree, "root", "cap")
        assert os.lstat(suid).st_uid == BASE and os.lstat(suid).st_mode & 0o4000
        value = os.getxattr(cap, "security.capability")
        assert value[3] == 0x03 and struct.unpack_from("<I", value, 20)[0] == BASE  # the env root's only
        # run as they lie in the tree (copied with owner, mode and xattrs to a path nobody can walk)
        exposed = os.path.join(tmp_path, "exposed")
        os.mkdir(exposed, 0o755)
        subprocess.run(["cp", "-a", suid, cap, exposed], check=True)
        assert _ids_as_nobody(os.path.join(exposed, "suid"))[0] == BASE  # setuid to the range's root, not 0
        assert _ids_as_nobody(os.path.join(exposed, "cap"))[1] == 0
        entries = {e.path: e for e in Layer.open(FileReader.open(os.path.join(
            userns_daemon.home, "store", "blobs", "sha256", digest.split(":", 1)[1]))).entries}
        assert entries["root/cap"].xattrs["security.capability"] == CAP_V2  # the layer keeps it as made
        assert entries["root/suid"].uid == 0 and entries["root/suid"].mode & 0o4000


@pytest.mark.integration
def test_layer_trees_hold_range_ids_v3_capabilities_and_no_device_nodes(userns_daemon):
    """Promise: a layer's setuid-root and capability files are written to its host-side tree as
    range ids and a v3 capability of the range's root; a layer shipping a device node gets no tree
    (it stays on the envlet's nodev mount, where the node does not open)."""
    from weenv.provision.envs._trees import LayerTrees

    trees = os.path.join(userns_daemon.home, "layer-trees")
    with userns_daemon.client() as c:
        with c.create(userns_daemon.locks["caps"]), c.create(userns_daemon.locks["devs"]) as devs_env:
            lowers = overlay_lowers(userns_daemon, devs_env.id)
            envlet_devs = lowers[0]
            assert envlet_devs.startswith(os.path.join(userns_daemon.home, "envlet"))
            with pytest.raises(PermissionError):  # the envlet mount is nodev
                open(os.path.join(envlet_devs, "opt", "dev", "null"), "rb").close()
            assert devs_env.exec(["sh", "-c", "echo x > /opt/dev/null"]).exit_code != 0  # rootfs nodev inside
        snap_lock = userns_daemon.locks["caps"]
        assert wait_for(lambda: len([n for n in os.listdir(trees) if not n.startswith(".") and
                                     os.path.isdir(os.path.join(trees, n))]) >= 2, timeout_s=60), userns_daemon.log()[-2000:]
        assert wait_for(lambda: "ships a device node" in userns_daemon.log(), timeout_s=30)
        with c.create(snap_lock) as env:
            lowers = overlay_lowers(userns_daemon, env.id)
            assert all(p.startswith(trees + "/") for p in lowers), lowers
            top = lowers[0]
            st = os.lstat(os.path.join(top, "opt", "suid"))
            assert st.st_uid == BASE and st.st_mode & 0o4000
            value = os.getxattr(os.path.join(top, "opt", "capbin"), "security.capability")
            assert value[3] == 0x03 and struct.unpack_from("<I", value, 20)[0] == BASE
            assert os.lstat(os.path.join(top, "opt", "mine")).st_uid == BASE + 1000
            r = env.exec(["stat", "-c", "%u:%g %a", "/opt/suid", "/opt/mine"])
            assert r.stdout == b"0:0 4755\n1000:1000 644\n"
        # no tree anywhere on the host holds a device node other than a whiteout
        for root, dirs, files in os.walk(trees):
            for name in files:
                st = os.lstat(os.path.join(root, name))
                assert not ((os.path.stat.S_ISCHR(st.st_mode) or os.path.stat.S_ISBLK(st.st_mode)) and st.st_rdev), name
        dev_key = LayerTrees.key(next(g["layer_digest"] for g in _lock_groups(userns_daemon.locks["devs"])
                                      if g["name"] == "devs"))
        assert not os.path.exists(os.path.join(trees, dev_key))


def _lock_groups(lock_path: str) -> list[dict]:
    import tomllib

    with open(lock_path, "rb") as fh:
        return tomllib.load(fh)["groups"]


@pytest.mark.integration
def test_the_home_stays_root_only_and_the_env_root_walks_only_its_own_directory(userns_daemon):
    """Promise: $WEENV_HOME and envs/ stay 0700 root (the env's root never needs them: crun is given
    paths relative to the bundle); only envs/<id> and its bundle let the range's root group through."""
    with userns_daemon.client() as c, c.create(userns_daemon.plan_lock) as env:
        for path, mode, gid in ((userns_daemon.home, 0o700, 0), (os.path.join(userns_daemon.home, "envs"), 0o700, 0),
                                (os.path.join(userns_daemon.home, "envs", env.id), 0o710, BASE),
                                (os.path.join(userns_daemon.home, "envs", env.id, "bundle"), 0o710, BASE)):
            st = os.stat(path)
            assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, 0, gid), path
        key = os.stat(os.path.join(userns_daemon.home, "envs", env.id, "agent.sock.key"))
        assert (key.st_mode & 0o777, key.st_uid) == (0o600, 0)
        assert env.exec(["true"]).exit_code == 0


@pytest.mark.integration
def test_the_rootfs_mount_is_nosuid_nodev_on_the_host(userns_daemon):
    """Promise: while an env runs, its overlay on the host grants no setuid and opens no device."""
    with userns_daemon.client() as c, c.create(userns_daemon.plan_lock) as env:
        rootfs = os.path.join(userns_daemon.home, "envs", env.id, "rootfs")
        with open("/proc/self/mountinfo") as fh:
            opts = [line.split()[5] for line in fh if line.split()[4] == rootfs]
        assert opts and {"nosuid", "nodev"} <= set(opts[0].split(",")), opts


@pytest.mark.integration
def test_the_env_sees_only_its_own_cgroups_read_only(userns_daemon):
    """Promise: /sys/fs/cgroup in a user-namespaced env holds its own groups, none writable."""
    with userns_daemon.client() as c, c.create(userns_daemon.plan_lock) as env, c.create(userns_daemon.plan_lock):
        r = env.exec(["sh", "-c", "mkdir /sys/fs/cgroup/memory/x && echo CG-WRITABLE; touch /sys/fs/cgroup/x && "
                                  "echo TMPFS-WRITABLE; echo 1 > /sys/fs/cgroup/memory/memory.limit_in_bytes && "
                                  "echo LIMIT-WRITABLE; cat /sys/fs/cgroup/pids/pids.max; "
                                  "find /sys/fs/cgroup/memory -mindepth 1 -type d | wc -l"])
        assert b"WRITABLE" not in r.stdout and r.stderr.count(b"Read-only file system") == 3, r
        assert r.stdout.split() == [b"256", b"0"], r  # its own pids limit; no other env's group below


@pytest.mark.integration
def test_a_non_root_plan_user_works(userns_daemon):
    """Promise: a plan's `user` runs as that env uid (host: range base + uid) and writes its home."""
    with userns_daemon.client() as c, c.create(userns_daemon.locks["user"]) as env:
        r = env.exec(["sh", "-c", "id -u; echo hi > /home/user/f; cat /home/user/f; touch /root/no"])
        assert r.stdout.startswith(b"1000\nhi\n") and r.exit_code != 0  # /root is not theirs
        st = os.lstat(os.path.join(_upper(userns_daemon, env.id), "home", "user", "f"))
        assert (st.st_uid, st.st_gid) == (BASE + 1000, BASE + 1000)
