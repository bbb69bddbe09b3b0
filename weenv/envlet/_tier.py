"""The chunk-tier seam: every place chunk bytes can come from, in the order the fetcher asks them.

    memory ─► disk ─► (peer) ─► registry          envlet serve --tiers memory,disk,registry

A tier is content-addressed by the chunk's sha256 (:class:`weenv.layerfmt.Chunk`); a tier that reads
a blob (the registry) also gets the :class:`LayerSource` that says which blob. The fetcher
(:mod:`._fetch`) owns everything around the tiers — single flight per chunk, deadlines, read-ahead,
prefetch that yields, fail-fast — and:

- never serves a byte that :func:`weenv.layerfmt.verify_chunk` (sha256) did not pass: a tier whose
  bytes come from elsewhere either verifies them itself before answering (``verified = True``: the
  disk tier checks every record it reads and forgets a bad one; the registry tier every chunk it
  decompresses; the memory tier holds only verified bytes) or the fetcher verifies what it answers,
  in the same worker thread (``verified = False``: the fake, a new tier by default). A chunk that
  fails — a :class:`~weenv.layerfmt.LayerError` from the tier or bytes that do not hash — is counted
  (``verify_failures``, the tier's ``rejected``), the tier is told (:meth:`ChunkTier.discard`) and
  the next tier is asked;
- writes a chunk found in tier *k* back into tiers ``0..k-1`` (:meth:`ChunkTier.put`);
- treats a tier that raises as a miss for those chunks (counted as the tier's ``errors``), except
  the last tier, whose error is the read's error.

A new tier (a peer node) is one new file, ``weenv/envlet/_tier_<name>.py``, with a
``make_tier(config: TierConfig) -> ChunkTier`` function; ``--tiers memory,disk,<name>,registry``
puts it in line. :class:`weenv.testing.FakeChunkTier` is the fake, tests/test_chunk_tiers.py the
conformance suite every tier passes.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..layerfmt import Chunk, LayerError
from ._metrics import Metrics

if TYPE_CHECKING:
    from ._fetch import LayerSource

DEFAULT_TIERS = ("memory", "disk", "registry")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


class ChunkTier(abc.ABC):
    """One source of chunk bytes: look up (:meth:`has`), read (:meth:`get`), store (:meth:`put`).

    Class attributes say how the fetcher drives it:

    - ``blocking``: :meth:`get` and :meth:`put` do I/O, so the fetcher calls them in worker threads
      (False: called on the trio loop, must be quick — the memory tier);
    - ``verified``: :meth:`get` answers only bytes it checked with :func:`weenv.layerfmt.verify_chunk`
      (or bytes this process verified before), so the fetcher does not hash them again;
    - ``max_concurrency``: calls of :meth:`get` in flight at once (None: no bound);
    - ``merge_gap_bytes``/``max_run_bytes``: when set, the fetcher hands :meth:`get` runs of chunks
      that are adjacent in the blob (gaps up to ``merge_gap_bytes``, at most ``max_run_bytes`` a
      run), so a range-reading tier makes one request per run; when None, all chunks in one call.
    """

    name: str = ""
    blocking: bool = True
    verified: bool = False
    max_concurrency: int | None = None
    merge_gap_bytes: int | None = None
    max_run_bytes: int | None = None
    # while this node's own reads wait on this tier, serving chunks to peers yields (the peer tier:
    # False — those reads wait on other nodes' serving, which yielding here would only slow down)
    peer_serving_yields: bool = True

    @abc.abstractmethod
    def has(self, chunk: Chunk) -> bool | None:
        """Whether the tier holds ``chunk``, answered without I/O; None when it cannot tell so cheaply.

        The fetcher skips a tier whose answer is False, and does not fetch ahead what a tier holds.
        """

    @abc.abstractmethod
    def get(self, src: "LayerSource", chunks: Sequence[Chunk]) -> list[bytes | LayerError | None]:
        """For each chunk (in order): its decompressed bytes, None when the tier does not hold it, or a
        :class:`weenv.layerfmt.LayerError` when what it holds cannot be the chunk (e.g. a frame that
        does not decompress). Raises when the tier cannot answer at all (store unreachable).
        """

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[Chunk, bytes]]) -> None:
        """Keep verified chunks (a tier may keep none of them, e.g. the read-only registry)."""

    def discard(self, chunk: Chunk) -> None:  # noqa: B027 - optional: tiers that hold nothing need not
        """The bytes :meth:`get` gave for ``chunk`` failed verification: forget them."""

    def split(self, src: "LayerSource", chunks: Sequence[Chunk]) -> Sequence[Sequence[Chunk]]:
        """Groups of ``chunks`` the fetcher asks (and then the next tiers) independently of each other:
        a group's claims resolve as soon as its own answers are in (default: one group). The peer tier
        groups by the peers it asks, so a slow owner of one region never delays another region.
        """
        return [chunks]


@dataclass
class TierConfig:
    """What a tier factory may use; tier-specific settings go in ``options`` (``--tier-option k=v``)."""

    metrics: Metrics
    cache_dir: str = ""
    cache_size_bytes: int = 10 << 30
    memory_cache_size_bytes: int = 256 << 20
    max_concurrent_fetches: int = 8
    merge_gap_bytes: int = 16 << 10
    max_run_bytes: int = 8 << 20
    options: dict[str, str] = field(default_factory=dict)


class TierConfigError(ValueError):
    """The configured tier list names a tier that does not exist, repeats one or is empty."""


def parse_tiers(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``"memory,disk,registry"`` (or a sequence) → names, checked for form and repeats."""
    names = tuple(n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec))
    if not names or not all(names):
        raise TierConfigError(f"envlet tiers {spec!r}: give one or more tier names separated by commas "
                              f"(default {','.join(DEFAULT_TIERS)})")
    for i, n in enumerate(names):
        if not _NAME.fullmatch(n):
            raise TierConfigError(f"envlet tiers[{i}] {n!r}: a tier name is lower-case letters, digits and _")
        if n in names[:i]:
            raise TierConfigError(f"envlet tiers[{i}] {n!r}: named twice")
        if importlib.util.find_spec(f"{__package__}._tier_{n}") is None:
            raise TierConfigError(f"envlet tiers[{i}] {n!r}: no such tier (no module weenv/envlet/_tier_{n}.py); "
                                  f"known: {', '.join(DEFAULT_TIERS)}")
    return names


def load_tiers(spec: str | Sequence[str], config: TierConfig) -> list[ChunkTier]:
    """Build the tiers named in ``spec`` from their modules ``weenv.envlet._tier_<name>``, in order."""
    out = []
    for i, name in enumerate(parse_tiers(spec)):
        module = importlib.import_module(f"{__package__}._tier_{name}")
        tier = module.make_tier(config)
        if not isinstance(tier, ChunkTier):
            raise TierConfigError(f"envlet tiers[{i}] {name!r}: make_tier returned {type(tier).__name__}, "
                                  "not a ChunkTier")
        out.append(tier)
    return out
