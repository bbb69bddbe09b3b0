"""Env commands: daemon, up, exec, ps, pause, resume, kill, timeout, cp, gc, top."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import click

from ._common import human_bytes, print_json, stdout
from . import main


def _client(autostart: bool = True):  # type: ignore[no-untyped-def]
    from .._client import Client

    return Client(autostart=autostart)


def _api_errors(fn):  # type: ignore[no-untyped-def]
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from .._client import WeenvError

        try:
            return fn(*args, **kwargs)
        except WeenvError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


from ._common import SIZE  # noqa: E402  (daemon flags)


@main.group("daemon", invoke_without_command=True)
@click.option("--envlet-cache-size", default="20GiB", show_default=True, help="Bound of the node disk chunk cache.")
@click.option("--cgroup-root", default="weenv", show_default=True, envvar="WEENV_CGROUP_ROOT",
              help="Name of weenv's parent cgroup (created under this process's own cgroup; $WEENV_CGROUP_ROOT).")
@click.option("--monitor-interval-ms", type=click.IntRange(10, 60_000), default=200, show_default=True,
              help="Elastic monitor tick.")
@click.option("--monitor-offload", type=click.Choice(["apply", "all"]), default="apply", show_default=True,
              help="What the monitor runs in a worker thread: quota writes only, or sampling too.")
@click.option("--hold", "hold_s", type=click.FloatRange(0, min_open=True), default=2.0, show_default=True,
              help="Seconds a resource must stay under-used before each halving.")
@click.option("--cpu-throttle-up", type=click.FloatRange(0, 1, min_open=True), default=0.30, show_default=True,
              help="Double the CPU quota when this share of the CFS periods of a tick were throttled.")
@click.option("--cpu-low", type=click.FloatRange(0, 1, min_open=True), default=0.25, show_default=True,
              help="Halve the CPU quota when usage stays below this share of it.")
@click.option("--memory-high-water", type=click.FloatRange(0, 1, min_open=True), default=0.80, show_default=True,
              help="Double the memory limit when usage reaches this share of it.")
@click.option("--memory-low-water", type=click.FloatRange(0, 1, min_open=True), default=0.25, show_default=True,
              help="Halve the memory limit when usage stays below this share of it.")
@click.option("--memory-pressure-up", type=click.FloatRange(0, 1, min_open=True), default=0.05, show_default=True,
              help="Double the memory limit when PSI memory stalls grow by this share of the wall time.")
@click.option("--memory-headroom", type=SIZE, default="64MiB", show_default=True,
              help="A halved memory limit stays this far above usage.")
@click.option("--node-reserve", type=SIZE, default="512MiB", show_default=True,
              help="Node memory never handed to envs (daemon, envlet, kernel).")
@click.option("--cpu-burst-budget", type=click.FloatRange(0), default=None,
              help="Cores handed out above the mins at once [default: the node's cores].")
@click.option("--cpu-min-overcommit", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="Admission: the CPU mins may add up to the node's cores times this.")
@click.option("--memory-burst-reservation/--no-memory-burst-reservation", default=True, show_default=True,
              help="A memory burst starts only if the node can cover the env up to its max (no deadlock "
                   "of half-grown envs on a full node).")
@click.option("--memory-contended-hold", "memory_contended_hold_s", type=click.FloatRange(0), default=0.2,
              show_default=True, help="Seconds a finished memory burst keeps its limit while other envs wait for "
                                      "memory (then straight down to usage + headroom).")
@click.option("--memory-wait", "memory_wait_s", type=click.FloatRange(0, min_open=True), default=20.0,
              show_default=True, help="Seconds an env may wait at its memory limit for a refused doubling; "
                                      "then the limit becomes hard and the kernel OOM-kills inside the env.")
@click.option("--layer-trees-after", type=click.IntRange(0), default=None,
              help="Keep a group layer as a local directory (no FUSE for envs started after) once this many "
                   "env starts used it; 0: never [default: 3, or $WEENV_LAYER_TREES_AFTER].")
@click.option("--layer-trees-size", type=SIZE, default=None,
              help="Disk the layer directories may take (least recently used unstacked ones go first) "
                   "[default: 16GiB, or $WEENV_LAYER_TREES_SIZE].")
@click.option("--egress-interface", "egress_interfaces", multiple=True, metavar="IFACE",
              help="An interface traffic of network = egress envs may leave the node by (repeatable); "
                   "none named: egress envs reach only the node's allowed ports (docs/network.md).")
@click.option("--egress-range", default=None, metavar="CIDR",
              help="Node-local range of egress env addresses, a /30 each [default: 10.213.0.0/16].")
@click.option("--egress-table", default=None, metavar="NAME",
              help="nftables table (inet) holding weenv's rules; nothing else is touched [default: weenv].")
@click.option("--egress-dns", default=None, metavar="ADDR[:PORT]",
              help="DNS server that resolves the host names in allow lists [default: the node's resolver].")
@click.option("--runtime", "default_runtime", type=click.Choice(["crun", "gvisor"]), default=None,
              help="Runtime of plans that name none: crun (containers) or gvisor (runsc, for code nobody trusts) "
                   "[default: crun, or $WEENV_RUNTIME].")
@click.option("--node-name", default=None, metavar="NAME",
              help="Start every env id with NAME- (1-12 of a-z0-9; a cluster routes ids by it) [default: $WEENV_NODE_NAME].")
@click.option("--envlet-peer-listen", default=None, metavar="HOST:PORT",
              help="Serve this node's cached chunks to the cluster's other nodes on HOST:PORT and read theirs "
                   "(the envlet's peer tier; a cluster agent sets it; docs/cluster.md, \"Peer chunk tier\").")
@click.option("--cluster-token-file", default=None, metavar="PATH",
              help="File holding the cluster token peers must present (with --envlet-peer-listen).")
@click.option("--userns/--no-userns", default=None,
              help="Run every crun env in a user namespace: env root is an unprivileged host uid "
                   "(docs/security.md); --no-userns: env root is host root [default: on, or $WEENV_USERNS=0/1].")
@click.option("--userns-base", type=click.IntRange(65536, 2**32 - 1 - 65536), default=None, metavar="UID",
              help="First host uid of the envs' id range (65536 ids) [default: 1073741824].")
@click.option("--park-after", "park_after_s", type=click.FloatRange(0), default=None, metavar="SECONDS",
              help="Park a paused (frozen) gVisor env once it stayed paused this long: its memory is checkpointed "
                   "to disk and freed, resume restores it; a pause may say otherwise (crun envs stay frozen) "
                   "[default: off, or $WEENV_PARK_AFTER_S].")
@click.option("--debug", is_flag=True)
@click.pass_context
def daemon_cmd(ctx: click.Context, envlet_cache_size: str, cgroup_root: str, monitor_interval_ms: int, monitor_offload: str,
               hold_s: float, cpu_throttle_up: float, cpu_low: float, memory_high_water: float,
               memory_low_water: float, memory_pressure_up: float, memory_headroom: int, node_reserve: int,
               cpu_burst_budget: float | None, cpu_min_overcommit: float, memory_burst_reservation: bool,
               layer_trees_after: int | None, layer_trees_size: int | None, debug: bool,
               egress_interfaces: tuple[str, ...] = (), egress_range: str | None = None,
               egress_table: str | None = None, egress_dns: str | None = None, memory_wait_s: float = 20.0,
               node_name: str | None = None, default_runtime: str | None = None, userns: bool | None = None,
               userns_base: int | None = None, envlet_peer_listen: str | None = None,
               cluster_token_file: str | None = None, park_after_s: float | None = None,
               memory_contended_hold_s: float = 0.2) -> None:
    """Run the node daemon in the foreground (the CLI starts it when needed).

    `weenv daemon status` tells whether it runs; `weenv daemon stop` stops it (SIGTERM does the same).
    """
    if ctx.invoked_subcommand is not None:
        given = [p.opts[0] for p in ctx.command.params
                 if ctx.get_parameter_source(p.name) is click.core.ParameterSource.COMMANDLINE]  # type: ignore[arg-type]
        if given:
            raise click.UsageError(f"{', '.join(given)} configure a running daemon, not "
                                   f"`weenv daemon {ctx.invoked_subcommand}`")
        return
    from ..provision import DaemonConfig, serve
    from ..provision.elastic._policy import PolicyConfig
    from ._common import parse_size

    if memory_low_water >= memory_high_water:
        raise click.BadParameter(f"{memory_low_water:g} must be below --memory-high-water {memory_high_water:g}",
                                 param_hint="--memory-low-water")
    policy = PolicyConfig(
        cpu_throttle_up_share=cpu_throttle_up, cpu_low_share=cpu_low, memory_high_water=memory_high_water,
        memory_low_water=memory_low_water, memory_pressure_up_share=memory_pressure_up, hold_s=hold_s,
        memory_headroom_bytes=memory_headroom, node_memory_reserve_bytes=node_reserve,
        cpu_burst_budget_cores=cpu_burst_budget, cpu_min_overcommit=cpu_min_overcommit,
        memory_burst_reservation=memory_burst_reservation, memory_wait_s=memory_wait_s,
        memory_contended_hold_s=memory_contended_hold_s,
    )
    config = DaemonConfig(envlet_cache_size_bytes=parse_size(envlet_cache_size), monitor_interval_ms=monitor_interval_ms,
                          monitor_offload=monitor_offload, policy=policy, cgroup_root=cgroup_root)
    if layer_trees_after is not None:
        config.layer_trees_after = layer_trees_after
    if layer_trees_size is not None:
        config.layer_trees_size_bytes = layer_trees_size
    if park_after_s is not None:
        config.park_after_s = park_after_s
    from ..net._egress import check_table_name
    from ..net._policy import parse_range

    for hint, check, value in (("--egress-range", parse_range, egress_range), ("--egress-table", check_table_name,
                                                                               egress_table)):
        if value is not None:
            try:
                check(value)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint=hint) from None
    config.egress_interfaces = list(egress_interfaces)
    if default_runtime is not None:
        config.runtime = default_runtime
    if node_name is not None:
        import re

        from ..provision.envs._state import NODE_NAME_PATTERN

        if not re.fullmatch(NODE_NAME_PATTERN, node_name):
            raise click.BadParameter(f"{node_name!r}: 1 to 12 lowercase letters or digits", param_hint="--node-name")
        config.node_name = node_name
    if envlet_peer_listen is not None:
        from ..envlet._tier_peer import parse_address

        if not cluster_token_file:
            raise click.BadParameter("needs --cluster-token-file (peers must present the cluster token)",
                                     param_hint="--envlet-peer-listen")
        try:
            parse_address(envlet_peer_listen, "--envlet-peer-listen")
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--envlet-peer-listen") from None
        if not os.path.isfile(cluster_token_file):
            raise click.BadParameter(f"{cluster_token_file}: no such file", param_hint="--cluster-token-file")
        config.envlet_tiers = ["memory", "disk", "peer", "registry"]
        config.envlet_tier_options = {"peer.listen": envlet_peer_listen,
                                      "peer.token_file": os.path.abspath(cluster_token_file)}
    if userns is not None:
        config.userns = userns
    if userns_base is not None:
        config.userns_base = userns_base
    for name, value in (("egress_range", egress_range), ("egress_table", egress_table), ("egress_dns", egress_dns)):
        if value is not None:
            setattr(config, name, value)
    serve(config, debug=debug)


@main.command("up")
@click.argument("plan")
@click.option("--name", help="Override the plan's name (env ids derive from it).")
@click.option("--ttl", "ttl_s", type=float, help="Kill the env after this many seconds.")
@click.option("--cpu", help="Cores: '0.5' or a range '0.25-2'.")
@click.option("--memory", help="Bytes: '1GiB' or a range '512MiB-2GiB'.")
@click.option("--json", "as_json", is_flag=True)
@_api_errors
def up_cmd(plan: str, name: str | None, ttl_s: float | None, cpu: str | None, memory: str | None,
           as_json: bool) -> None:
    """Start an env from PLAN: a plan, a lock, a snapshot id or an image (REF, oci:DIR[:TAG], docker-archive:FILE)."""
    t0 = time.perf_counter()
    with _client() as c:
        env = c.create(plan, name=name, ttl_s=ttl_s, cpu=cpu, memory=memory)
    if as_json:
        print_json(env.info)
    else:
        stdout.print(f"{env.id}  running  ({(time.perf_counter() - t0) * 1000:.0f} ms)")


@main.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("env_id")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", "timeout_s", type=float, help="Kill the command (and all it started) after S seconds.")
@click.option("-e", "--env", "env_vars", multiple=True, help="NAME=VALUE (repeatable).")
@click.option("-w", "--workdir", help="Working directory inside the env.")
@click.option("-u", "--user", help="User inside the env (name or uid[:gid]).")
@click.option("-i", "--stdin", "with_stdin", is_flag=True, help="Send this command's stdin to the env command.")
@click.option("--json", "as_json", is_flag=True, help="Print {exit_code, stdout, stderr, ...} instead of streaming.")
@_api_errors
def exec_cmd(env_id: str, cmd: tuple[str, ...], timeout_s: float | None, env_vars: tuple[str, ...],
             workdir: str | None, user: str | None, with_stdin: bool, as_json: bool) -> None:
    """Run CMD in ENV_ID (after --); the exit code is the command's."""
    env: dict[str, str] = {}
    for item in env_vars:
        if "=" not in item:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--env")
        k, v = item.split("=", 1)
        env[k] = v
    stdin = sys.stdin.buffer.read() if with_stdin else None
    argv = list(cmd)
    with _client() as c:
        e = c.get(env_id)
        if as_json:
            r = e.exec(argv, env=env or None, cwd=workdir, user=user, stdin=stdin, timeout_s=timeout_s)
            print_json({"exit_code": r.exit_code, "stdout": r.stdout.decode("utf-8", "replace"),
                        "stderr": r.stderr.decode("utf-8", "replace"), "timed_out": r.timed_out,
                        "duration_s": r.duration_s})
        else:
            def out(stream: str, data: bytes) -> None:
                f = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
                f.write(data)
                f.flush()

            r = e.exec(argv, env=env or None, cwd=workdir, user=user, stdin=stdin, timeout_s=timeout_s, on_output=out)
            if r.timed_out:
                click.echo(f"weenv: command timed out after {timeout_s:g} s and was killed", err=True)
    sys.exit(r.exit_code)


