"""weenv on many nodes, on Ray: node agents, cache-aware placement, routing by env id (docs/cluster.md).

Placement and reports are pure and import nothing of Ray; :func:`connect` and the agents need the
``cluster`` extra (``pip install weenv[cluster]``).
"""

from ._errors import (
    AgentError,
    ClusterAuthError,
    ClusterError,
    EnvLostError,
    NodeLostError,
    PlacementError,
    UnknownEnvError,
)
from ._aio import AsyncClusterClient, AsyncClusterEnv
from ._agent import NodeAgent, agent_class, agent_name, load_published, node_name_for
from ._local import LocalCluster, stop_node
from ._cluster import Backend, Cluster, ClusterEnv, NodeClient, connect
from ._placement import (
    Choice,
    ClusterView,
    PlacementRequest,
    place,
    place_group,
    rank,
    request_for,
    with_pending,
)
from ._reconcile import AgentHandle, NodeEntry, NodeState, PendingCall, Reconciler
from ._report import Capacity, EnvHeld, LayerHeld, NodeReport, SnapshotHeld, capacity_from_top, node_of

__all__ = [
    "AgentError",
    "AgentHandle",
    "AsyncClusterClient",
    "AsyncClusterEnv",
    "Backend",
    "Capacity",
    "Choice",
    "Cluster",
    "ClusterAuthError",
    "ClusterEnv",
    "ClusterError",
    "ClusterView",
    "EnvHeld",
    "EnvLostError",
    "LayerHeld",
    "LocalCluster",
    "NodeAgent",
    "NodeClient",
    "NodeEntry",
    "NodeLostError",
    "NodeReport",
    "NodeState",
    "PendingCall",
    "PlacementError",
    "PlacementRequest",
    "Reconciler",
    "SnapshotHeld",
    "UnknownEnvError",
    "agent_class",
    "agent_name",
    "capacity_from_top",
    "connect",
    "load_published",
    "node_name_for",
    "node_of",
    "place",
    "place_group",
    "rank",
    "request_for",
    "stop_node",
    "with_pending",
]
