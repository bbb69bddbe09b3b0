"""The unmodified E2B SDK (sync), pointed at ``weenv serve`` in front of a real daemon and real crun envs."""

from __future__ import annotations

import pytest

from .fixtures_api import Served, served, weenv_serve  # noqa: F401

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.integration]


def test_create_get_info_kill(served: Served) -> None:
    sbx = e2b.Sandbox.create("bb", metadata={"who": "sync"}, timeout=120)
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == "bb"
        assert info.metadata == {"who": "sync"}
        assert info.state.value == "running"
        assert sbx.is_running()
    finally:
        assert sbx.kill() is True
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.get_info(sbx.sandbox_id)