@main.command("ps")
@click.option("--json", "as_json", is_flag=True)
@_api_errors
def ps_cmd(as_json: bool) -> None:
    """List envs with their current CPU and memory quotas."""
    with _client() as c:
        envs = c.list()
    if as_json:
        print_json(envs)
        return
    stdout.print(ps_table(envs, time.time()))


def status_text(e: dict[str, Any], now: float) -> str:
    """An env's status as ``ps`` shows it: a paused env says whether it is parked (its memory on
    disk), when it will be, or why it stays frozen (docs/snapshots.md, "Park after N seconds paused")."""
    if e["status"] != "paused":
        return str(e["status"])
    if e.get("parked"):
        return "parked"
    if e.get("park_at_s") is not None:
        return f"paused, parks in {max(0.0, e['park_at_s'] - now):.0f}s"
    why = e.get("not_parked_because") or ""
    if why.startswith("its park failed"):
        return "paused, park failed"
    return "paused, frozen" if why else "paused"


def ps_table(envs: list[dict[str, Any]], now: float) -> Any:
    """One row per env; ids and sizes are never cut or wrapped (see ``unsqueezed``)."""
    from rich.table import Table

    from ._common import unsqueezed

    t = Table(box=None)
    for col in ("ID", "STATUS", "GROUPS", "CPU QUOTA", "MEMORY", "AGE"):
        t.add_column(col, no_wrap=True)
    for e in envs:
        res = e.get("resources") or {}
        cpu = (res.get("cpu") or {}).get("quota_cores")
        mem = res.get("memory") or {}
        t.add_row(e["id"], status_text(e, now), ",".join(g or "" for g in e.get("groups", [])),
                  f"{cpu:.2f}" if cpu else "-",
                  f"{human_bytes(mem.get('used_bytes') or 0)} / {human_bytes(mem['limit_bytes'])}"
                  if mem.get("limit_bytes") else "-", f"{now - e['created_s']:.0f}s")
    return unsqueezed(t)


