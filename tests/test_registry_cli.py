"""`weenv publish`, `weenv pull`, `weenv export` and `weenv layer … REF` through click's CliRunner."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from weenv.cli import main


def _tree(tmp_path) -> str:  # type: ignore[no-untyped-def]
    src = tmp_path / "tree"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "motd").write_text("hello cli\n")
    return str(src)


def test_publish_json_then_unchanged_republish(weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    src = _tree(tmp_path)
    r1 = runner.invoke(main, ["publish", src, "--ref", "team/harness:v1", "--class", "harness", "--json"])
    assert r1.exit_code == 0, r1.output
    first = json.loads(r1.output)
    assert set(first) == {"ref", "digest", "toc_digest", "size", "uploaded_bytes", "layer_digest"}
    assert first["uploaded_bytes"] == first["size"] > 0
    r2 = runner.invoke(main, ["publish", src, "--ref", "team/harness:v1", "--json"])
    second = json.loads(r2.output)
    assert (second["digest"], second["uploaded_bytes"]) == (first["digest"], 0)
    r3 = runner.invoke(main, ["publish", src, "--ref", "team/harness:v1"])
    assert r3.exit_code == 0 and "no upload" in r3.output and "tag unchanged" in r3.output


def test_layer_commands_accept_a_ref(weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    src = _tree(tmp_path)
    out = json.loads(runner.invoke(main, ["publish", src, "--ref", "h:v1", "--json"]).output)
    cat = runner.invoke(main, ["layer", "cat", "h:v1", "etc/motd"])
    assert cat.exit_code == 0 and cat.output == "hello cli\n"
    inspect = runner.invoke(main, ["layer", "inspect", f"h@{out['digest']}", "--json"])
    assert json.loads(inspect.output)["digest"] == out["layer_digest"]
    assert runner.invoke(main, ["layer", "verify", "h:v1"]).exit_code == 0


def test_cli_errors_are_clean(weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    src = _tree(tmp_path)
    bad = runner.invoke(main, ["publish", src, "--ref", "Bad/Ref:v1"])
    assert bad.exit_code != 0 and "invalid REF" in bad.output and "Traceback" not in bad.output
    missing = runner.invoke(main, ["layer", "cat", "nothere:v1", "x"])
    assert missing.exit_code != 0 and "no manifest" in missing.output


@pytest.mark.integration
def test_pull_and_export_commands(busybox_oci, weenv_home, tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    r = runner.invoke(main, ["pull", f"oci:{busybox_oci}:bb", "--name", "bb:v1", "--groups", "os=0,app=1-", "--json"])
    assert r.exit_code == 0, r.output
    pulled = json.loads(r.output)
    assert [g["ref"] for g in pulled["groups"]] == ["bb/os:v1", "bb/app:v1"]
    assert pulled["config"]["working_dir"] == "/srv"
    out = str(tmp_path / "oci")
    e = runner.invoke(main, ["export", "bb/app:v1", "--oci", f"{out}:x", "--json"])
    assert e.exit_code == 0, e.output
    assert json.loads(e.output)["tag"] == "x"
    assert os.path.exists(os.path.join(out, "index.json"))
