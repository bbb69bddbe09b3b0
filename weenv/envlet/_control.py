"""The envlet's control protocol: length-prefixed msgpack requests over a Unix socket.

Each request is one msgspec-tagged Struct; each answer a :class:`Reply`. The client is blocking
(one short-lived connection per call) so both the CLI and worker threads of the daemon can use it.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any, Literal

import msgspec

from ._errors import ControlError, EnvletUnavailableError, LayerNotFoundError

_LEN = struct.Struct(">I")
MAX_MESSAGE_BYTES = 16 << 20


class StoreSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where a layer's blob lives, in terms the envlet process can open itself."""

    kind: Literal["file", "layout", "registry"]
    path: str = ""  # file: the blob file; layout: the OCI image-layout root
    registry: str = ""  # registry: host[:port]
    insecure: bool = False  # registry: plain http


class Register(msgspec.Struct, tag="register", forbid_unknown_fields=True, omit_defaults=True):
    store: StoreSpec
    digest: str  # the layer blob's OCI digest
    size: int
    toc_digest: str  # pinned: the registration fails if the blob's TOC differs
    repo: str = ""
    prefetch: bool = True
    warm: bool = False  # fetch every chunk into the disk cache now (a freshly committed local layer)


class Unregister(msgspec.Struct, tag="unregister", forbid_unknown_fields=True):
    name: str


class ListLayers(msgspec.Struct, tag="list", forbid_unknown_fields=True):
    pass


class Stats(msgspec.Struct, tag="stats", forbid_unknown_fields=True):
    pass


class Prune(msgspec.Struct, tag="prune", forbid_unknown_fields=True):
    to_bytes: int


class Ping(msgspec.Struct, tag="ping", forbid_unknown_fields=True):
    pass


class Trace(msgspec.Struct, tag="trace", forbid_unknown_fields=True):
    """The files of a layer in the order they were first read: a prefetch list for the next build."""

    name: str
    clear: bool = False


class Extract(msgspec.Struct, tag="extract", forbid_unknown_fields=True):
    """Write a registered layer out as a plain directory ``dest`` (which must not exist)."""

    name: str
    dest: str


class SetPeers(msgspec.Struct, tag="set_peers", forbid_unknown_fields=True):
    """Replace the peer tier's table {peer address "HOST:PORT": layer digests it holds}.

    The node agent sends it after each report round, from the other nodes' reports (no discovery
    protocol of the envlet's own); this node's own address is ignored if listed.
    """

    peers: dict[str, list[str]]


class PeerServing(msgspec.Struct, tag="peer_serving", forbid_unknown_fields=True):
    """Serve chunks to peers or stop (a node being drained): answers in progress are cut."""

    enabled: bool


Request = Register | Unregister | ListLayers | Stats | Prune | Ping | Trace | Extract | SetPeers | PeerServing


class Reply(msgspec.Struct):
    ok: bool
    result: Any = None
    error: str = ""
    error_kind: str = ""  # "not_found" | "bad_request" | "failed"


class LayerInfo(msgspec.Struct):
    """A registered layer, as the control protocol reports it."""

    name: str  # directory name under the mountpoint
    path: str  # absolute path of that directory
    digest: str
    toc_digest: str
    size: int
    refcount: int
    entries: int
    prefetch_end: int


request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()


def frame(msg: msgspec.Struct) -> bytes:
    data = encoder.encode(msg)
    return _LEN.pack(len(data)) + data


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EnvletUnavailableError("envlet closed the control connection")
        buf += part
    return bytes(buf)


class EnvletClient:
    """Blocking client of one envlet's control socket."""

    def __init__(self, socket_path: str, timeout_s: float = 120.0):
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def _call(self, req: msgspec.Struct, timeout_s: float | None = None) -> Any:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s if timeout_s is None else timeout_s)
        try:
            try:
                s.connect(self.socket_path)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise EnvletUnavailableError(f"envlet is not running (control socket {self.socket_path}: {e.strerror})") from None
            s.sendall(frame(req))
            (n,) = _LEN.unpack(_recv_exact(s, 4))
            if n > MAX_MESSAGE_BYTES:
                raise ControlError(f"envlet reply of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
            reply = reply_decoder.decode(_recv_exact(s, n))
        except socket.timeout:
            raise EnvletUnavailableError(f"envlet did not answer within {s.gettimeout():g} s") from None
        except OSError as e:
            if isinstance(e, (EnvletUnavailableError, ControlError)):
                raise
            raise EnvletUnavailableError(f"envlet control socket {self.socket_path}: {e}") from None
        finally:
            s.close()
        if not reply.ok:
            cls = LayerNotFoundError if reply.error_kind == "not_found" else ControlError
            raise cls(reply.error)
        return reply.result

    def ping(self, timeout_s: float = 2.0) -> dict:
        return self._call(Ping(), timeout_s)

    def register(self, store: StoreSpec, digest: str, size: int, toc_digest: str, *, repo: str = "",
                 prefetch: bool = True, warm: bool = False) -> LayerInfo:
        return msgspec.convert(self._call(Register(store, digest, size, toc_digest, repo, prefetch, warm)), LayerInfo)

    def unregister(self, name: str) -> None:
        self._call(Unregister(name))

    def list(self) -> list[LayerInfo]:
        return msgspec.convert(self._call(ListLayers()), list[LayerInfo])

    def stats(self) -> dict:
        return self._call(Stats())

    def prune(self, to_bytes: int) -> dict:
        return self._call(Prune(to_bytes))

    def trace(self, name: str, *, clear: bool = False) -> list[str]:
        return self._call(Trace(name, clear))

    def extract(self, name: str, dest: str, *, timeout_s: float = 3600.0) -> dict:
        """Counts of what was made (dirs, files, links, symlinks, nodes, bytes)."""
        return self._call(Extract(name, dest), timeout_s)

    def set_peers(self, peers: dict[str, list[str]]) -> dict:
        """Set the peer table (see :class:`SetPeers`); answers {"peers": how many, "address": ours}."""
        return self._call(SetPeers({str(k): list(v) for k, v in peers.items()}))

    def set_peer_serving(self, enabled: bool) -> dict:
        """Start or stop serving chunks to peers (False: the node is being drained)."""
        return self._call(PeerServing(enabled))

    def wait_ready(self, timeout_s: float = 10.0, *, pid: int | None = None) -> None:
        """Block until the envlet answers a ping (or its process ``pid`` exits, or the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.005
        while True:
            try:
                self.ping(timeout_s=1.0)
                return
            except EnvletUnavailableError as e:
                if pid is not None and not _alive(pid):
                    raise EnvletUnavailableError(f"envlet process {pid} exited before it was ready") from None
                if time.monotonic() > deadline:
                    raise EnvletUnavailableError(f"envlet not ready after {timeout_s:g} s: {e}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
