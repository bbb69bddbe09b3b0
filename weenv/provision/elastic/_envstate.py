"""What the elastic monitor keeps of each env (its quota state, last sample, counters) and how it
shows it: the per-env view of ``GET /v1/top``, the counters, and the small helpers the monitor's
tick uses on them. The tick itself is weenv/provision/elastic/_monitor.py."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from ..cgroups._base import Cgroup, CgroupSample
from ._policy import Decision, EnvLimits, EnvQuotaState, NodeView

log = logging.getLogger("weenv.provision.monitor")


class EnvMetrics(msgspec.Struct, kw_only=True):
    """Counters for one env since it was added."""

    cpu_up: int = 0
    cpu_down: int = 0
    memory_up: int = 0
    memory_down: int = 0
    cpu_refusals: int = 0
    """Episodes in which a CPU doubling was refused (node burst budget spent)."""
    memory_refusals: int = 0
    """Episodes in which a memory doubling was refused (node headroom short)."""
    memory_hardened: int = 0
    """Times an env waited ``memory_wait_s`` at its limit and the limit became hard (OOM kill there)."""
    throttled_ns: int = 0
    """CFS throttled time observed while monitored."""
    oom_kills: int = 0
    """Processes OOM-killed inside the env's cgroup while monitored."""
    oom_events: int = 0
    """Times the env's cgroup ran out of memory (v2 ``memory.events oom``; v1 counts kills only)."""
    memory_limit_hits: int = 0
    sample_errors: int = 0
    apply_errors: int = 0


class MonitorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    envs: int
    ticks: int
    late_ticks: int
    """Ticks that started after the next one was due (the loop skips ahead, never bursts)."""
    last_tick_s: float
    """Wall (trio clock) duration of the last tick, sampling and applying included."""
    admitted: int = 0
    admission_refusals: int = 0
    """Envs :meth:`Monitor.admit` refused (their min did not fit)."""
    fast_steps: int = 0
    """Steps run between ticks for envs whose tasks stalled at their memory limit."""
    quiet_ticks: int = 0
    """Ticks in which no group had used CPU: only unsettled envs and due memory refreshes were read."""


class _Env:
    __slots__ = (
        "env_id", "cgroup", "limits", "memory_limits", "state", "last", "metrics", "last_change", "decision",
        "error", "key", "settled", "watch", "sampled_s", "sampled_tick", "slot", "waiting_since",
    )  # fmt: skip

    def __init__(self, env_id: str, cgroup: Cgroup, limits: EnvLimits, state: EnvQuotaState):
        self.env_id = env_id
        self.cgroup = cgroup
        self.limits = limits
        #: The limits with CPU left out, for steps that judge memory only.
        self.memory_limits = msgspec.structs.replace(limits, cpu_min_cores=None, cpu_max_cores=None)
        self.state = state
        self.last: CgroupSample | None = None
        self.metrics = EnvMetrics()
        self.last_change: dict[str, Any] | None = None
        self.decision: Decision | None = None
        self.error: str | None = None
        #: The counters decide() depends on, from the last sample.
        self.key: tuple | None = None
        #: The last decision saw unchanged counters, changed and refused nothing and left no hold
        #: timer running. decide() is deterministic in (state, counter deltas, levels) and only
        #: reads the clock through timers and the node when a signal asks for more, so the same
        #: unchanged counters next tick give the same decision: skip it. Idle envs sitting at
        #: their mins, the common case, cost the monitor a sample and a tuple compare.
        self.settled = False
        #: The memory event descriptor run() waits on, if any.
        self.watch: int | None = None
        #: When (and in which tick) it was last sampled (settled envs are skipped; see Monitor.tick).
        self.sampled_s = float("-inf")
        self.sampled_tick = -1
        #: Spreads the reads of settled envs over ticks (Monitor ``settled_read_every``).
        self.slot = 0
        #: Since when a memory doubling has been refused (None: not waiting). Waiting envs decide
        #: first, oldest first, so freed memory goes to them in order.
        self.waiting_since: float | None = None


def _reserved(env: _Env, state: EnvQuotaState) -> int:
    """What a bursting env may still take on the way to its max."""
    mem = env.limits.memory_range
    if not state.memory_bursting or mem is None or state.memory_limit_bytes is None:
        return 0
    return max(0, mem[1] - state.memory_limit_bytes)


def _waiting_first(item: tuple[_Env, CgroupSample, bool]) -> tuple[bool, float]:
    since = item[0].waiting_since
    return (since is None, since or 0.0)


def node_for(node: NodeView, held: int) -> NodeView:
    return node if not held else msgspec.structs.replace(node, memory_reserved_bytes=node.memory_reserved_bytes + held)


