"""The cluster's exception tree (one module, as every package of weenv)."""

from __future__ import annotations


class ClusterError(Exception):
    """Base of every error of weenv.cluster."""


class PlacementError(ClusterError):
    """No node can take the env (the message says what each kind of node lacked)."""


class NodeLostError(ClusterError):
    """The node is lost: it stopped reporting (or Ray says it is dead)."""


class EnvLostError(NodeLostError, LookupError):
    """The env's node was lost: the env's state is gone with it, and the cluster never re-runs it
    elsewhere on its own (a new env from its plan, or from a published snapshot, is the caller's call)."""

    def __init__(self, env_id: str, node: str, reason: str):
        super().__init__(f"env {env_id} is lost: its node {node} was lost ({reason}); its processes and files "
                         f"are gone from the cluster's view and it is not re-run elsewhere: create a new env "
                         f"(from its plan, or from a published snapshot)")
        self.env_id, self.node, self.reason = env_id, node, reason


class UnknownEnvError(ClusterError, LookupError):
    """No node reports the env and its id names no known node."""


class AgentError(ClusterError):
    """A node agent answered with an error (its daemon's, carried with status and kind)."""

    def __init__(self, node: str, status: int, kind: str, message: str):
        super().__init__(f"node {node}: {kind} ({status}): {message}")
        self.node, self.status, self.kind, self.message = node, status, kind, message


class ClusterAuthError(ClusterError, PermissionError):
    """A call to a node agent without the cluster token."""


class VolumeConflictError(ClusterError):
    """A create mounts volumes of two nodes (volumes are node-local), or names a volume by a name two
    nodes have, or makes a volume under a name the cluster has already (the gateway's 409)."""


class VolumeNotFoundError(ClusterError, LookupError):
    """No node of the cluster holds the volume (the gateway's 404 ``volume_not_found``)."""
