"""``weenv cluster serve``: the gateway of a Ray cluster of weenv nodes; ``weenv cluster stop-node`` /
``down``: taking nodes down (docs/cluster.md)."""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import click

from . import main
from ._common import errors_to_exit
from ._serve import image_routing_options


@main.group("cluster")
def cluster_cmd() -> None:
    """weenv on many nodes, on Ray: the gateway, taking nodes down (docs/cluster.md)."""


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
@click.option("--registry", "registries", multiple=True, metavar="HOST[:PORT]",
              help="A registry non-admin keys' plans may read from (repeat it; the --store registry is always one).")
@image_routing_options
@errors_to_exit(ValueError, OSError)
def cluster_serve(ray_address: str, listen: str, token_file: str | None, store: str | None, domain: str | None,
                  public_url: str | None, node_ip: str | None, report_interval: float,
                  registries: tuple[str, ...], image_metadata_key: str | None, image_size_key: str | None,
                  image_sizes: tuple[str, ...]) -> None:
    """Serve weenv's API (/v1) and E2B's for every node of the Ray cluster at --ray-address.

    API keys are the gateway's (`weenv token create`, in this process's $WEENV_HOME/api); creates go
    through placement, every other call to the env's node."""
    import trio

    from ..cluster import connect
    from ..cluster._gateway import serve_gateway
    from ._serve import _registries, image_routing

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{listen!r} is not host:port (e.g. 127.0.0.1:3000)", param_hint="--listen")
    token = _token(token_file)
    routing = image_routing(image_metadata_key, image_size_key, image_sizes)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray_init = {"_node_ip_address": node_ip} if node_ip else {}
    cluster = connect(ray_address, token=token, store=store, report_interval_s=report_interval, ray_init=ray_init)
    click.echo(f"weenv cluster serve: http://{listen} for {len(cluster.clients)} nodes ({ray_address})", err=True)
    try:
        trio.run(partial(serve_gateway, cluster, token, listen, domain=domain, public_url=public_url,
                         registries=_registries(registries), image_routing=routing))
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()


def _down_options(fn):  # type: ignore[no-untyped-def]
    """The options of ``stop-node`` and ``down``."""
    for deco in reversed([
        click.option("--ray-address", default="auto", show_default=True, envvar="RAY_ADDRESS",
                     help="The Ray cluster (HEAD:6379, ray://HEAD:10001, or auto: this machine's; $RAY_ADDRESS)."),
        click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
                     help="The cluster token (default $WEENV_CLUSTER_TOKEN)."),
        click.option("--kill-envs/--keep-envs", "kill_envs", default=None,
                     help="Kill the node's envs (then its envlet stops too), or leave them running, lost to the "
                          "cluster (a daemon started later on the node re-adopts them). One is required."),
        click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=60.0, show_default=True,
                     help="Seconds to wait for each node's daemon to exit."),
        click.option("--node-ip", help="This process's address in the Ray cluster (e.g. 127.0.0.1 on one host)."),
        click.option("--json", "as_json", is_flag=True, help="Print one record per node as JSON."),
    ]):
        fn = deco(fn)
    return fn


@cluster_cmd.command("stop-node")
@click.argument("names", nargs=-1, required=True, metavar="NODE...")
@_down_options
@errors_to_exit(ValueError, OSError)
def cluster_stop_node(names: tuple[str, ...], ray_address: str, token_file: str | None, kill_envs: bool | None,
                      timeout_s: float, node_ip: str | None, as_json: bool) -> None:
    """Take NODE out of the cluster: stop its weenv daemon (its envs too with --kill-envs).

    NODE is a node name (the prefix of its env ids: n + 8 hex digits of its Ray node id) or a Ray
    node id. Its agent stops the daemon and stays, down: every cluster client (the gateway too)
    marks the node lost at its next poll. Ray keeps running on the node: `ray stop` there next;
    restarting Ray brings it back as a new node. Without Ray (after `ray stop`), run
    `WEENV_HOME=<the node's home> weenv daemon stop --kill-envs` on the node itself."""
    _take_down(list(names), ray_address, token_file, kill_envs, timeout_s, node_ip, as_json)