def _simple(name: str, past: str, help_text: str) -> None:
    @main.command(name, help=help_text)
    @click.argument("env_ids", nargs=-1, required=True)
    @_api_errors
    def cmd(env_ids: tuple[str, ...]) -> None:
        with _client() as c:
            for env_id in env_ids:
                getattr(c.get(env_id), name)()
                stdout.print(f"{env_id}  {past}")


@main.command("pause")
@click.argument("env_ids", nargs=-1, required=True)
@click.option("--park-after", "park_after_s", type=click.FloatRange(0), default=None, metavar="SECONDS",
              help="Park it once it stayed paused this long (gVisor envs: its memory checkpointed to disk and "
                   "freed) [default: the daemon's --park-after].")
@_api_errors
def pause_cmd(env_ids: tuple[str, ...], park_after_s: float | None) -> None:
    """Freeze every process of the env (its memory stays)."""
    with _client() as c:
        for env_id in env_ids:
            c.get(env_id).pause(park_after_s=park_after_s)
            stdout.print(f"{env_id}  paused")
_simple("resume", "resumed", "Thaw a paused env (a parked one: restore its processes).")


@main.command("park")
@click.argument("env_ids", nargs=-1, required=True)
@_api_errors
def park_cmd(env_ids: tuple[str, ...]) -> None:
    """Pause envs and free their memory: their processes are checkpointed to disk (gVisor envs); resume restores them."""
    with _client() as c:
        for env_id in env_ids:
            c.env(env_id).pause(memory="park")
            stdout.print(f"{env_id}  parked")


