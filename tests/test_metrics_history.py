"""The daemon's usage history (weenv/provision/elastic/_history.py): the ring's order and bound, the
range filter, envs that go; and ``GET /v1/envs/{id}/metrics`` through the client on a real daemon."""

from __future__ import annotations

import time

import pytest

from weenv.provision.elastic import _history as H


def _view(used: float, mem: int) -> dict:
    return {"cpu": {"used_cores": used, "quota_cores": 1.0}, "memory": {"used_bytes": mem, "limit_bytes": 1 << 30}}


def test_the_ring_keeps_the_newest_points_oldest_first_and_filters_by_time() -> None:
    h = H.History()
    for i in range(H.POINTS + 5):
        h.record({"a": _view(i / 1000, i), "b": _view(0.5, 1)}, now=1000.0 + i)
    pts = h.between("a")
    assert len(pts) == H.POINTS
    assert [p["t"] for p in pts] == [1005.0 + i for i in range(H.POINTS)]
    assert pts[-1] == {"t": 1000.0 + H.POINTS + 4, "cpu_used_cores": (H.POINTS + 4) / 1000, "cpu_quota_cores": 1.0,
                       "memory_used_bytes": H.POINTS + 4, "memory_limit_bytes": 1 << 30}
    assert [p["t"] for p in h.between("a", 1010.0, 1012.0)] == [1010.0, 1011.0, 1012.0]
    assert h.between("a", start=5000.0) == [] and h.between("nope") == []
    h.record({"b": _view(0.5, 1)}, now=9999.0)  # a is gone: its history too
    assert h.between("a") == [] and len(h.between("b")) == H.POINTS


@pytest.mark.integration
def test_env_metrics_through_the_client(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c, c.create(daemon.plan_lock) as env:
        now = time.time()
        points = env.metrics()
        assert points and points[-1]["t"] >= now - 1 and points[-1]["memory_limit_bytes"] > 0
        assert env.metrics(start=now + 3600) == []
        from weenv import WeenvError
        from weenv._calls import Call

        with pytest.raises(WeenvError, match="start.*epoch seconds"):  # what a hand-made query gets
            c._run(Call("env_metrics", {"id": env.id}, query={"start": "yesterday"}, answer=None))
