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


def _limit_options(fn):  # type: ignore[no-untyped-def]
    """The per-key limits as options (docs/security.md, "Quotas")."""
    for opt in reversed([
        click.option("--envs", type=int, help="Envs at once."),
        click.option("--cores", type=float, help="Sum of the envs' minimum cores."),
        click.option("--memory", help="Sum of the envs' minimum memory (bytes or e.g. 64GiB)."),
        click.option("--watchers", type=int, help="E2B file watchers at once."),
        click.option("--processes", type=int, help="Commands and processes started through the API, running."),
        click.option("--creates-per-min", "creates_per_min", type=int, help="Env creates a minute (a fork of N: N)."),
    ]):
        fn = opt(fn)
    return fn


def _limits(kw: dict[str, object]) -> dict[str, object]:
    """The limits given on the command line, checked (``--memory`` in bytes)."""
    from ..api._quota import check_limits
    from ..plan._units import parse_size

    given = {k: v for k, v in kw.items() if v is not None}
    if "memory" in given:
        try:
            given["memory"] = parse_size(str(given["memory"]))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--memory") from None
    return check_limits(given, "limits")


@token_cmd.command("create")
@click.option("--name", required=True, help="What the key is for (ci, eval-runner...): how ls and revoke name it.")
@click.option("--admin", is_flag=True, help="May see and use every key's envs and the node-wide routes (gc, "
              "top, metrics).")
@_limit_options
@errors_to_exit(ValueError, OSError)
def create_cmd(name: str, admin: bool, **limits: object) -> None:
    """Make a key and print it: it is shown this once (only its hash is kept). Limits not given
    are the operator's defaults (`weenv token defaults`); an admin key has none but those given."""
    key = _store().create(name, admin=admin, limits=_limits(limits) or None)
    click.echo(key)
    click.echo(f"weenv: key {name!r}{' (admin)' if admin else ''} created; it is not shown again", err=True)


def _show_limits(values: dict[str, object]) -> str:
    return ", ".join(f"{k}={'unlimited' if v is None else v}" for k, v in values.items())


@token_cmd.command("limits")
@click.argument("name")
@_limit_options
@errors_to_exit(ValueError, OSError)
def limits_cmd(name: str, **limits: object) -> None:
    """Show key NAME's limits, or set those given (0 forbids; see `weenv token defaults` for the rest)."""
    from ..api._quota import limits_of

    store = _store()
    given = _limits(limits)
    key = store.set_limits(name, given) if given else store.get(name)
    click.echo(f"{name}: {_show_limits(limits_of(store, key))}")


@token_cmd.command("defaults")
@_limit_options
@errors_to_exit(ValueError, OSError)
def defaults_cmd(**limits: object) -> None:
    """Show or set the limits of keys that set none themselves (the operator's defaults)."""
    from ..api._quota import BUILTIN_DEFAULTS

    store = _store()
    given = _limits(limits)
    own = store.set_defaults(given) if given else store.defaults()
    click.echo(f"defaults: {_show_limits({**BUILTIN_DEFAULTS, **own})}")


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
    for col in ("NAME", "ID", "ADMIN", "CREATED", "LIMITS"):
        table.add_column(col)
    for k in keys:
        created = dt.datetime.fromtimestamp(k.get("created_s", 0)).strftime("%Y-%m-%d %H:%M")
        table.add_row(k.name, k.id, "yes" if k.admin else "", created,
                      ", ".join(f"{n}={v}" for n, v in (k.get("limits") or {}).items()) or "defaults")
    stdout.print(unsqueezed(table))


@token_cmd.command("revoke")
@click.argument("name")
@click.option("--keep-envs", is_flag=True, help="Keep the key's envs running, for admin keys (default: kill them).")
@errors_to_exit(ValueError, OSError)
def revoke_cmd(name: str, keep_envs: bool) -> None:
    """Delete a key: a running `weenv serve` refuses it, and its envs' access tokens, from its next
    request on; it kills the key's envs (or, with --keep-envs, hands them to admin keys)."""
    _store().revoke(name, envs="keep" if keep_envs else "kill")
    what = "kept for admin keys" if keep_envs else "killed by `weenv serve`"
    click.echo(f"weenv: key {name!r} revoked; its envs' tokens no longer work, its envs are {what}", err=True)


__all__ = ["token_cmd"]
