"""``weenv serve``: weenv's HTTP API on TCP, with API keys, and E2B's API (control plane and envd).

    app = create_app(NodeBackend())           # fronts the node's daemon through its Unix socket
    trio.run(serve, app, "127.0.0.1:3000")    # hypercorn, trio worker

See docs/e2b.md. Everything here is private modules re-exported below.
"""

from __future__ import annotations

from ._app import Gate as Gate
from ._app import create_app as create_app
from ._app import serve as serve
from ._backend import Backend as Backend
from ._backend import NodeBackend as NodeBackend
from ._e2b_requests import ImageRouting as ImageRouting
from ._store import AccessTokens as AccessTokens
from ._store import ApiKey as ApiKey
from ._store import KeyStore as KeyStore
from ._store import OwnerTable as OwnerTable
from ._store import StoreError as StoreError
from ._store import TemplateStore as TemplateStore

__all__ = ["AccessTokens", "ApiKey", "Backend", "Gate", "ImageRouting", "KeyStore", "NodeBackend", "OwnerTable", "StoreError",
           "TemplateStore", "create_app", "serve"]
