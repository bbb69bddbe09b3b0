"""The reconciler: polls every node agent for its report, and marks a node lost when it stops answering.

A plain state machine driven by :meth:`Reconciler.tick`, which never blocks: it looks at calls in
flight, starts the next ones, and moves nodes between explicit states. The clock and the agent
handles are injected (:class:`AgentHandle`, :class:`PendingCall`), so unit tests drive it with
fakes and a fake clock; :mod:`weenv.cluster._cluster` gives it Ray actor handles.

    STARTING --report--> HEALTHY --failure--> UNHEALTHY --report--> HEALTHY
       |                                          |
       +-- no report within start_timeout_s --+   +-- failure_threshold failures in a row --+
                                              v                                             v
                                             LOST  <------ Ray says the node is dead ------ LOST

A failure is a report call that raised, one that did not answer within ``call_timeout_s``, or a
report whose sequence number did not move for ``call_timeout_s`` (the agent's report thread is
stuck). A report that says the node was taken down (``NodeReport.down``: ``weenv cluster
stop-node``) makes it LOST at once, from any state. LOST is final for that node name: the node's
envs are handed to ``on_lost`` once, and the cluster never re-runs them.
"""

from __future__ import annotations

import abc
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ._report import NodeReport

log = logging.getLogger("weenv.cluster")


class NodeState(enum.Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    LOST = "lost"


class PendingCall(abc.ABC):
    @abc.abstractmethod
    def done(self) -> bool:
        """True once :meth:`result` would not block."""

    @abc.abstractmethod
    def result(self) -> NodeReport:
        """The report, or the call's exception."""


class AgentHandle(abc.ABC):
    """One node's agent as the reconciler sees it."""

    name: str

    @abc.abstractmethod
    def start_report(self) -> PendingCall:
        """Ask for the agent's latest report without waiting for it."""


@dataclass
class NodeEntry:
    name: str
    handle: AgentHandle
    since_s: float
    state: NodeState = NodeState.STARTING
    report: NodeReport | None = None
    last_ok_s: float | None = None
    last_seq_change_s: float | None = None
    failures: int = 0
    last_error: str = ""
    pending: PendingCall | None = None
    pending_since_s: float = 0.0
    next_poll_s: float = 0.0
    lost_reason: str = ""
    transitions: list[tuple[float, NodeState]] = field(default_factory=list)


LostCallback = Callable[[NodeEntry], None]


class Reconciler:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, interval_s: float = 2.0,
                 call_timeout_s: float = 10.0, failure_threshold: int = 3, start_timeout_s: float = 120.0,
                 on_lost: LostCallback | None = None):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, got {failure_threshold}")
        if interval_s <= 0 or call_timeout_s <= 0:
            raise ValueError(f"interval_s and call_timeout_s must be > 0, got {interval_s}, {call_timeout_s}")
        self.clock = clock
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.failure_threshold = failure_threshold
        self.start_timeout_s = start_timeout_s
        self.on_lost = on_lost
        self.nodes: dict[str, NodeEntry] = {}

    def add(self, handle: AgentHandle) -> NodeEntry:
        """Watch a node's agent (a name seen before keeps its entry: a LOST node stays lost)."""
        if handle.name in self.nodes:
            return self.nodes[handle.name]
        now = self.clock()
        entry = NodeEntry(name=handle.name, handle=handle, since_s=now, next_poll_s=now)
        entry.transitions.append((now, NodeState.STARTING))
        self.nodes[handle.name] = entry
        return entry

    def mark_lost(self, name: str, reason: str) -> None:
        entry = self.nodes.get(name)
        if entry is not None and entry.state is not NodeState.LOST:
            self._lose(entry, reason)

    def tick(self) -> None:
        now = self.clock()
        for entry in list(self.nodes.values()):
            if entry.state is NodeState.LOST:
                continue
            self._collect(entry, now)
            if entry.state is NodeState.LOST:
                continue
            if entry.state is NodeState.STARTING and now - entry.since_s > self.start_timeout_s:
                self._lose(entry, f"no report within {self.start_timeout_s:g} s of its start"
                                  + (f" (last error: {entry.last_error})" if entry.last_error else ""))
                continue
            if entry.pending is None and now >= entry.next_poll_s:
                try:
                    entry.pending = entry.handle.start_report()
                    entry.pending_since_s = now
                except Exception as e:  # the handle itself is gone (e.g. the actor was killed)
                    self._fail(entry, f"{type(e).__name__}: {e}", now)
                entry.next_poll_s = now + self.interval_s

    def _collect(self, entry: NodeEntry, now: float) -> None:
        call = entry.pending
        if call is None:
            return
        if not call.done():
            if now - entry.pending_since_s > self.call_timeout_s:
                entry.pending = None  # abandoned: a late answer is not waited for
                self._fail(entry, f"no answer within {self.call_timeout_s:g} s", now)
            return
        entry.pending = None
        try:
            report = call.result()
        except Exception as e:
            self._fail(entry, f"{type(e).__name__}: {e}", now)
            return
        previous = entry.report
        if previous is None or report.seq >= previous.seq:
            entry.report = report  # never an older one over a newer (one fetched after a create, say)
        if report.down:  # its operator took it down: its daemon (and envs) are stopped, not just silent
            self._lose(entry, f"taken down: {report.down}")
            return
        if previous is None or report.seq != previous.seq:
            entry.last_seq_change_s = now
        elif entry.last_seq_change_s is not None and now - entry.last_seq_change_s > self.call_timeout_s:
            self._fail(entry, f"its report did not change for {now - entry.last_seq_change_s:.0f} s "
                              f"(report thread stuck)", now)
            return
        entry.last_ok_s = now
        entry.failures = 0
        entry.last_error = ""
        self._set(entry, NodeState.HEALTHY, now)

    def _fail(self, entry: NodeEntry, why: str, now: float) -> None:
        entry.failures += 1
        entry.last_error = why
        if entry.state is NodeState.STARTING:
            return  # counted only against start_timeout_s: a node may take a while to come up
        if entry.failures >= self.failure_threshold:
            self._lose(entry, f"{entry.failures} report calls failed in a row (last: {why})")
        else:
            self._set(entry, NodeState.UNHEALTHY, now)

    def _set(self, entry: NodeEntry, state: NodeState, now: float) -> None:
        if entry.state is not state:
            log.info("node %s: %s -> %s", entry.name, entry.state.value, state.value)
            entry.state = state
            entry.transitions.append((now, state))

    def _lose(self, entry: NodeEntry, reason: str) -> None:
        now = self.clock()
        entry.lost_reason = reason
        entry.pending = None
        log.warning("node %s is lost: %s", entry.name, reason)
        self._set(entry, NodeState.LOST, now)
        if self.on_lost is not None:
            self.on_lost(entry)

    def reports(self, *, usable_only: bool = True) -> list[NodeReport]:
        """The latest reports (of HEALTHY nodes only, by default: what placement may use)."""
        return [e.report for e in self.nodes.values() if e.report is not None
                and (not usable_only or e.state is NodeState.HEALTHY)]
