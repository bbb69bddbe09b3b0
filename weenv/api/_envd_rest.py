"""envd's REST side: ``GET /health``, ``GET /files`` (the file, streamed) and ``POST /files``
(octet-stream, or multipart with one part per file: both streamed to the env's disk as they
arrive, nothing spooled on the host). Bodies may be gzip both ways (``Content-Encoding: gzip``
uploads; ``Accept-Encoding: gzip`` downloads), compressed and decompressed as they stream."""

from __future__ import annotations

import posixpath
import re
import zlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .._connection import ApiError as DaemonError
from .._connection import DaemonUnavailableError
from .._wire import KIND_STATUS
from ._common import HttpError, daemon_errors, relay, state_of
from ._envd_view import E2B_XATTRS, EnvView, in_env_mounts

# -- REST ---------------------------------------------------------------------------------------


def _rest_user(request: Request) -> str | None:
    return request.query_params.get("username") or None


def _rest_error(e: DaemonError) -> HttpError:
    """A daemon error as envd's REST answers it: a sandbox that is gone or not running is E2B's 502
    (the SDK's SandboxNotRunning), the rest by their kind's status."""
    if e.kind in ("env_not_found", "wrong_state"):
        return HttpError(502, "env_not_running", f"The sandbox was not found or is not running: {e.detail}")
    if e.kind in KIND_STATUS:
        return HttpError.of(e.kind, e.detail)
    return HttpError(e.status, e.kind, e.detail)


async def health(request: Request) -> Response:
    state, env_id = state_of(request), request.scope["weenv.env"]
    try:
        async with daemon_errors():
            info = await state.backend.for_env(env_id).env(env_id).refresh()
    except HttpError as e:
        if e.status == 404:
            raise HttpError(502, "env_not_running", f"The sandbox {env_id} was not found") from None
        raise
    if info.status != "running":
        raise HttpError(502, "env_not_running", f"The sandbox {env_id} was not found (it is {info.status})")
    return Response(b"", 204)


async def files_get(request: Request) -> Response:
    path = request.query_params.get("path")
    if not path:
        raise HttpError(400, "bad_request", "path is required")
    view = EnvView(state_of(request), request.scope["weenv.env"], _rest_user(request))
    path = await _rest_path(view, path)
    if in_env_mounts(path):  # /proc and the like: in the env's mount namespace
        try:
            data = await view.read_mounted(path)
        except DaemonError as e:
            raise _rest_error(e) from None
        headers = {"Content-Disposition": f'attachment; filename="{posixpath.basename(path)}"'}
        return Response(data, 200, media_type="application/octet-stream", headers=headers)
    params = {"path": path, **({"user": view.user} if view.user else {})}
    try:
        resp = await view.client.send_route("files_get", {"id": view.env_id}, query=params)
    except DaemonUnavailableError:
        raise HttpError(503, "daemon_unavailable", "the node's weenv daemon does not answer") from None
    if resp.status_code >= 400:
        await resp.aread()
        await resp.aclose()
        try:
            err = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = {"kind": "error", "message": resp.text}
        raise _rest_error(DaemonError(resp.status_code, err.get("kind", "error"), err.get("message", "")))
    name = posixpath.basename(path)
    headers = {"Content-Disposition": f'attachment; filename="{name}"'}
    body = relay(resp)
    if _asks_for_gzip(request):
        headers["Content-Encoding"] = "gzip"
        body = _gzipped(body)
    return StreamingResponse(body, 200, media_type="application/octet-stream", headers=headers)


GZIP_LEVEL = 1  # fast: a download is compressed as it streams, on the API server's CPU
MAX_INFLATE_PIECE = 1 << 20


def _asks_for_gzip(request: Request) -> bool:
    """Whether the client chose gzip: ``Accept-Encoding: gzip`` alone, what the SDK's ``gzip=True``
    sends. An HTTP client's default list (httpx: ``gzip, deflate``) gets the file as it is, so
    downloads nobody asked to compress cost no CPU."""
    return request.headers.get("accept-encoding", "").strip().lower() == "gzip"