@main.command("kill")
@click.argument("env_ids", nargs=-1, required=True)
@_api_errors
def kill_cmd(env_ids: tuple[str, ...]) -> None:
    """Stop the env and remove everything it used."""
    from .._client import EnvNotFoundError

    with _client() as c:
        for env_id in env_ids:
            try:
                c.kill(env_id)
            except EnvNotFoundError as e:
                raise click.ClickException(str(e)) from None
            stdout.print(f"{env_id}  killed")


@main.command("timeout")
@click.argument("env_id")
@click.argument("seconds", type=float)
@_api_errors
def timeout_cmd(env_id: str, seconds: float) -> None:
    """Reset ENV_ID's TTL: it is killed SECONDS from now (0 removes the TTL)."""
    with _client() as c:
        c.get(env_id).set_timeout(seconds if seconds > 0 else None)
    stdout.print(f"{env_id}  ttl {seconds:g}s" if seconds > 0 else f"{env_id}  no ttl")


@main.command("cp")
@click.argument("src")
@click.argument("dst")
@_api_errors
def cp_cmd(src: str, dst: str) -> None:
    """Copy files or directories host↔env, as `docker cp` does.

    `weenv cp ./repo ENV:/work` (a directory, recursively), `weenv cp ./a.txt ENV:/tmp/` (into
    /tmp), `weenv cp ENV:/etc/os-release .`. A trailing / on the destination means "into this
    directory", which must exist; SRC/. copies only the content of SRC.
    """
    from ._cp import CopyError, EnvSide, HostSide, copy

    def split(spec: str) -> tuple[str | None, str]:
        if ":" in spec and not spec.startswith(("/", ".")):
            env_id, path = spec.split(":", 1)
            if not env_id or not path.startswith("/"):
                raise click.BadParameter(f"{spec!r}: write ENV:/absolute/path", param_hint="SRC/DST")
            return env_id, path
        if not spec:
            raise click.BadParameter("empty path", param_hint="SRC/DST")
        return None, spec

    (se, sp), (de, dp) = split(src), split(dst)
    if (se is None) == (de is None):
        raise click.UsageError("exactly one of SRC and DST must be ENV:PATH")
    with _client() as c:
        env_side = EnvSide(c.get(se or de))  # type: ignore[arg-type]
        src_side, dst_side = (env_side, HostSide()) if se is not None else (HostSide(), env_side)
        try:
            report, target = copy(src_side, sp, dst_side, dp)
        except CopyError as e:
            raise click.ClickException(str(e)) from None
    what = f"{report.files} file{'' if report.files == 1 else 's'}"
    if report.dirs:
        what += f", {report.dirs} director{'y' if report.dirs == 1 else 'ies'}"
    stdout.print(f"copied {what} ({human_bytes(report.bytes)}) to {dst_side.show(target)}")
    for skipped in report.skipped:
        click.echo(f"weenv: skipped {skipped}: the env's files API makes only files and directories"
                   if se is None else f"weenv: skipped {skipped}: not a file, directory or symlink", err=True)


