"""``weenv cluster serve``: the gateway of a Ray cluster of weenv nodes (docs/cluster.md)."""

from __future__ import annotations

import logging
import os
from functools import partial

import click

from . import main
from ._common import errors_to_exit


@main.group("cluster")
def cluster_cmd() -> None:
    """weenv on many nodes, on Ray: the gateway (docs/cluster.md)."""


def _token(token_file: str | None) -> str:
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise click.BadParameter(f"{token_file} is empty", param_hint="--token-file")
        return token
    token = os.environ.get("WEENV_CLUSTER_TOKEN", "").strip()
    if not token:
        raise click.UsageError("the gateway needs the cluster token: --token-file PATH or $WEENV_CLUSTER_TOKEN "
                               "(the one the node agents check)")
    return token


@cluster_cmd.command("serve")
@click.option("--ray-address", required=True, help="The Ray cluster (HEAD:6379, ray://HEAD:10001, or auto).")
@click.option("--listen", default="127.0.0.1:3000", show_default=True, help="host:port to serve the API on.")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
              help="The cluster token (default $WEENV_CLUSTER_TOKEN).")
@click.option("--store", help="host[:port]/repo of the cluster's OCI registry (published snapshots).")
@click.option("--domain", help="Route {port}-{sandbox_id}.DOMAIN host names to sandboxes (E2B_DOMAIN).")
@click.option("--public-url", help="The URL clients use (registered in Ray's KV; default http://LISTEN).")
@click.option("--node-ip", help="This process's address in the Ray cluster (e.g. 127.0.0.1 on one host).")
@click.option("--report-interval", default=2.0, show_default=True, type=float, help="Seconds between node reports.")
@errors_to_exit(ValueError, OSError)
def cluster_serve(ray_address: str, listen: str, token_file: str | None, store: str | None, domain: str | None,
                  public_url: str | None, node_ip: str | None, report_interval: float) -> None:
    """Serve weenv's API (/v1) and E2B's for every node of the Ray cluster at --ray-address.

    API keys are the gateway's (`weenv token create`, in this process's $WEENV_HOME/api); creates go
    through placement, every other call to the env's node."""
    import trio

    from ..cluster import connect
    from ..cluster._gateway import serve_gateway

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{listen!r} is not host:port (e.g. 127.0.0.1:3000)", param_hint="--listen")
    token = _token(token_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray_init = {"_node_ip_address": node_ip} if node_ip else {}
    cluster = connect(ray_address, token=token, store=store, report_interval_s=report_interval, ray_init=ray_init)
    click.echo(f"weenv cluster serve: http://{listen} for {len(cluster.clients)} nodes ({ray_address})", err=True)
    try:
        trio.run(partial(serve_gateway, cluster, token, listen, domain=domain, public_url=public_url))
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()
