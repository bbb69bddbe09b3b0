"""Locking: pin every group of a plan to its manifest, layer and TOC digests, and check them later.

The resolver is injected (``resolve(ref) -> ResolvedGroup``), so this module does no I/O; the CLI
wires it to ``weenv.registry.resolve_group``. Starting from a lock never resolves a tag: the
provisioner fetches ``group.pinned_ref`` and calls :func:`verify_lock_group` /
:func:`verify_manifest` on what it got.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ._errors import LockError, PlanValidationError
from ._model import LOCK_VERSION, Lock, LockedGroup, Plan, plan_fields
from ._ref import DIGEST_PATTERN, parse_ref

_DIGEST = re.compile(DIGEST_PATTERN)


class ResolvedGroupLike(Protocol):
    """What a resolver returns (``weenv.plan.ResolvedGroup`` or the registry's ``GroupInfo``)."""

    manifest_digest: str
    layer_digest: str
    layer_size: int
    toc_digest: str
    registry: str | None
    repo: str


Resolver = Callable[[str], ResolvedGroupLike]


def _label(index: int, name: str) -> str:
    return f"groups[{index}] ({name})"


def lock_plan(plan: Plan, resolve: Resolver) -> Lock:
    """Resolve every group's ref and return the plan with each group pinned.

    A ref that pins a digest (``repo@sha256:…``) must resolve to exactly that digest. A
    :class:`Lock` given here is locked again from its refs (how a lock is refreshed). Raises
    :class:`LockError` naming the group on an unresolvable ref, a digest contradiction or a
    malformed answer from the resolver.
    """
    locked: list[LockedGroup] = []
    for i, g in enumerate(plan.groups):
        label = _label(i, g.name)
        pinned = parse_ref(g.ref).digest
        try:
            r = resolve(g.ref)
        except LockError:
            raise
        except Exception as e:  # the resolver is a seam: whatever it raises, name the group
            raise LockError(f"{label}: cannot resolve {g.ref!r}: {e}", group=g.name) from e
        _check_resolved(label, g.name, g.ref, r)
        if pinned is not None and r.manifest_digest != pinned:
            raise LockError(
                f"{label}: {g.ref!r} pins {pinned} but the store serves {r.manifest_digest}", group=g.name
            )
        locked.append(LockedGroup(
            name=g.name, ref=g.ref, group_class=g.group_class,
            digest=r.manifest_digest, layer_digest=r.layer_digest, layer_size=r.layer_size,
            toc_digest=r.toc_digest, registry=r.registry or None, repo=r.repo,
        ))
    fields = plan_fields(plan)
    fields["groups"] = locked
    lock = Lock(lock_version=LOCK_VERSION, **fields)
    # The resolver's strings become part of a file other weenvs will trust: check them like a file.
    from ._codec import plan_from_builtins, plan_to_builtins

    try:
        return plan_from_builtins(plan_to_builtins(lock), Lock, source="lock")
    except PlanValidationError as e:
        raise LockError(f"the resolver's answer does not make a valid lock: {e}") from None


def _check_resolved(label: str, name: str, ref: str, r: Any) -> None:
    missing = [a for a in ("manifest_digest", "layer_digest", "layer_size", "toc_digest", "registry", "repo")
               if not hasattr(r, a)]
    if missing:
        raise LockError(f"{label}: the resolver's answer for {ref!r} lacks {', '.join(missing)}", group=name)
    for attr in ("manifest_digest", "layer_digest", "toc_digest"):
        value = getattr(r, attr)
        if not isinstance(value, str) or not _DIGEST.match(value):
            raise LockError(f"{label}: {attr} of {ref!r} is not a sha256 digest: {value!r}", group=name)
    size = r.layer_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise LockError(f"{label}: layer_size of {ref!r} is not a byte count: {size!r}", group=name)


def _mismatch(group: LockedGroup, field: str, want: Any, found: str, label: str | None = None) -> LockError:
    label = label or f"group {group.name!r} ({group.pinned_ref})"
    return LockError(f"{label}: {field} mismatch: the lock pins {want}, {found}", group=group.name)


def verify_lock_group(group: LockedGroup, resolved: ResolvedGroupLike) -> None:
    """Check what a store serves for a locked group against the lock; :class:`LockError` naming
    the group, the lock's key that differs (``digest``, ``layer_digest``, ``layer_size``,
    ``toc_digest``), the lock's value and the value found."""
    checks = (("digest", group.digest, getattr(resolved, "manifest_digest", None)),
              ("layer_digest", group.layer_digest, getattr(resolved, "layer_digest", None)),
              ("layer_size", group.layer_size, getattr(resolved, "layer_size", None)),
              ("toc_digest", group.toc_digest, getattr(resolved, "toc_digest", None)))
    for field, want, got in checks:
        if want != got:
            raise _mismatch(group, field, want, f"the store has {got}")


@dataclass(frozen=True)
class ManifestLayer:
    digest: str
    size: int
    toc_digest: str | None  # the layer's TOC annotation, if any


@dataclass(frozen=True)
class ManifestPins:
    """What a manifest's bytes pin, read without trusting a lock: their own digest, the layers they
    reference and the TOC digest annotated on the manifest. Immutable for a given digest, so a
    provisioner may keep it and compare later locks with it (:func:`check_manifest_pins`)."""

    digest: str
    layers: tuple[ManifestLayer, ...]
    toc_digest: str | None


def read_manifest_pins(manifest: bytes) -> ManifestPins:
    """The :class:`ManifestPins` of manifest bytes; ValueError if they are not an OCI manifest."""
    from ..layerfmt import TOC_DIGEST_ANNOTATION

    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    try:
        doc = json.loads(manifest)
    except ValueError:
        raise ValueError("the manifest is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list):
        raise ValueError("the manifest is not an OCI manifest with layers")

    def toc_of(notes: Any) -> str | None:
        toc = notes.get(TOC_DIGEST_ANNOTATION) if isinstance(notes, dict) else None
        return toc if isinstance(toc, str) else None

    layers = []
    for d in doc["layers"]:
        if isinstance(d, dict) and isinstance(d.get("digest"), str) and isinstance(d.get("size"), int):
            layers.append(ManifestLayer(d["digest"], d["size"], toc_of(d.get("annotations"))))
    return ManifestPins(digest, tuple(layers), toc_of(doc.get("annotations")))


def check_manifest_pins(group: LockedGroup, pins: ManifestPins, *, label: str | None = None) -> None:
    """Every pinned field of ``group`` against what its manifest pins: the manifest digest, the
    layer digest and size, the TOC digest (layer or manifest annotation, when there is one; the
    envlet checks the TOC itself when it opens the layer). :class:`LockError` naming the group,
    the field, the lock's value and the manifest's (``label`` replaces ``group 'os' (ref)``)."""
    if pins.digest != group.digest:
        raise _mismatch(group, "digest", group.digest, f"the manifest fetched for it hashes to {pins.digest}", label)
    layer = next((x for x in pins.layers if x.digest == group.layer_digest), None)
    if layer is None:
        named = ", ".join(x.digest for x in pins.layers) or "no layer"
        raise _mismatch(group, "layer_digest", group.layer_digest, f"the manifest names {named}", label)
    if layer.size != group.layer_size:
        raise _mismatch(group, "layer_size", group.layer_size, f"the manifest says {layer.size}", label)
    for toc in (layer.toc_digest, pins.toc_digest):
        if toc is not None and toc != group.toc_digest:
            raise _mismatch(group, "toc_digest", group.toc_digest, f"the manifest says {toc}", label)


def verify_manifest(group: LockedGroup, manifest: bytes) -> None:
    """Check fetched manifest bytes against a locked group: their sha256 is the pinned digest,
    and they reference the pinned layer (digest and size) with the pinned TOC digest when they
    carry the TOC annotation. :class:`LockError` naming the group and the field otherwise."""
    try:
        pins = read_manifest_pins(manifest)
    except ValueError as e:
        raise LockError(f"group {group.name!r} ({group.pinned_ref}): {e}", group=group.name) from None
    check_manifest_pins(group, pins)
