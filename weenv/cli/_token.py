"""``weenv token create|ls|revoke``: the API keys of ``weenv serve`` (stored hashed under $WEENV_HOME/api)."""

from __future__ import annotations

import datetime as dt

import click
from rich.table import Table

from . import main
from ._common import errors_to_exit, print_json, stdout, unsqueezed


@main.group("token")
def token_cmd() -> None:
    """API keys for `weenv serve` (E2B's X-API-Key, Authorization: Bearer for /v1)."""


def _store():  # type: ignore[no-untyped-def]
    from ..api import KeyStore

    return KeyStore()


@token_cmd.command("create")
@click.option("--name", required=True, help="What the key is for (ci, eval-runner...): how ls and revoke name it.")
@click.option("--admin", is_flag=True, help="May see and use every key's envs and the node-wide routes (gc, "
              "top, metrics).")
@errors_to_exit(ValueError, OSError)
def create_cmd(name: str, admin: bool) -> None:
    """Make a key and print it: it is shown this once (only its hash is kept)."""
    key = _store().create(name, admin=admin)
    click.echo(key)
    click.echo(f"weenv: key {name!r}{' (admin)' if admin else ''} created; it is not shown again", err=True)


@token_cmd.command("ls")
@click.option("--json", "as_json", is_flag=True)
@errors_to_exit(ValueError, OSError)
def ls_cmd(as_json: bool) -> None:
    """The keys (names, admin or not, when made); never the keys themselves."""
    keys = sorted(_store().list(), key=lambda k: k.get("created_s", 0))
    if as_json:
        print_json([dict(k) for k in keys])
        return
    table = Table(box=None)
    for col in ("NAME", "ADMIN", "CREATED"):
        table.add_column(col)
    for k in keys:
        created = dt.datetime.fromtimestamp(k.get("created_s", 0)).strftime("%Y-%m-%d %H:%M")
        table.add_row(k.name, "yes" if k.admin else "", created)
    stdout.print(unsqueezed(table))


@token_cmd.command("revoke")
@click.argument("name")
@errors_to_exit(ValueError, OSError)
def revoke_cmd(name: str) -> None:
    """Delete a key: a running `weenv serve` refuses it from its next request on."""
    _store().revoke(name)
    click.echo(f"weenv: key {name!r} revoked", err=True)


__all__ = ["token_cmd"]
