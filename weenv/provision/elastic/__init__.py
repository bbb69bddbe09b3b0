"""Elastic resources: each env's cgroup limits follow its use, between its plan's min and max.

- :mod:`._policy`: the pure policy (admission, doubling and halving decisions; no I/O);
- :mod:`._monitor`: :class:`Monitor`, the trio task that samples every env's cgroup each tick,
  runs the policy and applies its decisions;
- :mod:`._envstate`: what it keeps of each env (state, counters) and the per-env view;
- :mod:`._prometheus`: the monitor's view rendered in the prometheus text format.
"""

from ._envstate import EnvMetrics as EnvMetrics
from ._envstate import MonitorStatistics as MonitorStatistics
from ._monitor import Monitor as Monitor
from ._policy import DEFAULT_POLICY as DEFAULT_POLICY
from ._policy import Admission as Admission
from ._policy import Decision as Decision
from ._policy import EnvLimits as EnvLimits
from ._policy import EnvQuotaState as EnvQuotaState
from ._policy import NodeView as NodeView
from ._policy import PolicyConfig as PolicyConfig
from ._policy import admit as admit
from ._policy import decide as decide
from ._prometheus import PROMETHEUS_CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from ._prometheus import render_prometheus as render_prometheus

__all__ = ["Admission", "DEFAULT_POLICY", "Decision", "EnvLimits", "EnvMetrics", "EnvQuotaState", "Monitor",
           "MonitorStatistics", "NodeView", "PROMETHEUS_CONTENT_TYPE", "PolicyConfig", "admit", "decide",
           "render_prometheus"]
