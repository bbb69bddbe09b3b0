"""``weenv demo``: the main job on the embedded default store (what `make demo` runs)."""

from __future__ import annotations

import click

from . import main


@main.command("demo")
@click.option("--keep", is_flag=True, help="Leave the env and its children running.")
def demo_cmd(keep: bool) -> None:
    """Publish os/harness/task groups locally, lock a plan, start an env, run an episode, fork, clean up."""
    from .._client import WeenvError
    from .._demo import run_demo

    try:
        run_demo(keep=keep)
    except WeenvError as e:
        raise click.ClickException(str(e)) from None