@main.command("gc")
@click.option("--json", "as_json", is_flag=True)
@_api_errors
def gc_cmd(as_json: bool) -> None:
    """Remove mounts, cgroups, containers and directories left by envs that are gone (idempotent)."""
    with _client() as c:
        out = c.gc()
    if as_json:
        print_json(out)
    else:
        stdout.print(", ".join(f"{k}: {len(v)}" for k, v in out.items()))



@main.command("commit")
@click.argument("env_id")
@click.option("--ref", help="Also publish the sealed layer as a task group at REF.")
@click.option("--memory", is_flag=True, help="Also checkpoint its processes (gVisor envs): envs from it resume them.")
@click.option("--json", "as_json", is_flag=True)
@_api_errors
def commit_cmd(env_id: str, ref: str | None, memory: bool, as_json: bool) -> None:
    """Seal ENV_ID's filesystem (and with --memory its processes) into a snapshot (the env keeps running)."""
    with _client() as c:
        info = c.commit(env_id, ref=ref, memory=memory)
    if as_json:
        print_json(info)
    else:
        stdout.print(f"{info.snapshot}  ({human_bytes(info.diff_bytes)} of changes)")


@main.command("fork")
@click.argument("env_id")
@click.option("-n", "n", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--memory", is_flag=True, help="The children continue ENV_ID's processes from one instant (gVisor envs).")
@click.option("--json", "as_json", is_flag=True)
@_api_errors
def fork_cmd(env_id: str, n: int, memory: bool, as_json: bool) -> None:
    """Commit ENV_ID once and start N independent children from that state."""
    with _client() as c:
        data = c.fork(env_id, n, memory=memory)
    if as_json:
        print_json(data.envs)
    else:
        for e in data.envs:
            stdout.print(e.id)


@main.group("snapshot")
def snapshot_group() -> None:
    """List and delete snapshots (made by commit, fork and build)."""


@snapshot_group.command("ls")
@click.option("--json", "as_json", is_flag=True)
@_api_errors
def snapshot_ls(as_json: bool) -> None:
    with _client() as c:
        snaps = c.snapshots()
    if as_json:
        print_json(snaps)
        return
    for s in snaps:
        stdout.print(f"{s['id']}  from {s['source_env']}  {len(s['layers'])} layer(s)  "
                     f"{human_bytes(s['diff_bytes'])}{'  ' + s['ref'] if s.get('ref') else ''}")


@snapshot_group.command("pull")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True)
@_api_errors
def snapshot_pull(ref: str, as_json: bool) -> None:
    """Record the snapshot published at REF on this node (with its memory, if it has one)."""
    with _client() as c:
        snap = c.pull_snapshot(ref)
    if as_json:
        print_json(snap)
        return
    stdout.print(f"{snap['id']}  from {ref}{'  with memory' if snap.get('memory') else ''}")


