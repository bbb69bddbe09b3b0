"""A corpus of images (or locks) as content: which files, layers and chunks are shared by how many
images, how often each part changed across an image family's versions, and a split into
change-rate groups (``weenv analyze``; ``weenv regroup`` publishes it, :mod:`._regroup`).

Each image is flattened (its groups bottom first, whiteouts applied) into one tree. A file version
is what makes two files the same file: path, type, mode, owner, size, content digest, link target
and xattrs (not the mtime: two builds of one file differ only there, and the shared copy keeps the
first image's). The images holding a file version are its *signature*; file versions with one
signature form a *piece*, and an image is exactly the union of the pieces whose signature holds
it, so pieces of one image never overlap and a store that keeps each piece once keeps every file
once. The proposal keeps a piece as a group when it is worth its table of contents on every start
(at least ``min_group_bytes``), and merges the rest into each image's own top group; classes
follow the signature: every image -> ``os``, images of several families -> ``toolchain``, several
images of one family -> ``harness``, one image -> ``task``. Each image's top group also carries
all of its directories (their modes and owners as that image has them: the top of an overlay
decides a directory's attributes).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from .. import layerfmt
from ._errors import ArtifactError
from ._image import squash

TOC_BYTES_PER_ENTRY = 48
"""Compressed TOC bytes an entry costs a start (measured on converted images: 35-60)."""
CLASS_BY_TIER = {"all": "os", "families": "toolchain", "family": "harness", "one": "task"}


@dataclass(frozen=True)
class FileKey:
    path: str
    type: str
    mode: int
    uid: int
    gid: int
    size: int
    digest: bytes
    link: str
    xattrs: tuple[tuple[str, bytes], ...]


@dataclass
class ImageTree:
    """One image of the corpus, flattened."""

    name: str
    family: str
    lock: Any
    entries: dict[str, layerfmt.SourceEntry]
    keys: dict[str, FileKey]
    layers: list[tuple[str, int]]
    """(layer digest, blob size) of its groups."""
    chunks: list[tuple[bytes, int]]
    """(chunk digest, compressed length) of its files' chunks."""
    toc_bytes: int
    stored: dict[str, int]
    """Compressed bytes of each file (its chunks' frames), what storing it costs."""

    @property
    def bytes(self) -> int:
        return sum(k.size for k in self.keys.values())


@dataclass
class Piece:
    signature: frozenset[int]
    paths: list[str] = field(default_factory=list)
    bytes: int = 0
    """Compressed bytes of its files (as a layer stores them)."""
    tier: str = "one"

    @property
    def group_class(self) -> str:
        return CLASS_BY_TIER[self.tier]


@dataclass
class Proposal:
    kept: list[Piece]
    merged: list[Piece]
    min_group_bytes: int
    stored_bytes: int
    toc_bytes_per_start: float

    def groups_of(self, i: int) -> list[Piece]:
        return [p for p in self.kept if i in p.signature]


def family_of(name: str) -> str:
    """An image's family: its repository (``host/ns/repo:tag`` -> ``ns/repo``), or a lock file's name
    up to its last ``-``/``_`` part."""
    if os.path.exists(name):
        base = os.path.basename(name).split(".")[0]
        return base.rsplit("-", 1)[0] if "-" in base else base
    tail = name.split("@", 1)[0]
    repo = tail.rsplit(":", 1)[0] if tail.rfind(":") > tail.rfind("/") else tail
    return repo.split("/", 1)[1] if "/" in repo and ("." in repo.split("/")[0] or ":" in repo.split("/")[0]) else repo


def _lock_of(name: str, store: str) -> Any:
    from ..plan import Lock, load_any, lock_plan
    from ._convert import is_image_ref, lock_for_image
    from ._group import resolve_group

    if os.path.isfile(name):
        doc = load_any(name)
        return doc if isinstance(doc, Lock) else lock_plan(doc, resolve_group)
    if is_image_ref(name):
        return lock_for_image(name, base=store)
    raise ArtifactError(f"{name!r} is neither a lock or plan file nor an image reference")


def _source_entries(lay: layerfmt.Layer, digests: dict[int, tuple[bytes, int]]) -> list[layerfmt.SourceEntry]:
    """A weenv layer's entries as build sources, each file's content read from the layer; the
    content digest and compressed size of each file entry go into ``digests`` (by the entry's id)."""
    out = []
    targets = {e.link for e in lay.entries if e.type == "hardlink"}
    for e in lay.entries:
        kind = "file" if e.type == "hardlink" else e.type
        opener = None
        content = lay.content_entry(e.path) if e.type == "hardlink" else e
        if kind == "file":
            opener = (lambda p=content.path: _Chunks(lay.iter_read(p)))
        key = ("h", e.link) if e.type == "hardlink" else (("h", e.path) if e.path in targets else None)
        src = layerfmt.SourceEntry(e.path, kind, mode=e.mode, uid=e.uid, gid=e.gid, mtime=e.mtime, size=content.size,
                                   link="" if e.type == "hardlink" else e.link, devmajor=e.devmajor,
                                   devminor=e.devminor, xattrs=dict(e.xattrs), opener=opener, link_key=key)
        if kind == "file":
            digests[id(src)] = (content.digest, sum(c.length for c in content.chunks))
        out.append(src)
    return out


