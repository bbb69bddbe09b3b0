"""``weenv analyze`` and ``weenv regroup``: a corpus of images or locks as shared content, and
republished as change-rate groups (docs/images.md)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import click

from .. import layerfmt, registry
from . import main
from ._common import errors_to_exit, human_bytes, print_json, stderr, stdout

_EXPECTED = (registry.RegistryError, layerfmt.LayerError, OSError)


def _options(fn: Any) -> Any:
    for opt in reversed([
        click.argument("inputs", nargs=-1, required=True, metavar="IMAGES-OR-LOCKS..."),
        click.option("--store", metavar="HOST[:PORT]/PREFIX", help="Where images are converted and groups go "
                     "(default $WEENV_IMAGE_STORE, else the embedded store)."),
        click.option("--min-group-bytes", type=int, help="Keep shared content as a group from this size on "
                     "(default: the size of least stored + fetched bytes)."),
        click.option("--max-groups", type=click.IntRange(2, 100), default=16, show_default=True,
                     help="Most groups an image's lock lists."),
        click.option("--json", "as_json", is_flag=True, help="Print the report as JSON."),
    ]):
        fn = opt(fn)
    return fn


def _load(inputs: tuple[str, ...], store: str | None, stack: ExitStack, quiet: bool) -> tuple[list, str]:
    from ..registry._convert import store_base
    from ..registry._corpus import load_corpus

    base = store_base(store)
    say = None if quiet else (lambda m: stderr.print(m))
    return load_corpus(list(inputs), store=base, stack=stack, progress=say), base


def _report_json(rep: Any) -> dict[str, Any]:
    prop = rep.proposal
    return {"images": rep.images, "image_bytes": rep.image_bytes, "layer_dedup_bytes": rep.layer_dedup_bytes,
            "file_dedup_bytes": rep.file_dedup_bytes, "chunk_dedup_bytes": rep.chunk_dedup_bytes,
            "sharing": [{"images": n, "bytes": b} for n, b in rep.sharing], "classes": rep.classes,
            "changes": rep.changes,
            "proposal": {"min_group_bytes": prop.min_group_bytes, "stored_bytes": prop.stored_bytes,
                         "groups": len(prop.kept), "toc_bytes_per_start": round(prop.toc_bytes_per_start)}}


def _print_report(rep: Any) -> None:
    from rich.table import Table

    t = Table(title=f"{rep.images} images, {human_bytes(rep.image_bytes)} of files in all")
    t.add_column("stored as")
    t.add_column("bytes", justify="right")
    t.add_column("vs registry", justify="right")
    base = max(1, rep.layer_dedup_bytes)
    for label, n in (("registry layers (deduplicated by layer)", rep.layer_dedup_bytes),
                     ("files (deduplicated by content)", rep.file_dedup_bytes),
                     ("chunks (deduplicated by chunk)", rep.chunk_dedup_bytes),
                     ("proposed groups", rep.proposal.stored_bytes)):
        t.add_row(label, human_bytes(n), f"{n / base:.2f}x")
    stdout.print(t)
    s = Table(title="sharing: bytes of file versions held by N images")
    s.add_column("images", justify="right")
    s.add_column("bytes", justify="right")
    for n, b in rep.sharing:
        s.add_row(str(n), human_bytes(b))
    stdout.print(s)
    c = Table(title=f"proposed split (groups from {human_bytes(rep.proposal.min_group_bytes)}, "
                    f"~{human_bytes(int(rep.proposal.toc_bytes_per_start))} of TOC per start)")
    for col in ("class", "groups", "files", "stored", "changed in versions", "bytes changed"):
        c.add_column(col, justify="right" if col != "class" else "left")
    changes = {r["class"]: r for r in rep.changes}
    for row in rep.classes:
        ch = changes.get(row["class"])
        c.add_row(row["class"], str(row["groups"]), str(row["files"]), human_bytes(row["bytes_stored"]),
                  f"{ch['versions_changed']}/{ch['of_versions']}" if ch else "0",
                  human_bytes(ch["bytes_changed"]) if ch else "0")
    stdout.print(c)


def _plot(rep: Any, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib (pip install matplotlib)") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["registry\nlayers", "files", "chunks", "proposed\ngroups"]
    values = [rep.layer_dedup_bytes, rep.file_dedup_bytes, rep.chunk_dedup_bytes, rep.proposal.stored_bytes]
    a.bar(labels, [v / 2**20 for v in values], color=["#888", "#4a7", "#47a", "#c63"])
    a.set_ylabel("MiB stored")
    a.set_title(f"{rep.images} images: bytes stored")
    b.bar([str(n) for n, _ in rep.sharing], [v / 2**20 for _, v in rep.sharing], color="#47a")
    b.set_xlabel("images holding the content")
    b.set_ylabel("MiB")
    b.set_title("sharing histogram")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@main.command("analyze")
@_options
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), metavar="PNG",
              help="Also draw bytes per way of storing and the sharing histogram.")
@errors_to_exit(*_EXPECTED)
def analyze_cmd(inputs: tuple[str, ...], store: str | None, min_group_bytes: int | None, max_groups: int,
                as_json: bool, plot_path: str | None) -> None:
    """Report what a corpus shares (layers, files, chunks), how often each part changed across an
    image family's versions (images of one repository, in the order given), and the change-rate
    split `weenv regroup` would publish."""
    from ..registry._corpus import analyze

    with ExitStack() as stack:
        trees, _ = _load(inputs, store, stack, as_json)
        rep = analyze(trees, min_group_bytes=min_group_bytes, max_groups=max_groups)
    if plot_path:
        _plot(rep, plot_path)
    if as_json:
        print_json(_report_json(rep))
    else:
        _print_report(rep)


@main.command("regroup")
@_options
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory the rewritten locks go to (one per image).")
@errors_to_exit(*_EXPECTED)
def regroup_cmd(inputs: tuple[str, ...], store: str | None, min_group_bytes: int | None, max_groups: int,
                as_json: bool, out_dir: str) -> None:
    """Republish a corpus as the proposed change-rate groups: one lock per image, each checked
    entry by entry against its image."""
    from ..registry._corpus import analyze
    from ..registry._regroup import regroup

    with ExitStack() as stack:
        trees, base = _load(inputs, store, stack, as_json)
        rep = analyze(trees, min_group_bytes=min_group_bytes, max_groups=max_groups)
        res = regroup(trees, rep.proposal, out_dir, store=base,
                      progress=None if as_json else (lambda m: stderr.print(m)))
    doc = {**_report_json(rep), "locks": res.locks, "groups": res.groups, "stored_bytes": res.stored_bytes,
           "uploaded_bytes": res.uploaded_bytes, "toc_bytes_per_start": round(res.toc_bytes_per_start)}
    if as_json:
        print_json(doc)
        return
    stdout.print(f"{len(res.locks)} locks in {out_dir}: {res.groups} groups, {human_bytes(res.stored_bytes)} stored "
                 f"({res.stored_bytes / max(1, rep.layer_dedup_bytes):.2f}x the registry's layers), "
                 f"{human_bytes(res.uploaded_bytes)} uploaded, ~{human_bytes(int(res.toc_bytes_per_start))} of TOC "
                 "per start")
