"""``weenv envlet`` (the FUSE layer server) and ``weenv cache`` (its chunk caches)."""

from __future__ import annotations

import click

from .. import _home
from ._common import SIZE, human_bytes, print_json, stdout
from . import main


@main.group()
def envlet() -> None:
    """The lazy FUSE layer server (one per node; the daemon starts it)."""


@envlet.command("serve")
@click.option("--mountpoint", default=_home.envlet_mountpoint, show_default="$WEENV_HOME/envlet/mnt",
              type=click.Path(file_okay=False))
@click.option("--cache-dir", default=_home.envlet_cache_dir, show_default="$WEENV_HOME/envlet/cache",
              type=click.Path(file_okay=False))
@click.option("--cache-size", type=SIZE, default="10GiB", show_default=True, help="Bound of the node disk cache (L2).")
@click.option("--memory-cache-size", type=SIZE, default="256MiB", show_default=True, help="Bound of the memory cache (L1).")
@click.option("--control-socket", default=_home.envlet_socket, show_default="$WEENV_HOME/run/envlet.sock")
@click.option("--state-file", default=None, help="Registrations to restore at start (default: in the cache dir).")
@click.option("--deadline", "deadline_s", type=float, default=30.0, show_default=True,
              help="Seconds before a read whose data cannot be fetched fails with EIO.")
@click.option("--readahead", "readahead_bytes", type=SIZE, default="4MiB", show_default=True,
              help="Read-ahead within a file on a cold read.")
@click.option("--neighbors", "neighbor_bytes", type=SIZE, default="64KiB", show_default=True,
              help="Compressed bytes of the small files that follow a cold read in the blob, fetched along (0 disables).")
@click.option("--metrics-port", type=int, default=None, help="Serve prometheus metrics on this port.")
@click.option("--tiers", default="memory,disk,registry", show_default=True,
              help="Chunk tiers asked in this order (each is weenv/envlet/_tier_<name>.py).")
@click.option("--id-base", type=click.IntRange(0, 2**32 - 65536), default=0, show_default=True,
              help="Show owners (and write layer trees) as host ids from this base: the root of the envs' "
                   "user namespace (0: envs without one).")
@click.option("--tier-option", "tier_options", multiple=True, metavar="KEY=VALUE",
              help="A setting for a tier (repeatable), e.g. peer.address=10.0.0.2:7070.")
@click.option("--fair/--no-fair", default=True, show_default=True,
              help="Keep one env's request storm from starving other envs' file reads.")
@click.option("--fair-share", "fair_share_cores", type=click.FloatRange(0, 64, min_open=True), default=0.2,
              show_default=True, help="Envlet loop time (in cores) shared by the active envs while two or more are.")
@click.option("--env-cgroup", default="weenv", show_default=True,
              help="Name of weenv's parent cgroup: a request's env is the cgroup below it.")
@click.option("--debug", is_flag=True, help="Verbose logs, FUSE debug output.")
def serve_cmd(mountpoint: str, cache_dir: str, cache_size: int, memory_cache_size: int, control_socket: str,
              state_file: str | None, deadline_s: float, readahead_bytes: int, neighbor_bytes: int,
              metrics_port: int | None, tiers: str, debug: bool, id_base: int = 0, fair: bool = True,
              fair_share_cores: float = 0.2, env_cgroup: str = "weenv", tier_options: tuple[str, ...] = ()) -> None:
    """Mount the envlet and serve until SIGTERM."""
    from ..envlet import serve
    from ..envlet._tier import TierConfigError, parse_tiers

    try:
        parse_tiers(tiers)
    except TierConfigError as e:
        raise click.BadParameter(str(e), param_hint="--tiers") from None
    options = {}
    for i, opt in enumerate(tier_options):
        key, eq, value = opt.partition("=")
        if not eq or not key.strip():
            raise click.BadParameter(f"{opt!r} (the {i + 1}. one) is not KEY=VALUE", param_hint="--tier-option")
        options[key.strip()] = value
    if "peer" in tiers.split(",") or any(k.startswith("peer.") for k in options):
        from ..envlet._tier_peer import PeerOptions

        try:
            PeerOptions.from_options(options)
        except TierConfigError as e:
            raise click.BadParameter(str(e), param_hint="--tier-option") from None
    if not env_cgroup or "/" in env_cgroup or env_cgroup in (".", ".."):
        raise click.BadParameter(f"{env_cgroup!r} is not a cgroup name (one path component)", param_hint="--env-cgroup")
    serve(mountpoint, cache_dir, cache_size_bytes=cache_size, memory_cache_size_bytes=memory_cache_size,
          control_socket=control_socket, state_file=state_file, deadline_s=deadline_s, metrics_port=metrics_port,
          readahead_bytes=readahead_bytes, neighbor_bytes=neighbor_bytes, tiers=tiers, debug=debug, id_base=id_base,
          fair=fair, fair_share_cores=fair_share_cores, env_cgroup=env_cgroup, tier_options=options)


@envlet.command("ls")
@click.option("--control-socket", default=_home.envlet_socket, show_default="$WEENV_HOME/run/envlet.sock")
@click.option("--json", "as_json", is_flag=True)
def ls_cmd(control_socket: str, as_json: bool) -> None:
    """List the registered layers."""
    import msgspec

    from ..envlet import EnvletClient, EnvletError

    try:
        layers = EnvletClient(control_socket).list()
    except EnvletError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        print_json(msgspec.to_builtins(layers))
        return
    for info in layers:
        stdout.print(f"{info.name}  {info.digest}  refs={info.refcount}  {info.entries} entries  {human_bytes(info.size)}")


