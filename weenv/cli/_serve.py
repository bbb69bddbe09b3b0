"""``weenv serve`` (the HTTP API on TCP: /v1 and E2B's) and ``weenv template set|ls|rm``."""

from __future__ import annotations

import logging
from functools import partial

import click
from rich.table import Table

from . import main
from ._common import errors_to_exit, print_json, stdout, unsqueezed


@main.command("serve")
@click.option("--listen", default="127.0.0.1:3000", show_default=True,
              help="host:port to listen on (e.g. 0.0.0.0:3000; [::1]:3000).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="PEM certificate (chain) for HTTPS.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="PEM private key for HTTPS.")
@click.option("--domain", help="Route {port}-{sandbox_id}.DOMAIN host names to sandboxes (E2B_DOMAIN).")
@click.option("--socket", "socket_path", help="The daemon's Unix socket (default $WEENV_HOME/run/weenv.sock).")
@errors_to_exit(ValueError, OSError)
def serve_cmd(listen: str, tls_cert: str | None, tls_key: str | None, domain: str | None,
              socket_path: str | None) -> None:
    """Serve weenv's API (/v1) and E2B's (control plane and envd) on TCP, in front of the node's daemon.

    Every request needs an API key (`weenv token create --name NAME`); data-plane requests the
    env's access token. See docs/e2b.md."""
    import trio

    from ..api import NodeBackend, create_app, serve

    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{listen!r} is not host:port (e.g. 127.0.0.1:3000, [::1]:3000)",
                                 param_hint="--listen")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(NodeBackend(socket_path), domain=domain)
    scheme = "https" if tls_cert else "http"
    click.echo(f"weenv serve: {scheme}://{listen} (daemon {socket_path or 'at $WEENV_HOME/run/weenv.sock'})", err=True)
    try:
        trio.run(partial(serve, app, listen, certfile=tls_cert, keyfile=tls_key))
    except KeyboardInterrupt:
        pass


@main.group("template")
def template_cmd() -> None:
    """E2B template names: what `Sandbox.create("NAME")` starts (a lock file or a snapshot)."""


def _store():  # type: ignore[no-untyped-def]
    from ..api import TemplateStore

    return TemplateStore()


@template_cmd.command("set")
@click.argument("name")
@click.argument("target")
@errors_to_exit(ValueError, OSError)
def template_set(name: str, target: str) -> None:
    """NAME starts envs from TARGET: a plan lock file, or a snapshot id (snap-...)."""
    entry = _store().set(name, target)
    click.echo(f"weenv: template {name!r} -> {next(iter(entry.values()))}", err=True)


@template_cmd.command("ls")
@click.option("--json", "as_json", is_flag=True)
@errors_to_exit(ValueError, OSError)
def template_ls(as_json: bool) -> None:
    """The template names and what each starts."""
    templates = _store().list()
    if as_json:
        print_json(templates)
        return
    table = Table(box=None)
    for col in ("NAME", "KIND", "TARGET"):
        table.add_column(col)
    for name, entry in sorted(templates.items()):
        kind, target = next(iter(entry.items()))
        table.add_row(name, kind, target)
    stdout.print(unsqueezed(table))


@template_cmd.command("rm")
@click.argument("name")
@errors_to_exit(ValueError, OSError)
def template_rm(name: str) -> None:
    """Forget a template name (its lock file or snapshot stays)."""
    _store().remove(name)
    click.echo(f"weenv: template {name!r} removed", err=True)


__all__ = ["serve_cmd", "template_cmd"]
