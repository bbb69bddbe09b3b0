"""Connect RPC (connectrpc.com/docs/protocol) framing and errors, without I/O.

Only what envd's clients speak: the JSON codec, unary calls (``application/json`` body in and
out, errors as a non-200 status with a Connect error body) and server streams
(``application/connect+json``: the request and every answer message is an *envelope*, a flags
byte and a 4-byte big-endian length before the JSON; the stream ends with an envelope flagged
:data:`END_STREAM` whose JSON carries the trailers and an optional error, so a stream error rides
on HTTP 200).

The ASGI glue (weenv/api/_envd.py) feeds request chunks to :class:`EnvelopeReader` and writes
what :func:`envelope` and :func:`end_stream` return.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator
from typing import Any

import msgspec

__all__ = ["END_STREAM", "COMPRESSED", "Code", "ConnectError", "EnvelopeReader", "FramingError", "HTTP_STATUS",
           "code_for_http_status", "end_stream", "envelope", "error_body", "UNARY_CONTENT_TYPE",
           "STREAM_CONTENT_TYPE"]

UNARY_CONTENT_TYPE = "application/json"
STREAM_CONTENT_TYPE = "application/connect+json"
COMPRESSED = 0x01
END_STREAM = 0x02
_HEADER = struct.Struct(">BI")


class Code(str, enum.Enum):
    """Connect error codes, as they are spelt on the wire."""

    CANCELED = "canceled"
    UNKNOWN = "unknown"
    INVALID_ARGUMENT = "invalid_argument"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    ABORTED = "aborted"
    OUT_OF_RANGE = "out_of_range"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data_loss"
    UNAUTHENTICATED = "unauthenticated"


HTTP_STATUS: dict[Code, int] = {
    Code.CANCELED: 499,
    Code.UNKNOWN: 500,
    Code.INVALID_ARGUMENT: 400,
    Code.DEADLINE_EXCEEDED: 504,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.FAILED_PRECONDITION: 400,
    Code.ABORTED: 409,
    Code.OUT_OF_RANGE: 400,
    Code.UNIMPLEMENTED: 501,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.DATA_LOSS: 500,
    Code.UNAUTHENTICATED: 401,
}
"""The HTTP status of a unary error answer, per code (the Connect spec's table)."""

_FROM_HTTP: dict[int, Code] = {400: Code.INVALID_ARGUMENT, 401: Code.UNAUTHENTICATED, 403: Code.PERMISSION_DENIED,
                               404: Code.NOT_FOUND, 408: Code.DEADLINE_EXCEEDED, 409: Code.ALREADY_EXISTS,
                               412: Code.FAILED_PRECONDITION, 413: Code.RESOURCE_EXHAUSTED,
                               429: Code.RESOURCE_EXHAUSTED, 499: Code.CANCELED, 501: Code.UNIMPLEMENTED,
                               502: Code.UNAVAILABLE, 503: Code.UNAVAILABLE, 504: Code.DEADLINE_EXCEEDED}


def code_for_http_status(status: int) -> Code:
    """The code for an HTTP error status from elsewhere (the daemon's answers): the spec's inverse table."""
    return _FROM_HTTP.get(status, Code.INTERNAL if status >= 500 else Code.UNKNOWN)


class ConnectError(Exception):
    """An RPC failed with ``code``; the message goes to the client as it is."""

    def __init__(self, code: Code, message: str):
        super().__init__(f"{code.value}: {message}")
        self.code, self.message = code, message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]


class FramingError(ValueError):
    """The request stream is not a sequence of envelopes (or one is larger than allowed)."""


def error_body(code: Code, message: str) -> bytes:
    """The JSON of a unary error answer (and of the ``error`` member of an end-of-stream message)."""
    return msgspec.json.encode({"code": code.value, "message": message})


def envelope(data: bytes, flags: int = 0) -> bytes:
    """One message on a stream: flags byte, 4-byte big-endian length, the bytes."""
    if len(data) > 0xFFFFFFFF:
        raise FramingError(f"a message of {len(data)} bytes does not fit an envelope")
    return _HEADER.pack(flags, len(data)) + data


def end_stream(error: ConnectError | None = None, metadata: dict[str, list[str]] | None = None) -> bytes:
    """The last envelope of a server stream: trailers, and the error if the call failed."""
    body: dict[str, Any] = {}
    if error is not None:
        body["error"] = {"code": error.code.value, "message": error.message}
    if metadata:
        body["metadata"] = metadata
    return envelope(msgspec.json.encode(body), END_STREAM)


class EnvelopeReader:
    """Fed chunks as they arrive, yields ``(flags, message)`` for each whole envelope.

    The declared length is checked against ``max_message_bytes`` as soon as a header is whole,
    before buffering the message; compressed envelopes are refused (weenv never offers compression).
    """

    def __init__(self, max_message_bytes: int = 4 << 20):
        self.max_message_bytes = max_message_bytes
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes]]:
        self._buf += chunk
        while len(self._buf) >= _HEADER.size:
            flags, length = _HEADER.unpack_from(self._buf)
            if length > self.max_message_bytes:
                raise FramingError(f"envelope of {length} bytes is larger than the limit of "
                                   f"{self.max_message_bytes} bytes")
            if flags & COMPRESSED:
                raise FramingError("compressed envelope: compression was not negotiated")
            if len(self._buf) < _HEADER.size + length:
                return
            message = bytes(self._buf[_HEADER.size:_HEADER.size + length])
            del self._buf[:_HEADER.size + length]
            yield flags, message

    def close(self) -> None:
        """The request ended: raise if it ended inside an envelope."""
        if self._buf:
            raise FramingError(f"the stream ended inside an envelope ({len(self._buf)} bytes left over)")
