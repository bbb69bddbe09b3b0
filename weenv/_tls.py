"""One TLS context per process for weenv's HTTP clients.

httpx builds an SSL context for every client and transport it makes, loading certifi's CA bundle
each time: ~35-75 ms of CPU here, paid by every ``weenv.Client`` on the daemon's Unix socket (where
TLS is never used) and by every registry store, plain-HTTP ones included. The default
verification (certifi's CAs, no environment variables) is made once and shared.
"""

from __future__ import annotations

import functools
import ssl

import httpx

__all__ = ["default_tls_context", "uds_transport", "async_uds_transport"]


@functools.cache
def default_tls_context() -> ssl.SSLContext:
    """httpx's default verification, made once per process."""
    return httpx.create_ssl_context(trust_env=False)


def uds_transport(path: str) -> httpx.HTTPTransport:
    """A transport to the HTTP server on the Unix socket ``path`` (no TLS on it: nothing to load)."""
    return httpx.HTTPTransport(uds=path, verify=default_tls_context())


def async_uds_transport(path: str) -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(uds=path, verify=default_tls_context())
