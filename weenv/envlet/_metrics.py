"""Counters and a latency histogram, exposed through the control socket and prometheus_client."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator

COUNTERS = (
    ("l1_hits", "chunks served from the memory cache"),
    ("l1_misses", "chunks not in the memory cache"),
    ("l1_bytes", "bytes served from the memory cache"),
    ("l1_evictions", "chunks evicted from the memory cache"),
    ("l2_hits", "chunks read from the node disk cache"),
    ("l2_misses", "chunks not in the node disk cache"),
    ("l2_bytes_read", "bytes read from the node disk cache"),
    ("l2_bytes_written", "bytes written to the node disk cache"),
    ("l2_evictions", "chunk files evicted from the node disk cache"),
    ("l2_write_errors", "chunks the node disk cache could not store (disk full or failing)"),
    ("l2_corrupt", "node disk cache files that failed verification (discarded)"),
    ("remote_fetches", "range requests to the store"),
    ("remote_bytes", "bytes fetched from the store"),
    ("remote_chunks", "chunks fetched from the store"),
    ("remote_errors", "range requests that failed"),
    ("readahead_chunks", "chunks fetched ahead of a read"),
    ("prefetch_bytes", "bytes fetched by background prefetch"),
    ("coalesced_waits", "reads that waited for another read's fetch of the same chunk"),
    ("verify_failures", "chunks from any tier that failed sha256 or decompression checks (asked of the next tier)"),
    ("failed_fast", "reads of a chunk whose fetch had just failed, failed again at once"),
    ("read_errors", "FUSE reads answered with EIO"),
    ("fuse_reads", "FUSE read requests"),
    ("fuse_read_bytes", "bytes returned to FUSE reads"),
    ("fuse_loop_wakeups", "times the FUSE loop was woken from a read of /dev/fuse with nothing to read"),
    ("peer_requests", "requests answered by peer nodes (the peer tier)"),
    ("peer_chunks", "chunks received from peer nodes (before verification)"),
    ("peer_bytes", "bytes received from peer nodes"),
    ("peer_misses", "chunks asked of a peer that it did not hold"),
    ("peer_errors", "peer requests that failed (refused, reset, malformed)"),
    ("peer_timeouts", "peer requests given up at the hedge or stall deadline"),
    ("peer_corrupt", "chunks from a peer that failed verification (the peer is penalised)"),
    ("peer_served_requests", "peer requests this node answered"),
    ("peer_served_chunks", "chunks this node served to peers"),
    ("peer_served_bytes", "bytes this node served to peers"),
    ("peer_served_fetches", "chunks this node fetched for a peer (it owned their region)"),
    ("peer_refused", "peer requests refused: missing or wrong cluster token"),
    ("peer_drained", "peer requests refused while this node is drained"),
)
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Thread-safe counters (worker threads and the trio loop both count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {name: 0 for name, _ in COUNTERS}
        self.latency_buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.latency_sum_s = 0.0
        self.peer_latency_buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.peer_latency_sum_s = 0.0

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def observe_fetch(self, seconds: float) -> None:
        with self._lock:
            self.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            self.latency_sum_s += seconds

    def observe_peer(self, seconds: float) -> None:
        with self._lock:
            self.peer_latency_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            self.peer_latency_sum_s += seconds

    def snapshot(self) -> dict:
        with self._lock:
            return {
                **self.counters,
                "remote_latency": {
                    "buckets_s": list(LATENCY_BUCKETS_S),
                    "counts": list(self.latency_buckets),
                    "sum_s": self.latency_sum_s,
                },
                "peer_latency": {
                    "buckets_s": list(LATENCY_BUCKETS_S),
                    "counts": list(self.peer_latency_buckets),
                    "sum_s": self.peer_latency_sum_s,
                },
            }


def start_prometheus(metrics: Metrics, port: int, envs: "callable", gauges: "callable",  # type: ignore[valid-type]
                     layer_tiers: "callable | None" = None) -> None:  # type: ignore[valid-type]
    """Serve the counters on http://0.0.0.0:PORT/metrics (prometheus text format)."""
    from prometheus_client import start_http_server
    from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    docs = dict(COUNTERS)

    class Collector:
        def collect(self) -> Iterator[object]:
            snap = metrics.snapshot()
            for name, _ in COUNTERS:
                c = CounterMetricFamily(f"weenv_envlet_{name}", docs[name])
                c.add_metric([], snap[name])
                yield c
            for key, hname, hdoc in (("remote_latency", "remote_fetch_seconds", "store range request latency"),
                                     ("peer_latency", "peer_fetch_seconds", "peer chunk request latency")):
                lat = snap[key]
                buckets, acc = [], 0
                for le, n in zip(list(lat["buckets_s"]) + [float("inf")], lat["counts"]):
                    acc += n
                    buckets.append((str(le) if le != float("inf") else "+Inf", acc))
                h = HistogramMetricFamily(f"weenv_envlet_{hname}", hdoc)
                h.add_metric([], buckets, lat["sum_s"])
                yield h
            if layer_tiers is not None:  # {layer: {tier: {"chunks": n, "bytes": n}}}
                lc = CounterMetricFamily("weenv_envlet_layer_tier_chunks", "chunks of a layer each tier answered",
                                         labels=["layer", "tier"])
                lb = CounterMetricFamily("weenv_envlet_layer_tier_bytes", "bytes of a layer each tier answered",
                                         labels=["layer", "tier"])
                for layer, per in layer_tiers().items():
                    for tier, v in per.items():
                        lc.add_metric([layer, tier], v["chunks"])
                        lb.add_metric([layer, tier], v["bytes"])
                yield lc
                yield lb
            per_env = envs()  # {env: {"requests": {op: n}, "busy_s", "read_bytes", "delayed", "delayed_s"}}
            req = CounterMetricFamily("weenv_envlet_env_requests", "FUSE requests by env and kind", labels=["env", "op"])
            busy = CounterMetricFamily("weenv_envlet_env_busy_seconds", "envlet loop time charged to the env",
                                       labels=["env"])
            rbytes = CounterMetricFamily("weenv_envlet_env_read_bytes", "bytes read by the env", labels=["env"])
            delayed = CounterMetricFamily("weenv_envlet_env_delayed_requests",
                                          "requests that waited for the env's fair share", labels=["env"])
            delayed_s = CounterMetricFamily("weenv_envlet_env_delayed_seconds", "time those requests waited",
                                            labels=["env"])
            for env, u in per_env.items():
                for op, n in u["requests"].items():
                    req.add_metric([env, op], n)
                busy.add_metric([env], u["busy_s"])
                rbytes.add_metric([env], u["read_bytes"])
                delayed.add_metric([env], u["delayed"])
                delayed_s.add_metric([env], u["delayed_s"])
            yield from (req, busy, rbytes, delayed, delayed_s)
            for name, value in gauges().items():
                g = GaugeMetricFamily(f"weenv_envlet_{name}", name.replace("_", " "))
                g.add_metric([], value)
                yield g

    REGISTRY.register(Collector())
    start_http_server(port)
