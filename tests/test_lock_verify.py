"""A lock protects what it pins (issue 14.3): every start checks digest, layer_digest, layer_size and
toc_digest against the store and the layers registered on the node; bad lock files get a 400 that
names the file (14.6); mount sources are checked again on the host, symlinks resolved (14.16).

Unit tests drive :class:`weenv.provision.envs._startcheck.LockVerifier` over a fake store; the
integration tests use the session daemon (real envlet, registry store, crun) and a real envlet.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import msgspec
import pytest

import weenv
import weenv.plan as wp
from weenv.plan import LockedGroup, LockError
from weenv.provision import SpecError
from weenv.provision.envs._startcheck import LockVerifier, check_mount_sources, check_registered

from .fixtures_daemon import leftovers


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _group_manifest(layer_digest: str, size: int, toc: str) -> bytes:
    from weenv.layerfmt import MEDIA_TYPE, TOC_DIGEST_ANNOTATION

    return json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "layers": [{"mediaType": MEDIA_TYPE, "digest": layer_digest, "size": size,
                                   "annotations": {TOC_DIGEST_ANNOTATION: toc}}],
                       "annotations": {TOC_DIGEST_ANNOTATION: toc}}).encode()


class FakeStore:
    """Manifests by (repo, digest); counts fetches."""

    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.fetches = 0

    def add(self, repo: str, data: bytes) -> str:
        self.manifests[(repo, _sha(data))] = data
        return _sha(data)

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str]:
        from weenv.registry import NotFoundError

        self.fetches += 1
        try:
            return self.manifests[(repo, reference)], "application/vnd.oci.image.manifest.v1+json"
        except KeyError:
            raise NotFoundError(f"manifest {repo}@{reference} not found") from None


def _lock_with(store: FakeStore) -> wp.Lock:
    layer, toc = _sha(b"layer"), _sha(b"toc")
    digest = store.add("busybox", _group_manifest(layer, 1234, toc))
    g = LockedGroup(name="os", ref="busybox:test", group_class="os", digest=digest, layer_digest=layer,
                    layer_size=1234, toc_digest=toc, repo="busybox")
    return wp.Lock(lock_version=1, name="bb", groups=[g])


def _edit(lock: wp.Lock, **fields: object) -> wp.Lock:
    return msgspec.structs.replace(lock, groups=[msgspec.structs.replace(lock.groups[0], **fields)])


@pytest.mark.parametrize("field,value,message", [
    ("digest", "sha256:" + "e" * 64,
     "lock 'bb': groups[0] (os): digest: the lock pins sha256:{e}, but the embedded store has no such manifest "
     "in repository 'busybox'"),
    ("layer_digest", "sha256:" + "d" * 64,
     "lock 'bb': groups[0] (os): layer_digest mismatch: the lock pins sha256:{d}, the manifest names sha256:"),
    ("layer_size", 5, "lock 'bb': groups[0] (os): layer_size mismatch: the lock pins 5, the manifest says 1234"),
    ("toc_digest", "sha256:" + "c" * 64,
     "lock 'bb': groups[0] (os): toc_digest mismatch: the lock pins sha256:{c}, the manifest says sha256:"),
])
def test_every_pinned_field_is_checked_against_the_store(field, value, message):
    store = FakeStore()
    lock = _lock_with(store)
    verifier = LockVerifier(lambda registry: store)
    verifier.check(lock)  # the lock as made passes
    assert store.fetches == 1
    with pytest.raises(LockError) as info:
        verifier.check(_edit(lock, **{field: value}))
    expected = re.sub(r"\{(\w)\}", lambda m: m[1] * 64, message)
    assert str(info.value).startswith(expected), str(info.value)
    assert info.value.group == "os"


def test_known_manifests_are_compared_in_memory_and_edits_still_refused():
    store = FakeStore()
    lock = _lock_with(store)
    verifier = LockVerifier(lambda registry: store)
    for _ in range(3):
        verifier.check(lock)
    assert store.fetches == 1 and verifier.missing(lock) == []
    # an edited size or TOC of a manifest already known is refused without asking the store again
    for edit in ({"layer_size": 1}, {"toc_digest": _sha(b"other")}, {"layer_digest": _sha(b"other")}):
        with pytest.raises(LockError, match="mismatch: the lock pins"):
            verifier.check(_edit(lock, **edit))
    assert store.fetches == 1


def test_a_manifest_whose_bytes_do_not_hash_to_the_pinned_digest_is_refused():
    store = FakeStore()
    lock = _lock_with(store)
    forged = _group_manifest(lock.groups[0].layer_digest, 99, lock.groups[0].toc_digest)
    store.manifests[("busybox", lock.groups[0].digest)] = forged  # a store serving other bytes
    with pytest.raises(LockError, match=r"groups\[0\] \(os\): digest mismatch: the lock pins sha256:\w+, the manifest "
                                        r"fetched for it hashes to " + _sha(forged)):
        LockVerifier(lambda registry: store).check(lock)


def test_the_remembered_manifests_are_bounded():
    store = FakeStore()
    verifier = LockVerifier(lambda registry: store, max_entries=2)
    locks = []
    for i in range(4):
        layer, toc = _sha(b"l%d" % i), _sha(b"t%d" % i)
        d = store.add("r", _group_manifest(layer, i, toc))
        locks.append(wp.Lock(lock_version=1, name="x", groups=[LockedGroup(
            name="os", ref="r:1", group_class="os", digest=d, layer_digest=layer, layer_size=i, toc_digest=toc,
            repo="r")]))
        verifier.check(locks[-1])
    assert len(verifier._pins) == 2 and verifier.missing(locks[0]) == [0] and verifier.missing(locks[3]) == []


def test_a_registered_layer_must_match_the_lock():
    store = FakeStore()
    lock = _lock_with(store)
    g = lock.groups[0]
    check_registered(lock, 0, g.layer_size, g.toc_digest)
    with pytest.raises(LockError, match=r"^lock 'bb': groups\[0\] \(os\): layer_size mismatch: the lock pins 1234, "
                                        r"the layer sha256:\w+ registered on this node has 99$"):
        check_registered(lock, 0, 99, g.toc_digest)
    with pytest.raises(LockError, match=r"toc_digest mismatch: the lock pins sha256:\w+, the layer"):
        check_registered(lock, 0, g.layer_size, _sha(b"x"))


def test_mount_sources_are_resolved_on_the_host(tmp_path):
    store = FakeStore()
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "to-etc").symlink_to("/etc")
    (tmp_path / "to-data").symlink_to(data)
    home = tmp_path / "home"
    (tmp_path / "to-home").symlink_to(home)
    lock = _lock_with(store)
    ok = msgspec.structs.replace(lock, mounts=[wp.Mount(source=str(tmp_path / "to-data"), target="/d")])
    check_mount_sources(ok, home=str(home))
    for link, why in (("to-etc", "it is /etc"), ("to-home", f"it is $WEENV_HOME {home}")):
        bad = msgspec.structs.replace(lock, mounts=[wp.Mount(source=str(tmp_path / link), target="/d")])
        with pytest.raises(SpecError, match=re.escape(f"mounts[0].source: {tmp_path / link} (resolves to ")
                           + ".*" + re.escape(f") exposes the host: {why}")):
            check_mount_sources(bad, home=str(home))


def test_the_embedded_store_is_asked_by_digest_and_its_bytes_checked(tmp_path, monkeypatch):
    from weenv.registry import publish, resolve_group

    from .layertrees import f, make_tree

    monkeypatch.setenv("WEENV_HOME", str(tmp_path / "home"))
    publish(make_tree(tmp_path / "src", f("etc/os-release", b"x\n")), "tiny:v1", group="os", group_class="os")
    plan = wp.load_plan('name = "t"\n[[groups]]\nname = "os"\nref = "tiny:v1"\nclass = "os"\n')
    lock = wp.lock_plan(plan, resolve_group)
    LockVerifier().check(lock)
    with pytest.raises(LockError, match=r"layer_size mismatch: the lock pins 5, the manifest says \d+$"):
        LockVerifier().check(_edit(lock, layer_size=5))
    blob = tmp_path / "home" / "store" / "blobs" / "sha256" / lock.groups[0].digest.removeprefix("sha256:")
    blob.write_bytes(blob.read_bytes() + b" ")  # the store's file, tampered
    with pytest.raises(LockError, match=r"^lock 't': groups\[0\] \(os\): digest: .*does not match its digest"):
        LockVerifier().check(lock)


# ---------------------------------------------------------------- a real envlet


def test_the_envlet_refuses_a_second_registration_with_another_size_or_toc(tmp_path, envlet):
    from weenv.envlet import ControlError, StoreSpec

    from .fixtures_envlet import build_layer_file
    from .layertrees import f, make_tree

    layer = build_layer_file(make_tree(tmp_path / "src", f("a", b"a")), str(tmp_path / "l"))
    spec = StoreSpec("file", path=layer.path)
    info = envlet.client.register(spec, layer.digest, layer.size, layer.toc_digest)
    try:
        with pytest.raises(ControlError, match=f"registered with size {layer.size}, not 5"):
            envlet.client.register(spec, layer.digest, 5, layer.toc_digest)
        with pytest.raises(ControlError, match=f"registered with TOC {layer.toc_digest}"):
            envlet.client.register(spec, layer.digest, layer.size, "sha256:" + "1" * 64)
        assert [x.refcount for x in envlet.client.list()] == [1]  # the refused ones took no reference
    finally:
        envlet.client.unregister(info.name)


# ---------------------------------------------------------------- the daemon


def _edited_lock(daemon, tmp_path, field: str, value: str) -> str:
    text = open(daemon.plan_lock).read()
    new, n = re.subn(rf"^{field} = .*$", f"{field} = {value}", text, count=1, flags=re.M)
    assert n == 1
    path = tmp_path / f"edited-{field}.lock.toml"
    path.write_text(new)
    return str(path)


@pytest.mark.integration
def test_up_refuses_a_lock_whose_pins_were_edited(daemon, tmp_path):
    good = wp.load_lock(daemon.plan_lock).groups[0]
    cases = [
        ("digest", f'"sha256:{"e" * 64}"', f"groups[0] (os): digest: the lock pins sha256:{'e' * 64}, but the "
                                           "embedded store has no such manifest in repository 'busybox'"),
        ("layer_digest", f'"sha256:{"d" * 64}"',
         f"groups[0] (os): layer_digest mismatch: the lock pins sha256:{'d' * 64}, the manifest names "
         f"{good.layer_digest}"),
        ("layer_size", "5", f"groups[0] (os): layer_size mismatch: the lock pins 5, the manifest says {good.layer_size}"),
        ("toc_digest", f'"sha256:{"c" * 64}"',
         f"groups[0] (os): toc_digest mismatch: the lock pins sha256:{'c' * 64}, the manifest says {good.toc_digest}"),
    ]
    log_start = len(daemon.log())
    with daemon.client() as c:
        with c.create(daemon.plan_lock) as env:  # the layer is registered on the node while the edits are tried
            assert env.exec(["true"]).exit_code == 0
            for field, value, message in cases:
                with pytest.raises(weenv.ApiError) as info:
                    c.create(_edited_lock(daemon, tmp_path, field, value))
                assert info.value.status == 400, (field, info.value)
                assert message in str(info.value), (field, str(info.value))
        for field, value, message in cases:  # and with no env holding the layer
            with pytest.raises(weenv.ApiError, match=re.escape(message)):
                c.create(_edited_lock(daemon, tmp_path, field, value))
        assert c.list() == []
        with c.create(daemon.plan_lock) as env:  # the real lock still starts
            assert env.exec(["echo", "ok"]).stdout == b"ok\n"
    assert "Traceback" not in daemon.log()[log_start:]
    assert leftovers(daemon) == []


@pytest.mark.integration
@pytest.mark.parametrize("data", [b"\x00" * 200, b"\x00\x01garbage\xfe", os.urandom(300), b"justoneword",
                                  b"/etc/shadow", b"x = " + b"[" * 50_000])
def test_garbage_lock_files_get_a_400_naming_the_file(daemon, tmp_path, data):
    path = tmp_path / "garbage.lock"
    path.write_bytes(data)
    log_start = len(daemon.log())
    with daemon.client() as c:
        with pytest.raises(weenv.WeenvError) as info:
            c.create(str(path))
        if isinstance(info.value, weenv.ApiError):
            assert info.value.status == 400, info.value
        assert str(path) in str(info.value), str(info.value)
        assert c.list() == []
    log = daemon.log()[log_start:]
    assert "embedded null byte" not in log and "Traceback" not in log


@pytest.mark.integration
def test_up_refuses_a_mount_source_that_resolves_into_the_host(daemon, tmp_path):
    (tmp_path / "to-etc").symlink_to("/etc")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_text("x\n")
    base = wp.load_lock(daemon.plan_lock)
    with daemon.client() as c:
        bad = msgspec.structs.replace(base, mounts=[wp.Mount(source=str(tmp_path / "to-etc"), target="/h")])
        with pytest.raises(weenv.ApiError) as info:
            c.create(bad)
        assert info.value.status == 400
        assert f"mounts[0].source: {tmp_path / 'to-etc'} (resolves to /etc) exposes the host: it is /etc" in str(info.value)
        with pytest.raises(weenv.ApiError, match=r"mounts\[0\].source: '/' exposes the host"):
            c.create(wp.plan_to_builtins(base) | {"mounts": [{"source": "/", "target": "/h"}]})
        ok = msgspec.structs.replace(base, mounts=[wp.Mount(source=str(tmp_path / "data"), target="/h")])
        with c.create(ok) as env:
            assert env.exec(["cat", "/h/x"]).stdout == b"x\n"
        assert c.list() == []
    assert leftovers(daemon) == []