@cluster_cmd.command("down")
@_down_options
@errors_to_exit(ValueError, OSError)
def cluster_down(ray_address: str, token_file: str | None, kill_envs: bool | None, timeout_s: float,
                 node_ip: str | None, as_json: bool) -> None:
    """Take every node of the Ray cluster down (`stop-node` on each): before `ray stop` on the nodes,
    so that no weenv daemon outlives Ray. Nodes whose agent is gone are listed with the command
    to run on them."""
    _take_down(None, ray_address, token_file, kill_envs, timeout_s, node_ip, as_json)


def _take_down(names: list[str] | None, ray_address: str, token_file: str | None, kill_envs: bool | None,
               timeout_s: float, node_ip: str | None, as_json: bool) -> None:
    from ..cluster import ClusterError, node_name_for
    from ..cluster._agent import AGENT_NAMESPACE
    from ..cluster._cluster import join_ray, node_agents
    from ._common import print_json, stdout

    if kill_envs is None:
        raise click.UsageError("say what happens to the node's envs: --kill-envs (killed; then its envlet stops "
                               "too) or --keep-envs (they run on, lost to the cluster; a daemon started later on "
                               "the node re-adopts them)")
    token = _token(token_file)
    join_ray(ray_address, namespace=AGENT_NAMESPACE, logging_level=logging.WARNING, log_to_driver=False,
             **({"_node_ip_address": node_ip} if node_ip else {}))
    found = node_agents(token)
    by_name = {(c.name if c is not None else node_name_for(n["NodeID"])): (n, c, why) for n, c, why in found}
    if names is None:
        targets = list(by_name.items())
    else:
        targets = []
        for name in names:
            hit = by_name.get(name) or next((x for x in by_name.values() if len(name) >= 8 and
                                             x[0]["NodeID"].startswith(name.lower())), None)
            if hit is None:
                raise click.ClickException(f"no node {name!r} in the Ray cluster at {ray_address} (nodes: "
                                           f"{', '.join(sorted(by_name)) or 'none'})")
            targets.append((hit[1].name if hit[1] is not None else node_name_for(hit[0]["NodeID"]), hit))
    plain = f"weenv daemon stop{' --kill-envs' if kill_envs else ''}"  # what to run on a node the agent is gone from
    records, failed = [], False
    for name, (node, client, why) in targets:
        rec: dict[str, Any] = {"node": name, "ray_node_id": node["NodeID"], "address": node.get("NodeManagerAddress"),
                               "down": False}
        if client is None:
            rec["error"] = why
            rec["hint"] = f"on {rec['address']}: WEENV_HOME=<the node's home> {plain}"
            failed = failed or names is not None or node.get("Alive", False)
        else:
            try:
                rec.update(client.stop(stop_daemon=True, kill_envs=kill_envs, timeout_s=timeout_s,
                                       reason="weenv cluster stop-node"))
            except ClusterError as e:
                rec["down"] = True  # the agent took the node out before its daemon failed to stop
                rec["error"] = str(e)
                failed = True
        records.append(rec)
    if as_json:
        print_json(records)
    else:
        for rec in records:
            stdout.print(_describe(rec, plain))
    if failed:
        raise SystemExit(1)


def _describe(rec: dict[str, Any], plain: str) -> str:
    from rich.markup import escape

    head = f"node {rec['node']}"
    if not rec["down"]:
        return escape(f"{head}: not reached ({rec['error']}); if its daemon still runs, {rec['hint']}")
    if "error" in rec:
        return escape(f"{head}: down, but: {rec['error']}")
    if not rec.get("daemon_was_running"):
        said = "down; its daemon was not running"
    else:
        said = f"down; daemon stopped (pid {rec['daemon_pid']})"
    n = len(rec.get("envs") or [])
    if n and rec.get("envs_killed"):
        said += f", killed {n} env{'' if n == 1 else 's'}"
    elif n:
        said += (f", {n} env{'' if n == 1 else 's'} left running, lost to the cluster (on the node: "
                 f"WEENV_HOME={rec['home']} weenv daemon stop --kill-envs)")
    said += "; envlet stopped" if rec.get("envlet_pid") is None else f"; envlet (pid {rec['envlet_pid']}) still runs"
    return escape(f"{head}: {said}")
