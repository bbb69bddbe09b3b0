"""The cluster gateway: ``weenv serve``'s app (``/v1``, E2B, envd) over every node of a Ray cluster.

``weenv cluster serve --ray-address ADDR --listen HOST:PORT`` runs :func:`weenv.api.create_app`
with a :class:`~weenv.cluster._backend.ClusterBackend` (where each env is, where a create goes,
forks that spread, snapshots at their home: see that module), so the app runs unchanged: one set
of API keys (the gateway's ``$WEENV_HOME/api``), one routing table built from node reports.

- Env ports (E2B's ``get_host``, ``/proxy/{id}/{port}``): the app's port tunnel is opened on the
  env's node through the same per-node client (weenv/api/_proxy.py speaks to a daemon's TCP API
  with the client's ``Authorization``), so the node API's token gate applies to it too.
- The gateway's address is kept in Ray's KV store: :func:`client` / :func:`async_client`
  (``weenv.cluster.client("HEAD:6379", token=...)``) find it; ``ray://`` addresses go through
  Ray's client, :func:`weenv.cluster._cluster.join_ray`.
"""

from __future__ import annotations

import logging
from typing import Any

from ._backend import ClusterBackend
from ._cluster import Cluster, join_ray
from ._errors import ClusterError

log = logging.getLogger("weenv.cluster")

KV_NAMESPACE = "weenv"
KV_GATEWAY = b"gateway"


def register(url: str) -> None:
    """Put the gateway's URL in Ray's KV store (the Ray cluster's own lookup: no extra service)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_GATEWAY, url.encode(), overwrite=True, namespace=KV_NAMESPACE)


def client(ray_address: str | None = None, *, token: str | None = None, **kw: Any) -> Any:
    """A :class:`weenv.Client` of the gateway registered in the Ray cluster at ``ray_address``
    (``HEAD:6379``, ``ray://HEAD:10001``; None: the cluster this process is in)."""
    from .._client import Client

    return Client(lookup(ray_address), token=token, **kw)


def async_client(ray_address: str | None = None, *, token: str | None = None, **kw: Any) -> Any:
    """As :func:`client`, a :class:`weenv.AsyncClient` (the lookup itself blocks: call it before your loop
    is busy, or in a thread)."""
    from .._aclient import AsyncClient

    return AsyncClient(lookup(ray_address), token=token, **kw)


def lookup(ray_address: str | None = None) -> str:
    """The gateway URL registered in the Ray cluster at ``ray_address`` (joins it if not yet joined)."""
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        join_ray(ray_address, namespace=KV_NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    raw = internal_kv._internal_kv_get(KV_GATEWAY, namespace=KV_NAMESPACE)
    if not raw:
        raise ClusterError(f"no weenv gateway is registered in the Ray cluster at {ray_address or 'this job'}: "
                           f"start one with `weenv cluster serve --ray-address ...`")
    return bytes(raw).decode()


async def serve_gateway(cluster: Cluster, token: str, listen: str, *, home: str | None = None,
                        domain: str | None = None, public_url: str | None = None,
                        registries: frozenset[str] | None = None, image_routing: Any = None,
                        task_status: Any = None) -> None:
    """Serve the API for the whole cluster on ``listen`` (runs until cancelled). ``registries``:
    what non-admin keys' plans may read from (default ``$WEENV_REGISTRIES``), with the cluster's
    store's registry always among them; ``image_routing``: see :class:`weenv.api.ImageRouting`."""
    from ..api import create_app, serve
    from ..api._tenant import registries_from_env

    allowed = set(registries if registries is not None else registries_from_env())
    if cluster.store:
        allowed.add(cluster.store.split("/", 1)[0])
    app = create_app(ClusterBackend(cluster, token), home=home, domain=domain, registries=frozenset(allowed),
                     image_routing=image_routing)
    register(public_url or f"http://{listen}")
    await serve(app, listen, task_status=task_status)
