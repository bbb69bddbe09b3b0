"""``weenv daemon status`` and ``weenv daemon stop``.

Stopping keeps envs running by default (a daemon started later re-adopts them). Their rootfs
stacks layers from the envlet's FUSE mount, so the envlet then keeps running too; it stops, and
unmounts, when no env is left: always with ``--kill-envs``. SIGTERM to the daemon is a plain
``weenv daemon stop``.
"""

from __future__ import annotations

import os
from typing import Any

import click

from .. import _home
from .._proc import wait_gone
from ._common import print_json, stdout
from ._env import daemon_cmd

STATUS_NOT_RUNNING = 3  # as `systemctl status` / LSB init scripts


def _envlet_info() -> dict[str, Any] | None:
    from ..envlet import EnvletClient, EnvletError

    try:
        return EnvletClient(_home.envlet_socket()).ping(timeout_s=2.0)
    except EnvletError:
        return None


def _env_dirs() -> list[str]:
    try:
        return sorted(os.listdir(_home.envs_dir()))
    except OSError:
        return []


def _ago(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    return f"{s // 3600}h {s % 3600 // 60}m"


@daemon_cmd.command("status")
@click.option("--json", "as_json", is_flag=True)
def status_cmd(as_json: bool) -> None:
    """Whether the daemon and the envlet run (exit status 3 when the daemon does not)."""
    from .._client import Client, WeenvError

    try:
        with Client(autostart=False) as c:
            daemon: dict[str, Any] | None = c.ping()
    except WeenvError:
        daemon = None
    envlet = _envlet_info()
    if as_json:
        print_json({"home": _home.home(), "socket": _home.daemon_socket(), "daemon": daemon, "envlet": envlet})
    else:
        if daemon is not None:
            n = daemon["envs"]
            stdout.print(f"daemon  running  pid {daemon['pid']}, version {daemon['version']}, up "
                         f"{_ago(daemon['uptime_s'])}, {n} env{'' if n == 1 else 's'}, socket {_home.daemon_socket()}")
        else:
            stdout.print(f"daemon  not running  (nothing answers on {_home.daemon_socket()})")
        if envlet is not None:
            stdout.print(f"envlet  running  pid {envlet['pid']}, layers mounted at {envlet['mountpoint']}")
        else:
            stdout.print("envlet  not running")
    if daemon is None:
        raise SystemExit(STATUS_NOT_RUNNING)


@daemon_cmd.command("stop")
@click.option("--kill-envs", is_flag=True, help="Kill every env first; then the envlet stops too.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=60.0, show_default=True,
              help="Seconds to wait for the daemon to exit.")
def stop_cmd(kill_envs: bool, timeout_s: float) -> None:
    """Stop the daemon, and the envlet when no env runs on it any more.

    Envs keep running (a daemon started later re-adopts them), and so does the envlet that serves
    their layers, unless --kill-envs kills them first.
    """
    from .._client import ApiError, Client, DaemonUnavailableError, WeenvError, start_daemon

    with Client(autostart=False) as c:
        try:
            info = c.ping()
        except WeenvError:
            envlet = _envlet_info()
            if not (kill_envs and (envlet is not None or _env_dirs())):
                note = ""
                if envlet is not None:
                    note = (f"; the envlet (pid {envlet['pid']}) still serves envs left running: "
                            "`weenv daemon stop --kill-envs` stops them and it")
                stdout.print(f"the weenv daemon is not running{note}")
                return
            # Envs (or an envlet) a stopped daemon left: a daemon re-adopts them, then stops with them.
            try:
                start_daemon(c.socket_path)
                info = c.ping()
            except WeenvError as e:
                raise click.ClickException(f"cannot start a daemon to kill the envs left running: {e}") from None
        try:
            envs = [e["id"] for e in c.list()]
        except WeenvError:
            envs = []
        try:
            c.stop_daemon(kill_envs=kill_envs)
        except ApiError as e:
            raise click.ClickException(f"the daemon refused to stop: {e}") from None
        except DaemonUnavailableError:
            pass  # it went away before its answer reached us: what we asked for
    if not wait_gone(info["pid"], timeout_s):
        raise click.ClickException(f"the daemon (pid {info['pid']}) still runs after {timeout_s:g} s; "
                                   f"see {_home.path('daemon.log')}")
    stdout.print(f"daemon stopped (pid {info['pid']})")
    if kill_envs and envs:
        stdout.print(f"killed {len(envs)} env{'' if len(envs) == 1 else 's'}")
    envlet = _envlet_info()
    if envlet is None:
        stdout.print(f"envlet stopped ({_home.envlet_mountpoint()} unmounted)")
    else:
        kept = f"{len(envs)} env{'' if len(envs) == 1 else 's'}" if envs else "envs"
        stdout.print(f"envlet kept (pid {envlet['pid']}): {kept} still run{'s' if len(envs) == 1 else ''} on its layers; "
                     "`weenv daemon stop --kill-envs` stops them and it")
