"""Env ids name their node (``weenv daemon --node-name``): the cluster routes an id without asking."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from weenv.cli import main
from weenv.provision.envs import _state


@pytest.fixture(autouse=True)
def _no_node_name():
    yield
    _state.set_node_name(None)


def test_ids_start_with_the_node_name():
    _state.set_node_name("n1a2b3c4d")
    env_id = _state.new_env_id("bb")
    assert env_id.startswith("n1a2b3c4d-bb-") and len(env_id) == len("n1a2b3c4d-bb-") + 8
    assert len(_state.new_env_id("x" * 80)) <= 63  # still a hostname


def test_without_a_node_name_ids_are_as_before():
    assert _state.new_env_id("bb").count("-") == 1


@pytest.mark.parametrize("bad", ["N1", "a-b", "x" * 13, "a.b", "é"])
def test_bad_node_names_are_refused(bad):
    with pytest.raises(ValueError, match="node name"):
        _state.set_node_name(bad)


def test_daemon_config_takes_the_node_name_from_the_environment(monkeypatch):
    from weenv.provision import DaemonConfig

    monkeypatch.setenv("WEENV_NODE_NAME", "nodeb")
    assert DaemonConfig().node_name == "nodeb"


def test_daemon_cli_refuses_a_bad_node_name():
    result = CliRunner().invoke(main, ["daemon", "--node-name", "Bad-Name"])
    assert result.exit_code == 2 and "--node-name" in result.output
