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
from ._placement import Choice, ClusterView, PlacementRequest, place, place_group, rank, request_for
from ._report import Capacity, EnvHeld, LayerHeld, NodeReport, SnapshotHeld, capacity_from_top, node_of

__all__ = [
    "AgentError",
    "Capacity",
    "Choice",
    "ClusterAuthError",
    "ClusterError",
    "ClusterView",
    "EnvHeld",
    "EnvLostError",
    "LayerHeld",
    "NodeLostError",
    "NodeReport",
    "PlacementError",
    "PlacementRequest",
    "SnapshotHeld",
    "UnknownEnvError",
    "capacity_from_top",
    "node_of",
    "place",
    "place_group",
    "rank",
    "request_for",
]
