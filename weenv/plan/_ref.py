"""Group references: ``[host[:port]/]repo[:tag][@sha256:…]``, parsed as OCI distribution does.

A ref whose first component has no ``.`` or ``:``, is not ``localhost`` and is not an IPv6
``[…]`` has no registry host:
it names the embedded local store (``harness:v3``, ``team/harness:v3``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
_DOMAIN_LABEL = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:\[[0-9a-fA-F:]+\]|{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})*)(?::[0-9]{{1,5}})?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"sha256:[0-9a-f]{64}"
# A plan ref must say which version it wants: a tag, a digest, or both (the digest wins).
REF_PATTERN = rf"^(?:{_DOMAIN}/)?{_REPO}(?::{_TAG}(?:@{_DIGEST})?|@{_DIGEST})$"
_REF = re.compile(
    rf"^(?:(?P<first>{_DOMAIN})/)?(?P<rest>{_REPO})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$"
)


@dataclass(frozen=True)
class Reference:
    """A parsed group reference. ``registry`` is ``None`` for the embedded local store."""

    registry: str | None
    repo: str
    tag: str | None
    digest: str | None

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repo}" if self.registry else self.repo
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_ref(ref: str) -> Reference:
    """Split a ref into registry, repo, tag and digest; ValueError if it is not a ref."""
    m = _REF.match(ref) if isinstance(ref, str) else None
    if m is None or not (m["tag"] or m["digest"]):
        raise ValueError(f"expected a reference like host/repo:tag, got {ref!r}")
    first, rest = m["first"], m["rest"]
    if first is not None and not ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        # A first component without '.' or ':' is part of the repository path (weenv.registry's rule).
        if not re.fullmatch(_PATH_COMPONENT, first):
            raise ValueError(f"expected a reference like host/repo:tag, got {ref!r}")
        rest, first = f"{first}/{rest}", None
    return Reference(registry=first, repo=rest, tag=m["tag"], digest=m["digest"])
