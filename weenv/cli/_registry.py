"""``weenv publish``, ``weenv pull`` and ``weenv export``: layer groups to and from registries."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from .. import layerfmt, registry
from . import main
from ._common import errors_to_exit, human_bytes, print_json, stderr, stdout

_EXPECTED = (registry.RegistryError, layerfmt.LayerError, OSError)


@contextmanager
def _progress(enabled: bool) -> Iterator[Any]:
    """A callback ``(label, done, total)`` drawing one bar per label, or None when hidden."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    columns = [TextColumn("{task.description:<12}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=stderr, transient=False) as bar:
        tasks: dict[str, TaskID] = {}

        def update(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total or None)
            bar.update(tasks[label], completed=done, total=total or None)

        yield update


@main.command("publish")
@click.argument("src", type=click.Path(exists=True))
@click.option("--ref", "ref", required=True, help="Where to publish: host:port/repo:tag, or repo:tag for the embedded store.")
@click.option("--group", "group", help="Group name (default: the last component of the repository).")
@click.option("--class", "group_class", type=click.Choice(list(registry.GROUP_CLASSES)), default="harness",
              show_default=True, help="Change-rate class of the group.")
@click.option("--source", help="What the tree came from (image, repo@commit); recorded as an annotation.")
@click.option("--no-cache", is_flag=True, help="Rebuild even when the tree's fingerprint is unchanged.")
@click.option("--json", "as_json", is_flag=True, help="Print {ref, digest, toc_digest, size, uploaded_bytes} as JSON.")
@errors_to_exit(*_EXPECTED)
def publish_cmd(src: str, ref: str, group: str | None, group_class: str, source: str | None, no_cache: bool,
                as_json: bool) -> None:
    """Build SRC (directory or tar) into a layer group and publish it; unchanged trees upload nothing."""
    with _progress(not as_json) as update:
        def progress(stage: str, done: int, total: int) -> None:
            if update is not None and stage == "upload" and total:
                update("upload", done, total)

        res = registry.publish(src, ref, group=group, group_class=group_class, source=source,
                               progress=progress, use_cache=not no_cache)
    if as_json:
        print_json(res.to_json())
        return
    what = "uploaded " + human_bytes(res.uploaded_bytes) if res.uploaded_bytes else "no upload (registry had the blob)"
    stdout.print(f"[bold]{res.ref}[/] → {res.digest}")
    stdout.print(f"  layer {res.layer_digest} ({human_bytes(res.size)}), {what}"
                 + ("" if res.manifest_pushed else ", tag unchanged"))
    stdout.print(f"  toc digest {res.toc_digest}")


@main.command("pull")
@click.argument("image")
@click.option("-o", "--output", "lock_path", type=click.Path(dir_okay=False), metavar="LOCK",
              help="Write the image's lock (TOML, or JSON for *.json) for review; `weenv up LOCK` starts it.")
@click.option("--squash", is_flag=True, help="Merge every layer into one os group (shares nothing with other images).")
@click.option("--groups", "groups", metavar="SPEC",
              help="Merge layer ranges (0-based, inclusive) into groups: os=0-3,toolchain=4-5,harness:harness=6-")
@click.option("--name", help="With --squash / --groups: the REF to store the group(s) at.")
@click.option("--store", metavar="HOST[:PORT]/PREFIX", help=(
    "Where per-layer groups go: a registry the cluster's nodes read (default $WEENV_IMAGE_STORE, else the "
    "embedded store)."))
