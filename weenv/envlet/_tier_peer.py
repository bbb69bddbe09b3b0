"""The peer tier: chunks from other nodes' disk caches (L2) before the registry.

    memory ─► disk ─► peer ─► registry          envlet serve --tiers memory,disk,peer,registry

Who holds what comes from the cluster's node reports, not from a discovery protocol of our own: the
node agent sets the envlet's peer table (``EnvletClient.set_peers({address: [layer digests]})``)
after each report round. For a chunk of layer L the tier asks the peers that hold L, in the order
of a rendezvous hash of (L, the chunk's region of the blob) over those peers *and this node*, so
every node of the cluster asks the same node first for the same region: that node (the region's
owner) serves it from its disk cache or, when it does not hold it yet, fetches it once from the
registry for everyone (:mod:`._peer_server`). When this node is the first in that order, the
peers after it are only asked whether they hold the chunks (a node that read the layer before
does), and what none holds is fetched from the registry here: a cold rollout costs the registry
each byte about once, not once per node.

- Hedging: a peer that has not answered (any status, 1xx included) within ``peer.hedge_ms``
  (150 ms) is given up on, and so is one whose body stalls for ``peer.stall_ms``; at most
  ``peer.k`` peers (2) are asked for a chunk, then the next tier.
- Never trusted: the tier is ``verified = False``, so the fetcher checks every chunk it answers with
  :func:`weenv.layerfmt.verify_chunk`; a chunk that fails is :meth:`PeerTier.discard`-ed, which
  penalises the peer that sent it (backoff, counted as ``peer_corrupt``), and the chunk is fetched
  from the next tier. A peer that fails or times out is backed off too (0.5 s doubling to 30 s).
- Authenticated: every request carries ``Authorization: Bearer <cluster token>``.

Options (``--tier-option``): ``peer.token_file`` (or ``peer.token``), ``peer.listen`` (serve on
HOST:PORT), ``peer.advertise``, ``peer.k``, ``peer.hedge_ms``, ``peer.stall_ms``,
``peer.fetch_timeout_ms``, ``peer.region``, ``peer.serve_bandwidth``, ``peer.serve_concurrency``,
``peer.fetch_for_peers`` — see :class:`PeerOptions` and docs/cluster.md, "Peer chunk tier".
"""

from __future__ import annotations

import bisect
import contextvars
import hashlib
import logging
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h11

from ..layerfmt import Chunk, LayerError
from ._metrics import LATENCY_BUCKETS_S, Metrics
from ._tier import ChunkTier, TierConfig, TierConfigError

if TYPE_CHECKING:
    from ._fetch import LayerSource

log = logging.getLogger("weenv.envlet")

# One requested item: chunk sha256, blob offset and compressed length (for a fetch on our behalf),
# decompressed length, and the range wanted within the decompressed bytes (length 0: to the end).
ITEM = struct.Struct(">32sQQQQQ")
ITEM_HEAD = struct.Struct(">q")  # each answered item: its byte count, or -1 (not held); then the bytes
MAX_ITEMS = 4096
PATH = "/v1/chunks"
# Peers not to ask, set by the peer server around a fetch it makes for a peer: the peer that asked
# holds none of those chunks (it would not have asked), so asking it back is a wasted round trip on
# the path everyone waiting for the region is on. Worker threads of trio.to_thread see the value.
NOT_ASKING: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("weenv_peer_not_asking",
                                                                          default=frozenset())
