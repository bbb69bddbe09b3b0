"""`weenv build` never writes a lock weenv refuses (issue 14.4): a group class that cannot go on top
of the base's groups is refused before any step runs, with a message saying what to do.

Logic only: the client is a fake that records calls (the build itself runs in test_snapshots.py).
"""

from __future__ import annotations

import hashlib

import pytest

import weenv.plan as wp
from weenv.build import BuildError, build
from weenv.plan import LockedGroup


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _group(name: str, cls: str) -> LockedGroup:
    return LockedGroup(name=name, ref=f"{name}:v1", group_class=cls, digest=_digest(name + "m"),
                       layer_digest=_digest(name + "l"), layer_size=100, toc_digest=_digest(name + "t"), repo=name)


BASE = wp.Lock(lock_version=1, name="base", groups=[_group("os", "os"), _group("py", "toolchain"), _group("t1", "task")])


class Reached(Exception):
    """The fake client was asked for something: the build got past its checks."""


class FakeClient:
    def __init__(self, snapshot_lock: dict | None = None):
        self.calls: list[tuple[str, str]] = []
        self.snapshot_lock = snapshot_lock

    def snapshot(self, snapshot_id: str):  # type: ignore[no-untyped-def]
        """As weenv.Client.snapshot: the daemon's SnapshotDetail."""
        from weenv import _wire as wire

        self.calls.append(("GET", f"/v1/snapshots/{snapshot_id}"))
        if self.snapshot_lock is None:
            raise Reached(snapshot_id)
        return wire.SnapshotDetail(id=snapshot_id, layers=[], lock=self.snapshot_lock)

    def create(self, *a: object, **kw: object):  # type: ignore[no-untyped-def]
        self.calls.append(("create", ""))
        raise Reached("create")

    def close(self) -> None:
        pass


def _spec(tmp_path, frm: str, name: str, cls: str) -> str:
    spec = tmp_path / "build.toml"
    spec.write_text(f'from = "{frm}"\n[group]\nname = "{name}"\nclass = "{cls}"\n[[steps]]\nrun = "true"\n')
    return str(spec)


def test_a_group_class_below_the_base_top_is_refused_before_building(tmp_path):
    wp.write_plan(BASE, tmp_path / "base.lock.toml")
    spec = _spec(tmp_path, "base.lock.toml", "gcc", "toolchain")
    client = FakeClient()
    with pytest.raises(BuildError) as info:
        build(spec, client=client)  # type: ignore[arg-type]
    assert client.calls == []  # nothing ran, nothing was published
    msg = str(info.value)
    assert msg.startswith(f"{spec}: group.class = 'toolchain' cannot be built FROM 'base.lock.toml': its groups[2] "
                          "(t1) is class 'task'"), msg
    assert "give the built group class 'task'" in msg and "list those after the built group" in msg


def test_a_plan_base_is_checked_before_it_is_locked(tmp_path):
    (tmp_path / "base.toml").write_text(
        'name = "b"\n[[groups]]\nname = "os"\nref = "debian:12"\nclass = "os"\n'
        '[[groups]]\nname = "h"\nref = "harness:v1"\nclass = "harness"\n')
    with pytest.raises(BuildError, match=r"class 'harness', 'evaluator', 'task'"):
        build(_spec(tmp_path, "base.toml", "tc", "toolchain"), client=FakeClient())  # type: ignore[arg-type]


def test_a_snapshot_base_is_checked_too(tmp_path):
    client = FakeClient(snapshot_lock=wp.plan_to_builtins(BASE))
    with pytest.raises(BuildError, match=r"cannot be built FROM 'snap-abc': its groups\[2\] \(t1\)"):
        build(_spec(tmp_path, "snap-abc", "tc", "harness"), client=client)  # type: ignore[arg-type]
    assert client.calls == [("GET", "/v1/snapshots/snap-abc")]


@pytest.mark.parametrize("keep,name,cls", [
    ((0, 1, 2), "t2", "task"),  # at the base's top class
    ((0, 2), "t1", "toolchain"),  # replaces the one group above it
    ((0, 1), "gcc", "toolchain"),  # next to a group of its own class
])
def test_classes_that_fit_on_top_go_ahead(tmp_path, keep, name, cls):
    base = wp.Lock(lock_version=1, name="b", groups=[BASE.groups[i] for i in keep])
    wp.write_plan(base, tmp_path / "base.lock.toml")
    with pytest.raises(Reached):
        build(_spec(tmp_path, "base.lock.toml", name, cls), client=FakeClient())  # type: ignore[arg-type]
