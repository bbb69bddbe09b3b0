"""The ``weenv`` command line. Each area registers its commands from its own module."""

from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="weenv")
def main() -> None:
    """weenv: lazily provisioned, isolated environments for agentic RL and evaluation."""


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

__all__ = ["main"]