class _Chunks:
    """A read-only file over an iterator of byte strings."""

    def __init__(self, it: Any):
        self._it, self._buf = it, b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) < n:
            try:
                self._buf += next(self._it)
            except StopIteration:
                break
        if n < 0:
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def close(self) -> None:
        pass

    def __enter__(self) -> "_Chunks":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _key(e: layerfmt.SourceEntry, digest: bytes) -> FileKey:
    return FileKey(e.path, e.type, e.mode & 0o7777, e.uid, e.gid, e.size, digest, e.link,
                   tuple(sorted(e.xattrs.items())))


def load_tree(name: str, lock: Any, stack: ExitStack, family: str | None = None) -> ImageTree:
    """Flatten ``lock``'s groups (their layers stay open on ``stack`` for reading contents)."""
    from ._group import open_layer_ref

    layers: list[list[layerfmt.SourceEntry]] = []
    digests: dict[int, tuple[bytes, int]] = {}
    blobs, chunks, toc = [], [], 0
    for g in lock.groups:
        reader = stack.enter_context(open_layer_ref(g.pinned_ref))
        lay = layerfmt.Layer.open(reader, expected_toc_digest=g.toc_digest)
        toc += lay.footer.toc_length
        blobs.append((g.layer_digest, g.layer_size))
        chunks += [(c.digest, c.length) for e in lay.entries if e.type == "file" for c in e.chunks]
        layers.append(_source_entries(lay, digests))
    flat = {e.path: e for e in squash(layers, bottom=True)}
    keys = {p: _key(e, digests.get(id(e), (b"", 0))[0]) for p, e in flat.items() if e.type != "dir"}
    stored = {p: digests.get(id(e), (b"", 0))[1] for p, e in flat.items() if e.type != "dir"}
    return ImageTree(name, family or family_of(name), lock, flat, keys, blobs, chunks, toc, stored)


def load_corpus(names: list[str], *, store: str = "", stack: ExitStack,
                progress: Callable[[str], Any] | None = None) -> list[ImageTree]:
    out = []
    for n, name in enumerate(names):
        if progress:
            progress(f"[{n + 1}/{len(names)}] {name}")
        out.append(load_tree(name, _lock_of(name, store), stack))
    if len({t.name for t in out}) != len(out):
        raise ArtifactError("the corpus names an image twice")
    return out


def pieces(trees: list[ImageTree]) -> list[Piece]:
    """File versions grouped by the images that hold them; a hardlink set stays in one piece."""
    holders: dict[FileKey, set[int]] = defaultdict(set)
    for i, t in enumerate(trees):
        for k in t.keys.values():
            holders[k].add(i)
    sig_of: dict[tuple[int, str], frozenset[int]] = {}
    for i, t in enumerate(trees):
        links: dict[Any, list[str]] = defaultdict(list)
        for p, e in t.entries.items():
            if e.type == "dir":
                continue
            sig_of[(i, p)] = frozenset(holders[t.keys[p]])
            if e.link_key is not None:
                links[e.link_key].append(p)
        for members in links.values():  # hardlinks share one inode: one piece, the narrowest signature
            common = frozenset.intersection(*(sig_of[(i, p)] for p in members))
            if any(sig_of[(i, p)] != common for p in members):
                for p in members:
                    sig_of[(i, p)] = frozenset({i})
    by_sig: dict[frozenset[int], Piece] = {}
    for (i, p), sig in sig_of.items():
        piece = by_sig.setdefault(sig, Piece(sig))
        if i == min(sig):  # listed once, from its first holder
            piece.paths.append(p)
            piece.bytes += trees[i].stored[p]
    families = [t.family for t in trees]
    for piece in by_sig.values():
        fams = {families[i] for i in piece.signature}
        piece.tier = "all" if len(piece.signature) == len(trees) and len(trees) > 1 else \
            "one" if len(piece.signature) == 1 else "families" if len(fams) > 1 else "family"
    return sorted(by_sig.values(), key=lambda p: (-len(p.signature), -p.bytes))


