"""The elastic monitor: one trio task that resizes every registered env's cgroup each tick.

Per tick: one worker-thread call samples every group (and the node's memory), the pure policy
(:func:`._policy.decide`) runs on the trio thread, and a second worker-thread call applies the
few changes. Time comes from ``trio.current_time()``, so tests drive the monitor with
``trio.testing.MockClock(autojump_threshold=0)`` and the fake backend's clock set to the same
``MockClock.current_time``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from .._errors import CgroupError
from ..cgroups._base import Cgroup, CgroupSample
from ._envstate import (
    EnvMetrics,
    MonitorStatistics,
    _accumulate,
    _Env,
    _reserved,
    _waiting_first,
    add_commitments,
    count_sample,
    env_view,
    node_for,
    record_decision,
)
from ._policy import (
    DEFAULT_POLICY,
    Admission,
    Decision,
    EnvLimits,
    NodeView,
    PolicyConfig,
    admit,
    adopt_state,
    decide,
    initial_state,
)
from ._prometheus import render_prometheus

log = logging.getLogger("weenv.provision.monitor")


class Monitor:
    """Resizes the cgroups of registered envs every ``interval_ms``.

    ``node_memory`` returns ``(total_bytes, available_bytes)`` (a backend's ``node_memory``);
    ``cpu_cores`` defaults to the CPUs this process may run on. ``offload`` says what runs in a
    worker thread: ``"all"`` (sampling and applying), ``"apply"`` (only the writes, which can
    block while the kernel reclaims; counter reads cannot, and the thread hand-off costs about
    as much CPU as sampling 50 idle groups on this VM, see benchmarks/monitor_overhead.py) or
    ``"none"`` (deterministic tests under an autojumping clock).
    ``idle_memory_refresh_s``: how stale the memory usage of a group that has not run may get
    (see :meth:`Cgroup.sample`); 0 reads it every tick.
    ``usage_ns``: the CPU time of all groups together (a backend's ``usage_ns``); when it has not
    moved since the last tick no group ran, and settled envs are not sampled at all (quiet tick).
    ``settled_read_every``: in the other ticks, read a settled env (idle, at its quotas, no timer
    running) only every that many ticks, spread over ticks; a task stalling at its memory limit is
    still answered at once (memory events), a CPU burst up to that many ticks later.
    """

    def __init__(
        self,
        node_memory: Callable[[], tuple[int, int]],
        *,
        interval_ms: int = 200,
        cfg: PolicyConfig = DEFAULT_POLICY,
        cpu_cores: float | None = None,
        offload: str = "all",
        idle_memory_refresh_s: float = 1.0,
        usage_ns: Callable[[], int | None] | None = None,
        settled_read_every: int = 1,
    ):
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be > 0, got {interval_ms}")
        self.interval_ms = interval_ms
        self.cfg = cfg
        self.cpu_cores = float(cpu_cores if cpu_cores is not None else len(os.sched_getaffinity(0)))
        self._node_memory = node_memory
        if offload not in ("all", "apply", "none"):
            raise ValueError(f"offload must be 'all', 'apply' or 'none', got {offload!r}")
        self._offload = offload
        self.idle_memory_refresh_s = idle_memory_refresh_s
        self._usage_ns = usage_ns
        self._last_usage_ns: int | None = None
        if settled_read_every < 1:
            raise ValueError(f"settled_read_every must be >= 1, got {settled_read_every}")
        self.settled_read_every = settled_read_every
        self._moved_tick = 0  # the last tick in which the groups' CPU counter moved
        self._slots = 0
        self._quiet_ticks = 0
        self._envs: dict[str, _Env] = {}
        self._ticks = 0
        self._late_ticks = 0
        self._last_tick_s = 0.0
        self._node: NodeView | None = None
        self._node_read_s = float("-inf")
        # Counters of removed envs, so node-wide totals never go down (prometheus counters).
        self._retired = EnvMetrics()
        self._admitted = 0
        self._admission_refusals = 0
        self._fast_steps = 0
        self._pending: list[tuple[float, EnvLimits]] = []
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self._urgent: dict[str, _Env] = {}

    # -- registration (called by the daemon) ----------------------------------------------------

    def add(self, env_id: str, cgroup: Cgroup, limits: EnvLimits, *, adopt: bool = False,
            start_cpu_cores: float | None = None) -> None:
        """Start managing ``cgroup``. A new env gets its mins now (the CPU quota: ``start_cpu_cores``
        when given, clamped to its range); ``adopt=True`` keeps the quotas a running env already has
        (after a daemon restart), clamped to ``limits``. Raises :class:`CgroupError` if the limits
        cannot be written."""
        if env_id in self._envs:
            raise ValueError(f"env {env_id!r} is already monitored")
        first = cgroup.sample() if adopt else None
        state = adopt_state(limits, first) if first is not None else initial_state(limits, start_cpu_cores)
        cpu, mem = limits.cpu_range, limits.memory_range
        if cpu is not None:
            cgroup.set_cpu(state.cpu_quota_cores)
        if mem is not None:
            actual = cgroup.set_memory(state.memory_limit_bytes, hard_limit_bytes=mem[1])
            state = msgspec.structs.replace(state, memory_limit_bytes=actual)
        if limits.pids_max is not None:
            cgroup.set_pids(limits.pids_max)
        env = _Env(env_id, cgroup, limits, state)
        env.slot = self._slots
        self._slots += 1
        # A baseline now lets the very first tick judge rates (one tick sooner to react).
        env.last = cgroup.sample()
        self._envs[env_id] = env
        self._take_pending(limits)
        self._watch(env)
        log.info(
            "env %s: monitored, cpu %s cores, memory %s bytes (limits %s)",
            env_id, state.cpu_quota_cores, state.memory_limit_bytes, limits,
        )

    def remove(self, env_id: str) -> EnvMetrics | None:
        """Stop managing ``env_id`` (its cgroup is left as it is); returns its final metrics."""
        env = self._envs.pop(env_id, None)
        if env is None:
            return None
        self._urgent.pop(env_id, None)
        self._unwatch(env)
        _accumulate(self._retired, env.metrics)
        return env.metrics

    def let_go(self) -> int:
        """Before the daemon exits leaving envs running (call it once :meth:`run` has stopped):
        nobody will raise their limits any more, so each elastic memory limit becomes hard where
        it stands. A task that needs more is OOM-killed there instead of waiting, for as long as
        the daemon is away, for a monitor that is gone (v1: the OOM killer is disabled below the
        max). The next daemon re-adopts the envs elastic. Returns how many groups it changed."""
        changed = 0
        for env in list(self._envs.values()):
            limit, mem = env.state.memory_limit_bytes, env.limits.memory_range
            if limit is None or mem is None or limit >= mem[1] or env.state.memory_hard:
                continue
            try:
                env.cgroup.set_memory(limit, hard_limit_bytes=limit)
            except CgroupError as exc:
                log.warning("env %s: cannot make its memory limit hard before the daemon exits: %s", env.env_id, exc)
                continue
            env.state = msgspec.structs.replace(env.state, memory_hard=True)
            changed += 1
        return changed

    def cpu_quota(self, env_id: str) -> float | None:
        """The CPU quota (cores) the monitor gives ``env_id`` now; None if unmanaged or unlimited."""
        env = self._envs.get(env_id)
        return None if env is None else env.state.cpu_quota_cores

    def __contains__(self, env_id: str) -> bool:
        return env_id in self._envs

    # -- node admission ------------------------------------------------------------------------

    #: An admitted env that is not added within this long (its start failed) stops counting.
    PENDING_ADMISSION_S = 120.0

    def _live_pending(self) -> list[EnvLimits]:
        horizon = time.monotonic() - self.PENDING_ADMISSION_S
        self._pending = [(t, lim) for t, lim in self._pending if t > horizon]
        return [lim for _, lim in self._pending]

    def node_view(self) -> NodeView:
        """The node now: its memory read fresh, every monitored env's quotas as they stand, and
        the mins of envs admitted but not added yet counted as promised."""
        total, available = self._node_memory()
        node = self._build_node(total, available)
        pending = sum(lim.memory_range[0] for lim in self._live_pending() if lim.memory_range)
        if pending:
            node = msgspec.structs.replace(node, memory_promised_bytes=node.memory_promised_bytes + pending)
        return node

    def admit(self, limits: EnvLimits) -> Admission:
        """Would an env with these limits get its mins next to the monitored ones and the ones
        admitted before it (still starting)? Counted. An admitted env counts from now on, until
        :meth:`add` takes it over or :meth:`cancel_admission` (or ``PENDING_ADMISSION_S``) drops it:
        concurrent creates cannot all squeeze into the same room."""
        committed = [e.limits for e in self._envs.values()] + self._live_pending()
        verdict = admit(limits, self.node_view(), committed, self.cfg)
        if verdict:
            self._admitted += 1
            self._pending.append((time.monotonic(), limits))
        else:
            self._admission_refusals += 1
            log.warning("admission refused: %s", verdict.reason)
        return verdict

    def cancel_admission(self, limits: EnvLimits) -> bool:
        """An admitted env will not be added after all (its start failed)."""
        return self._take_pending(limits)

    def _take_pending(self, limits: EnvLimits) -> bool:
        for i, (_, lim) in enumerate(self._pending):
            if lim == limits:
                del self._pending[i]
                return True
        return False

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick forever; cancel the enclosing scope to stop.

        Between ticks it waits on the groups' memory event descriptors (see
        :meth:`Cgroup.memory_event_fd`): an env whose tasks stall at their memory limit is
        stepped at once (memory only), so an allocation that needs several doublings waits
        milliseconds per doubling instead of a tick each.
        """
        interval_s = self.interval_ms / 1000
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._wake = trio.Event()
            try:
                for env in list(self._envs.values()):
                    self._watch(env)
                next_s = trio.current_time()
                task_status.started()
                while True:
                    await self.tick()
                    next_s += interval_s
                    now = trio.current_time()
                    if next_s <= now:
                        # Behind schedule (a stalled host): skip the missed ticks instead of bursting.
                        while next_s <= now:
                            next_s += interval_s
                            self._late_ticks += 1
                    while trio.current_time() < next_s:
                        with trio.move_on_at(next_s):
                            await self._wake.wait()
                        self._wake = trio.Event()  # events from here on wake the loop again
                        if self._urgent:
                            await self._fast_step()
            finally:
                self._nursery = None
                for env in self._envs.values():
                    env.watch = None
                nursery.cancel_scope.cancel()

    # -- memory events -------------------------------------------------------------------------

    def _watch(self, env: _Env) -> None:
        if self._nursery is None or env.watch is not None:
            return
        try:
            fd = env.cgroup.memory_event_fd()
        except CgroupError as exc:
            log.debug("env %s: no memory events, ticks only: %s", env.env_id, exc)
            return
        if fd is None:
            return
        env.watch = fd
        self._nursery.start_soon(self._wait_events, env, fd)

    def _unwatch(self, env: _Env) -> None:
        fd, env.watch = env.watch, None
        if fd is not None:
            # Wakes the waiter with ClosedResourceError and drops the fd from epoll now, before
            # the group (which owns the fd) is removed and closes it.
            try:
                trio.lowlevel.notify_closing(fd)
            except RuntimeError:
                pass  # not in the trio thread: run() has ended, nothing waits

    async def _wait_events(self, env: _Env, fd: int) -> None:
        while env.watch == fd and self._envs.get(env.env_id) is env:
            try:
                await trio.lowlevel.wait_readable(fd)
            except (trio.ClosedResourceError, OSError):
                return
            try:
                os.read(fd, 8)
            except BlockingIOError:
                continue
            except OSError:
                return
            if env.watch != fd or self._envs.get(env.env_id) is not env:
                return
            self._urgent[env.env_id] = env
            self._wake.set()

    async def _fast_step(self) -> None:
        urgent = [env for env in self._urgent.values() if self._envs.get(env.env_id) is env]
        self._urgent.clear()
        log.debug("memory events from %s", [env.env_id for env in urgent])
        if urgent:
            await self._step(urgent, fast=True)
            self._fast_steps += 1

    # -- one step ------------------------------------------------------------------------------

    async def _call(self, in_thread: bool, fn: Callable[..., Any], *args: Any) -> Any:
        if in_thread:
            return await trio.to_thread.run_sync(fn, *args)
        return fn(*args)

    async def tick(self) -> None:
        """Sample every env, decide, apply. Public so tests and ``weenv top --once`` can step it.

        A quiet tick (no group used CPU since the last tick, by the backend's ``usage_ns``) only
        samples the envs that are not settled or whose memory reading is due for a refresh: the
        others' counters cannot have moved, so decide() would repeat itself for them.
        """
        started = trio.current_time()
        envs = list(self._envs.values())
        quiet = False
        if self._usage_ns is not None:
            try:
                usage = self._usage_ns()
            except CgroupError as exc:
                log.debug("cannot read the groups' total CPU usage: %s", exc)
                usage = None
            quiet = usage is not None and usage == self._last_usage_ns
            self._last_usage_ns = usage
        tick = self._ticks
        due_s = started - self.idle_memory_refresh_s
        if quiet:
            # A settled env last read before the counter last moved may have run since: read it.
            moved = self._moved_tick
            envs = [env for env in envs if not env.settled or env.sampled_s <= due_s or env.sampled_tick < moved]
            self._quiet_ticks += 1
            if envs or started - self._node_read_s >= 1.0:
                await self._step(envs, fast=False, partial=True)
        else:
            self._moved_tick = tick
            every = self.settled_read_every
            if every > 1:
                envs = [env for env in envs
                        if not env.settled or (env.slot + tick) % every == 0 or env.sampled_s <= due_s]
                await self._step(envs, fast=False, partial=True)
            else:
                await self._step(envs, fast=False)
        self._ticks += 1
        self._last_tick_s = trio.current_time() - started

    async def _step(self, envs: list[_Env], *, fast: bool, partial: bool = False) -> None:
        """Sample ``envs``, decide, apply. A fast step (envs stalled at their memory limit,
        between ticks) decides memory only. A fast or partial step counts every other env as of
        its last sample."""
        partial = partial or fast
        started = trio.current_time()
        # The node's memory matters when some env may ask for more; when every env is settled it
        # is only refreshed for views, once a second (/proc/meminfo is not free).
        need_node = (
            fast
            or self._node is None
            or started - self._node_read_s >= 1.0
            or not all(env.settled for env in envs)
        )
        # A partial (quiet) tick samples settled envs only for their memory refresh: read it now.
        samples, node_memory = await self._call(
            self._offload == "all" and not fast, self._sample_all, envs, need_node,
            0.0 if partial and not fast else self.idle_memory_refresh_s,
        )
        if node_memory is None:
            assert self._node is not None
            total, available = self._node.memory_total_bytes, self._node.memory_available_bytes
        else:
            total, available = node_memory
            self._node_read_s = started
        now = trio.current_time()
        live = self._envs
        acc = [0.0, 0, 0]  # cpu burst committed, memory promised, memory reserved
        todo: list[tuple[_Env, CgroupSample, bool]] = []
        for env, sample in zip(envs, samples):
            if live.get(env.env_id) is not env:
                continue  # removed while we sampled
            if not fast:
                env.sampled_s = started
                env.sampled_tick = self._ticks
            if sample.__class__ is CgroupSample:
                env.error = None
                key = (
                    sample.cpu_usage_ns, sample.memory_usage_bytes, sample.nr_throttled, sample.memory_limit_hits,
                    sample.memory_high_events, sample.oom_kills, sample.memory_stalled,
                    sample.memory_pressure_some_total_us,
                )  # fmt: skip
                unchanged = key == env.key
                env.key = key
                if unchanged and env.settled and not fast:
                    # Same inputs as the last decision, which changed nothing and started no
                    # timer: decide() would return it again (see _Env.settled).
                    env.last = sample
                else:
                    todo.append((env, sample, unchanged and not fast))
            else:
                env.metrics.sample_errors += 1
                if env.error is None:
                    log.warning("env %s: cannot sample its cgroup: %s", env.env_id, sample)
                env.error = str(sample)
                sample = env.last
            add_commitments(env, env.state, sample, acc)
        if partial:
            stepped = {env.env_id for env in envs}
            for env in live.values():
                if env.env_id not in stepped:
                    add_commitments(env, env.state, env.last, acc)
        node = self._node_view(acc, total, available)
        changes: list[tuple[_Env, Decision]] = []
        cfg = self.cfg
        # Memory held back in this tick for waiting envs that could not start their burst: later
        # envs must not overtake them with smaller requests (the oldest waiter goes first).
        held = 0
        todo.sort(key=_waiting_first)
        for env, sample, unchanged in todo:
            prev = env.last
            count_sample(env, sample, prev)
            old = env.state
            if fast:
                d = decide(old, sample, prev, env.memory_limits, node_for(node, held), cfg, now)
                # CPU was not judged (a few ms of counters say nothing): keep its state and view.
                d = msgspec.structs.replace(
                    d,
                    state=msgspec.structs.replace(d.state, cpu_refused=old.cpu_refused),
                    cpu_refused=old.cpu_refused,
                    cpu_usage_cores=env.decision.cpu_usage_cores if env.decision else None,
                    cpu_throttled_share=env.decision.cpu_throttled_share if env.decision else None,
                )
            else:
                d = decide(old, sample, prev, env.limits, node_for(node, held), cfg, now)
            env.last = sample
            env.decision = d
            new = d.state
            if d.cpu_refused and not old.cpu_refused:
                env.metrics.cpu_refusals += 1
                log.warning("env %s: %s", env.env_id, "; ".join(d.reasons))
            if d.memory_refused and not old.memory_refused:
                env.metrics.memory_refusals += 1
                log.warning("env %s: %s", env.env_id, "; ".join(d.reasons))
            if d.memory_refused:
                if env.waiting_since is None:
                    env.waiting_since = now
                mem = env.limits.memory_range
                if cfg.memory_burst_reservation and mem is not None and not new.memory_bursting:
                    held += mem[1] - (old.memory_limit_bytes or 0)
            else:
                env.waiting_since = None
            if d.cpu_change is None and d.memory_change is None:
                env.state = new
                env.settled = (
                    unchanged and not d.cpu_refused and not d.memory_refused
                    and new.cpu_low_since_s is None and new.memory_low_since_s is None
                )  # fmt: skip
                continue
            env.settled = False
            changes.append((env, d))
            # Later envs in this tick must see what this one was granted.
            cpu_lo = env.limits.cpu_range[0] if env.limits.cpu_range else 0.0
            node = msgspec.structs.replace(
                node,
                cpu_burst_committed_cores=node.cpu_burst_committed_cores
                + ((d.cpu_quota_cores or cpu_lo) - (old.cpu_quota_cores or cpu_lo)),
                memory_promised_bytes=node.memory_promised_bytes
                + ((d.memory_limit_bytes or 0) - (old.memory_limit_bytes or 0)),
                memory_reserved_bytes=node.memory_reserved_bytes + _reserved(env, new) - _reserved(env, old),
            )
        self._node = node
        if changes:
            results = await self._call(self._offload != "none", self._apply_all, changes)
            for (env, d), (actual, error) in zip(changes, results):
                self._record(env, d, actual, error, now)

    # -- worker-thread halves ------------------------------------------------------------------

    def _sample_all(
        self, envs: list[_Env], need_node: bool = True, age_s: float = 1.0
    ) -> tuple[list[CgroupSample | CgroupError], tuple[int, int] | None]:
        out: list[CgroupSample | CgroupError] = []
        for env in envs:
            try:
                out.append(env.cgroup.sample(memory_max_age_s=age_s))
            except CgroupError as exc:
                out.append(exc)
        return out, self._node_memory() if need_node else None

    def _apply_all(self, changes: list[tuple[_Env, Decision]]) -> list[tuple[int | None, CgroupError | None]]:
        results: list[tuple[int | None, CgroupError | None]] = []
        for env, d in changes:
            actual = d.memory_limit_bytes
            try:
                if d.cpu_change is not None:
                    env.cgroup.set_cpu(d.cpu_quota_cores)
                if d.memory_change is not None:
                    mem = env.limits.memory_range
                    # A limit the env waited at for memory_wait_s is also where the kernel kills.
                    hard = d.memory_limit_bytes if d.state.memory_hard else mem[1] if mem else None
                    actual = env.cgroup.set_memory(d.memory_limit_bytes, hard_limit_bytes=hard)
            except CgroupError as exc:
                results.append((None, exc))
                continue
            results.append((actual, None))
        return results

    # -- bookkeeping -------------------------------------------------------------------------------

    def _build_node(self, total: int, available: int) -> NodeView:
        acc = [0.0, 0, 0]
        for env in self._envs.values():
            add_commitments(env, env.state, env.last, acc)
        return self._node_view(acc, total, available)

    def _node_view(self, acc: list, total: int, available: int) -> NodeView:
        """The node as the policy sees it, from commitments summed by :func:`._envstate.add_commitments`."""
        return NodeView(
            cpu_cores=self.cpu_cores,
            cpu_burst_committed_cores=acc[0],
            memory_total_bytes=total,
            memory_available_bytes=available,
            memory_promised_bytes=acc[1],
            memory_reserved_bytes=acc[2],
            memory_waiters=sum(1 for env in self._envs.values() if env.waiting_since is not None),
        )

    def _record(self, env: _Env, d: Decision, actual: int | None, error: CgroupError | None, now: float) -> None:
        if self._envs.get(env.env_id) is env:  # an env removed meanwhile records nothing
            record_decision(env, d, actual, error, now)

    # -- views ---------------------------------------------------------------------------------

    def statistics(self) -> MonitorStatistics:
        return MonitorStatistics(
            envs=len(self._envs), ticks=self._ticks, late_ticks=self._late_ticks, last_tick_s=self._last_tick_s,
            admitted=self._admitted, admission_refusals=self._admission_refusals, fast_steps=self._fast_steps,
            quiet_ticks=self._quiet_ticks,
        )

    def totals(self) -> EnvMetrics:
        """Every env's counters summed, removed envs included: they only ever grow."""
        out = msgspec.structs.replace(self._retired)
        for env in self._envs.values():
            _accumulate(out, env.metrics)
        return out

    def metrics(self, env_id: str) -> EnvMetrics:
        return self._envs[env_id].metrics

    def snapshot(self) -> dict[str, Any]:
        """Current quotas and usage of every env, JSON-ready (``weenv top``, ``weenv ps --json``)."""
        envs = {env.env_id: env_view(env) for env in self._envs.values()}
        node = self._node
        return {
            "interval_ms": self.interval_ms,
            "ticks": self._ticks,
            "wall_s": time.time(),
            "node": None if node is None else {
                **msgspec.structs.asdict(node), "memory_headroom_bytes": node.memory_headroom_bytes(self.cfg),
            },
            "envs": envs,
            "totals": msgspec.structs.asdict(self.totals()),
            "policy": msgspec.structs.asdict(self.cfg),
            "admission": {"admitted": self._admitted, "refused": self._admission_refusals},
        }

    def prometheus_text(self) -> bytes:
        """Every gauge and counter in the prometheus text format (``GET /v1/metrics``)."""
        return render_prometheus(self.snapshot(), self.statistics())