@snapshot_group.command("rm")
@click.argument("snapshot_ids", nargs=-1, required=True)
@_api_errors
def snapshot_rm(snapshot_ids: tuple[str, ...]) -> None:
    with _client() as c:
        for sid in snapshot_ids:
            c.delete_snapshot(sid)
            stdout.print(f"{sid}  removed")


@main.command("build")
@click.argument("spec", metavar="SPEC-OR-CONTEXT", required=False, type=click.Path(exists=True))
@click.option("-f", "--file", "dockerfile", type=click.Path(exists=True, dir_okay=False),
              help="A Dockerfile: build it over the context SPEC-OR-CONTEXT (default: CONTEXT/Dockerfile).")
@click.option("--build-arg", "build_args", multiple=True, metavar="NAME=VALUE", help="A Dockerfile ARG (repeatable).")
@click.option("--target", help="Build the Dockerfile up to this stage.")
@click.option("--network", type=click.Choice(["none", "loopback", "host"]),
              help="The network of RUN steps (default: the base's; host lets them download).")
@click.option("--store", metavar="HOST[:PORT]/PREFIX", help="Where built layers and converted images go "
              "(default $WEENV_IMAGE_STORE, else the embedded store).")
@click.option("--squash", is_flag=True, help="One group of every built layer (Dockerfile builds).")
@click.option("--class", "group_class", type=click.Choice(["os", "toolchain", "harness", "evaluator", "task"]),
              default="task", show_default=True, help="Class of the built groups (Dockerfile builds).")
