"""Serving this node's chunks to peer nodes (the other side of :mod:`._tier_peer`).

    POST /v1/chunks   Authorization: Bearer <cluster token>   X-Weenv-Layer: sha256:…   X-Weenv-Fetch: 1
                      X-Weenv-From: <the asker's peer address>
    body: N × (chunk sha256, blob offset, compressed length, length, range start, range length)
    → 200, body: N × (int64 byte count or -1 when not held, the bytes)

HTTP/1.1 (requests parsed by h11, keep-alive), on the trio loop of the envlet, on the address the
operator gives (``--tier-option peer.listen=HOST:PORT``; tests use 127.0.0.1 and port 0).

- Zero-copy: a chunk in the disk cache is sent with ``os.sendfile`` from its pack file's descriptor
  at the record's offset (the pack index locates it), in a worker thread, 256 KiB at a time; a chunk
  only in memory is sent from memory. Bytes are not verified here: the receiver verifies every chunk.
- A region this node owns (the rendezvous order puts it first) but does not hold yet is fetched
  for the asking peer through this node's own fetcher (single flight with its own reads: the
  registry sees the bytes once) when the request asks for it (``X-Weenv-Fetch: 1``) and the layer
  is registered here; the peer gets ``102 Processing`` at once, so its hedge deadline is met.
- Authenticated: the bearer token is compared in constant time (:func:`hmac.compare_digest`); a
  request without the right one gets 401 (counted as ``peer_refused``).
- Bounded: at most ``peer.serve_bandwidth`` bytes/s (one token bucket over all peers) and
  ``peer.serve_concurrency`` answers at once. This node's own reads go first: while one waits on its
  disk or the registry (:attr:`Fetcher.serving_yields`) each piece for a peer waits for them up to
  ``YIELD_S`` (20 ms), and pieces go one at a time. Reads waiting on peers and fetches made for a
  peer do not count: in a rollout every node's reads wait on the others' serving. A drained node
  (``EnvletClient.set_peer_serving(False)``) answers 503 and cuts answers in progress.
- No wait cycles: an owner fetching a region for a peer never asks that peer back (``X-Weenv-From``);
  a fetch=1 request only ever goes to a node ranked higher for the region, and the fetcher resolves
  each region's claims on their own (:meth:`ChunkTier.split`), so two nodes cannot each hold the
  claim the other's request waits for.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import h11
import trio

from ..layerfmt import Chunk
from ._errors import ChunkIntegrityError, FetchError
from ._tier_peer import ITEM, ITEM_HEAD, MAX_ITEMS, NOT_ASKING, PATH, PeerOptions

if TYPE_CHECKING:
    from ._server import Envlet

log = logging.getLogger("weenv.envlet")
PIECE = 256 << 10
MAX_CONNECTIONS = 256
IDLE_S = 120.0
REQUEST_S = 10.0
# While this node's own reads wait for chunks, each piece for a peer first waits for them to finish,
# this long at most: the node's reads go first, and a peer still gets a piece every YIELD_S (its
# stall deadline, peer.stall_ms, is far longer).
YIELD_S = 0.02


class TokenBucket:
    """``rate`` bytes/s with a burst of ``burst`` bytes, for tasks of one trio loop (0: unbounded)."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.last = time.monotonic()

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        n = min(n, self.burst)
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= n:
                self.tokens -= n
                return
            await trio.sleep((n - self.tokens) / self.rate)

    def give_back(self, n: int) -> None:
        if self.rate:
            self.tokens = min(self.burst, self.tokens + n)


class _Drained(Exception):
    pass


