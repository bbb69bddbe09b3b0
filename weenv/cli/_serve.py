"""``weenv serve`` (the HTTP API on TCP: /v1 and E2B's) and ``weenv template set|ls|rm``."""

from __future__ import annotations

import logging
from functools import partial

import click
from rich.table import Table

from . import main
from ._common import errors_to_exit, print_json, stdout, unsqueezed


def image_routing_options(fn):  # type: ignore[no-untyped-def]
    """``--image-metadata-key``, ``--image-size-key``, ``--image-size`` (serve and cluster serve)."""
    fn = click.option("--image-size", "image_sizes", multiple=True, metavar="NAME=CPU:MEMORY",
                      help="A size the --image-size-key may name (repeat it), e.g. sm=1:1GiB, lg=4:8GiB.")(fn)
    fn = click.option("--image-size-key", metavar="KEY",
                      help="With --image-metadata-key: the metadata key naming the env's size (one of --image-size).")(fn)
    return click.option("--image-metadata-key", metavar="KEY",
                        help="A create with no template whose metadata has KEY starts the image KEY names (pulled and "
                        "converted once): what slime's E2BSandbox sends.")(fn)


def image_routing(metadata_key: str | None, size_key: str | None, sizes: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """The :class:`weenv.api.ImageRouting` the options ask for, or None; usage errors name the option."""
    from ..api import ImageRouting

    if not metadata_key:
        if size_key or sizes:
            raise click.UsageError("--image-size-key and --image-size need --image-metadata-key")
        return None
    if bool(size_key) != bool(sizes):
        raise click.UsageError("--image-size-key and --image-size go together")
    table = {}
    for text in sizes:
        try:
            name, size = ImageRouting.parse_size(text)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--image-size") from None
        if name in table:
            raise click.BadParameter(f"size {name!r} is given twice", param_hint="--image-size")
        table[name] = size
    return ImageRouting(metadata_key, size_key or None, table)


@main.command("serve")
@click.option("--listen", default="127.0.0.1:3000", show_default=True,
              help="host:port to listen on (e.g. 0.0.0.0:3000; [::1]:3000).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="PEM certificate (chain) for HTTPS.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="PEM private key for HTTPS.")
@click.option("--domain", help="Route {port}-{sandbox_id}.DOMAIN host names to sandboxes (E2B_DOMAIN).")
@click.option("--socket", "socket_path", help="The daemon's Unix socket (default $WEENV_HOME/run/weenv.sock).")
@click.option("--registry", "registries", multiple=True, metavar="HOST[:PORT]",
              help="A registry non-admin keys' plans may read groups from, beside the embedded store (repeat it; "
              "default $WEENV_REGISTRIES, comma-separated). The daemon connects nowhere else for them.")
@click.option("--docker", "docker_url", metavar="unix:///PATH",
              help="Also serve the Docker Engine API on this Unix socket (mode 0660, root), as --docker-key "
              "(docs/docker.md). The TCP listen serves it too, under the API key as a bearer token.")
@click.option("--docker-key", default="docker-socket", show_default=True, metavar="NAME",
              help="The API key whose containers the Docker socket makes and sees (the default key is made, as "
              "an admin key, when it is not there; any other must exist).")
@image_routing_options
@errors_to_exit(ValueError, OSError)
def serve_cmd(listen: str, tls_cert: str | None, tls_key: str | None, domain: str | None,
              socket_path: str | None, registries: tuple[str, ...], docker_url: str | None, docker_key: str,
              image_metadata_key: str | None, image_size_key: str | None, image_sizes: tuple[str, ...]) -> None:
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
    routing = image_routing(image_metadata_key, image_size_key, image_sizes)  # bad options: before any daemon starts
    allowed = _registries(registries)
    docker_path = _docker_socket(docker_url, docker_key)
    _ensure_daemon(socket_path)
    app = create_app(NodeBackend(socket_path), domain=domain, registries=allowed, image_routing=routing)
    scheme = "https" if tls_cert else "http"
    click.echo(f"weenv serve: {scheme}://{listen} (daemon {socket_path or 'at $WEENV_HOME/run/weenv.sock'})", err=True)
    try:
        if docker_path:
            click.echo(f"weenv serve: the Docker API on unix://{docker_path} (as key {docker_key!r})", err=True)
        trio.run(partial(serve, app, listen, certfile=tls_cert, keyfile=tls_key, docker=docker_path,
                         docker_key=docker_key))
    except KeyboardInterrupt:
        pass


def _docker_socket(url: str | None, key_name: str) -> str | None:
    """The path of ``--docker unix:///PATH`` and its key made ready (usage errors name the option)."""
    if url is None:
        return None
    if not url.startswith("unix://") or not url[len("unix://"):].startswith("/"):
        raise click.BadParameter(f"{url!r} is not unix:///ABSOLUTE/PATH", param_hint="--docker")
    from ..api import KeyStore

    store = KeyStore()
    if not any(k.name == key_name for k in store.list()):
        if key_name != "docker-socket":
            raise click.BadParameter(f"no API key {key_name!r} (make it with `weenv token create --name "
                                     f"{key_name}`)", param_hint="--docker-key")
        store.create(key_name, admin=True)  # its secret is never shown: only the socket acts as it
    return url[len("unix://"):]


def _ensure_daemon(socket_path: str | None) -> None:
    """Start the node's daemon when it does not answer, as every other command does; refuse to
    serve, naming the fix, when it cannot be started (``WEENV_AUTOSTART=0``, or it fails)."""
    from .. import _home
    from .._connection import DaemonUnavailableError, daemon_answers, start_daemon

    path = socket_path or _home.daemon_socket()
    if daemon_answers(path):
        return
    click.echo(f"weenv serve: the daemon at {path} does not answer: starting it", err=True)
    try:
        start_daemon(path)
    except DaemonUnavailableError as e:
        raise click.ClickException(f"{e}; start it with `weenv daemon` (or let weenv serve start it: unset "
                                   "WEENV_AUTOSTART=0), then start weenv serve again") from None


def _registries(given: tuple[str, ...]) -> frozenset[str] | None:
    """``--registry`` values (checked as REF hosts), or None for ``$WEENV_REGISTRIES``."""
    from ..registry import RefError, parse_ref

    for host in given:
        try:
            if parse_ref(f"{host}/x:y").registry != host:
                raise RefError("not a host[:port]")
        except RefError:
            raise click.BadParameter(f"{host!r} is not a registry host[:port] (e.g. 127.0.0.1:5000, "
                                     "registry.example.com)", param_hint="--registry") from None
    return frozenset(given) if given else None


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


__all__ = ["image_routing", "image_routing_options", "serve_cmd", "template_cmd"]
