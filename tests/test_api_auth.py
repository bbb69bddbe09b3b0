"""Auth of ``weenv serve``: API keys on the control plane and /v1, per-env access tokens on envd,
ownership (another key's env does not exist), revocation at once, and the counted refusals."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import httpx
import pytest

import weenv
from weenv.api import KeyStore

from .fixtures_api import Served, served, start_serve, stop_serve, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


def _counter(served: Served, name: str, **labels: str) -> float:
    text = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {served.keys['root']}"}).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_control_plane_needs_a_key(served: Served) -> None:
    assert httpx.get(served.url + "/v2/sandboxes").status_code == 401
    before = _counter(served, "weenv_api_auth_failures_total", surface="e2b", reason="wrong_key")
    r = httpx.get(served.url + "/v2/sandboxes", headers={"X-API-Key": "weenv_not-a-key"})
    assert r.status_code == 401 and r.json()["code"] == 401
    assert _counter(served, "weenv_api_auth_failures_total", surface="e2b", reason="wrong_key") == before + 1
    assert "refused e2b request" in served.log() and "weenv_not-a-key" not in served.log()
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create("bb", api_key="weenv_wrong")
    r = httpx.get(served.url + "/v1/envs", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["kind"] == "unauthorized"
    assert httpx.get(served.url + "/metrics").status_code == 401


def test_keys_are_stored_hashed_0600(served: Served) -> None:
    path = os.path.join(served.home, "api", "keys.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as f:
        text = f.read()
    assert all(key not in text for key in served.keys.values())


def test_another_keys_env_is_not_found(served: Served) -> None:
    sbx = e2b.Sandbox.create("bb", timeout=60)
    bob = served.keys["bob"]
    try:
        with pytest.raises(e2b.NotFoundException):
            e2b.Sandbox.get_info(sbx.sandbox_id, api_key=bob)
        assert e2b.Sandbox.kill(sbx.sandbox_id, api_key=bob) is False
        with pytest.raises(e2b.NotFoundException):
            e2b.Sandbox.connect(sbx.sandbox_id, api_key=bob)
        assert sbx.sandbox_id not in {s.sandbox_id for s in e2b.Sandbox.list(api_key=bob).next_items()}
        with weenv.Client(served.url, token=bob) as c:
            assert sbx.sandbox_id not in [e["id"] for e in c.list()]
            with pytest.raises(weenv.EnvNotFoundError):
                c.get(sbx.sandbox_id)
            r = c.connection.http.post(f"/v1/envs/{sbx.sandbox_id}/exec", json={"cmd": "true"})
            assert r.status_code == 404
            with pytest.raises(weenv.ApiError) as err:
                c.gc()
            assert err.value.status == 403
        # an admin key sees and uses every env
        assert e2b.Sandbox.get_info(sbx.sandbox_id, api_key=served.keys["root"]).sandbox_id == sbx.sandbox_id
        assert sbx.is_running()
    finally:
        sbx.kill()


def test_envd_needs_the_envs_access_token(served: Served) -> None:
    sbx = e2b.Sandbox.create("bb", timeout=60)
    other = e2b.Sandbox.create("bb", timeout=60)
    try:
        token = sbx._envd_access_token
        assert token
        base = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        assert httpx.get(served.url + "/health", headers={**base, "X-Access-Token": token}).status_code == 204
        for headers in (base, {**base, "X-Access-Token": "wea_wrong"},
                        {**base, "X-Access-Token": other._envd_access_token}):
            assert httpx.get(served.url + "/files", params={"path": "/etc/passwd"}, headers=headers).status_code == 401
            r = httpx.post(served.url + "/filesystem.Filesystem/Stat", json={"path": "/"},
                           headers={**headers, "Connect-Protocol-Version": "1"})
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        # the SDK turns the refusal into its own exception
        forged = e2b.Sandbox(sandbox_id=sbx.sandbox_id, sandbox_domain=None, envd_version=sbx._envd_version,
                             envd_access_token="wea_forged", connection_config=e2b.ConnectionConfig(
                                 extra_sandbox_headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                                        "X-Access-Token": "wea_forged"}))
        with pytest.raises(e2b.AuthenticationException):
            forged.files.read("/etc/passwd")
        with pytest.raises(e2b.AuthenticationException):
            forged.files.list("/")
        # host-based routing: {port}-{sandbox id}.{domain}
        host = f"49983-{sbx.sandbox_id}.weenv.test"
        r = httpx.get(served.url + "/files", params={"path": "/etc/passwd"}, headers={"Host": host, "X-Access-Token": token})
        assert r.status_code == 200 and b"root:" in r.content
        assert httpx.get(served.url + "/health", headers={"Host": host}).status_code == 401
    finally:
        sbx.kill()
        other.kill()


def test_revoked_key_stops_at_once(served: Served) -> None:
    out = subprocess.run([sys.executable, "-m", "weenv", "token", "create", "--name", "carol"], check=True,
                         capture_output=True, text=True, env=served.daemon.env_vars())
    carol = out.stdout.strip()
    assert re.fullmatch(r"weenv_[A-Za-z0-9_-]{40,}", carol)
    ls = subprocess.run([sys.executable, "-m", "weenv", "token", "ls"], check=True, capture_output=True, text=True,
                        env=served.daemon.env_vars()).stdout
    assert "carol" in ls and carol not in ls
    try:
        assert e2b.Sandbox.list(api_key=carol).next_items() == []
        subprocess.run([sys.executable, "-m", "weenv", "token", "revoke", "carol"], check=True,
                       capture_output=True, env=served.daemon.env_vars())
        with pytest.raises(e2b.AuthenticationException):
            e2b.Sandbox.list(api_key=carol).next_items()
    finally:
        if any(k.name == "carol" for k in KeyStore(os.path.join(served.home, "api")).list()):
            KeyStore(os.path.join(served.home, "api")).revoke("carol")


def test_native_client_and_cli_over_tcp(served: Served) -> None:
    alice = served.keys["alice"]
    with weenv.Client(served.url, token=alice) as c, c.create(served.daemon.plan_lock) as env:
        chunks: list[bytes] = []
        result = env.exec("echo one; echo two", on_output=lambda stream, data: chunks.append(data))
        assert result.exit_code == 0 and b"".join(chunks) == b"one\ntwo\n"
        env.write_file("/tmp/x", b"data")
        assert env.read_file("/tmp/x") == b"data"
        assert env.id in [e["id"] for e in c.list()]
        out = subprocess.run([sys.executable, "-m", "weenv", "--host", served.url, "ps", "--json"],
                             capture_output=True, text=True, env={**served.daemon.env_vars(), "WEENV_TOKEN": alice})
        assert out.returncode == 0, out.stderr
        assert env.id in out.stdout
        out = subprocess.run([sys.executable, "-m", "weenv", "--host", served.url, "ps", "--json"],
                             capture_output=True, text=True, env={**served.daemon.env_vars(),
                                                                  "WEENV_TOKEN": served.keys["bob"]})
        assert out.returncode == 0 and env.id not in out.stdout


def test_metrics_endpoint(served: Served) -> None:
    r = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {served.keys['alice']}"})
    assert r.status_code == 403
    text = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {served.keys['root']}"}).text
    assert "weenv_api_requests_total" in text and "weenv_api_request_seconds_bucket" in text
    assert "weenv_api_auth_failures_total" in text
    assert "weenv_env_cpu_quota_cores" in text  # the daemon's own series follow


def test_ownership_survives_a_restart(served: Served) -> None:
    sbx = e2b.Sandbox.create("bb", timeout=60)
    second = start_serve(served.daemon, served.keys)
    try:
        info = e2b.Sandbox.get_info(sbx.sandbox_id, api_url=second.url)
        assert info.sandbox_id == sbx.sandbox_id
        with pytest.raises(e2b.NotFoundException):
            e2b.Sandbox.get_info(sbx.sandbox_id, api_url=second.url, api_key=served.keys["bob"])
        again = e2b.Sandbox.connect(sbx.sandbox_id, api_url=second.url, sandbox_url=second.url)
        assert again.files.exists("/etc/passwd")  # the access token still works: derived, not stored
    finally:
        stop_serve(second)
        sbx.kill()


def test_tls(served: Served, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import ssl

    from tests.test_api_http2 import _tls_files

    ca, cert, key = _tls_files(tmp_path)
    secure = start_serve(served.daemon, served.keys, tls=(cert, key), ca=ca)
    try:
        assert secure.url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=ca)) as c:
            r = c.get(secure.url + "/v1/ping", headers={"Authorization": f"Bearer {served.keys['alice']}"})
            assert r.status_code == 200
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(secure.url + "/v1/ping")
        monkeypatch.setenv("SSL_CERT_FILE", ca)  # how both clients are told to trust it
        with weenv.Client(secure.url, token=served.keys["alice"]) as c:
            assert c.ping()["pid"] > 0
        # the SDK's connection pool is process-wide, made with the trust of its first use: a fresh process
        script = ("import e2b\ns = e2b.Sandbox.create('bb', timeout=60)\n"
                  "try:\n    print(s.commands.run('echo over-tls').stdout, end='')\nfinally:\n    s.kill()\n")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "E2B_API_URL": secure.url, "E2B_SANDBOX_URL": secure.url})
        assert out.returncode == 0 and out.stdout == "over-tls\n", out.stderr[-2000:]
    finally:
        stop_serve(secure)


def test_only_admin_plans_reach_the_node(served: Served) -> None:
    import json
    import tomllib

    with open(served.daemon.plan_lock) as f:
        lock = f.read()
    mounts = {**tomllib.loads(lock), "mounts": [{"source": "/etc", "target": "/host-etc"}]}
    host_net = {**tomllib.loads(lock), "network": "host"}
    with weenv.Client(served.url, token=served.keys["alice"]) as c:
        for body in ({"plan": mounts}, {"plan_text": json.dumps(host_net), "format": "json"},
                     {"plan_text": lock, "overrides": {"network": "host"}},
                     {"plan_text": lock, "overrides": {"mounts": [{"source": "/srv", "target": "/srv"}]}}):
            r = c.connection.http.post("/v1/envs", json=body)
            assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], r.text
        assert c.list() == []
        r = c.connection.http.post("/v1/envs", json={"plan_text": "not = [toml"})
        assert r.status_code == 400 and "invalid TOML" in r.text  # read by the plan codec, as the daemon reads it
    with weenv.Client(served.url, token=served.keys["root"]) as c:  # an admin may (the daemon checks the rest)
        r = c.connection.http.post("/v1/envs", json={"plan": mounts})
        assert r.status_code != 403, r.text
        if r.status_code == 201:
            c.get(r.json()["id"]).kill()


def test_process_handles_over_tcp(served: Served) -> None:
    """The daemon's process routes pass through /v1 like the rest: streamed, owned."""
    with weenv.Client(served.url, token=served.keys["alice"]) as c, c.create(served.daemon.plan_lock) as env:
        proc = env.spawn("head -n1", stdin=True)
        proc.send_stdin("through tcp\n")
        out = b"".join(ev.data_b64 or b"" for ev in proc.events() if ev.stream == "stdout")
        assert out == b"through tcp\n" and proc.end is not None and proc.end.exit_code == 0
        sleeper = env.spawn("sleep 30")
        assert sleeper.pid in [p.pid for p in env.processes()]
        with weenv.Client(served.url, token=served.keys["bob"]) as other:
            r = other.connection.http.post(f"/v1/envs/{env.id}/processes/{sleeper.pid}/signal", json={"signal": 9})
            assert r.status_code == 404
        sleeper.kill()
        end = sleeper.wait()
        assert end is not None and end.exit_code != 0