def _accumulate(into: EnvMetrics, m: EnvMetrics) -> None:
    for field in EnvMetrics.__struct_fields__:
        setattr(into, field, getattr(into, field) + getattr(m, field))


def count_sample(env: _Env, sample: CgroupSample, prev: CgroupSample | None) -> None:
    """Add what changed since ``prev`` to the env's counters (throttling, limit hits, OOMs)."""
    if prev is None:
        return
    m = env.metrics
    m.throttled_ns += max(0, sample.throttled_ns - prev.throttled_ns)
    m.memory_limit_hits += max(0, sample.memory_limit_hits - prev.memory_limit_hits)
    m.oom_events += max(0, sample.oom_events - prev.oom_events)
    kills = sample.oom_kills - prev.oom_kills
    if kills > 0:
        m.oom_kills += kills
        log.warning(
            "env %s: %d process(es) OOM-killed inside its cgroup at %s bytes (max %s)",
            env.env_id, kills, sample.memory_limit_bytes, env.limits.memory_max_bytes,
        )


def env_view(env: _Env) -> dict[str, Any]:
    """One env's quotas, usage and counters, JSON-ready (its entry in ``GET /v1/top``)."""
    s, d, lim = env.last, env.decision, env.limits
    return {
        "cpu": {
            "quota_cores": env.state.cpu_quota_cores,
            "used_cores": d.cpu_usage_cores if d else None,
            "throttled_share": d.cpu_throttled_share if d else None,
            "min_cores": lim.cpu_range[0] if lim.cpu_range else None,
            "max_cores": lim.cpu_range[1] if lim.cpu_range else None,
            "refused": env.state.cpu_refused,
        },
        "memory": {
            "limit_bytes": env.state.memory_limit_bytes,
            "used_bytes": s.memory_usage_bytes if s else None,
            "min_bytes": lim.memory_range[0] if lim.memory_range else None,
            "max_bytes": lim.memory_range[1] if lim.memory_range else None,
            "refused": env.state.memory_refused,
            "bursting": env.state.memory_bursting,
            "hard": env.state.memory_hard,
            "reserved_bytes": _reserved(env, env.state),
            "pressure_some_avg10": s.memory_pressure_some_avg10 if s else None,
        },
        "pids": {"current": s.pids_current if s else None, "max": lim.pids_max},
        "last_change": env.last_change,
        "error": env.error,
        "metrics": msgspec.structs.asdict(env.metrics),
    }


def record_decision(env: _Env, d: Decision, actual: int | None, error: Exception | None, now: float) -> None:
    """What a decision the monitor applied (or failed to) did to the env: its new state, counters and log."""
    if error is not None:
        env.metrics.apply_errors += 1
        log.warning("env %s: could not apply %s: %s", env.env_id, "; ".join(d.reasons), error)
        return
    old = env.state
    state = d.state
    if d.memory_change is not None and actual != d.memory_limit_bytes:
        log.warning(
            "env %s: kernel kept memory limit %s bytes instead of %s (usage could not be reclaimed)",
            env.env_id, actual, d.memory_limit_bytes,
        )
        state = msgspec.structs.replace(state, memory_limit_bytes=actual)
    env.state = state
    m = env.metrics
    if d.memory_change == "hard":
        m.memory_hardened += 1
        log.warning("env %s: %s", env.env_id, next((r for r in d.reasons if "hard limit" in r), ""))
    elif d.memory_change == "elastic":
        log.info("env %s: %s", env.env_id, next((r for r in d.reasons if "throttles again" in r), ""))
    for resource, change, before, after in (
        ("cpu", d.cpu_change, old.cpu_quota_cores, state.cpu_quota_cores),
        ("memory", d.memory_change, old.memory_limit_bytes, state.memory_limit_bytes),
    ):
        if change is None or before == after:
            continue
        setattr(m, f"{resource}_{change}", getattr(m, f"{resource}_{change}") + 1)
        reason = next((r for r in d.reasons if r.startswith(resource)), "")
        env.last_change = {
            "resource": resource, "direction": change, "from": before, "to": after,
            "reason": reason, "at_s": now, "wall_s": time.time(),
        }  # fmt: skip
        log.info("env %s: %s", env.env_id, reason)


def add_commitments(env: _Env, state: EnvQuotaState, sample: CgroupSample | None, acc: list) -> None:
    """Adds the env's share to ``acc`` = [cpu burst committed, memory promised, reserved]."""
    cpu = env.limits.cpu_range
    q = state.cpu_quota_cores
    if cpu is not None and q is not None and q > cpu[0]:
        acc[0] += q - cpu[0]
    limit = state.memory_limit_bytes
    if limit is not None:
        used = sample.memory_usage_bytes if sample is not None else 0
        if limit > used:
            acc[1] += limit - used
        acc[2] += _reserved(env, state)