@click.option("--json", "as_json", is_flag=True, help="Print the layers (or groups) as JSON.")
@errors_to_exit(*_EXPECTED)
def pull_cmd(image: str, lock_path: str | None, squash: bool, groups: str | None, name: str | None,
             store: str | None, as_json: bool) -> None:
    """Import an OCI image (registry REF, oci:DIR[:TAG], docker-archive:FILE) as weenv layer groups.

    By default each image layer becomes its own group, tagged by its diff id, so images that share
    a base share its groups and a second pull converts nothing it already has."""
    if squash and groups:
        raise click.UsageError("give one of --squash and --groups")
    if name and not (squash or groups):
        raise click.UsageError("--name names the squashed group(s): use it with --squash or --groups "
                               "(per-layer groups are tagged by their diff ids)")
    if squash or groups:
        if lock_path or store:
            raise click.UsageError("-o and --store apply to per-layer pulls (without --squash / --groups)")
        _pull_merged(image, name, groups, as_json)
        return
    from ..registry._convert import store_base

    with _progress(not as_json) as update:
        converted = registry.convert_image(image, base=store_base(store), progress=update)
    lock = registry.image_lock(converted)
    if lock_path:
        from .. import plan as planmod

        planmod.write_plan(lock, lock_path)
    if as_json:
        print_json({"image": converted.image, "plan": lock.name, "lock": lock_path,
                    "layers": [{"index": x.index, "diff_id": x.diff_id, "ref": x.ref,
                                "manifest_digest": x.group.manifest_digest, "size": x.group.layer_size,
                                "converted": x.converted, "bytes_read": x.bytes_read} for x in converted.layers]})
        return
    for x in converted.layers:
        what = "converted" if x.converted else "had it"
        stdout.print(f"  layer {x.index} {x.diff_id[:19]}… → [bold]{x.ref}[/] ({human_bytes(x.group.layer_size)}, {what})")
    stdout.print(f"{converted.converted} of {len(converted.layers)} layers converted"
                 + (f"; lock written to {lock_path}" if lock_path else ""))


def _pull_merged(image: str, name: str | None, groups: str | None, as_json: bool) -> None:
    with _progress(not as_json) as update:
        res = registry.pull(image, name=name, groups=groups, progress=update)
    if as_json:
        print_json({
            "image": res.image,
            "groups": [{"ref": g.ref, "group": g.group, "class": g.group_class, "layers": list(g.layers),
                        **g.result.to_json()} for g in res.groups],
            "config": {"env": res.config.env, "working_dir": res.config.working_dir, "user": res.config.user,
                       "entrypoint": res.config.entrypoint, "cmd": res.config.cmd},
        })
        return
    for g in res.groups:
        stdout.print(f"[bold]{g.ref}[/] ({g.group}, {g.group_class}, layers {g.layers[0]}-{g.layers[1]}) → "
                     f"{g.result.digest} ({human_bytes(g.result.size)})")


def _refs_and_config(target: str) -> tuple[list[str], registry.ImageConfig | None]:
    """Group refs of a REF, or of a plan / lock file (bottom first), and the plan's overrides."""
    if not os.path.isfile(target):
        return [target], None
    from .. import plan as planmod

    doc = planmod.load_any(target)
    refs = [getattr(g, "pinned_ref", None) or str(g.ref) for g in doc.groups]
    refs = [r() if callable(r) else r for r in refs]
    base = registry.ImageConfig()
    if refs:
        base = registry.image_config(refs[-1])
    env = {k: v for k, _, v in (e.partition("=") for e in base.env)}
    env.update(doc.env or {})
    cfg = registry.ImageConfig(
        env=[f"{k}={v}" for k, v in env.items()], working_dir=doc.workdir or base.working_dir,
        user=doc.user or base.user, entrypoint=base.entrypoint if not doc.init else [],
        cmd=list(doc.init) if doc.init else base.cmd,
    )
    return refs, cfg


@main.command("export")
@click.argument("target", metavar="REF-OR-PLAN")
@click.option("--oci", "oci_dir", required=True, metavar="DIR[:TAG]", help="OCI image layout to write (tag default latest).")
@click.option("--compression", type=click.Choice(["zstd", "gzip"]), default="zstd", show_default=True,
              help="zstd copies the blobs as they are; gzip recompresses for tools without zstd (umoci 0.4).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@errors_to_exit(*_EXPECTED)
def export_cmd(target: str, oci_dir: str, compression: str, as_json: bool) -> None:
    """Write a group (or a plan's groups) as a standard OCI image that skopeo and umoci read."""
    path, tag = oci_dir, "latest"
    if ":" in oci_dir and not os.path.isdir(oci_dir):
        path, tag = oci_dir.rsplit(":", 1)
    refs, cfg = _refs_and_config(target)
    with _progress(not as_json) as update:
        res = registry.export_oci(refs, path, tag=tag, config=cfg, compression=compression, progress=update)
    if as_json:
        print_json({"oci_dir": res.oci_dir, "tag": res.tag, "manifest_digest": res.manifest_digest,
                    "config_digest": res.config_digest, "layers": res.layers})
        return
    stdout.print(f"[bold]oci:{res.oci_dir}:{res.tag}[/] → {res.manifest_digest} ({len(res.layers)} layers)")
