"""The daemon's HTTP side: the server (:mod:`._http`, h11 on trio over a Unix socket, a regex
router, bounded and streamed bodies) and the routes of the daemon's own API (:mod:`._routes`). The
E2B-compatible API is :mod:`weenv.api`, a server of its own beside this one.
"""

from ._http import HTTPError as HTTPError
from ._http import Request as Request
from ._http import Response as Response
from ._http import Router as Router
from ._http import Server as Server
from ._http import StreamResponse as StreamResponse
from ._routes import DaemonApi as DaemonApi

__all__ = ["DaemonApi", "HTTPError", "Request", "Response", "Router", "Server", "StreamResponse"]
