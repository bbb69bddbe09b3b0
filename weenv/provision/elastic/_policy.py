"""The elastic-quota policy: two samples in, new CPU quota and memory limit out.

Pure functions on plain values: no I/O, no clock (``now_s`` is passed in), so every rule and the
hysteresis are unit-tested with made-up samples. :mod:`._monitor` applies the decisions.

Rules (see docs/elastic.md for the reasoning and the defaults):

- CPU up: throttled in >= ``cpu_throttle_up_share`` of the CFS periods since the last sample ->
  double the quota, capped by the env's max and by the node's burst budget.
- CPU down: usage below ``cpu_low_share`` of the quota for ``hold_s`` -> halve (>= min).
- Memory up: usage >= ``memory_high_water`` of the limit, or the limit was hit (failcnt /
  memory.events max|high), or tasks stall at it (v1), or memory pressure grew by
  ``memory_pressure_up_share`` of the wall time -> double (<= max) if the node has headroom
  (available - promised - reserved - reserve), else refuse and leave the env throttled at its
  limit. With ``memory_burst_reservation`` (the default) the first doubling of a burst must fit
  the env's whole way to its max, which stays reserved until the burst ends (its first halving):
  envs that cannot start a burst wait at their current limit, and every env that started one can
  finish it, so envs never wait on each other's half-grown limits (no deadlock on a full node).
- Memory wait is bounded: an env whose doubling has been refused for ``memory_wait_s`` gets its
  current limit as its hard limit ("hard"): the kernel OOM-kills inside the env there instead of
  letting its tasks wait (v1: sleeping with the OOM killer disabled; v2: throttled above
  memory.high) for a node that may never have room. The limit turns elastic again ("elastic")
  once the env no longer asks for more, or with its next doubling or halving.
- Memory down: usage below ``memory_low_water`` of the limit for ``hold_s`` -> halve, never below
  usage + ``memory_headroom_bytes`` nor the min. While other envs wait for memory (a doubling
  refused for want of node headroom), the hold is ``memory_contended_hold_s`` and the limit drops
  straight to that floor: halving keeps a finished burst's memory promised for several holds (448
  MiB, then 224, 112, ...), which the waiting envs need now.

Hysteresis comes from the gaps between the thresholds: right after a doubling the env's load is
at most about half its new quota (above the quarter that would halve it), and right after a
halving it is below half (under the thresholds that would double it); halving also needs the
condition to hold for ``hold_s`` without a break.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import msgspec

from ..cgroups._base import CgroupSample, page_align_up

_MIB = 1 << 20
# Tick times are sums of floats; a hold of exactly N ticks must not miss by one ulp.
_EPS_S = 1e-6


def _mib(n: int) -> str:
    return f"{n / _MIB:.0f} MiB"


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else _mib(n)


class EnvLimits(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """What a plan's ``resources`` declares for one env. A resource with neither min nor max is
    left unlimited; with only one of them, or min == max, it is fixed at that value."""

    cpu_min_cores: float | None = None
    cpu_max_cores: float | None = None
    memory_min_bytes: int | None = None
    memory_max_bytes: int | None = None
    pids_max: int | None = None

    def __post_init__(self) -> None:
        for name in ("cpu_min_cores", "cpu_max_cores", "memory_min_bytes", "memory_max_bytes", "pids_max"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"EnvLimits.{name} must be > 0, got {value}")
        lo, hi = self.cpu_min_cores, self.cpu_max_cores
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"EnvLimits: cpu_min_cores {lo} > cpu_max_cores {hi}")
        lo, hi = self.memory_min_bytes, self.memory_max_bytes
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"EnvLimits: memory_min_bytes {lo} > memory_max_bytes {hi}")

    @functools.cached_property  # read every tick for every env
    def cpu_range(self) -> tuple[float, float] | None:
        """``(min, max)`` cores, or None when unlimited."""
        lo, hi = self.cpu_min_cores, self.cpu_max_cores
        if lo is None and hi is None:
            return None
        return (lo if lo is not None else hi, hi if hi is not None else lo)  # type: ignore[return-value]

    @functools.cached_property
    def memory_range(self) -> tuple[int, int] | None:
        """``(min, max)`` bytes, page-aligned, or None when unlimited."""
        lo, hi = self.memory_min_bytes, self.memory_max_bytes
        if lo is None and hi is None:
            return None
        lo = lo if lo is not None else hi
        hi = hi if hi is not None else lo
        return page_align_up(lo), page_align_up(hi)  # type: ignore[arg-type]


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Thresholds of the policy; daemon flags override them."""

    cpu_throttle_up_share: float = 0.30
    """Double the quota when at least this share of the CFS periods since the last tick were throttled."""
    cpu_low_share: float = 0.25
    """Halve the quota when usage stays below this share of it for ``hold_s``."""
    memory_high_water: float = 0.80
    """Double the memory limit when usage reaches this share of it."""
    memory_low_water: float = 0.25
    """Halve the memory limit when usage stays below this share of it for ``hold_s``."""
    memory_pressure_up_share: float = 0.05
    """Double when PSI memory "some" stall time grew by this share of the wall time since the last tick."""
    hold_s: float = 2.0
    """How long a resource must stay under-used, without a break, before each halving."""
    memory_headroom_bytes: int = 64 * _MIB
    """A halved memory limit stays at least this far above current usage."""
    node_memory_reserve_bytes: int = 512 * _MIB
    """Memory the policy never hands to envs (the daemon, the envlet, the kernel)."""
    cpu_burst_budget_cores: float | None = None
    """Cap on the sum over envs of (quota - min): how much burst CPU is handed out at once.
    None: the node's core count."""
    cpu_min_overcommit: float = 1.0
    """Admission: the sum of CPU mins may reach node cores times this."""
    memory_wait_s: float = 20.0
    """How long an env may wait at its memory limit for a refused doubling before that limit
    becomes hard (the kernel OOM-kills inside the env there). Bounds every stall."""
    memory_contended_hold_s: float = 0.2
    """The memory hold (instead of ``hold_s``, if shorter) while other envs wait for memory: how long
    a finished burst keeps its limit before it goes straight down to usage + headroom (0: at the
    first low reading; the default needs two readings a tick apart, so one dip between two
    allocations does not end a burst)."""
    memory_burst_reservation: bool = True
    """A burst (memory doublings from a limit the env was not already growing from) starts only
    if the node can cover the env up to its max, and that much stays reserved until the burst
    ends. False: each doubling only needs its own increase (envs can then block one another,
    each stalled at a partial limit, on a node without headroom)."""


