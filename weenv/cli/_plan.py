"""``weenv plan``: check, lock and show plans, and print their JSON Schema."""

from __future__ import annotations

import os
import sys

import click
from rich.markup import escape

from .._atomic import atomic_write
from .. import plan as planlib
from ._common import errors_to_exit, human_bytes, print_json, stdout
from . import main


@main.group("plan")
def plan_group() -> None:
    """Check, lock and show environment plans; print the plan JSON Schema."""


def _resolver() -> planlib.Resolver:
    """``weenv.registry.resolve_group``, imported late so that plans work without the registry."""
    try:
        from ..registry import resolve_group  # type: ignore[attr-defined]
    except ImportError:
        raise click.ClickException(
            "cannot resolve group refs: weenv.registry.resolve_group is not available in this build"
        ) from None
    return resolve_group  # type: ignore[no-any-return]


def _range(low: str, high: str) -> str:
    return low if low == high else f"{low}-{high}"


def _size(size_bytes: int) -> str:
    exact = planlib.format_size(size_bytes)
    return exact if isinstance(exact, str) else human_bytes(size_bytes)


def _print_summary(path: str, p: planlib.Plan) -> None:
    kind = "lock" if planlib.is_locked(p) else "plan"
    n = len(p.groups)
    stdout.print(f"[bold]{escape(path)}[/]: ok ({kind} {escape(p.name)!r}, {n} group{'s' * (n != 1)})")
    width = max((len(g.name) for g in p.groups), default=0)
    for g in p.groups:
        line = f"  {escape(g.name):{width}}  {g.group_class:9}  {escape(g.ref)}"
        if isinstance(g, planlib.LockedGroup):
            line += f"  [dim]{g.digest[:19]}… toc {g.toc_digest[:19]}…[/]"
        stdout.print(line)
    r = p.resources
    stdout.print(
        f"  cpu {_range(f'{r.cpu.min:g}', f'{r.cpu.max:g}')} cores · memory "
        f"{_range(_size(r.memory.min), _size(r.memory.max))} · pids {r.pids} · disk {_size(r.disk)} · "
        f"network {p.network} · ttl {'none' if p.ttl_s is None else f'{p.ttl_s:g}s'}"
    )
    if p.snapshot:
        stdout.print(f"  snapshot {escape(p.snapshot)}")
    for m in p.mounts:
        stdout.print(f"  mount {escape(m.source)} → {escape(m.target)} (read-only)")


@plan_group.command("check")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help='Print {"ok", "kind", "problems"} as JSON.')
@errors_to_exit(planlib.PlanError, OSError)
def check_cmd(plan_path: str, as_json: bool) -> None:
    """Validate a plan or lock; print a summary, or each located error and exit 1."""
    if not as_json:
        _print_summary(plan_path, planlib.load_any(plan_path))
        return
    try:
        p = planlib.load_any(plan_path)
    except planlib.PlanValidationError as e:
        print_json({"ok": False, "source": e.source,
                    "problems": [{"location": x.location, "message": x.message} for x in e.problems]})
        sys.exit(1)
    except planlib.PlanSyntaxError as e:
        print_json({"ok": False, "source": e.source, "problems": [
            {"location": "", "message": e.message, "line": e.line, "column": e.column}]})
        sys.exit(1)
    print_json({"ok": True, "kind": "lock" if planlib.is_locked(p) else "plan", "name": p.name,
                "groups": len(p.groups), "problems": []})


def _default_lock_path(plan_path: str) -> str:
    root, ext = os.path.splitext(plan_path)
    return (root if ext in (".toml", ".json") else plan_path) + ".lock"


def _with_image_defaults(lock: planlib.Lock, resolver: object, plan_path: str) -> planlib.Lock:
    """Groups imported by `weenv pull` carry their image config: take Env/WorkingDir/User as defaults."""
    try:
        from ..registry import RegistryError, image_config, resolve_group
    except ImportError:
        return lock
    if resolver is not resolve_group:  # a substitute resolver (tests) knows no image configs
        return lock
    try:
        for g in reversed(lock.groups):
            defaults = planlib.plan_defaults_from_image(image_config(g.pinned_ref))
            if defaults:
                lock = planlib.apply_image_defaults(lock, defaults)
    except RegistryError as e:
        raise click.ClickException(f"{plan_path}: reading image configs: {e}") from None
    return lock


@plan_group.command("lock")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Lock file to write: JSON if it ends in .json, else TOML; '-' for stdout. "
                   "Default: PLAN with its extension replaced by .lock.")
@click.option("--json", "as_json", is_flag=True, help="Print what was pinned as JSON.")
@errors_to_exit(planlib.PlanError, OSError)
def lock_cmd(plan_path: str, output: str | None, as_json: bool) -> None:
    """Pin every group of PLAN to its manifest, layer and TOC digests."""
    p = planlib.load_any(plan_path)
    resolver = _resolver()
    try:
        lock = planlib.lock_plan(p, resolver)
    except planlib.LockError as e:
        raise click.ClickException(f"{plan_path}: {e}") from None
    lock = _with_image_defaults(lock, resolver, plan_path)
    out = output or _default_lock_path(plan_path)
    if out == "-":
        sys.stdout.write(planlib.dump_plan(lock, "toml"))
    else:
        planlib.write_plan(lock, out)
    if as_json:
        print_json({"path": out, "name": lock.name, "groups": [
            {"name": g.name, "class": g.group_class, "ref": g.ref, "digest": g.digest,
             "layer_digest": g.layer_digest, "layer_size": g.layer_size, "toc_digest": g.toc_digest,
             "registry": g.registry, "repo": g.repo} for g in lock.groups]})
    elif out != "-":
        stdout.print(f"[bold]{escape(out)}[/]: {len(lock.groups)} group(s) pinned")
        for g in lock.groups:
            stdout.print(f"  {escape(g.name)}  {escape(g.ref)} → {g.digest}")


@plan_group.command("show")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of TOML.")
@errors_to_exit(planlib.PlanError, OSError)
def show_cmd(plan_path: str, as_json: bool) -> None:
    """Print a plan or lock with every default spelled out."""
    p = planlib.load_any(plan_path)
    sys.stdout.write(planlib.dump_plan(p, "json" if as_json else "toml"))


@plan_group.command("schema")
@click.option("--lock", "for_lock", is_flag=True, help="The schema of lock files instead of plans.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to this file instead of stdout.")
@errors_to_exit(OSError)
def schema_cmd(for_lock: bool, output: str | None) -> None:
    """Print the JSON Schema of plan files (docs/plan.schema.json is this output)."""
    text = planlib.dump_json_schema(lock=for_lock)
    if output is None:
        sys.stdout.write(text)
        return
    atomic_write(output, text, mode=None, fsync=False)
