"""Joining a Ray cluster (a member or a ``ray://`` client) and finding the node agents."""

from __future__ import annotations

import logging
import time
from typing import Any

from ._agent import AGENT_NAMESPACE, agent_name, node_name_for
from ._errors import ClusterError
from ._nodes import NodeClient

log = logging.getLogger("weenv.cluster")



def require_ray_client(address: str) -> None:
    """Refuse a ``ray://`` address clearly when this Python has no Ray client (``ray[client]``: grpcio)."""
    try:
        import grpc  # noqa: F401  (what Ray's client is built on; ray.init("ray://...") fails deep without it)
        import ray.util.client  # noqa: F401
    except ImportError as e:
        raise ClusterError(f"{address}: a ray:// address needs Ray's client, which is not installed here ({e}): "
                           f"`pip install 'ray[client]'` (weenv[cluster] brings it), or give the Ray cluster's "
                           f"GCS address (HEAD:6379) from a process that can join it") from None


def join_ray(address: str | None, **kw: Any) -> None:
    """``ray.init`` for a cluster address: ``ray://HOST:PORT`` through Ray's client (a process outside
    the cluster; driver-only options such as ``_node_ip_address`` do not apply there; a server-side
    start failure of the client is tried again twice), else joining."""
    import ray

    if address is None or not address.startswith("ray://"):
        ray.init(address=address, **kw)
        return
    require_ray_client(address)
    kw = {k: v for k, v in kw.items() if not k.startswith("_") and k not in ("include_dashboard",)}
    for attempt in range(CLIENT_ATTEMPTS):
        try:
            ray.init(address=address, **kw)
            return
        except ConnectionError as e:
            # The head's client proxy starts a server per client; under load that start fails now and
            # then ("Initialization failure from server: ... Starting Ray client server failed").
            if "Initialization failure from server" not in str(e) or attempt == CLIENT_ATTEMPTS - 1:
                raise
            log.warning("%s: Ray's client server did not start (attempt %d of %d), trying again",
                        address, attempt + 1, CLIENT_ATTEMPTS)
            ray.shutdown()
            time.sleep(1.0 + attempt)


CLIENT_ATTEMPTS = 3


def node_agents(token: str | None, *,
                hello_timeout_s: float = 10.0) -> list[tuple[dict[str, Any], NodeClient | None, str]]:
    """Every node of the Ray cluster this process joined (``ray.nodes()``: dead ones too), with the
    client of its node agent (None when it has none, or it does not answer) and what went wrong.
    Agents are looked up by name, never created: a new agent would start the node's daemon, which
    is not what an operator taking nodes down wants (``weenv cluster stop-node``, ``down``)."""
    import ray

    out: list[tuple[dict[str, Any], NodeClient | None, str]] = []
    for node in ray.nodes():
        ray_id = node["NodeID"]
        if not node.get("Alive"):
            out.append((node, None, "Ray reports the node dead"))
            continue
        try:
            actor = ray.get_actor(agent_name(ray_id), namespace=AGENT_NAMESPACE)
        except ValueError:
            out.append((node, None, "it has no weenv node agent"))
            continue
        client = NodeClient(node_name_for(ray_id), actor, token)
        try:
            client.name = str(client.hello(timeout_s=hello_timeout_s)["node"])
        except ClusterError as e:
            out.append((node, None, str(e)))
            continue
        out.append((node, client, ""))
    return out
