"""weenv on many nodes, on Ray: node agents, cache-aware placement, routing by env id (docs/cluster.md).

Placement and reports are pure and import nothing of Ray; :func:`connect` and the agents need the
``cluster`` extra (``pip install weenv[cluster]``).
"""

from ._agent import NodeAgent, agent_class, agent_name, load_published, node_name_for
from ._aio import AsyncClusterClient, AsyncClusterEnv
from ._cluster import Backend, Cluster, ClusterEnv, NodeClient, connect
from ._errors import (
    AgentError,
    ClusterAuthError,
    ClusterError,
    EnvLostError,
    NodeLostError,
    PlacementError,
    UnknownEnvError,
    VolumeConflictError,
    VolumeNotFoundError,
)
from ._gateway import async_client, client
from ._gateway import lookup as gateway_url
from ._local import LocalCluster, stop_node
from ._placement import (
    Choice,
    ClusterView,
    PlacementRequest,
    place,
    place_group,
    place_volume,
    rank,
    request_for,
    volume_home,
    volume_nodes,
    with_pending,
)
from ._reconcile import AgentHandle, NodeEntry, NodeState, PendingCall, Reconciler
from ._report import Capacity, EnvHeld, LayerHeld, NodeReport, SnapshotHeld, VolumeHeld, capacity_from_top, node_of

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
    "VolumeConflictError",
    "VolumeHeld",
    "VolumeNotFoundError",
    "agent_class",
    "agent_name",
    "async_client",
    "capacity_from_top",
    "client",
    "connect",
    "gateway_url",
    "load_published",
    "node_name_for",
    "node_of",
    "place",
    "place_group",
    "place_volume",
    "rank",
    "request_for",
    "stop_node",
    "volume_home",
    "volume_nodes",
    "with_pending",
]