def test_signed_file_urls(served: Served) -> None:
    """download_url/upload_url carry a signature instead of the token (reached by host name: the
    URL names no sandbox otherwise)."""
    import urllib.parse as up

    sbx = e2b.Sandbox.create("bb", timeout=60)
    try:
        host = {"Host": f"49983-{sbx.sandbox_id}.weenv.test"}

        def local(url: str) -> str:
            parts = up.urlsplit(url)
            return served.url + parts.path + "?" + parts.query

        up_url = sbx.upload_url("/tmp/signed.txt", use_signature_expiration=60)
        r = httpx.post(local(up_url), files={"file": ("signed.txt", b"signed")}, headers=host)
        assert r.status_code == 200, r.text
        down = sbx.download_url("/tmp/signed.txt")
        r = httpx.get(local(down), headers=host)
        assert r.status_code == 200 and r.content == b"signed"
        assert httpx.get(local(down).replace("signed.txt", "other.txt"), headers=host).status_code == 401
        assert httpx.post(local(down), files={"file": ("x", b"x")}, headers=host).status_code == 401  # read-only
        expired = sbx.download_url("/tmp/signed.txt", use_signature_expiration=-10)
        late = httpx.get(local(expired), headers=host)  # E2B's own answer (issue 29 item 13)
        assert (late.status_code, late.json()) == (401, {"code": 401, "message": "signature is already expired"})
        forged = httpx.get(local(expired).replace("signature=v1_", "signature=v1_A"), headers=host)
        assert forged.status_code == 401 and "expired" not in forged.text  # a wrong signature says nothing more
    finally:
        sbx.kill()
