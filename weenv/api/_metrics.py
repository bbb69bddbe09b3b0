"""The API's own Prometheus series, in a registry of their own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["ApiMetrics"]


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("weenv_api_requests", "API requests answered, by surface, method and status",
                                ["surface", "method", "status"], registry=self.registry)
        self.latency = Histogram("weenv_api_request_seconds", "Time to the answer's head, by surface",
                                 ["surface"], registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.auth_failures = Counter("weenv_api_auth_failures", "Requests refused for a missing or wrong key "
                                     "or access token", ["surface", "reason"], registry=self.registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)