async def _gzipped(source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    comp = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    async for chunk in source:
        if out := comp.compress(chunk):
            yield out
    yield comp.flush()


async def _inflated(source: AsyncIterator[bytes], where: str) -> AsyncIterator[bytes]:
    """A gzip request body as it arrives, decompressed in pieces of at most 1 MiB whatever the
    ratio (a small body of zeros stays a bounded buffer here; the env's disk limit bounds the rest).
    Members one after another, zero padding between them, as gzip(1) allows."""
    d = zlib.decompressobj(31)
    try:
        async for data in source:
            while data:
                if d.eof:  # the next member
                    data = data.lstrip(b"\0")
                    if not data:
                        break
                    d = zlib.decompressobj(31)
                out = d.decompress(data, MAX_INFLATE_PIECE)
                data = d.unused_data if d.eof else d.unconsumed_tail
                if out:
                    yield out
                while not data and not d.eof and len(out) == MAX_INFLATE_PIECE:  # zlib may hold more
                    out = d.decompress(b"", MAX_INFLATE_PIECE)
                    data = d.unused_data if d.eof else d.unconsumed_tail
                    if out:
                        yield out
    except zlib.error as e:
        raise HttpError(400, "bad_request", f"{where}: the gzip body does not decompress ({e})") from None
    if not d.eof:
        raise HttpError(400, "bad_request", f"{where}: the gzip body ends inside its stream")


async def _rest_path(view: EnvView, path: str) -> str:
    """A request's path as the absolute path it names (relative: the acting user's home's)."""
    from ._connect import ConnectError

    try:
        return await view.path(path)
    except ConnectError as e:
        raise HttpError(400, "bad_request", e.message) from None
    except DaemonError as e:
        raise _rest_error(e) from None


METADATA_PREFIX = "x-metadata-"
_METADATA_KEY = re.compile(r"\A[a-z0-9!#$%&'*+\-.^_`|~]{1,200}\Z")
_METADATA_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")


def upload_metadata(request: Request) -> dict[str, str] | None:
    """E2B's file metadata (envd 0.6.2): ``X-Metadata-KEY: value`` headers, keys lower-cased, set on
    every file of the upload as ``user.KEY`` extended attributes; a 400 naming a bad one."""
    out = {}
    for name, value in request.headers.items():  # Starlette's header names are lower-case
        if not name.startswith(METADATA_PREFIX):
            continue
        key = name[len(METADATA_PREFIX):]
        if not _METADATA_KEY.match(key) or not _METADATA_VALUE.match(value):
            raise HttpError(400, "bad_request", f"header X-Metadata-{key[:60]}: keys are HTTP tokens, values "
                            "printable US-ASCII")
        out[key] = value
    if sum(len(k) + len(v) for k, v in out.items()) > 32 << 10:
        raise HttpError(400, "bad_request", "X-Metadata-* headers: more than 32 KiB of file metadata")
    return out or None


async def _put(view: EnvView, path: str, content: Any, metadata: dict[str, str] | None = None) -> dict[str, Any]:
    try:
        path = await _rest_path(view, path)
        if in_env_mounts(path):
            raise HttpError(400, "bad_request", f"{path}: the env mounts it itself (read-only, or a kernel "
                            "file): write it from a command in the env")
        # made without a user: the env's default user's, as in E2B
        await view.env.write_file(path, content, user=await view.acting_user(),
                                  xattrs={E2B_XATTRS + k: v for k, v in metadata.items()} if metadata else None)
    except DaemonError as e:
        raise _rest_error(e) from None
    except DaemonUnavailableError:
        raise HttpError(503, "daemon_unavailable", "the node's weenv daemon does not answer") from None
    return {"name": posixpath.basename(path), "type": "file", "path": path, **({"metadata": metadata} if metadata else {})}


async def files_post(request: Request) -> Response:
    view = EnvView(state_of(request), request.scope["weenv.env"], _rest_user(request))
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    path = request.query_params.get("path")
    encoding = request.headers.get("content-encoding", "identity").strip().lower() or "identity"
    if encoding not in ("identity", "gzip"):
        raise HttpError(415, "unsupported_media", f"Content-Encoding {encoding!r}: uploads are plain or gzip")
    body: AsyncIterator[bytes] = request.stream()
    if encoding == "gzip":
        body = _inflated(body, "upload")
    if ctype == "multipart/form-data":
        return Response(msgspec.json.encode(await _multipart_upload(view, request, path, body)), 200,
                        media_type="application/json")
    if not path:
        raise HttpError(400, "bad_request", "path is required for an octet-stream upload")
    try:
        written = await _put(view, path, _pump(body), upload_metadata(request))
    except HttpError:
        await _drain_body(body)
        raise
    return Response(msgspec.json.encode([written]), 200, media_type="application/json")


MAX_UPLOAD_PARTS = 1000
DRAIN_S = 60.0


async def _pump(source: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``source`` as another iterator: the daemon call may close this one, ``source`` stays readable."""
    async for item in source:
        yield item


async def _drain_body(source: AsyncIterator[Any]) -> None:
    """Read and drop the rest of a request body the env refused (its disk is full, say): a client
    sends its whole body before it reads the answer, so it would never see the error otherwise.
    Nothing is kept; bounded in time (then the connection closes)."""
    with anyio.move_on_after(DRAIN_S):
        async for _ in source:
            pass


async def _multipart_events(body: AsyncIterator[bytes], boundary: bytes) -> AsyncIterator[tuple[str, Any]]:
    """A multipart body as it arrives: ``("file", filename)`` at each part's start, then its
    ``("data", bytes)``, then ``("end", None)``. Parsed by python-multipart's streaming parser, so
    nothing of the body is kept: each piece goes on to the env's disk before the next is read."""
    from python_multipart import MultipartParser
    from python_multipart.exceptions import MultipartParseError
    from python_multipart.multipart import parse_options_header

    pending: list[tuple[str, Any]] = []
    field, value, headers = bytearray(), bytearray(), {}

    def header_end() -> None:
        headers[bytes(field).lower()] = bytes(value)
        field.clear()
        value.clear()

    def headers_done() -> None:
        _, options = parse_options_header(headers.get(b"content-disposition", b""))
        name = options.get(b"filename")
        pending.append(("file", name.decode("utf-8", "replace") if name is not None else None))
        headers.clear()

    parser = MultipartParser(boundary, {
        "on_header_field": lambda d, a, b: field.extend(d[a:b]),
        "on_header_value": lambda d, a, b: value.extend(d[a:b]),
        "on_header_end": header_end,
        "on_headers_finished": headers_done,
        "on_part_data": lambda d, a, b: pending.append(("data", bytes(d[a:b]))),
        "on_part_end": lambda: pending.append(("end", None)),
    })
    try:
        async for chunk in body:
            parser.write(chunk)
            while pending:
                yield pending.pop(0)
        parser.finalize()
    except MultipartParseError as e:
        raise HttpError(400, "bad_request", f"multipart upload: {e}") from None
    while pending:
        yield pending.pop(0)


async def _multipart_upload(view: EnvView, request: Request, path: str | None,
                            body: AsyncIterator[bytes]) -> list[dict[str, Any]]:
    """Each file part of a multipart upload, streamed to its path in the env as it arrives
    (``?path=`` names the single part's path; else its filename does)."""
    from python_multipart.multipart import parse_options_header

    _, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if not boundary:
        raise HttpError(400, "bad_request", "multipart upload without a boundary in its Content-Type")
    events = _multipart_events(body, boundary)
    written: list[dict[str, Any]] = []
    parts = 0

    async def data() -> AsyncIterator[bytes]:
        async for kind, piece in events:  # the same iterator, on to this part's end
            if kind == "end":
                return
            if kind == "data":
                yield piece

    async for kind, filename in events:
        if kind != "file":
            continue
        parts += 1
        if parts > MAX_UPLOAD_PARTS:
            raise HttpError(400, "bad_request", f"multipart upload of more than {MAX_UPLOAD_PARTS} parts")
        if filename is None and not path:
            async for _ in data():  # a form field, not a file: nothing to write
                pass
            continue
        if path and written:
            raise HttpError(400, "bad_request", "?path= names the path of a single-file upload; a second part "
                            "came (send no ?path=: each part's filename is its path)")
        target = path or filename
        if not target:
            raise HttpError(400, "bad_request", "a file part without a filename (its path) and no ?path=")
        try:
            written.append(await _put(view, target, data(), upload_metadata(request)))
        except HttpError:
            await _drain_body(events)
            raise
    if not written:
        raise HttpError(400, "bad_request", "multipart upload without a file part")
    return written