class _BadRequest(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status


def _head(status: int, reason: str, length: int, extra: str = "") -> bytes:
    return f"HTTP/1.1 {status} {reason}\r\nContent-Length: {length}\r\n{extra}\r\n".encode()


class PeerServer:
    def __init__(self, envlet: "Envlet", options: PeerOptions):
        if options.listen is None:
            raise ValueError("the peer server needs peer.listen=HOST:PORT")
        self.envlet = envlet
        self.options = options
        self.metrics = envlet.metrics
        self.serving = True
        self.address = ""
        self.active = 0
        self.connections = 0
        self._expected = f"Bearer {options.token}".encode()
        self._slots = trio.CapacityLimiter(options.serve_concurrency)
        self._lowprio = trio.Lock()
        self._bucket = TokenBucket(options.serve_bandwidth, PIECE)

    def stats(self) -> dict[str, Any]:
        return {"address": self.address, "serving": self.serving, "active": self.active,
                "connections": self.connections, "bandwidth_bytes_s": self.options.serve_bandwidth,
                "concurrency": self.options.serve_concurrency}

    async def serve(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        host, port = self.options.listen  # type: ignore[misc]
        listeners = await trio.open_tcp_listeners(port, host=host)
        sock = listeners[0].socket
        bound = sock.getsockname()
        self.address = self.options.advertise or f"{bound[0]}:{bound[1]}"
        log.info("serving chunks to peers on %s:%d (as %s)", bound[0], bound[1], self.address)
        task_status.started(self.address)
        await trio.serve_listeners(self._connection, listeners)

    # ------------------------------------------------------------------ one connection

    async def _connection(self, stream: trio.SocketStream) -> None:
        if self.connections >= MAX_CONNECTIONS:
            await stream.aclose()
            return
        self.connections += 1
        try:
            async with stream:
                pending = b""
                while True:
                    h = h11.Connection(h11.SERVER)
                    if pending:
                        h.receive_data(pending)
                    got = await self._read_request(stream, h)
                    if got is None:
                        return
                    req, body = got
                    pending = h.trailing_data[0]
                    keep = await self._answer(stream, req, body)
                    if not keep:
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, OSError, _Drained):
            return
        except Exception:  # one peer's request must never take the envlet's loop down
            log.exception("peer connection from %s failed", _peer_of(stream))
        finally:
            self.connections -= 1

    async def _read_request(self, stream: trio.SocketStream, h: h11.Connection) -> tuple[h11.Request, bytes] | None:
        req = None
        body = bytearray()
        limit = 64 + MAX_ITEMS * ITEM.size
        deadline = trio.current_time() + IDLE_S
        while True:
            ev = h.next_event()
            if ev is h11.NEED_DATA:
                with trio.move_on_at(deadline if req is None else min(deadline, trio.current_time() + REQUEST_S)):
                    data = await stream.receive_some(1 << 16)
                    h.receive_data(data)
                    if not data:
                        return None
                    continue
                return None  # idle or too slow
            if isinstance(ev, h11.Request):
                req = ev
            elif isinstance(ev, h11.Data):
                body += ev.data
                if len(body) > limit:
                    await stream.send_all(_head(413, "Content Too Large", 0, "Connection: close\r\n"))
                    return None
            elif isinstance(ev, h11.EndOfMessage):
                return req, bytes(body)  # type: ignore[return-value]
            else:
                return None

    async def _error(self, stream: trio.SocketStream, status: int, reason: str, text: str, extra: str = "") -> None:
        data = text.encode()
        await stream.send_all(_head(status, reason, len(data), "Content-Type: text/plain\r\n" + extra) + data)

    async def _answer(self, stream: trio.SocketStream, req: h11.Request, body: bytes) -> bool:
        """Answer one request; False: close the connection."""
        headers = {k.lower(): v for k, v in req.headers}
        if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
            self.metrics.inc("peer_refused")
            log.warning("peer request from %s refused: missing or wrong cluster token", _peer_of(stream))
            await self._error(stream, 401, "Unauthorized", "the cluster token is missing or wrong\n",
                              'WWW-Authenticate: Bearer realm="weenv-peer"\r\n')
            return True
        if req.target.split(b"?")[0] != PATH.encode() or req.method != b"POST":
            await self._error(stream, 404, "Not Found", f"only POST {PATH} is served here\n")
            return True
        if not self.serving:
            self.metrics.inc("peer_drained")
            await self._error(stream, 503, "Service Unavailable", "this node is drained: not serving peers\n",
                              "Retry-After: 30\r\n")
            return True
        try:
            items = self._parse(body)
        except _BadRequest as e:
            await self._error(stream, e.status, "Bad Request", f"{e}\n")
            return True
        self.metrics.inc("peer_served_requests")
        answers = self._resolve(items)
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing and self.options.fetch_for_peers and headers.get(b"x-weenv-fetch") == b"1":
            m = self._layer(headers.get(b"x-weenv-layer", b"").decode(errors="replace"))
            if m is not None:
                await stream.send_all(b"HTTP/1.1 102 Processing\r\n\r\n")
                asker = headers.get(b"x-weenv-from", b"").decode(errors="replace")
                await self._fetch_for_peer(m, items, missing, answers, asker)
        parts = []
        total = 0
        for (_, _, _, ulen, rstart, rlen), a in zip(items, answers):
            if a is None:
                parts.append(None)
                total += ITEM_HEAD.size
                continue
            n = (ulen - rstart) if rlen == 0 else min(rlen, ulen - rstart)
            parts.append((a, rstart, n))
            total += ITEM_HEAD.size + n
        async with self._slots:
            self.active += 1
            try:
                # the head and the item counts before an item's bytes go out in one send, not a
                # packet each (MSG_MORE would merge them with the bytes, but sendfile after it stalls)
                pend = bytearray(_head(200, "OK", total, "Content-Type: application/octet-stream\r\n"))
                sent = 0
                for p in parts:
                    if p is None:
                        pend += ITEM_HEAD.pack(-1)
                        continue
                    a, start, n = p
                    pend += ITEM_HEAD.pack(n)
                    await stream.send_all(pend)
                    pend.clear()
                    if isinstance(a, bytes):
                        await self._send_bytes(stream, memoryview(a)[start : start + n])
                    else:
                        holder, fd, offset, _ = a
                        await self._send_file(stream, fd, offset + start, n)
                    sent += n
                    self.metrics.inc("peer_served_chunks")
                if pend:
                    await stream.send_all(pend)
                self.metrics.inc("peer_served_bytes", sent)
            finally:
                self.active -= 1
        return True

    def _parse(self, body: bytes) -> list[tuple[bytes, int, int, int, int, int]]:
        if not body or len(body) % ITEM.size:
            raise _BadRequest(400, f"the body is {len(body)} bytes: give 1 to {MAX_ITEMS} items of {ITEM.size}")
        items = list(ITEM.iter_unpack(body))
        if len(items) > MAX_ITEMS:
            raise _BadRequest(400, f"{len(items)} items: at most {MAX_ITEMS} a request")
        for i, (_, _, _, ulen, rstart, rlen) in enumerate(items):
            if rstart > ulen or rstart + rlen > ulen:
                raise _BadRequest(400, f"item {i}: range {rstart}+{rlen} outside the chunk's {ulen} bytes")
        return items

    def _resolve(self, items: list) -> list[Any]:
        """Per item: a disk record (holder, fd, offset, length), bytes from memory, or None."""
        l1, l2 = self.envlet.l1, self.envlet.l2
        out: list[Any] = []
        for digest, _, _, ulen, _, _ in items:
            rec = l2.record(digest) if l2 is not None else None
            if rec is not None and rec[3] == ulen:
                out.append(rec)
                continue
            data = l1.get(digest) if l1 is not None else None
            out.append(data if data is not None and len(data) == ulen else None)
        return out

    def _layer(self, digest: str) -> Any:
        if not digest.startswith("sha256:"):
            return None
        m = self.envlet.by_name.get(digest[7:19])
        return m if m is not None and m.digest == digest else None

    async def _fetch_for_peer(self, m: Any, items: list, missing: list[int], answers: list[Any], asker: str) -> None:
        chunks = []
        for i in missing:
            digest, off, clen, ulen, _, _ = items[i]
            if off + clen > m.size:
                continue
            chunks.append((i, Chunk(off, clen, 0, ulen, digest)))
        if not chunks:
            return
        # the asker holds none of these: our fetcher does not ask it back (ContextVar: seen by the
        # peer tier in the fetcher's worker threads)
        not_asking = NOT_ASKING.set(frozenset([asker]) if asker else frozenset())
        try:
            with trio.move_on_after(self.options.fetch_timeout_s):
                got = await self.envlet.fetcher.get(m.source, [c for _, c in chunks], "(for a peer)", own=False)
                for (i, _), data in zip(chunks, got):
                    answers[i] = data
                self.metrics.inc("peer_served_fetches", len(chunks))
        except (FetchError, ChunkIntegrityError) as e:
            log.info("layer %s: fetching %d chunks for a peer failed: %s", m.name, len(chunks), e)
        finally:
            NOT_ASKING.reset(not_asking)

    # ------------------------------------------------------------------ sending, bounded

    async def _piece(self, send: Any, n: int) -> int:
        if not self.serving:
            raise _Drained()
        await self._bucket.take(n)
        fetcher = self.envlet.fetcher
        if fetcher.serving_yields:  # our own reads wait (on disk, registry): they go first, then one piece
            async with self._lowprio:
                with trio.move_on_after(YIELD_S):
                    await fetcher.own_waits_done()
                return await send()
        return await send()

    async def _send_bytes(self, stream: trio.SocketStream, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            n = min(PIECE, len(view) - pos)

            async def send(a: int = pos, b: int = pos + n) -> int:
                await stream.send_all(view[a:b])
                return b - a

            pos += await self._piece(send, n)

    async def _send_file(self, stream: trio.SocketStream, fd: int, offset: int, n: int) -> None:
        sock = stream.socket
        out_fd = sock.fileno()
        end = offset + n
        while offset < end:
            want = min(PIECE, end - offset)

            async def send(at: int = offset, k: int = want) -> int:
                while True:
                    try:
                        sent = await trio.to_thread.run_sync(os.sendfile, out_fd, fd, at, k)
                    except BlockingIOError:
                        await trio.lowlevel.wait_writable(out_fd)
                        continue
                    if sent == 0:
                        raise OSError(f"pack file ends before offset {at}")
                    if sent < k:
                        self._bucket.give_back(k - sent)
                    return sent

            offset += await self._piece(send, want)


def _peer_of(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
