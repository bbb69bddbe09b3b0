"""``weenv regroup``: a corpus republished as the change-rate groups :func:`._corpus.propose`
chose, one lock per image, every lock checked entry by entry against the image it replaces.

Each kept piece becomes one group (its files, and the directories above them), built once
whatever number of images hold it; each image gets a top group of class ``task`` with all of its
directories (as that image has them) and the files of its merged pieces. Groups are tagged by
their layer digest (``[store/]regrouped:sha256-<hex>``), so a re-run publishes nothing it made
before. A lock keeps everything of the image's lock but its groups (env, workdir, user,
``[image]``, resources), ordered by class, largest first within a class.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import layerfmt
from ._corpus import ImageTree, Piece, Proposal, _key
from ._errors import IntegrityError, NotFoundError

REGROUPED_REPO = "regrouped"
CLASS_ORDER = ("os", "toolchain", "harness", "evaluator", "task")


@dataclass
class RegroupResult:
    locks: dict[str, str]
    """Image (as named) -> the lock file written for it."""
    groups: int
    stored_bytes: int
    """Blob bytes of the distinct groups the locks use."""
    uploaded_bytes: int
    toc_bytes_per_start: float
    """Mean compressed TOC bytes a start of one image fetches (all its groups)."""


def _parents(path: str) -> list[str]:
    out, cur = [], path
    while "/" in cur:
        cur = cur.rsplit("/", 1)[0]
        out.append(cur)
    return out


def _piece_entries(tree: ImageTree, paths: list[str]) -> list[layerfmt.SourceEntry]:
    dirs = {d for p in paths for d in _parents(p)}
    out = [tree.entries[d] for d in sorted(dirs) if d in tree.entries]
    if "." in tree.entries:
        out.insert(0, tree.entries["."])
    return out + [tree.entries[p] for p in paths]


def _top_entries(tree: ImageTree, i: int, merged: list[Piece]) -> list[layerfmt.SourceEntry]:
    dirs = [e for p, e in tree.entries.items() if e.type == "dir"]
    own = [tree.entries[p] for piece in merged if i in piece.signature for p in piece.paths]
    return dirs + own


def _publish(entries: list[layerfmt.SourceEntry], name: str, group_class: str, store: str, tmp: str,
             source: str) -> tuple[Any, int]:
    from ._group import resolve_group
    from ._publish import publish_layer_file

    fd, path = tempfile.mkstemp(prefix="weenv-regroup-", suffix=".layer", dir=tmp)
    try:
        with os.fdopen(fd, "wb") as out:
            built = layerfmt.build_entries(entries, out)
        ref = f"{store}{REGROUPED_REPO}:sha256-{built.digest.split(':', 1)[1]}"
        try:
            return resolve_group(ref), 0
        except NotFoundError:
            pub = publish_layer_file(path, ref, group=name, group_class=group_class, source=source,
                                     digest=built.digest)
            return resolve_group(ref), pub.uploaded_bytes
    finally:
        os.unlink(path)


def _locked(info: Any, name: str, group_class: str) -> Any:
    from ..plan import LockedGroup

    return LockedGroup(name=name, ref=f"{info.registry + '/' if info.registry else ''}{info.repo}@"
                       f"{info.manifest_digest}", group_class=group_class, digest=info.manifest_digest,
                       layer_digest=info.layer_digest, layer_size=info.layer_size, toc_digest=info.toc_digest,
                       registry=info.registry, repo=info.repo)


def lock_file_name(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(name) if os.path.exists(name) else name).strip("-.")
    base = re.sub(r"\.lock(\.toml|\.json)?$|\.toml$|\.json$", "", base)
    return f"{base or 'image'}.lock.toml"


def regroup(trees: list[ImageTree], proposal: Proposal, out_dir: str, *, store: str = "",
            progress: Callable[[str], Any] | None = None) -> RegroupResult:
    """Build and publish the proposal's groups, write one lock per image into ``out_dir`` and verify
    each against its image (IntegrityError naming the image and path when one differs)."""
    import msgspec

    from ..build._build import tmp_dir
    from ..plan import Lock, plan_from_builtins, plan_to_builtins, write_plan

    os.makedirs(out_dir, exist_ok=True)
    say = progress or (lambda m: None)
    tmp = tmp_dir() or tempfile.gettempdir()
    shared: dict[int, tuple[Any, Piece]] = {}
    uploaded = 0
    for n, piece in enumerate(proposal.kept):
        holder = trees[min(piece.signature)]
        say(f"group {n + 1}/{len(proposal.kept)}: {piece.group_class}, {len(piece.paths)} files, "
            f"{piece.bytes} bytes, {len(piece.signature)} images")
        info, up = _publish(_piece_entries(holder, piece.paths), f"{piece.group_class}-{n}", piece.group_class,
                            store, tmp, "weenv regroup")
        shared[id(piece)] = (info, piece)
        uploaded += up
    locks: dict[str, str] = {}
    layers: dict[str, int] = {}
    toc_total = 0
    for i, tree in enumerate(trees):
        top, up = _publish(_top_entries(tree, i, proposal.merged), "top", "task", store, tmp,
                           f"weenv regroup {tree.name}")
        uploaded += up
        mine = sorted((shared[id(p)] for p in proposal.groups_of(i)),
                      key=lambda x: (CLASS_ORDER.index(x[1].group_class), -x[1].bytes))
        counts: dict[str, int] = {}
        groups = []
        for info, piece in mine:
            k = counts[piece.group_class] = counts.get(piece.group_class, -1) + 1
            groups.append(_locked(info, f"{piece.group_class}{k}", piece.group_class))
        groups.append(_locked(top, "top", "task"))
        path = os.path.join(out_dir, lock_file_name(tree.name))
        data = plan_to_builtins(msgspec.structs.replace(tree.lock, groups=groups))
        lock = plan_from_builtins(data, Lock, source=path)
        toc_total += verify(tree, lock)
        write_plan(lock, path)
        locks[tree.name] = path
        for g in lock.groups:
            layers[g.layer_digest] = g.layer_size
        say(f"{tree.name}: {len(groups)} groups -> {path}")
    return RegroupResult(locks, len(layers), sum(layers.values()), uploaded, toc_total / max(1, len(trees)))


def verify(tree: ImageTree, lock: Any) -> int:
    """Compose ``lock``'s groups as the overlay would (the top group's entry wins) and check every
    path against ``tree``: files by type, mode, owner, size, content, link target and xattrs;
    directories by mode and owner. Returns the TOC bytes of the groups."""
    from contextlib import ExitStack

    from ._group import open_layer_ref

    got: dict[str, Any] = {}
    toc = 0
    with ExitStack() as stack:
        for g in lock.groups:  # bottom first: a later group's entry replaces an earlier one
            lay = layerfmt.Layer.open(stack.enter_context(open_layer_ref(g.pinned_ref)),
                                      expected_toc_digest=g.toc_digest)
            toc += lay.footer.toc_length
            for e in lay.entries:
                if e.type in ("whiteout", "opaque"):
                    raise IntegrityError(f"{tree.name}: regrouped group {g.name} holds a {e.type} at {e.path!r}")
                got[e.path] = (e, lay.content_entry(e.path) if e.type == "hardlink" else e)
    want_paths = set(tree.entries)
    if set(got) != want_paths:
        extra, missing = sorted(set(got) - want_paths)[:5], sorted(want_paths - set(got))[:5]
        raise IntegrityError(f"{tree.name}: the regrouped lock differs in its paths (extra {extra}, missing {missing})")
    for path, src in tree.entries.items():
        e, content = got[path]
        if src.type == "dir":
            if e.type != "dir" or (e.mode & 0o7777, e.uid, e.gid) != (src.mode & 0o7777, src.uid, src.gid):
                raise IntegrityError(f"{tree.name}: directory {path!r} differs in the regrouped lock")
            continue
        kind = "file" if e.type == "hardlink" else e.type
        mine = _key(layerfmt.SourceEntry(path, kind, mode=e.mode, uid=e.uid, gid=e.gid, size=content.size,
                                         link="" if e.type == "hardlink" else e.link, xattrs=dict(e.xattrs)),
                    content.digest if kind == "file" else b"")
        if mine != tree.keys[path]:
            raise IntegrityError(f"{tree.name}: {path!r} differs in the regrouped lock ({mine} vs {tree.keys[path]})")
    return toc
