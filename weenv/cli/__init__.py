"""The ``weenv`` command line. Each area registers its commands from its own module."""

from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="weenv")
@click.option("--host", envvar="WEENV_HOST", metavar="URL",
              help="Talk to `weenv serve` at URL (http://host:3000) instead of the local daemon.")
@click.option("--token", envvar="WEENV_TOKEN", metavar="KEY", help="API key for --host (`weenv token create`).")
def main(host: str | None, token: str | None) -> None:
    """weenv: lazily provisioned, isolated environments for agentic RL and evaluation."""
    import os

    if host:  # what every weenv.Client() made by the commands below picks up
        if not host.startswith(("http://", "https://")):
            raise click.BadParameter(f"{host!r} is not an http:// or https:// URL", param_hint="--host")
        os.environ["WEENV_HOST"] = host
    if token:
        os.environ["WEENV_TOKEN"] = token


# Registration order is the order of `weenv --help`.
from . import _layer  # noqa: E402,F401
from . import _plan  # noqa: E402,F401
from . import _registry  # noqa: E402,F401
from . import _envlet  # noqa: E402,F401
from . import _env  # noqa: E402,F401
from . import _daemonctl  # noqa: E402,F401
from . import _top  # noqa: E402,F401
from . import _net  # noqa: E402,F401
from . import _package  # noqa: E402,F401
from . import _demo  # noqa: E402,F401
from . import _serve  # noqa: E402,F401
from . import _token  # noqa: E402,F401
from . import _cluster  # noqa: E402,F401
from . import _images  # noqa: E402,F401

__all__ = ["main"]