@envlet.command("trace")
@click.argument("name")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the list here (default: stdout).")
@click.option("--clear", is_flag=True, help="Start a new trace after reading this one.")
@click.option("--control-socket", default=_home.envlet_socket, show_default="$WEENV_HOME/run/envlet.sock")
def trace_cmd(name: str, output: str | None, clear: bool, control_socket: str) -> None:
    """Files of layer NAME in first-read order: pass it to `weenv layer build --prefetch-list`."""
    from ..envlet import EnvletClient, EnvletError

    try:
        paths = EnvletClient(control_socket).trace(name, clear=clear)
    except EnvletError as e:
        raise click.ClickException(str(e)) from None
    text = "".join(p + "\n" for p in paths)
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        click.echo(text, nl=False)


@main.group()
def cache() -> None:
    """The node's chunk caches (memory L1, disk L2)."""


@cache.command("stats")
@click.option("--control-socket", default=_home.envlet_socket, show_default="$WEENV_HOME/run/envlet.sock")
@click.option("--json", "as_json", is_flag=True)
def stats_cmd(control_socket: str, as_json: bool) -> None:
    """Hits, misses and bytes per tier, remote fetches, evictions, verification failures."""
    from ..envlet import EnvletClient, EnvletError

    try:
        s = EnvletClient(control_socket).stats()
    except EnvletError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        print_json(s)
        return
    stdout.print(f"L1 memory  {human_bytes(s['l1_size_bytes'])} of {human_bytes(s['l1_capacity_bytes'])}: "
                 f"{s['l1_hits']} hits, {s['l1_misses']} misses, {s['l1_evictions']} evictions")
    stdout.print(f"L2 disk    {human_bytes(s['l2_size_bytes'])} of {human_bytes(s['l2_capacity_bytes'])} "
                 f"({s['l2_files']} chunks): {s['l2_hits']} hits, {s['l2_misses']} misses, "
                 f"{s['l2_evictions']} evictions, {s['l2_corrupt']} corrupt")
    lat = s["remote_latency"]
    n = sum(lat["counts"])
    mean_ms = 1000 * lat["sum_s"] / n if n else 0.0
    stdout.print(f"L3 remote  {s['remote_fetches']} range reads, {human_bytes(s['remote_bytes'])} "
                 f"({s['remote_chunks']} chunks, mean {mean_ms:.1f} ms), {s['remote_errors']} errors, "
                 f"{s['coalesced_waits']} coalesced waits, {s['verify_failures']} verification failures")
    stdout.print(f"reads      {s['fuse_reads']} FUSE reads, {human_bytes(s['fuse_read_bytes'])}, "
                 f"{s['read_errors']} EIO; {s['layers']} layers registered")
    for name, t in s.get("tiers", {}).items():
        stdout.print(f"tier {name:<9} {t['hits']} hits ({human_bytes(t['hit_bytes'])}), {t['misses']} misses, "
                     f"{t['rejected']} rejected, {t['errors']} errors")
    peer = s.get("peer") or {}
    if peer.get("tier") is not None:
        lat = s["peer_latency"]
        n = sum(lat["counts"])
        stdout.print(f"peers      {s['peer_requests']} requests, {s['peer_chunks']} chunks "
                     f"({human_bytes(s['peer_bytes'])}, mean {1000 * lat['sum_s'] / n if n else 0.0:.1f} ms), "
                     f"{s['peer_misses']} misses, {s['peer_errors']} errors, {s['peer_timeouts']} timeouts, "
                     f"{s['peer_corrupt']} corrupt")
        for addr, p in peer["tier"]["peers"].items():
            backoff = f", backed off {p['backoff_s']:.1f} s" if p["backoff_s"] else ""
            stdout.print(f"peer {addr:<21} {p['layers']} layers, {p['chunks']} chunks ({human_bytes(p['bytes'])}), "
                         f"{p['errors']} errors, {p['timeouts']} timeouts, {p['corrupt']} corrupt{backoff}")
    if peer.get("server") is not None:
        sv = peer["server"]
        stdout.print(f"serving    {sv['address']} ({'on' if sv['serving'] else 'drained'}): "
                     f"{s['peer_served_requests']} requests, {s['peer_served_chunks']} chunks "
                     f"({human_bytes(s['peer_served_bytes'])}), {s['peer_served_fetches']} fetched for peers, "
                     f"{s['peer_refused']} refused, {s['peer_drained']} while drained")
    for layer, per in s.get("layer_tiers", {}).items():
        parts = ", ".join(f"{t} {v['chunks']} chunks ({human_bytes(v['bytes'])})" for t, v in per.items())
        stdout.print(f"layer {layer[7:19]:<12} {parts}")
    for env, u in sorted(s.get("envs", {}).items(), key=lambda kv: -kv[1]["busy_s"])[:20]:
        reqs = ", ".join(f"{n} {op}" for op, n in u["requests"].items() if n)
        stdout.print(f"env {env:<14} {u['busy_s'] * 1000:.0f} ms busy, {human_bytes(u['read_bytes'])} read, "
                     f"{u['delayed']} delayed ({u['delayed_s']:.2f} s): {reqs}")


@cache.command("prune")
@click.option("--to", "to_bytes", type=SIZE, default=0, help="Keep at most this much in the disk cache.")
@click.option("--control-socket", default=_home.envlet_socket, show_default="$WEENV_HOME/run/envlet.sock")
@click.option("--json", "as_json", is_flag=True)
def prune_cmd(to_bytes: int, control_socket: str, as_json: bool) -> None:
    """Evict least recently used chunks from the disk cache."""
    from ..envlet import EnvletClient, EnvletError

    try:
        r = EnvletClient(control_socket).prune(to_bytes)
    except EnvletError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        print_json(r)
    else:
        stdout.print(f"evicted {r['files']} chunks ({human_bytes(r['bytes'])}); {human_bytes(r['l2_size_bytes'])} left")