_SIZE_UNITS = {"": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
               "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_address(value: str, where: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise TierConfigError(f"{where} {value!r}: give HOST:PORT (e.g. 10.0.0.2:7070)")
    return host, int(port)


def _size(value: str, where: str) -> int:
    v = value.strip().lower().removesuffix("/s")
    num = v.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = v[len(num):]
    try:
        n = float(num)
    except ValueError:
        n = -1
    if unit not in _SIZE_UNITS or n < 0:
        raise TierConfigError(f"{where} {value!r}: give a size such as 50MiB (per second for a bandwidth)")
    return int(n * _SIZE_UNITS[unit])


@dataclass
class PeerOptions:
    """The ``peer.*`` tier options, checked (a bad one names itself)."""

    token: str = ""
    listen: tuple[str, int] | None = None  # serve chunks here; None: this node does not serve
    advertise: str = ""  # the address peers know this node by (default: the bound listen address)
    k: int = 2  # peers asked for one chunk at most
    hedge_s: float = 0.150  # no answer from a peer within this: the next peer, then the next tier
    stall_s: float = 2.0  # a body that stalls this long: given up
    fetch_timeout_s: float = 10.0  # a whole answer (the peer may fetch the region for us first)
    region_bytes: int = 4 << 20  # rendezvous granularity: a region of the blob has one owner
    serve_bandwidth: int = 100 << 20  # bytes/s served to peers at most (0: unbounded)
    serve_concurrency: int = 8  # answers being sent at once at most (1 while our own reads wait)
    fetch_for_peers: bool = True  # fetch a region we own but do not hold for a peer that asks

    @classmethod
    def from_options(cls, options: dict[str, str]) -> "PeerOptions":
        o = cls()
        known = {"peer.token", "peer.token_file", "peer.listen", "peer.advertise", "peer.k", "peer.hedge_ms",
                 "peer.stall_ms", "peer.fetch_timeout_ms", "peer.region", "peer.serve_bandwidth",
                 "peer.serve_concurrency", "peer.fetch_for_peers"}
        for key in options:
            if key.startswith("peer.") and key not in known:
                raise TierConfigError(f"--tier-option {key}: no such peer option (known: {', '.join(sorted(known))})")
        if "peer.token_file" in options:
            path = options["peer.token_file"]
            try:
                with open(path, encoding="utf-8") as f:
                    o.token = f.read().strip()
            except OSError as e:
                raise TierConfigError(f"--tier-option peer.token_file={path}: {e.strerror}") from None
        elif "peer.token" in options:
            o.token = options["peer.token"].strip()
        if not o.token:
            raise TierConfigError("peer tier: the cluster token is missing or empty: give --tier-option "
                                  "peer.token_file=PATH (or peer.token=SECRET)")

        def num(key: str, lo: float, hi: float, conv=int) -> float | None:
            if key not in options:
                return None
            try:
                v = conv(options[key])
            except ValueError:
                v = None
            if v is None or not lo <= v <= hi:
                raise TierConfigError(f"--tier-option {key}={options[key]}: give a number from {lo:g} to {hi:g}")
            return v

        if "peer.listen" in options:
            o.listen = parse_address(options["peer.listen"], "--tier-option peer.listen")
        if "peer.advertise" in options:
            parse_address(options["peer.advertise"], "--tier-option peer.advertise")
            o.advertise = options["peer.advertise"]
        o.k = int(num("peer.k", 1, 64) or o.k)
        for key, attr in (("peer.hedge_ms", "hedge_s"), ("peer.stall_ms", "stall_s"),
                          ("peer.fetch_timeout_ms", "fetch_timeout_s")):
            v = num(key, 1, 600_000, float)
            if v is not None:
                setattr(o, attr, v / 1000)
        if "peer.region" in options:
            o.region_bytes = _size(options["peer.region"], "--tier-option peer.region")
            if o.region_bytes < 4096:
                raise TierConfigError(f"--tier-option peer.region={options['peer.region']}: at least 4KiB")
        if "peer.serve_bandwidth" in options:
            o.serve_bandwidth = _size(options["peer.serve_bandwidth"], "--tier-option peer.serve_bandwidth")
        o.serve_concurrency = int(num("peer.serve_concurrency", 1, 1024) or o.serve_concurrency)
        if "peer.fetch_for_peers" in options:
            v = options["peer.fetch_for_peers"].strip().lower()
            if v not in ("true", "false", "1", "0", "yes", "no"):
                raise TierConfigError(f"--tier-option peer.fetch_for_peers={v}: give true or false")
            o.fetch_for_peers = v in ("true", "1", "yes")
        return o


@dataclass
class PeerState:
    """What this node knows of one peer: its layers, how it answered, and its backoff."""

    layers: frozenset[str] = frozenset()
    requests: int = 0
    chunks: int = 0
    bytes: int = 0
    misses: int = 0  # chunks asked that it did not hold
    errors: int = 0  # requests that failed (refused, reset, bad answer)
    timeouts: int = 0
    corrupt: int = 0  # chunks whose bytes failed verification
    fails: int = 0  # consecutive failures (the backoff doubles)
    backoff_until: float = 0.0  # monotonic
    latency_s_sum: float = 0.0

    def snapshot(self, now: float) -> dict:
        return {"layers": len(self.layers), "requests": self.requests, "chunks": self.chunks, "bytes": self.bytes,
                "misses": self.misses, "errors": self.errors, "timeouts": self.timeouts, "corrupt": self.corrupt,
                "backoff_s": round(max(0.0, self.backoff_until - now), 3),
                "mean_latency_ms": round(1000 * self.latency_s_sum / self.requests, 2) if self.requests else 0.0}


class PeerError(Exception):
    """A peer's answer cannot be used (refused, malformed, cut short)."""


class PeerTimeout(PeerError):
    pass


class _Stale(Exception):
    """A kept-alive connection the peer had closed before we used it (not the peer's fault)."""


@dataclass
class _Conn:
    sock: socket.socket
    reused: bool = False  # from the idle pool: the peer may have closed it meanwhile
    answered: bool = False  # the peer began an answer on it
    complete: bool = False  # the last answer was read to its end (nothing of it left on the socket)


def _hrw(key: bytes, node: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + node.encode(), digest_size=8).digest()


class PeerTier(ChunkTier):
    name = "peer"
    blocking = True
    verified = False  # the fetcher verifies every chunk a peer sends (and tells us of a bad one)
    peer_serving_yields = False  # reads waiting on peers: a rollout, where our serving is what others wait on

    def __init__(self, metrics: Metrics, options: PeerOptions):
        self.metrics = metrics
        self.options = options
        self.self_address = ""  # set by the envlet once its peer server is bound
        self.peers: dict[str, PeerState] = {}
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Conn]] = {}
        self._served: OrderedDict[bytes, str] = OrderedDict()  # chunk digest -> the peer that sent it
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="peer-tier")
        self.latency_buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.latency_sum_s = 0.0

    # ------------------------------------------------------------------ the peer table

    def set_peers(self, table: dict[str, Sequence[str]]) -> int:
        """Replace the table {peer address: layer digests it holds}; this node's own address is left out."""
        for addr, layers in table.items():
            parse_address(addr, "peer table address")
            for d in layers:
                if not isinstance(d, str) or not d.startswith("sha256:") or len(d) != 71:
                    raise ValueError(f"peer table: {addr}: {d!r} is not a layer digest (sha256:<64 hex>)")
        with self._lock:
            old = self.peers
            self.peers = {}
            for addr, layers in table.items():
                if addr == self.self_address:
                    continue
                st = old.get(addr) or PeerState()
                st.layers = frozenset(layers)
                self.peers[addr] = st
            for addr in set(old) - set(self.peers):
                for c in self._idle.pop(addr, []):
                    c.sock.close()
        return len(self.peers)

    def stats(self) -> dict:
        now = time.monotonic()
        with self._lock:
            peers = {a: st.snapshot(now) for a, st in self.peers.items()}
        return {"address": self.self_address, "k": self.options.k, "hedge_ms": self.options.hedge_s * 1000,
                "peers": peers, "latency": {"buckets_s": list(LATENCY_BUCKETS_S), "counts": list(self.latency_buckets),
                                            "sum_s": self.latency_sum_s}}

    def _penalise(self, addr: str, *, timeout: bool = False, corrupt: bool = False) -> None:
        with self._lock:
            st = self.peers.get(addr)
            if st is None:
                return
            st.fails += 1
            if corrupt:
                st.corrupt += 1
                wait = min(600.0, 60.0 * st.corrupt)
            else:
                wait = min(30.0, 0.5 * 2 ** (st.fails - 1))
                if timeout:
                    st.timeouts += 1
                else:
                    st.errors += 1
            st.backoff_until = time.monotonic() + wait
            for c in self._idle.pop(addr, []):
                c.sock.close()
        self.metrics.inc("peer_corrupt" if corrupt else "peer_timeouts" if timeout else "peer_errors")
        log.warning("peer %s penalised (%s): backed off for %.1f s", addr,
                    "wrong bytes" if corrupt else "timeout" if timeout else "error", wait)

    # ------------------------------------------------------------------ the tier

    def has(self, chunk: Chunk) -> bool | None:
        return None if self.peers else False  # who holds a chunk is only known by asking

    def order(self, layer: str, chunk: Chunk) -> list[tuple[str, bool]]:
        """Peers to ask for ``chunk`` of ``layer``, best first, each with whether it may fetch it for us.

        Peers the rendezvous order puts before this node own the region: they may fetch it (once,
        for everyone). When this node comes first it owns the region: the peers after it are only
        asked whether they hold it (a node that read the layer earlier does), then the next tier.
        """
        now = time.monotonic()
        skip = NOT_ASKING.get()
        with self._lock:
            holders = [a for a, st in self.peers.items()
                       if layer in st.layers and st.backoff_until <= now and a not in skip]
        if not holders:
            return []
        key = layer.encode() + struct.pack(">Q", chunk.offset // self.options.region_bytes)
        nodes = holders + ([self.self_address] if self.self_address else [])
        nodes.sort(key=lambda n: _hrw(key, n), reverse=True)
        out = []
        owner = True
        for n in nodes:
            if n == self.self_address:
                owner = False  # past us: we fetch this region from the next tier if nobody holds it
                continue
            out.append((n, owner and self.options.fetch_for_peers))
        return out[: self.options.k]

    def split(self, src: "LayerSource", chunks: Sequence[Chunk]) -> list[list[Chunk]]:
        """One group per list of peers to ask: the fetcher resolves each group's claims on its own, so a
        region this node fetches itself (it owns it) never waits on a region it asked an owner for."""
        layer = getattr(src, "digest", "") or ""
        if not layer or not self.peers:
            return [list(chunks)]
        groups: dict[tuple[tuple[str, bool], ...], list[Chunk]] = {}
        for c in chunks:
            groups.setdefault(tuple(self.order(layer, c)), []).append(c)
        return list(groups.values())

    def get(self, src: "LayerSource", chunks: Sequence[Chunk]) -> list[bytes | LayerError | None]:
        out: list[bytes | LayerError | None] = [None] * len(chunks)
        layer = getattr(src, "digest", "") or ""
        if not layer or not self.peers:
            return out
        groups: dict[tuple[tuple[str, bool], ...], list[int]] = {}
        for i, c in enumerate(chunks):
            order = tuple(self.order(layer, c))
            if order:
                groups.setdefault(order, []).append(i)
        if not groups:
            return out
        jobs = [(order, idx) for order, idx in groups.items()]
        if len(jobs) == 1:
            self._fetch_group(layer, jobs[0][0], [chunks[i] for i in jobs[0][1]], jobs[0][1], out)
        else:
            futures = [self._pool.submit(self._fetch_group, layer, order, [chunks[i] for i in idx], idx, out)
                       for order, idx in jobs]
            for fut in futures:
                fut.result()
        return out

    def _fetch_group(self, layer: str, order: tuple[tuple[str, bool], ...], chunks: list[Chunk], idx: list[int],
                     out: list) -> None:
        todo = list(range(len(chunks)))
        for addr, fetch in order:
            if not todo:
                return
            want = [chunks[j] for j in todo]
            t0 = time.monotonic()
            try:
                answers = self._request(addr, layer, want, fetch=fetch)
            except PeerTimeout as e:
                log.info("peer %s: %s", addr, e)
                self._penalise(addr, timeout=True)
                continue
            except (PeerError, OSError, h11.ProtocolError) as e:
                log.info("peer %s: %s", addr, e)
                self._penalise(addr)
                continue
            dt = time.monotonic() - t0
            got = [(j, a) for j, a in zip(todo, answers) if a is not None]
            nbytes = sum(len(a) for _, a in got)
            with self._lock:
                st = self.peers.get(addr)
                if st is not None:
                    st.requests += 1
                    st.chunks += len(got)
                    st.bytes += nbytes
                    st.misses += len(todo) - len(got)
                    st.latency_s_sum += dt
                    st.fails = 0
                self.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, dt)] += 1
                self.latency_sum_s += dt
                for j, a in got:
                    self._served[chunks[j].digest] = addr
                while len(self._served) > 100_000:
                    self._served.popitem(last=False)
            m = self.metrics
            m.inc("peer_requests")
            m.observe_peer(dt)
            if got:
                m.inc("peer_chunks", len(got))
                m.inc("peer_bytes", nbytes)
            if len(got) != len(todo):
                m.inc("peer_misses", len(todo) - len(got))
            for j, a in got:
                out[idx[j]] = a
            todo = [j for j, a in zip(todo, answers) if a is None]

    def put(self, items: Sequence[tuple[Chunk, bytes]]) -> None:
        return None  # the peers' caches are theirs; ours is the disk tier before this one

    def discard(self, chunk: Chunk) -> None:
        with self._lock:
            addr = self._served.pop(chunk.digest, None)
        if addr is not None:
            self._penalise(addr, corrupt=True)

    # ------------------------------------------------------------------ the wire

    def _connect(self, addr: str, timeout_s: float) -> _Conn:
        with self._lock:
            idle = self._idle.get(addr)
            if idle:
                conn = idle.pop()
                conn.reused = True
                return conn
        host, port = parse_address(addr, "peer")
        try:
            sock = socket.create_connection((host, port), timeout=max(0.001, timeout_s))
        except socket.timeout:
            raise PeerTimeout(f"no connection within {self.options.hedge_s * 1000:.0f} ms") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(sock)

    def _request(self, addr: str, layer: str, chunks: list[Chunk], *, fetch: bool = False) -> list[bytes | None]:
        """One POST /v1/chunks to ``addr``: each chunk's bytes or None (not held). Raises PeerError."""
        start = time.monotonic()
        conn = self._connect(addr, self.options.hedge_s)
        if conn.reused:
            try:
                return self._request_on(conn, addr, layer, chunks, fetch, start)
            except _Stale:  # the peer closed the idle connection: once more on a new one
                conn = self._connect(addr, max(0.001, start + self.options.hedge_s - time.monotonic()))
        return self._request_on(conn, addr, layer, chunks, fetch, start)

    def _request_on(self, conn: _Conn, addr: str, layer: str, chunks: list[Chunk], fetch: bool,
                    start: float) -> list[bytes | None]:
        o = self.options
        hedge_end = start + o.hedge_s
        ok = False
        try:
            body = b"".join(ITEM.pack(c.digest, c.offset, c.length, c.ulength, 0, 0) for c in chunks)
            h = h11.Connection(h11.CLIENT)
            head = h.send(h11.Request(method="POST", target=PATH, headers=[
                ("Host", addr), ("Authorization", f"Bearer {o.token}"), ("Content-Length", str(len(body))),
                ("X-Weenv-Layer", layer), ("X-Weenv-Fetch", "1" if fetch else "0"),
                *([("X-Weenv-From", self.self_address)] if self.self_address else [])]))
            conn.sock.settimeout(max(0.001, hedge_end - time.monotonic()))
            conn.sock.sendall(head + h.send(h11.Data(data=body)) + h.send(h11.EndOfMessage()))
            status, data = self._response(conn, h, hedge_end, start + o.fetch_timeout_s)
            if status in (401, 403):
                raise PeerError(f"refused our cluster token ({status})")
            if status != 200:
                raise PeerError(f"answered {status}: {bytes(data[:200]).decode(errors='replace')}")
            out: list[bytes | None] = []
            pos = 0
            for c in chunks:
                if pos + ITEM_HEAD.size > len(data):
                    raise PeerError("answer cut short")
                (n,) = ITEM_HEAD.unpack_from(data, pos)
                pos += ITEM_HEAD.size
                if n < 0:
                    out.append(None)
                    continue
                if n > c.ulength or pos + n > len(data):
                    raise PeerError(f"answer item of {n} bytes for a chunk of {c.ulength}")
                out.append(bytes(data[pos : pos + n]))
                pos += n
            if pos != len(data):
                raise PeerError(f"{len(data) - pos} bytes after the last item")
            ok = conn.complete or (h.our_state is h11.DONE and h.their_state is h11.DONE)
            conn.complete = False
            return out
        except (_Stale, ConnectionError) as e:
            if conn.reused and (isinstance(e, _Stale) or not conn.answered):
                raise _Stale() from None
            raise PeerError(str(e) or "closed the connection mid-answer") from None
        except socket.timeout:
            raise PeerTimeout("no answer within the hedge deadline" if time.monotonic() < hedge_end + o.stall_s
                              else f"answer stalled for {o.stall_s:g} s") from None
        finally:
            if ok:
                with self._lock:
                    if addr in self.peers:
                        self._idle.setdefault(addr, []).append(conn)
                        conn = None  # type: ignore[assignment]
            if conn is not None:
                conn.sock.close()

    def _response(self, conn: _Conn, h: h11.Connection, hedge_end: float, end: float) -> tuple[int, memoryview]:
        """The answer's status and body. h11 parses the head; a 200's body (its Content-Length known)
        is read straight into one buffer (``recv_into``): each byte is copied once more, into the chunk."""
        status = 0
        answered = False
        data = bytearray()
        while True:
            ev = h.next_event()
            if ev is h11.NEED_DATA:
                h.receive_data(self._recv(conn, answered, hedge_end, end, 1 << 16))
                continue
            if isinstance(ev, h11.InformationalResponse):
                answered = conn.answered = True  # 102: the peer is fetching the region for us
            elif isinstance(ev, h11.Response):
                answered = conn.answered = True
                status = ev.status_code
                length = next((int(v) for k, v in ev.headers if k == b"content-length"), -1)
                if status == 200 and length >= 0:
                    return status, self._body(conn, h, length, end)
            elif isinstance(ev, h11.Data):
                data += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                return status, memoryview(data)
            elif isinstance(ev, h11.ConnectionClosed):
                raise PeerError("closed the connection mid-answer")

    def _body(self, conn: _Conn, h: h11.Connection, length: int, end: float) -> memoryview:
        buf = memoryview(bytearray(length))
        got = 0
        while got < length:  # what h11 read along with the head
            ev = h.next_event()
            if not isinstance(ev, h11.Data):
                break
            buf[got : got + len(ev.data)] = ev.data
            got += len(ev.data)
        while got < length:
            now = time.monotonic()
            if now > end:
                raise PeerTimeout(f"no whole answer within {self.options.fetch_timeout_s:g} s")
            conn.sock.settimeout(max(0.001, min(self.options.stall_s, end - now)))
            n = conn.sock.recv_into(buf[got:])
            if not n:
                raise PeerError("closed the connection mid-answer")
            got += n
        conn.complete = True  # the answer ended where its length said: the connection can be reused
        return buf

    def _recv(self, conn: _Conn, answered: bool, hedge_end: float, end: float, size: int) -> bytes:
        now = time.monotonic()
        if now > end:
            raise PeerTimeout(f"no whole answer within {self.options.fetch_timeout_s:g} s")
        limit = (hedge_end - now) if not answered else self.options.stall_s
        conn.sock.settimeout(max(0.001, min(limit, end - now)))
        part = conn.sock.recv(size)
        if not part:
            raise _Stale() if conn.reused and not answered else PeerError("closed the connection mid-answer")
        return part


def make_tier(config: TierConfig) -> PeerTier:
    return PeerTier(config.metrics, PeerOptions.from_options(config.options))