def propose(trees: list[ImageTree], all_pieces: list[Piece], *, min_group_bytes: int | None = None,
            max_groups: int = 16, starts_per_image: int = 100) -> Proposal:
    """The split: pieces kept as groups (at least ``min_group_bytes``; None: the threshold of the
    least stored bytes + TOC bytes fetched over ``starts_per_image`` starts of every image), the
    rest merged into each image's top group; at most ``max_groups`` kept groups per image."""
    candidates = [min_group_bytes] if min_group_bytes is not None else [0, 64 << 10, 256 << 10, 1 << 20, 4 << 20,
                                                                        16 << 20]
    best: Proposal | None = None
    for threshold in candidates:
        prop = _split(trees, all_pieces, threshold, max_groups)
        cost = prop.stored_bytes + prop.toc_bytes_per_start * starts_per_image * len(trees)
        if best is None or cost < best.stored_bytes + best.toc_bytes_per_start * starts_per_image * len(trees):
            best = prop
    assert best is not None
    return best


def _split(trees: list[ImageTree], all_pieces: list[Piece], threshold: int, max_groups: int) -> Proposal:
    kept = [p for p in all_pieces if len(p.signature) > 1 and p.bytes >= threshold]
    while True:  # too many groups for some image: its smallest shared piece goes into the top groups
        counts = Counter(i for p in kept for i in p.signature)
        over = {i for i, n in counts.items() if n > max_groups - 1}
        if not over:
            break
        victim = min((p for p in kept if p.signature & over), key=lambda p: p.bytes)
        kept.remove(victim)
    kept_ids = {id(p) for p in kept}
    merged = [p for p in all_pieces if id(p) not in kept_ids]
    stored = sum(p.bytes for p in kept) + sum(p.bytes * len(p.signature) for p in merged)
    entries_per_start = []
    for i, t in enumerate(trees):
        own = sum(len(p.paths) for p in kept if i in p.signature)
        entries_per_start.append(len(t.entries) + own)  # the top group lists every directory and merged file
    toc = TOC_BYTES_PER_ENTRY * sum(entries_per_start) / max(1, len(trees))
    return Proposal(kept, merged, threshold, stored, toc)


@dataclass
class Report:
    images: int
    image_bytes: int
    """Sum over images of their files' bytes, uncompressed (what a full copy of each would hold)."""
    layer_dedup_bytes: int
    """Blob bytes of the distinct layers: what a registry stores (compressed, as all the byte counts
    below: a file costs its chunks' zstd frames)."""
    file_dedup_bytes: int
    chunk_dedup_bytes: int
    sharing: list[tuple[int, int]]
    """(number of images holding it, bytes of file versions held by that many)."""
    classes: list[dict[str, Any]]
    changes: list[dict[str, Any]]
    proposal: Proposal


def analyze(trees: list[ImageTree], *, min_group_bytes: int | None = None, max_groups: int = 16,
            starts_per_image: int = 100) -> Report:
    all_pieces = pieces(trees)
    prop = propose(trees, all_pieces, min_group_bytes=min_group_bytes, max_groups=max_groups,
                   starts_per_image=starts_per_image)
    layers = {d: s for t in trees for d, s in t.layers}
    unique_content = {k.digest: t.stored[k.path] for t in trees for k in t.keys.values() if k.type == "file"}
    chunks = {d: n for t in trees for d, n in t.chunks}
    share = Counter()
    for p in all_pieces:
        share[len(p.signature)] += p.bytes
    classes = []
    for cls in ("os", "toolchain", "harness", "evaluator", "task"):
        kept = [p for p in prop.kept if p.group_class == cls]
        merged = [p for p in prop.merged if p.group_class == cls]
        if kept or merged:
            classes.append({"class": cls, "groups": len(kept), "bytes_stored": sum(p.bytes for p in kept)
                            + sum(p.bytes * len(p.signature) for p in merged),
                            "files": sum(len(p.paths) for p in kept + merged)})
    return Report(len(trees), sum(t.bytes for t in trees), sum(layers.values()), sum(unique_content.values()),
                  sum(chunks.values()), sorted(share.items()), classes, _changes(trees, prop), prop)


def _changes(trees: list[ImageTree], prop: Proposal) -> list[dict[str, Any]]:
    """Per class: in how many consecutive versions of a family its content changed, and how much."""
    cls_of: dict[tuple[int, str], str] = {}
    for p in prop.kept + prop.merged:
        for i in p.signature:
            for path in p.paths:
                cls_of[(i, path)] = p.group_class
    fam: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trees):
        fam[t.family].append(i)
    out: dict[str, dict[str, Any]] = {}
    pairs = 0
    for members in fam.values():
        for a, b in zip(members, members[1:]):
            pairs += 1
            ta, tb = trees[a], trees[b]
            changed: dict[str, int] = defaultdict(int)
            for path, k in tb.keys.items():
                if ta.keys.get(path) != k:
                    changed[cls_of.get((b, path), "task")] += k.size
            for cls, n in changed.items():
                row = out.setdefault(cls, {"class": cls, "versions_changed": 0, "bytes_changed": 0})
                row["versions_changed"] += 1
                row["bytes_changed"] += n
    for row in out.values():
        row["of_versions"] = pairs
    return sorted(out.values(), key=lambda r: ("os", "toolchain", "harness", "evaluator", "task").index(r["class"]))