DEFAULT_POLICY = PolicyConfig()


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """The node as the policy sees it during one tick; the monitor updates the committed and
    promised totals after each grant so envs deciding later in the same tick see them."""

    cpu_cores: float
    cpu_burst_committed_cores: float = 0.0
    """Sum over managed envs of (current quota - min)."""
    memory_total_bytes: int
    memory_available_bytes: int
    """Memory the kernel could still hand out (MemAvailable, capped by weenv's parent's limits)."""
    memory_promised_bytes: int = 0
    """Sum over managed envs of (limit - usage): memory envs may still take without asking."""
    memory_reserved_bytes: int = 0
    """Sum over bursting envs of (max - limit): what their bursts may still take."""
    memory_waiters: int = 0
    """Envs whose memory doubling is being refused for want of headroom (as of the last tick)."""

    def memory_headroom_bytes(self, cfg: PolicyConfig) -> int:
        return (
            self.memory_available_bytes - self.memory_promised_bytes - self.memory_reserved_bytes
            - cfg.node_memory_reserve_bytes
        )  # fmt: skip


class EnvQuotaState(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy remembers about one env between ticks."""

    cpu_quota_cores: float | None
    memory_limit_bytes: int | None
    cpu_low_since_s: float | None = None
    memory_low_since_s: float | None = None
    cpu_last_change_s: float | None = None
    memory_last_change_s: float | None = None
    cpu_refused: bool = False
    """A CPU doubling is being refused (the node's burst budget is spent)."""
    memory_refused: bool = False
    """A memory doubling is being refused (the node has no headroom)."""
    memory_bursting: bool = False
    """The env is growing: its way up to max is reserved on the node (memory_burst_reservation)
    until the limit is halved again."""
    memory_refused_since_s: float | None = None
    """When the current run of refused memory doublings began (None: not refused)."""
    memory_hard: bool = False
    """The limit in force is also the hard limit (the env waited ``memory_wait_s``): the kernel
    OOM-kills at it rather than throttling."""


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    state: EnvQuotaState
    """The state to keep for the next tick (quotas included)."""
    cpu_quota_cores: float | None
    memory_limit_bytes: int | None
    cpu_change: str | None = None
    """"up", "down" or None."""
    memory_change: str | None = None
    """"up", "down", "hard" (the limit stays, and becomes the kill limit) or "elastic" (it stays,
    and throttles again below the max)."""
    cpu_refused: bool = False
    memory_refused: bool = False
    reasons: tuple[str, ...] = ()
    cpu_usage_cores: float | None = None
    """Measured between the two samples (None without a previous sample)."""
    cpu_throttled_share: float | None = None


class Admission(msgspec.Struct, frozen=True):
    admitted: bool
    reason: str

    def __bool__(self) -> bool:
        return self.admitted


def initial_state(limits: EnvLimits, start_cpu_cores: float | None = None) -> EnvQuotaState:
    """Every env starts at its min, but for the CPU quota a start hint (the quota of the env a
    snapshot was taken from), clamped to the env's range: a fork of a busy env starts busy, and
    the monitor halves it if it idles."""
    cpu = limits.cpu_range
    mem = limits.memory_range
    if cpu is not None and start_cpu_cores is not None:
        cpu = (min(max(start_cpu_cores, cpu[0]), cpu[1]), cpu[1])
    return EnvQuotaState(
        cpu_quota_cores=None if cpu is None else cpu[0],
        memory_limit_bytes=None if mem is None else mem[0],
    )


def adopt_state(limits: EnvLimits, sample: CgroupSample) -> EnvQuotaState:
    """State for an env found running after a daemon restart: keep the quotas it has, clamped to
    what its plan allows."""
    cpu = limits.cpu_range
    mem = limits.memory_range
    q = sample.cpu_quota_cores
    m = sample.memory_limit_bytes
    return EnvQuotaState(
        cpu_quota_cores=None if cpu is None else min(max(q if q is not None else cpu[1], cpu[0]), cpu[1]),
        memory_limit_bytes=None if mem is None else min(max(m if m is not None else mem[1], mem[0]), mem[1]),
    )


def decide(
    state: EnvQuotaState,
    sample: CgroupSample,
    prev_sample: CgroupSample | None,
    limits: EnvLimits,
    node: NodeView,
    cfg: PolicyConfig,
    now_s: float,
) -> Decision:
    """One tick of the policy for one env. See the module docstring for the rules."""
    reasons: list[str] = []
    dt_s = 0.0 if prev_sample is None else sample.timestamp_s - prev_sample.timestamp_s

    # -- CPU -------------------------------------------------------------------------------------
    quota = state.cpu_quota_cores
    new_quota = quota
    cpu_change = None
    cpu_refused = False
    cpu_low_since = state.cpu_low_since_s
    cpu_last_change = state.cpu_last_change_s
    usage_cores = share = None
    cpu = limits.cpu_range
    if prev_sample is not None and dt_s > 0:
        usage_cores = max(0, sample.cpu_usage_ns - prev_sample.cpu_usage_ns) / (dt_s * 1e9)
        periods = sample.nr_periods - prev_sample.nr_periods
        share = (sample.nr_throttled - prev_sample.nr_throttled) / periods if periods > 0 else 0.0
    if quota is not None and cpu is not None and cpu[1] > cpu[0] and usage_cores is not None:
        lo, hi = cpu
        assert share is not None
        if share >= cfg.cpu_throttle_up_share:
            cpu_low_since = None
            if quota < hi:
                budget = cfg.cpu_burst_budget_cores if cfg.cpu_burst_budget_cores is not None else node.cpu_cores
                room = max(0.0, budget - node.cpu_burst_committed_cores)
                target = min(quota * 2, hi, quota + room)
                # Steps below 1 % are noise the kernel rounds away anyway.
                if target > quota * 1.01:
                    new_quota, cpu_change, cpu_last_change = target, "up", now_s
                    reasons.append(
                        f"cpu {quota:.3g} -> {target:.3g} cores: throttled in {share:.0%} of periods"
                    )
                else:
                    cpu_refused = True
                    if not state.cpu_refused:
                        reasons.append(
                            f"cpu stays at {quota:.3g} cores: node burst budget {budget:.3g} cores is spent"
                        )
        elif usage_cores < cfg.cpu_low_share * quota and quota > lo:
            if cpu_low_since is None:
                cpu_low_since = now_s
            elif now_s - cpu_low_since >= cfg.hold_s - _EPS_S:
                target = max(quota / 2, lo)
                new_quota, cpu_change, cpu_last_change = target, "down", now_s
                # The next halving needs a full hold again.
                cpu_low_since = now_s
                reasons.append(
                    f"cpu {quota:.3g} -> {target:.3g} cores: used {usage_cores:.3g} "
                    f"(< {cfg.cpu_low_share:.0%}) for {cfg.hold_s:g} s"
                )
        else:
            cpu_low_since = None

    # -- memory ----------------------------------------------------------------------------------
    limit = state.memory_limit_bytes
    new_limit = limit
    mem_change = None
    mem_refused = False
    mem_low_since = state.memory_low_since_s
    mem_last_change = state.memory_last_change_s
    bursting = state.memory_bursting
    refused_since = state.memory_refused_since_s
    hard = state.memory_hard
    mem = limits.memory_range
    if limit is not None and mem is not None and mem[1] > mem[0]:
        lo, hi = mem
        usage = sample.memory_usage_bytes
        signals: list[str] = []
        if usage >= cfg.memory_high_water * limit:
            signals.append(f"usage {_mib(usage)} >= {cfg.memory_high_water:.0%} of {_mib(limit)}")
        if sample.memory_stalled:
            signals.append("tasks wait at the limit")
        if prev_sample is not None:
            hits = sample.memory_limit_hits - prev_sample.memory_limit_hits
            if hits > 0:
                signals.append(f"limit hit {hits}x")
            high = sample.memory_high_events - prev_sample.memory_high_events
            if high > 0:
                signals.append(f"throttled above memory.high {high}x")
            now_us = sample.memory_pressure_some_total_us
            was_us = prev_sample.memory_pressure_some_total_us
            if now_us is not None and was_us is not None and dt_s > 0:
                stall = (now_us - was_us) / (dt_s * 1e6)
                if stall >= cfg.memory_pressure_up_share:
                    signals.append(f"memory stalls {stall:.0%} of the time")
        if signals:
            mem_low_since = None
            if limit < hi:
                target = min(limit * 2, hi)
                headroom = node.memory_headroom_bytes(cfg)
                if not cfg.memory_burst_reservation:
                    need, granted = target - limit, target - limit <= headroom
                elif bursting:
                    # Already reserved up to max when the burst started.
                    need, granted = 0, True
                else:
                    need = hi - limit
                    granted = need <= headroom
                if granted:
                    new_limit, mem_change, mem_last_change = target, "up", now_s
                    bursting = cfg.memory_burst_reservation
                    refused_since, hard = None, False  # the new limit is written elastic
                    reasons.append(f"memory {_mib(limit)} -> {_mib(target)}: {', '.join(signals)}")
                else:
                    mem_refused = True
                    if refused_since is None:
                        refused_since = now_s
                    if not state.memory_refused:
                        reasons.append(
                            f"memory stays at {_mib(limit)} ({', '.join(signals)}): node headroom "
                            f"{_mib(max(0, headroom))} < {_mib(need)} needed"
                            + (f" (the way to max {_mib(hi)})" if need != target - limit else "")
                        )
                    if not hard and now_s - refused_since >= cfg.memory_wait_s - _EPS_S:
                        hard, mem_change, mem_last_change = True, "hard", now_s
                        reasons.append(
                            f"memory {_mib(limit)} is now the hard limit: refused for {now_s - refused_since:.1f} s "
                            f"(>= {cfg.memory_wait_s:g} s), the kernel OOM-kills inside the env instead of "
                            f"letting it wait"
                        )
        elif usage < cfg.memory_low_water * limit and limit > lo:
            refused_since = None
            if mem_low_since is None:
                mem_low_since = now_s  # a hold of 0 (contended) completes at once
            waiters = node.memory_waiters
            hold = min(cfg.hold_s, cfg.memory_contended_hold_s) if waiters else cfg.hold_s
            if now_s - mem_low_since >= hold - _EPS_S:
                bursting = False  # the burst is over: its reservation goes back to the node
                floor = max(page_align_up(usage + cfg.memory_headroom_bytes), lo)
                # Others waiting for memory: give back all of it at once, not half per hold.
                target = floor if waiters else max(limit // 2, floor)
                if target < limit:
                    new_limit, mem_change, mem_last_change = target, "down", now_s
                    hard = False  # the new limit is written elastic
                    reasons.append(
                        f"memory {_mib(limit)} -> {_mib(target)}: used {_mib(usage)} "
                        f"(< {cfg.memory_low_water:.0%}) for {hold:g} s"
                        + (f", {waiters} env(s) wait for memory" if waiters else "")
                    )
                mem_low_since = now_s
        else:
            mem_low_since = None
            refused_since = None
        if hard and not signals and mem_change is None:
            # Nothing asks for more any longer (the kill freed memory, or the load went): tasks may
            # wait at the limit again, for at most memory_wait_s.
            hard, mem_change, mem_last_change = False, "elastic", now_s
            reasons.append(f"memory {_mib(limit)} throttles again (below max {_mib(hi)}): nothing waits at it")

    new_state = EnvQuotaState(
        cpu_quota_cores=new_quota,
        memory_limit_bytes=new_limit,
        cpu_low_since_s=cpu_low_since,
        memory_low_since_s=mem_low_since,
        cpu_last_change_s=cpu_last_change,
        memory_last_change_s=mem_last_change,
        cpu_refused=cpu_refused,
        memory_refused=mem_refused,
        memory_bursting=bursting,
        memory_refused_since_s=refused_since,
        memory_hard=hard,
    )
    return Decision(
        state=new_state,
        cpu_quota_cores=new_quota,
        memory_limit_bytes=new_limit,
        cpu_change=cpu_change,
        memory_change=mem_change,
        cpu_refused=cpu_refused,
        memory_refused=mem_refused,
        reasons=tuple(reasons),
        cpu_usage_cores=usage_cores,
        cpu_throttled_share=share,
    )


def admit(
    requested_min: EnvLimits,
    node: NodeView,
    committed_mins: Iterable[EnvLimits],
    cfg: PolicyConfig = DEFAULT_POLICY,
) -> Admission:
    """Can the node guarantee a new env its mins, next to the mins of the envs already running?

    Memory: the mins of all envs must fit in RAM minus the reserve (mins are never taken back);
    the new max must fit there too (a max the node can never cover is refused, not clamped: the
    plan says what the env may use, and a silent clamp would OOM-kill it below that); the new min
    must fit in today's headroom. CPU: the mins must fit in the node's cores
    (times ``cpu_min_overcommit``). (Mins that fill the RAM leave no env room to grow: size mins
    to what an idle env uses.)
    """
    mem = requested_min.memory_range
    cpu = requested_min.cpu_range
    want_mem = 0 if mem is None else mem[0]
    want_cpu = 0.0 if cpu is None else cpu[0]
    n = 0
    committed_mem = 0
    committed_cpu = 0.0
    for other in committed_mins:
        n += 1
        m, c = other.memory_range, other.cpu_range
        committed_mem += 0 if m is None else m[0]
        committed_cpu += 0.0 if c is None else c[0]
    guaranteed = node.memory_total_bytes - cfg.node_memory_reserve_bytes
    if committed_mem + want_mem > guaranteed:
        return Admission(
            False,
            f"memory min {_mib(want_mem)} does not fit: {_mib(committed_mem)} of {_mib(guaranteed)} "
            f"(RAM minus reserve) already guaranteed to {n} envs",
        )
    if mem is not None and mem[1] > guaranteed:
        # It could never be granted: the env would wait at its limit for room that cannot come.
        return Admission(
            False,
            f"memory max {_size(mem[1])} is more than this node can ever give one env: {_size(guaranteed)} "
            f"(RAM {_size(node.memory_total_bytes)} minus the {_size(cfg.node_memory_reserve_bytes)} node reserve); "
            f"lower resources.memory.max to at most that",
        )
    headroom = node.memory_headroom_bytes(cfg)
    if want_mem > headroom:
        return Admission(
            False, f"memory min {_mib(want_mem)} exceeds the node's headroom now ({_mib(max(0, headroom))})"
        )
    cpu_cap = node.cpu_cores * cfg.cpu_min_overcommit
    if committed_cpu + want_cpu > cpu_cap + 1e-9:
        return Admission(
            False,
            f"cpu min {want_cpu:.3g} cores does not fit: {committed_cpu:.3g} of {cpu_cap:.3g} cores "
            f"already guaranteed to {n} envs",
        )
    return Admission(
        True,
        f"fits: memory {_mib(committed_mem + want_mem)} of {_mib(guaranteed)}, "
        f"cpu {committed_cpu + want_cpu:.3g} of {cpu_cap:.3g} cores guaranteed",
    )
