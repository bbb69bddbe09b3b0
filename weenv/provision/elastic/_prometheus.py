"""The monitor's view in the prometheus text format (``GET /v1/metrics``), apart from the monitor:
the monitor hands over :meth:`~weenv.provision.elastic.Monitor.snapshot` and its statistics, this
module only renders them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._monitor import MonitorStatistics

#: Prometheus exposition content type (text format 0.0.4).
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_prometheus(snapshot: dict[str, Any], stats: MonitorStatistics) -> bytes:
    """The monitor's view in the prometheus text format. Per-env series carry an ``env`` label
    and vanish with the env; ``weenv_*_total`` node-wide counters include removed envs."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def collect() -> Any:
        envs = snapshot["envs"]

        def gauge(name: str, doc: str, pick: Callable[[dict[str, Any]], Any]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["env"])
            for env_id, e in envs.items():
                value = pick(e)
                if value is not None:
                    g.add_metric([env_id], float(value))
            return g

        yield gauge("weenv_env_cpu_quota_cores", "CPU quota in force (cores)", lambda e: e["cpu"]["quota_cores"])
        yield gauge("weenv_env_cpu_used_cores", "CPU used over the last tick (cores)",
                    lambda e: e["cpu"]["used_cores"])
        yield gauge("weenv_env_cpu_min_cores", "Plan's CPU min (cores)", lambda e: e["cpu"]["min_cores"])
        yield gauge("weenv_env_cpu_max_cores", "Plan's CPU max (cores)", lambda e: e["cpu"]["max_cores"])
        yield gauge("weenv_env_memory_limit_bytes", "Elastic memory limit in force",
                    lambda e: e["memory"]["limit_bytes"])
        yield gauge("weenv_env_memory_used_bytes", "Memory charged to the env", lambda e: e["memory"]["used_bytes"])
        yield gauge("weenv_env_memory_min_bytes", "Plan's memory min", lambda e: e["memory"]["min_bytes"])
        yield gauge("weenv_env_memory_max_bytes", "Plan's memory max (OOM kill above)",
                    lambda e: e["memory"]["max_bytes"])
        yield gauge("weenv_env_pids", "Tasks in the env", lambda e: e["pids"]["current"])
        changes = CounterMetricFamily("weenv_env_quota_changes", "Quota changes by resource and direction",
                                      labels=["env", "resource", "direction"])
        refusals = CounterMetricFamily("weenv_env_refusals", "Refused doublings (episodes)", labels=["env", "resource"])
        throttled = CounterMetricFamily("weenv_env_cpu_throttled_seconds", "CFS throttled time", labels=["env"])
        ooms = CounterMetricFamily("weenv_env_oom_kills", "Processes OOM-killed in the env", labels=["env"])
        oom_events = CounterMetricFamily("weenv_env_oom_events", "Times the env ran out of memory", labels=["env"])
        hits = CounterMetricFamily("weenv_env_memory_limit_hits", "Allocations that hit the limit", labels=["env"])
        hardened = CounterMetricFamily("weenv_env_memory_hardened", "Waits at the memory limit that ended with the "
                                       "limit made hard (OOM kill inside the env)", labels=["env"])
        for env_id, e in envs.items():
            m = e["metrics"]
            for resource in ("cpu", "memory"):
                for direction in ("up", "down"):
                    changes.add_metric([env_id, resource, direction], m[f"{resource}_{direction}"])
                refusals.add_metric([env_id, resource], m[f"{resource}_refusals"])
            throttled.add_metric([env_id], m["throttled_ns"] / 1e9)
            ooms.add_metric([env_id], m["oom_kills"])
            oom_events.add_metric([env_id], m["oom_events"])
            hits.add_metric([env_id], m["memory_limit_hits"])
            hardened.add_metric([env_id], m["memory_hardened"])
        yield from (changes, refusals, throttled, ooms, oom_events, hits, hardened)

        t = snapshot["totals"]
        c = CounterMetricFamily("weenv_quota_changes", "Quota changes on this node (removed envs included)",
                                labels=["resource", "direction"])
        for resource in ("cpu", "memory"):
            for direction in ("up", "down"):
                c.add_metric([resource, direction], t[f"{resource}_{direction}"])
        yield c
        c = CounterMetricFamily("weenv_refusals", "Refused doublings and admissions on this node", labels=["resource"])
        c.add_metric(["cpu"], t["cpu_refusals"])
        c.add_metric(["memory"], t["memory_refusals"])
        c.add_metric(["admission"], stats.admission_refusals)
        yield c
        yield CounterMetricFamily("weenv_cpu_throttled_seconds", "CFS throttled time of all envs",
                                  value=t["throttled_ns"] / 1e9)
        yield CounterMetricFamily("weenv_oom_kills", "Processes OOM-killed inside envs", value=t["oom_kills"])
        yield CounterMetricFamily("weenv_admitted", "Envs admitted", value=stats.admitted)
        yield GaugeMetricFamily("weenv_monitor_envs", "Envs the monitor manages", value=stats.envs)
        yield CounterMetricFamily("weenv_monitor_ticks", "Monitor ticks", value=stats.ticks)
        yield CounterMetricFamily("weenv_monitor_late_ticks", "Ticks skipped because the loop was behind",
                                  value=stats.late_ticks)
        yield GaugeMetricFamily("weenv_monitor_last_tick_seconds", "Duration of the last tick", value=stats.last_tick_s)
        node = snapshot["node"]
        if node is not None:
            for key, doc in (
                ("memory_total_bytes", "Node memory (capped by weenv's cgroup ancestors)"),
                ("memory_available_bytes", "Node memory the kernel could still hand out"),
                ("memory_promised_bytes", "Sum over envs of (limit - usage)"),
                ("memory_reserved_bytes", "Sum over bursting envs of (max - limit)"),
                ("memory_waiters", "Envs whose memory doubling is refused for want of headroom"),
                ("memory_headroom_bytes", "available - promised - reserve: room for doublings"),
                ("cpu_cores", "CPU cores the monitor counts"),
                ("cpu_burst_committed_cores", "Sum over envs of (quota - min)"),
            ):
                yield GaugeMetricFamily(f"weenv_node_{key}", doc, value=float(node[key]))

    class _Collector:
        def collect(self) -> Any:
            return collect()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    return generate_latest(registry)
