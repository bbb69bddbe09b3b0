"""E2B's volumes through the unmodified SDK (``e2b.Volume``, ``volume_mounts``) against a real
``weenv serve`` and daemon (issue 29 item 17): the control plane with the API key, the content API
with the volume's own token, volumes shared by sandboxes and outliving them, owned by a key."""

from __future__ import annotations

import httpx
import pytest

from .fixtures_api import Served, served, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


@pytest.fixture
def vols(served: Served, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("E2B_VOLUME_API_URL", served.url)  # the content API: the same listener
    made: list[str] = []
    yield made
    for vol_id in made:
        e2b.Volume.destroy(vol_id, api_key=served.keys["root"])


def test_volume_create_list_get_delete_and_content(served: Served, vols) -> None:  # type: ignore[no-untyped-def]
    vol = e2b.Volume.create("notes")
    vols.append(vol.volume_id)
    assert vol.name == "notes" and vol.token and vol.volume_id.startswith("vol-")
    assert [(v.volume_id, v.name) for v in e2b.Volume.list()] == [(vol.volume_id, "notes")]
    info = e2b.Volume.get_info(vol.volume_id)
    assert (info.volume_id, info.name, info.token) == (vol.volume_id, "notes", vol.token)
    stat = vol.write_file("/dir/a.txt", "hello", mode=0o600)
    assert (stat.name, stat.path, stat.size, stat.mode & 0o777, stat.type.value) == ("a.txt", "/dir/a.txt", 5, 0o600,
                                                                                     "file")
    assert vol.read_file("/dir/a.txt") == "hello"
    assert vol.read_file("dir/a.txt", format="bytes") == b"hello"
    assert b"".join(vol.read_file("/dir/a.txt", format="stream")) == b"hello"
    assert vol.make_dir("/dir/sub").type.value == "directory"
    assert sorted(e.path for e in vol.list("/", depth=2)) == ["/dir", "/dir/a.txt", "/dir/sub"]
    assert vol.update_metadata("/dir/a.txt", mode=0o644, uid=1000).mode & 0o777 == 0o644
    assert vol.get_info("/dir/a.txt").uid == 1000
    assert vol.exists("/dir/a.txt") and not vol.exists("/nope")
    with pytest.raises(e2b.VolumePathNotFoundException):
        vol.read_file("/nope")
    vol.remove("/dir")
    assert vol.list("/") == []
    assert e2b.Volume.destroy(vol.volume_id) is True
    vols.remove(vol.volume_id)
    assert e2b.Volume.destroy(vol.volume_id) is False
    with pytest.raises(e2b.VolumeNotFoundException):
        e2b.Volume.get_info(vol.volume_id)


def test_a_volume_is_shared_by_sandboxes_and_outlives_them(served: Served, vols) -> None:  # type: ignore[no-untyped-def]
    vol = e2b.Volume.create("work")
    vols.append(vol.volume_id)
    first = e2b.Sandbox.create("bb", timeout=120, volume_mounts={"/data": vol})
    try:
        r = first.commands.run("echo from-first > /data/f.txt && cat /data/f.txt")
        assert r.stdout == "from-first\n"
        second = e2b.Sandbox.create("bb", timeout=120, volume_mounts={"/mnt/w": "work"})  # by name
        try:
            assert second.commands.run("cat /mnt/w/f.txt").stdout == "from-first\n"
            second.commands.run("echo from-second >> /mnt/w/f.txt")
            assert first.files.read("/data/f.txt") == "from-first\nfrom-second\n"
            with pytest.raises(e2b.VolumeException) as err:  # refused while mounted
                e2b.Volume.destroy(vol.volume_id)
            assert first.sandbox_id in str(err.value)
        finally:
            second.kill()
    finally:
        first.kill()
    assert vol.read_file("/f.txt") == "from-first\nfrom-second\n"  # outlives both, read through the content API
    third = e2b.Sandbox.create("bb", timeout=120, volume_mounts={"/data": vol})
    try:
        assert third.commands.run("cat /data/f.txt").stdout == "from-first\nfrom-second\n"
    finally:
        third.kill()


def test_a_volume_is_its_keys_own(served: Served, vols) -> None:  # type: ignore[no-untyped-def]
    vol = e2b.Volume.create("private")
    vols.append(vol.volume_id)
    vol.write_file("/secret", "alice's")
    bob = served.keys["bob"]
    with pytest.raises(e2b.VolumeNotFoundException):
        e2b.Volume.get_info(vol.volume_id, api_key=bob)
    assert e2b.Volume.destroy(vol.volume_id, api_key=bob) is False
    assert vol.volume_id not in [v.volume_id for v in e2b.Volume.list(api_key=bob)]
    for name in ("private", vol.volume_id):
        with pytest.raises(e2b.SandboxException) as err:
            e2b.Sandbox.create("bb", timeout=60, volume_mounts={"/d": name}, api_key=bob)
        assert "not found" in str(err.value)
    # bob's own volume of the same name is another volume
    bobs = e2b.Volume.create("private", api_key=bob)
    vols.append(bobs.volume_id)
    assert bobs.volume_id != vol.volume_id
    with pytest.raises(e2b.VolumePathNotFoundException):
        bobs.read_file("/secret")
    # the content API wants the volume's own token: bob's opens only bob's
    other = e2b.Volume(vol.volume_id, "private", token=bobs.token)
    with pytest.raises(e2b.AuthenticationException):
        other.read_file("/secret")
    r = httpx.get(f"{served.url}/volumecontent/{vol.volume_id}/file", params={"path": "/secret"},
                  headers={"Authorization": f"Bearer {served.keys['alice']}"})  # an API key is not a volume token
    assert r.status_code == 401
    # bob's /v1 cannot reach it either: not listed, 404 on every route, not mountable from a plan
    v1 = httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {bob}"})
    assert vol.volume_id not in [v["id"] for v in v1.get("/v1/volumes").json()]
    assert v1.get(f"/v1/volumes/{vol.volume_id}").status_code == 404
    assert v1.get(f"/v1/volumes/{vol.volume_id}/files", params={"path": "/secret"}).status_code == 404
    assert v1.delete(f"/v1/volumes/{vol.volume_id}").status_code == 404
    with open(served.daemon.plan_lock) as f:
        lock = f.read()
    r = v1.post("/v1/envs", json={"plan_text": lock, "overrides": {"volumes": [{"name": vol.volume_id,
                                                                                 "path": "/d"}]}})
    assert r.status_code == 404 and r.json()["error"]["kind"] == "volume_not_found", r.text
    # admin keys see every volume
    root = served.keys["root"]
    assert {vol.volume_id, bobs.volume_id} <= {v.volume_id for v in e2b.Volume.list(api_key=root)}
    assert e2b.Volume.get_info(vol.volume_id, api_key=root).name == "private"
