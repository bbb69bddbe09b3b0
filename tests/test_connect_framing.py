"""weenv/api/_connect.py: Connect's envelopes, end-of-stream message and error codes, without I/O."""

from __future__ import annotations

import json
import struct

import pytest

from weenv.api._connect import (END_STREAM, Code, ConnectError, EnvelopeReader, FramingError, HTTP_STATUS,
                                code_for_http_status, end_stream, envelope, error_body)

# The Connect protocol's table (connectrpc.com/docs/protocol#error-codes), written out here on its own.
SPEC = [
    ("canceled", 499), ("unknown", 500), ("invalid_argument", 400), ("deadline_exceeded", 504),
    ("not_found", 404), ("already_exists", 409), ("permission_denied", 403), ("resource_exhausted", 429),
    ("failed_precondition", 400), ("aborted", 409), ("out_of_range", 400), ("unimplemented", 501),
    ("internal", 500), ("unavailable", 503), ("data_loss", 500), ("unauthenticated", 401),
]


@pytest.mark.parametrize(("wire", "status"), SPEC)
def test_code_to_http_status(wire: str, status: int) -> None:
    code = Code(wire)
    assert HTTP_STATUS[code] == status
    err = ConnectError(code, "why")
    assert err.http_status == status
    assert json.loads(error_body(code, "why")) == {"code": wire, "message": "why"}


def test_every_code_has_a_row() -> None:
    assert {c.value for c in Code} == {w for w, _ in SPEC} == {c.value for c in HTTP_STATUS}


@pytest.mark.parametrize(("status", "wire"), [(400, "invalid_argument"), (401, "unauthenticated"),
                                              (403, "permission_denied"), (404, "not_found"),
                                              (409, "already_exists"), (429, "resource_exhausted"),
                                              (501, "unimplemented"), (502, "unavailable"), (503, "unavailable"),
                                              (504, "deadline_exceeded"), (500, "internal"), (418, "unknown")])
def test_code_for_http_status(status: int, wire: str) -> None:
    assert code_for_http_status(status).value == wire


def test_envelope_layout() -> None:
    assert envelope(b'{"a":1}') == b"\x00\x00\x00\x00\x07" + b'{"a":1}'
    assert envelope(b"", END_STREAM) == b"\x02\x00\x00\x00\x00"


def test_reader_takes_any_chunking() -> None:
    stream = envelope(b'{"x":1}') + envelope(b"{}") + end_stream()
    for size in (1, 2, 3, 7, len(stream)):
        reader = EnvelopeReader()
        got = []
        for i in range(0, len(stream), size):
            got.extend(reader.feed(stream[i:i + size]))
        reader.close()
        assert got == [(0, b'{"x":1}'), (0, b"{}"), (END_STREAM, b"{}")]


def test_reader_checks_the_size_before_buffering() -> None:
    reader = EnvelopeReader(max_message_bytes=10)
    with pytest.raises(FramingError, match="11 bytes is larger than the limit of 10"):
        list(reader.feed(struct.pack(">BI", 0, 11)))  # the header alone is refused


def test_reader_refuses_compressed_and_truncated() -> None:
    with pytest.raises(FramingError, match="compressed"):
        list(EnvelopeReader().feed(b"\x01\x00\x00\x00\x01x"))
    reader = EnvelopeReader()
    assert list(reader.feed(envelope(b"abc")[:-1])) == []
    with pytest.raises(FramingError, match="inside an envelope"):
        reader.close()


def test_end_stream_carries_error_and_trailers() -> None:
    frame = end_stream(ConnectError(Code.NOT_FOUND, "no such file"), {"x-trailer": ["1"]})
    flags, length = struct.unpack(">BI", frame[:5])
    assert flags == END_STREAM and length == len(frame) - 5
    assert json.loads(frame[5:]) == {"error": {"code": "not_found", "message": "no such file"},
                                     "metadata": {"x-trailer": ["1"]}}
    assert json.loads(end_stream()[5:]) == {}


def test_sdk_reads_our_frames() -> None:
    """connectrpc (the SDK's own Connect implementation) parses what we write."""
    pytest.importorskip("connectrpc")
    from connectrpc._envelope import EnvelopeReader as TheirReader  # type: ignore[import-not-found]
    from e2b.envd.client_shared import ENVD_JSON_CODEC
    from e2b.envd.filesystem import filesystem_pb

    reader = TheirReader(filesystem_pb.WatchDirResponse, ENVD_JSON_CODEC, None, 1 << 20)
    msgs = list(reader.feed(envelope(b'{"filesystem":{"name":"a","type":"EVENT_TYPE_CREATE"}}')))
    assert msgs[0].event.field == "filesystem" and msgs[0].event.value.name == "a"
