"""E2B templates built through the unmodified SDK (issue 29 item 15): ``Template.build`` and
``build_in_background`` against ``weenv serve`` and a real daemon, registry and crun envs, on
weenv's own builder and step cache; the result an alias owned by the key that built it."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from .fixtures_api import Served, start_serve, stop_serve, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]

INSTALL = ("busybox mkdir -p /usr/bin /sbin /usr/sbin /home/user && busybox --install -s && "
           "printf 'root:x:0:0:root:/root:/bin/sh\\nuser:x:1000:1000::/home/user:/bin/sh\\n' > /etc/passwd && "
           "printf 'root:x:0:\\nuser:x:1000:\\n' > /etc/group && chown 1000:1000 /home/user")
"""The test image is busybox with four applets and no /etc/passwd: the first step links the others
(ln, id) and writes one with E2B's ``user`` (Debian's busybox has no adduser to make it)."""


@pytest.fixture(scope="module")
def tpl_server(weenv_serve: Served, registry, busybox_oci: str) -> Iterator[tuple[Served, str]]:  # type: ignore[no-untyped-def]  # noqa: F811
    image = f"{registry.host}/tpl/bb:1"
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{busybox_oci}:bb", f"docker://{image}"],
                   check=True, capture_output=True, timeout=120)
    served = start_serve(weenv_serve.daemon, weenv_serve.keys, args=["--registry", registry.host])
    try:
        yield served, image
    finally:
        stop_serve(served)


@pytest.fixture
def srv(tpl_server: tuple[Served, str], daemon, monkeypatch: pytest.MonkeyPatch) -> tuple[Served, str]:  # type: ignore[no-untyped-def]
    served, _ = tpl_server
    for k, v in served.e2b_env("alice").items():
        monkeypatch.setenv(k, v)
    return tpl_server


@pytest.fixture
def ctx(tmp_path) -> str:  # type: ignore[no-untyped-def]
    (tmp_path / "a.txt").write_text("hello a\n")
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "x.txt").write_text("x\n")
    (tmp_path / "d" / "sub" / "y.txt").write_text("y\n")
    return str(tmp_path)


def _as(served: Served, who: str) -> dict[str, str]:
    return {"api_key": served.keys[who], "api_url": served.url, "sandbox_url": served.url}


def _template(image: str, ctx: str) -> object:
    return (e2b.Template(file_context_path=ctx).from_image(image)
            .set_user("root")
            .run_cmd(INSTALL)
            .copy("a.txt", "/opt/a.txt")
            .copy("d", "/opt/d/")
            .set_envs({"FOO": "bar"})
            .run_cmd("echo $FOO > /opt/foo")
            .set_user("user")
            .make_symlink("/opt/a.txt", "/home/user/link")
            .set_workdir("/opt/d")
            .set_start_cmd("echo started > /home/user/started; exec sleep 600", e2b.wait_for_file("/home/user/started")))


def _build(template: object, name: str, **kw: object) -> tuple[object, list[str], float]:
    logs: list[str] = []
    t0 = time.perf_counter()
    info = e2b.Template.build(template, name, on_build_logs=lambda e: logs.append(e.message), **kw)
    return info, logs, time.perf_counter() - t0


def test_build_from_image_and_start_a_sandbox_of_it(srv, ctx: str) -> None:  # type: ignore[no-untyped-def]
    served, image = srv
    info, logs, first_s = _build(_template(image, ctx), "tpl-full")
    assert info.template_id.startswith("tpl") and info.name == "tpl-full", info
    assert any("Uploaded 'a.txt'" in m for m in logs) and any("RUN" in m for m in logs), logs
    sbx = e2b.Sandbox.create("tpl-full", timeout=60)
    try:
        run = sbx.commands.run
        assert run("cat /opt/a.txt /opt/d/x.txt /opt/d/sub/y.txt /opt/foo").stdout == "hello a\nx\ny\nbar\n"
        assert run("echo $FOO; pwd; id -un").stdout == "bar\n/opt/d\nuser\n"
        assert run("readlink /home/user/link").stdout == "/opt/a.txt\n"
        assert run("cat /home/user/started").stdout == "started\n"  # the start command ran, ready before create
        assert "sleep 600" in run("ps -o args").stdout  # and runs on
    finally:
        sbx.kill()
    # the same steps again: every RUN and COPY step from the step cache
    _, logs2, second_s = _build(_template(image, ctx), "tpl-full")
    assert any(" 0 steps built" in m for m in logs2), logs2
    cached = [m for m in logs2 if ": cached (snap-" in m]
    assert len(cached) >= 5, logs2  # 2 RUN, 2 COPY, the USER's adduser, the symlink's RUN
    assert any("Skipping upload of 'a.txt', already cached" in m for m in logs2), logs2
    print(f"first build {first_s:.2f}s, cached rebuild {second_s:.2f}s")


def test_build_in_background_status_and_logs(srv, ctx: str) -> None:  # type: ignore[no-untyped-def]
    served, image = srv
    t = e2b.Template().from_image(image).run_cmd("echo one; echo two >&2").set_envs({"A": "1"})
    info = e2b.Template.build_in_background(t, "tpl-bg:v1")
    offset, seen, status = 0, [], None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        st = e2b.Template.get_build_status(info, logs_offset=offset)
        offset += len(st.log_entries)
        seen += [e.message for e in st.log_entries]
        status = st.status.value
        if status in ("ready", "error") and not st.log_entries:
            break
        time.sleep(0.2)
    assert status == "ready", seen
    assert "one" in seen and "two" in seen, seen
    assert offset == len(seen) and e2b.Template.get_build_status(info, logs_offset=offset).log_entries == []
    with httpx.Client(base_url=served.url, headers={"X-API-Key": served.keys["alice"]}) as h:
        r = h.get(f"/templates/{info.template_id}/builds/{info.build_id}/logs", params={"limit": 3})
        assert r.status_code == 200 and len(r.json()["logs"]) == 3, r.text
    sbx = e2b.Sandbox.create("tpl-bg:v1", timeout=30)
    try:
        assert sbx.commands.run("echo $A").stdout == "1\n"
    finally:
        sbx.kill()
    # another server on the same home (a restart) still reports the finished build
    again = start_serve(served.daemon, served.keys)
    try:
        st = e2b.Template.get_build_status(info, **_as(again, "alice"))
        assert st.status.value == "ready"
    finally:
        stop_serve(again)


def test_a_failing_step_raises_build_exception_with_its_output(srv) -> None:  # type: ignore[no-untyped-def]
    _, image = srv
    t = e2b.Template().from_image(image).run_cmd("echo before-boom; echo boom-detail >&2; exit 3")
    with pytest.raises(e2b.BuildException) as ei:
        e2b.Template.build(t, "tpl-fail")
    msg = str(ei.value)
    assert "exit code 3" in msg and "boom-detail" in msg, msg
    assert e2b.Template.exists("tpl-fail") is True  # the template exists; it has no ready build
    with pytest.raises(e2b.SandboxException):
        e2b.Sandbox.create("tpl-fail", timeout=30)


def test_exists_tags_and_other_keys(srv, ctx: str) -> None:  # type: ignore[no-untyped-def]
    served, image = srv
    t = e2b.Template().from_image(image).run_cmd("echo v > /tmp/v", user="root")
    e2b.Template.build(t, "tpl-tags")
    assert e2b.Template.exists("tpl-tags") is True
    assert e2b.Template.exists("tpl-nope") is False
    got = e2b.Template.assign_tags("tpl-tags:default", ["v1", "stable"])
    assert sorted(got.tags) == ["stable", "v1"]
    assert sorted(x.tag for x in e2b.Template.get_tags("tpl-tags")) == ["default", "stable", "v1"]
    sbx = e2b.Sandbox.create("tpl-tags:stable", timeout=30)
    try:
        assert sbx.commands.run("cat /tmp/v").stdout == "v\n"
    finally:
        sbx.kill()
    e2b.Template.remove_tags("tpl-tags", "stable")
    assert sorted(x.tag for x in e2b.Template.get_tags("tpl-tags")) == ["default", "v1"]
    with pytest.raises(e2b.SandboxException):
        e2b.Sandbox.create("tpl-tags:stable", timeout=30)
    # bob: none of it exists for him, and he can neither build over it, tag it nor delete it
    bob = _as(served, "bob")
    assert e2b.Template.exists("tpl-tags", **bob) is False
    with pytest.raises(e2b.SandboxException):
        e2b.Sandbox.create("tpl-tags", timeout=30, **bob)
    with pytest.raises(e2b.TemplateException):
        e2b.Template.get_tags("tpl-tags", **bob)
    with pytest.raises(e2b.TemplateException):
        e2b.Template.assign_tags("tpl-tags:default", "bobs", **bob)
    with pytest.raises(e2b.BuildException):
        e2b.Template.build(t, "tpl-tags", **bob)
    with httpx.Client(base_url=served.url, headers={"X-API-Key": served.keys["bob"]}) as h:
        r = h.delete("/templates/tpl-tags")
        assert r.status_code == 404, r.text
    with httpx.Client(base_url=served.url, headers={"X-API-Key": served.keys["alice"]}) as h:
        assert h.delete("/templates/tpl-tags").status_code == 204
    assert e2b.Template.exists("tpl-tags") is False


def test_other_key_gets_404_for_builds(srv) -> None:  # type: ignore[no-untyped-def]
    served, image = srv
    info = e2b.Template.build(e2b.Template().from_image(image).set_envs({"Q": "1"}), "tpl-private")
    with pytest.raises(e2b.BuildException) as ei:
        e2b.Template.get_build_status(info, **_as(served, "bob"))
    assert "not found" in str(ei.value)
    with httpx.Client(base_url=served.url, headers={"X-API-Key": served.keys["bob"]}) as h:
        assert h.get(f"/templates/{info.template_id}/builds/{info.build_id}/logs").status_code == 404
        assert h.get(f"/templates/{info.template_id}/files/{'0' * 64}").status_code == 404
        assert h.get("/templates/aliases/tpl-private").status_code == 404


def test_from_template_and_from_dockerfile(srv, ctx: str) -> None:  # type: ignore[no-untyped-def]
    _, image = srv
    e2b.Template.build(e2b.Template().from_image(image).run_cmd(INSTALL, user="root")
                       .run_cmd("echo base > /base", user="root"), "tpl-base")
    e2b.Template.build(e2b.Template().from_template("tpl-base").run_cmd("echo more > /more", user="root"),
                       "tpl-child")
    sbx = e2b.Sandbox.create("tpl-child", timeout=30)
    try:
        assert sbx.commands.run("cat /base /more").stdout == "base\nmore\n"
    finally:
        sbx.kill()
    dockerfile = (f"FROM {image}\nRUN {INSTALL}\nCOPY a.txt /srv/a.txt\nENV X=1 Y=two\nWORKDIR /srv/w\n"
                  "RUN echo $X-$Y > /srv/w/x\n")
    e2b.Template.build(e2b.Template(file_context_path=ctx).from_dockerfile(dockerfile), "tpl-df")
    sbx = e2b.Sandbox.create("tpl-df", timeout=30)
    try:
        assert sbx.commands.run("cat /srv/a.txt x; pwd; echo $Y; id -un").stdout == "hello a\n1-two\n/srv/w\ntwo\nuser\n"
    finally:
        sbx.kill()


def test_bad_requests_name_the_field(srv) -> None:  # type: ignore[no-untyped-def]
    served, image = srv
    with httpx.Client(base_url=served.url, headers={"X-API-Key": served.keys["alice"]}) as h:
        r = h.post("/v3/templates", json={})
        assert r.status_code == 400 and "$.name" in r.json()["message"], r.text
        r = h.post("/v3/templates", json={"name": "bad name"})
        assert r.status_code == 400 and "$.name" in r.json()["message"], r.text
        r = h.post("/v3/templates", json={"name": "tpl-bad", "cpuCount": 1000})
        assert r.status_code == 400 and "cpuCount" in r.json()["message"], r.text
        made = h.post("/v3/templates", json={"name": "tpl-bad"}).json()
        url = f"/v2/templates/{made['templateID']}/builds/{made['buildID']}"
        cases = [({"steps": []}, "fromImage"),
                 ({"fromImage": "ubuntu:22.04"}, "$.fromImage"),
                 ({"fromImage": "10.9.9.9:5000/x:1"}, "$.fromImage"),
                 ({"fromImage": image, "steps": [{"type": "FOO", "args": ["x"]}]}, "$.steps[0].type"),
                 ({"fromImage": image, "steps": [{"type": "RUN", "args": []}]}, "$.steps[0].args"),
                 ({"fromImage": image, "steps": [{"type": "ENV", "args": ["1X", "y"]}]}, "$.steps[0].args[0]"),
                 ({"fromImage": image, "steps": [{"type": "COPY", "args": ["a", "/a"], "filesHash": "f" * 64}]},
                  "$.steps[0].filesHash"),
                 ({"fromImage": image, "steps": [{"type": "RUN", "args": ["x"]}] * 300}, "$.steps"),
                 ({"fromTemplate": "no-such-template"}, "$.fromTemplate"),
                 ({"fromImage": image, "fromImageRegistry": {"type": "registry"}}, "$.fromImageRegistry")]
        for body, field in cases:
            r = h.post(url, json=body)
            assert r.status_code in (400, 403) and field in r.json()["message"], (body, r.text)
        assert h.post(url, json={"fromImage": "10.9.9.9:5000/x:1"}).status_code == 403  # not a listed registry
        r = h.put(f"/templates/{made['templateID']}/files/{'a' * 64}", content=b"not a tar at all")
        assert r.status_code == 400 and "tar" in r.json()["message"], r.text
        assert h.get(f"/templates/{made['templateID']}/builds/{made['buildID']}/status",
                     params={"logsOffset": "x"}).status_code == 400
    with httpx.Client(base_url=served.url) as anon:  # an upload link is signed: nothing else opens the route
        r = anon.put(f"/templates/{made['templateID']}/files/{'a' * 64}?expires=9999999999&signature=x", content=b"")
        assert r.status_code == 401


def test_copy_refuses_symlinks_out_of_the_context(srv, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, image = srv
    (tmp_path / "c").mkdir()
    os.symlink("../../etc/passwd", tmp_path / "c" / "esc")
    t = e2b.Template(file_context_path=str(tmp_path)).from_image(image).copy("c", "/c/")
    with pytest.raises(e2b.BuildException) as ei:
        e2b.Template.build(t, "tpl-esc")
    assert "leaves the context" in str(ei.value)

