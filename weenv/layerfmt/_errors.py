"""The one exception tree of :mod:`weenv.layerfmt`.

::

    LayerError                      anything this package raises on purpose
     ├── LayerFormatError           the blob is not a valid weenv layer
     │    ├── TruncatedLayerError   fewer bytes than the footer or TOC promise
     │    ├── UnsafePathError       traversal, absolute path, NUL byte, bad name
     │    └── LimitExceededError    a size or count above the reader's limits
     ├── IntegrityError             a sha256 did not match (TOC or chunk)
     ├── LayerInputError            a build input cannot be turned into a layer
     │    └── StreamOrderError      a tar stream cannot be written in its own order (build from a spool)
     └── EntryNotFoundError         a path that the layer does not contain

Every error carries ``offset`` (a byte offset in the blob) and/or ``path`` (an entry path) when
they are known, and names them in its message.
"""

from __future__ import annotations


class LayerError(Exception):
    """Base of every error raised by :mod:`weenv.layerfmt`."""

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None):
        where = []
        if path is not None:
            where.append(f"path {path!r}")
        if offset is not None:
            where.append(f"offset {offset}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path = path
        self.offset = offset


class LayerFormatError(LayerError):
    """Raised when a blob's footer, TOC or frames violate the format."""


class TruncatedLayerError(LayerFormatError):
    """Raised when the blob is shorter than its footer or TOC says, or a read comes back short."""


class UnsafePathError(LayerFormatError):
    """Raised for entry paths that are absolute, contain ``..``, NUL bytes or empty components."""


class LimitExceededError(LayerFormatError):
    """Raised when a size or count in the blob exceeds :class:`~weenv.layerfmt.Limits`."""


class IntegrityError(LayerError):
    """Raised when the TOC or a chunk does not match its sha256; the bytes are never returned."""


class LayerInputError(LayerError):
    """Raised when a build input (directory or tar stream) cannot be represented as a layer."""


class StreamOrderError(LayerInputError):
    """Raised while a tar stream is built in its own order when the stream needs a view of the whole
    archive that a single pass does not give: a path that comes twice, a hardlink to a later entry, the
    root after other entries, or a whiteout next to an entry of the same layer that it would change.
    What was written is unusable; the same stream can still be built with :func:`scan_tar` (spooled)."""


class EntryNotFoundError(LayerError, KeyError):
    """Raised when a path is looked up that the layer does not contain."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)
