"""The one exception tree of :mod:`weenv.registry`.

::

    RegistryError                    anything this package raises on purpose
     ├── RefError                    a REF string that cannot be parsed or used
     ├── NotFoundError               the repository, tag, manifest or blob does not exist
     ├── AuthError                   credentials missing or refused (401/403 after the challenge)
     ├── RegistryUnavailableError    the registry kept failing (5xx, 429, resets) past retries/deadline
     ├── ProtocolError               the registry answered against the protocol (Range ignored, broken 416,
     │    │                           missing headers, undecodable JSON)
     │    └── BlobRangeError         a read outside the blob's bytes was asked for
     ├── IntegrityError              a digest or size did not match (upload, download, manifest)
     ├── ArtifactError               a manifest is not a weenv group / usable image
     └── StoreError                  the local layout store cannot be read or written (disk, permissions)

Lower-level errors (httpx, requests/oras, OSError, JSON) are translated at the boundary by
:func:`mapped_errors`; a test checks that each of them comes out as a :class:`RegistryError`.
Every error names what failed and where (registry host, repository, digest or path).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager


class RegistryError(Exception):
    """Base of every error raised by :mod:`weenv.registry`."""


class RefError(RegistryError, ValueError):
    """Raised when a REF (``host:port/repo:tag``, ``repo@sha256:…``) is malformed or names nothing usable."""


class NotFoundError(RegistryError):
    """Raised when a repository, tag, manifest or blob does not exist (HTTP 404, missing file)."""


class AuthError(RegistryError):
    """Raised when the registry refuses us: no credentials for a challenge, or 401/403 after answering it."""


class RegistryUnavailableError(RegistryError):
    """Raised when retries or the overall deadline ran out on 5xx, 429, timeouts or connection errors."""


class ProtocolError(RegistryError):
    """Raised when the registry's answer breaks the protocol we rely on (e.g. a Range answered with 200)."""


class BlobRangeError(ProtocolError):
    """Raised when a read asks for bytes outside the blob."""


class IntegrityError(RegistryError):
    """Raised when bytes do not match their digest or size, on upload or download."""


class ArtifactError(RegistryError):
    """Raised when a manifest is not a weenv layer group (or an importable image)."""


class StoreError(RegistryError):
    """Raised when the local OCI layout store cannot be read or written."""


def _lower_error_types() -> tuple[type[BaseException], ...]:
    import httpx
    import requests

    return (httpx.HTTPError, httpx.InvalidURL, requests.RequestException, OSError, json.JSONDecodeError)


@contextmanager
def mapped_errors(where: str) -> Iterator[None]:
    """Translate errors from httpx, requests (oras), the OS and JSON into the tree above.

    ``where`` names the operation and target, e.g. ``"GET 127.0.0.1:5000/team/harness blob sha256:…"``.
    """
    import httpx
    import requests

    try:
        yield
    except RegistryError:
        raise
    except httpx.TimeoutException as e:
        raise RegistryUnavailableError(f"{where}: timed out ({type(e).__name__})") from e
    except (httpx.TransportError, requests.ConnectionError, requests.Timeout) as e:
        raise RegistryUnavailableError(f"{where}: connection failed: {e or type(e).__name__}") from e
    except httpx.HTTPStatusError as e:
        raise ProtocolError(f"{where}: unexpected HTTP {e.response.status_code}") from e
    except (httpx.HTTPError, httpx.InvalidURL, requests.RequestException) as e:
        raise ProtocolError(f"{where}: {type(e).__name__}: {e}") from e
    except json.JSONDecodeError as e:
        raise ProtocolError(f"{where}: invalid JSON: {e}") from e
    except FileNotFoundError as e:
        raise NotFoundError(f"{where}: {e.strerror}: {e.filename}") from e
    except OSError as e:
        raise StoreError(f"{where}: {e.strerror or e}" + (f": {e.filename}" if e.filename else "")) from e
