"""``weenv net ENV``: show an egress env's network, or change its policy while it runs."""

from __future__ import annotations

from typing import Any

import click

from . import main
from ._common import human_bytes, print_json, stdout
from ._env import _api_errors, _client


def _show(info: dict[str, Any]) -> None:
    if info.get("mode") != "egress":
        stdout.print(f"network: {info.get('mode')}")
        return
    c = info.get("counters", {})
    stdout.print(f"address {info['address']} · gateway (node) {info['gateway']} · dns {info.get('dns', 'none')}"
                 + (f" · bandwidth {info['bandwidth_bps'] / 1e6:g} Mbit/s" if info.get("bandwidth_bps") else ""))
    stdout.print(f"allow: {', '.join(info.get('allow', [])) or '(nothing)'}")
    stdout.print(f"deny:  {', '.join(info.get('deny', [])) or '(only the implicit denies)'}")
    for host, addrs in info.get("resolved", {}).items():
        stdout.print(f"  {host} → {', '.join(addrs) or '(no address)'}")
    stdout.print(f"out {human_bytes(c.get('bytes_out', 0))} · in {human_bytes(c.get('bytes_in', 0))} · "
                 f"{c.get('connections_allowed', 0)} connections allowed · {c.get('packets_denied', 0)} packets "
                 f"denied ({human_bytes(c.get('bytes_denied', 0))})")


@main.command("net")
@click.argument("env_id")
@click.option("--allow", multiple=True, metavar="ENTRY", help="Allow this entry (CIDR[:ports], host[:ports], node[:ports]).")
@click.option("--deny", multiple=True, metavar="ENTRY", help="Deny this entry (wins over allow).")
@click.option("--remove", multiple=True, metavar="ENTRY", help="Drop this entry from both lists.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@_api_errors
def net_cmd(env_id: str, allow: tuple[str, ...], deny: tuple[str, ...], remove: tuple[str, ...], as_json: bool) -> None:
    """Show ENV's network (policy, addresses, accounting); with --allow/--deny/--remove, change the
    policy of the running env (new connections follow it at once; docs/network.md)."""
    with _client(autostart=False) as c:
        if allow or deny or remove:
            info = c.env(env_id).set_network(allow=list(allow), deny=list(deny), remove=list(remove))
        else:
            info = c.env(env_id).network()
    if as_json:
        print_json(info)
    else:
        _show(info)
