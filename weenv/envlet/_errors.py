"""The one exception tree of :mod:`weenv.envlet`.

::

    EnvletError                  anything this package raises on purpose
     ├── EnvletUnavailableError  the envlet process is not running or its socket does not answer
     ├── ControlError            the envlet refused a control request (message says why)
     │    └── LayerNotFoundError a layer name that is not registered
     ├── FetchError              a chunk could not be fetched from the store within the deadline
     └── ChunkIntegrityError     fetched or cached bytes failed verification (never served)

Inside the FUSE handlers every error becomes an errno in exactly one place (``_fs._errno``).
"""

from __future__ import annotations


class EnvletError(Exception):
    """Base of every error raised by :mod:`weenv.envlet`."""


class EnvletUnavailableError(EnvletError):
    """Raised by the control client when the envlet socket is missing or does not answer."""


class ControlError(EnvletError):
    """Raised by the control client when the envlet answers a request with an error."""


class LayerNotFoundError(ControlError):
    """Raised when a request names a layer that is not registered."""


class FetchError(EnvletError):
    """Raised when chunk bytes could not be fetched from the store (after retries, within the deadline)."""


class ChunkIntegrityError(EnvletError):
    """Raised when chunk bytes fail their sha256 or decompression check."""