@click.option("--name", help="The lock's plan name (Dockerfile builds; default: the context's name).")
@click.option("--ref", help="Build specs: publish the result here (default: GROUP:build in the embedded store).")
@click.option("-o", "--lock-out", "lock_out", type=click.Path(dir_okay=False),
              help="Write the plan lock here (default: SPEC.lock.toml, or NAME.lock.toml beside the Dockerfile).")
@click.option("--json", "as_json", is_flag=True)
@_api_errors
def build_cmd(spec: str | None, dockerfile: str | None, build_args: tuple[str, ...], target: str | None,
              network: str | None, store: str | None, squash: bool, group_class: str, name: str | None,
              ref: str | None, lock_out: str | None, as_json: bool) -> None:
    """Build a lock from a Dockerfile (-f, or a context directory holding one), or a group from a
    build spec (FROM + RUN / COPY / ENV / WORKDIR / USER steps). Unchanged steps come from the cache."""
    log = None if as_json else (lambda msg: stdout.print(msg))
    if dockerfile or (spec is not None and os.path.isdir(spec)) or spec is None:
        from ..build import build_dockerfile

        context = spec or "."
        dockerfile = dockerfile or os.path.join(context, "Dockerfile")
        if not os.path.isfile(dockerfile):
            raise click.UsageError(f"no Dockerfile at {dockerfile} (give -f FILE)")
        args = {}
        for item in build_args:
            k, eq, v = item.partition("=")
            if not eq:
                v = os.environ.get(k, "")  # as docker: --build-arg NAME takes NAME from the environment
            args[k] = v
        res = build_dockerfile(dockerfile, context, output=lock_out, name=name, build_args=args, target=target,
                               network=network, store=store, squash=squash, group_class=group_class, log=log)
        if as_json:
            print_json(res.to_json())
        else:
            cached = sum(1 for s in res.steps if s.cached)
            stdout.print(f"lock: {res.lock_path} ({len(res.groups)} built groups, {cached}/{len(res.steps)} steps "
                         f"cached, {res.uploaded_bytes} bytes uploaded, {res.seconds:.1f}s)")
        return
    from ..build import build

    result = build(spec, ref=ref, lock_out=lock_out, log=log)
    if as_json:
        print_json(result.to_json())
    else:
        stdout.print(f"published {result.ref} ({result.digest}); lock: {result.lock}")
