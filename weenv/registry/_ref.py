"""REF strings: ``host:port/repo:tag``, ``host/repo@sha256:…``, or ``repo:tag`` for the embedded store."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._errors import RefError

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:\[[0-9a-fA-F:]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?$")
DEFAULT_TAG = "latest"


@dataclass(frozen=True)
class Ref:
    """A parsed REF. ``registry`` is ``host[:port]``, or None for the embedded local store."""

    registry: str | None
    repo: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What to ask the store for: the digest when pinned, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def with_digest(self, digest: str) -> "Ref":
        return Ref(self.registry, self.repo, None, digest)

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repo}" if self.registry else self.repo
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


def is_digest(text: str) -> bool:
    return bool(_DIGEST.match(text))


def check_digest(text: str) -> str:
    if not _DIGEST.match(text):
        raise RefError(f"not a sha256 digest: {text!r} (expected sha256:<64 hex>)")
    return text


def _is_host(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost" or component.startswith("[")


def parse_ref(ref: str, *, default_tag: str | None = DEFAULT_TAG) -> Ref:
    """Parse a REF.

    ``host:port/repo:tag`` and ``host/repo@sha256:…`` name a registry (the first component is a host
    when it has a dot, a port or is ``localhost``); ``harness:v3`` and ``team/harness:v3`` name the
    embedded local store. Without a tag or digest the tag is ``default_tag``.
    """
    text = ref.strip()
    if not text or any(c.isspace() for c in text):
        raise RefError(f"invalid REF {ref!r}: empty or contains whitespace")
    name, digest = text, None
    if "@" in text:
        name, _, digest = text.partition("@")
        if not _DIGEST.match(digest):
            raise RefError(f"invalid REF {ref!r}: {digest!r} is not sha256:<64 lowercase hex>")
    registry = None
    first, sep, rest = name.partition("/")
    if sep and _is_host(first):
        if not _HOST.match(first):
            raise RefError(f"invalid REF {ref!r}: bad registry host {first!r}")
        registry, name = first, rest
    tag = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG.match(tag):
            raise RefError(f"invalid REF {ref!r}: bad tag {tag!r} (letters, digits, _ . -; at most 128)")
    if not _REPO.match(name):
        raise RefError(
            f"invalid REF {ref!r}: bad repository {name!r} (lowercase components [a-z0-9] joined by . _ - and /)"
        )
    if tag is None and digest is None:
        tag = default_tag
    return Ref(registry, name, tag, digest)
