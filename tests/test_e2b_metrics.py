"""``weenv serve``'s /metrics scraped by a real Prometheus (Debian's ``prometheus``, on 127.0.0.1,
started and stopped by PID), and a weenv series queried back through its HTTP API."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse

import httpx
import pytest

from .fixtures_api import Served, served, weenv_serve  # noqa: F401

pytestmark = [pytest.mark.integration]

PROMETHEUS = "/usr/bin/prometheus"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_prometheus_scrapes_weenv_serve(served: Served, tmp_path) -> None:  # type: ignore[no-untyped-def]
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip("Debian's prometheus package is not installed (make deps)")
    target = urllib.parse.urlsplit(served.url).netloc
    httpx.get(served.url + "/sandboxes", headers={"X-API-Key": "wrong"}, timeout=5)  # an auth failure to count
    (tmp_path / "prometheus.yml").write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: weenv
    metrics_path: /metrics
    authorization:
      type: Bearer
      credentials: {served.keys['root']}
    static_configs:
      - targets: ["{target}"]
""")
    port = _free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    try:
        api = f"http://127.0.0.1:{port}/api/v1/query"
        deadline = time.monotonic() + 60
        found: dict[str, list] = {}  # type: ignore[type-arg]
        queries = ['up{job="weenv"} == 1', 'weenv_api_auth_failures_total{reason="wrong_key"}',
                   'weenv_api_request_seconds_count{surface="e2b"}']
        while len(found) < len(queries):
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, f"no scrape within 60 s: {found}\n" + \
                (tmp_path / "prometheus.log").read_text()[-2000:]
            for q in queries:
                try:
                    r = httpx.get(api, params={"query": q}, timeout=2)
                except httpx.TransportError:
                    break  # not listening yet
                result = r.json().get("data", {}).get("result", []) if r.status_code == 200 else []
                if result:
                    found[q] = result
            time.sleep(0.5)
        assert float(found[queries[1]][0]["value"][1]) >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp_path / "data", ignore_errors=True)
