"""Images routed by a create's metadata (issue 29 item 16): ``weenv serve --image-metadata-key KEY``,
what slime's ``E2BSandbox`` sends — ``AsyncSandbox.create(timeout, metadata={KEY: image})`` with no
template — through the unmodified E2B SDK, against a real daemon, registry and crun envs."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator

import pytest

from .fixtures_api import Served, start_serve, stop_serve, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]

SIZES = ["--image-size", "sm=0.5:96MiB", "--image-size", "md=0.5:128MiB", "--image-size", "lg=1:160MiB"]


@pytest.fixture(scope="module")
def routed(weenv_serve: Served, registry, busybox_oci: str) -> Iterator[tuple[Served, str]]:  # type: ignore[no-untyped-def]
    """A second ``weenv serve`` on the session's daemon and keys, routing by ``image`` and ``size``,
    and the busybox image pushed to the test registry (which it lists for API keys)."""
    image = f"{registry.host}/routed/bb:1"
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{busybox_oci}:bb", f"docker://{image}"],
                   check=True, capture_output=True, timeout=120)
    served = start_serve(weenv_serve.daemon, weenv_serve.keys,
                         args=["--registry", registry.host, "--image-metadata-key", "image",
                               "--image-size-key", "size", *SIZES])
    try:
        yield served, image
    finally:
        stop_serve(served)


@pytest.fixture
def as_alice(routed: tuple[Served, str], monkeypatch: pytest.MonkeyPatch) -> tuple[Served, str]:
    served, image = routed
    for k, v in served.e2b_env("alice").items():
        monkeypatch.setenv(k, v)
    return routed


def test_a_create_with_no_template_starts_the_image_its_metadata_names(as_alice) -> None:  # type: ignore[no-untyped-def]
    _, image = as_alice

    async def main() -> None:
        sbx = await e2b.AsyncSandbox.create(timeout=120, metadata={"image": image, "size": "lg"})
        try:
            out = await sbx.commands.run("cat /etc/new; echo $FOO; pwd", user="root")
            assert out.stdout == "new\nbar\n/srv\n", out
            await sbx.files.write("/tmp/x", "routed")
            assert await sbx.files.read("/tmp/x") == "routed"
            info = await sbx.get_info()
            assert info.template_id == image and info.metadata == {"image": image, "size": "lg"}
            assert info.cpu_count == 1 and info.memory_mb == 160, info
        finally:
            await sbx.kill()

    asyncio.run(main())
    sbx = e2b.Sandbox.create(timeout=60, metadata={"image": image})  # no size: the image's plan as it is
    try:
        assert sbx.commands.run("cat /etc/motd", user="root").stdout == "hi\n"
    finally:
        sbx.kill()


def test_a_named_template_wins_over_the_metadata(as_alice) -> None:  # type: ignore[no-untyped-def]
    _, image = as_alice
    sbx = e2b.Sandbox.create("bb", timeout=60, metadata={"image": image})
    try:
        assert sbx.get_info().template_id == "bb"
        assert sbx.commands.run("test -e /etc/new || echo plain").stdout == "plain\n"
    finally:
        sbx.kill()


def test_routing_errors_name_what_is_wrong(as_alice, busybox_oci: str) -> None:  # type: ignore[no-untyped-def]
    _, image = as_alice
    with pytest.raises(e2b.SandboxException, match=r"400: .*metadata.size: 'xl' is not a size .*\(lg, md, sm\)"):
        e2b.Sandbox.create(timeout=60, metadata={"image": image, "size": "xl"})
    with pytest.raises(e2b.SandboxException, match="admin key"):  # a tenant never names the node's disk
        e2b.Sandbox.create(timeout=60, metadata={"image": f"oci:{busybox_oci}:bb"})
    with pytest.raises(e2b.SandboxException, match="not one this node reads"):
        e2b.Sandbox.create(timeout=60, metadata={"image": "127.0.0.1:1/elsewhere/bb:1"})


def test_serve_refuses_routing_options_that_do_not_fit_together(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Refused before anything starts: no daemon is started for a serve that cannot run."""
    import os
    import sys

    for args, msg in ((["--image-size-key", "size"], "need --image-metadata-key"),
                      (["--image-metadata-key", "i", "--image-size-key", "size"], "go together"),
                      (["--image-metadata-key", "i", "--image-size-key", "s", "--image-size", "sm=1"],
                       "not NAME=CPU:MEMORY"),
                      (["--image-metadata-key", "i", "--image-size-key", "s", "--image-size", "sm=1:lots"],
                       "not a size")):
        p = subprocess.run([sys.executable, "-m", "weenv", "serve", "--listen", "127.0.0.1:1", *args],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "WEENV_HOME": str(tmp_path)})
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)
        assert not (tmp_path / "run").exists(), "a daemon was started for a serve that cannot run"


def test_slimes_own_e2b_sandbox_creates_execs_writes_and_reads(as_alice, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """slime's ``E2BSandbox`` (slime/agent/sandbox.py, from a checkout of THUDM/slime on PYTHONPATH:
    it is not on PyPI), unmodified, with the metadata key it is told to route by; it sends its
    default size, ``md``."""
    sandbox = pytest.importorskip("slime.agent.sandbox", reason="slime is not importable: put a checkout of "
                                  "THUDM/slime on PYTHONPATH to run this")
    _, image = as_alice
    monkeypatch.setenv("SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY", "image")
    host_file = tmp_path / "payload.bin"
    host_file.write_bytes(bytes(range(256)) * 64)

    async def main() -> None:
        async with sandbox.E2BSandbox(image, timeout=120) as sb:
            assert sb.sandbox_id
            code, out, _ = await sb.exec("cat /etc/new; echo $FOO")
            assert (code, out) == (0, "new\nbar\n")
            code, _, err = await sb.exec("echo oops >&2; exit 3")
            assert code == 3 and err == "oops\n"
            await sb.write_file("/tmp/t.txt", "text")
            await sb.write_file("/tmp/b.bin", b"\x00\x01bytes")
            await sb.write_file("/tmp/p.bin", host_file)
            assert await sb.read_file("/tmp/t.txt") == "text"
            code, out, _ = await sb.exec("od -An -c /tmp/b.bin | tr -d ' '; md5sum /tmp/p.bin | cut -c1-32")
            import hashlib
            assert out.split() == ["\\0001bytes", hashlib.md5(host_file.read_bytes()).hexdigest()], out
            info = await __import__("e2b").AsyncSandbox.get_info(sb.sandbox_id)
            assert info.metadata == {"image": image, "size": "md"} and info.memory_mb == 128

    asyncio.run(main())
