"""``weenv layer``: build, inspect, read and verify layers."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import click

from .. import layerfmt
from .._atomic import atomic_writer
from ._common import SIZE, errors_to_exit, human_bytes, print_json, stdout
from . import main


@main.group()
def layer() -> None:
    """Build, inspect, read and verify weenv layers."""


@contextmanager
def open_layer_reader(source: str) -> Iterator[layerfmt.RandomAccessReader]:
    """A reader for a layer given as a file path (registry refs are added by weenv.registry)."""
    if os.path.exists(source):
        r = layerfmt.FileReader.open(source)
        try:
            yield r
        finally:
            r.close()
        return
    opener = _ref_opener()
    if opener is None:
        raise click.ClickException(f"no such layer file: {source}")
    from ..registry import RegistryError

    try:
        with opener(source) as r:
            yield r
    except RegistryError as e:  # a REF that cannot be resolved or read
        raise click.ClickException(str(e)) from None


def _ref_opener():  # type: ignore[no-untyped-def]
    try:
        from ..registry import open_layer_ref  # type: ignore[attr-defined]
    except ImportError:
        return None
    return open_layer_ref


def _build(src: str, out: str, chunk_size: int, prefetch_list: str | None, as_json: bool, level: int) -> None:
    prefetch: list[str] = []
    if prefetch_list:
        with open(prefetch_list, encoding="utf-8") as f:
            prefetch = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    t0 = time.perf_counter()
    with atomic_writer(out, mode=None, fsync=False) as f:
        result = layerfmt.build_layer(src, f, chunk_size=chunk_size, prefetch=prefetch, level=level)
    dt = time.perf_counter() - t0
    if as_json:
        print_json({**result.__dict__, "path": out, "seconds": round(dt, 3)})
        return
    stdout.print(
        f"[bold]{out}[/]: {result.entries} entries, {human_bytes(result.content_bytes)} of content → "
        f"{human_bytes(result.size)} in {dt:.2f}s ({result.content_bytes / max(dt, 1e-9) / 1e6:.0f} MB/s)"
    )
    stdout.print(f"  digest      {result.digest}\n  toc digest  {result.toc_digest}")
    for p in result.prefetch_missing:
        stdout.print(f"  [yellow]prefetch path not in the tree:[/] {p}")


_build_options = [
    click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help="Layer file to write."),
    click.option("--chunk-size", type=SIZE, default=layerfmt.DEFAULT_CHUNK_SIZE, show_default=True,
                 help="Largest uncompressed chunk (files above it are split)."),
    click.option("--prefetch-list", type=click.Path(exists=True, dir_okay=False),
                 help="File of paths (one per line) to place first, for one-read prefetch."),
    click.option("--level", type=click.IntRange(1, 19), default=3, show_default=True, help="zstd level."),
    click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
]


def _with_build_options(fn):  # type: ignore[no-untyped-def]
    for opt in reversed(_build_options):
        fn = opt(fn)
    return fn


@layer.command("build")
@click.argument("src", type=click.Path(exists=True))
@_with_build_options
@errors_to_exit(layerfmt.LayerError, OSError)
def build_cmd(src: str, out: str, chunk_size: int, prefetch_list: str | None, level: int, as_json: bool) -> None:
    """Build a layer from a directory or a tar / tar.gz / tar.zst file."""
    _build(src, out, chunk_size, prefetch_list, as_json, level)


@layer.command("convert")
@click.argument("oci_layer", type=click.Path(exists=True, dir_okay=False))
@_with_build_options
@errors_to_exit(layerfmt.LayerError, OSError)
def convert_cmd(oci_layer: str, out: str, chunk_size: int, prefetch_list: str | None, level: int, as_json: bool) -> None:
    """Convert a standard OCI layer (tar, tar.gz, tar.zst) into a weenv layer."""
    if os.path.isdir(oci_layer):
        raise click.ClickException(f"{oci_layer} is a directory; use `weenv layer build`")
    _build(oci_layer, out, chunk_size, prefetch_list, as_json, level)


def entry_json(e: layerfmt.Entry) -> dict:
    d = {"path": e.path, "type": e.type, "mode": f"{e.mode:04o}", "uid": e.uid, "gid": e.gid, "mtime": e.mtime}
    if e.type == "file":
        d["size"] = e.size
        d["digest"] = "sha256:" + e.digest.hex()
        d["chunks"] = [
            {"offset": c.offset, "length": c.length, "uoffset": c.uoffset, "ulength": c.ulength,
             "digest": "sha256:" + c.digest.hex()} for c in e.chunks
        ]
    if e.link:
        d["link"] = e.link
    if e.type in ("char", "block"):
        d["devmajor"], d["devminor"] = e.devmajor, e.devminor
    if e.xattrs:
        d["xattrs"] = {k: v.decode("utf-8", "backslashreplace") for k, v in e.xattrs.items()}
    return d


@layer.command("inspect")
@click.argument("layer_ref")
@click.option("--json", "as_json", is_flag=True, help="Print every entry with its chunks as JSON.")
@errors_to_exit(layerfmt.LayerError, OSError)
def inspect_cmd(layer_ref: str, as_json: bool) -> None:
    """Show a layer's digest, TOC digest, sizes and entries."""
    with open_layer_reader(layer_ref) as reader:
        lay = layerfmt.Layer.open(reader)
        digest = _blob_digest(reader, layer_ref)
    files = [e for e in lay.entries if e.type == "file"]
    summary = {
        "digest": digest,
        "toc_digest": lay.toc_digest,
        "size": lay.size,
        "format_version": lay.footer.version,
        "chunk_size": lay.toc.chunk_size,
        "entry_count": len(lay.entries),
        "file_count": len(files),
        "chunk_count": sum(len(e.chunks) for e in files),
        "content_bytes": sum(e.size for e in files),
        "toc_bytes": lay.footer.toc_length,
        "prefetch_end": lay.prefetch_end,
    }
    if as_json:
        print_json({**summary, "entries": [entry_json(e) for e in lay.entries]})
        return
    for k, v in summary.items():
        stdout.print(f"{k:15} {v}")


def _blob_digest(reader: layerfmt.RandomAccessReader, source: str) -> str:
    known = getattr(reader, "digest", None)
    if isinstance(known, str):
        return known
    import hashlib

    h = hashlib.sha256()
    step = 8 << 20
    for off in range(0, reader.size, step):
        h.update(reader.read_at(off, min(step, reader.size - off)))
    return "sha256:" + h.hexdigest()


@layer.command("cat")
@click.argument("layer_ref")
@click.argument("path")
@errors_to_exit(layerfmt.LayerError, OSError)
def cat_cmd(layer_ref: str, path: str) -> None:
    """Write one file's bytes to stdout, reading only the tail and that file's chunks."""
    with open_layer_reader(layer_ref) as reader:
        lay = layerfmt.Layer.open(reader)
        out = sys.stdout.buffer
        for part in lay.iter_read(path):
            out.write(part)
        out.flush()


@layer.command("verify")
@click.argument("layer_ref")
@errors_to_exit(OSError)
def verify_cmd(layer_ref: str) -> None:
    """Verify every chunk; exit non-zero naming the first bad path."""
    with open_layer_reader(layer_ref) as reader:
        try:
            lay = layerfmt.Layer.open(reader)
            lay.verify()
        except layerfmt.LayerError as e:
            raise click.ClickException(f"{layer_ref}: verification failed: {e}") from None
    stdout.print(f"{layer_ref}: ok ({len(lay.entries)} entries, TOC {lay.toc_digest})")
