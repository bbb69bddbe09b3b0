"""The routes issue 29 added, tried as the issue-25 attack tried the old ones, on the real
``weenv serve``: another key's ids answer 404, no key 401, and a path percent-encoded twice is refused
as it was sent (a 400 naming the segment), never decoded again into another route."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import weenv

from .fixtures_api import Served, served, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


def _raw(served: Served, method: str, raw_path: str, headers: dict[str, str], **kw: Any) -> httpx.Response:
    url = httpx.URL(served.url).copy_with(raw_path=raw_path.encode("ascii"))
    return httpx.request(method, url, headers=headers, timeout=30, **kw)


def test_v1_metrics_pause_and_volumes_are_the_keys_own(served: Served) -> None:
    alice, bob = ({"Authorization": f"Bearer {served.keys[k]}"} for k in ("alice", "bob"))
    with weenv.Client(served.url, token=served.keys["alice"]) as c, c.create(served.daemon.plan_lock) as env:
        vol = httpx.post(served.url + "/v1/volumes", json={"name": "sec-vol", "size_bytes": 16 << 20},
                         headers=alice, timeout=60)
        assert vol.status_code in (200, 201), vol.text
        vid = vol.json()["id"]
        try:
            for method, path in (("GET", f"/v1/envs/{env.id}/metrics"), ("POST", f"/v1/envs/{env.id}/pause?memory=false"),
                                 ("POST", f"/v1/envs/{env.id}/resume"),
                                 ("GET", f"/v1/volumes/{vid}"), ("GET", f"/v1/volumes/{vid}/files?path=/"),
                                 ("DELETE", f"/v1/volumes/{vid}")):
                assert _raw(served, method, path, bob).status_code == 404, (method, path)
                assert _raw(served, method, path, {}).status_code == 401, (method, path)
            assert _raw(served, "GET", f"/v1/envs/{env.id}/metrics", alice).status_code == 200
            for method, path in (("GET", f"/v1/envs%252F{env.id}%252Fmetrics"), ("GET", f"/v1/envs/{env.id}%252Fmetrics"),
                                 ("POST", f"/v1/envs/{env.id}%252Fresume"),
                                 ("GET", f"/v1/volumes%252F{vid}"), ("DELETE", f"/v1/volumes%252F{vid}"),
                                 ("GET", "/v1/%2576olumes")):
                r = _raw(served, method, path, alice)
                assert r.status_code in (400, 404) and r.status_code != 200, (path, r.text)
                if "%252F" in path:
                    assert r.status_code == 400 and "segment" in r.json()["error"]["message"], (path, r.text)
            assert env.info["status"] == "running"  # bob's pause did nothing
            assert _raw(served, "GET", f"/v1/volumes/{vid}", alice).status_code == 200  # nor his delete
        finally:
            httpx.delete(f"{served.url}/v1/volumes/{vid}", headers=alice, timeout=60)


def test_e2b_volumes_templates_and_metrics_are_the_keys_own(served: Served) -> None:
    alice, bob = ({"X-API-Key": served.keys[k]} for k in ("alice", "bob"))
    vol = httpx.post(served.url + "/volumes", json={"name": "sec-e2b"}, headers=alice, timeout=60)
    assert vol.status_code in (200, 201), vol.text
    vid = vol.json()["volumeID"]
    sbx = httpx.post(served.url + "/sandboxes", json={"templateID": "bb", "timeout": 60}, headers=alice, timeout=60)
    assert sbx.status_code == 201, sbx.text
    sid = sbx.json()["sandboxID"]
    try:
        for method, path in (("GET", f"/volumes/{vid}"), ("DELETE", f"/volumes/{vid}"),
                             ("GET", f"/sandboxes/{sid}/metrics"), ("POST", f"/sandboxes/{sid}/pause"),
                             ("GET", f"/templates/{sid}/builds/b-1/status")):  # (operator aliases are public)
            assert _raw(served, method, path, bob).status_code == 404, (method, path)
            assert _raw(served, method, path, {}).status_code == 401, (method, path)
        for method, path in (("GET", f"/volumes%252F{vid}"), ("DELETE", f"/volumes%252F{vid}"),
                             ("GET", f"/sandboxes%252F{sid}%252Fmetrics"), ("POST", f"/sandboxes/{sid}%252Fpause")):
            r = _raw(served, method, path, alice)
            assert r.status_code == 400, (path, r.text)
        assert _raw(served, "GET", f"/volumes/{vid}", alice).status_code == 200
        assert e2b.Sandbox.get_info(sid, api_key=served.keys["alice"]).state.value == "running"
    finally:
        httpx.delete(f"{served.url}/sandboxes/{sid}", headers=alice, timeout=60)
        httpx.delete(f"{served.url}/volumes/{vid}", headers=alice, timeout=60)
